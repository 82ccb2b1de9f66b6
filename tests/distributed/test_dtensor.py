"""DTensor local-shard helpers on a one-rank gloo group (in process, no ports)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tightfit.distributed import dtensor

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
    from tightfit.optim.adamw import PagedAdamW
    from tightfit.optim.lion import PagedLion
    from tightfit.optim.sgd import PagedSGD

    return {"adamw": (PagedAdamW, {}), "lion": (PagedLion, {}),
            "sgd": (PagedSGD, {"momentum": 0.9})}[name]  # fmt: skip


@pytest.mark.parametrize("name", ["adamw", "lion", "sgd"])
def test_paged_optimizers_page_dtensor_params_like_plain_ones(mesh, name, tmp_path) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    cls, kw = _paged(name)
    full = torch.randn(80, 64)
    p = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
    q = torch.nn.Parameter(full.clone())
    # 40 KiB of state per array under an 8 KiB budget: pages stream through every step
    common = {"lr": 1e-2, "page_bytes": 4096, "device_budget": 8192, **kw}
    opt_d = cls([p], spill_dir=tmp_path, **common)
    opt_p = cls([q], spill_dir=tmp_path, **common)
    for _ in range(3):
        g = torch.randn(80, 64)
        p.grad, q.grad = distribute_tensor(g, mesh, [Shard(0)]), g.clone()
        opt_d.step()
        opt_p.step()
    assert torch.equal(p.full_tensor(), q)
    assert opt_d.memory_stats()["bytes_paged_in"] > 0
    sd = opt_d.state_dict()
    names = [k for k in sd["state"][0] if k != "step"]
    assert names and all(dtensor.is_dtensor(sd["state"][0][k]) for k in names)
    assert not dtensor.is_dtensor(sd["state"][0]["step"])  # as torch's optimizers keep it
    # loading DTensor state writes the pages back; the next step matches the plain run
    opt_d.load_state_dict(sd)
    g = torch.randn(80, 64)
    p.grad, q.grad = distribute_tensor(g, mesh, [Shard(0)]), g.clone()
    opt_d.step()
    opt_p.step()
    assert torch.equal(p.full_tensor(), q)
    opt_d.close()
    opt_p.close()
