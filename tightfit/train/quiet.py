"""Other libraries' output that is no business of a ``tightfit`` user, switched off with those
libraries' own switches and only around tightfit's calls into them (the state before comes
back, so a Python caller's own use of transformers or datasets is left as it was).

* progress bars (``tightfit -q``, or ``progress=False`` in Python): transformers' "Loading
  weights" and "Writing model shards" (``transformers.utils.logging.disable_progress_bar``)
  and datasets' map and load bars (``datasets.disable_progress_bars``);
* deprecation warnings raised inside transformers by peft's calls, which the user can neither
  act on nor avoid (``warnings`` filters scoped to the call, by message).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from tightfit.train.data.sources import quiet_datasets

# FutureWarnings libraries raise at each other, not at the user's code (message regexes).
LIBRARY_DEPRECATIONS = (
    r"`is_gradient_checkpointing` is deprecated",  # transformers 5, on peft's merge/load
)


@contextlib.contextmanager
def library_bars(progress: bool) -> Iterator[None]:
    """transformers' and datasets' progress bars off inside unless ``progress``."""
    if progress:
        yield
        return
    from transformers.utils import logging as hf_logging

    hf_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with quiet_datasets(False):  # datasets' half, as the data pipeline does it
            yield
    finally:
        if hf_was_on:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def no_library_deprecations() -> Iterator[None]:
    """The :data:`LIBRARY_DEPRECATIONS` warnings not shown inside (every other one is)."""
    with warnings.catch_warnings():
        for message in LIBRARY_DEPRECATIONS:
            warnings.filterwarnings("ignore", message=message, category=FutureWarning)
        yield
