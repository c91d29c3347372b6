"""Memory a run leaves unused: its whole batch peaks well below the budget.

After :data:`STEADY` committed steps in a row that ran the whole batch in one
piece and peaked under ``share`` of the budget, :class:`Headroom` says once,
in an event and a log line, what the run uses, the budget, and the largest
batch the planner's peak model predicts to fit under the guard's
constraints (``multiple_of``, ``divisor_of``, ``min_micro_batch``). With
``divisor_of`` (a queue size), it also names batches that fit with a queue
size near the current one (a multiple of the batch). It changes nothing.

The model is the planner's line of peak bytes against micro-batch size;
while every step had one size that line runs from the steps' floor to their
peak, which rises faster than the truth (the step's fixed part, gradients,
is counted as if it grew with the batch), so the batch it names errs small.
It is not extrapolated past :data:`MAX_FACTOR` times the batch.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from memguard import _C
from memguard._common import size
from memguard.telemetry.events import Event

log = logging.getLogger("memguard")

#: steps at the whole batch, under the share, before the headroom is said
STEADY = 5

#: the largest batch named, as a multiple of the batch run
MAX_FACTOR = 8

#: the batch sizes offered with a queue: the largest that fits, and the
#: largest multiples of these below it (sizes GPUs run well)
QUEUE_ALIGN = (8, 32)


class Headroom:
    """Watches committed steps for memory left unused.

    Args:
        share: the peak's share of the budget below which the batch is
            said to leave room (``None``: never).
        opts: the planner's options (``min_micro``, ``multiple_of``,
            ``divisor_of``, ``margin``).
        event: where the event goes (``event(name, **data)``).
    """

    def __init__(self, share: float | None, opts: dict[str, Any],
                 event: Callable[..., Any] | None = None) -> None:
        self.share, self.opts, self._event = share, opts, event
        self._steady = 0
        #: the headroom event's fields, once said
        self.found: dict[str, Any] | None = None

    def observe(self, step: int, micro: int, n: int, peak: int, budget: int,
                planner: Any, source: str) -> None:
        """A committed step of ``n`` samples at ``micro`` that peaked at
        ``peak`` bytes of ``source`` against ``budget``."""
        if self.share is None or self.found is not None:
            return
        whole = micro >= n and peak > 0 and budget > 0 and peak < self.share * budget
        self._steady = self._steady + 1 if whole else 0
        if self._steady < STEADY:
            return
        fields = self.fields(step, n, peak, budget, planner, source)
        if fields is None:
            return
        self.found = fields
        log.warning(message(fields))
        if self._event is not None:
            self._event(Event.HEADROOM, **fields)

    def fields(self, step: int, n: int, peak: int, budget: int, planner: Any,
               source: str) -> dict[str, Any] | None:
        """The event's fields: the largest batch the model predicts to fit
        (``n`` itself where the constraints allow none larger, but a resized
        queue does); ``None`` when the model names no batch above ``n``."""
        a, b = planner.predict(0), planner.predict(n)
        if a is None or b is None or b <= a:
            return None
        slope = (b - a) / n
        limit = budget * (1.0 - max(float(planner.state()["margin"]), self.opts["margin"]))
        top = int((limit - a) / slope)
        capped = top > MAX_FACTOR * n
        largest = self._fit(min(top, MAX_FACTOR * n))
        queue = self._queue(min(top, MAX_FACTOR * n), n)
        if largest <= n and not queue:
            return None
        return {"step": step, "source": source, "peak_bytes": peak, "budget_bytes": budget,
                "batch": n, "largest_batch": largest,
                "predicted_peak_bytes": int(a + slope * largest), "capped": capped,
                "multiple_of": self.opts["multiple_of"],
                "divisor_of": self.opts["divisor_of"] or None,
                "queue": queue}

    def _fit(self, x: int, divisor_of: int | None = None) -> int:
        """The largest size at most ``x`` the constraints allow (0: none)."""
        o = self.opts
        rules = _C.Planner(min_micro=o["min_micro"], multiple_of=o["multiple_of"],
                           divisor_of=o["divisor_of"] if divisor_of is None else divisor_of)
        s = rules.fit(max(0, x))
        return int(s) if s is not None else 0

    def _queue(self, top: int, n: int) -> list[dict[str, int]] | None:
        """With a queue (``divisor_of``): batches above ``n`` that fit, each
        with the multiple of it nearest the queue's size."""
        q = self.opts["divisor_of"]
        if not q:
            return None
        best = self._fit(top, divisor_of=0)
        sizes = {best} | {best - best % k for k in QUEUE_ALIGN}
        return [{"batch": s, "queue": max(s, round(q / s) * s)}
                for s in sorted(sizes, reverse=True) if s > n]


def message(f: dict[str, Any]) -> str:
    """The headroom's log line."""
    more = "at least " if f["capped"] else ""
    line = (f"memguard: the whole batch of {f['batch']} peaks at {size(f['peak_bytes'])} of a "
            f"budget of {size(f['budget_bytes'])} ({f['source']}): by the peak model "
            f"{more}a batch of {f['largest_batch']} fits (predicted peak "
            f"{size(f['predicted_peak_bytes'])})")
    if f["largest_batch"] <= f["batch"]:
        line = (f"memguard: the whole batch of {f['batch']} peaks at {size(f['peak_bytes'])} of "
                f"a budget of {size(f['budget_bytes'])} ({f['source']}): no larger batch "
                f"divides {f['divisor_of']:,} and fits")
    if f.get("queue"):
        pairs = ", ".join(f"batch {p['batch']} with queue {p['queue']:,}" for p in f["queue"])
        line += f"; with the queue of {f['divisor_of']:,} resized: {pairs}"
    return line
