"""Issue 25 finding 2: a train run's offloaded activations (made in prepare) and its paged
optimizer's host pages count their pinned bytes with one accountant, whose budget is what
``tightfit plan`` checks (``host_limit().budget``)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from tightfit.distributed.launch import DistInfo
from tightfit.planner.host import host_limit
from tightfit.tiers import pinned
from tightfit.train import run_setup
from tightfit.train.job import TrainJob
from tightfit.train.run_options import RunConfig


class _Stop(Exception):
    pass


def test_prepare_and_the_optimizer_share_one_pinned_budget(monkeypatch, tmp_path) -> None:
    seen: dict[str, pinned.PinnedHost] = {}

    def fake_prepare(model, **_kw):  # noqa: ANN001, ANN202
        seen["prepare"] = pinned.current()  # where the Offloader's pool takes it
        model.tightfit_info = SimpleNamespace(notes=[], plan=None)
        return model

    def fake_optimizer_for(model, options):  # noqa: ANN001, ANN202
        seen["optimizer"] = pinned.current()  # where the PageStore takes it
        raise _Stop

    monkeypatch.setattr(run_setup, "prepare", fake_prepare)
    monkeypatch.setattr(run_setup, "optimizer_for", fake_optimizer_for)
    monkeypatch.setattr(run_setup, "_load_model", lambda cfg, data: torch.nn.Linear(2, 2))
    data = SimpleNamespace(fingerprint="f", eval_fingerprint=None, describe=lambda: "",
                           summary={"preview": ""}, epochs=lambda steps: "",
                           train=SimpleNamespace(largest=lambda: {}))
    cfg = RunConfig()
    cfg = replace(cfg, train=replace(cfg.train, device="cpu"))
    job = TrainJob(DistInfo(), "single")
    with pytest.raises(_Stop):
        run_setup._build(cfg, job, tmp_path, None, data, False, lambda _m: None)
    assert seen["prepare"] is seen["optimizer"]
    assert seen["prepare"] is not pinned.current()  # the run's, not the process's
    assert seen["prepare"].budget == host_limit().budget
