"""``OptimizerOptions``: every choice :func:`tightfit.optimizer_for` takes, in one object.

``tightfit train`` builds its optimizer flags from the fields (their ``metadata["help"]``; a
field with ``metadata["cli"] = False`` is for the Python API only), and
:func:`~tightfit.optim.registry.optimizer_for` takes the object as it is. The four paging
fields are made into the store's :class:`~tightfit.paging.paging_options.PagingOptions` once,
here, when the options are made (checked then); that object, ``options.paging``, is what the
optimizer, its page store and the residency plan receive.

The learning rate's default is the QLoRA recipe's (:data:`RECIPE_LR`), the one that
``tightfit train`` uses; the paged optimizer classes keep torch's own defaults.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from tightfit.paging.paging_options import DEFAULT_PAGE_BYTES, PagingOptions
from tightfit.pressure.probes import Probe

OptimizerKind = Literal[
    "paged_adamw",
    "paged_adam",
    "paged_adamw8bit",
    "paged_adam8bit",
    "paged_lion",
    "paged_lion8bit",
    "paged_sgd",
    "adamw",
]
# Every kind; "adamw" is torch's AdamW, the unpaged reference (tightfit.optim.registry maps
# the others to their classes).
KINDS: tuple[str, ...] = (
    "paged_adamw", "paged_adam", "paged_adamw8bit", "paged_adam8bit", "paged_lion",
    "paged_lion8bit", "paged_sgd", "adamw",
)  # fmt: skip
# What --target takes: "auto" (on where it can act), a fraction of capacity, bytes, or None.
Target = float | int | Literal["auto"] | None

# QLoRA's learning rate (Dettmers et al. 2023 and its reference qlora.py), the default of
# optimizer_for and of tightfit train.
RECIPE_LR = 2e-4

_API_ONLY = {"cli": False}  # not a flag of tightfit train (see the module docstring)


@dataclass(frozen=True)
class OptimizerOptions:
    """Which optimizer, its hyperparameters, and how much of each memory tier its state may use.

    Attributes:
        paging: ``page_bytes``, ``device_budget``, ``host_budget`` and ``spill_dir`` as the
            page store takes them (made and checked with these options; not a field to set).
    """

    kind: OptimizerKind = field(
        default="paged_adamw", metadata={"help": "optimizer: " + ", ".join(KINDS)}
    )
    lr: float = field(default=RECIPE_LR, metadata={"help": "learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "decoupled weight decay"})
    page_bytes: int | None = field(
        default=None, metadata={"help": "bytes per optimizer-state page (default: the pager's)"}
    )
    device_budget: int | None = field(
        default=None, metadata={"help": "bytes of optimizer state kept on the device tier"}
    )
    host_budget: int | None = field(
        default=None, metadata={"help": "bytes of optimizer state kept on the host tier"}
    )
    spill_dir: str | None = field(
        default=None, metadata={"help": "folder for the disk tier's spill file"}
    )
    target: Target = field(
        default="auto",
        metadata={"help": "keep the device's total usage under this, evicting optimizer pages "
                          "before activation spikes pass it: a fraction of capacity (0.9) or "
                          "bytes (6GiB; on the CPU it reads RSS); auto: 0.9 of a CUDA device, "
                          "or of the memory cgroup's limit on the CPU (off without one); none: "
                          "off (see docs/pressure.md)"},
    )
    betas: tuple[float, float] | None = field(
        default=None,
        metadata={**_API_ONLY, "help": "None: the kind's default, (0.9, 0.999) for Adam kinds, "
                                       "(0.9, 0.99) for Lion"},
    )
    eps: float = field(default=1e-8, metadata={**_API_ONLY, "help": "Adam's epsilon"})
    probe: Probe | None = field(
        default=None,
        metadata={**_API_ONLY, "help": "reads the device's usage (None: default_probe: CUDA's "
                                       "allocator, the CPU's cgroup or RSS)"},
    )
    watch: bool = field(
        default=True,
        metadata={**_API_ONLY, "help": "with a target, hook the model's blocks so pages leave "
                                       "before a spike passes it"},
    )
    extra: Mapping[str, Any] = field(
        default_factory=dict, hash=False,
        metadata={**_API_ONLY, "help": "further keywords of the optimizer class (momentum for "
                                       "paged_sgd, amsgrad, min_8bit_size, backend, foreach, ...)"},
    )  # fmt: skip
    paging: PagingOptions = field(init=False, repr=False, compare=False, metadata=_API_ONLY)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown optimizer kind {self.kind!r}; choose one of {list(KINDS)}.")
        if self.lr <= 0:
            raise ValueError(f"learning rate must be > 0, got {self.lr}.")
        check_target(self.target)
        spill_dir = None if self.spill_dir is None else os.fspath(self.spill_dir)
        page_bytes = DEFAULT_PAGE_BYTES if self.page_bytes is None else self.page_bytes
        paging = PagingOptions(page_bytes, self.device_budget, self.host_budget, spill_dir)
        object.__setattr__(self, "paging", paging)


def check_target(target: object) -> None:
    """Raise ``ValueError``/``TypeError`` unless ``target`` is a value ``--target`` takes."""
    if target is None or target == "auto":
        return
    if isinstance(target, bool) or not isinstance(target, int | float):
        raise TypeError(f"target must be 'auto', a fraction (0.9), bytes (6GiB) or none, got "
                        f"{target!r}.")
    if isinstance(target, float) and not 0.0 < target <= 1.0:
        raise ValueError(f"a fractional target must be in (0, 1], got {target}; pass bytes as "
                         "an integer (e.g. 6GiB) or a fraction such as 0.9.")
    if isinstance(target, int) and target <= 0:
        raise ValueError(f"a target in bytes must be positive, got {target}; e.g. 6GiB.")


# The keywords a paged optimizer's constructor takes besides torch's (checked here once).
_PAGING_FIELDS = tuple(f.name for f in fields(PagingOptions))


def check_keywords(owner: str, keywords: dict[str, Any]) -> None:
    """Raise Python's ``TypeError`` for an unexpected keyword (plus the options there are)
    unless every one of ``keywords`` is a paging option."""
    unknown = [k for k in keywords if k not in ("paging", *_PAGING_FIELDS, "target", "probe")]
    if unknown:
        raise TypeError(
            f"{owner}.__init__() got an unexpected keyword argument {unknown[0]!r}; its "
            f"paging options are paging, {', '.join(_PAGING_FIELDS)}, target, probe (see "
            "tightfit.paging.paging_options.PagingOptions)"
        )


def paging_options(paging: PagingOptions | None, keywords: dict[str, Any]) -> PagingOptions:
    """The store's options of a constructor call: ``paging``, or made from its fields given as
    keywords (checked there); both only when they agree (``ValueError`` naming both)."""
    if paging is None:
        return PagingOptions(**keywords)
    if not isinstance(paging, PagingOptions):
        raise TypeError(f"paging must be a PagingOptions or None, got {paging!r}")
    differ = [f"{k}={v!r}" for k, v in keywords.items() if getattr(paging, k) != v]
    if differ:
        raise ValueError(f"got paging={paging!r} and {', '.join(differ)}: pass the paging "
                         "options once, as paging=PagingOptions(...) or as keywords")
    return paging
