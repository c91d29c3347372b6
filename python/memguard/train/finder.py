"""Find the largest batch size that fits a memory budget in a few steps.

::

    res = memguard.find_batch_size(step, sample_batch, budget="20GiB", queue_size=65536)
    print(res.size, res.queue_size, res.measured_peak_bytes, res.probes)

Peak memory of a training step is close to linear in the batch size (the
model, gradients and optimizer state, plus activations per sample), so two
measured sizes give the line, the line gives the largest size whose peak
stays under ``budget * (1 - margin)`` (aiming 1 % low), and one more step
verifies it.
Four steps at most when the first probe fits: a small and a large probe,
the verification, and when that misses (the small probe may carry a first
step's one-off allocations, such as optimizer state), a refit through the
two warm points and one more. A first probe that does not fit is shrunk,
through the origin and then along the line of the failed probes, until one
fits or the line says nothing can. The probes should be in the regime where
activations dominate the peak: a sample batch of the size you train at is
right. Out-of-memory errors during a probe count as "too big".

Bounds: no probe is built larger than half of what the budget and the
machine's free memory can hold of the batch itself, and a peak that does not
grow with the batch is reported as such, never extrapolated.

On a CUDA device (the sample batch's first tensor's) budgets and peaks are
the process as ``nvidia-smi`` shows it: the caching allocator's reserved
bytes plus the CUDA context (with other processes' use of the device, which
cannot be told apart from it). ``"auto"`` is what the process can have there
less :data:`CUDA_RESERVE`, a share is of the device's total memory.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, Callable

import torch

from memguard import _C
from memguard._common import is_auto, size
from memguard.memory import arena, cuda
from memguard.memory.oom import is_oom
from memguard.memory.room import live_budget
from memguard.telemetry.budget import parse_budget
from memguard.telemetry.samples import sample
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
        peak_source: where peaks came from: "arena" (the bytes requested
            from memguard's arena), "cuda_reserved" (a CUDA device's
            reserved bytes and context), "rss" (or "footprint" on macOS).
        note: how the size was found, in words, where it was not a plain fit:
            the peak does not grow with the batch, the probes were bounded by
            memory, or nothing fits.
        queue_size: with ``queue_size=`` asked, the multiple of ``size``
            nearest it (never below ``size``; 0 when nothing fits), else
            ``None``.
    """
    size: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    probes: list[tuple[int, int | None]]
    budget_bytes: int
    peak_source: str
    note: str = ""
    queue_size: int | None = None


def _take(batch: Any, n: int, size: int) -> Any:
    """``size`` samples from a batch of ``n``, repeating it when it is short."""
    if size <= n:
        return _batch.slice_(batch, 0, size)
    reps = -(-size // n)
    return _batch.slice_(_batch.concat([batch] * reps), 0, size)


def _bytes_per_sample(batch: Any, n: int) -> float:
    """What one sample of ``batch`` takes once a probe batch is built: its
    tensors' bytes, and a pointer per entry of a list of samples."""
    total = sum(x.element_size() * x.numel() if isinstance(x, torch.Tensor) else 8 * len(x)
                for x in _batch.leaves(batch))
    return max(total / n, 1.0)


def _on_host(batch: Any) -> bool:
    return all(not isinstance(x, torch.Tensor) or x.device.type == "cpu"
               for x in _batch.leaves(batch))


def _room_left() -> int | None:
    """What the process can still take now: the live budget (a cgroup's
    limit less what others use, or the host's free memory, less a reserve)
    less its footprint. Under a cgroup the host's MemAvailable would be far
    too much: the kernel kills the process at the cgroup's limit."""
    s = sample()
    live = live_budget(s)
    held = s.footprint_bytes or s.rss_bytes
    if live is None or held is None:
        return s.mem_available_bytes
    return max(live[0] - held, 0)


def _probe_cap(batch: Any, n: int, limit: float, free: int | None) -> int:
    """The most samples a probe batch may hold: half of what the budget, and
    for host tensors the machine's free memory (``free``), can hold of the
    batch."""
    room = min(limit, free) if free else limit
    return max(1, int(room / 2 / _bytes_per_sample(batch, n)))


def _check(step_fn: Any, margin: Any, multiple_of: Any, min_size: Any, max_size: Any,
           first_probe: Any, divisor_of: Any, queue_size: Any) -> None:
    if not callable(step_fn):
        raise ValueError(f"step_fn must be callable (one training step on a batch), "  # noqa: TRY004 - one error type for every bad argument
                         f"not {step_fn!r}")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), not {margin!r}")
    for name, v in (("multiple_of", multiple_of), ("min_size", min_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, not {v!r}")
    if max_size is not None and (isinstance(max_size, bool) or not isinstance(max_size, int)
                                 or max_size < min_size):
        raise ValueError(f"max_size must be an integer >= min_size, not {max_size!r}")
    if first_probe is not None and (isinstance(first_probe, bool)
                                    or not isinstance(first_probe, int) or first_probe < 1):
        raise ValueError(f"first_probe must be a positive integer, not {first_probe!r}")
    for name, v in (("divisor_of", divisor_of), ("queue_size", queue_size)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive integer or None, not {v!r}")
    if divisor_of is not None and queue_size is not None:
        raise ValueError(f"divisor_of={divisor_of} and queue_size={queue_size} were both "
                         f"given: divisor_of keeps the queue and sizes divide it, queue_size "
                         f"keeps the largest size and moves the queue to a multiple of it")


#: the least the arena's bound during probes leaves above a budget
SLACK = 64 << 20

#: a peak that grows by less than this share of itself from the small probe
#: to the large one does not depend on the batch (RSS moves by pages)
FLAT = 0.01

#: what ``"auto"`` on a CUDA device leaves free beyond the margin: the
#: modules of kernels first launched after the search (CUDA loads them
#: lazily, into the context) and buffers that libraries (cuDNN, NCCL) take
#: outside the caching allocator
CUDA_RESERVE = 256 << 20


def _cuda_device(batch: Any) -> Any:
    """The device of the batch's first tensor where it is a CUDA one (the
    device :class:`PeakMeter` would measure), else ``None``."""
    first = next((x for x in _batch.leaves(batch) if isinstance(x, torch.Tensor)), None)
    return first.device if first is not None and first.is_cuda else None


def _empty_cache() -> None:
    """Hand the cached blocks of CUDA's allocator back to the device (and
    memguard's, where it serves CUDA tensors)."""
    torch.cuda.empty_cache()
    if _C.cuda_backend() is not None:
        _C.cuda_trim(-1)


class _CudaMeter:
    """A probe's peak on a CUDA device as ``nvidia-smi`` shows the process:
    the allocator's reserved bytes at their peak, plus what the device holds
    outside them (the context, and others' use: ``total - free - reserved``),
    the larger of that at the probe's start and at its end (the context grows
    when a kernel's module is first loaded).

    The cache is emptied before each probe, so that a probe starts from what
    is live. torch's peak counters are read, never reset (:class:`PeakMeter`):
    a probe smaller than an earlier one does not raise the mark, and is
    measured by what is reserved at its end, which is its peak (segments stay
    reserved until the cache is emptied)."""

    source = "cuda_reserved"

    def __init__(self, device: Any) -> None:
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.meter = PeakMeter(cuda_key="reserved_bytes")
        self._outside = 0
        self._retries = 0

    def read(self) -> tuple[int, int, dict[str, int]]:
        """(free, total, the allocator's counters): the device now."""
        free, total = torch.cuda.mem_get_info(self.index)
        return int(free), int(total), cuda.stats(self.index)

    def budget(self, budget: str | int) -> tuple[int, int]:
        """(the budget, the device's room) in bytes as peaks count them.
        The room, and ``"auto"``, is what the process can have: the device's
        free memory and what its allocator reserves now, less
        :data:`CUDA_RESERVE`, plus what is outside the allocator (peaks
        count it too). A share is of the device's total memory."""
        if not is_auto(budget):
            parse_budget(budget, total=1 << 40)   # a bad budget fails before the device is read
        free, total, st = self.read()
        reserved = st["reserved_bytes.current"]
        room = max(max(total - free - reserved, 0) + reserved + free - CUDA_RESERVE, 1)
        return (room if is_auto(budget) else parse_budget(budget, total=total)), room

    def start(self, batch: Any) -> None:
        _empty_cache()
        free, total, st = self.read()
        self._outside = max(total - free - st["reserved_bytes.current"], 0)
        self._retries = st["num_alloc_retries"]
        self.meter.start_cuda(torch.device("cuda", self.index))

    def stop(self) -> int | None:
        """The probe's peak; ``None`` where the allocator had to free its
        cache and retry to go on: the device was full, the probe too big."""
        free, total, st = self.read()
        self.meter.now(stats=st, settled=True)
        reserved = self.meter.stop()
        if st["num_alloc_retries"] > self._retries:
            return None
        return max(total - free - st["reserved_bytes.current"], self._outside) + reserved


def _line(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Intercept and slope through the first and last point; through the
    origin (which overestimates growth) when they do not rise."""
    (x0, y0), (x1, y1) = points[0], points[-1]
    if x1 == x0 or y1 <= y0:
        return 0.0, y1 / x1
    b = (y1 - y0) / (x1 - x0)
    return y0 - b * x0, b


class _Search:
    """The probes of one search: sizes kept to the rules and bounds, peaks
    measured, every step run recorded."""

    def __init__(self, step_fn: Callable[[Any], Any], batch: Any, n: int, rules: Any,
                 max_size: int | None, cap: int, meter: Any, queue_size: int | None) -> None:
        self.step_fn, self.batch, self.n, self.rules = step_fn, batch, n, rules
        self.max_size, self.cap, self.queue_size = max_size, cap, queue_size
        self.capped = False
        self.note = ""                   # why the limit is below the budget, if it is
        self.upper: int | None = None    # the smallest size known not to fit
        self.meter = meter
        self.probes: list[tuple[int, int | None]] = []

    def fit(self, x: float) -> int:
        """The largest allowed size at most ``x`` (0: none)."""
        top = min(self.cap, self.upper - 1 if self.upper else self.cap)
        if self.max_size is not None:
            top = min(top, self.max_size)
        if x > top:
            self.capped = self.capped or top == self.cap
            x = top
        s = self.rules.fit(int(max(0, x)))
        return int(s) if s is not None else 0

    def probe(self, size: int) -> int | None:
        batch = _take(self.batch, self.n, size)
        self.meter.start(batch)
        try:
            self.step_fn(batch)
        except Exception as exc:
            if not is_oom(exc):
                raise
            peak = None
        else:
            peak = self.meter.stop()
        del batch
        self.probes.append((size, peak))
        return peak


def find_batch_size(step_fn: Callable[[Any], Any], sample_batch: Any, *,
                    budget: str | int = "auto", multiple_of: int = 1,
                    divisor_of: int | None = None, min_size: int = 1,
                    max_size: int | None = None, margin: float = 0.1,
                    first_probe: int | None = None,
                    queue_size: int | None = None) -> BatchSizeResult:
    """The largest batch size whose step peaks under ``budget * (1 - margin)``.

    Args:
        step_fn: runs one training step on a batch (forward and backward at
            least; it may step an optimizer: the probes then train).
        sample_batch: a batch to cut probe batches from (repeated when a
            probe needs more samples than it has).
        budget: see :func:`memguard.parse_budget`. Peaks are the bytes
            requested from memguard's arena when it serves tensors (its
            blocks round them up by up to 25 %: a run under an arena
            bounded at the same budget needs ``margin=0.2``), else the
            process's peak RSS; for a batch on a CUDA device, the process
            as ``nvidia-smi`` shows it: the allocator's peak reserved bytes
            plus the context (and others' use of the device). There
            ``"auto"`` is what the process can have (the device's free
            memory and what its allocator reserves now, less
            :data:`CUDA_RESERVE`), a share (``"75%"``) is of the device's
            total, and a budget above the device's room is held to the room
            (``note`` says so).
        multiple_of, divisor_of, min_size, max_size: constraints the size
            keeps to (``max_size`` defaults to no limit; ``divisor_of``: the
            size divides it, as a queue that must stay a multiple of the
            batch).
        margin: headroom kept under the budget (=0.1).
        first_probe: the small probe's size (default: a quarter of the
            sample batch, at least ``min_size``); one that does not fit is
            shrunk until one does.
        queue_size: a queue that follows the size instead (not with
            ``divisor_of``): the size is the largest that fits, and the
            result's ``queue_size`` the multiple of it nearest this.

    Returns:
        A :class:`BatchSizeResult` (``size`` 0 when not even ``min_size``
        fits; ``note`` says why, and when the peak does not grow with the
        batch or the probes were bounded by memory).

    Raises:
        ValueError: a bad budget, margin, constraint (``divisor_of`` and
            ``queue_size`` both given), step function or sample batch
            (none, or no samples in it).
    """
    _check(step_fn, margin, multiple_of, min_size, max_size, first_probe, divisor_of,
           queue_size)
    n = _batch.checked_size(sample_batch)
    if n == 0:
        raise ValueError("sample_batch holds no samples (its batch dimension is 0): give a "
                         "batch of the size you train at")
    meter, budget_bytes, device_room = _meter_and_budget(sample_batch, budget)
    limit = budget_bytes * (1.0 - margin)
    rules = _C.Planner(min_micro=min_size, multiple_of=multiple_of, divisor_of=divisor_of or 0)
    on_host = _on_host(sample_batch)
    free = _room_left() if on_host else None      # read once, for both bounds
    s = _Search(step_fn, sample_batch, n, rules, max_size,
                _probe_cap(sample_batch, n, limit, free if on_host else device_room),
                meter, queue_size)
    small = _first_size(s, first_probe if first_probe is not None else max(min_size, n // 4),
                        min_size, multiple_of, divisor_of)
    with _bounded(on_host, budget_bytes, free):
        if free is not None and arena.installed():
            # the machine (its cgroup) may hold less than the budget: the
            # arena's peaks, what it holds included, must fit what it can take
            limit = _within(s, limit, arena.stats()["allocated_bytes.current"] + free, margin,
                            "the machine (or its cgroup)")
        elif device_room is not None:
            limit = _within(s, limit, device_room, margin, f"CUDA device {meter.index}")
        small, y_small = _shrink_to_fit(s, small, limit)
        if y_small is None:
            return _result(s, 0, 0, 0, budget_bytes, f"not even min_size={min_size} fits "
                           f"under {limit:.0f} bytes (the budget less the margin)")
        return _grow(s, small, y_small, limit, budget_bytes)


def _meter_and_budget(batch: Any, budget: str | int) -> tuple[Any, int, int | None]:
    """(the probes' peak meter, the budget in bytes, a CUDA device's room or
    ``None`` off CUDA)."""
    device = _cuda_device(batch)
    if device is None:
        # Requested bytes under the arena: what the step asks for is linear
        # in the batch size, while block rounding (four sizes per doubling)
        # makes block bytes zigzag above that line by up to 25 %, which the
        # margin must cover where the run is bounded by the arena.
        return PeakMeter(arena_key="requested_bytes.peak"), parse_budget(budget), None
    meter = _CudaMeter(device)
    return (meter, *meter.budget(budget))


def _within(s: _Search, limit: float, room: int, margin: float, where: str) -> float:
    """The limit held to ``room`` (its margin kept), ``s.note`` saying so
    where that lowers it."""
    held = room * (1.0 - margin)
    if held >= limit:
        return limit
    s.note = f"{where} has room for less than the budget now: sizes fit {size(int(held))}"
    return held


def _queue_for(size: int, queue: int | None) -> int | None:
    """The multiple of ``size`` nearest ``queue`` (the larger on a tie),
    never below ``size``; ``None`` where no queue was asked, 0 where no size
    fits."""
    if queue is None:
        return None
    if size == 0:
        return 0
    return max(1, (2 * queue + size) // (2 * size)) * size


def _large_probe(s: _Search, small: int) -> tuple[int, int | None]:
    """The large point of the line: a probe well above ``small``, or the
    smallest size measured too big on the way down (it need not be run
    again)."""
    above = [(x, y) for x, y in s.probes if x > small and y is not None]
    if above:
        return min(above)
    large = s.fit(max(4 * small, s.n))
    return (large, s.probe(large)) if large > small else (large, None)


@contextlib.contextmanager
def _bounded(on_host: bool, budget_bytes: int, free: int | None) -> Iterator[None]:
    """Probes of a host batch run under memguard's arena, bounded at what it
    holds plus 1.5 budgets: at least a budget and :data:`SLACK` more, at most
    what the process can still take (the live budget's room, its reserve
    kept). The arena is installed for them where it was
    not, and a lower budget it had is kept. A probe far too big then fails as
    an out-of-memory error, counted as "too big", instead of taking the
    machine's memory. (The bound is above the budget: the arena's blocks
    round requests up, and the finder judges the bytes requested.)"""
    was_installed = arena.installed()
    if not on_host:
        yield
        return
    st = arena.stats()
    extra = budget_bytes + max(budget_bytes // 2, SLACK)
    before = st["budget_bytes"]
    bound = st["allocated_bytes.current"] + (min(extra, free) if free else extra)
    try:
        arena.install(budget=min(before, bound) if before else bound)
    except RuntimeError:                 # no arena here: the probe cap alone bounds them
        yield
        return
    try:
        yield
    finally:
        arena.set_budget(before or None)
        if not was_installed:
            arena.uninstall()


def _first_size(s: _Search, want: int, min_size: int, multiple_of: int,
                divisor_of: int | None) -> int:
    small = s.fit(want)
    if small == 0:                    # nothing that small is allowed: the smallest size that is
        top = s.max_size if s.max_size is not None else max(divisor_of or 0, min_size) + multiple_of
        small = next((x for x in range(min_size, min(top, s.cap) + 1) if s.fit(x) == x), 0)
    if small == 0:
        raise ValueError(f"no batch size satisfies min_size={min_size}, "
                         f"multiple_of={multiple_of}, divisor_of={divisor_of}, "
                         f"max_size={s.max_size}")
    return small


def _shrink_to_fit(s: _Search, small: int, limit: float) -> tuple[int, int | None]:
    """Probe ``small``; while it does not fit, a smaller size: through the
    origin from one failed probe, along the line of two, halving after an
    out-of-memory error. (size, peak), peak None when nothing fits."""
    failed: list[tuple[int, int]] = []
    while True:
        y = s.probe(small)
        if y is not None and y <= limit:
            return small, y
        s.upper = small
        if y is None:
            guess = small // 2
        else:
            failed.insert(0, (small, y))
            a, b = _line(failed) if len(failed) > 1 else (0.0, y / small)
            if a >= limit:                 # what does not depend on the batch is too much
                return small, None
            guess = (limit * 0.99 - a) / b
        nxt = s.fit(min(guess, small - 1))
        if nxt == 0 or nxt >= small:
            return small, None
        small = nxt


def _grow(s: _Search, small: int, y_small: int, limit: float,
          budget_bytes: int) -> BatchSizeResult:
    """From a size that fits: a large probe, the line through both, the
    largest size it allows, verified (and refitted once on a miss)."""
    large, y_large = _large_probe(s, small)
    if large > small and y_large is not None and y_large - y_small <= FLAT * y_large:
        ok = y_large <= limit
        return _result(s, large if ok else small, y_large if ok else y_small,
                       y_large if ok else y_small, budget_bytes,
                       f"the step's peak did not grow from {small} to {large} samples: its "
                       f"memory does not depend on the batch here, so no larger size was "
                       f"extrapolated (max_size sets one)")
    if large > small and y_large is None:
        # the large probe did not fit, and its peak is unknown: the line
        # through the origin and the small probe rises at least as fast as
        # the step's (whose fixed part is not negative), so its size fits
        s.upper = large
        a, b = 0.0, y_small / small
    else:
        a, b = _line([(small, y_small), (large, y_large if y_large is not None else y_small)])
    # Aim 1 % low: measured peaks scatter a little around the line, and a
    # miss costs the last probe.
    aim = limit * 0.99
    guess = max(s.fit((aim - a) / b) if b > 0 else small, small)
    predicted = int(a + b * guess)
    measured = s.probe(guess) if guess not in (small, large) else (
        y_small if guess == small else y_large)
    if measured is not None and measured <= limit:
        return _result(s, guess, predicted, measured, budget_bytes)
    # Missed: refit through the two warm points (the large probe and the
    # miss; the small one may carry one-off allocations) and settle below.
    s.upper = guess
    pts = [(large, y_large if y_large is not None else int(budget_bytes)),
           (guess, measured if measured is not None else int(budget_bytes))]
    a, b = _line(pts) if guess != large else _line([(small, y_small), pts[-1]])
    if measured is None:               # its peak is unknown: the origin's line fits
        a, b = 0.0, y_small / small
    retry = s.fit(min((aim - a) / b, guess - 1)) if b > 0 else small
    if retry > 0 and retry not in (small, large):
        y = s.probe(retry)
        if y is not None and y <= limit:
            return _result(s, retry, int(a + b * retry), y, budget_bytes)
    best = max(((x, y) for x, y in s.probes if y is not None and y <= limit), default=(0, 0))
    return _result(s, best[0], int(a + b * best[0]), best[1], budget_bytes)


def _result(s: _Search, size: int, predicted: int, measured: int, budget_bytes: int,
            note: str = "") -> BatchSizeResult:
    note = note or s.note
    if s.capped and not note:
        note = (f"probes were bounded at {s.cap} samples: half of what the budget and the "
                f"machine's free memory can hold of the batch itself")
    return BatchSizeResult(size, predicted, measured, list(s.probes), budget_bytes,
                           s.meter.source, note, _queue_for(size, s.queue_size))
