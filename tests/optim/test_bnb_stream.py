"""Finding 8 (issue 25): bitsandbytes' 8-bit kernel launches on the legacy default stream.

When ``step()`` runs under another (non-blocking) stream, the default stream must wait for it
before the kernel (the page loads have landed) and it must wait for the default stream after
(a page leaving sees the update). Fake streams record the order on the CPU."""

from __future__ import annotations

import pytest
import torch

from tightfit.optim import quant8
from tightfit.optim.adamw8bit import PagedAdamW8bit

CUDA0 = torch.device("cuda", 0)


class FakeStream:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits {other.name}")


def _streams(monkeypatch: pytest.MonkeyPatch, *, side: bool) -> list[str]:
    log: list[str] = []
    default = FakeStream("default", log)
    current = FakeStream("side", log) if side else default
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: default)
    return log


def test_the_kernel_runs_between_the_two_waits(monkeypatch) -> None:
    log = _streams(monkeypatch, side=True)
    with quant8.bnb_stream_order(CUDA0):
        log.append("kernel")
    assert log == ["default waits side", "kernel", "side waits default"]


def test_the_current_stream_waits_even_when_the_kernel_raises(monkeypatch) -> None:
    log = _streams(monkeypatch, side=True)
    with pytest.raises(RuntimeError, match="boom"), quant8.bnb_stream_order(CUDA0):
        raise RuntimeError("boom")
    assert log == ["default waits side", "side waits default"]


def test_no_waits_on_the_default_stream_or_off_cuda(monkeypatch) -> None:
    log = _streams(monkeypatch, side=False)
    with quant8.bnb_stream_order(CUDA0):
        log.append("kernel")
    assert log == ["kernel"]

    def no_cuda(device=None):  # noqa: ANN001, ANN202
        raise AssertionError("touched torch.cuda on the CPU")

    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    with quant8.bnb_stream_order(torch.device("cpu")):
        pass


def test_the_paged_8bit_update_calls_bitsandbytes_inside_the_waits(monkeypatch) -> None:
    log = _streams(monkeypatch, side=True)
    real_order, real_ops = quant8.bnb_stream_order, quant8.bnb_ops()

    class Ops:  # bitsandbytes' op, logged
        def optimizer_update_8bit_blockwise(self, *args):  # noqa: ANN002, ANN202
            log.append("kernel")
            return real_ops.optimizer_update_8bit_blockwise(*args)

    # the params stay on the CPU; the stream order is asked for as if they were on cuda:0
    monkeypatch.setattr(quant8, "bnb_stream_order", lambda device: real_order(CUDA0))
    monkeypatch.setattr(quant8, "bnb_ops", lambda: Ops())
    params = [torch.nn.Parameter(torch.randn(n)) for n in (8192, 5000)]
    opt = PagedAdamW8bit(params, lr=1e-3, backend="bitsandbytes")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert log[0] == "default waits side" and log[-1] == "side waits default"
    assert set(log[1:-1]) == {"kernel"} and len(log) >= 3
