"""Joining page views (``tightfit.paging.coalesce``) on its own: which segments become one run
and which stay apart — another param, a gap in the pages, another slab, a window slot, the
one-buffer-per-page format, a dtype/layout boundary, the length limit."""

from __future__ import annotations

import pytest
import torch

from tightfit.paging.coalesce import coalesce
from tightfit.paging.layout import StateSpec, build_pages
from tightfit.paging.paging_options import PagingOptions
from tightfit.paging.slab import Slab, page_runs, slabs_supported
from tightfit.paging.store import PageStore

PAGE = 4096
SPECS = [StateSpec("m", torch.float32), StateSpec("v", torch.float32)]

pytestmark = pytest.mark.skipif(not slabs_supported(), reason="slabs need madvise (Linux)")


def _setup(tmp_path, numels, dtypes=None, specs=SPECS, unit=1, slabs=True):
    """Params with gradients and a fully resident store holding their state."""
    dtypes = dtypes or [torch.float32] * len(numels)
    params = [torch.zeros(n, dtype=dt) for n, dt in zip(numels, dtypes)]
    for p in params:
        p.grad = torch.ones_like(p)
    store = PageStore(torch.device("cpu"), PagingOptions(PAGE, spill_dir=tmp_path), slabs=slabs)
    store.add_pages(build_pages(0, numels, dtypes, specs, unit, PAGE, first_index=0))
    store.materialize()
    return params, store


def _bucket(store, pages=None):
    return [(p, store.arrays(p)) for p in (store.pages if pages is None else pages)]


def _spans(runs) -> list[tuple[int, int, int]]:
    """``(id(param), start, end)`` of each run."""
    return [(id(p), a, b) for p, a, b, _ in runs]


def test_a_param_over_consecutive_slab_pages_is_one_view(tmp_path) -> None:
    params, store = _setup(tmp_path, [1500])  # 3 pages of one param, one slab
    assert len(store.pages) == 3
    (run,) = coalesce(params, _bucket(store), None)
    p, start, end, views = run
    assert p is params[0] and (start, end) == (0, 1500)
    first = store.arrays(store.pages[0])
    for name in ("m", "v"):  # every state array joined, over the slab's own memory
        assert views[name].numel() == 1500
        assert views[name].data_ptr() == first[name].data_ptr()
    views["m"].fill_(3.0)  # the joined view is the pages' memory, not a copy
    assert all(torch.all(store.arrays(pg)["m"] == 3.0) for pg in store.pages)
    store.close()


def test_params_sharing_a_page_stay_apart_and_gradless_ones_are_left_out(tmp_path) -> None:
    params, store = _setup(tmp_path, [100, 7, 200, 50])  # one page, back to back in memory
    params[2].grad = None
    runs = coalesce(params, _bucket(store), None)
    assert _spans(runs) == [(id(params[0]), 0, 100), (id(params[1]), 0, 7), (id(params[3]), 0, 50)]
    store.close()


def test_a_gap_in_the_pages_is_never_bridged(tmp_path) -> None:
    params, store = _setup(tmp_path, [2000])  # 4 pages of one param
    pages = store.pages
    runs = coalesce(params, _bucket(store, [pages[0], pages[1], pages[3]]), None)
    cap = pages[0].segments[0].length
    assert _spans(runs) == [(id(params[0]), 0, 2 * cap), (id(params[0]), 3 * cap, 2000)]
    store.close()


def test_views_in_other_slabs_or_in_no_slab_are_not_joined(tmp_path) -> None:
    params, store = _setup(tmp_path, [1500], slabs=False)  # one buffer per page
    cap = store.pages[0].segments[0].length
    expected = [(id(params[0]), k * cap, min(1500, (k + 1) * cap)) for k in range(3)]
    assert _spans(coalesce(params, _bucket(store), None)) == expected
    # the same pages in two slabs: joined within each, not across
    pages = store.pages
    first, second = Slab(pages[:2]), Slab(pages[2:])
    bucket = [(pages[0], first.views(pages[0])), (pages[1], first.views(pages[1])),
              (pages[2], second.views(pages[2]))]  # fmt: skip
    assert _spans(coalesce(params, bucket, None)) == [expected[0][:2] + (2 * cap,), expected[2]]
    # a window slot's views (plain tensors, as the sweep gives a streamed page) after a slab's
    slot = torch.zeros(pages[2].nbytes, dtype=torch.uint8)
    bucket[2] = (pages[2], pages[2].array_views(slot))
    assert _spans(coalesce(params, bucket, None)) == [expected[0][:2] + (2 * cap,), expected[2]]
    for slab in (first, second):
        slab.close()
    store.close()


def test_a_dtype_boundary_is_a_slab_boundary(tmp_path) -> None:
    dtypes = [torch.float32, torch.bfloat16]
    params, store = _setup(tmp_path, [1200, 1200], dtypes=dtypes)
    runs_of_pages = page_runs(store.pages)
    assert [{p.dtype for p in run} for run in runs_of_pages] == [{d} for d in dtypes]
    slabs = [store.arrays(run[0]).slab for run in runs_of_pages]
    assert slabs[0] is not slabs[1]
    for p, run in zip(params, runs_of_pages):  # each dtype's run joins within its own slab
        assert _spans(coalesce(params, _bucket(store, run), None)) == [(id(p), 0, 1200)]
    store.close()


def test_blockwise_arrays_join_with_their_codes(tmp_path) -> None:
    specs = [StateSpec("state1", torch.uint8), StateSpec("absmax1", torch.float32, 256)]
    params, store = _setup(tmp_path, [20 * 256], specs=specs, unit=256)
    assert len(store.pages) > 1
    (run,) = coalesce(params, _bucket(store), None)
    assert run[3]["state1"].numel() == 20 * 256 and run[3]["absmax1"].numel() == 20
    store.close()


@pytest.mark.parametrize("limit", [1, 600, 1100, 5000])
def test_joined_runs_stay_under_the_limit(tmp_path, limit) -> None:
    params, store = _setup(tmp_path, [2000])
    cap = store.pages[0].segments[0].length  # 512 elements a page
    runs = coalesce(params, _bucket(store), limit)
    lengths = [b - a for _, a, b, _ in runs]
    assert sum(lengths) == 2000 and [a for _, a, _, _ in runs] == sorted(a for _, a, _, _ in runs)
    # a run grows by whole pages while it stays within the limit (one page always fits)
    per_run = max(1, limit // cap)
    assert lengths == [min(per_run * cap, 2000 - k) for k in range(0, 2000, per_run * cap)]
    store.close()
