"""tightfit plan --gpus N: the planner's per-rank figures, and its per-rank base beside the
runtime's measured one.

    python benchmarks/plan_ranks.py

Runs ``tightfit.plan`` (what ``tightfit plan`` prints) for the issue's cases (Llama-3.3-70B
QLoRA r=16 at 2,048 tokens on 24 GiB GPUs; Llama-3.1-8B r=32 ``--max-seq`` on 24 GiB with
128 GiB of host RAM, one GPU and two), and predicts the per-rank 4-bit base (codes, absmax,
nested absmax) and one gathered block of ``benchmarks/fsdp_qlora.py``'s model, beside its
measured figures in ``results/fsdp_qlora.md`` (read, not rerun). Writes
``results/plan_ranks.md``. Predictions only (the memory model), no step is run: the
machine's load does not change them.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from environment import git_commit, versions_text

from tightfit.measure.sizes import format_bytes
from tightfit.planner.ladder import plan
from tightfit.planner.presets import load_shape
from tightfit.planner.ranks import rank_estimate, unit_bytes
from tightfit.planner.train_setup import TrainSetup

HERE = Path(__file__).parent
KIB = 1024
TINY = {"model_type": "llama", "vocab_size": 67, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "tie_word_embeddings": False}


def _measured() -> dict[int, tuple[float, float]]:
    """Rank 0's held and gathered-peak KiB per rank count, from results/fsdp_qlora.md."""
    out: dict[int, tuple[float, float]] = {}
    for line in (HERE / "results" / "fsdp_qlora.md").read_text().splitlines():
        m = re.match(r"\| (\d+) \| 0 \| ([\d.]+) \| ([\d.]+) \| [^|]+\| ([\d.]+) \|", line)
        if m:
            out[int(m[1])] = (float(m[3]), float(m[4]))
    return out


def _base_rows() -> list[str]:
    shape = load_shape(TINY)
    rows = []
    for ranks, (held, gathered) in sorted(_measured().items()):
        setup = TrainSetup(seq_len=16, batch_size=4 // ranks, lora_r=4)
        u = unit_bytes(shape, setup)
        norms = shape.traits.norms * shape.hidden * setup.d
        est = rank_estimate(shape, setup, None, ranks)
        non_base = (u.rotary + -(-u.head // ranks) + -(-u.embed // ranks)
                    + shape.layers * (-(-norms // ranks) + u.replicated))
        p_held = (est.weights + est.constants - non_base) / KIB
        p_block = (u.weights - norms + u.constants) / KIB
        rows.append(f"| {ranks} | {p_held:.1f} | {held:.1f} | {p_held / held - 1:+.2%} | "
                    f"{p_block:.1f} | {gathered:.1f} | {p_block / gathered - 1:+.2%} |")
    return rows


def _row_line(report, r, what: str = "") -> str:  # noqa: ANN001
    e = r.estimate
    fits = "yes" if r.fits else "tight" if r.tight else "NO" if not r.fits_device else "HOST"
    size = "" if r.maximum is None else f"{r.maximum:,} | "
    what = f" | {what}" if what else ""
    name = r.name + (" (`--fsdp-offload`)" if r.setup.fsdp_offload and not what else "")
    return (f"| {report.gpus} | #{report.rows.index(r) + 1} {name} | {size}"
            f"{format_bytes(e.total)} | {fits}{what} |")


def _pieces(e) -> str:  # noqa: ANN001
    text = ", ".join(f"{k} {format_bytes(v)}" for k, v in e.pieces().items() if v)
    start = getattr(e, "start_peak", 0)
    return text + (f"; at the embedding's gather {format_bytes(start)}" if start else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(HERE / "results" / "plan_ranks.md"))
    args = parser.parse_args()
    big = {n: plan("llama-3.3-70b", "24GiB", seq_len=2048, gpus=n, host_ram="128GiB")
           for n in (1, 2, 3)}  # fmt: skip
    small_host = plan("llama-3.3-70b", "24GiB", seq_len=2048, gpus=2, host_ram="16GiB")
    two32 = plan("llama-3.3-70b", "32GiB", seq_len=2048, gpus=2, host_ram="16GiB").recommended
    long = {n: plan("llama-3.1-8b", "24GiB", lora_r=32, maximize="seq", host_ram="128GiB",
                    gpus=n) for n in (1, 2)}
    lines70 = []
    for rep in big.values():
        best = rep.recommended
        smallest = min((r for r in rep.rows if r.estimate), key=lambda r: r.estimate.total)
        row = best or smallest
        lines70.append(_row_line(rep, row, ("recommended" if best else "smallest row")
                                 + ": " + _pieces(row.estimate)
                                 + ("; `--fsdp-offload`" if row.setup.fsdp_offload else "")))
    two = big[2].recommended
    fewest = small_host.fewest
    text = f"""# tightfit plan --gpus N: per-rank predictions

`python benchmarks/plan_ranks.py` (the memory model only: no step runs; the machine's load does
not change these figures). {versions_text()}. Commit {git_commit()}.

## The per-rank base, predicted beside measured

`benchmarks/fsdp_qlora.py`'s model (8 layers, hidden 256, NF4 + double quant, LoRA r=4, gloo
ranks; `results/fsdp_qlora.md`, rank 0, read not rerun): the 4-bit base's codes, absmax and
nested absmax a rank holds, and one block's (what one gather brings; the planner counts two
in flight, the measured *gathered peak* counts the one at the hooks).

| ranks | held, predicted KiB | held, measured KiB | error | block, predicted KiB | gathered peak, measured KiB | error |
|---|---|---|---|---|---|---|
{chr(10).join(_base_rows())}

## Llama-3.3-70B, QLoRA r=16, 2,048 tokens, 24 GiB GPUs (one sequence per GPU)

`tightfit plan --model llama-3.3-70b --gpu 24GiB --gpus N --seq-len 2048 --host-ram 128GiB`
(N = 1: no --gpus; 1 GPU streams the base's layers from the host, `--resident-layers`):

| GPUs | row | total per rank | fits | pieces (per rank) |
|---|---|---|---|---|
{chr(10).join(lines70)}

On **2 x 24 GiB** the shards on the GPU leave no room (every row without `--fsdp-offload`
needs more than the 22.6 GiB usable), so the long-context row keeps each rank's shards (the
4-bit base, constants, LoRA, grads: {format_bytes(two.estimate.host_weights) if two else '-'}) and
the optimizer step on the host with FSDP2's `CPUOffloadPolicy` (`tightfit train --fsdp
--fsdp-offload`): {format_bytes(two.estimate.total) if two else 'nothing fits'} a rank on the
GPU (most of it activations: the room the shards left buys a `budget` plan that stores
layers instead of recomputing every one), {format_bytes(two.estimate.host) if two else '-'} a rank of pinned host memory (its
2 ranks need {format_bytes(2 * two.estimate.host) if two else '-'} of the 64 GiB pinned of 128 GiB).
The per-rank host bytes are the *held* bytes measured above plus LoRA and grads: the same
shards, on the host (`results/fsdp_qlora.md`'s *shards on host* rows).

With a 16 GiB host (8 GiB pinned, too little for the shards), the fewest GPUs (the plan
without `--gpus` says it): **{fewest.gpus} x 24 GiB**
({fewest.row.name if fewest.row else '-'}). On 2 x 32 GiB with that host:
{'nothing fits' if two32 is None else f"#{big[2].rows.index(next(r for r in big[2].rows if r.name == two32.name)) + 1} {two32.name}, {format_bytes(two32.estimate.total)} per rank"}.

## Llama-3.1-8B, r=32, the longest sequence on 24 GiB, 128 GiB host RAM

`tightfit plan --model llama-3.1-8b --gpu 24GiB --lora-r 32 --max-seq --host-ram 128GiB`
without and with `--gpus 2` (2 GPUs: one sequence per GPU, the host's pinned budget shared):

| GPUs | row | longest sequence | total per rank | fits |
|---|---|---|---|---|
{chr(10).join(_row_line(rep, r) for rep in long.values() for r in rep.rows)}
"""
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
