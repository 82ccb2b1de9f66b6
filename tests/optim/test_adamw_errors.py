"""Bad input to PagedAdamW: a clear error naming the problem and the fix, before any change."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from tightfit.optim.adamw import PagedAdam, PagedAdamW


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"lr": -1e-3}, ValueError, "Invalid learning rate: -0.001; pass a learning rate >= 0"),
    ({"lr": float("nan")}, ValueError, "Invalid learning rate: nan"),
    ({"betas": (1.0, 0.999)}, ValueError,
     r"Invalid beta parameter at index 0: 1.0; each beta must be in \[0, 1\)"),
    ({"betas": (0.9, -0.1)}, ValueError, "Invalid beta parameter at index 1"),
    ({"betas": 0.9}, TypeError, "must be a pair"),
    ({"eps": -1e-8}, ValueError, "Invalid epsilon value: -1e-08; pass eps >= 0"),
    ({"weight_decay": -0.1}, ValueError, "Invalid weight_decay value: -0.1; pass weight_decay"),
    ({"page_bytes": 0}, ValueError, "page_bytes"),
    ({"page_bytes": -5}, ValueError, "page_bytes"),
    ({"page_bytes": 4096, "device_budget": 4095}, ValueError, "below one page"),
    ({"page_bytes": 4096, "device_budget": -1}, ValueError, "negative"),
    ({"page_bytes": 4096, "host_budget": 100}, ValueError, "host_budget=100 is below one page"),
    ({"device_budget": 1.5e9}, TypeError, "int number of bytes"),
    ({"page_bytes": 8}, ValueError, "cannot hold even one"),
    ({"capturable": True}, ValueError, "capturable=True is not supported"),
    ({"differentiable": True}, ValueError, "differentiable=True is not supported"),
    ({"fused": True, "foreach": True}, RuntimeError, "cannot be `True` together; pass one"),
])
@pytest.mark.parametrize("cls", [PagedAdamW, PagedAdam])
def test_bad_hyperparameters_raise(cls, kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        cls([torch.randn(10)], **kwargs)


def test_bad_group_hyperparameters_raise_before_the_group_is_added() -> None:
    opt = PagedAdamW([torch.randn(10)])
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.add_param_group({"params": [torch.randn(5)], "lr": -1.0})
    assert len(opt.param_groups) == 1 and len(opt.pager.pages) == 1
    opt.close()


def test_params_on_different_devices_raise() -> None:
    a = torch.randn(4)
    b = torch.randn(4, device="meta")
    with pytest.raises(ValueError, match="different devices"):
        PagedAdamW([a, b])
    opt = PagedAdamW([a])
    with pytest.raises(ValueError, match="make another optimizer"):
        opt.add_param_group({"params": [b]})
    opt.close()


def test_other_bad_params_raise() -> None:
    with pytest.raises(ValueError, match="empty parameter list"):
        PagedAdamW([])
    with pytest.raises(TypeError, match="float params"):
        PagedAdamW([torch.zeros(3, dtype=torch.long)])
    with pytest.raises(TypeError, match="optimize Tensors, but one of the params is int"):
        PagedAdamW([torch.randn(3), 5])


def test_sparse_gradients_raise_before_anything_changes() -> None:
    a, b = torch.randn(6), torch.randn(6)
    a0, b0 = a.clone(), b.clone()
    opt = PagedAdamW([a, b], lr=0.1)
    a.grad = torch.ones(6)
    b.grad = torch.ones(6).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()
    assert torch.equal(a, a0) and torch.equal(b, b0) and len(opt.state) == 0
    opt.close()


def test_unwritable_spill_dir_raises(tmp_path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        PagedAdamW([torch.randn(3)], spill_dir=a_file)
    with pytest.raises(ValueError, match="cannot be written"):  # a folder cannot be made there
        PagedAdamW([torch.randn(3)], spill_dir=a_file / "spill")
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(locked, os.W_OK):  # running as root: permissions do not apply
            pytest.skip("permissions are not enforced for this user")
        with pytest.raises(ValueError, match="cannot be written"):
            PagedAdamW([torch.randn(3)], spill_dir=locked)
    finally:
        os.chmod(locked, stat.S_IRWXU)
