"""Tiny models here: one torch thread (a second buys nothing and stalls on a busy machine)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test here runs on one torch thread (``one_thread`` in tests/conftest.py)."""
