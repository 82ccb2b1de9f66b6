"""Finding 11 (issue 25): under torchrun each rank computes on its own device.

NCCL binds ``cuda:LOCAL_RANK``, so an explicit ``--device cuda:N`` must not put every rank's
model on one GPU: the index is refused before any process group exists, and the model goes on
the rank's device (``job.info.device``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tightfit.distributed.launch import DistInfo
from tightfit.train.job import TrainJob


@pytest.mark.parametrize("device", ["cuda:0", "cuda:1"])
def test_a_cuda_index_under_torchrun_is_refused(monkeypatch, device: str) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match="cuda:LOCAL_RANK.*CUDA_VISIBLE_DEVICES"):
        TrainJob.start(fsdp=False, batch_size=2, device=device)
    assert not dist.is_initialized()


def test_the_model_goes_on_the_ranks_device() -> None:
    rank1 = DistInfo(1, 2, 1, torch.device("cuda", 1), distributed=True)
    assert TrainJob(rank1, "ddp").model_device("cuda") == torch.device("cuda", 1)
    assert TrainJob(rank1, "fsdp").model_device(None) == torch.device("cuda", 1)
    assert TrainJob(DistInfo(), "single").model_device("cuda:3") == "cuda:3"  # no torchrun


def test_setup_prepares_the_model_on_the_ranks_device(monkeypatch, tmp_path) -> None:
    from dataclasses import replace
    from types import SimpleNamespace

    from tightfit.train import run_setup
    from tightfit.train.run_options import RunConfig

    class Stop(Exception):
        pass

    seen: dict = {}

    def fake_prepare(model, *, device, **_kw):  # noqa: ANN001, ANN202
        seen["device"] = device
        raise Stop

    monkeypatch.setattr(run_setup, "prepare", fake_prepare)
    monkeypatch.setattr(run_setup, "_load_model", lambda cfg, data: torch.nn.Linear(2, 2))
    data = SimpleNamespace(fingerprint="f", eval_fingerprint=None, describe=lambda: "",
                           summary={"preview": ""}, epochs=lambda steps: "",
                           train=SimpleNamespace(largest=lambda: {}))
    cfg = RunConfig()
    cfg = replace(cfg, train=replace(cfg.train, device="cuda:0"))
    rank1 = TrainJob(DistInfo(1, 2, 1, torch.device("cuda", 1), distributed=True), "ddp")
    with pytest.raises(Stop):
        run_setup._build(cfg, rank1, tmp_path, None, data, False, lambda _m: None)
    assert seen["device"] == torch.device("cuda", 1)  # not every rank on --device's cuda:0
