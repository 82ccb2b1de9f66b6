"""Page layout: every element's state in exactly one page, aligned, within page_bytes."""

from __future__ import annotations

import math

import pytest
import torch

from tightfit.paging.layout import StateSpec, build_pages, page_capacity

ADAM = [StateSpec("exp_avg", torch.float32), StateSpec("exp_avg_sq", torch.float32)]
EIGHT_BIT = [StateSpec("state1", torch.uint8), StateSpec("absmax1", torch.float32, block=256),
             StateSpec("state2", torch.uint8), StateSpec("absmax2", torch.float32, block=256)]


def _coverage(pages, numels):
    seen = [torch.zeros(n, dtype=torch.int32) for n in numels]
    for page in pages:
        for s in page.segments:
            seen[s.param][s.start : s.start + s.length] += 1
    return seen


def test_capacity_fills_the_page() -> None:
    assert page_capacity(ADAM, 1, 4096) == 512
    assert page_capacity(ADAM, 1, 4096 + 7) == 512


@pytest.mark.parametrize(("specs", "unit"), [(ADAM, 1), (EIGHT_BIT, 256)])
def test_every_element_once_and_pages_within_budget(specs, unit) -> None:
    numels = [1, 7, 4097, 300, 20_000, 3]
    page_bytes = 8192
    pages = build_pages(0, numels, [torch.float32] * len(numels), specs, unit, page_bytes, 0)
    assert all(bool((c == 1).all()) for c in _coverage(pages, numels))
    assert [p.index for p in pages] == list(range(len(pages)))
    for page in pages:
        assert page.nbytes <= page_bytes
        buf = torch.zeros(page.nbytes, dtype=torch.uint8)
        views = page.segment_views(buf)
        ends = []
        for k, seg in enumerate(page.segments):
            # params start, and large params split, on unit boundaries: a 256-element
            # quantization block never straddles two params or two pages
            assert seg.offset % unit == 0 and seg.start % unit == 0
            ends.append(seg.offset + seg.length)
            for spec in specs:
                assert views[spec.name][k].numel() == math.ceil(seg.length / spec.block)
                assert views[spec.name][k].dtype == spec.dtype
        # the views of different segments never overlap
        for name in views:
            for k, v in enumerate(views[name]):
                v.fill_(k + 1) if v.dtype == torch.uint8 else v.fill_(float(k + 1))
            for k, v in enumerate(views[name]):
                assert bool((v == k + 1).all())


def test_small_params_share_a_page_and_dtypes_do_not() -> None:
    numels = [3, 5, 7, 11]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    pages = build_pages(2, numels, dtypes, ADAM, 1, 1 << 20, first_index=10)
    assert [p.dtype for p in pages] == [torch.float32, torch.bfloat16]
    assert [[s.param for s in p.segments] for p in pages] == [[0, 2], [1, 3]]
    assert [p.index for p in pages] == [10, 11] and all(p.group == 2 for p in pages)
    assert pages[0].elements == 10 and pages[0].nbytes == 128  # 2 arrays, 64-byte aligned


def test_page_too_small_for_one_unit() -> None:
    with pytest.raises(ValueError, match="page_bytes=100 cannot hold"):
        build_pages(0, [10_000], [torch.float32], EIGHT_BIT, 256, 100, 0)
