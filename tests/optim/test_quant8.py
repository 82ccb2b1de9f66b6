"""Blockwise 8-bit state pages against bitsandbytes' quantize/dequantize, to the last code."""

from __future__ import annotations

import bitsandbytes.functional as bnbf
import pytest
import torch

from tightfit.optim import quant8
from tightfit.paging.layout import StateSpec, build_pages

SPECS = [
    StateSpec("state1", torch.uint8),
    StateSpec("absmax1", torch.float32, quant8.BLOCKSIZE),
    StateSpec("state2", torch.uint8),
    StateSpec("absmax2", torch.float32, quant8.BLOCKSIZE),
]


def _bnb_torch_backend(x: torch.Tensor, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' own pure-torch quantize_blockwise (its path for devices without kernels)."""
    op = torch.ops.bitsandbytes.quantize_blockwise.default
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    return op.redispatch(keys, x, code, quant8.BLOCKSIZE)


def _state_like(n: int, signed: bool) -> torch.Tensor:
    # heavy-tailed values over many decades, as optimizer moments are; a few exact zeros
    x = torch.randn(n) * torch.rand(n).pow(6) * 10.0 ** torch.randint(-6, 2, (n,))
    x[::97] = 0.0
    return x if signed else x.square()


def test_maps_are_bitsandbytes_dynamic_maps() -> None:
    for signed in (True, False):
        m = quant8.dynamic_map(signed)
        assert m.dtype == torch.float32 and m.numel() == 256
        assert torch.equal(m, bnbf.create_dynamic_map(signed=signed).float())
        assert bool((m[1:] >= m[:-1]).all())
    assert quant8.dynamic_map(True) is quant8.dynamic_map(True, "cpu")  # cached


@pytest.mark.parametrize("signed", [True, False])
def test_page_roundtrip_equals_bitsandbytes_to_the_last_code(signed: bool) -> None:
    # params of 8-bit size, one not a multiple of 256, split over small pages (so segments
    # start mid-param and pages hold pieces of several params)
    sizes = [5000, 70_001, 4096]
    values = [_state_like(n, signed) for n in sizes]
    pages = build_pages(0, sizes, [torch.float32] * 3, SPECS, quant8.BLOCKSIZE, 24 << 10, 0)
    assert len(pages) > 3
    code = quant8.dynamic_map(signed)
    codes = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    absmax = [torch.empty(quant8.blocks(n)) for n in sizes]
    for page in pages:
        buf = torch.zeros(page.nbytes, dtype=torch.uint8)
        views = page.segment_views(buf)
        for k, seg in enumerate(page.segments):
            lo, hi = seg.start, seg.start + seg.length
            assert lo % quant8.BLOCKSIZE == 0  # blocks never straddle pages
            c, a = views["state1"][k], views["absmax1"][k]
            quant8.quantize_into(values[seg.param][lo:hi], code, c, a)
            # dequantize from the page views (codes and absmax of the same page)
            deq = quant8.dequantize(c, a, code)
            ref_deq = bnbf.dequantize_blockwise(c, absmax=a, code=code, blocksize=256)
            assert torch.equal(deq, ref_deq)
            codes[seg.param][lo:hi] = c
            absmax[seg.param][lo // 256 : lo // 256 + a.numel()] = a
    for i, x in enumerate(values):
        ref_codes, state = bnbf.quantize_blockwise(x, code=code, blocksize=256)
        assert torch.equal(codes[i], ref_codes)  # every code
        assert torch.equal(absmax[i], state.absmax)
        ref = bnbf.dequantize_blockwise(ref_codes, state)
        assert torch.equal(quant8.dequantize(codes[i], absmax[i], code), ref)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [256 * 40, 256 * 40 + 77, 100])
def test_torch_quantize_equals_bitsandbytes_torch_backend(signed: bool, n: int) -> None:
    code = quant8.dynamic_map(signed)
    x = _state_like(n, signed)
    x[:256] = 0.0  # an all-zero block
    codes, absmax = torch.empty(n, dtype=torch.uint8), torch.empty(quant8.blocks(n))
    quant8.quantize_torch(x, code, codes, absmax)
    ref_codes, ref_absmax = _bnb_torch_backend(x, code)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(absmax, ref_absmax)
    ref = torch.ops.bitsandbytes.dequantize_blockwise(codes, absmax, code, 256, torch.float32)
    assert torch.equal(quant8.dequantize_torch(codes, absmax, code), ref)


@pytest.mark.parametrize("signed", [True, False])
def test_lookup_table_equals_bucketize_at_every_boundary(signed: bool) -> None:
    code = quant8.dynamic_map(signed)
    bounds = (code[:-1] + code[1:]) / 2
    # each map entry, each midpoint and the floats right next to them: where rounding decides
    pts = torch.cat([code, bounds])
    x = torch.cat([pts, torch.nextafter(pts, pts + 1), torch.nextafter(pts, pts - 1)])
    x = x.clamp(-1.0, 1.0)
    got = quant8._table(signed).lookup(x)
    assert torch.equal(got.long(), torch.bucketize(x, bounds))
    assert torch.equal(quant8._table(signed).lookup(code).long(), torch.arange(256))


def test_quantize_into_rejects_mismatched_views() -> None:
    code = quant8.dynamic_map(True)
    with pytest.raises(ValueError, match="views of matching size"):
        quant8.quantize_into(torch.randn(600), code, torch.empty(512, dtype=torch.uint8),
                             torch.empty(3))


def test_backend_choice() -> None:
    cpu = torch.device("cpu")
    assert quant8.resolve_backend("auto", cpu) == "bitsandbytes"  # bitsandbytes >= 0.50 on CPU
    assert quant8.resolve_backend("torch", cpu) == "torch"
    assert quant8.resolve_backend("auto", torch.device("meta")) == "torch"
    with pytest.raises(ValueError, match="backend='torch'"):
        quant8.resolve_backend("bitsandbytes", torch.device("meta"))
    with pytest.raises(ValueError, match="is not one of"):
        quant8.resolve_backend("triton", cpu)  # type: ignore[arg-type]


def test_small_params_stay_32bit_as_in_bitsandbytes() -> None:
    assert not quant8.is_8bit(4095) and quant8.is_8bit(4096)
    assert quant8.blocks(256) == 1 and quant8.blocks(257) == 2
