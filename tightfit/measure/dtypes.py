"""The dtype names of ``tightfit train``, ``tightfit plan`` and the Python API: one table.

The names are torch's (``"float32"``, ``"bfloat16"``, ``"float16"``); the short forms people
also write (``"fp32"``, ``"bf16"``, ``"fp16"``) are accepted as input and mean the same dtype.
torch is imported only by :func:`torch_dtype`: the names and byte widths need no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch

DtypeName = Literal["float32", "bfloat16", "float16"]
DTYPE_NAMES: tuple[DtypeName, ...] = get_args(DtypeName)
DTYPE_BYTES: dict[DtypeName, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
SHORT_NAMES: dict[str, DtypeName] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def dtype_name(name: str, *, what: str = "dtype") -> DtypeName:
    """The canonical name of a dtype name or short form (``"bf16"`` → ``"bfloat16"``).

    Args:
        name: ``"float32"``, ``"bfloat16"``, ``"float16"`` or a short form of one.
        what: What the dtype is for, used in the error message (e.g. ``"compute_dtype"``).

    Raises:
        ValueError: Any other name; the message lists the accepted ones.
    """
    if isinstance(name, str):
        if name in DTYPE_BYTES:
            return name  # type: ignore[return-value]
        if name in SHORT_NAMES:
            return SHORT_NAMES[name]
    raise ValueError(
        f"{what} must be one of {', '.join(DTYPE_NAMES)} (or the short forms "
        f"{', '.join(SHORT_NAMES)}), got {name!r}."
    )


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name or short form (``"bf16"`` → ``torch.bfloat16``)."""
    import torch

    return getattr(torch, dtype_name(name))
