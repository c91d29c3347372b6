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


@pytest.fixture
def arena():
    """memguard's arena serving torch's CPU tensors, with no budget and an
    empty cache, before and after the test (skips where it cannot be
    installed)."""
    import memguard
    from memguard.memory import arena as allocator

    allocator.set_budget(None)
    try:
        memguard.install()
    except RuntimeError as exc:
        pytest.skip(f"memguard's allocator cannot be installed here: {exc}")
    allocator.trim()
    yield
    allocator.set_budget(None)
    allocator.trim()
    memguard.uninstall()


@pytest.fixture
def one_thread():
    """torch on one thread for the test: reductions in one order, so runs
    compare bit for bit."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def gloo_group(tmp_path):
    """A real one-process gloo group (rank 0 of 1) for the test, destroyed
    after it: DistributedDataParallel runs in-process, its reducer and
    all-reduces included (skips where gloo is not available)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0,
                            world_size=1)
    yield dist
    dist.destroy_process_group()
