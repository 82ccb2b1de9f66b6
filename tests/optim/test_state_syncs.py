"""``state_dict()`` and ``save()`` of a paged optimizer with an accelerator's tiers make a fixed
number of synchronizations and scalar reads, not three syncs per page and a read per param
(issue 25 finding 12): counted by the strict CUDA emulation (``tests/tiers/strict_cuda.py``)
with 4 and 16 params over device, host and disk pages.

Not counted: its "blocking copies". The emulation's device is the CPU, so every CPU tensor but
a pinned one is device memory to it, and the pages read back into CPU memory (host and disk
pages alike) look like device reads; on CUDA only a device-tier page's read is one, and that
read is what the host asked for (one per device-resident page)."""

from __future__ import annotations

import pytest
import torch

from tightfit.optim.adamw import PagedAdamW
from tightfit.optim.base import PagedOptimizer
from tightfit.paging.paging_options import PagingOptions
from tightfit.paging.store import PageStore

from ..tiers.strict_pinned import strict_pinned  # noqa: F401 (the fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
PAGE = 64 << 10


@pytest.fixture
def accelerator(monkeypatch):  # noqa: ANN001, ANN201
    def new_store(self: PagedOptimizer, device: torch.device, paging: PagingOptions) -> PageStore:
        return PageStore(device, paging, slabs=False, emulate_accelerator=True)

    monkeypatch.setattr(PagedOptimizer, "_new_store", new_store)


def _counted(emu) -> int:  # noqa: ANN001
    return sum(v for k, v in emu.syncs.items() if k != "blocking copy")


def _syncs(emu, n: int, tmp_path) -> tuple[int, int, int]:  # noqa: ANN001
    params = [torch.nn.Parameter(torch.randn(20_000)) for _ in range(n)]
    state = 2 * 4 * 20_000 * n  # two fp32 moments
    opt = PagedAdamW(params, lr=1e-2, page_bytes=PAGE, device_budget=state // 3,
                     host_budget=state // 3)
    try:
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        tiers = {p.tier for p in opt.pager.pages}
        assert tiers == {"device", "host", "disk"}
        emu.synchronize()
        before = _counted(emu)
        sd = opt.state_dict()
        after_sd = _counted(emu)
        opt.save(tmp_path / f"state{n}.pages")
        after_save = _counted(emu)
        assert len(sd["state"]) == n
        return len(opt.pager.pages), after_sd - before, after_save - after_sd
    finally:
        opt.close()


def test_state_dict_and_save_sync_a_fixed_number_of_times(accelerator, strict_cuda, strict_pinned,  # noqa: F811
                                                          tmp_path) -> None:  # fmt: skip
    few = _syncs(strict_cuda, 4, tmp_path)
    many = _syncs(strict_cuda, 16, tmp_path)
    assert many[0] > few[0]  # more pages, more params: the same count
    assert many[1:] == few[1:] and max(few[1:]) <= 3, (few, many)
