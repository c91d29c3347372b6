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
#: blocks come then); the process's footprint settles later (measured: a
#: ViT's RSS grew 0.48 MB a step over its first 36 steps, then 0.12 MB a
#: step for the next thousand, with the same leak)
WARMUP = 5
FOOTPRINT_WARMUP = 30

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


class _Series:
    """One quantity read at every step: its time scales and their trend."""

    def __init__(self) -> None:
        self.scales = [_Scale(b) for b in BLOCKS]
        self.rising: _Scale | None = None

    def add(self, step: int, value: int) -> None:
        for s in self.scales:
            s.add(step, value)
        rising = [s for s in self.scales if s.last is not None]
        # the longest rising scale: the most steps behind its rate (a
        # growth that began late does not rise over the longer ones)
        self.rising = rising[-1] if rising else None

    @property
    def trend(self) -> tuple[float, float, float] | None:
        """(rate per step, the trend's value, at the step), or ``None``."""
        return self.rising.last if self.rising is not None else None

    def since(self) -> int:
        """The first step of the window the trend was read from."""
        s = self.rising
        return int(s.points[0][0]) if s is not None and s.points else 0


class Drift:
    """The trends of what a guard holds between steps, and the forecast.

    Two quantities are followed: the floor of the peak's source (against
    the planner's budget for it) and the process's footprint (its RSS with
    its DataLoader workers', against the process's live budget), which
    also sees what the arena does not serve (NumPy arrays, Python objects).
    The forecast is the nearer of the two.

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
        self._series: dict[str, _Series] = {}
        self._times: collections.deque[float] = collections.deque(maxlen=WINDOW)
        #: the floor's trend (rate per step, level, at step), for metrics
        self.trend: tuple[float, float, float] | None = None
        #: the last forecast's event fields, until its episode ends
        self.forecast: dict[str, Any] | None = None
        self._quiet = 0                 # steps in a row without a rising trend
        self._baseline: Any = None      # the census taken when a trend first rose

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

    def observe(self, step: int, readings: list[tuple[str, int, int]], need: int) -> None:
        """A committed step. ``readings``: ``(source, bytes held as it
        began, the budget of that source)`` (the floor's first; a budget of
        0: none); a step at the smallest micro-batch needs ``need`` bytes
        above its floor."""
        if self.horizon is None or step < WARMUP:
            return
        self._times.append(time.monotonic())
        for source, value, _ in readings:
            if value > 0 and (source != "footprint" or step >= FOOTPRINT_WARMUP):
                self._series.setdefault(source, _Series()).add(step, value)
        first = self._series.get(readings[0][0]) if readings else None
        self.trend = first.trend if first is not None else None
        self._episode(step, readings, need)

    def _episode(self, step: int, readings: list[tuple[str, int, int]], need: int) -> None:
        """Once per episode: the first census when a trend rises, the
        forecast :data:`CENSUS_GAP` steps later (at once when the budget is
        nearer); the episode, and the census, forgotten after a window of
        steps without a rising trend."""
        rising = [(src, budget) for src, _, budget in readings
                  if src in self._series and self._series[src].trend is not None]
        self._quiet = 0 if rising else self._quiet + 1
        if self._quiet >= WINDOW:
            self.forecast, self._baseline = None, None
        if self.forecast is not None:
            self._refresh(step, readings, need)
            return
        if not rising:
            return
        if self._baseline is None:
            self._baseline = _census(step)
        due = [f for f in (self._fields(step, src, budget, need) for src, budget in rising if budget)
               if f is not None]
        if not due:
            return
        fields = min(due, key=lambda f: f["steps_left"])
        if fields["steps_left"] <= CENSUS_GAP or step - self._baseline.step >= CENSUS_GAP:
            self._fire(fields)

    def _refresh(self, step: int, readings: list[tuple[str, int, int]], need: int) -> None:
        """During an episode, the forecast's figures follow its trend
        (what :attr:`forecast` and the metrics say; the warning and the
        event stay the first reading's)."""
        f = self.forecast
        budget = next((b for src, _, b in readings if src == f["source"]), 0)
        if not budget or self._series[f["source"]].trend is None:
            return
        now = self._fields(step, f["source"], budget, need, horizon=False)
        f.update({k: v for k, v in now.items() if k not in ("since_step", "horizon_steps")})

    def _fields(self, step: int, source: str, budget: int, need: int,
                horizon: bool = True) -> dict[str, Any] | None:
        """The forecast's fields when the trend of ``source`` reaches its
        budget within the horizon (or anywhere: ``horizon`` False)."""
        series = self._series[source]
        rate, level, at = series.trend
        steps = self.horizon_steps()
        level += rate * (step - at)
        left = max(0.0, (budget - need - level) / rate)
        if horizon and (steps is None or left > steps):
            return None
        spe = self.steps_per_epoch
        return {"step": step, "source": source, "level_bytes": int(level),
                "rate_bytes_per_step": rate, "rate_bytes_per_epoch": rate * spe if spe else None,
                "budget_bytes": budget, "need_bytes": need, "steps_left": int(left),
                "reach_step": step + int(left), "epochs_left": left / spe if spe else None,
                "seconds_left": left * self._step_seconds(), "since_step": series.since(),
                "horizon_steps": steps}

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
