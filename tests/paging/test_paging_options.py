"""``PagingOptions``: the store's options, checked once when made (also when
``OptimizerOptions`` makes them), never again downstream."""

from __future__ import annotations

import pytest

from tightfit.optim.optimizer_options import OptimizerOptions
from tightfit.paging.paging_options import DEFAULT_PAGE_BYTES, PagingOptions


def test_the_defaults() -> None:
    assert PagingOptions() == PagingOptions(DEFAULT_PAGE_BYTES, None, None, None)
    assert DEFAULT_PAGE_BYTES == 8 << 20


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"page_bytes": 0}, ValueError, "page_bytes=0 must be a positive int"),
    ({"page_bytes": True}, ValueError, "page_bytes=True must be a positive int"),
    ({"page_bytes": 4096, "device_budget": 4095}, ValueError, "device_budget=4095 is below one page"),
    ({"device_budget": -1}, ValueError, "device_budget=-1 is negative"),
    ({"host_budget": 1.5}, TypeError, "host_budget must be an int number of bytes"),
])  # fmt: skip
def test_bad_values_are_refused(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        PagingOptions(**kwargs)


def test_paging_options_are_checked_once_when_made(tmp_path) -> None:
    with pytest.raises(ValueError, match="host_budget=100 is below one page"):
        PagingOptions(4096, host_budget=100)
    with pytest.raises(ValueError, match="host_budget=100 is below one page"):
        OptimizerOptions(page_bytes=4096, host_budget=100)  # at once, not when training starts
    with pytest.raises(ValueError, match="page_bytes=0 must be a positive int"):
        OptimizerOptions(page_bytes=0)
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        PagingOptions(spill_dir=tmp_path / "f")
