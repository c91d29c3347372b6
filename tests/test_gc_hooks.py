"""GcHooks: timing Python collections, relief runs (rate limit, the gc
setting, the system trim, the arena cache), and the guard's reaction to
pressure: a shrink at the next step and one relief on the rise to HIGH."""
from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

import memguard
from memguard import _C
from memguard.memory.gc_hooks import GcHooks
from memguard.telemetry import Level, Sampler, read_jsonl

from .conftest import FIXTURES, wait_for

MiB = 2**20


class CollectCounter:
    """Counts collections through gc.callbacks, independently of GcHooks."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.n += 1

    def __enter__(self) -> CollectCounter:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def test_collections_are_timed_while_installed():
    hooks = GcHooks()
    assert hooks.install() is hooks
    hooks.install()  # idempotent: one callback, not two
    try:
        assert gc.callbacks.count(hooks._callback) == 1
        before = list(hooks.stats.collections)
        gc.collect()
        gc.collect(2)
        s = hooks.stats
        assert s.collections[2] == before[2] + 2
        assert s.gc_seconds > 0 and 0 < s.max_pause_s <= s.gc_seconds
        gc.collect(0)
        assert s.collections[0] >= before[0] + 1
        d = s.to_dict()
        assert d["collections"] == s.collections and d["collections"] is not s.collections
    finally:
        hooks.uninstall()
    hooks.uninstall()  # idempotent
    assert hooks._callback not in gc.callbacks
    frozen = (list(hooks.stats.collections), hooks.stats.gc_seconds)
    gc.collect()
    assert (hooks.stats.collections, hooks.stats.gc_seconds) == frozen


def test_relieve_is_rate_limited_unless_forced():
    events = []
    hooks = GcHooks(min_interval_s=60, on_event=lambda name, d: events.append((name, d)))
    first = hooks.relieve("high")
    assert first is not None and first["reason"] == "high"
    assert hooks.relieve("high") is None  # within min_interval_s
    assert hooks.relieve("pressure") is None
    forced = hooks.relieve("oom", force=True)
    assert forced is not None and forced["reason"] == "oom"
    assert hooks.stats.reliefs == 2
    assert [(n, d["reason"]) for n, d in events] == [("relieve", "high"), ("relieve", "oom")]
    assert hooks.stats.relief_seconds >= first["seconds"] + forced["seconds"] > 0
    # no limit: every call runs
    free = GcHooks(min_interval_s=0, max_share=1)
    assert free.relieve() is not None and free.relieve() is not None
    with pytest.raises(ValueError, match="min_interval_s"):
        GcHooks(min_interval_s=-1)
    with pytest.raises(ValueError, match="max_share must be in .0, 1., not 0"):
        GcHooks(max_share=0)


def test_relieve_is_rate_limited_by_its_own_cost():
    """At most max_share of the wall time: after a relief that took d
    seconds, the next waits until d / max_share seconds after it began.
    The rate limit reads a clock the test sets: no time passes but the
    test's, however slowly the machine runs."""
    now = [1000.0]
    hooks = GcHooks(max_share=0.5)
    hooks._clock = lambda: now[0]
    first = hooks.relieve("high")
    assert first is not None and first["seconds"] > 0
    assert not hooks.due() and hooks.relieve("high") is None
    forced = hooks.relieve("high", force=True)   # forced: at once
    assert forced is not None and forced["seconds"] > 0
    # it began at 1000 and took d: the next may begin 2 d after it
    now[0] = 1000.0 + 1.99 * forced["seconds"]
    assert not hooks.due() and hooks.relieve("high") is None
    now[0] = 1000.0 + 2.01 * forced["seconds"]
    assert hooks.due()
    now[0] = 2000.0
    assert hooks.relieve("high") is not None
    hooks._last_cost = 0.25                  # as if that one had taken 250 ms
    now[0] = 2000.499                        # 0.25 / 0.5 = 0.5 s after it began
    assert not hooks.due() and hooks.relieve("high") is None
    now[0] = 2000.5
    assert hooks.due() and hooks.relieve("high") is not None


def test_relieve_respects_a_script_that_turned_gc_off():
    hooks = GcHooks(max_share=1)
    with CollectCounter() as count:
        done = hooks.relieve()
        assert "gc_collected" in done and count.n == 1  # gc on: relief collects
        was = gc.isenabled()
        gc.disable()
        try:
            n = count.n
            done = hooks.relieve()
            assert "gc_collected" not in done and count.n == n
            done = hooks.relieve(collect=True)
            assert "gc_collected" in done and count.n == n + 1
            done = hooks.relieve(collect=False)
            assert "gc_collected" not in done and count.n == n + 1
        finally:
            if was:
                gc.enable()
    assert gc.isenabled() == was


def test_system_trim_is_glibc_in_a_plain_process():
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run(
        [sys.executable, "-c", "from memguard import _C; print(_C.system_trim())"],
        capture_output=True, text=True, timeout=60, check=True, env=env)
    assert out.stdout.strip() == "glibc"
    assert GcHooks(max_share=1).relieve()["system_trim"] == _C.system_trim()


def test_relieve_releases_the_arena_cache():
    torch = pytest.importorskip("torch")
    memguard.memory.arena.set_budget(None)
    try:
        memguard.install()
    except RuntimeError as e:  # no ELF import slots, or torch allocates elsewhere
        pytest.skip(f"memguard's allocator cannot be installed here: {e}")
    try:
        t = torch.empty(48 * MiB, dtype=torch.uint8)
        t.fill_(1)
        del t
        cached = memguard.stats()["cached_bytes"]
        assert cached >= 48 * MiB
        hooks = GcHooks(max_share=1)
        trims = memguard.stats()["num_trims"]
        # what the caller says the next steps reuse stays cached
        done = hooks.relieve("high", arena_keep=cached)
        assert done["arena_released_bytes"] == 0 and memguard.stats()["cached_bytes"] == cached
        done = hooks.relieve("high")
        s = memguard.stats()
        assert s["cached_bytes"] <= cached - 48 * MiB
        assert done["arena_released_bytes"] >= 48 * MiB
        assert hooks.stats.released_bytes == done["arena_released_bytes"]
        assert s["num_trims"] > trims
    finally:
        memguard.memory.arena.set_budget(None)
        memguard.uninstall()


# -- the guard under pressure ------------------------------------------------------
def test_guard_shrinks_within_a_step_of_high_and_relieves_once(tmp_path):
    torch = pytest.importorskip("torch")
    root = FIXTURES / "proc" / "v2"
    probe = Sampler(proc_root=root / "proc", cgroup_root=root / "cgroup")
    rss = probe.sample_now().rss_bytes  # the fixture's RSS
    calm_budget, high_budget = rss * 100, int(rss / 0.95)  # 95 % of the budget used: HIGH
    sampler = Sampler(interval_ms=10, budget=calm_budget, proc_root=root / "proc",
                      cgroup_root=root / "cgroup", pressure={"calm_samples": 2})
    path = tmp_path / "guard.jsonl"
    guard = memguard.Guard(budget=None, micro_batch="auto", allocator=False, sampler=sampler,
                           telemetry=path, gc_interval_s=60)
    now = [0.0]
    guard.gc._clock = lambda: now[0]         # the rate limit reads the test's time
    guard.gc.max_share = 1.0                 # so only gc_interval_s limits reliefs
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 8)

    def loss_fn(mb):
        return model(mb).square().mean()

    highs = []
    try:
        guard.install()
        assert sampler.running
        n = guard.gc.stats.collections[2]
        gc.collect()
        assert guard.gc.stats.collections[2] == n + 1  # the guard's gc hooks are in
        sampler.on_pressure(lambda ev: highs.append(ev) if ev.new >= Level.HIGH else None)
        assert wait_for(lambda: sampler.latest() is not None)
        assert sampler.latest().level < Level.HIGH  # the fixture's headroom: ELEVATED
        res = guard.step(x, loss_fn, opt)  # the whole batch
        assert res.micro_batch == 32 and guard.plan()["reason"] == "start"
        sampler.set_budget(high_budget)
        # the guard's callbacks run before this one, on the same thread: once
        # it has the rise, so has the guard, however late that thread runs
        assert wait_for(lambda: len(highs) == 1)
        assert highs[0].new == Level.HIGH and "budget" in highs[0].sample.reasons
        res = guard.step(x, loss_fn, opt)
        plan = guard.plan()
        assert res.micro_batch == 16 and res.n_micro == 2 and res.retries == 0
        assert plan["action"] == "shrink" and plan["reason"] == "high"
        # down and up again 59 s later, within gc_interval_s: the second relief
        # is rate-limited
        now[0] = 59.0
        sampler.set_budget(calm_budget)
        assert wait_for(lambda: sampler.latest().level < Level.HIGH)  # ELEVATED: headroom
        sampler.set_budget(high_budget)
        assert wait_for(lambda: len(highs) == 2)
        assert guard.gc.stats.reliefs == 1
    finally:
        guard.uninstall()
        sampler.stop()
    assert not sampler.running and guard.sampler is sampler
    _, _, events = read_jsonl(path)
    reliefs = [e for e in events if e["event"] == "relieve"]
    assert [e["reason"] for e in reliefs] == ["high"]
    steps = [e for e in events if e["event"] == "step"]
    assert [(e["micro_batch"], e["reason"]) for e in steps] == [(32, "start"), (16, "high")]
