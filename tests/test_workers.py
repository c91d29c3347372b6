"""The DataLoader workers (child processes): their number and memory in the
samples, ``memguard watch``, ``memguard report`` and the Lightning metrics,
and the guard's advice on them, given once.

The real case runs once for the module (:func:`run`): a loader of two
persistent workers that each hold 80 MiB of their own, a guard stepping a
small model on its batches under a budget the workers take a fifth of.
"""
from __future__ import annotations

import sys
import warnings

import pytest

import memguard
from memguard._common import MiB
from memguard.cli.report import scan
from memguard.cli.watch import format_line
from memguard.telemetry import Event, read_jsonl, workers_metrics
from memguard.telemetry.samples import Sample
from memguard.telemetry.workers import describe, give_back, own_bytes
from memguard.train.workers import SHARE, WorkersAdvice, WorkersWarning

torch = pytest.importorskip("torch")

WORKERS, HELD = 2, 80 * MiB
linux = pytest.mark.skipif(not sys.platform.startswith("linux"),
                           reason="the process tree below the process is read from Linux's /proc")


class _Held(torch.utils.data.Dataset):
    """64 samples of 16 features; each worker holds HELD bytes of its own."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((16,), float(i))


def _hold(_: int) -> None:
    """In each worker: HELD bytes written, so they are its own (not shared with the parent)."""
    global _held
    _held = bytearray(b"\1") * HELD


def _wait_for_workers(loader_iter) -> Sample:
    """A sample once the workers hold what they allocate (their first batch is out)."""
    import time

    next(loader_iter)
    for _ in range(100):
        s = memguard.sample()
        if (s.children or 0) >= WORKERS and (s.children_bytes or 0) >= WORKERS * HELD * 0.9:
            return s
        time.sleep(0.05)
    pytest.fail(f"the workers were not seen holding their memory: {s.children} "
                f"children, {s.children_bytes} bytes")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The real case, once: (the sample with the workers, the warnings, the
    telemetry file)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the process tree below the process is read from Linux's /proc")
    path = tmp_path_factory.mktemp("workers") / "run.jsonl"
    loader = torch.utils.data.DataLoader(_Held(), batch_size=8, num_workers=WORKERS,
                                         worker_init_fn=_hold, persistent_workers=True)
    it = iter(loader)
    s = _wait_for_workers(it)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    budget = s.footprint_bytes + 5 * WORKERS * HELD - s.children_bytes   # the workers: a fifth
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memguard.Guard(budget=budget, allocator=False, telemetry=str(path),
                            interval_ms=20) as g:
            for _ in range(3):
                g.step(next(it), lambda b: model(b).square().mean(), opt)
        with memguard.Guard(budget=budget, allocator=False) as g, g.evaluate():
            for _ in range(3):                   # an evaluation alone: advised too
                g.infer(next(it), model)
    del it, loader
    return s, [w for w in caught if issubclass(w.category, WorkersWarning)], path


@linux
def test_samples_and_watch_name_the_workers(run):
    """A sample counts the workers and their bytes apart from the process's
    own, its JSON carries both, and ``memguard watch`` shows them."""
    s, _, _ = run
    assert s.children == WORKERS and s.children_bytes >= WORKERS * HELD * 0.9
    assert own_bytes(s) == s.footprint_bytes - s.children_bytes
    d = s.to_dict()
    assert (d["children"], d["children_bytes"]) == (s.children, s.children_bytes)
    assert f" workers {WORKERS} ({s.children_bytes / MiB:,.0f} MiB) " in format_line(s)
    m = workers_metrics(s)
    assert m["memguard/workers"] == WORKERS and m["memguard/workers_mib"] >= 0.9 * 160


@linux
def test_advice_given_once_with_its_event(run):
    """Three steps under a budget the workers take a fifth of: one warning,
    one ``workers`` event, both naming the workers, their bytes and what
    fewer would give back."""
    _, caught, path = run
    assert len(caught) == 2, [str(w.message) for w in caught]   # the steps', the evaluation's
    assert f"{WORKERS} DataLoader workers (child processes) hold" in str(caught[1].message)
    msg = str(caught[0].message)
    assert f"{WORKERS} DataLoader workers (child processes) hold" in msg
    assert "num_workers=1 would give back about" in msg and "num_workers=0 about" in msg
    assert caught[0].filename == __file__     # the warning points at the script's step
    _, _, events = read_jsonl(path)
    advice = [e for e in events if e["event"] == Event.WORKERS]
    assert len(advice) == 1, advice
    e = advice[0]
    assert e["workers"] == WORKERS and e["workers_bytes"] >= WORKERS * HELD * 0.9
    assert "share" in e["reasons"] and e["share"] >= SHARE
    assert [g["num_workers"] for g in e["give_back"]] == [1, 0]
    assert e["give_back"][1]["bytes"] == e["workers_bytes"] // WORKERS * WORKERS


@linux
def test_report_shows_the_workers_and_the_advice(run):
    """The report's summary names the workers with their bytes and the
    advice; its memory panel has the workers' line and the advice's event line."""
    _, _, path = run
    r = scan(path)
    summary = r.summary(path)
    assert summary.peak_workers == WORKERS
    assert summary.peak_workers_bytes >= WORKERS * HELD * 0.9
    rows = dict(summary.rows())
    assert rows["DataLoader workers (child processes)"].startswith(f"at most {WORKERS}, holding")
    assert rows["advice on the workers"].startswith(f"step 1: {WORKERS} workers held")
    assert "num_workers=0" in rows["advice on the workers"]
    assert len(r.lines["children_bytes"]) == summary.samples
    assert len(r.event_lines["workers"]) == 1


def test_no_advice_without_workers():
    """Steps of a guard in a process without children: no warning, no event."""
    events = []
    advice = WorkersAdvice(lambda name, **kw: events.append(name))
    none = Sample.from_dict({"children": 0, "children_bytes": 0, "footprint_bytes": 1 << 30})
    unknown = Sample.from_dict({"footprint_bytes": 1 << 30})   # not Linux: no figure
    for step in range(3):
        assert not advice.check(none, 1 << 30, 32, 8, _Planner(None), step=step)
        assert not advice.check(unknown, 1 << 30, 32, 8, _Planner(None), step=step)
    assert workers_metrics(unknown) == {}
    assert " workers " not in format_line(none)
    assert events == [] and not advice.given


class _Planner:
    """A planner that predicts ``peak`` bytes for any size (``None``: no model yet)."""

    def __init__(self, peak: int | None, budget: int = 1000 * MiB) -> None:
        self.peak, self.budget = peak, budget

    def predict(self, n: int) -> int | None:
        return self.peak

    def state(self) -> dict:
        return {"budget_bytes": self.budget, "margin": 0.05}


@pytest.mark.parametrize("peak, advised", [(1100 * MiB, True), (1200 * MiB, False),
                                           (None, False)])
def test_advice_when_the_workers_keep_the_whole_batch_out(peak, advised):
    """Workers of a twentieth of the budget (below the share) are advised on
    only when the whole batch, split now, would fit in the room they take
    (the planner's margin kept): 1100 MiB fits 1000 + 200 MiB less 5 %,
    1200 MiB does not, and nothing is said before the planner predicts."""
    events = []
    advice = WorkersAdvice(lambda name, **kw: events.append((name, kw)))
    s = Sample.from_dict({"children": 4, "children_bytes": 200 * MiB})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not advice.check(s, 4000 * MiB, 32, 8, _Planner(peak), step=4)  # first sight
        assert advice.check(s, 4000 * MiB, 32, 8, _Planner(peak), step=5) is advised
    assert len(caught) == len(events) == advised
    if advised:
        assert "keep the step at micro-batch 8 of 32" in str(caught[0].message)
        name, kw = events[0]
        assert name == Event.WORKERS and kw["reasons"] == ["micro_batch"]
        assert kw["whole_batch_peak_bytes"] == peak
        assert not advice.check(s, 4000 * MiB, 32, 8, _Planner(peak), step=6)   # once


def test_advice_waits_for_the_workers_to_be_started():
    """A loader starts its workers one by one: the advice names them once
    their number held over two boundaries, not the first ones seen."""
    events = []
    advice = WorkersAdvice(lambda name, **kw: events.append(kw))
    for step, n in enumerate((2, 3, 4)):   # each boundary sees more
        s = Sample.from_dict({"children": n, "children_bytes": n * 200 * MiB})
        assert not advice.check(s, 2000 * MiB, 32, 32, _Planner(None), step=step)
    with pytest.warns(WorkersWarning, match="4 DataLoader workers"):
        assert advice.check(s, 2000 * MiB, 32, 32, _Planner(None), step=3)
    assert events[0]["workers"] == 4 and events[0]["workers_bytes"] == 800 * MiB


def test_what_fewer_workers_give_back():
    """Halving, then none, each worker taken as an equal share."""
    assert give_back(4, 600 * MiB) == [(2, 300 * MiB), (0, 600 * MiB)]
    assert give_back(1, 100 * MiB) == [(0, 100 * MiB)]
    assert give_back(0, 0) == []
    assert describe(4, 600 * MiB) == ("4 DataLoader workers (child processes) hold 600.0 MiB; "
                                      "num_workers=2 would give back about 300.0 MiB, "
                                      "num_workers=0 about 600.0 MiB")
