"""Every input torch's AdamW/Adam/SGD take (issue 16, items 5-7): float64, complex, strided
and channels_last params, meta params, a Tensor lr, param groups edited directly, torch's
flags on every paged class, torch's validations and the AMP scaler's attributes. Each is
checked against torch doing the same, resident and paged out to disk."""

from __future__ import annotations

import pytest
import torch

from tightfit.optim.adamw import PagedAdam, PagedAdamW
from tightfit.optim.adamw8bit import PagedAdam8bit, PagedAdamW8bit
from tightfit.optim.lion import PagedLion, PagedLion8bit
from tightfit.optim.sgd import PagedSGD

BUDGETS = {"resident": {}, "disk": {"page_bytes": 4096, "device_budget": 4096}}
KERNELS = {"default": {}, "fused": {"fused": True}, "foreach": {"foreach": True},
           "forloop": {"foreach": False}}  # fmt: skip
ALL = [PagedAdamW, PagedAdam, PagedAdamW8bit, PagedAdam8bit, PagedLion, PagedLion8bit, PagedSGD]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _run(make_params, torch_cls, paged_cls, kw, budget="resident", steps=5, tol=1e-6):
    """``steps`` steps of torch's optimizer and ours on equal params and grads."""
    ref = make_params()
    ours = [p.detach().clone().requires_grad_(True) for p in ref]
    for r, o in zip(ref, ours):  # keep the layout (strides) of the params made
        o.data = torch.empty_strided(r.shape, r.stride(), dtype=r.dtype).copy_(r.detach())
    ref_opt = torch_cls(ref, **kw)
    opt = paged_cls(ours, **kw, **BUDGETS[budget])
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for r, o in zip(ref, ours):
            g = torch.randn(r.shape, dtype=r.dtype, generator=gen)
            r.grad, o.grad = g, g.clone()
        ref_opt.step()
        opt.step()
    for r, o in zip(ref, ours):
        assert o.dtype == r.dtype and o.stride() == r.stride()
        torch.testing.assert_close(o, r, rtol=tol, atol=tol)
        for name, value in ref_opt.state[r].items():
            if name != "step":
                torch.testing.assert_close(opt.state[o][name], value, rtol=tol, atol=tol)
    return ref, ours, opt


# ---------------------------------------------------------------- item 5: float64
@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize(("torch_cls", "paged_cls", "kw"), [
    (torch.optim.AdamW, PagedAdamW, {"amsgrad": True}),
    (torch.optim.Adam, PagedAdam, {"weight_decay": 0.1}),
    (torch.optim.SGD, PagedSGD, {"lr": 0.01, "momentum": 0.9, "dampening": 0.1}),
])  # fmt: skip
def test_float64_params_match_torch(torch_cls, paged_cls, kw, kernel, budget) -> None:
    def make():
        return [torch.randn(700, dtype=torch.float64, requires_grad=True),
                torch.randn(3, 4, dtype=torch.float64, requires_grad=True)]  # fmt: skip

    _, ours, opt = _run(make, torch_cls, paged_cls, {**kw, **KERNELS[kernel]}, budget, tol=1e-12)
    names = [n for n in opt.state[ours[0]] if n != "step"]
    assert names and all(opt.state[ours[0]][n].dtype == torch.float64 for n in names)
    assert opt.state_dict()["state"][0][names[0]].dtype == torch.float64
    opt.close()


# ---------------------------------------------------------------- item 6: layouts
LAYOUTS = {
    "transposed": lambda: torch.randn(40, 30).t(),
    "channels_last": lambda: torch.randn(8, 3, 5, 5).to(memory_format=torch.channels_last),
    "strided with gaps": lambda: torch.randn(10, 5, 2)[..., 0],
    "complex": lambda: torch.randn(10, 5, dtype=torch.complex64),
    "complex transposed": lambda: torch.randn(5, 10, dtype=torch.complex64).t(),
}


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("torch_cls", "paged_cls", "kw"), [
    (torch.optim.AdamW, PagedAdamW, {"weight_decay": 0.1}),
    (torch.optim.AdamW, PagedAdamW, {"fused": False, "amsgrad": True}),
    (torch.optim.SGD, PagedSGD, {"lr": 0.01, "momentum": 0.9, "nesterov": True}),
    (torch.optim.SGD, PagedSGD, {"lr": 0.01}),  # no momentum: no state, no pages
])  # fmt: skip
def test_strided_and_complex_params_match_torch(torch_cls, paged_cls, kw, layout, budget) -> None:
    def make():
        return [LAYOUTS[layout]().requires_grad_(True), torch.randn(6, requires_grad=True)]

    ref, ours, opt = _run(make, torch_cls, paged_cls, kw, budget)
    st = opt.state[ours[0]]
    for name in (n for n in st if n != "step"):
        assert st[name].shape == ref[0].shape and st[name].dtype == ref[0].dtype
        assert opt.state_dict()["state"][0][name].is_complex() == ref[0].is_complex()
    opt.close()


def test_dense_strided_params_are_updated_in_place() -> None:
    """A transposed or channels_last param's pages follow its storage order, so the update
    runs on the param's own memory (no staging copy)."""
    for make in (LAYOUTS["transposed"], LAYOUTS["channels_last"]):
        p = make()
        ptr, stride = p.data_ptr(), p.stride()
        opt = PagedAdamW([p])
        assert opt._maybe_staged and not opt._maybe_staged - {id(p)}
        assert opt._access.order(p).view(p) is not None  # a view of the param's memory
        p.grad = torch.randn_like(p)
        opt.step()
        assert p.data_ptr() == ptr and p.stride() == stride
        opt.close()


def test_meta_params_wait_for_their_memory() -> None:
    with torch.device("meta"):
        model = torch.nn.Linear(4, 3)
    opt = PagedAdamW(model.parameters(), fused=True)  # torch takes them; so do we
    for p in model.parameters():
        p.grad = torch.rand_like(p)
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be"):
        opt.step()
    assert opt.pager.device.type == "meta" and len(opt.state) == 0
    opt.close()
    # params that keep their identity through to_empty (torch's swap_tensors path): the
    # pages follow them to their device
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with torch.device("meta"):
            model = torch.nn.Linear(4, 3)
        opt = PagedAdamW(model.parameters())
        model.to_empty(device="cpu")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)
    ref_model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for r, p in zip(ref_model.parameters(), model.parameters()):
            p.copy_(r)
    ref = torch.optim.AdamW(ref_model.parameters())
    x = torch.randn(2, 4)
    for m, o in ((model, opt), (ref_model, ref)):
        m(x).sum().backward()
        o.step()
    assert opt.pager.device.type == "cpu"
    for r, p in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    opt.close()


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("cls", [PagedAdamW, PagedSGD, PagedLion, PagedAdamW8bit])
def test_a_tensor_lr_equals_its_float(cls, kernel) -> None:
    if cls is PagedLion and kernel == "fused":
        pytest.skip("no fused Lion kernel (refused: see test_flags_that_cannot_be_honoured)")
    kw = KERNELS[kernel]
    if kernel == "foreach":
        kw = {}  # a Tensor lr with foreach=True is refused, as torch refuses it
    a, b = torch.randn(5000), torch.randn(5000)
    b.copy_(a)
    oa = cls([a], lr=0.01, **kw)
    ob = cls([b], lr=torch.tensor(0.01), **kw)
    for _ in range(3):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
        oa.step()
        ob.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for o in (oa, ob):
        o.close()


def test_groups_appended_directly_are_laid_out_and_duplicates_refused() -> None:
    a, b = torch.randn(50), torch.randn(20)
    ref_a, ref_b = a.clone(), b.clone()
    ref = torch.optim.AdamW([ref_a], lr=0.01)
    opt = PagedAdamW([a], lr=0.01, page_bytes=4096, device_budget=4096)
    for o, p in ((ref, ref_b), (opt, b)):  # torch code appends full groups itself
        o.param_groups.append({**{k: v for k, v in o.param_groups[0].items() if k != "params"},
                               "params": [p], "lr": 0.02})  # fmt: skip
    for _ in range(3):
        for r, p in ((ref_a, a), (ref_b, b)):
            r.grad = torch.randn_like(r)
            p.grad = r.grad.clone()
        ref.step()
        opt.step()
    torch.testing.assert_close(a, ref_a)
    torch.testing.assert_close(b, ref_b)
    assert len(opt.state_dict()["param_groups"]) == 2
    # extended with its own groups: the state dict packs them as torch does; a step refuses
    opt.param_groups.extend(opt.param_groups)
    ref.param_groups.extend(ref.param_groups)
    assert opt.state_dict()["param_groups"][-1]["params"] == ref.state_dict()["param_groups"][-1]["params"]
    with pytest.raises(ValueError, match="list params of earlier groups"):
        opt.step()
    opt.close()


# ---------------------------------------------------------------- item 7: flags, checks
@pytest.mark.parametrize("cls", ALL)
def test_every_class_takes_torchs_flags(cls) -> None:
    fused_ok = cls not in (PagedLion, PagedLion8bit)
    for flags in ({"foreach": True}, {"foreach": False}, {"fused": False}, {"fused": None},
                  {"capturable": False, "differentiable": False}):  # fmt: skip
        p = torch.randn(5000)
        opt = cls([p], **flags)
        p.grad = torch.randn_like(p)
        opt.step()
        assert p.isfinite().all()
        opt.close()
    if fused_ok:
        cls([torch.randn(5)], fused=True).close()


@pytest.mark.parametrize("cls", ALL)
def test_flags_that_cannot_be_honoured_raise_naming_the_flag(cls) -> None:
    for flag in ("capturable", "differentiable"):
        with pytest.raises(ValueError, match=f"{flag}=True is not supported.*pass {flag}=False"):
            cls([torch.randn(5)], **{flag: True})
    if cls in (PagedLion, PagedLion8bit):
        with pytest.raises(ValueError, match="fused=True: torch has no fused kernel"):
            cls([torch.randn(5)], fused=True)
    with pytest.raises(RuntimeError, match="cannot be `True` together"):
        cls([torch.randn(5)], fused=True, foreach=True)


@pytest.mark.parametrize("cls", ALL)
def test_hyperparameters_are_checked_before_the_params_as_in_torch(cls) -> None:
    for c in (torch.optim.AdamW, cls):
        with pytest.raises(ValueError, match="Invalid learning rate"):
            c(None, lr=-1.0)


@pytest.mark.parametrize("cls", ALL)
def test_a_bare_tensor_as_params_is_torchs_type_error(cls) -> None:
    for c in (torch.optim.AdamW, cls):
        with pytest.raises(TypeError, match="should be an iterable of Tensors or dicts"):
            c(torch.nn.Parameter(torch.randn(3)))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"lr": torch.tensor([1e-3, 1e-3])}, "Tensor lr must be 1-element"),
    ({"lr": torch.tensor(1e-3), "foreach": True},
     "lr as a Tensor is not supported for capturable=False and foreach=True"),
    ({"betas": (0.9, torch.tensor(0.99))}, "betas must be either both floats or both Tensors"),
    ({"betas": (torch.tensor(0.9), 0.99)}, "betas must be either both floats or both Tensors"),
    ({"betas": (torch.tensor(0.9), torch.tensor(0.99)), "foreach": True},
     r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True"),
    ({"betas": (1.0, 0.0)}, "Invalid beta parameter at index 0: 1.0"),
    ({"weight_decay": -1}, "Invalid weight_decay value: -1"),
    ({"eps": -1.0}, "Invalid epsilon value: -1.0"),
    ({"lr": -0.1}, "Invalid learning rate: -0.1"),
])  # fmt: skip
def test_torchs_validations_with_torchs_words(kwargs, match) -> None:
    for cls in (torch.optim.AdamW, PagedAdamW, PagedAdamW8bit):
        with pytest.raises(ValueError, match=match):
            cls([torch.randn(4)], **kwargs)


def test_tensor_betas_work_as_in_torch() -> None:
    betas = (torch.tensor(0.8), torch.tensor(0.99))
    _run(lambda: [torch.randn(40, requires_grad=True)], torch.optim.AdamW, PagedAdamW,
         {"betas": betas})  # fmt: skip


def test_eps_zero_is_taken_as_torch_takes_it() -> None:
    _run(lambda: [torch.randn(40, requires_grad=True)], torch.optim.AdamW, PagedAdamW,
         {"eps": 0.0})  # fmt: skip


@pytest.mark.parametrize("cls", [PagedAdamW, PagedSGD, PagedAdamW8bit, PagedLion])
def test_found_inf_skips_the_step(cls) -> None:
    """The AMP scaler's attributes, as torch's fused optimizers honour them: an inf/NaN found
    skips the update and leaves the step counts; torch.optim.AdamW(fused=True) alike."""
    for c in ((torch.optim.AdamW, cls) if cls is PagedAdamW else (cls,)):
        params = [torch.ones(5000) for _ in range(2)]
        for p in params:
            p.grad = torch.ones_like(p)
        opt = c(params, **({"fused": True} if c is not PagedLion else {}))
        opt.grad_scale = torch.ones(())
        opt.found_inf = torch.ones(())
        opt.step()
        assert all(torch.equal(p, torch.ones(5000)) for p in params)
        assert all(float(opt.state[p].get("step", 0)) == 0 for p in params)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("cls", [PagedAdamW, PagedSGD, PagedAdamW8bit])
def test_grad_scale_unscales_as_torchs_fused_kernel(cls, kernel) -> None:
    scale = torch.tensor(1024.0)
    a = torch.randn(5000)
    b = a.clone()
    kw = {"momentum": 0.9} if cls is PagedSGD else {}
    oa = cls([a], lr=0.01, **kw, **KERNELS[kernel])
    ob = cls([b], lr=0.01, **kw, **KERNELS[kernel])
    fused = cls is not PagedAdamW8bit and kernel in ("default", "fused")  # CPU has fused
    for _ in range(3):
        g = torch.randn_like(a)
        a.grad, b.grad = g, g * scale
        grad_before = b.grad.clone()
        ob.grad_scale, ob.found_inf = scale, torch.zeros(())
        oa.step()
        ob.step()
        if fused:  # torch's fused kernel unscales the grads in place; ours is that kernel
            torch.testing.assert_close(b.grad, g)
        else:  # other kernels get unscaled copies: the grads are never changed in place
            assert torch.equal(b.grad, grad_before)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if cls is PagedAdamW and kernel == "fused":
        ref = torch.optim.AdamW([a.clone()], lr=0.01, fused=True)
        assert ref._step_supports_amp_scaling == oa._step_supports_amp_scaling is True
        ref_grad = a.grad * scale
        ref.param_groups[0]["params"][0].grad = ref_grad
        ref.grad_scale, ref.found_inf = scale, torch.zeros(())
        ref.step()
        torch.testing.assert_close(ref_grad, a.grad)  # torch unscales in place too


def test_grad_scaler_with_fused_paged_adamw_matches_torch() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    ref_model = torch.nn.Linear(16, 4)
    ref_model.load_state_dict(model.state_dict())
    opt = PagedAdamW(model.parameters(), lr=0.01, fused=True, page_bytes=4096,
                     device_budget=4096)  # fmt: skip
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.01, fused=True)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    x = torch.randn(8, 16)
    for k in range(6):
        for m, o, s in ((model, opt, scalers[0]), (ref_model, ref, scalers[1])):
            o.zero_grad()
            loss = m(x).pow(2).mean() * (float("inf") if k == 2 else 1.0)  # one overflow
            s.scale(loss).backward()
            s.step(o)
            s.update()
    assert scalers[0].get_scale() == scalers[1].get_scale() < 2.0**10  # the inf was seen
    for p, r in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    opt.close()


def test_8bit_refuses_complex_and_float64_params() -> None:
    for dtype in (torch.complex64, torch.float64):
        with pytest.raises(TypeError, match="bitsandbytes has no kernel.*use PagedAdamW"):
            PagedAdamW8bit([torch.randn(5000, dtype=dtype)])
