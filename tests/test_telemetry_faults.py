"""Telemetry never harms the run it watches: a callback that raises, a
failing ``sys.unraisablehook`` and a full disk leave sampling, the guard's
listeners and the training steps going."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import memguard
from memguard.telemetry import ExportStoppedWarning, Sampler, SkippedLinesWarning, read_jsonl

from .conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]


def python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a plain interpreter: no pytest hooks installed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=120, check=False)


def test_raising_callbacks_neither_stop_sampling_nor_the_guards_listeners():
    # The default sys.unraisablehook accepts only CPython's own argument type:
    # this runs without pytest, whose hook would accept anything.
    out = python("""
        import json, sys, threading, time
        import memguard

        assert sys.unraisablehook is sys.__unraisablehook__
        rss = memguard.Sampler().sample_now().rss_bytes
        s = memguard.Sampler(interval_ms=10, budget=int(rss / 0.95))   # at HIGH or above
        failed = {"sample": None, "pressure": 0}

        def bad_sample(smp):
            if failed["sample"] is None:
                failed["sample"] = smp.seq
                raise RuntimeError("sample callback failed once")

        def bad_pressure(ev):
            failed["pressure"] += 1
            raise RuntimeError("pressure callback failed")

        seen = []
        s.on_sample(bad_sample)
        s.on_pressure(bad_pressure)
        s.on_sample(lambda smp: seen.append(smp.seq))
        guard = memguard.Guard(budget=None, sampler=s, allocator=False)
        with guard:   # its listeners come after the failing ones
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (
                    len(seen) < 20 or guard.summary()["gc"]["reliefs"] == 0):
                time.sleep(0.01)
            alive = any(t.name == "memguard-telemetry" for t in threading.enumerate())
            reliefs = guard.summary()["gc"]["reliefs"]
        print(json.dumps({"alive": alive, "failed": failed, "seen": seen,
                          "reliefs": reliefs}))
    """)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["alive"]
    assert got["failed"]["sample"] is not None and got["failed"]["pressure"] >= 1
    after = [seq for seq in got["seen"] if seq > got["failed"]["sample"]]
    assert len(after) >= 19
    assert got["reliefs"] >= 1   # the guard heard HIGH after both failures
    assert "Exception ignored in memguard telemetry callback" in out.stderr
    assert "RuntimeError: sample callback failed once" in out.stderr
    assert "RuntimeError: pressure callback failed" in out.stderr
    assert "TypeError" not in out.stderr


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 1 MiB tmpfs, unmounted afterwards; skipped where mounting is
    not allowed (not root, no CAP_SYS_ADMIN, no tmpfs)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                              capture_output=True, text=True, timeout=30, check=False)
    except OSError as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield disk
    finally:
        busy = subprocess.run(["umount", str(disk)], capture_output=True, text=True,
                              timeout=30, check=False)
        if busy.returncode != 0:   # a file left open on it: detach it all the same
            subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30,
                           check=True)
            pytest.fail(f"the tmpfs could not be unmounted, a file on it is still open: "
                        f"{busy.stderr.strip()}")


def fill(disk: Path) -> None:
    """Write to ``disk`` until it is full."""
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass


def stopped(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ExportStoppedWarning)]


def test_full_telemetry_disk_fails_no_step_and_no_uninstall(small_disk: Path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(8, 8), torch.randn(8, 1)) for _ in range(40)]
    path = small_disk / "run.jsonl"
    # one sample a minute: the step's own events meet the full disk
    guard = memguard.Guard(budget=None, micro_batch=4, allocator=False,
                           telemetry=str(path), interval_ms=60000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard.install()
        fill(small_disk)
        before = [p.detach().clone() for p in model.parameters()]
        results = [guard.step(b, lambda m: nn.functional.mse_loss(model(m[0]), m[1]), opt)
                   for b in batches]
        guard.uninstall()
    assert guard.steps == len(batches)
    assert all(r is not None and r.n_micro == 2 for r in results)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not guard.installed
    msgs = stopped(caught)
    assert len(msgs) == 1, msgs
    assert repr(str(path)) in msgs[0] and "No space left on device" in msgs[0]
    with warnings.catch_warnings():   # the line the disk cut short, if any, is skipped
        warnings.simplefilter("ignore", SkippedLinesWarning)
        meta, _, events = read_jsonl(path)   # what was written before the disk filled
    assert meta["type"] == "meta" and len(events) < len(batches)


# TensorBoard's own writer thread dies on the full disk and says so; its
# exporter hears of it on its next write and stops
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_full_disk_stops_each_exporter_once_and_sampling_goes_on(small_disk: Path):
    from memguard.telemetry.tensorboard import TensorBoardExporter

    tb = TensorBoardExporter(small_disk / "tb")
    csv_path = small_disk / "samples.csv"
    s = Sampler(interval_ms=5, export=csv_path)
    seen = []
    s.on_sample(tb)
    s.on_sample(lambda smp: seen.append(smp.seq))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with s:
            fill(small_disk)
            full_at = len(seen)
            assert wait_for(lambda: len(seen) >= full_at + 50)   # sampling goes on
        tb.event("step", step=1, micro_batch=4)
        tb.close()
    msgs = stopped(caught)
    assert len(msgs) == 2, msgs
    assert any(repr(str(csv_path)) in m for m in msgs)
    assert any(repr(tb.log_dir) in m for m in msgs)
    assert all("No space left on device" in m for m in msgs)
    assert seen == list(range(seen[0], seen[0] + len(seen)))
