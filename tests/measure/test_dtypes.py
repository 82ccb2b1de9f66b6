"""The one table of dtype names: canonical names, short forms, byte widths, torch dtypes."""

from __future__ import annotations

import pytest
import torch

from tightfit.measure.dtypes import DTYPE_BYTES, DTYPE_NAMES, SHORT_NAMES, dtype_name, torch_dtype


def test_names_are_torchs_and_widths_are_its_item_sizes() -> None:
    assert DTYPE_NAMES == ("float32", "bfloat16", "float16")
    for name in DTYPE_NAMES:
        dtype = torch_dtype(name)
        assert dtype is getattr(torch, name)
        assert DTYPE_BYTES[name] == dtype.itemsize
        assert dtype_name(name) == name


def test_short_forms_map_to_the_same_dtype() -> None:
    assert SHORT_NAMES == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    for short, name in SHORT_NAMES.items():
        assert dtype_name(short) == name
        assert torch_dtype(short) is torch_dtype(name)


@pytest.mark.parametrize("bad", ["float64", "BF16", "", "auto", None, 16])
def test_other_names_are_refused_with_the_choices(bad: object) -> None:
    with pytest.raises(ValueError, match=r"--dtype must be one of float32, bfloat16, float16 "
                                         r"\(or the short forms fp32, bf16, fp16\)"):
        dtype_name(bad, what="--dtype")  # type: ignore[arg-type]
