"""Finding 8 (issue 25): bitsandbytes' 8-bit kernel launches on the legacy default stream.

When ``step()`` runs under another (non-blocking) stream, the default stream must wait for it
before the kernel (the page loads have landed) and it must wait for the default stream after
(a page leaving sees the update). Under the strict emulation (``strict_cuda``,
tests/conftest.py) the kernel is run on the default stream, as bitsandbytes launches it, and
the stream clocks check every access of the step."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tightfit.optim import quant8
from tightfit.optim.adamw8bit import PagedAdamW8bit

CUDA0 = torch.device("cuda", 0)


def _waits(emu) -> list[tuple[str, ...]]:  # noqa: ANN001
    return [c for c in emu.calls if c[0] in ("wait_stream", "kernel")]


def test_the_kernel_runs_between_the_two_waits(strict_cuda) -> None:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), quant8.bnb_stream_order(CUDA0):
        strict_cuda.calls.append(("kernel",))
    assert _waits(strict_cuda) == [("wait_stream", "compute", side.name), ("kernel",),
                                   ("wait_stream", side.name, "compute")]  # fmt: skip


def test_the_current_stream_waits_even_when_the_kernel_raises(strict_cuda) -> None:
    side = torch.cuda.Stream()
    boom = pytest.raises(RuntimeError, match="boom")
    with boom, torch.cuda.stream(side), quant8.bnb_stream_order(CUDA0):
        raise RuntimeError("boom")
    assert _waits(strict_cuda) == [("wait_stream", "compute", side.name),
                                   ("wait_stream", side.name, "compute")]  # fmt: skip


def test_no_waits_on_the_default_stream_or_off_cuda(strict_cuda, monkeypatch) -> None:
    with quant8.bnb_stream_order(CUDA0):
        strict_cuda.calls.append(("kernel",))
    assert _waits(strict_cuda) == [("kernel",)]

    def no_cuda(device=None):  # noqa: ANN001, ANN202
        raise AssertionError("touched torch.cuda on the CPU")

    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    with quant8.bnb_stream_order(torch.device("cpu")):
        pass


def _step_under_a_side_stream(monkeypatch, emu, order) -> None:  # noqa: ANN001
    """A PagedAdamW8bit step under a side stream, bitsandbytes' kernel run on the default
    stream (as it launches), the stream order around it given by ``order``."""
    real_ops = quant8.bnb_ops()

    class Ops:  # bitsandbytes' op, on the legacy default stream
        def optimizer_update_8bit_blockwise(self, *args):  # noqa: ANN002, ANN202
            emu.calls.append(("kernel",))
            with torch.cuda.stream(torch.cuda.default_stream()):
                return real_ops.optimizer_update_8bit_blockwise(*args)

    # the params stay on the CPU; the stream order is asked for as if they were on cuda:0
    monkeypatch.setattr(quant8, "bnb_stream_order", lambda device: order(CUDA0))
    monkeypatch.setattr(quant8, "bnb_ops", lambda: Ops())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        params = [torch.nn.Parameter(torch.randn(n)) for n in (8192, 5000)]
        opt = PagedAdamW8bit(params, lr=1e-3, backend="bitsandbytes")
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        opt.close()


def test_the_paged_8bit_update_calls_bitsandbytes_inside_the_waits(strict_cuda,
                                                                   monkeypatch) -> None:
    _step_under_a_side_stream(monkeypatch, strict_cuda, quant8.bnb_stream_order)
    inside, kernels = False, 0  # each step: default waits side, kernels, side waits default
    for call in _waits(strict_cuda):
        if call == ("wait_stream", "compute", "side1"):
            assert not inside
            inside = True
        elif call == ("wait_stream", "side1", "compute"):
            assert inside
            inside = False
        else:
            assert inside, "a kernel outside the waits"
            kernels += 1
    assert not inside and kernels >= 2
    assert strict_cuda.violations == []


def test_without_the_waits_the_kernel_races_the_current_stream(strict_cuda,
                                                               monkeypatch) -> None:
    """What the emulation sees without :func:`quant8.bnb_stream_order` (the code before it)."""
    _step_under_a_side_stream(monkeypatch, strict_cuda, lambda device: contextlib.nullcontext())
    assert any("without waiting" in v for v in strict_cuda.violations)
    strict_cuda.violations.clear()
