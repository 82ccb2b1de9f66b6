"""fix_mmap_threshold: freed tensors leave the RSS (what a memory cgroup and the preflight count)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# a freed 16 MiB block raises glibc's dynamic threshold to 16 MiB (up to 32 MiB): then
# 8 MiB tensors come from the heap, and their pages stay mapped once freed
SCRIPT = textwrap.dedent("""
    import sys, torch
    from tightfit.measure import heap
    fixed = sys.argv[1] == "fixed"
    if fixed:
        assert heap.fix_mmap_threshold()
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096
    big = torch.ones(16 << 18)  # 16 MiB, mmapped, then freed: the threshold grows unless fixed
    del big
    before = rss()
    keep = [torch.ones(2 << 20) for _ in range(16)]  # 16 x 8 MiB
    keep += [torch.ones(16)]  # a small block above them keeps the heap's top from shrinking
    del keep[:-1]
    print((rss() - before) >> 20)
""")


def _left_mib(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_fixed_threshold_hands_freed_tensors_back() -> None:
    assert _left_mib("fixed") < 8
    # without it the heap keeps them, the case it fixes: all 128 MiB, or, where free trims the
    # heap's top, what the trim threshold keeps (it grows with the mmap threshold: 2 x 16 MiB)
    assert _left_mib("dynamic") >= 24
