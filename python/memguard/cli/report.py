"""``memguard report``: one picture of a run from its JSONL telemetry.

::

    memguard report run.jsonl -o report.png     # the figure
    memguard report run.jsonl -o report.html    # the figure and a summary table, one file

The figure has one time axis, in seconds since the run's first record, and
three panels: memory against the budget (RSS, the arena's allocated and
reserved bytes when it served tensors, what the DataLoader workers (child
processes) held alone when there were any, and the baseline, what the run
held between steps, with each slow-growth forecast's trend extended to the
budget it reaches: :mod:`~memguard.cli.drift_view`), the pressure level, and
the micro-batch size of each :meth:`memguard.Guard.step`. Events are drawn
on all three: out-of-memory errors recovered, gc reliefs, checkpointing
switched on or off, CRITICAL with nothing left to shrink, the guard's
advice on the DataLoader workers and on a larger batch, forecasts, the size of
:meth:`memguard.Guard.infer`'s own plan changing (apart from the steps');
the steps' shrink and grow decisions are marked on the micro-batch panel;
any other event (a script's own, written with
:meth:`~memguard.telemetry.JsonlExporter.event`) is a labelled grey line. A run without a guard, or with fields its schema
version lacks, gives the panels it has data for.

The file is read once, streamed (:func:`~memguard.telemetry.exporters.iter_jsonl`):
the summary's figures are counted as the records go by, and each drawn line
keeps at most ``2 * POINTS`` points, its lowest and highest of each stretch
(:class:`_Series`), so memory does not grow with the run's length.

matplotlib is imported on first use, through its object API only: a report
never changes the pyplot backend of the process that asks for it.
"""
from __future__ import annotations

import argparse
import base64
import heapq
import html
import io
import math
import os
import sys
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any

from memguard._common import finite, size, unwritable
from memguard.cli import drift_view
from memguard.telemetry import Event, Level, Sample, SkippedLinesWarning
from memguard.telemetry.exporters import iter_jsonl

#: Output suffixes :func:`report` writes.
FORMATS = (".png", ".html")

# Events the panels show in their own way; the rest get a labelled grey line.
_PLOTTED = {e.value for e in (Event.STEP, Event.INSTALL, Event.OOM_RECOVERED, Event.OOM_GAVE_UP,
                              Event.RELIEVE, Event.CHECKPOINT, Event.CRITICAL)}
_MAX_LABELS = 40          # labelled lines of other events, so a chatty run stays readable
_MAX_FORECASTS = 8        # forecasts kept and drawn, the last ones (one per growth episode)
#: Points kept of each line the figure draws: at most twice this many, so a
#: week of samples is drawn in the memory and time of an hour (see _Series).
POINTS = 2000
_LEVEL_COLOURS = ("#d9f0d3", "#fff3bf", "#ffd8a8", "#ffc9c9")   # OK .. CRITICAL


@dataclass(frozen=True)
class RunSummary:
    """What a run did, from its telemetry.

    Attributes:
        path: the telemetry file.
        duration_s: first to last record.
        samples: telemetry samples.
        steps: guard steps (``step`` events).
        micro_batch_changes: steps that ran at another micro-batch size
            than the step before.
        shrinks, grows: steps whose planner decision was to shrink or grow.
        ooms_recovered: out-of-memory errors a step recovered from.
        ooms_gave_up: steps that ran out of memory at every size.
        gc_reliefs: memory releases by the gc hooks.
        checkpoint_changes: times checkpointing was switched on or off for
            some blocks; ``max_checkpointed_blocks`` the most at once.
        peak_rss_bytes: the highest sampled RSS.
        peak_arena_allocated_bytes: the highest sampled arena allocation.
        peak_step_bytes: the highest peak of a step (arena, CUDA or RSS).
        budget_bytes: the last budget the samples were compared with.
        arena_budget_bytes: the arena's last budget, when it served tensors.
        max_level: the highest pressure level sampled.
        high_s: time spent at HIGH or above.
        peak_workers: the most DataLoader workers (child processes) sampled.
        peak_workers_bytes: the most they held alone, sampled.
        workers_advice: the guard's advice on them (its ``workers`` event),
            in words; ``None`` where it gave none.
        forecasts: ``forecast`` events: a slow growth of the memory held
            between steps that reaches the budget within the horizon.
        forecast: the last of them (its growing groups cut to
            :data:`~memguard.cli.drift_view.GROWING_KEPT`); ``None`` without one.
        headroom: the last ``headroom`` event (the whole batch peaked well
            below the budget); ``None`` without one.
    """

    path: str
    duration_s: float
    samples: int
    steps: int
    micro_batch_changes: int
    shrinks: int
    grows: int
    ooms_recovered: int
    ooms_gave_up: int
    gc_reliefs: int
    checkpoint_changes: int
    max_checkpointed_blocks: int
    peak_rss_bytes: int | None
    peak_arena_allocated_bytes: int | None
    peak_step_bytes: int | None
    budget_bytes: int | None
    arena_budget_bytes: int | None
    max_level: Level | None
    high_s: float
    peak_workers: int | None = None
    peak_workers_bytes: int | None = None
    workers_advice: str | None = None
    forecasts: int = 0
    forecast: dict | None = None
    headroom: dict | None = None

    def rows(self) -> list[tuple[str, str]]:
        """(name, value) pairs for a table, sizes with their exact bytes."""
        def sz(n: int | None) -> str:
            return "-" if n is None else f"{size(n)} ({n:,} bytes)"

        return [
            ("duration", f"{self.duration_s:.1f} s"),
            ("samples", str(self.samples)),
            ("steps", str(self.steps)),
            ("micro-batch changes", str(self.micro_batch_changes)),
            ("shrinks / grows", f"{self.shrinks} / {self.grows}"),
            ("OOMs recovered", str(self.ooms_recovered)),
            ("OOMs given up", str(self.ooms_gave_up)),
            ("gc reliefs", str(self.gc_reliefs)),
            ("checkpointing changes",
             f"{self.checkpoint_changes} (at most {self.max_checkpointed_blocks} blocks)"),
            ("peak RSS (sampled)", sz(self.peak_rss_bytes)),
            ("peak arena allocated", sz(self.peak_arena_allocated_bytes)),
            ("peak step memory", sz(self.peak_step_bytes)),
            ("budget", "none" if self.budget_bytes is None else sz(self.budget_bytes)),
            ("arena budget", sz(self.arena_budget_bytes)),
            ("highest pressure level", "-" if self.max_level is None else self.max_level.name),
            ("time at HIGH or above", f"{self.high_s:.1f} s"),
            ("DataLoader workers (child processes)",
             "-" if self.peak_workers is None else
             f"at most {self.peak_workers}, holding at most {sz(self.peak_workers_bytes)}"),
            ("advice on the workers", self.workers_advice or "none"),
            *drift_view.rows(self.forecast, self.forecasts, self.headroom),
        ]


class _Series:
    """One line of the figure in at most ``2 * POINTS`` points.

    Points come in one at a time; while there are at most :data:`POINTS`
    every one is kept. Past that, consecutive points share buckets (two
    neighbours merge whenever the buckets outnumber :data:`POINTS`) and a
    bucket keeps its lowest and its highest point: min/max decimation, so a
    peak or a dip of one sample stays on the figure. ``NaN`` (a missing
    value) gives way to any real value in its bucket.
    """

    def __init__(self) -> None:
        self._buckets: list[list[tuple[int, float, float]]] = []   # [lowest, highest]
        self._stride = 1       # points a full bucket stands for
        self._fill = 1         # points the last bucket stands for
        self._n = 0

    def __len__(self) -> int:
        """The points added."""
        return self._n

    def add(self, x: float, y: float) -> None:
        """Append the point ``(x, y)``."""
        p = (self._n, x, y)
        self._n += 1
        if self._fill < self._stride:
            b = self._buckets[-1]
            b[0], b[1] = _lower(b[0], p), _higher(b[1], p)
            self._fill += 1
            return
        self._buckets.append([p, p])
        self._fill = 1
        if len(self._buckets) > POINTS:
            self._halve()

    def _halve(self) -> None:
        b = self._buckets
        merged = [[_lower(a[0], c[0]), _higher(a[1], c[1])] for a, c in zip(b[::2], b[1::2])]
        if len(b) % 2:
            merged.append(b[-1])
        else:
            self._fill += self._stride
        self._buckets = merged
        self._stride *= 2

    def points(self) -> tuple[list[float], list[float]]:
        """The kept points' x and y, in the order they came."""
        kept = [p for lo, hi in self._buckets for p in ((lo,) if lo is hi else sorted((lo, hi)))]
        return [x for _, x, _ in kept], [y for _, _, y in kept]


def _lower(p: tuple[int, float, float], q: tuple[int, float, float]) -> tuple[int, float, float]:
    """The lower of two points, ``p`` the earlier: a real value before NaN, ``p`` on a tie."""
    return q if not math.isnan(q[2]) and (math.isnan(p[2]) or q[2] < p[2]) else p


def _higher(p: tuple[int, float, float], q: tuple[int, float, float]) -> tuple[int, float, float]:
    """The higher of two points, as :func:`_lower`."""
    return q if not math.isnan(q[2]) and (math.isnan(p[2]) or q[2] > p[2]) else p


def _bigger(a: float | None, b: float | None) -> float | None:
    """The larger of two values, either of which may be missing."""
    return b if a is None or (b is not None and b > a) else a


def _value(v: float | None) -> float:
    """A value to draw: NaN (a gap) where it is missing."""
    return math.nan if v is None else float(v)


# the memory and level lines drawn from the samples: the value a sample gives each
_DRAWN = {
    "rss_bytes": lambda s: _value(s.rss_bytes),
    "arena_allocated_bytes": lambda s: _value(s.arena_allocated_bytes),
    "arena_reserved_bytes": lambda s: _value(s.arena_reserved_bytes),
    "children_bytes": lambda s: _value(s.children_bytes),
    "budget_bytes": lambda s: _value(s.budget_bytes or None),
    "arena_budget_bytes": lambda s: _value(s.arena_budget_bytes),
    "raw_level": lambda s: float(int(s.raw_level)),
    "level": lambda s: float(int(s.level)),
}


class _Run:
    """What a report counts and draws, folded one record at a time, in
    memory bounded by :data:`POINTS` whatever the run's length."""

    def __init__(self) -> None:
        self.meta: dict[str, Any] = {}
        self.t_lo, self.t_hi = math.inf, -math.inf       # every record's time
        self.event_t_lo = math.inf
        self.first_sample_t: float | None = None
        self._sample_state()
        self._event_state()

    def _sample_state(self) -> None:
        self.samples = 0
        self.high_s = 0.0
        self._prev: tuple[float, Level] | None = None    # the last sample's (t, level)
        self.peak_rss = self.peak_arena = self.max_level = None
        self.peak_workers = self.peak_workers_bytes = None
        self.budget = self.arena_budget = self.arena_budget_max = None   # last truthy; max
        self.top = 0                  # the largest RSS or arena reserved
        self.arena_budget_apart = False
        self._arena_alone: set[int] = set()  # arena budgets of samples without a budget (2 at most)
        self.lines = {name: _Series() for name in _DRAWN}

    def _event_state(self) -> None:
        self.counts = dict.fromkeys((Event.OOM_RECOVERED.value, Event.OOM_GAVE_UP.value,
                                     Event.RELIEVE.value), 0)
        self.install_budget: int | None = None
        self.workers_advice: str | None = None
        self.steps = self.micro_batch_changes = self.shrinks = self.grows = 0
        self._micro: float | None = None
        self.peak_step: int | None = None
        self.checkpoints, self.max_blocks = 0, None
        # the micro-batch panel: steps with a micro-batch size, decisions, step peaks
        self.micro_line, self.step_peaks = _Series(), _Series()
        self.marks = {"shrink": _Series(), "grow": _Series()}
        self.top_peak = 0.0
        self._prev_step_t: float | None = None
        self.event_lines: dict[str, _Series] = {}
        # a heap of (-t, -n, name): the earliest _MAX_LABELS other events, n their order
        self._labels: list[tuple[float, int, str]] = []
        self._others = 0
        # the drift: the steps' floors (the baseline), when each step ended
        # (the step clock that places a forecast's first step), the forecasts
        self.floor_line, self.step_clock = _Series(), _Series()
        self.top_floor = 0.0
        self.forecasts: deque[tuple[dict, drift_view.Trend | None]] = deque(maxlen=_MAX_FORECASTS)
        self.n_forecasts = 0
        self.headroom: dict | None = None

    def add(self, kind: str, rec: Any) -> None:
        """Fold one record of :func:`~memguard.telemetry.exporters.iter_jsonl`."""
        if kind == "meta":
            self.meta = rec
        elif kind == "sample":
            self._sample(rec)
        else:
            self._event(rec)

    def _time(self, t: float) -> None:
        self.t_lo, self.t_hi = min(self.t_lo, t), max(self.t_hi, t)

    def _sample(self, s: Sample) -> None:
        self.samples += 1
        self._time(s.t)
        if self.first_sample_t is None:
            self.first_sample_t = s.t
        if self._prev is not None and self._prev[1] >= Level.HIGH:
            self.high_s += max(s.t - self._prev[0], 0.0)
        self._prev = (s.t, s.level)
        self.peak_rss = _bigger(self.peak_rss, s.rss_bytes)
        self.peak_arena = _bigger(self.peak_arena, s.arena_allocated_bytes)
        self.max_level = _bigger(self.max_level, s.level)
        self.peak_workers = _bigger(self.peak_workers, s.children)
        self.peak_workers_bytes = _bigger(self.peak_workers_bytes, s.children_bytes)
        self.top = max(self.top, s.rss_bytes or 0, s.arena_reserved_bytes or 0,
                       s.children_bytes or 0)
        self.budget = s.budget_bytes or self.budget
        self.arena_budget = s.arena_budget_bytes or self.arena_budget
        self.arena_budget_max = _bigger(self.arena_budget_max, s.arena_budget_bytes)
        if s.arena_budget_bytes and s.budget_bytes:
            self.arena_budget_apart |= s.arena_budget_bytes != s.budget_bytes
        elif s.arena_budget_bytes and len(self._arena_alone) < 2:
            self._arena_alone.add(s.arena_budget_bytes)
        for name, value in _DRAWN.items():
            self.lines[name].add(s.t, value(s))

    def _event(self, e: dict) -> None:
        t, name = e["t"], e["event"]
        self._time(t)
        self.event_t_lo = min(self.event_t_lo, t)
        if name in self.counts:
            self.counts[name] += 1
        elif name == Event.INSTALL and self.install_budget is None and \
                finite(e.get("budget_bytes")):
            self.install_budget = int(e["budget_bytes"])
        elif name == Event.STEP:
            self._step(e)
        elif name == Event.WORKERS and self.workers_advice is None:
            self.workers_advice = _advice(e)
        elif name == Event.CHECKPOINT:
            self.checkpoints += 1
            self.max_blocks = _bigger(self.max_blocks, finite(e.get("blocks")))
        elif name == Event.FORECAST:
            self._forecast(e)
        elif name == Event.HEADROOM:
            self.headroom = e
        kind = _line_kind(e)
        if kind is not None:
            self.event_lines.setdefault(kind, _Series()).add(t, 0.0)
        if kind == "other":
            self._others += 1
            heapq.heappush(self._labels, (-t, -self._others, name))
            if len(self._labels) > _MAX_LABELS:
                heapq.heappop(self._labels)

    def _step(self, e: dict) -> None:
        self.steps += 1
        self._drift_step(e)
        micro = finite(e.get("micro_batch"))
        if micro is not None:
            if self._micro is not None and micro != self._micro:
                self.micro_batch_changes += 1
            self._micro = micro
        action = e.get("action")
        self.shrinks += action == "shrink"
        self.grows += action == "grow"
        if finite(e.get("peak_bytes")) is not None:
            self.peak_step = _bigger(self.peak_step, int(e["peak_bytes"]))
        if not micro:               # drawn only with a size
            return
        t = e["t"]
        # a decision is marked where the new size starts: the end of the step before
        if action in self.marks:
            self.marks[action].add(t if self._prev_step_t is None else self._prev_step_t,
                                   e["micro_batch"])
        self._prev_step_t = t
        self.micro_line.add(t, e["micro_batch"])
        peak = finite(e.get("peak_bytes"))
        if peak:
            self.step_peaks.add(t, peak)
            self.top_peak = max(self.top_peak, peak)

    def _drift_step(self, e: dict) -> None:
        """A step's floor on the baseline, its end on the step clock."""
        floor, step = finite(e.get("floor_bytes")), finite(e.get("step"))
        if floor is not None:
            self.floor_line.add(e["t"], floor)
            self.top_floor = max(self.top_floor, floor)
        if step is not None:
            self.step_clock.add(e["t"], step)

    def _forecast(self, e: dict) -> None:
        """Keep a forecast with its trend, placed in time by the steps seen so far."""
        self.n_forecasts += 1
        ts, steps = self.step_clock.points()
        t_since = drift_view.step_time(ts, steps, finite(e.get("since_step")))
        self.forecasts.append((drift_view.compact(e), drift_view.trend(e, t_since)))

    def trends(self) -> list[drift_view.Trend]:
        """The kept forecasts' trend lines."""
        return [tr for _, tr in self.forecasts if tr is not None]

    def labels(self) -> list[tuple[float, str]]:
        """The earliest :data:`_MAX_LABELS` events without their own line style, in time order."""
        return [(-t, name) for t, _, name in sorted(self._labels, key=lambda x: (-x[0], -x[1]))]

    def budget_bytes(self) -> int | None:
        """The last budget a sample was compared with; else the install event's; else the header's."""
        if self.budget:
            return self.budget
        if self.install_budget is not None:
            return self.install_budget
        b = finite(self.meta.get("budget_bytes"))
        return int(b) if b else None

    def arena_budget_drawn(self, budget: int | None) -> bool:
        """Whether the arena's budget differs from the one samples compare RSS with."""
        return self.arena_budget_apart or len(self._arena_alone) > 1 or \
            any(a != budget for a in self._arena_alone)

    def summary(self, path: str | os.PathLike) -> RunSummary:
        """The run's counters."""
        return RunSummary(
            path=os.fspath(path),
            duration_s=self.t_hi - self.t_lo if self.t_hi >= self.t_lo else 0.0,
            samples=self.samples,
            steps=self.steps,
            micro_batch_changes=self.micro_batch_changes,
            shrinks=self.shrinks,
            grows=self.grows,
            ooms_recovered=self.counts[Event.OOM_RECOVERED.value],
            ooms_gave_up=self.counts[Event.OOM_GAVE_UP.value],
            gc_reliefs=self.counts[Event.RELIEVE.value],
            checkpoint_changes=self.checkpoints,
            max_checkpointed_blocks=int(self.max_blocks or 0),
            peak_rss_bytes=self.peak_rss,
            peak_arena_allocated_bytes=self.peak_arena,
            peak_step_bytes=self.peak_step,
            budget_bytes=self.budget_bytes(),
            arena_budget_bytes=self.arena_budget,
            max_level=self.max_level,
            high_s=self.high_s,
            peak_workers=self.peak_workers,
            peak_workers_bytes=self.peak_workers_bytes,
            workers_advice=self.workers_advice,
            forecasts=self.n_forecasts,
            forecast=self.forecasts[-1][0] if self.forecasts else None,
            headroom=self.headroom,
        )


def _advice(e: dict) -> str:
    """A ``workers`` event in words: the workers, their memory, and what a
    lower ``num_workers`` would give back."""
    n, held = finite(e.get("workers")), finite(e.get("workers_bytes"))
    if n is None or held is None:
        return "given (no figures)"
    fewer = [f"num_workers={int(g['num_workers'])}: {size(g['bytes'])}"
             for g in e.get("give_back") or () if isinstance(g, dict)
             and finite(g.get("num_workers")) is not None and finite(g.get("bytes")) is not None]
    return (f"step {e.get('step')}: {int(n)} workers held {size(int(held))}"
            + (f"; would give back {', '.join(fewer)}" if fewer else ""))


def scan(path: str | os.PathLike) -> _Run:
    """Read a telemetry file once, start to end, every failure as a ``ValueError`` naming it.

    Raises:
        ValueError: the file is missing, unreadable, not JSON lines, or not
            memguard telemetry.
    """
    p = os.fspath(path)
    run = _Run()
    try:
        for kind, rec in iter_jsonl(p):
            run.add(kind, rec)
    except OSError as exc:
        raise ValueError(f"cannot read telemetry file {p!r}: {exc.strerror or exc}") from exc
    return run


# -- the figure ------------------------------------------------------------------
# (label, colour, line style, width) of the event lines drawn across every panel
_LINES = {
    Event.OOM_RECOVERED.value: ("OOM recovered", "#e03131", "-", 1.6),
    Event.OOM_GAVE_UP.value: ("OOM, gave up", "black", "-", 2.2),
    Event.RELIEVE.value: ("gc relief", "#1098ad", ":", 1.4),
    "checkpoint_on": ("checkpointing on (more blocks)", "#7048e8", "--", 1.4),
    "checkpoint_off": ("checkpointing off (fewer blocks)", "#b197fc", "--", 1.4),
    Event.CRITICAL.value: ("CRITICAL, nothing left to shrink", "#862e9c", "-.", 1.4),
    Event.INFER_PLAN.value: ("inference resized (Guard.infer)", "#f76707", "--", 1.0),
    Event.WORKERS.value: ("advice: fewer DataLoader workers", "#5c940d", "-.", 1.4),
    Event.FORECAST.value: ("forecast: slow growth reaches the budget", "#f783ac", "-.", 1.2),
    Event.HEADROOM.value: ("advice: a larger batch fits", "#2b8a3e", ":", 1.4),
    "other": ("other event", "#868e96", "-", 0.8),
}


def _line_kind(e: dict) -> str | None:
    name = e.get("event")
    if name == Event.CHECKPOINT:
        return "checkpoint_off" if e.get("reason") == "calm" else "checkpoint_on"
    if name in _LINES:
        return name
    return None if name in _PLOTTED else "other"


def _figure(title: str, run: _Run, summary: RunSummary) -> Any:
    """The report's matplotlib Figure (Agg canvas, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    starts = [t for t in (run.first_sample_t, run.event_t_lo) if t is not None and t < math.inf]
    t0 = min(starts) if starts else (finite(run.meta.get("t")) or 0.0)
    fig = Figure(figsize=(12, 9), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    has_steps = len(run.micro_line) > 0
    # the micro-batch panel only for a run with a guard
    ratios = [3, 1.3, 1.7] if has_steps else [3, 1.3]
    axes = list(fig.subplots(len(ratios), 1, sharex=True,
                             gridspec_kw={"height_ratios": ratios}))
    sub = ", ".join(f"{k} {run.meta[k]}" for k in ("host", "demo", "pid") if run.meta.get(k))
    fig.suptitle(f"memguard run: {os.path.basename(summary.path) or title}"
                 + (f"\n{sub}" if sub else ""), fontsize=13)
    left, right = min(run.t_lo - t0, 0.0), run.t_hi - t0
    end = drift_view.x_end(run.trends(), t0, left, right)
    _memory_panel(axes[0], run, summary.budget_bytes, t0, end)
    _level_panel(axes[1], run, t0)
    handles: dict[str, Any] = {}
    if has_steps:
        _micro_panel(axes[2], run, t0, handles)
    else:
        axes[1].set_title("no step events: the run had no memguard.Guard", loc="right",
                          fontsize=9, color="#868e96")
    axes[-1].set_xlabel("time since start (s)")
    _event_lines(axes, run, t0, handles)
    if run.t_hi >= run.t_lo:
        axes[-1].set_xlim(left, end + 1e-3)
    order = ["oom_recovered", "oom_gave_up", "shrink", "grow", "infer_plan", "workers", "headroom",
             "forecast", "relieve", "checkpoint_on", "checkpoint_off", "critical", "other"]
    shown = [handles[k] for k in order if k in handles]
    if shown:
        fig.legend(handles=shown, loc="outside lower center", ncols=min(len(shown), 5),
                   fontsize=9, title="events", title_fontsize=9)
    return fig


def _memory_panel(ax: Any, run: _Run, budget: int | None, t0: float, end: float) -> None:
    """Memory against the budget: RSS, the arena, the budgets, the step peaks,
    the baseline and the forecasts' trends (up to ``end``)."""
    trends = run.trends()
    top = max(run.top, budget or 0, run.arena_budget_max or 0, run.top_peak, run.top_floor,
              *(ys[-1] for _, ys in trends))
    unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)

    def line(name: str) -> tuple[list[float], list[float]]:
        xs, ys = run.lines[name].points()
        return [x - t0 for x in xs], [y / scale for y in ys]

    drawn = False
    for field, label, colour, style in (
            ("rss_bytes", "RSS", "#1c7ed6", "-"),
            ("arena_allocated_bytes", "arena allocated", "#f08c00", "-"),
            ("arena_reserved_bytes", "arena reserved", "#f08c00", ":"),
            ("children_bytes", "DataLoader workers (child processes)", "#5c940d", "-")):
        xs, ys = line(field)
        if any(not math.isnan(y) and (y or field != "children_bytes") for y in ys):
            ax.plot(xs, ys, style, color=colour, lw=1.6, label=label)
            drawn = True
    if run.budget:
        ax.plot(*line("budget_bytes"), "--", color="black", lw=1.4, drawstyle="steps-post",
                label="budget")
    elif budget:
        ax.axhline(budget / scale, ls="--", color="black", lw=1.4, label="budget")
    # the arena's own budget, where it is not the one the samples compare RSS with
    if run.arena_budget_drawn(budget):
        ax.plot(*line("arena_budget_bytes"), "-.", color="#f08c00", lw=1.2,
                drawstyle="steps-post", label="arena budget")
    xs, ys = run.step_peaks.points()
    if xs:
        ax.plot([x - t0 for x in xs], [y / scale for y in ys], "o", ms=3.5, color="#495057",
                label="step peak")
        drawn = True
    drawn |= drift_view.draw(ax, run.floor_line.points(), trends, t0, scale, end)
    if not drawn:
        ax.text(0.5, 0.5, "no memory samples in this file", transform=ax.transAxes,
                ha="center", va="center", color="#868e96")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(bottom=0)
    _zoom_to_trends(ax, run, trends, top, scale)
    ax.set_title("memory against the budget", loc="left", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=9, framealpha=0.9)


def _zoom_to_trends(ax: Any, run: _Run, trends: list, top: float, scale: float) -> None:
    """A forecast whose budget (the arena's, the device's) is a small part
    of the panel's height would be a flat line at its bottom: the panel is
    cut at a quarter above the trend's budget and what it held, and the
    cut said."""
    near = max([run.top_floor, run.top_peak, *(ys[-1] for _, ys in trends)], default=0)
    if not trends or near * 4 > top:
        return
    ax.set_ylim(0, near * 1.25 / scale)
    ax.text(0.01, 0.98, f"cut at {size(int(near * 1.25))} to show the forecast (the panel "
            f"goes to {size(int(top))})", transform=ax.transAxes, va="top", fontsize=8,
            color="#868e96")


def _level_panel(ax: Any, run: _Run, t0: float) -> None:
    """The pressure level, raw and with hysteresis, over coloured bands."""
    for lv, colour in zip(Level, _LEVEL_COLOURS):
        ax.axhspan(lv - 0.5, lv + 0.5, color=colour, lw=0)
    if run.samples:
        for name, colour, lw, alpha, label in (
                ("raw_level", "#868e96", 0.8, 0.8, "raw level (this sample)"),
                ("level", "#c92a2a", 2, None, "level (with hysteresis)")):
            xs, ys = run.lines[name].points()
            ax.plot([x - t0 for x in xs], ys, color=colour, lw=lw, drawstyle="steps-post",
                    alpha=alpha, label=label)
        ax.legend(loc="best", fontsize=8, framealpha=0.9)
    else:
        ax.text(0.5, 0.5, "no samples", transform=ax.transAxes, ha="center",
                va="center", color="#868e96")
    ax.set_yticks([int(lv) for lv in Level], [lv.name for lv in Level])
    ax.set_ylim(-0.5, 3.5)
    ax.set_ylabel("pressure level")


def _micro_panel(ax: Any, run: _Run, t0: float, handles: dict[str, Any]) -> None:
    """The micro-batch size of each step, with the shrink and grow decisions."""
    from matplotlib.ticker import MaxNLocator

    xs, ys = run.micro_line.points()
    ax.plot([x - t0 for x in xs], ys, "-o", color="#1c7ed6", ms=2.5, lw=1.4,
            drawstyle="steps-pre", label="micro-batch size of the step")
    for action, marker, colour in (("shrink", "v", "#f76707"), ("grow", "^", "#2f9e44")):
        mx, my = run.marks[action].points()
        if mx:
            handles[action] = ax.plot([x - t0 for x in mx], my, marker, color=colour, ms=9,
                                      ls="none", label=action)[0]
    ax.set_ylim(0, max(ys) * 1.15)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc="best", fontsize=8, framealpha=0.9)
    ax.set_ylabel("micro-batch (samples)")
    ax.grid(alpha=0.3)


def _event_lines(axes: list[Any], run: _Run, t0: float, handles: dict[str, Any]) -> None:
    """Each event as a vertical line across every panel, one collection per kind;
    other events labelled (the first :data:`_MAX_LABELS`)."""
    from matplotlib.collections import LineCollection
    from matplotlib.lines import Line2D

    for kind, series in run.event_lines.items():
        label, colour, style, width = _LINES[kind]
        xs = [x - t0 for x in series.points()[0]]
        for ax in axes:
            ax.add_collection(LineCollection([[(x, 0), (x, 1)] for x in xs], colors=colour,
                                             linestyles=style, linewidths=width, alpha=0.85,
                                             transform=ax.get_xaxis_transform()),
                              autolim=False)
        # reliefs also get a marker on top: one often shares its time with an OOM's line
        marker = "v" if kind == "relieve" else "none"
        if kind == "relieve":
            axes[0].plot(xs, [1.0] * len(xs), marker, ls="none", color=colour, ms=7,
                         clip_on=False, transform=axes[0].get_xaxis_transform())
        handles[kind] = Line2D([], [], color=colour, ls=style, lw=width, marker=marker,
                               label=label)
    last_label = -math.inf
    width_s = max(run.t_hi - t0, 1e-9)
    for t, name in run.labels():
        x = t - t0
        # labels of close events are staggered so they do not overprint
        y = 0.98 if x - last_label > 0.02 * width_s else 0.7
        last_label = x if y == 0.98 else last_label
        axes[0].text(x, y, f"{name} ", transform=axes[0].get_xaxis_transform(), rotation=90,
                     va="top", ha="right", fontsize=7, color="#495057")


def _html(summary: RunSummary, png: bytes) -> str:
    name = html.escape(os.path.basename(summary.path))
    rows = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                     for k, v in summary.rows())
    data = base64.b64encode(png).decode("ascii")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>memguard report: {name}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; color: #212529; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
th, td {{ border: 1px solid #ced4da; padding: 0.3em 0.8em; text-align: left; }}
th {{ background: #f1f3f5; font-weight: normal; }}
img {{ max-width: 100%; }}
</style>
</head>
<body>
<h1>memguard report: {name}</h1>
<table class="summary">
{rows}
</table>
{drift_view.growing_html(summary.forecast)}<img alt="memory, pressure level and micro-batch size of {name} over time"
     src="data:image/png;base64,{data}">
</body>
</html>
"""


def report(path: str | os.PathLike, out: str | os.PathLike) -> RunSummary:
    """Draw the report of a telemetry file.

    Args:
        path: a JSONL file written by :class:`memguard.telemetry.JsonlExporter`
            (``Guard(telemetry="run.jsonl")``, ``Sampler(export=...)``,
            ``memguard watch --export``, ``memguard demo``).
        out: ``.png`` for the figure, ``.html`` for a self-contained page with
            the figure and the summary table.

    Returns:
        The run's :class:`RunSummary`.

    Raises:
        ValueError: an unknown output suffix, or a telemetry file that is
            missing, unreadable or not memguard telemetry (named).
    """
    o = os.fspath(out)
    ext = os.path.splitext(o)[1].lower()
    if ext not in FORMATS:
        raise ValueError(f"report output {o!r} must end in {' or '.join(FORMATS)}")
    run = scan(path)
    summary = run.summary(path)
    fig = _figure(os.fspath(path), run, summary)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    png = buf.getvalue()
    try:
        if ext == ".png":
            with open(o, "wb") as f:
                f.write(png)
        else:
            with open(o, "w", encoding="utf-8") as f:
                f.write(_html(summary, png))
    except OSError as exc:
        raise ValueError(f"cannot write report {o!r}: {unwritable(exc, o)}") from exc
    return summary


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``memguard report`` to the command's parser."""
    rp = sub.add_parser("report", help="draw a run's telemetry (.jsonl) as a .png or .html report")
    rp.add_argument("telemetry", help="a JSONL telemetry file (Guard(telemetry=...), demo, watch)")
    rp.add_argument("-o", "--output", default=None,
                    help="report.png or report.html (default: the telemetry file's name, .png)")
    rp.set_defaults(fn=_command)


def _command(args: argparse.Namespace) -> int:
    """Write the report and say where (0)."""
    out = args.output or os.path.splitext(args.telemetry)[0] + ".png"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SkippedLinesWarning)
        summary = report(args.telemetry, out)
    for w in caught:
        print(f"memguard report: {w.message}", file=sys.stderr)
    print(f"report of {summary.steps} steps and {summary.samples} samples written to {out}")
    if summary.peak_workers:
        print(f"DataLoader workers (child processes): at most {summary.peak_workers}, "
              f"holding at most {size(summary.peak_workers_bytes)}")
    if summary.workers_advice:
        print(f"advice on the workers: {summary.workers_advice}")
    for name, text in drift_view.rows(summary.forecast, summary.forecasts, summary.headroom):
        print(f"{name}: {text}")
    return 0
