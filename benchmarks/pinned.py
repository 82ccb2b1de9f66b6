"""Pinned host bytes of the 8B long-context plan: asked, really pinned, and the budget.

``tightfit plan --model llama-3.1-8b --gpu 24GiB --lora-r 32 --max-seq --host-ram 128GiB``
recommends a step whose host side is the offloaded layer inputs (the offload pool's one first
chunk, a region per layer) and the paged AdamW 8-bit's host pages. For that step this script
writes ``benchmarks/results/pinned.md``:

* **analytic**: what torch 2.13's caching host allocator pins for those buffers (each rounded
  up to a power of two; what tightfit asked it for before ``tightfit/tiers/pinned.py``) and
  what tightfit pins now (to the page), against the plan's host budget;
* **emulation** (``tests/tiers/strict_pinned.py``: torch's rounding and caching, and
  ``cudaHostRegister``): *before* replays the old code's requests through torch's
  ``torch.empty(..., pin_memory=True)`` (each pool's first chunk — offloaded layer inputs,
  streamed base weights —, one per host page), then frees them as a closed pool did; *after*
  runs the new code (``pinned_pool`` regions, the page store's reserved host chunk) and closes
  it. Every size is divided by ``SCALE`` (a power of two: torch's power-of-two rounding scales
  exactly) so that the buffers exist on a small machine; the table multiplies back.

Byte counts, not times: one run is the measurement (no medians).

Run: ``.venv/bin/python benchmarks/pinned.py``.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from environment import cpu_model, git_commit, load_text, versions_text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.tiers import strict_pinned  # noqa: E402
from tightfit.paging.paging_options import DEFAULT_PAGE_BYTES  # noqa: E402
from tightfit.planner.host import host_limit, pinned_host_bytes, torch_pinned_host_bytes  # noqa: E402
from tightfit.planner.ladder import plan  # noqa: E402
from tightfit.tiers.pinned import PinnedHost, sharing  # noqa: E402
from tightfit.tiers.regions import aligned, pinned_pool  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
SCALE = 256


def _plan() -> tuple[object, dict[str, int], list[int], list[int], int]:
    """The recommended row, its pools' first chunks by user, its layer-input regions, its
    host pages, and the host budget."""
    report = plan("llama-3.1-8b", "24GiB", lora_r=32, host_ram="128GiB", maximize="seq")
    row = report.recommended
    est = row.estimate
    layers = report.shape.layers
    regions = [est.host_activations // layers] * layers
    # the Offloader's first chunk is its plan's host bytes: each region page-aligned
    chunks = {"offloaded activations": sum(map(aligned, regions)),
              "streamed base weights": getattr(est, "host_weights", 0)}
    chunks = {k: v for k, v in chunks.items() if v}
    pages = [DEFAULT_PAGE_BYTES] * (est.optimizer_offloaded // DEFAULT_PAGE_BYTES)
    if est.optimizer_offloaded % DEFAULT_PAGE_BYTES:
        pages.append(est.optimizer_offloaded % DEFAULT_PAGE_BYTES)
    return row, chunks, regions, pages, host_limit("128GiB").budget


def _scaled(sizes: list[int]) -> list[int]:
    return [max(1, n // SCALE) for n in sizes]


def _before(chunks: list[int], pages: list[int], mp: pytest.MonkeyPatch) -> tuple[int, int]:
    emu = strict_pinned.install(mp)
    held = [torch.empty(aligned(n), dtype=torch.uint8, pin_memory=True) for n in chunks]
    held += [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in pages]
    pinned = emu.pinned_bytes
    del held
    gc.collect()
    return pinned, emu.pinned_bytes  # closed pools: their blocks stay in torch's cache


def _after(chunks: dict[str, int], regions: list[int], pages: list[int],
           mp: pytest.MonkeyPatch) -> tuple[int, int, dict]:
    emu = strict_pinned.install(mp)
    host = PinnedHost(host_limit("128GiB").budget // SCALE)
    with sharing(host):  # as tightfit train builds them
        pools = {k: pinned_pool(n, None, what=k) for k, n in chunks.items()}
        store = pinned_pool(pages[0], None, what="optimizer host pages")
    taken = [pools["offloaded activations"].take(n) for n in regions]
    assert pools["offloaded activations"].chunks_made == 1
    for k, n in chunks.items():
        if k != "offloaded activations":
            taken.append(pools[k].take(n))
    region = aligned(DEFAULT_PAGE_BYTES)  # PageStore._region_bytes: one page's size each
    store.reserve(len(pages) * region)  # PageStore._reserve_host
    taken += [store.take(region) for _ in pages]
    pinned, stats = emu.pinned_bytes, host.stats()
    assert pinned == stats["pinned_bytes"], (pinned, stats)
    del taken
    for pool in (*pools.values(), store):
        pool.close()
    return pinned, emu.pinned_bytes, stats


def main() -> None:
    row, chunks, regions, pages, budget = _plan()
    asked = sum(chunks.values()) + sum(pages)
    old = torch_pinned_host_bytes([aligned(n) for n in chunks.values()] + pages)
    new = pinned_host_bytes(list(chunks.values())) + pinned_host_bytes([DEFAULT_PAGE_BYTES] * len(pages))
    with pytest.MonkeyPatch.context() as mp:
        before, before_closed = _before(_scaled(list(chunks.values())), _scaled(pages), mp)
    with pytest.MonkeyPatch.context() as mp:
        small = {k: max(1, n // SCALE) for k, n in chunks.items()}
        small["offloaded activations"] = sum(map(aligned, _scaled(regions)))
        after, after_closed, stats = _after(small, _scaled(regions), _scaled(pages), mp)
    before, before_closed, after, after_closed = (
        x * SCALE for x in (before, before_closed, after, after_closed))

    def g(n: int) -> str:
        return f"{n / GiB:.3f}"

    lines = [
        "# Pinned host memory of the 8B long-context plan: asked, pinned, budget",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} CPUs; {versions_text()}; commit "
        f"{git_commit()}; load average {load_text(os.getloadavg())}. Written by "
        "`benchmarks/pinned.py` (byte counts, one run: nothing is timed).",
        "",
        "Plan: `tightfit plan --model llama-3.1-8b --gpu 24GiB --lora-r 32 --max-seq --host-ram "
        f"128GiB` recommends *{row.name}* at {row.maximum:,} tokens. Its host side: "
        + ", ".join(f"{k} {g(n)} GiB (one pool chunk)" for k, n in chunks.items())
        + f" — the layer inputs in {len(regions)} regions —, paged AdamW 8-bit host pages "
        f"{g(sum(pages))} GiB (modelled as {len(pages)} pages of at most "
        f"{DEFAULT_PAGE_BYTES // MiB} MiB), no disk pages (so no staging buffers). Host budget: "
        f"{g(budget)} GiB (50% of 128 GiB). Emulated figures ran at 1/{SCALE} of every size "
        "and are multiplied back.",
        "",
        "| GiB | asked | pinned | after the pools close | within the budget |",
        "|---|---:|---:|---:|---|",
        f"| before, analytic (torch's allocator: each buffer to a power of two) | {g(asked)} | "
        f"{g(old)} | {g(old)} (cached) | {'yes' if old <= budget else 'no'} |",
        f"| before, emulated (the old requests replayed) | {g(asked)} | {g(before)} | "
        f"{g(before_closed)} | {'yes' if before <= budget else 'no'} |",
        f"| after, analytic (tiers/pinned.py: to the page) | {g(asked)} | {g(new)} | 0 | "
        f"{'yes' if new <= budget else 'no'} |",
        f"| after, emulated (the new pools, closed) | {g(asked)} | {g(after)} | "
        f"{g(after_closed)} | {'yes' if after <= budget else 'no'} |",
        "",
        "Before, each pool's first chunk was one request to torch's allocator ("
        + ", ".join(f"{g(aligned(n))} GiB pinned {g(torch_pinned_host_bytes([aligned(n)]))}"
                    for n in chunks.values())
        + f" GiB), and budgets were checked against the {g(asked)} GiB asked: "
        f"{g(old - asked)} GiB pinned beyond what was counted "
        f"({100 * (old - asked) / asked:.1f} %). A 17 GiB chunk would have pinned 32 GiB "
        "(88 %). After, the accountant's count (`PinnedHost.stats()`, multiplied back: "
        f"{g(SCALE * stats['pinned_bytes'])} GiB pinned for "
        f"{g(SCALE * stats['requested_bytes'])} GiB asked, by user "
        f"{', '.join(f'{k} {g(SCALE * v)}' for k, v in stats['by_user'].items())}) "
        "equals what the emulation saw pinned, and closing the pools unpins everything.",
        "",
        f"Pinned beyond asked, after (analytic): {new - asked} bytes — page alignment, and "
        "the page store's host regions are all one page's size (a smaller last page takes a "
        "whole one) so that reserved chunks never fragment. The emulated *after* pins each pool's first chunk as the code sizes it (the "
        "offload pool's: its regions page-aligned, as the checkpoint plan counts its host "
        f"bytes), at 1/{SCALE} of the sizes, so its alignment is {SCALE}x what it is at full "
        "size; the accountant's count matched the emulation's.",
    ]
    dirty = subprocess.run(["git", "status", "--short", "--", "tightfit"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split("\n")
    changed = sorted(line[3:] for line in dirty if line.strip())
    if changed:
        lines += ["", f"The working tree had uncommitted changes in {len(changed)} files under "
                  f"tightfit/ when this ran (the shared tree: {', '.join(changed[:8])}"
                  f"{', ...' if len(changed) > 8 else ''})."]
    out = ROOT / "benchmarks" / "results" / "pinned.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
