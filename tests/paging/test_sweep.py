"""The step sweep on its own (a page store, no optimizer): each page updated once, resident pages
in batches by layout, streamed pages through the window, marks, and a failure part-way."""

from __future__ import annotations

import pytest
import torch

from tightfit.paging.layout import Page, StateSpec, build_pages
from tightfit.paging.paging_options import PagingOptions
from tightfit.paging.store import PageStore
from tightfit.paging.sweep import sweep

from ..tiers.counting import CountingEngine

PAGE = 4096  # bytes: at most 512 elements of two fp32 arrays
SPECS = [StateSpec("m", torch.float32), StateSpec("v", torch.float32)]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _store(tmp_path, budget: int | None, dtypes=(torch.float32,) * 3, numels=(2500, 7, 2000),
           ) -> PageStore:  # fmt: skip
    """A store with one group's pages (9 pages, the last one partly filled, by default)."""
    store = PageStore(torch.device("cpu"), PagingOptions(PAGE, budget, spill_dir=tmp_path),
                      engine=CountingEngine())
    store.add_pages(build_pages(0, list(numels), list(dtypes), SPECS, 1, PAGE, first_index=0))
    store.materialize()
    return store


class Recorder:
    """An update that adds 1 to every state value it is given and records each call."""

    def __init__(self, store: PageStore, fail_at: int | None = None) -> None:
        self.store, self.fail_at = store, fail_at
        self.calls: list[list[Page]] = []
        self.owned: list[bool] = []  # per call: the arrays are the store's own (resident)
        self.slot_ptrs: dict[int, int] = {}  # streamed page index -> its arrays' address
        self.loaded_at: list[int] = []  # engine.loaded when each call started

    def __call__(self, items: list[tuple[Page, dict[str, torch.Tensor]]]) -> None:
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            self.fail_at = None
            raise torch.OutOfMemoryError("fake: could not allocate 2.00 MiB")
        self.calls.append([page for page, _ in items])
        self.owned.append(all(page.owns(arrays) for page, arrays in items))
        self.loaded_at.append(self.store.engine.loaded)
        for page, arrays in items:
            if not page.owns(arrays):
                self.slot_ptrs[page.index] = arrays["m"].data_ptr()
            for view in arrays.values():
                view.add_(1)


def _values(store: PageStore) -> list[float]:
    """Each page's state value (all of a page's values are equal in these tests)."""
    out = []
    for page in store.pages:
        arrays = page.array_views(store.read_page(page))
        values = torch.cat([a for a in arrays.values()])
        assert torch.all(values == values[0]), "a page was updated in part"
        out.append(values[0].item())
    return out


@pytest.mark.parametrize("budget", [None, 5 * PAGE, 2 * PAGE], ids=["all", "some", "none"])
def test_every_page_is_updated_exactly_once(tmp_path, budget) -> None:
    store = _store(tmp_path, budget)
    streamed = [p for p in store.pages if p.tier != "device"]
    update = Recorder(store)
    sweep(store, store.pages, 1, update)
    assert _values(store) == [1.0] * len(store.pages)
    done = [p.index for call in update.calls for p in call]
    assert sorted(done) == [p.index for p in store.pages]  # once each
    assert all(p.updated_step == 1 for p in store.pages)
    # a streamed page is a call of its own, on window-slot views; resident pages on the
    # store's own arrays, in batches
    for call, owned in zip(update.calls, update.owned):
        assert owned == (call[0].tier == "device")
        assert owned or len(call) == 1
    # each streamed page copied in once and written back once: its spill copy is current
    engine = store.engine
    assert engine.counts() == (sum(p.nbytes for p in streamed),) * 2 + (0,)
    assert all(p.spill_valid == (p.tier == "disk") for p in store.pages)
    store.close()


def test_pages_already_marked_are_skipped_and_unlisted_pages_untouched(tmp_path) -> None:
    store = _store(tmp_path, 2 * PAGE)  # everything streams
    pages = store.pages
    sweep(store, pages[:4], 1, Recorder(store))
    again = Recorder(store)
    sweep(store, pages, 1, again)  # the same step: only the pages not yet done
    assert [p.index for call in again.calls for p in call] == [p.index for p in pages[4:]]
    assert _values(store) == [1.0] * len(pages)
    loaded = store.engine.loaded
    sweep(store, pages[:2], 2, Recorder(store))  # a later step, two pages with gradients
    assert _values(store) == [2.0, 2.0] + [1.0] * (len(pages) - 2)
    assert store.engine.loaded - loaded == pages[0].nbytes + pages[1].nbytes  # no others read
    store.close()


def test_resident_pages_go_in_batches_of_one_layout_between_streamed_pages(tmp_path) -> None:
    dtypes = (torch.float32, torch.bfloat16, torch.float32)  # two layouts in one group
    store = _store(tmp_path, 10 * PAGE, dtypes=dtypes, numels=(2000, 1500, 2000))
    streamed = [p for p in store.pages if p.tier != "device"]
    assert streamed and len(store.pages) - len(streamed) > len(streamed) + 1
    update = Recorder(store)
    sweep(store, store.pages, 1, update)
    for call in update.calls:  # never two layouts in one call
        assert len({(p.group, p.dtype, tuple(p.arrays)) for p in call}) == 1
    # resident work before the first streamed page, and after each one
    kinds = "".join("R" if owned else "S" for owned in update.owned)
    assert kinds.startswith("R") and kinds.endswith("R") and "SS" not in kinds
    assert kinds.count("S") == len(streamed)
    store.close()


@pytest.mark.parametrize(("budget", "slots"), [(PAGE, 1), (2 * PAGE, 2), (5 * PAGE, 2)])
def test_the_window_loads_ahead_by_its_slots_and_reuses_them(tmp_path, budget, slots) -> None:
    store = _store(tmp_path, budget)
    assert len(store.slots) == slots
    streamed = [p for p in store.pages if p.tier != "device"]
    update = Recorder(store)
    sweep(store, store.pages, 1, update)
    starts = [lo for lo, owned in zip(update.loaded_at, update.owned) if not owned]
    for i, loaded in enumerate(starts):  # page i is updated with pages < i + slots loaded
        assert loaded == sum(p.nbytes for p in streamed[: min(len(streamed), i + slots)])
    ptrs = [update.slot_ptrs[p.index] for p in streamed]
    assert len(set(ptrs)) == slots and all(ptrs[i] == ptrs[i % slots] for i in range(len(ptrs)))
    store.close()


@pytest.mark.parametrize("fail_at", [0, 3, 7])
def test_an_error_part_way_leaves_done_pages_marked_and_written_back(tmp_path, fail_at) -> None:
    store = _store(tmp_path, 5 * PAGE)  # 3 pages resident, 6 streamed
    update = Recorder(store, fail_at=fail_at)
    with pytest.raises(torch.OutOfMemoryError):
        sweep(store, store.pages, 1, update)
    done = {p.index for call in update.calls for p in call}
    assert {p.index for p in store.pages if p.updated_step == 1} == done
    # what was updated is in the pages (streamed ones written back before the error surfaced)
    assert _values(store) == [1.0 if p.index in done else 0.0 for p in store.pages]
    sweep(store, store.pages, 1, Recorder(store))  # run again for the same step
    assert _values(store) == [1.0] * len(store.pages)  # every page once, none twice
    store.close()


class ThreadRecorder(Recorder):
    """A :class:`Recorder` that also notes torch's intra-op threads in each call."""

    def __init__(self, store: PageStore, fail_at: int | None = None) -> None:
        super().__init__(store, fail_at)
        self.threads: list[int] = []

    def __call__(self, items: list[tuple[Page, dict[str, torch.Tensor]]]) -> None:
        self.threads.append(torch.get_num_threads())
        super().__call__(items)


@pytest.fixture
def four_threads(one_thread):  # noqa: ANN001, ANN201 (after the module's one_thread)
    torch.set_num_threads(4)
    yield


@pytest.mark.usefixtures("four_threads")
@pytest.mark.parametrize(("budget", "inside"), [(None, 4), (5 * PAGE, 3), (2 * PAGE, 3)],
                         ids=["all", "some", "none"])
def test_streaming_on_the_cpu_leaves_the_copies_a_core_and_restores_the_threads(
    tmp_path, budget, inside
) -> None:
    # a 4 KiB page is one checksum stripe: one copy thread at a time, so the update (resident
    # batches and streamed pages alike) runs on three of the four threads while copies are
    # in flight (here always: the queue never reads as idle; tests/tiers/test_copy.py has
    # the idle case)
    store = _store(tmp_path, budget)
    store.engine._pool.idle = lambda: False
    update = ThreadRecorder(store)
    sweep(store, store.pages, 1, update)
    assert set(update.threads) == {inside}
    assert torch.get_num_threads() == 4
    store.close()


@pytest.mark.usefixtures("four_threads")
def test_the_threads_come_back_when_an_update_fails(tmp_path) -> None:
    store = _store(tmp_path, 5 * PAGE)
    store.engine._pool.idle = lambda: False
    update = ThreadRecorder(store, fail_at=2)
    with pytest.raises(torch.OutOfMemoryError):
        sweep(store, store.pages, 1, update)
    assert update.threads == [3, 3, 3] and torch.get_num_threads() == 4
    store.close()


@pytest.mark.usefixtures("four_threads")
def test_a_resident_batch_larger_than_the_window_keeps_every_thread(tmp_path) -> None:
    # 18 pages, 14 resident and 4 streamed through 2 slots: a resident batch of 3 pages
    # outlasts any copy in flight (at most the window's 2 pages), one of 2 does not
    store = _store(tmp_path, 16 * PAGE, numels=(2500, 7, 6000))
    store.engine._pool.idle = lambda: False
    update = ThreadRecorder(store)
    sweep(store, store.pages, 1, update)
    window = sum(slot.numel() for slot in store.slots)
    for call, threads in zip(update.calls, update.threads, strict=True):
        assert threads == (4 if sum(p.nbytes for p in call) > window else 3), call
    assert 4 in update.threads and 3 in update.threads
    store.close()
