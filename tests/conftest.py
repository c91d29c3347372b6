"""Shared test helpers."""
from __future__ import annotations

import gc
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any, Callable

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_bounded(cmd: list[str], env: dict[str, str], timeout_s: float, what: str,
                cwd: Any = None) -> str:
    """Run ``cmd`` (a launch of several processes) to its end; its output.
    Past ``timeout_s`` its whole session is killed and the test fails,
    saying ``what`` hung: a rank waiting in a collective another never
    joins fails the test instead of hanging it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what} did not finish in {timeout_s} s (a rank hung):\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out
FIXTURES = ROOT / "tests" / "fixtures"

_frozen_before: list = [None]   # the module whose first test last froze the heap


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the first test of each module (its fixtures not made yet):
    collect what the modules before left, and freeze what is still alive
    (torch, Lightning, every module imported, the session's fixtures:
    hundreds of thousands of objects) out of the cyclic collector's reach.
    memguard's reliefs run a full ``gc.collect()``, one per out-of-memory
    error in an update, and each walked all of them: 0.25-0.4 s a
    collection, 29 of test_step_transaction.py's 48 s. What the module's
    tests make is collected as before."""
    if item.path != _frozen_before[0]:
        _frozen_before[0] = item.path
        gc.collect()
        gc.freeze()


def wait_for(pred: Callable[[], Any], timeout: float = 30.0) -> bool:
    """Whether ``pred()`` holds within ``timeout`` seconds, polled every
    10 ms. A loaded machine delays what a test waits for: the test waits
    longer instead of failing, and where it passes it waits no longer than
    the event took."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())


def check_pace(samples: Sequence[Any], interval_s: float, elapsed_s: float | None = None) -> None:
    """Check what no load can break about a sampler's pace: it never runs
    ahead of its interval.

    Its thread aims each sample at the first slot of its interval grid
    after the previous sample ended, and a late sample only moves the next
    slot on, so any k consecutive gaps of one run together span more than
    k - 1 intervals, and a run that lasted ``elapsed_s`` seconds (measured
    around its start and stop) holds at most ``elapsed_s / interval_s + 1``
    samples. A slow machine makes samples fewer and later, never more or
    earlier; how many a quiet machine would take is no part of the check.

    Args:
        samples: one run of the sampler's thread, oldest first (the first
            one's ``interval_s`` is from before the run and is not read).
        interval_s: the interval the sampler was asked for.
        elapsed_s: how long the run lasted at most; ``None``: not known.
    """
    assert samples, "the sampler took no sample"
    if elapsed_s is not None:
        assert len(samples) <= elapsed_s / interval_s + 1 + 1e-6, \
            f"{len(samples)} samples in {elapsed_s:.3f} s at an interval of {interval_s} s"
    # lead[k]: the time from the first sample to the k-th, less k intervals; it
    # may not fall a whole interval below any earlier lead
    lead, top, top_k = 0.0, 0.0, 0
    for k, s in enumerate(samples[1:], 1):
        lead += s.interval_s - interval_s
        assert lead > top - interval_s - 1e-9, (
            f"samples {samples[top_k].seq} to {s.seq}: {k - top_k} gaps in "
            f"{lead - top + (k - top_k) * interval_s:.4f} s, not more than "
            f"{k - top_k - 1} intervals of {interval_s} s")
        if lead > top:
            top, top_k = lead, k


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
