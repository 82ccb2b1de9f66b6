"""What the disk tier's checksums cost: candidates on 8 MiB pages, and paged steps with them on/off.

1. Candidates, per 8 MiB page, from RAM larger than the caches (as a step sees pages): a bare
   copy, XXH3-64 after the copy, ``copy_and_checksum`` (what the pager does: 4 MiB stripes on
   the copy worker and the hash pool, each copied in 256 KiB chunks, each chunk hashed while in
   cache), the same on one thread, the striped torch copy before both (4 MiB stripes copied,
   then hashed, on two threads), zlib's CRC-32 and a torch ``int64`` sum; and XXH3-64 in cache.
2. PagedAdamW at 97 %, 50 % and 10 % resident (``benchmarks/optimizer.py``'s setup: one
   50M-param tensor, 8 MiB pages), four modes stepping one optimizer per residency round-robin,
   the order reversed every other round: *on* (the pager as it is: the update leaves the copy
   threads their cores, ``CopyEngine.beside_copies``), *off* (the same with the hashing taken
   out of the copy), and both again with the update on every core (*all cores*: the pager
   until commit 37bf4bc). The modes swap the pager's copy and hash functions and its core
   count inside this script only; there is no such option. Wall time and process CPU time
   per step; paired ratios (each round's steps ran back to back) as medians with a 95 %
   bootstrap interval. Here the spill files stay in the page cache, so a "disk" copy runs at
   RAM speed: the worst case for the checksums' share. Beside it the floor: the bytes hashed
   at XXH3's in-cache speed on this machine, as a share of the "off" step's CPU time — what
   hashing costs even with no extra pass over RAM and perfect overlap; and the same at
   XXH3's own in-cache speed (without ``checksum()``'s per-call overhead), beside the copy
   worker's and hash pool's own CPU time on minus off (Linux): whether the hash itself or the
   way its time lands on the update's threads makes up the ratio.
3. The same steps at 50 % and 10 % in a child process under a memory cgroup that leaves no room to keep the
   spill files in the page cache, so pages really come from and go to the disk (what the tier
   is for: state that does not fit in RAM). Skipped where no cgroup can be made, or with
   ``--disk-rounds 0``.

Writes ``benchmarks/results/checksums.md``. Run: ``.venv/bin/python benchmarks/checksums.py``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash
from environment import cpu_model, git_commit, versions
from spike import cgroup_figures, child_cgroup, detect_cap

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np  # noqa: E402

from tightfit.integrity import checksums  # noqa: E402
from tightfit.integrity.checksums import STRIPE, checksum, copy_and_checksum  # noqa: E402
from tightfit.optim.adamw import PagedAdamW  # noqa: E402
from tightfit.paging import disk, sweep  # noqa: E402

MIB = 1 << 20


def in_cache_speed(rounds: int = 200) -> float:
    """Bytes per second XXH3-64 hashes a 256 KiB buffer that stays in a core's cache (best of
    ``rounds``): the fastest any pass over a page's bytes can hash them here."""
    buf = torch.randn(64 << 10).view(torch.uint8)
    checksum(buf)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        checksum(buf)
        best = min(best, time.perf_counter() - t0)
    return buf.numel() / best


def _median_speed(hash_once: Callable[[memoryview], object], rounds: int) -> float:
    """Bytes per second of ``hash_once`` on a 256 KiB buffer in cache (median of ``rounds``)."""
    view = memoryview(torch.randn(64 << 10).view(torch.uint8).numpy())
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        hash_once(view)
        times.append(time.perf_counter() - t0)
    return view.nbytes / statistics.median(times)


def raw_in_cache_speed(rounds: int = 2000) -> float:
    """Bytes per second of XXH3-64 itself on a 256 KiB buffer in cache (median of ``rounds``
    calls on a ``memoryview``): what :func:`in_cache_speed` measures without ``checksum()``'s
    checks and tensor-to-numpy conversion, which cost about as much as the hash at this size.
    The one-shot digest of a chunk in the copy pass pays neither."""
    return _median_speed(xxhash.xxh3_64_intdigest, rounds)


def streaming_in_cache_speed(rounds: int = 2000) -> float:
    """Bytes per second of a streaming XXH3-64 ``update`` of the same 256 KiB (median of
    ``rounds``): what the copy pass paid per chunk until b10e237, against the one-shot digest
    of :func:`raw_in_cache_speed` it pays now."""
    return _median_speed(xxhash.xxh3_64().update, rounds)


def _copy_thread_cpu() -> float | None:
    """CPU seconds so far of this process's copy worker and hash pool (the threads named
    ``tightfit-*``), from ``/proc/self/task/*/schedstat``; ``None`` where there is none."""
    total, found = 0.0, False
    for t in threading.enumerate():
        if not t.name.startswith("tightfit-") or t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
            found = True
        except (OSError, ValueError, IndexError):
            continue
    return total if found else None


def candidates(pages: int, rounds: int) -> list[str]:
    """Milliseconds per 8 MiB page of each candidate (best of ``rounds`` passes)."""
    src = [torch.randn(2 * MIB).view(torch.uint8) for _ in range(pages)]
    dst = torch.empty(8 * MIB, dtype=torch.uint8)

    def crc(t: torch.Tensor) -> int:
        return zlib.crc32(memoryview(t.numpy()))

    ways: dict[str, Callable[[torch.Tensor], object]] = {
        "copy only (torch, 1 thread)": lambda s: dst.copy_(s),
        "copy, then XXH3-64 of the copy": lambda s: (dst.copy_(s), checksum(dst)),
        "copy_and_checksum (4 MiB stripes on 2 threads, 256 KiB chunks hashed after copy)":
            lambda s: copy_and_checksum(dst, s),
        "the same, each stripe one streaming XXH3 (the pager until b10e237)":
            lambda s: _streaming(dst, s),
        "the same on the copy worker alone (b71e87e..3862237)": lambda s: _single(dst, s),
        "chunked copy alone (copy_and_checksum without the hash)": lambda s: _off(dst, s),
        "before: 4 MiB stripes on 2 threads, each hashed after its copy": lambda s: _before(dst, s),
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


def _chunked(dst: np.ndarray, src: np.ndarray, stripe: slice) -> list[int]:
    """One stripe copied :data:`CHUNK` by chunk, unhashed: the modes without a hash."""
    for x, y in checksums._chunks(stripe):
        np.copyto(dst[x:y], src[x:y])
    return []


def _streamed(dst: np.ndarray, src: np.ndarray, landed: memoryview, stripe: slice
              ) -> list[int]:
    """One stripe copied chunk by chunk into a streaming XXH3 of the whole stripe (the pager
    until commit b10e237; the page checksum was then that of the stripes' digests)."""
    h = xxhash.xxh3_64()
    for x, y in checksums._chunks(stripe):
        np.copyto(dst[x:y], src[x:y])
        h.update(landed[x:y])
    return [h.intdigest()]


def _streaming(dst: torch.Tensor, src: torch.Tensor) -> int:
    d, s = dst.numpy(), src.numpy()
    return checksums._striped(d.size, functools.partial(_streamed, d, s, memoryview(d)))


def _off(dst: torch.Tensor, src: torch.Tensor) -> int:
    """``copy_and_checksum``'s copy with the hashing taken out (mode *off*): the same
    stripes, chunk by chunk, on the copy worker and the hash pool."""
    d, s = dst.numpy(), src.numpy()
    checksums._striped(d.size, lambda st: _chunked(d, s, st))
    return UNHASHED


def _single(dst: torch.Tensor, src: torch.Tensor) -> int:
    """The copy-pass hash on the copy worker alone (mode *single*, commit b71e87e to 3862237):
    every stripe copied chunk by chunk, each chunk hashed in cache, on the calling thread."""
    d, s = dst.numpy(), src.numpy()
    return checksums._combine([x for a in range(0, max(d.size, 1), STRIPE) for x in (
        checksums._copy_stripe(d, s, memoryview(d), slice(a, min(a + STRIPE, d.size))))])  # fmt: skip


def _before(dst: torch.Tensor, src: torch.Tensor) -> int:
    """The copy and hash of commit 3c8118b and before: 4 MiB stripes, each copied by torch
    then hashed, the copy worker and the hash pool taking stripes in turn."""

    def one(s: slice) -> list[int]:
        out = dst[s]
        out.copy_(src[s])
        return [checksum(out)]

    return checksums._striped(dst.numel(), one)


FRACTIONS = {"97% resident": 0.97, "50% resident": 0.5, "10% resident": 0.1}
ON_DISK = ["50% resident", "10% resident"]  # under the cap (at 97 % the spill file would fit)
UNHASHED = -1  # what the unhashed modes record for a page written to disk: never verified
# mode -> (hashed, whether the update leaves the copy threads their cores as the pager does,
# or takes every core as it did until commit 37bf4bc)
MODES = {"on": (True, True), "off": (False, True),
         "on, all cores": (True, False), "off, all cores": (False, False)}  # fmt: skip
PAIRS = {"on / off": ("on", "off"), "on / off, all cores": ("on, all cores", "off, all cores"),
         "on / on, all cores": ("on", "on, all cores"),
         "off / off, all cores": ("off", "off, all cores")}  # fmt: skip
OVER = ["on / off", "on / off, all cores"]  # hashed / the same unhashed: against the floor
_REAL = (disk.copy_and_checksum, disk.page_checksum, disk.verify, sweep.copy_threads)


def _verify_hashed(spill: object, page: object, data: torch.Tensor, found: int | None = None
                   ) -> None:
    """``disk.verify`` for pages last written by a hashing mode; a page an unhashed mode wrote
    (or read) is taken as it is, so every mode can step the same optimizer (its memory, not
    one optimizer's placement against another's, is what the modes share)."""
    if found != UNHASHED and page.spill_checksum != UNHASHED:  # type: ignore[attr-defined]
        _REAL[2](spill, page, data, found)  # type: ignore[arg-type]


def _use(mode: str | None) -> None:
    """Swap the pager's disk copy, page checksum and core policy for those of ``mode``
    (``None``: the pager's own again)."""
    copy, page, verify, threads = _REAL
    if mode is not None:
        hashed, own_cores = MODES[mode]
        verify = _verify_hashed
        if not hashed:
            copy, page = _off, (lambda data: UNHASHED)
        if not own_cores:
            threads = lambda nbytes: 0  # noqa: E731
    disk.copy_and_checksum, disk.page_checksum, disk.verify = copy, page, verify
    sweep.copy_threads = threads


def median_ci(values: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """The median of ``values`` and a 95 % percentile-bootstrap interval around it (a fixed
    seed, so a rerun on the same figures gives the same interval)."""
    rng = np.random.default_rng(0)
    arr = np.asarray(values)
    meds = np.median(rng.choice(arr, size=(resamples, arr.size)), axis=1)
    return float(np.median(arr)), float(np.quantile(meds, 0.025)), float(np.quantile(meds, 0.975))


def paged(n: int, rounds: int, page: int, labels: list[str]) -> dict[str, dict[str, float]]:
    """Steps of one PagedAdamW per residency in every mode of :data:`MODES`, round-robin in
    alternating order (forward, then backward: a mode's place in the round favours none);
    per residency ``label``, the MiB hashed per step, the median wall and CPU seconds of each
    mode and the median paired ratios of :data:`PAIRS` with their 95 % intervals."""
    param = torch.randn(n)
    param.grad = torch.randn(n) * 1e-3
    root = tempfile.mkdtemp(prefix="tightfit-bench-checksums-")
    out = {}
    for label in labels:
        opt = PagedAdamW([param], page_bytes=page, device_budget=int(8 * n * FRACTIONS[label]),
                         spill_dir=root)
        _use("on")
        opt.step()  # placement and first touch
        wall: dict = {m: [] for m in MODES}
        cpu: dict = {m: [] for m in MODES}
        copy_cpu: dict = {m: [] for m in MODES}
        for r in range(rounds):
            for mode in list(MODES)[:: 1 if r % 2 else -1]:
                _use(mode)
                k0, c0, t0 = _copy_thread_cpu(), _cpu(), time.perf_counter()
                opt.step()
                wall[mode].append(time.perf_counter() - t0)
                cpu[mode].append(_cpu() - c0)
                k1 = _copy_thread_cpu()
                copy_cpu[mode].append(None if k1 is None or k0 is None else k1 - k0)
        _use(None)
        s = opt.memory_stats()
        f = out[label] = {"hashed": 2 * (s["state_bytes"] - s["resident_bytes"])}
        # the same round's steps ran back to back: their ratio cancels slow drifts of the
        # machine (the disk's throughput under the cap varies by 2 x between minutes)
        for name, (a, b) in PAIRS.items():
            ratios = [x / y - 1 for x, y in zip(wall[a], wall[b], strict=True)]
            f[name], f[f"{name} lo"], f[f"{name} hi"] = median_ci(ratios)
        # the copy threads' extra CPU time with the hash, paired the same way: what hashing
        # costs where it runs, apart from how that time lands on the update's threads
        if None not in copy_cpu["on"] + copy_cpu["off"]:
            f["copy cpu on - off"] = statistics.median(
                [x - y for x, y in zip(copy_cpu["on"], copy_cpu["off"], strict=True)])
        for m in MODES:
            f[f"wall {m}"] = statistics.median(wall[m])
            f[f"cpu {m}"] = statistics.median(cpu[m])
        opt.close()
    os.rmdir(root)
    return out


def table(
    res: dict[str, dict[str, float]], speed: float | None, raw: float | None = None
) -> list[str]:
    """The tables of :func:`paged`'s figures: each mode's medians, then the paired ratios
    with their 95 % intervals (with the floor, and each hashed / unhashed ratio over it,
    when ``speed``), then (when ``raw``, XXH3's own in-cache speed) the copy threads' paired
    extra CPU time against both floors."""
    head = "| residency | MiB hashed / step |" + "".join(
        f" wall {m} ms | CPU {m} ms |" for m in MODES)
    rows = [head, "|---" * (head.count("|") - 1) + "|"]
    for label, f in res.items():
        rows.append(f"| {label} | {f['hashed'] / MIB:.0f} |" + "".join(
            f" {f[f'wall {m}'] * 1e3:.1f} | {f[f'cpu {m}'] * 1e3:.1f} |" for m in MODES))
    head = "| residency |" + "".join(f" {p} |" for p in PAIRS) + (
        " floor |" + "".join(f" {p} over the floor |" for p in OVER) if speed else "")
    rows += ["", head, "|---" * (head.count("|") - 1) + "|"]
    for label, f in res.items():
        row = f"| {label} |" + "".join(
            f" {f[p] * 100:+.1f}% ({f[f'{p} lo'] * 100:+.1f}..{f[f'{p} hi'] * 100:+.1f}) |"
            for p in PAIRS)
        if speed:
            floor = f["hashed"] / speed / f["cpu off"]
            row += f" +{floor * 100:.1f}% |" + "".join(
                f" {f[p] / floor:.2f} x ({f[f'{p} lo'] / floor:.2f}..{f[f'{p} hi'] / floor:.2f}) |"
                for p in OVER)
        rows.append(row)
    if speed and raw and all("copy cpu on - off" in f for f in res.values()):
        rows += ["", "| residency | floor ms (in-cache speed above) | floor ms (XXH3's own speed) "
                 "| copy threads' CPU, on - off, ms | over the floor | over XXH3's own floor |",
                 "|---|---|---|---|---|---|"]
        for label, f in res.items():
            extra, slow, fast = f["copy cpu on - off"], f["hashed"] / speed, f["hashed"] / raw
            rows.append(f"| {label} | {slow * 1e3:.1f} | {fast * 1e3:.1f} | {extra * 1e3:+.1f} | "
                        f"{extra / slow:.2f} x | {extra / fast:.2f} x |")
    return rows


def disk_bound(n: int, rounds: int, page: int) -> tuple[list[str], str]:
    """Each residency in a child under a memory cgroup too small to cache the spill files:
    the table lines and a line saying how the cap was set (or why there was none)."""
    if rounds <= 0:
        return [], "skipped (--disk-rounds 0)"
    cap = detect_cap()
    if not cap.kind.startswith("cgroup"):
        return [], f"skipped: {cap.detail}"
    res, notes = {}, []
    for label in ON_DISK:
        frac = FRACTIONS[label]
        # params + grads + the optimizer's resident state + 420 MiB: the interpreter and torch
        # (264 MiB RSS after the imports here), the window and ~140 MiB for dirty spill pages
        # on their way out (40 MiB OOM-killed the 10 % child); less than the spill file (191
        # MiB at 50 % resident, 343 MiB at 10 %, at the default 50 M params), so it does not
        # stay in the page cache
        limit = 8 * n + int(8 * n * frac) + 420 * MIB
        cg, join = child_cgroup(cap, limit, "tightfit-bench-checksums")
        cmd = [sys.executable, __file__, "--child", label, "--params", str(n), "--rounds",
               str(rounds)]  # fmt: skip
        proc = subprocess.run(cmd, preexec_fn=join, capture_output=True, text=True)
        peak, kills = cgroup_figures(cap, cg)
        if proc.returncode != 0:
            notes.append(f"{label}: the child failed (exit {proc.returncode}, {kills} OOM kills)"
                         f": {proc.stderr.strip()[-300:]}")
            continue
        res.update(json.loads(proc.stdout.strip().splitlines()[-1]))
        notes.append(f"{label}: cap {limit / MIB:.0f} MiB, cgroup peak {(peak or 0) / MIB:.0f} "
                     f"MiB, {kills} OOM kills")
    return table(res, None), f"{cap.kind}; " + "; ".join(notes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--rounds", type=int, default=100, help="timed steps per optimizer")
    parser.add_argument("--disk-rounds", type=int, default=10,
                        help="the same under the cap (0: skip that section)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "checksums.md"))
    parser.add_argument("--child", choices=ON_DISK, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # one residency, printed as JSON, for disk_bound()
        print(json.dumps(paged(args.params, args.rounds, 8 * MIB, [args.child])))
        return 0
    load = os.getloadavg()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core each, as the copy worker hashes (xxhash is 1 thread)
    first = candidates(pages=40, rounds=3)
    speed = in_cache_speed()
    raw = raw_in_cache_speed()
    streaming = streaming_in_cache_speed()
    torch.set_num_threads(threads)
    second = table(paged(args.params, args.rounds, 8 * MIB, list(FRACTIONS)), speed, raw)
    load_mid = os.getloadavg()
    third, how = disk_bound(args.params, args.disk_rounds, 8 * MIB)
    load_end = os.getloadavg()
    v = versions()
    text = [
        "# Disk-tier checksums: candidates and cost in a paged step (CPU)",
        "",
        f"Written by `benchmarks/checksums.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores (torch {torch.get_num_threads()} "
        f"threads); load average (1 min) {load[0]:.2f} at the start, {load_mid[0]:.2f} after the "
        f"page-cache steps, {load_end[0]:.2f} at the end (other work shares the machine: "
        "compare modes only by their paired ratios)",
        f"- versions: python {v['python']}, torch {v['torch']}, xxhash {xxhash.VERSION}; "
        f"tightfit at commit {git_commit()}",
        "",
        "## Candidates (8 MiB pages, 320 MiB of sources: from RAM, not cache; 1 torch thread)",
        "",
        *first,
        "",
        f"XXH3-64 of a 256 KiB buffer in cache: {speed / 2**30:.1f} GiB/s on one core through "
        f"`checksum()` (best of 200; the floor below), {raw / 2**30:.1f} GiB/s for XXH3 itself "
        "on a memoryview (median of 2000; \"XXH3's own floor\": the one-shot digest of a chunk "
        f"the copy pass takes), {streaming / 2**30:.1f} GiB/s for a streaming `update` of the "
        "same bytes (median of 2000; what the copy pass paid per chunk until b10e237).",
        "",
        f"## PagedAdamW steps, checksums on vs off, spill files in the page cache "
        f"({args.params:,} fp32 params, 8 MiB pages, {args.rounds} rounds, medians)",
        "",
        "Every streamed page is verified when it is read in and hashed when it is written back:",
        "2 x the non-resident bytes per step. The spill files fit in the page cache, so these",
        "copies run at RAM speed. Modes, round-robin in one process (one residency at a time,",
        "the order reversed every other round): *on* the pager as it is (4 MiB stripes on the",
        "copy worker and the hash pool, each copied 256 KiB by 256 KiB and hashed in cache; the",
        "update leaves those threads their cores), *off* the same copy without the hash, and",
        "both with the update on every core (*all cores*, the pager until 37bf4bc).",
        "*floor*: the MiB hashed at the in-cache speed above, as a share of the off step's CPU",
        "time — the least any hash of every byte costs here. Ratios: the median over rounds of",
        "(one mode's step / the other's step of the same round) - 1, in brackets its 95 %",
        "bootstrap interval; the target is on / off at most 1.5 x the floor. The last table:",
        "the copy worker's and hash pool's own CPU time (`/proc/self/task/*/schedstat`), on",
        "minus off paired by round: what the hash costs on the threads that run it, apart from",
        "how that time lands on the update's threads.",
        "",
        *second,
        "",
        f"## The same under a memory cap: pages from and to the disk ({args.disk_rounds} rounds, "
        "medians)",
        "",
        f"Cap: {how}.",
        "",
        *third,
        "",
    ]
    Path(args.out).write_text("\n".join(text))
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
