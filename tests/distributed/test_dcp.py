"""DCP save/load of model + optimizer in one process (no process group)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tightfit.distributed import dcp

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not dist.is_available(), reason="torch.distributed is not available on this platform"
    ),
]


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 3))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_save_then_load_resumes_exactly(tmp_path) -> None:
    model = _model()
    fresh = _model()  # other random weights: the load must overwrite all of them
    assert not torch.equal(model[0].weight, fresh[0].weight)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(3):
        _step(model, opt, s)
    dcp.save(tmp_path / "ck", model, opt, extra={"step": 3, "note": "x"})
    for s in range(3, 5):
        _step(model, opt, s)

    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    extra = dcp.load(tmp_path / "ck", fresh, fresh_opt)
    assert extra == {"step": 3, "note": "x"}
    assert fresh_opt.state_dict()["state"][0]["step"].item() == 3
    for s in range(extra["step"], 5):
        _step(fresh, fresh_opt, s)
    for a, b in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_model_only_round_trip(tmp_path) -> None:
    model, other = _model(), _model()
    dcp.save(tmp_path / "m", model)
    assert dcp.load(tmp_path / "m", other) == {}
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


def test_missing_saved_state_is_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no .metadata"):
        dcp.load(tmp_path / "nothing", _model())


def test_trainable_only_leaves_frozen_params(tmp_path) -> None:
    model, other = _model(), _model()
    model[0].weight.requires_grad_(False)
    other[0].weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    _step(model, opt, 0)
    assert dcp.trainable_fqns(model) == {"0.bias", "2.weight", "2.bias"}
    dcp.save(tmp_path / "t", model, opt, trainable_only=True)
    frozen_before = other[0].weight.clone()
    other_opt = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=1e-2)
    dcp.load(tmp_path / "t", other, other_opt, trainable_only=True)
    assert torch.equal(other[0].weight, frozen_before)  # not in the saved state: untouched
    assert torch.equal(other[2].weight, model[2].weight)
    assert other_opt.state_dict()["state"][0]["step"].item() == 1
