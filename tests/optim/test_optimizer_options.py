"""The paging options, defined once (``tightfit.paging.paging_options.PagingOptions``) and
taken by every paged optimizer after torch's own arguments: as ``paging=`` or as its fields'
keywords, they reach the store unchanged, and a keyword no optimizer knows still raises
``TypeError`` before anything exists. ``OptimizerOptions`` (one object for ``optimizer_for``)
makes its ``PagingOptions`` once."""

from __future__ import annotations

import dataclasses
import inspect
import os

import pytest
import torch
from torch import nn

from tightfit.optim import registry
from tightfit.optim.adamw import PagedAdam, PagedAdamW
from tightfit.optim.adamw8bit import PagedAdam8bit, PagedAdamW8bit
from tightfit.optim.lion import PagedLion, PagedLion8bit
from tightfit.optim.optimizer_options import KINDS, RECIPE_LR, OptimizerOptions
from tightfit.optim.registry import optimizer_for
from tightfit.optim.sgd import PagedSGD
from tightfit.paging.paging_options import DEFAULT_PAGE_BYTES, PagingOptions

from ..pressure.fakes import FakeProbe

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
    assert [f.name for f in dataclasses.fields(PagingOptions)] == [
        "page_bytes", "device_budget", "host_budget", "spill_dir"]  # fmt: skip
    assert PagingOptions().page_bytes == DEFAULT_PAGE_BYTES == 8 << 20
    assert OptimizerOptions().paging == PagingOptions()  # page_bytes None: the pager's default
    assert [*registry.CLASSES, "adamw"] == list(KINDS)


def test_the_learning_rate_defaults() -> None:
    # the recipe's lr is OptimizerOptions' (and so optimizer_for's and tightfit train's); the
    # classes are drop-ins for torch's and keep torch's defaults
    assert OptimizerOptions().lr == RECIPE_LR == 2e-4
    assert inspect.signature(PagedAdamW).parameters["lr"].default == 1e-3  # torch.optim.AdamW
    assert inspect.signature(PagedSGD).parameters["lr"].default == 1e-3  # torch.optim.SGD
    assert inspect.signature(PagedLion).parameters["lr"].default == 1e-4  # bitsandbytes' Lion
    model = nn.Linear(4, 4)
    with optimizer_for(model, target=None) as opt:
        assert opt.param_groups[0]["lr"] == RECIPE_LR


@pytest.mark.parametrize("cls", list(TORCH_ARGS))
def test_signatures_show_torchs_arguments_then_the_paging_options(cls) -> None:
    params = list(inspect.signature(cls).parameters.values())
    assert [p.name for p in params[:-1]] == TORCH_ARGS[cls]
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD and params[-1].name == "paging_kw"
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


@pytest.mark.parametrize("cls", [PagedAdamW, PagedAdamW8bit, PagedSGD])
def test_one_paging_object_reaches_the_store_unchanged(cls, tmp_path) -> None:
    paging = PagingOptions(16 << 10, 64 << 10, None, tmp_path)
    opt = cls([torch.randn(100_000)], paging=paging)
    assert opt.pager.options is paging
    assert cls([torch.randn(10)], paging=paging, page_bytes=16 << 10).pager.options is paging
    with pytest.raises(ValueError, match="paging=PagingOptions.*device_budget=None"):
        cls([torch.randn(10)], paging=paging, device_budget=None)  # contradicts it
    opt.close()


def test_optimizer_for_takes_one_options_object_and_refuses_contradicting_keywords() -> None:
    model = nn.Linear(8, 8)
    options = OptimizerOptions(kind="paged_sgd", lr=0.1, target=None, extra={"momentum": 0.9})
    with optimizer_for(model, options) as opt:
        assert type(opt) is PagedSGD and opt.pager.options is options.paging
        assert opt.param_groups[0]["momentum"] == 0.9
    with optimizer_for(model, options, lr=0.1, nesterov=True) as opt:  # agrees, adds a keyword
        assert opt.param_groups[0]["nesterov"]
    with pytest.raises(ValueError, match=r"options.lr=0.1 and lr=0.01"):
        optimizer_for(model, options, lr=0.01)
    with pytest.raises(ValueError, match=r"options.extra\['momentum'\]=0.9 and momentum=0.5"):
        optimizer_for(model, options, momentum=0.5)
    with pytest.raises(TypeError, match="pass the kind as kind='paged_sgd'"):
        optimizer_for(model, "paged_sgd")  # type: ignore[arg-type]
