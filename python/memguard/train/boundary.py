"""A step boundary: where a guard looks at memory and decides the next
step's micro-batch size.

In order: the pressure level of the last step (:class:`~memguard.train.signals.Signals`),
the room now (:class:`~memguard.memory.room.Room`: the live budget, and the
arena's budget and cache following it), a relief while pressure is HIGH, the
peak meter restarted, the planner's budget synchronised with what the peaks
measure, then the plan (:class:`~memguard.train.plan.Plan`), and advice on
the DataLoader workers, once (:class:`~memguard.train.workers.WorkersAdvice`).
After a committed step: its peak learnt, the drift forecast
(:class:`~memguard.train.drift.Drift`) and the headroom
(:class:`~memguard.train.headroom.Headroom`) told.
"""
from __future__ import annotations

import time
from typing import Any

from memguard.memory import arena
from memguard.memory.gc_hooks import GcHooks
from memguard.memory.room import Room
from memguard.telemetry.events import Event
from memguard.telemetry.samples import Level
from memguard.train.config import GuardConfig
from memguard.train.drift import Drift
from memguard.train.headroom import Headroom
from memguard.train.overruns import Overruns
from memguard.train.peaks import PeakMeter
from memguard.train.plan import Plan
from memguard.train.signals import Signals
from memguard.train.workers import WorkersAdvice


class Boundary:
    """The guard's parts that act between steps, and the order they act in."""

    def __init__(self, room: Room, signals: Signals, plan: Plan, gc: GcHooks,
                 config: GuardConfig) -> None:
        self.room, self.signals, self.planner, self.gc = room, signals, plan, gc
        #: allocations past the tensor budget outside steps, reported (at
        #: each sample, each boundary, the end of an evaluation)
        self.overruns = Overruns(signals.event, lambda: gc.relieve("overrun"))
        signals.after_sample = self.overruns.check
        self.peak = PeakMeter()
        self.floor = 0          # what the peak's source held as the step began
        self._t0 = 0.0          # when the step began (0: not timed: redone, or not calm)
        #: the last committed step's time the planner learnt (0: not timed)
        self.seconds = 0.0
        #: whether the guard is installed (it manages the arena only then)
        self.active = False
        #: advice on the DataLoader workers, from the boundary's sample
        self.workers = WorkersAdvice(signals.event)
        self._sample: Any = None   # the sample the room followed at this boundary
        #: the forecast of slow growth, and the memory the whole batch leaves unused
        self.drift = Drift(config.forecast_horizon, config.steps_per_epoch, signals.event)
        self.headroom = Headroom(config.headroom, plan.opts, signals.event)

    def begin(self, batch: Any, n: int, peers: Any, step: int, budget: int) -> tuple[int, dict]:
        """The boundary before step number ``step`` of ``n`` samples:
        returns its size and what its event records of the plan."""
        self.overruns.check()
        level = self.signals.boundary_level()   # first: it pushes the last step's CUDA peaks
        self._follow_room(level, step)
        # the push's reading, unless a relief (HIGH) freed memory since
        pushed = self.signals.cuda_pushed if level < Level.HIGH else None
        self.floor = self.peak.start(batch, pushed)
        self.sync_budget(budget)
        begun = self.planner.begin(n, level, peers, step)
        self.workers.check(self._sample, budget, n, begun[0], self.planner.planner, step)
        # only a calm step is the plan's own time (pressure, swap and
        # reliefs are not)
        self._t0 = time.perf_counter() if level == Level.OK else 0.0
        return begun

    def restart(self, batch: Any) -> None:
        """Before a step is redone after an out-of-memory error: memory
        relieved, the peak meter restarted (the planner learns the retry's
        peak), the failed attempt's pressure forgotten (the OOM already
        shrank for it)."""
        self.gc.relieve_oom()
        self.floor = self.peak.start(batch)
        self.signals.forget_attempt()
        self._t0 = 0.0          # a redone step's time is not its size's

    def end(self, micro: int, n: int, step: int) -> int:
        """Committed step number ``step`` of ``n`` samples at ``micro``: its
        peak, learnt by the planner (and by the room's cache bound, when the
        arena measured it), its duration where it was calm and done at once;
        then the drift and the headroom see it."""
        peak = self.peak.stop()
        seconds = time.perf_counter() - self._t0 if self._t0 else 0.0
        self.seconds = seconds
        exact = peak if self.peak.exact else 0
        # a lower bound (a mark nobody resets, not raised) teaches nothing
        self.planner.end(micro, exact, self.floor, n, seconds)
        if self.peak.source == "arena":
            self.room.record_peak(peak)
        budget = self.planner.budget
        # what a step at the smallest size needs above its floor, scaled
        need = max(0, exact - self.floor) * self.planner.opts["min_micro"] // max(micro, 1)
        if self.drift.horizon is not None:   # the readings cost a read of /proc
            self.drift.observe(step, self._readings(budget), need)
        self.headroom.observe(step, micro, n, exact, budget, self.planner.planner,
                              self.peak.source)
        return peak

    def _readings(self, budget: int) -> list[tuple[str, int, int]]:
        """What the drift follows: the peak source's floor against the
        planner's budget, and (where the floor is not already the process's) the
        process's footprint at this boundary against its live budget."""
        out = [(self.peak.source, self.floor, budget)]
        own, room = self.peak.footprint(), self.room.last
        if own and self.peak.source not in ("rss", "footprint"):
            # read now: the sampler's newest sample can be several steps old
            workers = getattr(self._sample, "children_bytes", None) or 0
            out.append(("footprint", own + workers, room.budget_bytes if room else 0))
        return out

    def said(self) -> dict[str, Any]:
        """The forecast (while its episode lasts) and the headroom, as their
        events had them (``None``: not said)."""
        return {"forecast": self.drift.forecast, "headroom": self.headroom.found}

    def follow_now(self, budget: int) -> None:
        """Within a step (after an out-of-memory error): the room now, the
        arena's budget and the planner's following it."""
        self.room.follow(self.signals.latest_sample(), self.manages_arena())
        self.sync_budget(budget)

    def cache_keep(self) -> int:
        """Arena cache a relief keeps: what the recent steps' working set
        reuses (all of it before a step has run)."""
        keep = self.room.cache_keep()
        return int(arena.stats()["cached_bytes"]) if keep is None else keep

    def sync_budget(self, budget: int) -> None:
        """The planner plans against the budget of what the step's peaks
        measure (:meth:`budget_of`), and, for CUDA batches, prefers
        multiples of 8."""
        self.planner.set_budget(self.budget_of(self.peak.source, budget))
        self.planner.set_align(8 if self.peak.source == "cuda" else 1)

    def budget_of(self, source: str, budget: int) -> int:
        """The budget of what peaks from ``source`` measure: the arena's
        (the room the live budget leaves tensors) when it serves them, less
        what it holds that is neither allocated nor cached (the free part of
        slabs other tensors keep: the budget counts it, the peaks do not);
        the device's for CUDA; the process's ``budget`` for RSS."""
        if source == "arena":
            st = arena.stats()
            stuck = st["reserved_bytes.current"] - st["allocated_bytes.current"] - \
                st["cached_bytes"]
            budget = int(st["budget_bytes"])   # 0: none; else at least 1 (0 is "none")
            return budget and max(1, budget - max(0, int(stuck)))
        if source == "cuda":
            gov = self.signals.governor
            return 0 if gov is None else \
                gov.budget_bytes or (gov.last or {}).get("total_bytes", 0)
        return budget

    def manages_arena(self) -> bool:
        """Whether the room sets the arena's budget: the guard is installed
        and the arena is its to manage."""
        return self.active and self.room.manages_arena and arena.installed()

    def _follow_room(self, level: int, step: int) -> None:
        """The room now, and relief while pressure is HIGH or above (at most
        the share of the time GcHooks allows)."""
        before = self.room.last
        outside = self.signals.take_outside_peak()
        if step:
            self.room.record_step(outside)
        self._sample = self.signals.latest_sample()
        state = self.room.boundary(self._sample, self.manages_arena())
        if before is None or _moved(before.budget_bytes, state.budget_bytes):
            self.signals.event(Event.ROOM, step=step, **state.to_dict())
        if level >= Level.HIGH:
            self.gc.relieve(Level(level).name.lower(), arena_keep=self.cache_keep())
        back = self.room.recover_swap(level)
        if back:
            self.signals.event(Event.SWAP_IN, step=step, swap_bytes=back)


def _moved(old: int, new: int) -> bool:
    """Whether a budget moved by more than 1/32 (telemetry's "room" events)."""
    return abs(new - old) * 32 > max(old, new)
