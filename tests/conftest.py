"""Shared test helpers."""
from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture
def restore_options():
    """Put every option back as it was after the test."""
    from memguard import _C

    saved = {n: _C.option_get(n) for n in _C.option_names()}
    yield
    for n, v in saved.items():
        _C.option_set(n, v)
