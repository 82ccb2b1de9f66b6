"""torch.optim's API on the paged optimizers (issue 16, items 2-4): every state-dict hook runs
as torch runs it, named parameters are taken and carried in state dicts, and ``deepcopy`` /
``pickle`` give a working optimizer, resident or paged out to disk. Each behaviour is checked
side by side with ``torch.optim.AdamW`` doing the same."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from tightfit.optim.adamw import PagedAdamW
from tightfit.optim.adamw8bit import PagedAdamW8bit
from tightfit.optim.lion import PagedLion
from tightfit.optim.sgd import PagedSGD

BUDGETS = {"resident": {}, "disk": {"page_bytes": 4096, "device_budget": 4096}}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _both(budget: str = "resident", **kw):
    """The same params under torch's AdamW and ours."""
    ref = [torch.randn(30, 40, requires_grad=True), torch.randn(7, requires_grad=True)]
    ours = [p.detach().clone().requires_grad_(True) for p in ref]
    return (ref, torch.optim.AdamW(ref, **kw)), (ours, PagedAdamW(ours, **kw, **BUDGETS[budget]))


def _grads(*param_lists, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for ps in zip(*param_lists):
        g = torch.randn(ps[0].shape, generator=gen)
        for p in ps:
            p.grad = g.clone()


# ---------------------------------------------------------------- item 2: hooks
def test_state_dict_pre_and_post_hooks_run_as_torchs() -> None:
    def pre(opt):
        opt.state["test"] = 1

    def post(opt, sd):
        sd["ran"] = sd["state"].pop("test", None) == 1
        return sd

    for _, opt in _both():
        opt.register_state_dict_pre_hook(pre)
        opt.register_state_dict_post_hook(post)
        sd = opt.state_dict()
        assert sd["ran"] is True and "test" not in sd["state"]


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_a_post_hook_sees_the_moments_and_its_edits_land(budget) -> None:
    (ref, ref_opt), (ours, opt) = _both(budget)
    _grads(ref, ours)
    ref_opt.step()
    opt.step()
    seen = {}

    def post(o, sd):
        seen[o] = sorted(sd["state"][0])
        sd["state"][0]["exp_avg"].zero_()  # torch's state dict shares the live tensors

    for o in (ref_opt, opt):
        o.register_state_dict_post_hook(post)
        o.state_dict()
    assert seen[opt] == seen[ref_opt] == ["exp_avg", "exp_avg_sq", "step"]
    assert opt.state[ours[0]]["exp_avg"].abs().max() == 0  # the edit reached the pages
    _grads(ref, ours, seed=1)
    ref_opt.step()
    opt.step()
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-7)
    opt.close()


def test_load_state_dict_hooks_run_in_torchs_order_with_prepend() -> None:
    def set_lr(value):
        def hook(opt, sd):
            sd["param_groups"][0]["lr"] = value
        return hook

    def replace(opt, sd):  # a pre hook may return a replacement state dict
        sd = copy.deepcopy(sd)
        sd["param_groups"][0]["lr"] = 0.003
        return sd

    def post(opt):
        opt.state["ran_post"] = opt.param_groups[0]["lr"]

    results = []
    for _, opt in _both():
        sd = opt.state_dict()
        opt.register_load_state_dict_pre_hook(set_lr(0.002))
        opt.load_state_dict(sd)
        first = opt.param_groups[0]["lr"]
        opt.register_load_state_dict_pre_hook(replace, prepend=True)
        opt.register_load_state_dict_post_hook(post)
        opt.load_state_dict(sd)
        results.append((first, opt.param_groups[0]["lr"], opt.state["ran_post"]))
    assert results[0] == results[1] == (0.002, 0.002, 0.002)


def test_state_under_other_keys_passes_through_as_in_torch() -> None:
    for _, opt in _both():
        opt.state["counter"] = 5
        opt.load_state_dict(opt.state_dict())
        assert opt.state["counter"] == 5


# ---------------------------------------------------------------- item 3: named params
def test_named_parameters_are_taken_and_carried_in_state_dicts() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    names = [n for n, _ in model.named_parameters()]
    ref = torch.optim.AdamW(model.named_parameters())
    opt = PagedAdamW(model.named_parameters())
    for o in (ref, opt):
        model(torch.randn(2, 4)).sum().backward()
        o.step()
    assert opt.state_dict()["param_groups"][0]["param_names"] == names
    assert opt.param_groups[0]["param_names"] == ref.param_groups[0]["param_names"] == names
    plain = PagedAdamW(model.parameters())  # loads a named state dict: names carried over
    plain.load_state_dict(opt.state_dict())
    assert plain.state_dict()["param_groups"][0]["param_names"] == names
    named = PagedAdamW(model.named_parameters())  # and a named one loads an unnamed one
    named.load_state_dict(PagedAdamW(model.parameters()).state_dict())
    assert named.state_dict()["param_groups"][0]["param_names"] == names
    for o in (opt, plain, named):
        o.close()


def test_mixed_names_raise_torchs_errors() -> None:
    w, b = torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)
    for cls in (torch.optim.AdamW, PagedAdamW):
        with pytest.raises(ValueError, match="Some param names are missing"):
            cls([("w", w), b])
        opt = cls([("w", w)])
        with pytest.raises(ValueError, match="cannot add param group without names"):
            opt.add_param_group({"params": [b]})
    assert len(opt.param_groups) == 1 and len(opt.pager.pages) == 1  # nothing was added


# ---------------------------------------------------------------- item 4: copies
@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_is_a_working_optimizer(how, budget) -> None:
    (ref, ref_opt), (ours, opt) = _both(budget, weight_decay=0.1)
    for k in range(3):
        _grads(ref, ours, seed=k)
        ref_opt.step()
        opt.step()
    if how == "deepcopy":
        twin = copy.deepcopy(opt)
    elif how == "pickle":
        twin = pickle.loads(pickle.dumps(opt))
    else:
        buf = io.BytesIO()
        torch.save(opt, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    copies = twin.param_groups[0]["params"]
    assert all(c is not o and torch.equal(c, o) for c, o in zip(copies, ours))
    assert twin.memory_stats()["device_budget"] == opt.memory_stats()["device_budget"]
    public = {k for k in vars(opt) if not k.startswith("_")}
    assert public == {k for k in vars(twin) if not k.startswith("_")}
    for k in range(3, 6):  # the copy continues exactly as the original and as torch
        _grads(ref, ours, copies, seed=k)
        ref_opt.step()
        opt.step()
        twin.step()
    for r, o, c in zip(ref, ours, copies):
        torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-7)
        assert torch.equal(c, o)
    assert twin.pager is not opt.pager
    twin.close()
    opt.step()  # closing the copy leaves the original alone
    opt.close()


@pytest.mark.parametrize("cls", [PagedSGD, PagedLion, PagedAdamW8bit])
def test_every_class_copies(cls) -> None:
    p = torch.randn(5000, requires_grad=True)
    kw = {"momentum": 0.9} if cls is PagedSGD else {}
    opt = cls([p], **kw)
    p.grad = torch.randn_like(p)
    opt.step()
    twin = copy.deepcopy(opt)
    q = twin.param_groups[0]["params"][0]
    p.grad = torch.randn_like(p)
    q.grad = p.grad.clone()
    opt.step()
    twin.step()
    assert torch.equal(p, q)
    for o in (opt, twin):
        o.close()


def test_a_closed_optimizer_refuses_to_be_copied() -> None:
    _, (_, opt) = _both()
    opt.close()
    with pytest.raises(RuntimeError, match="was closed; make a new optimizer"):
        copy.deepcopy(opt)
