"""tightfit: fine-tune large language models in far less memory.

The public API is re-exported here. Names are resolved lazily so that ``import tightfit``
stays cheap (no transformers/peft import until a name that needs them is used).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "MemoryTracker": "tightfit.measure.tracker",
    "plan": "tightfit.planner.ladder",
    "PlanReport": "tightfit.planner.ladder",
    "prepare": "tightfit.qlora.prepare",
    "optimizer_for": "tightfit.optim.registry",
    "PrepareOptions": "tightfit.qlora.prepare_options",
    "LoraOptions": "tightfit.qlora.prepare_options",
    "enable_paged_base": "tightfit.qlora.paged_base",
    "disable_paged_base": "tightfit.qlora.paged_base",
    "MemoryReport": "tightfit.report.report",
    "measure_report": "tightfit.report.report",
    "chunked_cross_entropy": "tightfit.loss",
    "enable_chunked_loss": "tightfit.loss",
    "disable_chunked_loss": "tightfit.loss",
    "auto_chunk_tokens": "tightfit.loss",
    "predict_head_loss_bytes": "tightfit.loss",
    "predict_model_head_loss_bytes": "tightfit.loss",
    "Plan": "tightfit.checkpoint.plan",
    "PagedAdamW": "tightfit.optim.adamw",
    "PagedAdam": "tightfit.optim.adamw",
    "PagedOptimizer": "tightfit.optim.base",
    "PagedAdamW8bit": "tightfit.optim.adamw8bit",
    "PagedAdam8bit": "tightfit.optim.adamw8bit",
    "PagedLion": "tightfit.optim.lion",
    "PagedLion8bit": "tightfit.optim.lion",
    "PagedSGD": "tightfit.optim.sgd",
    "Probe": "tightfit.pressure.probes",
    "CudaProbe": "tightfit.pressure.probes",
    "RSSProbe": "tightfit.pressure.probes",
    "CgroupProbe": "tightfit.pressure.probes",
    "PressureWatch": "tightfit.pressure.watch",
    "OccupancyControl": "tightfit.pressure.occupancy",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tightfit' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
