"""A forecast of slow growth: the memory a run holds between steps, its
trend, and when that trend reaches the budget.

At every committed step the guard hands :class:`Drift` what the peak's
source held as the step began (the floor: the arena's or CUDA's allocated
bytes, or the process's RSS). A leak (``losses.append(loss)``, a cache that
keeps features) raises that floor step after step; the allocator's noise,
an evaluation or a checkpoint save moves it once.

The trend is read at several time scales: the floors themselves over the
last 64 steps, and medians of blocks of 4, 16, 64 and 256 steps over the
last 64 blocks, so a leak of a few bytes a step shows over thousands of
steps and one of megabytes within dozens. At each scale the window is cut
in four quarters; the trend rises when each quarter's median is above the
one before by more than the values' own spread (their median absolute
deviation) and by :data:`MIN_RISE`. A one-off jump lifts one quarter only;
noise lifts all three by chance rarely, and even then its rate is too small
to reach the budget within the horizon. The rate is the rise of the medians
from the first quarter to the last, over the steps between them.

A rising trend that reaches the budget (less what a step at the smallest
micro-batch needs above the floor) within the horizon is a forecast: one
warning and one :data:`~memguard.telemetry.events.Event.FORECAST` event per
episode, with what grows named by a census
(:mod:`memguard.telemetry.census`): one taken when the trend first rises,
one at the forecast. An episode ends after a window of steps without a
rising trend.
"""
from __future__ import annotations

import collections
import statistics
import time
import warnings
from typing import Any, Callable

from memguard._common import size, user_stacklevel
from memguard.telemetry.events import Event

#: steps left out at the start (optimizer state and the allocator's first
#: blocks come then)
WARMUP = 5

#: floors (or block medians) per scale, and the least a trend is read from
WINDOW, MIN_POINTS = 64, 24

#: the steps per block at each scale
BLOCKS = (1, 4, 16, 64, 256)

#: the least rise between quarters counted (bytes): RSS moves by pages
MIN_RISE = 64 << 10

#: steps between the two censuses when a forecast is due right as the
#: trend was first seen (a rate needs two)
CENSUS_GAP = 8

#: the horizon when none is given: three epochs where epochs are known
AUTO_STEPS, AUTO_EPOCHS = 1000, 3


class ForecastWarning(UserWarning):
    """The memory a run holds between steps grows, and reaches the budget
    within the horizon; the message names what grows."""


class _Scale:
    """One time scale: medians of blocks of ``block`` steps, the last
    :data:`WINDOW` of them."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.points: collections.deque[tuple[float, float]] = collections.deque(maxlen=WINDOW)
        self._xs: list[int] = []
        self._ys: list[int] = []
        #: the trend read when the last block completed
        self.last: tuple[float, float, float] | None = None

    def add(self, step: int, floor: int) -> bool:
        """A floor; whether a block was completed."""
        self._xs.append(step)
        self._ys.append(floor)
        if len(self._ys) < self.block:
            return False
        self.points.append((statistics.fmean(self._xs), statistics.median(self._ys)))
        self._xs, self._ys = [], []
        self.last = self.trend()
        return True

    def trend(self) -> tuple[float, float, float] | None:
        """(rate per step, the trend's value, at the step) when the window
        rises quarter by quarter; ``None`` otherwise."""
        if len(self.points) < MIN_POINTS:
            return None
        pts = list(self.points)
        q = len(pts) // 4
        quarters = [pts[len(pts) - 4 * q + i * q:len(pts) - 4 * q + (i + 1) * q] for i in range(4)]
        meds = [statistics.median(y for _, y in part) for part in quarters]
        xs = [statistics.median(x for x, _ in part) for part in quarters]
        spread = max(statistics.median(abs(y - m) for _, y in part)
                     for part, m in zip(quarters, meds))
        if any(b - a <= max(spread, MIN_RISE) for a, b in zip(meds, meds[1:])):
            return None
        return (meds[3] - meds[0]) / (xs[3] - xs[0]), meds[3], xs[3]


class Drift:
    """The trend of a guard's floors and the forecast from it.

    Args:
        horizon: steps (an int), ``"N epochs"``, ``"auto"``
            (:data:`AUTO_EPOCHS` epochs where they are known, else
            :data:`AUTO_STEPS` steps) or ``None`` (no forecast).
        steps_per_epoch: optimizer steps per epoch, where known.
        event: where the forecast's event goes (``event(name, **data)``).
    """

    def __init__(self, horizon: Any = "auto", steps_per_epoch: int | None = None,
                 event: Callable[..., Any] | None = None) -> None:
        self.horizon = horizon
        #: optimizer steps per epoch (the Lightning callback sets it)
        self.steps_per_epoch = steps_per_epoch
        self._event = event
        self._scales = [_Scale(b) for b in BLOCKS]
        self._times: collections.deque[float] = collections.deque(maxlen=WINDOW)
        #: the last trend read (rate per step, level, at step), for metrics
        self.trend: tuple[float, float, float] | None = None
        #: the last forecast's event fields, until its episode ends
        self.forecast: dict[str, Any] | None = None
        self._quiet = 0                 # steps in a row without a rising trend
        self._baseline: Any = None      # the census taken when the trend first rose
        self._rising: _Scale | None = None

    def horizon_steps(self) -> int | None:
        """The horizon in steps now (``None``: no forecast)."""
        h, spe = self.horizon, self.steps_per_epoch
        if h is None:
            return None
        if isinstance(h, int):
            return h
        if h == "auto":
            return max(AUTO_STEPS, AUTO_EPOCHS * spe) if spe else AUTO_STEPS
        epochs = int(str(h).split()[0])
        return epochs * spe if spe else AUTO_STEPS

    def observe(self, step: int, floor: int, budget: int, need: int) -> None:
        """A committed step: it began holding ``floor`` bytes; the budget
        of the floor's source is ``budget`` (0: none), and a step at the
        smallest micro-batch needs ``need`` bytes above its floor."""
        if self.horizon is None or step < WARMUP or floor <= 0:
            return
        self._times.append(time.monotonic())
        for s in self._scales:
            s.add(step, floor)
        rising = [s for s in self._scales if s.last is not None]
        # the longest rising scale: the most steps behind its rate (a
        # growth that began late does not rise over the longer ones)
        self._rising = rising[-1] if rising else None
        self.trend = self._rising.last if rising else None
        self._episode(step, budget, need, bool(rising))

    def _episode(self, step: int, budget: int, need: int, rising: bool) -> None:
        """Once per episode: the first census when the trend rises, the
        forecast :data:`CENSUS_GAP` steps later (at once when the budget is
        nearer); the episode, and the census, forgotten after a window of
        steps without a rising trend."""
        self._quiet = 0 if rising else self._quiet + 1
        if self._quiet >= WINDOW:
            self.forecast, self._baseline = None, None
        if self.forecast is not None or not rising or not budget:
            return
        if self._baseline is None:
            self._baseline = _census(step)
        fields = self._fields(step, budget, need)
        if fields is not None and (fields["steps_left"] <= CENSUS_GAP
                                   or step - self._baseline.step >= CENSUS_GAP):
            self._fire(fields)

    def _fields(self, step: int, budget: int, need: int) -> dict[str, Any] | None:
        """The forecast's fields when the trend reaches the budget within
        the horizon."""
        rate, level, at = self.trend
        horizon = self.horizon_steps()
        level += rate * (step - at)
        left = max(0.0, (budget - need - level) / rate)
        if horizon is None or left > horizon:
            return None
        spe = self.steps_per_epoch
        return {"step": step, "level_bytes": int(level), "rate_bytes_per_step": rate,
                "rate_bytes_per_epoch": rate * spe if spe else None, "budget_bytes": budget,
                "need_bytes": need, "steps_left": int(left), "reach_step": step + int(left),
                "epochs_left": left / spe if spe else None,
                "seconds_left": left * self._step_seconds(), "since_step": self._since(),
                "horizon_steps": horizon}

    def _fire(self, fields: dict[str, Any]) -> None:
        """The forecast: the second census, the warning, the event."""
        after = _census(fields["step"])
        from memguard.telemetry.census import growing
        fields["growing"] = growing(self._baseline, after) if self._baseline else []
        fields["census_s"] = after.seconds + (self._baseline.seconds if self._baseline else 0)
        self.forecast = fields
        warnings.warn(ForecastWarning(message(fields)), stacklevel=user_stacklevel())
        if self._event is not None:
            self._event(Event.FORECAST, **fields)

    def _step_seconds(self) -> float:
        t = self._times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0

    def _since(self) -> int:
        """The first step of the window the trend was read from."""
        s = self._rising
        return int(s.points[0][0]) if s is not None and s.points else 0


def _census(step: int) -> Any:
    from memguard.telemetry.census import take
    return take(step)


def message(f: dict[str, Any]) -> str:
    """The forecast's warning, in words."""
    rate = f"{size(int(f['rate_bytes_per_step']))} a step"
    if f.get("rate_bytes_per_epoch"):
        rate += f" ({size(int(f['rate_bytes_per_epoch']))} an epoch)"
    when = f"in {f['steps_left']} steps (step {f['reach_step']}"
    if f.get("epochs_left") is not None:
        when += f", {f['epochs_left']:.1f} epochs"
    if f.get("seconds_left"):
        when += f", about {_duration(f['seconds_left'])}"
    grows = "; ".join(g["what"] for g in f.get("growing") or []) or \
        "nothing the census sees (memory outside Python's tensors and objects)"
    return (f"memguard: the memory held between steps grows by {rate}, from "
            f"{size(f['level_bytes'])} now; at this rate a step no longer fits the budget of "
            f"{size(f['budget_bytes'])} {when}). What grows: {grows}")


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    return f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"
