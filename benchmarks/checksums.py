"""What the disk tier's checksums cost: candidates on 8 MiB pages, and paged steps with them on/off.

1. Candidates, per 8 MiB page, from RAM larger than the caches (as a step sees pages): a bare
   copy, XXH3-64 after the copy, ``copy_and_checksum`` (the copy hashed chunk by chunk while in
   cache, what the pager does), zlib's CRC-32 and a torch ``int64`` sum.
2. PagedAdamW at 50 % and 10 % resident (``benchmarks/optimizer.py``'s setup: one 50M-param
   tensor, 8 MiB pages), checksums on and off round-robin in one process. "Off" swaps the
   pager's hash functions for a plain copy inside this script only; there is no such option.
   Wall time and process CPU time per step (CPU time is less disturbed by other work on a
   shared machine).

Writes ``benchmarks/results/checksums.md``. Run: ``.venv/bin/python benchmarks/checksums.py``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash
from environment import cpu_model, git_commit, versions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tightfit.optim.adamw import PagedAdamW  # noqa: E402
from tightfit.paging import disk  # noqa: E402
from tightfit.tiers.integrity import checksum, copy_and_checksum  # noqa: E402

MIB = 1 << 20


def candidates(pages: int, rounds: int) -> list[str]:
    """Milliseconds per 8 MiB page of each candidate (best of ``rounds`` passes)."""
    src = [torch.randn(2 * MIB).view(torch.uint8) for _ in range(pages)]
    dst = torch.empty(8 * MIB, dtype=torch.uint8)

    def crc(t: torch.Tensor) -> int:
        return zlib.crc32(memoryview(t.numpy()))

    ways: dict[str, Callable[[torch.Tensor], object]] = {
        "copy only": lambda s: dst.copy_(s),
        "copy, then XXH3-64 of the copy": lambda s: (dst.copy_(s), checksum(dst)),
        "copy_and_checksum (XXH3-64 per 256 KiB chunk while in cache)":
            lambda s: copy_and_checksum(dst, s),
        "XXH3-64 alone": checksum,
        "zlib.crc32 alone": crc,
        "torch int64 sum alone (order-blind)": lambda s: s.view(torch.int64).sum(),
    }
    rows = []
    for name, fn in ways.items():
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for s in src:
                fn(s)
            best = min(best, (time.perf_counter() - t0) / len(src))
        rows.append(f"| {name} | {best * 1e3:.2f} | {8 * MIB / best / 2**30:.1f} |")
    return ["| way | ms per 8 MiB page | GiB/s |", "|---|---|---|", *rows]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _off(dst: torch.Tensor, src: torch.Tensor) -> int:
    dst.copy_(src)
    return 0


def paged(n: int, rounds: int, page: int) -> list[str]:
    """Paged steps with checksums on and off, round-robin; a table and the overheads."""
    real = (disk.checksum, disk.copy_and_checksum, disk.zeros_checksum)
    fake = (lambda t: 0, _off, lambda nbytes: 0)
    param = torch.randn(n)
    param.grad = torch.randn(n) * 1e-3
    root = tempfile.mkdtemp(prefix="tightfit-bench-checksums-")
    configs = {}
    for label, budget in (("50% resident", 4 * n), ("10% resident", 8 * n // 10)):
        for mode in ("on", "off"):
            configs[(label, mode)] = PagedAdamW([param], page_bytes=page, device_budget=budget,
                                                spill_dir=root)  # fmt: skip
    wall: dict = {k: [] for k in configs}
    cpu: dict = {k: [] for k in configs}
    for r in range(rounds + 1):  # round 0: placement and first touch
        for key, opt in configs.items():
            disk.checksum, disk.copy_and_checksum, disk.zeros_checksum = (
                real if key[1] == "on" else fake)
            c0, t0 = _cpu(), time.perf_counter()
            opt.step()
            if r:
                wall[key].append(time.perf_counter() - t0)
                cpu[key].append(_cpu() - c0)
    disk.checksum, disk.copy_and_checksum, disk.zeros_checksum = real
    rows = []
    for label in ("50% resident", "10% resident"):
        s = configs[(label, "on")].memory_stats()
        moved = 2 * (s["state_bytes"] - s["resident_bytes"])
        w = {m: statistics.median(wall[(label, m)]) for m in ("on", "off")}
        c = {m: statistics.median(cpu[(label, m)]) for m in ("on", "off")}
        rows.append(f"| {label} | {moved / MIB:.0f} | {w['off'] * 1e3:.1f} | {w['on'] * 1e3:.1f} "
                    f"| {(w['on'] / w['off'] - 1) * 100:+.1f}% | {c['off'] * 1e3:.1f} | "
                    f"{c['on'] * 1e3:.1f} | {(c['on'] / c['off'] - 1) * 100:+.1f}% |")
    for opt in configs.values():
        opt.close()
    os.rmdir(root)
    return [
        "| mode | MiB hashed / step | wall off ms | wall on ms | wall | CPU off ms | CPU on ms "
        "| CPU |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--rounds", type=int, default=10, help="timed steps per optimizer")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "checksums.md"))
    args = parser.parse_args()
    load = os.getloadavg()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core each, as the copy worker hashes (xxhash is 1 thread)
    first = candidates(pages=40, rounds=3)
    torch.set_num_threads(threads)
    second = paged(args.params, args.rounds, 8 * MIB)
    load_end = os.getloadavg()
    v = versions()
    text = [
        "# Disk-tier checksums: candidates and cost in a paged step (CPU)",
        "",
        f"Written by `benchmarks/checksums.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores (torch {torch.get_num_threads()} "
        f"threads); load average {load[0]:.2f} at the start, {load_end[0]:.2f} at the end — "
        "**shared with other work: compare within a table**",
        f"- versions: python {v['python']}, torch {v['torch']}, xxhash {xxhash.VERSION}; "
        f"tightfit at commit {git_commit()}",
        "",
        "## Candidates (8 MiB pages, 320 MiB of sources: from RAM, not cache; 1 torch thread)",
        "",
        *first,
        "",
        f"## PagedAdamW steps, checksums on vs off ({args.params:,} fp32 params, 8 MiB pages, "
        f"{args.rounds} rounds, medians)",
        "",
        "Every streamed page is verified when it is read in and hashed when it is written back:",
        "2 x the non-resident bytes per step.",
        "",
        *second,
        "",
    ]
    Path(args.out).write_text("\n".join(text))
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
