"""The micro-batch plan of a guard: memguard's C planner (a model of peak
bytes against micro-batch size, learnt online), the budget it plans
against, and what comes after shrinking is not enough: checkpointing more
blocks, then ``on_critical``.
"""
from __future__ import annotations

from typing import Any, Callable

from memguard import _C
from memguard.telemetry.events import Event
from memguard.telemetry.samples import Level
from memguard.train.checkpoint import Checkpoints
from memguard.train.checkpoint import wrap as wrap_checkpoints
from memguard.train.config import GuardConfig

#: a step predicted to peak above this share of its budget is tight
TIGHT_SHARE = 0.8


def predicted_tight(planner: Any, n: int, micro: int, budget: int) -> bool:
    """Whether ``planner`` (a C planner) finds ``micro`` of ``n`` samples
    tight: split, a size its peak model does not know, or a predicted peak
    above :data:`TIGHT_SHARE` of ``budget`` (0: none)."""
    if micro < n:
        return True
    peak = int(planner.predict(micro) or 0)
    return peak == 0 or bool(budget) and peak > TIGHT_SHARE * budget


class Plan:
    """The planner and its escalation.

    Args:
        config: the guard's options.
        event: where events go (``event(name, **data)``).
        on_critical: called once per CRITICAL episode with nothing left to
            shrink or checkpoint.
    """

    def __init__(self, config: GuardConfig, event: Callable[..., Any],
                 on_critical: Callable[[], Any]) -> None:
        self.opts = {
            "micro": config.micro_batch if config.fixed else 0,
            "min_micro": config.min_micro_batch, "multiple_of": config.multiple_of,
            "divisor_of": config.divisor_of or 0, "budget_bytes": config.user_budget_bytes or 0,
            "margin": float(config.margin), "grow_after": config.grow_after,
            "retry_after": config.retry_after, "fixed": config.fixed}
        self.planner = _C.Planner(**self.opts)
        start = self.opts["micro"]
        if config.fixed and self.planner.fit(start) != start:
            raise ValueError(f"micro_batch {start} breaks the constraints min_micro_batch="
                             f"{config.min_micro_batch}, multiple_of={config.multiple_of}, "
                             f"divisor_of={config.divisor_of}")
        #: the budget the planner plans against now
        self.budget = self.opts["budget_bytes"]
        self._align = 1
        ck = config.checkpoint
        self.checkpoints: Checkpoints | None = None if ck is None else \
            ck if isinstance(ck, Checkpoints) else wrap_checkpoints(ck)
        self._event, self._on_critical = event, on_critical
        self._grow_after = config.grow_after
        self._sync = config.sync_collectives
        self._calm = 0                 # calm boundaries since the last checkpoint change
        self._critical_fired = False   # on_critical ran in this CRITICAL episode
        #: decisions that changed the size, OOM redos included
        self.changes = 0

    @property
    def micro(self) -> int:
        """The planned micro-batch size (0 before the first step with "auto")."""
        return int(self.planner.state()["micro"])

    def state(self) -> dict[str, Any]:
        """The planner's state and its last decision with the reason."""
        return self.planner.state()

    def set_budget(self, budget: int) -> None:
        """Plan against ``budget`` bytes from now on."""
        if budget != self.budget:
            self.planner.set_budget(budget)
            self.budget = budget

    def begin(self, n: int, level: int, peers: Any, step: int) -> tuple[int, dict]:
        """A step of ``n`` samples at pressure ``level``: the size (agreed
        with the other ranks), and what the step's event records of it."""
        plan_level = self._checkpoint_hold(level, step)
        budget = self.budget
        micro = int(self.planner.begin(n, plan_level))
        if peers is not None:
            agreed = peers.begin_plan(micro, self.tight(n, micro, plan_level))
            if agreed < micro:
                self.planner.agree(agreed)
                micro = agreed
            peers.begin_step()
        state = self.planner.state()
        self._escalate(level, state, step)
        if state["action"] != "hold":
            self.changes += 1
        return micro, {"plan": state, "level": int(plan_level), "budget": budget}

    def tight(self, n: int, micro: int, level: int) -> bool:
        """Whether memory is tight for a step of ``n`` samples at ``micro``
        (the ranks then vote before each collective inside it: see
        :mod:`memguard.train.collectives`): always with
        ``sync_collectives="always"``; else under pressure, split, soon
        after an out-of-memory error, before the peak model knows the
        size, or where it predicts more than :data:`TIGHT_SHARE` of the
        budget."""
        st = self.planner.state()
        if self._sync == "always" or level >= Level.ELEVATED:
            return True
        if st["ooms"] and st["calm_since_fail"] < self._grow_after:
            return True
        return predicted_tight(self.planner, n, micro, self.budget)

    def oom(self, micro: int) -> int:
        """Out of memory at ``micro``: the next size (0: nothing smaller)."""
        return int(self.planner.oom(micro) or 0)

    def agree(self, micro: int, failed: int | None = None) -> None:
        """Take the size the ranks agreed on (``failed``: another rank's OOM)."""
        if failed is None:
            self.planner.agree(micro)
        else:
            self.planner.agree(micro, failed=failed)

    def end(self, micro: int, peak: int, floor: int, n: int = 0, seconds: float = 0.0) -> None:
        """A committed step: the model learns its peak above the floor, and,
        for a calm step of ``n`` samples done at the first attempt, its
        duration (``seconds``; 0: not timed)."""
        self.planner.end(micro, peak, floor)
        if seconds > 0.0:
            self.planner.time(micro, n, seconds)

    def set_align(self, align: int) -> None:
        """Prefer multiples of ``align`` where they add no micro-batch (8 on
        CUDA, where kernels favour them; 1 elsewhere)."""
        if align != self._align:
            self.planner.set_align(align)
            self._align = align

    def restart_at(self, micro: int) -> None:
        """A resumed run: plan from ``micro`` (a fixed size stays fixed)."""
        if micro and not self.opts["fixed"]:
            self.planner = _C.Planner(**dict(self.opts, micro=micro))
            self.budget = self.opts["budget_bytes"]
            self._align = 1

    def _checkpoint_hold(self, level: int, step: int) -> int:
        """De-escalation comes first: while blocks are checkpointed a calm
        level switches a quarter of them off every grow_after steps, and the
        planner holds the size (it sees ELEVATED) until none is left."""
        ck = self.checkpoints
        if ck is None or not ck.n_on or level != Level.OK:
            self._calm = 0
            return level
        self._calm += 1
        if self._calm >= self._grow_after:
            self._calm = 0
            ck.fewer(max(1, len(ck) // 4))
            self._event(Event.CHECKPOINT, step=step, blocks=ck.n_on, reason="calm")
        return int(Level.ELEVATED)

    def _escalate(self, level: int, state: dict, step: int) -> None:
        """At the smallest micro-batch and still HIGH: checkpoint more
        blocks; at CRITICAL with nothing left, call on_critical once."""
        if level < Level.CRITICAL:
            self._critical_fired = False
        if level < Level.HIGH or state["reason"] != "at_min":
            return
        ck = self.checkpoints
        if ck is not None and ck.n_on < len(ck):
            ck.more(max(1, len(ck) // 4))
            self._event(Event.CHECKPOINT, step=step, blocks=ck.n_on,
                        reason=Level(level).name.lower())
        elif level >= Level.CRITICAL and not self._critical_fired:
            self._critical_fired = True
            self._event(Event.CRITICAL, step=step)
            self._on_critical()
