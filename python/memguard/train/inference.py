""":meth:`memguard.Guard.infer` and its micro-batch plan, apart from the
training step's.

An inference holds no graph and no gradients, so the size that fits it is
not the training step's: it has a planner of its own (memguard's C planner,
with the guard's constraints) and a peak meter of its own, and an
out-of-memory error in it never changes the training plan, its ceilings or
its model. Each call starts from the size the last one settled on (the
whole batch at first), and at every micro-batch boundary the plan looks at
the pressure and the room as a step boundary does
(:mod:`memguard.train.boundary`), from the newest sample the sampler
delivered (nothing is taken or pushed between micro-batches): a room that
fell below the planned size's predicted peak, or HIGH pressure, shrinks
before anything runs out of memory. An out-of-memory error shrinks too, and
the call goes on from the micro-batch that failed. Where memguard's own
tensor budget refuses the smallest size (the machine did not), the call goes
on past the budget, as code outside a guarded step does
(:mod:`memguard.train.overruns`): an inference the plain loop would finish
is never ended by memguard.

Under FSDP2 across ranks every rank must run the same forwards (each
all-gathers): the ranks agree on one size, and redo a micro-batch together
(:func:`_infer_agreed`).
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

import torch

from memguard import _C
from memguard.memory import arena
from memguard.memory.oom import is_oom
from memguard.memory.room import WORKING_SET_FACTOR, WORKING_SET_SLACK
from memguard.telemetry.events import Event
from memguard.telemetry.samples import Level
from memguard.train import batch as _batch
from memguard.train import collectives
from memguard.train import outputs as _outputs
from memguard.train.collectives import Attempt
from memguard.train.distributed import PeerOOM, Peers, fsdp2_roots
from memguard.train.peaks import PeakMeter
from memguard.train.plan import predicted_tight
from memguard.train.step import gave_up

if TYPE_CHECKING:
    from memguard.train.guard import Guard

log = logging.getLogger("memguard")


class InferencePlan:
    """The micro-batch plan of a guard's inferences.

    Args:
        opts: the training planner's options (:attr:`memguard.train.plan.Plan.opts`):
            the same constraints, margin, ``grow_after`` and ``retry_after``,
            and the same fixed size where one was given.
    """

    def __init__(self, opts: dict[str, Any]) -> None:
        self.planner = _C.Planner(**opts)
        #: the peaks the planner learns
        self.peak = PeakMeter()
        #: decisions that changed the size, out-of-memory errors included
        self.changes = 0
        self._size = 0                 # the size the last boundary planned (0: none, or an OOM)
        self._floor: int | None = None   # where the metered micro-batch's peak starts
        self._seen_t = -math.inf       # the time of the newest sample acted on
        self._held = int(Level.OK)     # the level while no newer sample comes
        #: the largest arena peak an inference was metered at (0: none yet)
        self.arena_peak = 0

    @property
    def micro(self) -> int:
        """The size the last inference settled on (0 before the first)."""
        return int(self.planner.state()["micro"])

    def state(self) -> dict[str, Any]:
        """The planner's state and its last decision with the reason."""
        return self.planner.state()

    def begin(self, guard: Guard, batch: Any, n: int, first: bool) -> tuple[int, bool]:
        """A micro-batch boundary of an inference over ``batch`` of ``n``
        samples (``first``: the call's first): its size, and whether the
        plan changed size here. The peak is metered for a call's first
        micro-batch and the first at each new size (what the model learns
        most from; metering each would cost more than the rest of the
        boundary)."""
        if first:
            self._meter(batch)         # first: the budget is that of the peaks' source
        sample = guard.signals.latest_sample() if first else guard.signals.delivered()
        level = self._level(guard, sample, first)
        self.planner.set_budget(guard.boundary.budget_of(self.peak.source, guard.budget_bytes))
        if first:
            self.planner.set_align(8 if self.peak.source == "cuda" else 1)
        micro = int(self.planner.begin(n, level))
        if first:        # an evaluation alone says what the workers cost it too
            guard.boundary.workers.check(sample, guard.budget_bytes, n, micro, self.planner,
                                         guard.steps, "an inference")
        if micro == self._size:
            return micro, False
        if not first:
            self._meter(batch)
        self._size = micro
        return micro, self.planner.state()["action"] != "hold"

    def end(self, size: int) -> None:
        """A micro-batch of ``size`` samples ran: where it was metered, the
        planner learns its peak (not a lower bound: see
        :attr:`PeakMeter.exact`)."""
        if self._floor is None:
            return
        peak = self.peak.stop()
        self.planner.end(size, peak if self.peak.exact else 0, self._floor)
        if self.peak.source == "arena" and self.peak.exact:
            self.arena_peak = max(self.arena_peak, peak)
        self._floor = None

    @contextlib.contextmanager
    def cache_bound(self, guard: Guard) -> Iterator[None]:
        """Hold the arena's cache, while an inference runs, to the working
        set's bound (a quarter of the largest metered peak, 64 MiB before
        one, plus 64 MiB: the step boundary's rule): a forward frees blocks
        of many sizes that one class cannot reuse for another, and cached
        they would double what the process holds (measured, a ViT-S/16 at
        batch 128: 1.3 GB reserved for a 600 MB peak, 0.72 GB with the
        bound, at 0.9x the uncapped speed and still 1.7x glibc's), which a
        lowered limit then swaps. Blocks freed past the bound go back to the
        kernel as they are freed."""
        if not guard.boundary.manages_arena():
            yield
            return
        before = int(arena.stats()["cache_limit_bytes"])
        bound = int((WORKING_SET_FACTOR - 1) * self.arena_peak) + WORKING_SET_SLACK
        arena.set_cache_limit(min(before or bound, bound))
        try:
            yield
        finally:
            arena.set_cache_limit(before or None)

    def oom(self, guard: Guard, micro: int) -> int:
        """Out of memory at ``micro``: the size to go on at (0: none is
        smaller), with the room as it is now."""
        self._follow(guard, guard.signals.latest_sample())
        self.planner.set_budget(guard.boundary.budget_of(self.peak.source, guard.budget_bytes))
        self._size, self._floor = 0, None   # the next micro-batch is metered
        return int(self.planner.oom(micro) or 0)

    def tight(self, n: int, micro: int) -> bool:
        """Whether memory is tight for an inference of ``n`` samples at
        ``micro`` (the rule of :meth:`memguard.train.plan.Plan.tight`)."""
        st = self.planner.state()
        return bool(st["ooms"]) or predicted_tight(self.planner, n, micro,
                                                   int(st["budget_bytes"]))

    def _meter(self, batch: Any) -> None:
        """Meter the next micro-batch's peak, from what its source holds now."""
        self._floor = self.peak.start(batch)

    def _level(self, guard: Guard, s: Any, first: bool) -> int:
        """The pressure level the boundary acts on, and the room followed,
        from ``s``: at a call's first boundary the newest sample there is
        (the room followed, as a step boundary does); at the others only
        what the sampler's callbacks delivered since, which costs nothing to
        read. A
        sample's level counts once: while none newer comes, the size holds
        at ELEVATED and above, as the step boundary after a shrink for HIGH
        does."""
        t = getattr(s, "t", None)
        fresh = t is not None and t > self._seen_t
        if fresh or first:
            self._follow(guard, s)
        if not fresh:
            return self._held
        self._seen_t = t
        raw, level = int(s.raw_level), int(s.level)
        self._held = int(Level.ELEVATED) if max(raw, level) >= Level.ELEVATED else int(Level.OK)
        return raw if raw >= Level.HIGH else self._held

    @staticmethod
    def _follow(guard: Guard, sample: Any) -> None:
        """The room in ``sample``, and memguard's arena budget following it
        where the guard manages the arena (the step's rule)."""
        guard.room.follow(sample, guard.boundary.manages_arena())


def infer(guard: Guard, batch: Any, fn: Callable[[Any], Any], combine: Any = None) -> Any:
    """:meth:`memguard.Guard.infer`: ``fn`` over ``batch`` under ``no_grad``
    in micro-batches of the inference plan's size, going on after an
    out-of-memory error from the micro-batch that failed, at a smaller size;
    the outputs joined by :func:`memguard.train.outputs.join`."""
    n = _batch.checked_size(batch)
    _outputs.check_combine(combine)
    peers = _sharded_peers(guard)
    if peers is not None:
        return _infer_agreed(guard, peers, batch, fn, combine, n)
    plan, sizes = guard.inference, guard.config.sizes
    start, micro, parts, outs, counts, tried = 0, 0, [], [], [], []
    refused, past = _refusals(), False      # past: served past memguard's budget
    with torch.no_grad(), contextlib.closing(arena.strict), plan.cache_bound(guard):
        while start < n:
            planned, changed = plan.begin(guard, batch, n, first=not (start or tried))
            if changed:
                _changed(guard, n, start)
            if planned != micro:
                micro, parts = planned, sizes.of(n - start, planned)
            stop = start + parts[0]
            try:
                with contextlib.nullcontext() if past else arena.strict():
                    out = fn(_batch.slice_(batch, start, stop))
                plan.end(stop - start)
                outs.append(_batch.detach(out))
                counts.append(stop - start)
                start = stop
                parts.pop(0)
                continue
            except Exception as exc:
                if not is_oom(exc):
                    raise
                tried.append(micro)
                nxt = plan.oom(guard, micro)
                if not nxt and not past and _refusals() > refused:
                    nxt, past = micro, True  # memguard's budget, not the machine: serve it
                elif not nxt:
                    raise gave_up(tried, guard.config.min_micro_batch, exc,
                                  inference=True) from exc
            guard.gc.relieve_oom()     # out of the except block: its frames are gone
            guard.ooms_recovered += 1
            _changed(guard, n, start, failed=micro)
            log.warning("memguard: an inference ran out of memory at micro-batch %d; going on "
                        "at %d from sample %d of %d%s", micro, nxt, start, n,
                        " past memguard's budget, which refused the smallest size (the "
                        "machine did not)" if nxt == micro else "")
            micro, parts = nxt, sizes.of(n - start, nxt)
    return _outputs.join(outs, counts, combine)


def _sharded_peers(guard: Guard) -> Peers | None:
    """The guard's ranks where its model is sharded by FSDP2 across them:
    each forward all-gathers, so every rank must run as many as the others."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            and fsdp2_roots(guard.model)):
        return None
    return guard._peers_for_step()


def _infer_agreed(guard: Guard, peers: Peers, batch: Any, fn: Callable[[Any], Any],
                  combine: Any, n: int) -> Any:
    """:func:`infer` where the ranks must run the same forwards (FSDP2): one
    size for all (the smallest any rank plans), a vote after each
    micro-batch, and, where any rank finds memory tight, a vote before each
    collective; after an out-of-memory error on any rank every rank redoes
    that micro-batch at the agreed smaller size. Ranks whose batches differ
    in size run them whole, as the plain loop does."""
    plan, sizes = guard.inference, guard.config.sizes
    planned, _ = plan.begin(guard, batch, n, first=True)
    micro, least, most, calm = peers.agree([planned, n, -n, 0 if plan.tight(n, planned) else 1])
    if least != -most:
        with torch.no_grad():
            return fn(batch)
    armed = not calm
    start, outs, counts, tried = 0, [], [], []
    refused, past = _refusals(), False      # past: served past memguard's budget

    def before(_: str) -> None:
        vote = peers.vote(peers.OK, micro)
        if vote.outcome != "ok":
            raise PeerOOM(vote.next, micro)

    with torch.no_grad(), contextlib.closing(arena.strict), plan.cache_bound(guard):
        while start < n:
            stop = start + sizes.of(n - start, micro)[0]
            attempt = Attempt(before if armed else None)
            try:
                with collectives.attempt_of(attempt), \
                        contextlib.nullcontext() if past else arena.strict():
                    out = fn(_batch.slice_(batch, start, stop))
                nxt = plan.begin(guard, batch, n, first=False)[0] if stop < n else micro
                vote = peers.vote(peers.OK, nxt)
                if vote.outcome != "ok":             # another rank failed this micro-batch
                    raise PeerOOM(vote.next, micro)
            except PeerOOM as exc:
                nxt, peer = exc.next, True
                if nxt:
                    plan.planner.agree(nxt, failed=micro)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                nxt = plan.oom(guard, micro)
                if not nxt and not past and _refusals() > refused:
                    nxt, past = micro, True  # memguard's budget, not the machine: serve it
                stranded = None if armed else peers.stranded(attempt)
                if stranded is not None:
                    peers.abort()
                    raise stranded from exc
                own, nxt, peer = nxt, peers.vote(peers.OOM, nxt).next, False
                if not nxt:
                    raise gave_up(tried + [micro], guard.config.min_micro_batch, exc,
                                  inference=True) from exc
                if nxt != own:
                    plan.planner.agree(nxt)
            else:
                plan.end(stop - start)
                outs.append(_batch.detach(out))
                counts.append(stop - start)
                if vote.next != nxt:
                    plan.planner.agree(vote.next)
                start, micro = stop, vote.next
                continue
            tried.append(micro)
            if not nxt:
                raise gave_up(tried, guard.config.min_micro_batch, None, inference=True)
            guard.gc.relieve_oom()
            guard.ooms_recovered += 1
            _changed(guard, n, start, failed=micro)
            log.warning("memguard: an inference ran out of memory at micro-batch %d%s; every "
                        "rank goes on at %d from sample %d of %d", micro,
                        " (on another rank)" if peer else "", nxt, start, n)
            micro = nxt
    return _outputs.join(outs, counts, combine)


def _refusals() -> int:
    """How many allocations memguard's arena budget has refused so far."""
    return int(arena.stats()["num_ooms"]) if arena.installed() else 0


def _changed(guard: Guard, n: int, start: int, failed: int = 0) -> None:
    """The inference plan changed size before sample ``start`` of ``n``
    (``failed``: out of memory at that size): counted, and written as an
    ``infer_plan`` event, which ``memguard report`` tells from the
    training step's decisions (an inference writes no ``step`` event)."""
    plan = guard.inference
    plan.changes += 1
    state = plan.state()
    guard.signals.event(Event.INFER_PLAN, micro_batch=state["to"], from_micro_batch=state["from"],
                        action=state["action"], reason=state["reason"],
                        failed_micro_batch=failed or None, batch=n, sample=start,
                        planner_budget_bytes=state["budget_bytes"])
