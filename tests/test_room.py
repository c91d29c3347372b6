"""The live budget and what follows it (memguard.memory.room), and a guard's budget
from install to uninstall, with real torch, memguard's real arena and the
live /proc: the cache that decays in step boundaries and stays within the
working set, cache released at once when the budget falls, a failed install
that leaves nothing behind, the budget that was there before restored,
guards that do not nest, MEMGUARD_BUDGET, and a tensor budget given
directly."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch")

import memguard
from memguard import Guard
from memguard.memory import arena as allocator
from memguard.memory import room
from memguard.memory.room import Room

MiB = 2**20


def _one_step(g: Guard) -> None:
    """One step of a tiny model through g."""
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g.step((torch.randn(4, 8), torch.randn(4, 2)),
           lambda b: torch.nn.functional.mse_loss(model(b[0]), b[1]), opt)


def _churn(*sizes_mib: int) -> None:
    """Tensors of these sizes, touched, then freed: the arena caches them."""
    ts = [torch.ones(s * MiB, dtype=torch.uint8) for s in sizes_mib]
    del ts


def test_live_budget_of_a_sample_matches_the_samplers_own() -> None:
    s = memguard.Sampler(budget="auto")
    assert s.live and s.budget_bytes is None
    got = s.sample_now()
    assert room.live_budget(got) == (got.budget_bytes, got.budget_source)
    assert got.budget_source in ("host", "cgroup")
    # a budget given caps it, and says so
    capped = room.live_budget(got, 64 * MiB)
    assert capped == (64 * MiB, "user")
    # the host's figure: what the process and its children hold, plus what
    # is available, less the HIGH headroom (8 % of memory)
    if got.budget_source == "host":
        held = got.rss_bytes + (got.children_bytes or 0)
        reserve = int(0.08 * got.mem_total_bytes)
        assert got.budget_bytes == held + got.mem_available_bytes - reserve


def test_cached_sizes_a_step_no_longer_uses_decay_in_three_boundaries(arena) -> None:
    r = Room(budget=None, decay_steps=3)
    sample = memguard.sample()
    _churn(40, 24)                        # a step at a larger size, once
    cached = allocator.stats()["cached_bytes"]
    assert cached >= 64 * MiB
    decayed = allocator.stats()["decayed_bytes"]
    for _ in range(2):
        _churn(24)                        # the steps that follow reuse 24 MiB only
        r.boundary(sample, manage_arena=True)
        assert allocator.stats()["cached_bytes"] == cached
    _churn(24)
    r.boundary(sample, manage_arena=True)
    st = allocator.stats()
    assert st["decayed_bytes"] - decayed >= 40 * MiB      # the 40 MiB block went back
    assert 24 * MiB <= st["cached_bytes"] <= cached - 40 * MiB   # the reused one stays


def test_reserved_stays_within_the_recent_working_set(arena) -> None:
    r = Room(budget=None)
    sample = memguard.sample()
    _churn(64, 64, 64)                    # 192 MiB cached after a big step
    assert r.cache_keep() is None         # no step's peak known yet: nothing bounded
    r.record_peak(16 * MiB)               # the steps since peak at 16 MiB
    keep = r.cache_keep()
    r.boundary(sample, manage_arena=True)
    st = allocator.stats()
    assert st["reserved_bytes.current"] <= 1.25 * 16 * MiB + 64 * MiB
    assert st["cached_bytes"] <= keep
    assert r.last.reserved_bytes == st["reserved_bytes.current"]


def test_a_lower_budget_releases_the_cache_at_once(arena) -> None:
    r = Room(budget=None, tensor_budget=None)
    sample = memguard.sample()
    r.follow(sample, manage_arena=True)
    assert allocator.stats()["budget_bytes"] == r.last.arena_budget_bytes > 0
    _churn(64, 64)
    assert allocator.stats()["cached_bytes"] >= 128 * MiB
    # the room falls to what the process holds outside the arena plus 32 MiB
    outside = r.last.outside_bytes
    low = Room(budget=outside + 32 * MiB)
    state = low.follow(memguard.sample(), manage_arena=True)
    st = allocator.stats()
    assert state.source == "user" and st["budget_bytes"] == state.arena_budget_bytes
    assert st["reserved_bytes.current"] <= state.arena_budget_bytes
    # without the arena to manage, nothing is touched
    allocator.set_budget(None)
    Room(budget=outside + 32 * MiB).follow(memguard.sample(), manage_arena=False)
    assert allocator.stats()["budget_bytes"] == 0


def test_a_guard_with_no_budget_leaves_the_arena_budget_alone(arena) -> None:
    allocator.set_budget(900 * MiB)
    g = Guard(budget=None, gc_interval_s=0)
    with g:
        _one_step(g)
        assert allocator.stats()["budget_bytes"] == 900 * MiB
    assert allocator.stats()["budget_bytes"] == 900 * MiB


# -- the budget's lifecycle -----------------------------------------------------
def _installed_state() -> dict:
    return {"guard": memguard.train.guard._active, "arena_budget": allocator.stats()["budget_bytes"],
            "gc_callbacks": len(gc.callbacks),
            "threads": sorted(t.name for t in threading.enumerate())}


def test_a_failed_install_leaves_nothing_installed() -> None:
    before = _installed_state()
    was = allocator.installed()
    g = Guard(budget="1MiB", telemetry=None)
    with pytest.raises(ValueError, match="1.0 MiB is below what this process already holds"):
        g.install()
    assert _installed_state() == before
    assert allocator.installed() == was and not g.installed and g.sampler is None


def test_a_failure_after_the_allocator_undoes_the_allocator(monkeypatch, tmp_path) -> None:
    before = _installed_state()
    was = allocator.installed()
    g = Guard(budget="auto", telemetry=str(tmp_path / "run.jsonl"))

    def broken(*a, **kw):
        raise OSError("the exporter's disk is gone")

    monkeypatch.setattr(memguard.train.signals, "open_exporter", broken)
    with pytest.raises(OSError, match="disk is gone"):
        g.install()
    assert _installed_state() == before and allocator.installed() == was
    # and it can be installed once the cause is gone
    monkeypatch.undo()
    with g:
        assert memguard.train.guard._active is g
    assert _installed_state() == before


def test_guards_do_not_nest() -> None:
    a, b = Guard(budget="auto"), Guard(budget="auto")
    with a:
        with pytest.raises(RuntimeError, match="another memguard.Guard is installed"):
            b.install()
        assert not b.installed
        a.install()                       # the installed one: idempotent
    with b:                               # once the first is gone, the second may
        assert memguard.train.guard._active is b
    assert memguard.train.guard._active is None


def test_uninstall_restores_the_budget_installed_before(arena) -> None:
    """memguard.install(budget=X), then a guard: X stays the cap for the
    tensors while the guard runs, and is the arena's budget again after."""
    allocator.set_budget(300 * MiB)
    g = Guard(budget="auto")
    with g:
        assert g.room.tensor_budget == 300 * MiB
        for _ in range(2):
            _one_step(g)
            assert 0 < allocator.stats()["budget_bytes"] <= 300 * MiB
    assert allocator.stats()["budget_bytes"] == 300 * MiB


def test_a_tensor_budget_caps_the_arena(arena) -> None:
    g = Guard(budget="auto", tensor_budget="96MiB")
    with g:
        _one_step(g)
        assert allocator.stats()["budget_bytes"] == 96 * MiB
        assert g.budget_bytes > 96 * MiB          # the process's, live
    assert allocator.stats()["budget_bytes"] == 0
    with pytest.raises(ValueError, match="tensor_budget 'auto' must be a size or bytes"):
        Guard(tensor_budget="auto")
    with pytest.raises(ValueError, match="budget 'lots' is not valid"):
        Guard(tensor_budget="lots")


def test_memguard_budget_is_the_guards_default_budget() -> None:
    code = ("import memguard, torch; g = memguard.Guard(); "
            "print(g.budget, g.room.budget, g.budget_bytes)")
    env = dict(os.environ, MEMGUARD_BUDGET="1GiB")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    budget, user, now = out.stdout.split()
    assert (budget, int(user), int(now)) == ("1GiB", 2**30, 2**30)
    env.pop("MEMGUARD_BUDGET")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split()[:2] == ["auto", "None"]
