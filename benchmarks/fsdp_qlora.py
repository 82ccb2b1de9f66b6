"""FSDP2 with the 4-bit base sharded: per-rank bytes of the base on 1, 2 and 4 gloo ranks.

    python benchmarks/fsdp_qlora.py [--layers 8] [--hidden 256] [--ranks 2 4]

Runs :mod:`tightfit.distributed.qlora_check` (NF4 + double quant, LoRA r=4, paged AdamW,
``every`` checkpoint plan, chunked loss) on a Llama-architecture model written as safetensors:
once in one process (``tightfit.prepare``: the whole base on the one process), then under
``torchrun`` on each rank count (loaded shard by shard: meta first, each rank keeps its rows
of every layer's codes, absmax and nested absmax). Per rank it reads the base bytes held, the
most base bytes gathered at once (forward, recompute, backward), and the largest block's base;
it checks held = whole / N within 5 % and held + gathered <= whole / N * 1.05 + one block, and
compares the loss trajectory with the one-process run. Writes ``results/fsdp_qlora.md``.
Memory figures are byte counts of tensors, not timings: the load of the shared machine does
not change them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from environment import cpu_model, git_commit, load_text, versions_text

from tightfit.distributed.launch import run_torchrun

HERE = Path(__file__).parent
KIB = 1024


def _check(out: Path, model: Path, args: argparse.Namespace, nproc: int | None,
           offload: bool = False) -> dict:
    flags = ["--out", str(out), "--model", str(model), "--layers", str(args.layers),
             "--hidden", str(args.hidden), "--steps", str(args.steps), "--device", args.device,
             "--batch", "4", "--save-at", "1", *(["--fsdp-offload"] if offload else [])]  # fmt: skip
    target = ["tightfit.distributed.qlora_check", *flags]
    if nproc is None:
        res = subprocess.run([sys.executable, "-m", *target], capture_output=True, text=True,
                             timeout=args.timeout)  # fmt: skip
    else:
        res = run_torchrun(target, nproc, timeout_s=args.timeout, module=True)
    if res.returncode != 0:
        raise SystemExit(f"qlora_check on {nproc or 1} process(es) failed:\n{res.stderr[-3000:]}")
    return json.loads((out / "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, a GPU a rank)")
    parser.add_argument("--out", default=str(HERE / "results" / "fsdp_qlora.md"))
    parser.add_argument("--tol", type=float, default=1e-5, help="largest loss difference")
    parser.add_argument("--fsdp-offload", action="store_true",
                        help="run each rank count again with the shards on the host "
                             "(FSDP2's CPUOffloadPolicy, tightfit train --fsdp-offload)")
    args = parser.parse_args()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        one = _check(root / "one", root / "model", args, None)  # writes the model first
        layouts = [(n, off) for n in args.ranks for off in (False, True)[: 1 + args.fsdp_offload]]
        runs = {(n, off): _check(root / f"w{n}{'o' * off}", root / "model", args, n, off)
                for n, off in layouts}  # fmt: skip
    load1 = os.getloadavg()
    rows, ok = [], True
    for (n, off), res in runs.items():
        loss_diff = max(abs(a - b) for a, b in zip(one["losses"], res["losses"]))
        for rank, r in enumerate(res["ranks"]):
            ideal = r["whole"] / n
            held_ok = abs(r["held"] - ideal) <= 0.05 * ideal
            peak = r["held"] + r["gathered_peak"]
            peak_ok = peak <= 1.05 * ideal + r["block"]
            ok &= held_ok and peak_ok and loss_diff <= args.tol
            rows.append(f"| {n} | {rank} | {r['whole'] / KIB:.1f} | {r['held'] / KIB:.1f} | "
                        f"{r['held'] / r['whole']:.4f} (1/{n} = {1 / n:.4f}) | "
                        f"{r['gathered_peak'] / KIB:.1f} | {r['block'] / KIB:.1f} | "
                        f"{peak / KIB:.1f} | {(1.05 * ideal + r['block']) / KIB:.1f} | "
                        f"{loss_diff:.1e} | {'yes' if held_ok and peak_ok else 'NO'} | "
                        f"{'yes' if r.get('shards_on_host') else 'no'} |")
            ok &= r.get("shards_on_host", False) == off
    text = f"""# FSDP2 with the 4-bit base sharded: per-rank bytes of the base

`python benchmarks/fsdp_qlora.py --layers {args.layers} --hidden {args.hidden} --steps {args.steps} --ranks {' '.join(map(str, args.ranks))}{' --fsdp-offload' if args.fsdp_offload else ''}`

Llama architecture, {args.layers} layers, hidden {args.hidden}, NF4 + double quant (blocksize 64),
LoRA r=4 on every linear, paged AdamW, `every` checkpoint plan, chunked loss, {args.steps} steps
on 4 global rows of 16 tokens; device {args.device} ({'gloo' if args.device == 'cpu' else 'NCCL'}). One process: `tightfit.prepare` (the whole
base in the process). N ranks: loaded shard by shard (meta, then each rank's rows of every
layer's codes, absmax and nested absmax from the safetensors), gathered a block at a time by
FSDP2. *held*: the base bytes a rank keeps (its shards); *gathered peak*: the most base bytes
gathered at once, read at every 4-bit layer's forward, recompute and backward; *block*: the
largest decoder layer's base; *peak* = held + gathered peak, against the bound
whole/N x 1.05 + one block. *loss diff*: largest difference of a step's loss to the
one-process run. *shards on host*: every FSDP2 parameter keeps its shard on the host
(`--fsdp-offload`, FSDP2's `CPUOffloadPolicy`; on the CPU the host is the device, so these
rows show the policy in place and the same bytes and losses, not a device saving). Byte
counts of tensors, exact; not timings.

| ranks | rank | whole base KiB | held KiB | held / whole | gathered peak KiB | block KiB | peak KiB | bound KiB | loss diff | within | shards on host |
|---|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

All within: **{'yes' if ok else 'NO'}**. The all-gather's own output buffer (one block, FSDP2's,
freed once the block's parameters are copied out) and the next block prefetched (one more
block in flight while a block computes) are not in *gathered peak*: add up to two blocks for
the process's transient.

Machine: {cpu_model()}, {os.cpu_count()} cores shared with other work; load average
{load_text(load0)} before, {load_text(load1)} after. {versions_text()}. Commit {git_commit()}.
"""
    cuda = [(n, r.get("cuda_peak")) for (n, _), res in runs.items() for r in res["ranks"]]
    if any(peak for _, peak in cuda):
        text += "\nCUDA max_memory_allocated per rank (MiB): " + ", ".join(
            f"{n} ranks: {peak / 2**20:.1f}" for n, peak in cuda) + "\n"
    Path(args.out).write_text(text)
    print(text)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
