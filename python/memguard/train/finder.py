"""Find the largest batch size that fits a memory budget in a few steps.

::

    res = memguard.find_batch_size(step, sample_batch, budget="20GiB", divisor_of=65536)
    print(res.size, res.predicted_peak_bytes, res.measured_peak_bytes, res.probes)

Peak memory of a training step is close to linear in the batch size (the
model, gradients and optimizer state, plus activations per sample), so two
measured sizes give the line, the line gives the largest size whose peak
stays under ``budget * (1 - margin)`` (aiming 1 % low), and one more step
verifies it.
Four steps at most: a small and a large probe, the verification, and when
that misses (the small probe may carry a first step's one-off allocations,
such as optimizer state), a refit through the two warm points and one more. The probes should be in the regime where activations
dominate the peak: a sample batch of the size you train at is right. Out-of-memory errors during a probe count as "too big".
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from memguard import _C
from memguard.memory.oom import is_oom
from memguard.telemetry.budget import parse_budget
from memguard.train import batch as _batch
from memguard.train.peaks import PeakMeter


@dataclasses.dataclass
class BatchSizeResult:
    """What :func:`find_batch_size` found.

    Attributes:
        size: the largest batch size found to fit (0: none fits).
        predicted_peak_bytes: the line's peak for ``size``.
        measured_peak_bytes: the verification step's peak at ``size``.
        probes: ``(size, peak_bytes)`` of every step run, in order
            (``peak_bytes`` is ``None`` for a probe that ran out of memory).
        budget_bytes: the budget compared against.
        peak_source: where peaks came from ("arena", "cuda" or "rss").
    """
    size: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    probes: list[tuple[int, int | None]]
    budget_bytes: int
    peak_source: str


def _take(batch: Any, n: int, size: int) -> Any:
    """``size`` samples from a batch of ``n``, repeating it when it is short."""
    if size <= n:
        return _batch.slice_(batch, 0, size)
    reps = -(-size // n)
    return _batch.slice_(_batch.concat([batch] * reps), 0, size)


def find_batch_size(step_fn: Callable[[Any], Any], sample_batch: Any, *,
                    budget: str | int = "auto", multiple_of: int = 1,
                    divisor_of: int | None = None, min_size: int = 1,
                    max_size: int | None = None, margin: float = 0.1,
                    first_probe: int | None = None) -> BatchSizeResult:
    """The largest batch size whose step peaks under ``budget * (1 - margin)``.

    Args:
        step_fn: runs one training step on a batch (forward and backward at
            least; it may step an optimizer: the probes then train).
        sample_batch: a batch to cut probe batches from (repeated when a
            probe needs more samples than it has).
        budget: see :func:`memguard.parse_budget`; peaks are the bytes
            requested from memguard's arena when it serves tensors (the
            margin covers its block rounding), CUDA's allocated bytes for
            CUDA batches, else the process's peak RSS.
        multiple_of, divisor_of, min_size, max_size: constraints the size
            keeps to (``max_size`` defaults to no limit).
        margin: headroom kept under the budget (=0.1).
        first_probe: the small probe's size (default: a quarter of the
            sample batch, at least ``min_size``).

    Returns:
        A :class:`BatchSizeResult` (``size`` 0 when not even ``min_size``
        fits).

    Raises:
        ValueError: a bad budget, margin or constraint.
    """
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), not {margin!r}")
    for name, v in (("multiple_of", multiple_of), ("min_size", min_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, not {v!r}")
    if max_size is not None and (not isinstance(max_size, int) or max_size < min_size):
        raise ValueError(f"max_size must be an integer >= min_size, not {max_size!r}")
    budget_bytes = parse_budget(budget)
    limit = budget_bytes * (1.0 - margin)
    rules = _C.Planner(min_micro=min_size, multiple_of=multiple_of, divisor_of=divisor_of or 0)
    n = _batch.batch_size(sample_batch)
    # Requested bytes under the arena: what the step asks for is linear in
    # the batch size, while block rounding (four sizes per doubling) makes
    # block bytes zigzag around that line by several percent; the margin
    # is what covers the rounding.
    meter = PeakMeter(arena_key="requested_bytes.peak")
    probes: list[tuple[int, int | None]] = []

    def fit(x: float) -> int:
        x = int(max(0, min(x, max_size if max_size is not None else x)))
        s = rules.fit(x)
        return int(s) if s is not None else 0

    def probe(size: int) -> int | None:
        batch = _take(sample_batch, n, size)
        meter.start(batch)
        try:
            step_fn(batch)
        except Exception as exc:
            if not is_oom(exc):
                raise
            peak = None
        else:
            peak = meter.stop()
        del batch
        probes.append((size, peak))
        return peak

    small = fit(first_probe if first_probe is not None else max(min_size, n // 4))
    if small == 0:                    # nothing that small is allowed: the smallest size that is
        top = max_size if max_size is not None else max(divisor_of or 0, min_size) + multiple_of
        small = next((x for x in range(min_size, top + 1) if fit(x) == x), 0)
    if small == 0:
        raise ValueError(f"no batch size satisfies min_size={min_size}, "
                         f"multiple_of={multiple_of}, divisor_of={divisor_of}, "
                         f"max_size={max_size}")
    large = fit(max(4 * small, n))
    y_small = probe(small)            # may carry a first step's one-off allocations
    if y_small is None or y_small > limit:
        return BatchSizeResult(0, 0, y_small or 0, probes, budget_bytes, meter.source)
    y_large = probe(large) if large > small else None

    def line(points: list[tuple[int, int]]) -> tuple[float, float]:
        (x0, y0), (x1, y1) = points[0], points[-1]
        if x1 == x0 or y1 <= y0:
            return 0.0, y1 / x1          # through the origin: overestimates growth
        b = (y1 - y0) / (x1 - x0)
        return y0 - b * x0, b

    if y_large is None:               # the large probe did not fit: bisect towards it
        a, b = line([(small, y_small), (large, int(budget_bytes))])
    else:
        a, b = line([(small, y_small), (large, y_large)])
    # Aim 1 % low: measured peaks scatter a little around the line, and a
    # miss costs the last probe.
    aim = limit * 0.99
    guess = max(fit((aim - a) / b) if b > 0 else fit(10**12), small)
    predicted = int(a + b * guess)
    measured = probe(guess) if guess not in (small, large) else (
        y_small if guess == small else y_large)
    if measured is not None and measured <= limit:
        return BatchSizeResult(guess, predicted, measured, probes, budget_bytes, meter.source)
    # Missed: refit through the two warm points (the large probe and the
    # miss; the small one may carry one-off allocations) and settle below.
    pts = [(large, y_large if y_large is not None else int(budget_bytes)),
           (guess, measured if measured is not None else int(budget_bytes))]
    a, b = line(pts) if guess != large else line([(small, y_small), pts[-1]])
    retry = fit(min((aim - a) / b, guess - 1)) if b > 0 else small
    if retry > 0 and retry not in (small, large):
        y = probe(retry)
        if y is not None and y <= limit:
            return BatchSizeResult(retry, int(a + b * retry), y, probes, budget_bytes,
                                   meter.source)
    best = max(((x, y) for x, y in probes if y is not None and y <= limit), default=(0, 0))
    return BatchSizeResult(best[0], int(a + b * best[0]), best[1], probes, budget_bytes,
                           meter.source)
