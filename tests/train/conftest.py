"""Tiny models made here (nothing downloaded); one torch thread.

datasets and the hub are offline, and datasets' default cache is a temporary folder (the
train job passes its own cache folder anyway; this keeps ``~/.cache`` out of it for certain).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from .helpers import tiny_llama

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="tightfit-test-datasets-"))


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test here runs on one torch thread (``one_thread`` in tests/conftest.py)."""


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny Llama folder with a tokenizer whose ids are the UTF-8 bytes."""
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tokenizer=True)
