"""Advice on the DataLoader workers, once per guard.

The budget bounds the process's footprint with its child processes' (the
DataLoader workers: each holds its own copy of whatever its dataset loads).
Where they hold a tenth of the budget or more, or they are what keeps the
step below its whole batch (the planner's predicted peak of the whole batch
would fit the room the workers take), memguard says so once: a
:class:`WorkersWarning` and a ``workers`` event naming their number, their
memory and what a lower ``num_workers`` would give back. It never changes
the loader. It is checked at step boundaries and at each inference's first
(an evaluation alone is advised too), from the sample read there, and
waits for the workers' number to hold over two boundaries: a loader starts
its workers one by one, and the first boundary may see only some of them.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

from memguard._common import size
from memguard.telemetry.events import Event
from memguard.telemetry.samples import Sample
from memguard.telemetry.workers import describe, give_back

#: the share of the budget from which the workers' memory is worth a word
SHARE = 0.1


class WorkersWarning(UserWarning):
    """The DataLoader workers (child processes) hold much of the budget."""


class WorkersAdvice:
    """Says once per guard when the workers cost the run memory it needs.

    Args:
        event: writes an event (the guard's exporter).
    """

    def __init__(self, event: Callable[..., Any]) -> None:
        self._event = event
        #: whether the advice was given (it is given once)
        self.given = False
        #: the advice's words, once given
        self.message: str | None = None
        self._seen = 0     # the workers at the previous boundary

    def check(self, s: Sample | None, budget: int, n: int, micro: int, planner: Any,
              step: int, what: str = "the step") -> bool:
        """At a step boundary (or an inference's first, ``what``: "an
        inference"): the boundary's sample ``s``, the process's ``budget``,
        the batch of ``n`` samples planned at ``micro`` by ``planner`` (a
        ``_C.Planner``). Advises at most once; whether it did now."""
        if self.given or s is None:
            return False
        workers, held = int(s.children or 0), int(s.children_bytes or 0)
        settled, self._seen = workers == self._seen, workers
        if not workers or not held or budget <= 0 or not settled:
            return False
        reasons = []
        if held >= SHARE * budget:
            reasons.append("share")
        whole = _whole_batch_fits(planner, n, held) if 0 < micro < n else None
        if whole is not None:
            reasons.append("micro_batch")
        if not reasons:
            return False
        self.given = True
        self._say(workers, held, budget, reasons, n, micro, whole, step, what)
        return True

    def _say(self, workers: int, held: int, budget: int, reasons: list[str], n: int,
             micro: int, whole: int | None, step: int, what: str) -> None:
        """The warning and the event."""
        why = f", {held / budget:.0%} of the budget ({size(budget)})"
        if whole is not None:
            why += (f"; they keep {what} at micro-batch {micro} of {n}: without them the "
                    f"whole batch (predicted peak {size(whole)}) would fit")
        head, _, fewer = describe(workers, held).partition("; ")
        self.message = (f"memguard: {head}{why}" + (f"; {fewer}" if fewer else "")
                        + ". memguard does not change the loader.")
        warnings.warn(self.message, WorkersWarning, stacklevel=5)
        self._event(Event.WORKERS, step=step, workers=workers, workers_bytes=held,
                    budget_bytes=budget, share=held / budget, reasons=reasons,
                    batch=n, micro_batch=micro, whole_batch_peak_bytes=whole,
                    give_back=[{"num_workers": k, "bytes": b}
                               for k, b in give_back(workers, held)])


def _whole_batch_fits(planner: Any, n: int, held: int) -> int | None:
    """The whole batch's predicted peak where it would fit the planner's
    room with the workers' bytes added to it (its margin kept); else ``None``
    (no prediction yet, no budget, or it would not fit even so)."""
    st = planner.state()
    budget = int(st["budget_bytes"])
    pred = planner.predict(n)
    if not budget or pred is None:
        return None
    return int(pred) if pred <= (budget + held) * (1.0 - float(st["margin"])) else None
