"""The CUDA paths ``benchmarks/gpu_check.sh`` runs once each, a section a process.

Sections (``python benchmarks/gpu_sections.py SECTION --out FILE``):

* ``paged``: PagedAdamW resident, streamed (fused and foreach) and PagedAdamW8bit streamed:
  torch parity (8-bit: streamed equals resident) and the host syncs of each step after the
  first, counted with torch's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``);
* ``offload``: a small Llama's loss and gradients with every block checkpointed and its
  activations offloaded to pinned host memory and prefetched, against no checkpointing;
* ``oom_step``: an out-of-memory error injected into the fused AdamW kernel at step 2: the
  step is retried (streaming) and the params equal a run without it;
* ``oom_backward``: one injected into a backward of a ``tightfit train`` run (tiny Llama,
  QLoRA): the step is retried once and the adapter equals a run without it.

Each case is one JSON line appended to ``--out`` as soon as it is measured (a killed or
crashed section keeps what it wrote); the exit status is 1 when a case failed. A sticky CUDA
error ends only its own section's process. ``--emulate`` runs the same code on the CPU under
the strict CUDA emulation (``tests/tiers/strict_cuda.py``, smaller sizes): CI runs every
section that way (``tests/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import tightfit.checkpoint as ck  # noqa: E402
from tightfit.optim.adamw import PagedAdamW  # noqa: E402
from tightfit.optim.adamw8bit import PagedAdamW8bit  # noqa: E402

SYNC_BUDGET = 2  # host syncs a paged step may make (docs/optimizers.md)


class Section:
    """Where a section runs (device, sizes) and where its results go."""

    def __init__(self, out: Path, emulated: bool) -> None:
        self.out, self.emulated = out, emulated
        self.device = torch.device("cpu" if emulated else "cuda")
        self.failed = 0

    def big(self, cuda: int, cpu: int) -> int:
        return cpu if self.emulated else cuda

    def write(self, section: str, case: str, ok: bool, **fields: Any) -> None:
        """One result line, flushed at once."""
        self.failed += not ok
        line = {"section": section, "case": case, "ok": bool(ok),
                "device": "emulated" if self.emulated else torch.cuda.get_device_name(), **fields}
        with self.out.open("a") as f:
            f.write(json.dumps(line) + "\n")
        print(f"gpu_sections: {section} / {case}: {'ok' if ok else 'FAILED'} {fields}", flush=True)

    def case(self, section: str, case: str, fn: Callable[[], dict[str, Any]]) -> None:
        """Run one case; an error is its failure (written), not the section's end, unless
        it is a sticky CUDA error (the process's context is gone: stop here)."""
        t0 = time.perf_counter()
        try:
            fields = fn()
        except Exception as exc:  # noqa: BLE001 - every failure is a result line
            self.write(section, case, False, error=f"{type(exc).__name__}: {exc}"[:500],
                       seconds=round(time.perf_counter() - t0, 2))
            traceback.print_exc()
            if isinstance(exc, torch.AcceleratorError):
                raise
            return
        ok = fields.pop("ok")
        self.write(section, case, ok, seconds=round(time.perf_counter() - t0, 2), **fields)


def count_syncs(fn: Callable[[], object]) -> int:
    """Host syncs ``fn()`` makes, as torch's sync debug mode flags them (the emulation flags
    its own count the same way)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchronizing" in str(w.message) for w in seen)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# -- paged ---------------------------------------------------------------------------------
def _paged_run(sec: Section, cls: type, steps: int, **kw: Any) -> tuple[list, list[int], dict]:
    gen = torch.Generator(sec.device).manual_seed(0)
    sizes = [4097, sec.big(1_000_003, 30_000)]
    params = [torch.randn(n, device=sec.device, generator=gen) for n in sizes]
    page = sec.big(256 << 10, 16 << 10)
    opt = cls(params, lr=1e-2, weight_decay=0.1, page_bytes=page, **kw)
    syncs = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, device=sec.device, generator=gen)
        syncs.append(count_syncs(opt.step))
    torch.cuda.synchronize()
    stats = opt.memory_stats()
    opt.close()
    return params, syncs[1:], stats


def _torch_adamw(sec: Section, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator(sec.device).manual_seed(0)
    sizes = [4097, sec.big(1_000_003, 30_000)]
    params = [torch.randn(n, device=sec.device, generator=gen) for n in sizes]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, device=sec.device, generator=gen)
        opt.step()
    return params


def paged(sec: Section) -> None:
    steps = 4
    ref = _torch_adamw(sec, steps)
    page = sec.big(256 << 10, 16 << 10)
    for case, kw, syncs_max in [("PagedAdamW resident", {}, 0),
                                ("PagedAdamW streamed", {"device_budget": 2 * page}, 0),
                                ("PagedAdamW foreach streamed",
                                 {"device_budget": 2 * page, "foreach": True}, 1)]:  # fmt: skip
        def run(kw: dict = kw, syncs_max: int = syncs_max) -> dict[str, Any]:
            params, syncs, stats = _paged_run(sec, PagedAdamW, steps, **kw)
            rel = max(_rel(p, r) for p, r in zip(params, ref))
            return {"ok": rel <= 1e-6 and max(syncs) <= syncs_max, "rel_vs_torch": rel,
                    "syncs_per_step": syncs, "bytes_paged_in": stats["bytes_paged_in"]}
        sec.case("paged", case, run)

    def eight_bit() -> dict[str, Any]:
        resident, _, _ = _paged_run(sec, PagedAdamW8bit, steps)
        streamed, syncs, stats = _paged_run(sec, PagedAdamW8bit, steps, device_budget=2 * page)
        diff = max((a - b).abs().max().item() for a, b in zip(resident, streamed))
        return {"ok": diff == 0 and max(syncs) <= 1, "max_diff_vs_resident": diff,
                "syncs_per_step": syncs, "bytes_paged_in": stats["bytes_paged_in"]}
    sec.case("paged", "PagedAdamW8bit streamed", eight_bit)


# -- offload -------------------------------------------------------------------------------
def _llama(sec: Section) -> tuple[torch.nn.Module, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hidden = sec.big(512, 64)
    cfg = LlamaConfig(vocab_size=sec.big(4096, 256), hidden_size=hidden,
                      intermediate_size=2 * hidden, num_hidden_layers=sec.big(4, 2),
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                      attn_implementation="eager")  # deterministic backward  # fmt: skip
    model = LlamaForCausalLM(cfg).to(sec.device)
    x = torch.randint(0, cfg.vocab_size, (2, sec.big(1024, 64)), device=sec.device)
    return model, {"input_ids": x, "labels": x}


def _loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    torch.cuda.synchronize()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def offload(sec: Section) -> None:
    def run() -> dict[str, Any]:
        model, batch = _llama(sec)
        loss0, grads0 = _loss_and_grads(model, batch)
        plan = ck.enable(model, "every", offload="all", example=batch, offload_min_bytes=16 << 10)
        try:
            results = [_loss_and_grads(model, batch) for _ in range(2)]
        finally:
            ck.disable(model)
        diff = max(max((g[n] - grads0[n]).abs().max().item() for n in grads0) for _, g in results)
        dloss = max(abs(loss - loss0) for loss, _ in results)
        return {"ok": plan.host_bytes > 0 and dloss <= 1e-5 and diff <= 1e-5,
                "offloaded_bytes": plan.host_bytes, "loss_diff": dloss, "grad_max_diff": diff}
    sec.case("offload", "every block offloaded + prefetched vs none", run)


# -- oom -----------------------------------------------------------------------------------
def _bf16_params(sec: Section) -> list[torch.Tensor]:
    gen = torch.Generator(sec.device).manual_seed(7)
    return [torch.randn(n, device=sec.device, generator=gen).bfloat16()
            for n in (3000, sec.big(500_000, 5000), 4097)]


def _adamw_steps(sec: Section, params: list[torch.Tensor], steps: int,
                 hook: Callable[[PagedAdamW], None] | None = None) -> dict:
    opt = PagedAdamW(params, lr=1e-2, weight_decay=0.1, page_bytes=sec.big(256 << 10, 16 << 10))
    if hook is not None:
        hook(opt)
    for step in range(1, steps + 1):
        gen = torch.Generator(sec.device).manual_seed(200 + step)
        for p in params:
            p.grad = torch.randn(p.shape, device=sec.device, generator=gen).bfloat16()
        opt.step()
    stats = opt.memory_stats()
    opt.close()
    return stats


@contextlib.contextmanager
def _kernel_oom(at_step: int) -> Iterator[Callable[[PagedAdamW], None]]:
    """torch's fused AdamW kernel raising OutOfMemoryError once, in step ``at_step``."""
    real, left, box = torch._fused_adamw_, [1], []

    def fake(*args: Any, **kwargs: Any) -> None:
        if box and box[0]._step_id == at_step and left[0]:
            left[0] -= 1
            raise torch.OutOfMemoryError("injected by gpu_sections: could not allocate")
        real(*args, **kwargs)

    torch._fused_adamw_ = fake
    try:
        yield box.append
    finally:
        torch._fused_adamw_ = real


def oom_step(sec: Section) -> None:
    def run() -> dict[str, Any]:
        clean = _bf16_params(sec)
        _adamw_steps(sec, clean, 4)
        hit = _bf16_params(sec)
        with _kernel_oom(at_step=2) as hook:
            stats = _adamw_steps(sec, hit, 4, hook)
        same = all(torch.equal(a, b) for a, b in zip(clean, hit))
        return {"ok": same and stats["oom_recoveries"] == 1, "equal_to_clean": same,
                "oom_recoveries": stats["oom_recoveries"]}
    sec.case("oom", "OOM in step() retried", run)


def _train(sec: Section, model_dir: Path, out: Path, fail_at: set[int]) -> Any:
    from tightfit.optim.optimizer_options import OptimizerOptions
    from tightfit.qlora.prepare_options import LoraOptions
    from tightfit.train import run_setup
    from tightfit.train.loop import RunConfig, TrainOptions, train

    real, calls = run_setup.prepare, [0]

    def prepare(*args: Any, **kwargs: Any) -> Any:  # a backward through the final norm raises
        model = real(*args, **kwargs)

        def grad_hook(grad: torch.Tensor) -> None:
            calls[0] += 1
            if calls[0] in fail_at:
                raise torch.OutOfMemoryError("CUDA out of memory (injected by gpu_sections)")

        def forward_hook(module: Any, args: Any, output: torch.Tensor) -> None:
            if output.requires_grad:
                output.register_hook(grad_hook)

        model.get_base_model().model.norm.register_forward_hook(forward_hook)
        return model

    run_setup.prepare = prepare
    try:
        cfg = RunConfig(train=TrainOptions(model=str(model_dir), out=str(out), batch_size=2,
                                           seq_len=32, steps=3, save_every=3, track_every=0,
                                           device=str(sec.device)),
                        lora=LoraOptions(r=4, alpha=8, dropout=0.1),
                        optimizer=OptimizerOptions(lr=1e-2, page_bytes=16 << 10))
        return train(cfg, progress=False, log=lambda s: None)
    finally:
        run_setup.prepare = real


def oom_backward(sec: Section) -> None:
    from safetensors.torch import load_file

    from tests.train.helpers import tiny_llama

    def run() -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = tiny_llama(Path(tmp) / "model", tokenizer=True)
            clean = _train(sec, model_dir, Path(tmp) / "clean", set())
            hit = _train(sec, model_dir, Path(tmp) / "hit", {2})
            a = load_file(str(clean.out / "adapter" / "adapter_model.safetensors"))
            b = load_file(str(hit.out / "adapter" / "adapter_model.safetensors"))
            same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            retries = [h["oom_retry"] for h in hit.history]
        return {"ok": same and retries == [False, True, False], "adapter_equal": same,
                "oom_retry": retries}
    sec.case("oom", "OOM in backward retried (tightfit train)", run)


SECTIONS = {"paged": paged, "offload": offload, "oom_step": oom_step,
            "oom_backward": oom_backward}  # fmt: skip


@contextlib.contextmanager
def emulation() -> Iterator[None]:
    """The strict CUDA emulation on the CPU, stores built as on CUDA, the offload tier
    pinned host memory (what a CUDA device has)."""
    import pytest

    import tightfit.checkpoint.api as ck_api
    from tests.optim.syncs import as_on_cuda
    from tests.tiers.strict_cuda import install, uninstall

    with pytest.MonkeyPatch.context() as mp:
        emu = install(mp)
        try:
            as_on_cuda(mp)
            mp.setattr(ck_api, "tier_of", lambda device: ("host", True))
            yield
            emu.synchronize()
        finally:
            uninstall(emu)
        if emu.violations:
            raise AssertionError("strict CUDA emulation: " + "; ".join(emu.violations[:3]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("section", choices=sorted(SECTIONS))
    ap.add_argument("--out", type=Path, required=True, help="JSON lines, appended")
    ap.add_argument("--emulate", action="store_true",
                    help="on the CPU under the strict CUDA emulation (CI)")
    args = ap.parse_args(argv)
    sec = Section(args.out, args.emulate)
    with emulation() if args.emulate else contextlib.nullcontext():
        SECTIONS[args.section](sec)
    return 1 if sec.failed else 0


if __name__ == "__main__":
    sys.exit(main())
