"""What a guard does around its steps does no harm: teardown completes
whatever raises in it, the tensor budget refuses only inside guarded steps
(where a refusal is recovered) and elsewhere serves and reports, and the
process's own peak counters are read, never reset."""
from __future__ import annotations

import gc
import json
import resource
import time

import pytest

torch = pytest.importorskip("torch")

import memguard
from memguard import BudgetOverrunWarning
from memguard._common import MiB
from memguard.memory import arena


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _step(guard, model, opt, n=32):
    x, y = torch.randn(n, 64), torch.randn(n, 1)
    return guard.step((x, y), lambda b: torch.nn.functional.mse_loss(model(b[0]), b[1]), opt)


class _Broken(RuntimeError):
    pass


def _raise(*a, **k):
    raise _Broken("a part of the teardown failed")


@pytest.mark.parametrize("part", ["gc", "governor", "sampler", "room"])
def test_uninstall_finishes_every_part_when_one_raises(monkeypatch, tmp_path, part):
    before = arena.stats()["budget_bytes"]
    g = memguard.Guard(budget=None, tensor_budget="256MiB", telemetry=str(tmp_path / "t.jsonl"))
    g.install()
    sampler, exporter = g.sampler, g.signals.exporter
    target = {"gc": (g.gc, "uninstall"), "governor": (g.signals, "_stop_governor"),
              "sampler": (sampler, "stop"), "room": (g.room, "uninstall_arena")}[part]
    try:
        monkeypatch.setattr(*target, _raise)
    except (AttributeError, TypeError):
        pytest.skip(f"{part}: a C type's method cannot be replaced")
    with pytest.raises(_Broken):
        g.uninstall()
    monkeypatch.undo()
    assert not g.installed
    if part != "gc":
        assert g.gc._callback not in gc.callbacks
    if part != "sampler":
        assert not sampler.running
    else:
        sampler.stop()
    assert g.signals.exporter is None and exporter._f.closed       # the file was closed
    if part != "room":
        assert arena.stats()["budget_bytes"] == before
    else:
        g.room.uninstall_arena()                    # what the failed part left
    g.uninstall()                                   # again: nothing left to do
    with memguard.Guard(budget=None, tensor_budget="256MiB") as again:   # not "another guard"
        assert again.installed
    arena.set_budget(before or None)


def test_an_allocation_past_the_budget_outside_a_step_is_served_and_reported(tmp_path):
    path = tmp_path / "t.jsonl"
    model, opt = _model_and_opt()
    with memguard.Guard(budget=None, tensor_budget="64MiB", micro_batch=32,
                        telemetry=str(path), interval_ms=20) as g:
        if g.allocator_error is not None:
            pytest.skip(g.allocator_error)
        _step(g, model, opt)
        with pytest.warns(BudgetOverrunWarning, match=r"outside a guarded step.*64\.0 MiB"):  # noqa: PT031
            big = torch.ones(96 * MiB, dtype=torch.uint8)    # no split can help here
            deadline = time.monotonic() + 10                 # the sampler's thread reports it
            while g.boundary.overruns.check() == 0 and time.monotonic() < deadline and \
                    '"overrun"' not in path.read_text():
                time.sleep(0.02)
        assert int(big[-1]) == 1
        del big
        assert _step(g, model, opt).n_micro == 1            # steps go on
    events = [json.loads(x) for x in path.read_text().splitlines()]
    over = [e for e in events if e.get("event") == "overrun"]
    assert len(over) == 1 and over[0]["last_bytes"] >= 96 * MiB
    assert over[0]["where"] == "outside a guarded step"
    assert any(e.get("event") == "relieve" and e.get("reason") == "overrun" for e in events)


def test_inside_a_step_the_budget_refuses_and_the_step_splits():
    """The same 96 MiB inside a step's attempts is refused, so the step
    is redone smaller instead of passing the budget."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(1))
    opt = torch.optim.SGD([w], lr=0.1)

    def loss_fn(micro):     # 3 MiB a sample: 32 samples pass 64 MiB, 8 fit
        hog = torch.ones(micro.shape[0], 3 * MiB // 4)
        return (micro.sum() + hog.sum() * 0) * w.sum()

    with memguard.Guard(budget=None, tensor_budget="64MiB", micro_batch=32) as g:
        if g.allocator_error is not None:
            pytest.skip(g.allocator_error)
        before = arena.stats()["num_overruns"]
        res = g.step(torch.ones(32, 1), loss_fn, opt)
        assert res.n_micro > 1 and g.ooms_recovered >= 1
        assert arena.stats()["num_overruns"] == before
        assert arena.stats()["reserved_bytes.peak"] <= 64 * MiB


def test_a_budget_set_without_a_guard_still_refuses():
    before, was = arena.stats()["budget_bytes"], arena.installed()
    memguard.install(budget="64MiB")
    try:
        with pytest.raises(RuntimeError, match="can't allocate memory"):
            torch.ones(96 * MiB, dtype=torch.uint8)
    finally:
        arena.set_budget(before or None)
        if not was:
            arena.uninstall()


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) * 1024


def test_guarded_steps_leave_the_processs_peak_counters_alone():
    hog = torch.ones(400 * MiB, dtype=torch.uint8)       # the process's peak, before the run
    hog += 1
    del hog
    hwm, maxrss = _hwm(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model, opt = _model_and_opt()
    if arena.installed():
        pytest.skip("the arena serves tensors here: its own peak is the step's")
    with memguard.Guard(budget=None, micro_batch=8, allocator=False) as g:
        for _ in range(3):
            res = _step(g, model, opt)
        assert g.peak_source == "rss"
        # below the mark set before: a lower bound, not taught to the planner
        assert not g.boundary.peak.exact and 0 < res.peak_bytes < hwm
    assert _hwm() >= hwm
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >= maxrss


def test_a_guard_reports_only_the_overruns_of_its_own_install():
    with memguard.Guard(budget=None, tensor_budget="64MiB") as g:
        if g.allocator_error is not None:
            pytest.skip(g.allocator_error)
        with pytest.warns(BudgetOverrunWarning):  # noqa: PT031
            big = torch.ones(96 * MiB, dtype=torch.uint8)
            g.boundary.overruns.check()      # unless the sampler's thread was first
        del big
    assert g.boundary.overruns.check() == 0                  # uninstalled: not watching
    idle = memguard.Guard(budget=None, allocator=False)      # never installed
    assert idle.boundary.overruns.check() == 0
    with memguard.Guard(budget=None, tensor_budget="64MiB") as later:
        assert later.boundary.overruns.check() == 0          # the earlier one is not its


class _RaisingTelemetry:
    """A user's telemetry object whose ``event`` fails (a broken logger)."""

    def __init__(self) -> None:
        self.samples = 0

    def __call__(self, sample) -> None:
        self.samples += 1

    def event(self, name, **data) -> None:
        raise ConnectionError("the logging service is down")


def test_a_users_telemetry_whose_event_raises_never_fails_a_step():
    from memguard.telemetry import ExportStoppedWarning

    model, opt = _model_and_opt()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(ExportStoppedWarning, match="logging service is down") as seen:  # noqa: PT031, SIM117
        with memguard.Guard(budget=None, micro_batch=8, allocator=False,
                            telemetry=_RaisingTelemetry()) as g:
            for _ in range(3):
                _step(g, model, opt)
    assert g.steps == 3
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert len([w for w in seen if w.category is ExportStoppedWarning]) == 1
