"""PagedAdamW8bit / PagedAdam8bit against bitsandbytes' AdamW8bit and torch's AdamW."""

from __future__ import annotations

import os

import bitsandbytes as bnb
import pytest
import torch

from tightfit.measure.tracker import MemoryTracker
from tightfit.optim import quant8
from tightfit.optim.adamw8bit import PagedAdam8bit, PagedAdamW8bit

from ..tiers.counting import count_copies

PAGE = 16 << 10
SIZES = [20_000, 5000, 100, 9000]  # 100 < 4096: fp32 state, as in bitsandbytes


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _grads(params: list[torch.Tensor], *others: list[torch.Tensor]) -> None:
    for i, p in enumerate(params):
        g = torch.randn_like(p)
        p.grad = g.clone()
        for o in others:
            o[i].grad = g.clone()


def _budget(kind: str, opt: PagedAdamW8bit) -> int | None:
    return {"unlimited": None, "one_page": PAGE, "30%": int(0.3 * opt.pager.state_bytes)}[kind]


@pytest.mark.parametrize("budget", ["unlimited", "one_page", "30%"])
def test_bit_identical_to_bitsandbytes_adamw8bit(monkeypatch, budget: str) -> None:
    count_copies(monkeypatch)
    ref = [torch.randn(n) for n in SIZES]
    ours = [p.clone() for p in ref]
    groups = lambda ps: [  # noqa: E731
        {"params": [ps[0], ps[2]], "lr": 1e-2, "weight_decay": 0.1},
        {"params": [ps[1], ps[3]], "lr": 5e-3, "weight_decay": 0.0, "betas": (0.8, 0.99)},
    ]
    ref_opt = bnb.optim.AdamW8bit(groups(ref))
    probe = PagedAdamW8bit(groups([p.clone() for p in ref]), page_bytes=PAGE)
    opt = PagedAdamW8bit(groups(ours), page_bytes=PAGE, device_budget=_budget(budget, probe))
    probe.close()
    for _ in range(12):
        _grads(ours, ref)
        opt.step()
        ref_opt.step()
    for i, (a, b) in enumerate(zip(ours, ref)):
        if quant8.is_8bit(a.numel()):
            assert torch.equal(a, b), i  # same kernel on page views: the same bits
        else:  # fp32 state: torch's fused Adam vs bitsandbytes' 32-bit kernel
            assert ((a - b).norm() / b.norm()).item() < 1e-6
    stats = opt.memory_stats()
    if budget != "unlimited":
        assert stats["peak_device_bytes"] <= opt.pager.device_budget
        assert stats["bytes_paged_in"] > 0
    # the copy engine's own count of the bytes it copied (no re-plan: all of it the sweep's)
    assert opt.pager.engine.counts() == (stats["bytes_paged_in"], stats["bytes_paged_out"], 0)
    opt.close()


def test_state_bytes_per_param_and_one_page_budget(monkeypatch) -> None:
    count_copies(monkeypatch)
    n = 600_000
    p = torch.randn(n)
    page = 64 << 10
    opt = PagedAdamW8bit([p], lr=1e-3, page_bytes=page, device_budget=page)
    p.grad = torch.randn(n)
    opt.step()
    stats = opt.memory_stats()
    # codes + absmax (two fp32 per 256 elements), all of it in the pages
    assert stats["state_bytes"] / n <= 2.04
    assert stats["state_bytes"] >= 2 * n + 2 * 4 * quant8.blocks(n)
    assert stats["peak_device_bytes"] <= page
    # everything streams: 2 x the state bytes moved (in and out)
    assert stats["bytes_paged_in"] == stats["bytes_paged_out"] == stats["state_bytes"]
    assert opt.pager.engine.counts() == (stats["state_bytes"], stats["state_bytes"], 0)
    opt.close()


def _regression(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 64, generator=g)
    w = torch.randn(64, 96, generator=g) / 8
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(512, 96, generator=g)


def _curve(make_opt, steps: int = 200) -> list[float]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 96))
    opt = make_opt(model.parameters())
    x, y = _regression()
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if hasattr(opt, "close"):
        opt.close()
    return losses


def test_loss_curve_within_2_percent_of_bitsandbytes_and_fp32_adamw() -> None:
    kw = {"lr": 3e-3, "weight_decay": 0.01}
    # (paging is bit-neutral: see test_bit_identical_to_bitsandbytes_adamw8bit)
    ours = _curve(lambda ps: PagedAdamW8bit(ps, **kw))
    ours_torch = _curve(lambda ps: PagedAdamW8bit(ps, backend="torch", **kw))
    bnb8 = _curve(lambda ps: bnb.optim.AdamW8bit(ps, **kw))
    fp32 = _curve(lambda ps: torch.optim.AdamW(ps, **kw))
    assert ours[-1] < 0.5 * ours[0]  # it trains
    for other in (bnb8, fp32):
        assert abs(ours[-1] - other[-1]) <= 0.02 * other[-1]
        assert abs(ours_torch[-1] - other[-1]) <= 0.02 * other[-1]


def test_adam8bit_adds_l2_decay_to_the_gradient() -> None:
    a = torch.randn(8192)
    b = a.clone()
    ours = PagedAdam8bit([a], lr=1e-2, weight_decay=0.1, page_bytes=PAGE)
    ref = PagedAdamW8bit([b], lr=1e-2, weight_decay=0.0, page_bytes=PAGE)
    for _ in range(5):
        g = torch.randn_like(a)
        a.grad = g.clone()
        b.grad = torch.add(g, b, alpha=0.1)  # Adam's L2 term, by hand
        ours.step()
        ref.step()
    assert torch.equal(a, b)


def test_state_dict_round_trip_is_bit_exact_and_native() -> None:
    ps = [torch.randn(n) for n in SIZES]
    opt = PagedAdamW8bit(ps, lr=1e-2, page_bytes=PAGE, device_budget=2 * PAGE)
    for _ in range(3):
        _grads(ps)
        opt.step()
    sd = opt.state_dict()
    e = sd["state"][0]
    assert e["state1"].dtype == torch.uint8 and e["state1"].shape == ps[0].shape
    assert e["absmax2"].shape == (quant8.blocks(SIZES[0]),) and e["step"].item() == 3
    assert sd["state"][2]["state1"].dtype == torch.float32  # small param: fp32
    twin = [p.clone() for p in ps]
    opt2 = PagedAdamW8bit(twin, lr=0.5, page_bytes=PAGE)  # lr comes from the state dict
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 1e-2
    for _ in range(3):
        _grads(ps, twin)
        opt.step()
        opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(ps, twin))
    sd1, sd2 = opt.state_dict(), opt2.state_dict()
    for i in sd1["state"]:
        for k in sd1["state"][i]:
            assert torch.equal(sd1["state"][i][k], sd2["state"][i][k]), (i, k)
    opt.close()
    opt2.close()


def test_torch_format_both_ways() -> None:
    ps = [torch.randn(n) for n in SIZES]
    opt = PagedAdamW8bit(ps, lr=1e-2, page_bytes=PAGE)
    _grads(ps)
    opt.step()
    tsd = opt.torch_state_dict()
    assert set(tsd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    code1, code2 = quant8.dynamic_map(True), quant8.dynamic_map(False)
    native = opt.state_dict()["state"][0]
    deq = quant8.dequantize(native["state1"], native["absmax1"], code1)
    assert torch.equal(tsd["state"][0]["exp_avg"].reshape(-1), deq)
    # into torch's AdamW and back
    ref = [p.clone() for p in ps]
    topt = torch.optim.AdamW(ref, lr=1e-2)
    topt.load_state_dict(tsd)
    back = PagedAdamW8bit([p.clone() for p in ps], page_bytes=PAGE)
    back.load_state_dict(topt.state_dict())
    again = back.state_dict()["state"][0]
    # re-quantizing dequantized values loses at most about one code step
    assert torch.equal(again["absmax2"], native["absmax2"])  # unsigned map reaches 1.0
    for i, code in ((1, code1), (2, code2)):
        got = quant8.dequantize(again[f"state{i}"], again[f"absmax{i}"], code)
        want = quant8.dequantize(native[f"state{i}"], native[f"absmax{i}"], code)
        scale = native[f"absmax{i}"].repeat_interleave(256)[: want.numel()]
        assert ((got - want).abs() <= 0.03 * scale).all()
    opt.close()
    back.close()


def test_bf16_params() -> None:
    p = torch.randn(10_000, dtype=torch.bfloat16)
    ref = p.float().clone()
    opt = PagedAdamW8bit([p], lr=1e-2, page_bytes=PAGE)
    ref_opt = bnb.optim.AdamW8bit([ref], lr=1e-2)
    for _ in range(3):
        g = torch.randn(10_000)
        p.grad = g.bfloat16()
        ref.grad = g.bfloat16().float()
        opt.step()
        ref_opt.step()
    assert p.dtype == torch.bfloat16
    assert ((p.float() - ref).norm() / ref.norm()).item() < 1e-2
    opt.close()


def test_close_removes_spill_files(tmp_path) -> None:
    p = torch.randn(50_000)
    opt = PagedAdamW8bit([p], page_bytes=PAGE, device_budget=PAGE, spill_dir=tmp_path)
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.memory_stats()["disk_bytes"] > 0 and any(tmp_path.rglob("*"))
    opt.close()
    assert not [f for f in tmp_path.rglob("*") if f.is_file()]
    assert os.path.isdir(tmp_path)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"lr": -1.0}, "Invalid learning rate: -1.0"),
    ({"betas": (0.9, 1.0)}, "Invalid beta parameter at index 1"),
    ({"eps": -1e-8}, "Invalid epsilon value"),
    ({"weight_decay": -0.1}, "Invalid weight_decay value: -0.1"),
    ({"backend": "cuda"}, "is not one of"),
    ({"min_8bit_size": -1}, "min_8bit_size=-1"),
    ({"device_budget": 100}, "below one page"),
])
def test_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        PagedAdamW8bit([torch.randn(5000)], page_bytes=PAGE, **kwargs)


def test_bad_state_dict_changes_nothing() -> None:
    ps = [torch.randn(n) for n in SIZES]
    opt = PagedAdamW8bit(ps, page_bytes=PAGE)
    _grads(ps)
    opt.step()
    before = opt.state_dict()
    bad = opt.state_dict()
    bad["state"][1]["absmax1"] = bad["state"][1]["absmax1"][:-1]
    bad["param_groups"][0]["lr"] = 123.0
    with pytest.raises(ValueError, match="absmax1"):
        opt.load_state_dict(bad)
    wrong = opt.state_dict()
    wrong["state"][2]["state1"] = wrong["state"][2]["state1"].to(torch.uint8)  # small: fp32
    with pytest.raises(ValueError, match="min_8bit_size"):
        opt.load_state_dict(wrong)
    other = PagedAdamW8bit([torch.randn(7000)], page_bytes=PAGE)
    with pytest.raises(ValueError, match="params but the state dict has"):
        other.load_state_dict(before)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for i in before["state"]:
        for k in before["state"][i]:
            assert torch.equal(before["state"][i][k], after["state"][i][k])
    opt.close()
    other.close()


@pytest.mark.cuda
@pytest.mark.parametrize("budget", [None, PAGE])
def test_cuda_matches_bitsandbytes_adamw8bit(budget: int | None) -> None:
    # not run on the CPU machine: bitsandbytes' CUDA kernel on page views vs on whole params
    ref = [torch.randn(n, device="cuda") for n in SIZES]
    ours = [p.clone() for p in ref]
    opt = PagedAdamW8bit(ours, lr=1e-2, page_bytes=PAGE, device_budget=budget)
    ref_opt = bnb.optim.AdamW8bit(ref, lr=1e-2)
    for _ in range(5):
        _grads(ours, ref)
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        assert ((a - b).norm() / b.norm()).item() < 1e-5
    if budget is not None:
        assert opt.memory_stats()["peak_device_bytes"] <= budget
    opt.close()


def test_loads_a_bitsandbytes_adamw8bit_state_dict() -> None:
    ref = [torch.randn(n) for n in (20_000, 100)]
    bnb_opt = bnb.optim.AdamW8bit(ref, lr=1e-2)
    for _ in range(3):
        _grads(ref)
        bnb_opt.step()
    ours = [p.clone() for p in ref]
    opt = PagedAdamW8bit(ours, lr=0.5, page_bytes=PAGE, device_budget=PAGE)
    opt.load_state_dict(bnb_opt.state_dict())  # bnb nests codes/absmax under an FSDP key
    assert opt.param_groups[0]["lr"] == 1e-2
    for _ in range(3):
        _grads(ours, ref)
        opt.step()
        bnb_opt.step()
    assert torch.equal(ours[0], ref[0])  # 8-bit state continues bit-identically
    assert ((ours[1] - ref[1]).norm() / ref[1].norm()).item() < 1e-6
    opt.close()


def test_page_file_save_and_load_resume_bit_identically(tmp_path) -> None:
    ps = [torch.randn(n) for n in SIZES]
    opt = PagedAdamW8bit(ps, lr=1e-2, page_bytes=PAGE, device_budget=2 * PAGE)
    for _ in range(2):
        _grads(ps)
        opt.step()
    opt.save(tmp_path / "opt.pages")
    twin = [p.clone() for p in ps]
    opt2 = PagedAdamW8bit(twin, lr=1e-2, page_bytes=PAGE)
    opt2.load(tmp_path / "opt.pages")
    for _ in range(2):
        _grads(ps, twin)
        opt.step()
        opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(ps, twin))
    opt.close()
    opt2.close()


def test_torch_backend_is_budget_invariant_and_close_to_bitsandbytes() -> None:
    base = [torch.randn(n) for n in SIZES]
    runs = {}
    for name, kw in (("torch", {"backend": "torch"}),
                     ("torch_one_page", {"backend": "torch", "device_budget": PAGE}),
                     ("bnb", {})):
        ps = [p.clone() for p in base]
        opt = PagedAdamW8bit(ps, lr=1e-2, page_bytes=PAGE, **kw)
        torch.manual_seed(5)
        for _ in range(6):
            _grads(ps)
            opt.step()
        if name == "torch":
            assert opt.backend == "torch"
        runs[name] = ps
        opt.close()
    assert all(torch.equal(a, b) for a, b in zip(runs["torch"], runs["torch_one_page"]))
    for a, b in zip(runs["torch"], runs["bnb"]):
        # same math; rounding to codes differs near midpoints between the two quantizers
        assert ((a - b).norm() / b.norm()).item() < 1e-3


def test_torch_backend_transient_memory_is_per_chunk_not_per_state() -> None:
    peaks = []
    for n_params in (4, 16):
        ps = [torch.randn(65_536) for _ in range(n_params)]
        opt = PagedAdamW8bit(ps, backend="torch", page_bytes=PAGE * 4)
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
        with MemoryTracker() as mt:
            opt.step()
        peaks.append(mt.peak_bytes)
        opt.close()
    fp32_state_16 = 16 * 65_536 * 8
    # dequantized fp32 copies exist for about one page of elements at a time
    assert peaks[1] <= 1.1 * peaks[0]
    assert peaks[1] < 0.25 * fp32_state_16


def test_step_counts_are_read_once_per_step_not_per_page(monkeypatch) -> None:
    # bitsandbytes' kernel takes the step as a number; reading the counts per update call
    # would synchronize a GPU once per streamed page
    ps = [torch.randn(20_000) for _ in range(3)]
    opt = PagedAdamW8bit(ps, page_bytes=PAGE, device_budget=3 * PAGE, backend="bitsandbytes")
    stacks: list[int] = []
    stack = torch.stack

    def counting(tensors, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if all(t.dim() == 0 for t in tensors):
            stacks.append(len(tensors))
        return stack(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "stack", counting)
    for step in range(3):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
        assert len(stacks) == step + 1  # one read per optimizer step
    assert opt.memory_stats()["page_faults"] >= 3 * 3  # several streamed pages per step
    assert all(float(s["step"]) == 3.0 for s in opt.state_dict()["state"].values())
    opt.close()
