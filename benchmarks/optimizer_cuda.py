"""CUDA optimizer step: PagedAdamW against torch fused AdamW and bitsandbytes (Paged)AdamW.

Run on a GPU machine (``benchmarks/gpu_check.sh`` does): 50M fp32 params (``--quick``: 5M).
Measures, round-robin in one run: step time (CUDA-synchronized medians), device bytes of
optimizer state (``torch.cuda.mem_get_info`` delta, which also sees bitsandbytes' managed
memory), bytes PagedAdamW moved per step, and the pinned host<->device copy bandwidth, then
checks the same targets as the CPU benchmark. Writes ``benchmarks/results/optimizer_cuda.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tightfit.optim.adamw import PagedAdamW  # noqa: E402

MIB = 1 << 20


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _bandwidth(page: int, n: int) -> float:
    """Pinned host -> device -> host bytes/s for page-sized copies (one pass, both ways)."""
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for off in range(0, n, page):
            dev[off : off + page].copy_(host[off : off + page], non_blocking=True)
        for off in range(0, n, page):
            host[off : off + page].copy_(dev[off : off + page], non_blocking=True)
        torch.cuda.synchronize()
        out.append(2 * n / (time.perf_counter() - t0))
    return statistics.median(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5M params, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                             "optimizer_cuda.md"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("optimizer_cuda: no CUDA device; nothing measured")
        return 0
    n = 5_000_000 if args.quick else 50_000_000
    rounds = args.rounds or (3 if args.quick else 10)
    page = 4 * MIB
    state_bytes = 8 * n
    torch.manual_seed(0)
    param = torch.randn(n, device="cuda")
    param.grad = torch.randn(n, device="cuda") * 1e-3
    makers = {
        "torch AdamW fused": lambda: torch.optim.AdamW([param], fused=True),
        "PagedAdamW unlimited": lambda: PagedAdamW([param], page_bytes=page),
        "PagedAdamW 50% resident (rest pinned host)":
            lambda: PagedAdamW([param], page_bytes=page, device_budget=state_bytes // 2),
        "PagedAdamW 10% resident (rest pinned host)":
            lambda: PagedAdamW([param], page_bytes=page, device_budget=state_bytes // 10),
    }
    notes = []
    try:
        import bitsandbytes as bnb  # optional and heavy: only for the comparison rows

        makers["bitsandbytes AdamW (32-bit)"] = lambda: bnb.optim.AdamW([param], optim_bits=32)
        makers["bitsandbytes PagedAdamW (32-bit)"] = lambda: bnb.optim.PagedAdamW([param])
    except Exception as exc:  # noqa: BLE001
        notes.append(f"bitsandbytes unavailable: {type(exc).__name__}: {exc}")
    configs, state_dev = {}, {}
    for name, make in makers.items():
        torch.cuda.synchronize()
        before = _used()
        opt = make()
        opt.step()  # creates the state
        torch.cuda.synchronize()
        configs[name], state_dev[name] = opt, _used() - before
    times = {k: [] for k in configs}
    moved = {k: [] for k in configs}
    for _ in range(rounds):
        for name, opt in configs.items():
            s0 = opt.memory_stats() if isinstance(opt, PagedAdamW) else None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
            if s0 is not None:
                s1 = opt.memory_stats()
                moved[name].append(s1["bytes_paged_in"] - s0["bytes_paged_in"]
                                   + s1["bytes_paged_out"] - s0["bytes_paged_out"])
    bw = _bandwidth(page, min(state_bytes, 1024 * MIB))
    med = {k: statistics.median(v) for k, v in times.items()}
    fused = med["torch AdamW fused"]
    rows, checks = [], []
    for name, opt in configs.items():
        row = f"| {name} | {med[name] * 1e3:.2f} | {med[name] / fused:.2f} | " \
              f"{state_dev[name] / MIB:.0f} | "
        if isinstance(opt, PagedAdamW):
            s = opt.memory_stats()
            per_step = statistics.median(moved[name])
            non_res = s["state_bytes"] - s["resident_bytes"]
            exact = all(m == 2 * non_res for m in moved[name])
            row += f"{s['peak_device_bytes'] / MIB:.0f} | {per_step / MIB:.0f} | " \
                   f"{'yes' if exact else 'NO'} |"
            if s["device_budget"] is None:
                checks.append(f"- {name}: {med[name] / fused:.3f}x fused (target <= 1.05x): "
                              f"**{'met' if med[name] <= 1.05 * fused else 'MISSED'}**")
            else:
                bound = 1.3 * (fused + per_step / bw)
                checks.append(f"- {name}: {med[name] * 1e3:.2f} ms vs bound {bound * 1e3:.2f} ms "
                              f"(1.3 x (fused + {per_step / MIB:.0f} MiB / {bw / 1e9:.1f} GB/s)); "
                              f"moved exactly 2 x non-resident: {'yes' if exact else 'NO'}: "
                              f"**{'met' if med[name] <= bound and exact else 'MISSED'}**")
            opt.close()
        else:
            row += "- | - | - |"
        rows.append(row)
    lines = [
        "# Optimizer step on CUDA: PagedAdamW vs torch fused AdamW and bitsandbytes",
        "",
        f"`benchmarks/optimizer_cuda.py{' --quick' if args.quick else ''}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {n:,} fp32 params, {rounds} "
        "timed steps each, round-robin, medians, CUDA-synchronized around each step.",
        "",
        f"- device: {torch.cuda.get_device_name()}; host load average {os.getloadavg()[0]:.2f}",
        f"- versions: torch {torch.__version__}",
        f"- pinned host<->device copy bandwidth (same run, page-sized copies): {bw / 1e9:.1f} GB/s",
        "- bitsandbytes' paged optimizer only pages when the GPU is oversubscribed (unified "
        "memory); here everything fits, so its row is its no-pressure cost",
        "",
        "| optimizer | step ms | x fused | device MiB (mem_get_info) | peak device state MiB "
        "| moved MiB/step | = 2 x non-resident |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "## Targets",
        "",
        *checks,
        *notes,
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
