"""DTensor local-shard helpers on a one-rank gloo group (in process, no ports)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tightfit.optim import dtensor
from tightfit.optim.adamw import PagedAdamW
from tightfit.optim.adamw8bit import PagedAdamW8bit
from tightfit.optim.lion import PagedLion, PagedLion8bit
from tightfit.optim.sgd import PagedSGD

from ..tiers.counting import count_copies

# torch.distributed's tensor and mesh modules are imported inside the tests: on a build
# without torch.distributed the module still loads, and the mark below skips its tests.
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()),
        reason="torch.distributed with the gloo backend is not available on this platform",
    ),
]


@pytest.fixture
def mesh():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    # A HashStore needs no port: a one-rank group is all these helpers need.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_plain_tensors_pass_through() -> None:
    t = torch.randn(3, 4)
    assert not dtensor.is_dtensor(t)
    assert dtensor.local_tensor(t) is t
    assert dtensor.like_param(t, t) is t
    assert dtensor.local_numel(t) == 12
    assert dtensor.local_state(t.clone(), t).shape == t.shape


def test_local_tensor_is_a_view_of_the_shard(mesh) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    p = distribute_tensor(torch.zeros(5, 3), mesh, [Shard(0)])
    local = dtensor.local_tensor(p)
    local.add_(1.0)  # an optimizer's in-place update of the shard must reach the param
    assert p.full_tensor().eq(1.0).all()
    assert dtensor.local_numel(p) == 15


def test_like_param_round_trips_layout(mesh) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    p = distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)])
    state = torch.randn(5, 3)
    wrapped = dtensor.like_param(state, p)
    assert dtensor.is_dtensor(wrapped)
    assert wrapped.placements == p.placements and wrapped.shape == p.shape
    assert torch.equal(dtensor.local_state(wrapped, p), state)


def test_local_state_rejects_wrong_shape_and_placement(mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    p = distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)])
    with pytest.raises(ValueError, match="does not match this rank's parameter shard"):
        dtensor.local_state(torch.zeros(2, 4), p)
    other = distribute_tensor(torch.randn(4, 2), mesh, [Replicate()])
    with pytest.raises(ValueError, match="set_optimizer_state_dict"):
        dtensor.local_state(other, p)


def test_partial_placement_is_rejected(mesh) -> None:
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    dtensor.check_param(distribute_tensor(torch.randn(4), mesh, [Shard(0)]))
    partial = DTensor.from_local(torch.randn(4), mesh, [Partial()])
    with pytest.raises(TypeError, match="partial sums"):
        dtensor.check_param(partial)


def _paged(name: str):
    # budgets under each layout's state for an 80x64 param (adamw 40 KiB, adamw8bit 10.2 KiB,
    # lion8bit 5.1 KiB of state): pages stream through every step
    return {"adamw": (PagedAdamW, {}), "lion": (PagedLion, {}),
            "sgd": (PagedSGD, {"momentum": 0.9}),
            "adamw8bit": (PagedAdamW8bit, {}),
            "adamw8bit-torch": (PagedAdamW8bit, {"backend": "torch"}),
            "lion8bit": (PagedLion8bit, {"device_budget": 4096})}[name]  # fmt: skip


def _dequantized(opt) -> dict[str, torch.Tensor]:
    """The optimizer's state of param 0 in torch's fp32 format, as plain tensors."""
    sd = opt.torch_state_dict() if hasattr(opt, "torch_state_dict") else opt.state_dict()
    return {k: dtensor.local_tensor(v) for k, v in sd["state"][0].items() if k != "step"}


@pytest.mark.parametrize(
    "name", ["adamw", "lion", "sgd", "adamw8bit", "adamw8bit-torch", "lion8bit"]
)
def test_paged_optimizers_page_dtensor_params_like_plain_ones(
    monkeypatch, mesh, name, tmp_path
) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    count_copies(monkeypatch)
    cls, kw = _paged(name)
    full = torch.randn(80, 64)  # 5120 elements: 8-bit state (>= min_8bit_size 4096)
    p = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
    q = torch.nn.Parameter(full.clone())
    common = {"lr": 1e-2, "page_bytes": 4096, "device_budget": 8192, **kw}
    opt_d = cls([p], spill_dir=tmp_path, **common)
    opt_p = cls([q], spill_dir=tmp_path, **common)
    for _ in range(3):
        g = torch.randn(80, 64)
        p.grad, q.grad = distribute_tensor(g, mesh, [Shard(0)]), g.clone()
        opt_d.step()
        opt_p.step()
    assert torch.equal(p.full_tensor(), q)
    stats = opt_d.memory_stats()
    assert stats["bytes_paged_in"] > 0
    assert opt_d.pager.engine.counts() == (stats["bytes_paged_in"], stats["bytes_paged_out"], 0)
    sd = opt_d.state_dict()
    names = [k for k in sd["state"][0] if k != "step"]
    assert names and all(dtensor.is_dtensor(sd["state"][0][k]) for k in names)
    assert all(sd["state"][0][k].placements == p.placements for k in names)
    assert not dtensor.is_dtensor(sd["state"][0]["step"])  # as torch's optimizers keep it
    before = _dequantized(opt_d)
    # loading DTensor state writes the pages back; the next step matches the plain run
    opt_d.load_state_dict(sd)
    if "8bit" in name:
        # DTensor params: torch's fp32 format (codes/absmax of local blocks cannot reshard)
        assert sorted(names) == sorted(cls.torch_names)
        assert all(sd["state"][0][k].dtype == torch.float32 for k in names)
        # Dequantize -> requantize is not bit-exact: the signed map's most negative code is
        # -0.99297, so a block whose largest magnitude is negative comes back with its absmax
        # 0.703 % smaller (codes may move one step): each value moves by at most 0.703 % of
        # itself (measured: 0.70 %); the unsigned map ends at 1.0, so exp_avg_sq is exact.
        after = _dequantized(opt_d)
        for k in names:
            assert ((after[k] - before[k]).abs() <= 0.00704 * before[k].abs()).all()
        if name == "adamw8bit":
            assert torch.equal(after["exp_avg_sq"], before["exp_avg_sq"])
        # the plain run takes the same trip through torch's format, so both stay equal
        opt_p.load_state_dict(opt_p.torch_state_dict())
    g = torch.randn(80, 64)
    p.grad, q.grad = distribute_tensor(g, mesh, [Shard(0)]), g.clone()
    opt_d.step()
    opt_p.step()
    assert torch.equal(p.full_tensor(), q)
    opt_d.close()
    opt_p.close()


def test_8bit_layout_follows_the_global_size_of_a_dtensor_param(mesh) -> None:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    small = torch.nn.Parameter(distribute_tensor(torch.randn(10, 32), mesh, [Shard(0)]))
    # a shard of 2560 elements of a 10240-element param (as rank 0 of 4 would hold): the
    # global size decides, so every rank pages it 8-bit, as one process would
    big = torch.nn.Parameter(
        DTensor.from_local(
            torch.randn(40, 64), mesh, [Shard(0)], run_check=False, shape=(160, 64),
            stride=(64, 1),
        )
    )  # fmt: skip
    opt = PagedAdamW8bit([small, big], lr=1e-2)
    dtypes = [{n: a[2] for n, a in page.arrays.items()} for page in opt.pager.pages]
    assert {"state1": torch.float32, "state2": torch.float32} in dtypes  # 320 < 4096
    assert {"state1": torch.uint8, "absmax1": torch.float32,
            "state2": torch.uint8, "absmax2": torch.float32} in dtypes  # fmt: skip
    for p in (small, big):
        p.grad = DTensor.from_local(
            torch.randn_like(p.to_local()), mesh, [Shard(0)], run_check=False, shape=p.shape,
            stride=p.stride(),
        )  # fmt: skip
    opt.step()
    sd = opt.state_dict()
    assert sd["state"][1]["exp_avg"].shape == (160, 64)  # global shape, local shard inside
    assert sd["state"][1]["exp_avg"].to_local().shape == (40, 64)
    assert sd["state"][0]["exp_avg"].dtype == torch.float32
    before = opt.torch_state_dict()
    opt.load_state_dict(sd)
    # fp32 state below min_8bit_size has nothing to requantize: bit-exact
    assert torch.equal(opt.torch_state_dict()["state"][0]["exp_avg"].to_local(),
                       before["state"][0]["exp_avg"].to_local())  # fmt: skip
    opt.close()


def test_8bit_native_state_is_unchanged_without_dtensors() -> None:
    from tightfit.optim.lion import PagedLion8bit

    q = torch.nn.Parameter(torch.randn(80, 64))
    opt = PagedLion8bit([q], lr=1e-2)
    q.grad = torch.randn(80, 64)
    opt.step()
    sd = opt.state_dict()
    assert sd["state"][0]["state1"].dtype == torch.uint8 and "absmax1" in sd["state"][0]
    opt.load_state_dict(sd)
    assert all(torch.equal(v, opt.state_dict()["state"][0][k]) for k, v in sd["state"][0].items())
    opt.close()


def test_8bit_rejects_dtensor_codes_and_misplaced_state(mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tightfit.optim.lion import PagedLion8bit

    p = torch.nn.Parameter(distribute_tensor(torch.randn(80, 64), mesh, [Shard(0)]))
    opt = PagedLion8bit([p], lr=1e-2)
    p.grad = distribute_tensor(torch.randn(80, 64), mesh, [Shard(0)])
    opt.step()
    sd = opt.state_dict()
    saved = opt.torch_state_dict()
    replicated = distribute_tensor(torch.zeros(80, 64), mesh, [Replicate()])
    wrong = {**sd, "state": {0: {**sd["state"][0], "exp_avg": replicated}}}
    with pytest.raises(ValueError, match="set_optimizer_state_dict"):
        opt.load_state_dict(wrong)
    # native codes as DTensors: their blocks cannot be resharded, so they are refused
    state1 = distribute_tensor(torch.zeros(80, 64, dtype=torch.uint8), mesh, [Shard(0)])
    native = {"step": sd["state"][0]["step"], "state1": state1, "absmax1": torch.ones(20)}
    with pytest.raises(ValueError, match="cannot be resharded"):
        opt.load_state_dict({**sd, "state": {0: native}})
    # nothing changed
    assert torch.equal(opt.torch_state_dict()["state"][0]["exp_avg"].to_local(),
                       saved["state"][0]["exp_avg"].to_local())  # fmt: skip
    opt.close()
