"""The paging options, defined once (``tightfit.optim.optimizer_options``) and taken by every paged
optimizer after torch's own arguments: they reach the store, and a keyword no optimizer knows
still raises ``TypeError`` before anything exists."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

from tightfit.optim import optimizer_options
from tightfit.optim.adamw import PagedAdam, PagedAdamW
from tightfit.optim.adamw8bit import PagedAdam8bit, PagedAdamW8bit
from tightfit.optim.lion import PagedLion, PagedLion8bit
from tightfit.optim.sgd import PagedSGD
from tightfit.pressure.probes import FakeProbe

CLASSES = [PagedAdamW, PagedAdam, PagedAdamW8bit, PagedAdam8bit, PagedLion, PagedLion8bit,
           PagedSGD]  # fmt: skip
# torch's (or bitsandbytes') own arguments, in the order each signature shows them
TORCH_ARGS = {
    PagedAdamW: ["params", "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize",
                 "foreach", "capturable", "differentiable", "fused"],
    PagedAdamW8bit: ["params", "lr", "betas", "eps", "weight_decay", "min_8bit_size", "backend",
                     "foreach", "fused", "capturable", "differentiable"],
    PagedLion: ["params", "lr", "betas", "weight_decay", "foreach", "fused", "capturable", "differentiable"],
    PagedLion8bit: ["params", "lr", "betas", "weight_decay", "min_8bit_size", "backend",
                    "foreach", "fused", "capturable", "differentiable"],
    PagedSGD: ["params", "lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize",
               "foreach", "differentiable", "fused", "capturable"],
}  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_the_options_and_their_defaults_are_one_list() -> None:
    assert set(optimizer_options.PagingOptions.__optional_keys__) == set(optimizer_options.DEFAULTS)
    assert optimizer_options.DEFAULTS["page_bytes"] == optimizer_options.DEFAULT_PAGE_BYTES == 8 << 20


@pytest.mark.parametrize("cls", list(TORCH_ARGS))
def test_signatures_show_torchs_arguments_then_the_paging_options(cls) -> None:
    params = list(inspect.signature(cls).parameters.values())
    assert [p.name for p in params[:-1]] == TORCH_ARGS[cls]
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD and params[-1].name == "paging"
    assert "PagingOptions" in cls.__doc__  # documented once, referenced here


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("keyword", ["page_size", "nesterov_momentum", "budget"])
def test_an_unknown_keyword_raises_type_error_and_changes_nothing(cls, keyword, tmp_path) -> None:
    with pytest.raises(TypeError, match=f"got an unexpected keyword argument '{keyword}'"):
        cls([torch.randn(5000)], spill_dir=tmp_path, **{keyword: 1})
    assert os.listdir(tmp_path) == []  # no spill folder made


@pytest.mark.parametrize(("cls", "keyword"), [(PagedAdamW, "momentum"), (PagedLion, "eps"),
                                              (PagedSGD, "betas"), (PagedLion8bit, "amsgrad")])
def test_another_optimizers_hyperparameter_is_an_unknown_keyword(cls, keyword) -> None:
    with pytest.raises(TypeError, match=f"{cls.__name__}.__init__.. got an unexpected keyword"):
        cls([torch.randn(10)], **{keyword: 0.9})


@pytest.mark.parametrize("cls", CLASSES)
def test_every_option_reaches_the_store(cls, tmp_path) -> None:
    p = torch.randn(100_000)  # more state than the device budget, 8-bit included
    probe = FakeProbe(1 << 30, [lambda: 0])
    kw = {"momentum": 0.9} if cls is PagedSGD else {}
    opt = cls([p], page_bytes=16 << 10, device_budget=64 << 10, host_budget=32 << 10,
              spill_dir=tmp_path, target=1 << 29, probe=probe, **kw)  # fmt: skip
    p.grad = torch.randn_like(p)
    opt.step()
    stats = opt.memory_stats()
    assert (stats["page_bytes"], stats["device_budget"]) == (16 << 10, 64 << 10)
    assert stats["host_budget"] is None  # on the CPU the next tier is disk
    assert stats["spill_dir"].startswith(str(tmp_path)) and stats["disk_bytes"] > 0
    assert stats["target_bytes"] == 1 << 29 and probe.reads > 0
    opt.close()
