"""Short paged-optimizer demonstration: train a small MLP with PagedAdamW under a tight budget.

Runs on the CPU in seconds. The optimizer state is cut into pages; a device budget smaller than
the state keeps some pages in memory and streams the rest through a spill file on disk every
step. It prints where the state lives, what each step moved, and checks the result against
torch.optim.AdamW.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

from tightfit.optim.adamw import PagedAdamW

_MIB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tightfit demo``."""
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width (default 1024)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    parser.add_argument(
        "--page-mib", type=float, default=1.0, help="page size in MiB (default 1)"
    )
    parser.add_argument(
        "--resident", type=float, default=0.3,
        help="fraction of the state allowed in memory; the rest goes to disk (default 0.3)",
    )


def _model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
        nn.Linear(hidden, 16),
    )


def run(args: argparse.Namespace) -> int:
    """Run the demonstration; returns 0 when paged and torch AdamW agree."""
    if not 0.0 < args.resident <= 1.0:
        raise ValueError(f"--resident={args.resident} must be in (0, 1], e.g. 0.3")
    if args.steps < 1 or args.hidden < 1:
        raise ValueError("--steps and --hidden must be positive integers")
    page_bytes = max(4096, int(args.page_mib * _MIB))
    model, reference = _model(args.hidden), _model(args.hidden)
    n_params = sum(p.numel() for p in model.parameters())
    state_bytes = 8 * n_params  # exp_avg + exp_avg_sq, fp32
    budget = max(page_bytes, int(args.resident * state_bytes))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    print(f"model: {n_params:,} params; AdamW state ≈ {state_bytes / _MIB:.1f} MiB")
    print(f"page size {page_bytes / _MIB:.2f} MiB, device budget {budget / _MIB:.1f} MiB "
          f"({args.resident:.0%} of the state); on this CPU the next tier is a spill file")
    x, y = torch.randn(64, args.hidden), torch.randn(64, 16)
    with PagedAdamW(model.parameters(), lr=1e-3, page_bytes=page_bytes,
                    device_budget=budget) as opt:
        last_in = last_out = 0
        for step in range(1, args.steps + 1):
            for m, o in ((model, opt), (reference, ref_opt)):
                o.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
            t0 = time.perf_counter()
            opt.step()
            dt = time.perf_counter() - t0
            ref_opt.step()
            s = opt.memory_stats()
            moved_in, moved_out = s["bytes_paged_in"] - last_in, s["bytes_paged_out"] - last_out
            last_in, last_out = s["bytes_paged_in"], s["bytes_paged_out"]
            if step == 1:
                print(f"pages: {s['pages']} — resident {s['resident_bytes'] / _MIB:.2f} MiB, "
                      f"window {s['window_bytes'] / _MIB:.2f} MiB, on disk "
                      f"{s['disk_bytes'] / _MIB:.2f} MiB in {s['spill_dir']}")
            print(f"step {step}: paged in {moved_in / _MIB:6.2f} MiB, out {moved_out / _MIB:6.2f} "
                  f"MiB (in + out = 2 × {s['disk_bytes'] / _MIB:.2f} MiB on disk), "
                  f"{dt * 1e3:6.1f} ms")
        s = opt.memory_stats()
        spill = s["spill_dir"]
    diff = max(
        ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
        for a, b in zip(model.parameters(), reference.parameters())
    )
    print(f"totals: {s['bytes_paged_in'] / _MIB:.1f} MiB in, {s['bytes_paged_out'] / _MIB:.1f} "
          f"MiB out, {s['page_faults']} page faults, {s['stall_seconds'] * 1e3:.1f} ms stalled, "
          f"peak device {s['peak_device_bytes'] / _MIB:.2f} MiB (budget {budget / _MIB:.2f} MiB)")
    print(f"closed: spill folder removed = {spill is None or not os.path.exists(spill)}")
    print(f"max relative difference vs torch.optim.AdamW: {diff:.2e}")
    return 0 if diff < 1e-5 else 1
