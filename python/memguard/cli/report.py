"""``memguard report``: one picture of a run from its JSONL telemetry.

::

    memguard report run.jsonl -o report.png     # the figure
    memguard report run.jsonl -o report.html    # the figure and a summary table, one file

The figure has one time axis, in seconds since the run's first record, and
three panels: memory against the budget (RSS, and the arena's allocated and
reserved bytes when it served tensors), the pressure level, and the
micro-batch size of each :meth:`memguard.Guard.step`. Events are drawn on
all three: out-of-memory errors recovered, gc reliefs, checkpointing
switched on or off, CRITICAL with nothing left to shrink; shrink and grow
decisions are marked on the micro-batch panel; any other event (a script's
own, written with :meth:`~memguard.telemetry.JsonlExporter.event`) is a
labelled grey line. A run without a guard, or with fields its schema
version lacks, gives the panels it has data for.

matplotlib is imported on first use, through its object API only: a report
never changes the pyplot backend of the process that asks for it.
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from memguard._common import finite, size, unwritable
from memguard.telemetry import Event, Level, Sample, SkippedLinesWarning, read_jsonl

#: Output suffixes :func:`report` writes.
FORMATS = (".png", ".html")

# Events the panels show in their own way; the rest get a labelled grey line.
_PLOTTED = {e.value for e in (Event.STEP, Event.INSTALL, Event.OOM_RECOVERED, Event.OOM_GAVE_UP,
                              Event.RELIEVE, Event.CHECKPOINT, Event.CRITICAL)}
_MAX_LABELS = 40          # labelled lines of other events, so a chatty run stays readable
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
        ]


def load(path: str | os.PathLike) -> tuple[dict[str, Any], list[Sample], list[dict]]:
    """Read a telemetry file, every failure as a ``ValueError`` naming it.

    Returns:
        ``(meta, samples, events)`` as :func:`memguard.telemetry.read_jsonl`.

    Raises:
        ValueError: the file is missing, unreadable, not JSON lines, or not
            memguard telemetry.
    """
    p = os.fspath(path)
    try:
        return read_jsonl(p)
    except OSError as exc:
        raise ValueError(f"cannot read telemetry file {p!r}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{p!r} is not a text file: {exc.reason}") from exc


def _timed(events: list[dict]) -> list[dict]:
    """Events with a time, in time order."""
    return sorted((e for e in events if finite(e.get("t")) is not None), key=lambda e: e["t"])


def _budget(meta: dict[str, Any], samples: list[Sample], events: list[dict]) -> int | None:
    for s in reversed(samples):
        if s.budget_bytes:
            return s.budget_bytes
    for e in events:
        if e.get("event") == Event.INSTALL and finite(e.get("budget_bytes")):
            return int(e["budget_bytes"])
    b = finite(meta.get("budget_bytes"))
    return int(b) if b else None


def _max(values: Any) -> int | None:
    vs = [v for v in values if v is not None]
    return max(vs) if vs else None


def summarize(meta: dict[str, Any], samples: list[Sample], events: list[dict],
              path: str | os.PathLike = "") -> RunSummary:
    """The run's counters, from what :func:`load` returned."""
    timed = _timed(events)
    steps = [e for e in timed if e.get("event") == Event.STEP]
    micro = [finite(e.get("micro_batch")) for e in steps]
    micro = [m for m in micro if m is not None]
    times = [s.t for s in samples] + [e["t"] for e in timed]
    high_s = 0.0
    for a, b in zip(samples, samples[1:]):
        if a.level >= Level.HIGH:
            high_s += max(b.t - a.t, 0.0)
    blocks = [finite(e.get("blocks")) for e in timed if e.get("event") == Event.CHECKPOINT]

    def count(name: str) -> int:
        return sum(1 for e in events if e.get("event") == name)

    return RunSummary(
        path=os.fspath(path),
        duration_s=(max(times) - min(times)) if times else 0.0,
        samples=len(samples),
        steps=len(steps),
        micro_batch_changes=sum(1 for a, b in zip(micro, micro[1:]) if a != b),
        shrinks=sum(1 for e in steps if e.get("action") == "shrink"),
        grows=sum(1 for e in steps if e.get("action") == "grow"),
        ooms_recovered=count(Event.OOM_RECOVERED),
        ooms_gave_up=count(Event.OOM_GAVE_UP),
        gc_reliefs=count(Event.RELIEVE),
        checkpoint_changes=len(blocks),
        max_checkpointed_blocks=int(_max(blocks) or 0),
        peak_rss_bytes=_max(s.rss_bytes for s in samples),
        peak_arena_allocated_bytes=_max(s.arena_allocated_bytes for s in samples),
        peak_step_bytes=_max(int(e["peak_bytes"]) for e in steps
                             if finite(e.get("peak_bytes")) is not None),
        budget_bytes=_budget(meta, samples, events),
        arena_budget_bytes=next((s.arena_budget_bytes for s in reversed(samples)
                                 if s.arena_budget_bytes), None),
        max_level=max((s.level for s in samples), default=None),
        high_s=high_s,
    )


# -- the figure ------------------------------------------------------------------
# (label, colour, line style, width) of the event lines drawn across every panel
_LINES = {
    Event.OOM_RECOVERED.value: ("OOM recovered", "#e03131", "-", 1.6),
    Event.OOM_GAVE_UP.value: ("OOM, gave up", "black", "-", 2.2),
    Event.RELIEVE.value: ("gc relief", "#1098ad", ":", 1.4),
    "checkpoint_on": ("checkpointing on (more blocks)", "#7048e8", "--", 1.4),
    "checkpoint_off": ("checkpointing off (fewer blocks)", "#b197fc", "--", 1.4),
    Event.CRITICAL.value: ("CRITICAL, nothing left to shrink", "#862e9c", "-.", 1.4),
    "other": ("other event", "#868e96", "-", 0.8),
}


def _line_kind(e: dict) -> str | None:
    name = e.get("event")
    if name == Event.CHECKPOINT:
        return "checkpoint_off" if e.get("reason") == "calm" else "checkpoint_on"
    if name in _LINES:
        return name
    return None if name in _PLOTTED else "other"


def _figure(title: str, meta: dict[str, Any], samples: list[Sample], events: list[dict],
            summary: RunSummary) -> Any:
    """The report's matplotlib Figure (Agg canvas, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    timed = _timed(events)
    starts = [s.t for s in samples[:1]] + [e["t"] for e in timed[:1]]
    t0 = min(starts) if starts else (finite(meta.get("t")) or 0.0)
    ts = [s.t - t0 for s in samples]

    fig = Figure(figsize=(12, 9), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    steps = [e for e in timed if e.get("event") == Event.STEP and finite(e.get("micro_batch"))]
    # the micro-batch panel only for a run with a guard
    ratios = [3, 1.3, 1.7] if steps else [3, 1.3]
    axes = list(fig.subplots(len(ratios), 1, sharex=True,
                             gridspec_kw={"height_ratios": ratios}))
    ax_mem, ax_lvl = axes[:2]
    sub = ", ".join(f"{k} {meta[k]}" for k in ("host", "demo", "pid") if meta.get(k))
    fig.suptitle(f"memguard run: {os.path.basename(summary.path) or title}"
                 + (f"\n{sub}" if sub else ""), fontsize=13)

    # memory against the budget
    budget = summary.budget_bytes
    arena_budget = _max(s.arena_budget_bytes for s in samples)
    peaks = [(e["t"] - t0, finite(e.get("peak_bytes"))) for e in steps]
    peaks = [(t, p) for t, p in peaks if p]
    top = max([v or 0 for s in samples for v in (s.rss_bytes, s.arena_reserved_bytes)]
              + [budget or 0, arena_budget or 0] + [p for _, p in peaks] + [0])
    unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)

    def series(field: str) -> list[float]:
        out = []
        for s in samples:
            v = getattr(s, field)
            out.append(math.nan if v is None else v / scale)
        return out

    drawn_mem = False
    for field, label, colour, style in (
            ("rss_bytes", "RSS", "#1c7ed6", "-"),
            ("arena_allocated_bytes", "arena allocated", "#f08c00", "-"),
            ("arena_reserved_bytes", "arena reserved", "#f08c00", ":")):
        ys = series(field)
        if any(not math.isnan(y) for y in ys):
            ax_mem.plot(ts, ys, style, color=colour, lw=1.6, label=label)
            drawn_mem = True
    if any(s.budget_bytes for s in samples):
        ax_mem.plot(ts, [math.nan if not s.budget_bytes else s.budget_bytes / scale
                         for s in samples], "--", color="black", lw=1.4,
                    drawstyle="steps-post", label="budget")
    elif budget:
        ax_mem.axhline(budget / scale, ls="--", color="black", lw=1.4, label="budget")
    # the arena's own budget, where it is not the one the samples compare RSS with
    if any(s.arena_budget_bytes and s.arena_budget_bytes != (s.budget_bytes or budget)
           for s in samples):
        ax_mem.plot(ts, series("arena_budget_bytes"), "-.", color="#f08c00", lw=1.2,
                    drawstyle="steps-post", label="arena budget")
    if peaks:
        ax_mem.plot([t for t, _ in peaks], [p / scale for _, p in peaks], "o", ms=3.5,
                    color="#495057", label="step peak")
        drawn_mem = True
    if not drawn_mem:
        ax_mem.text(0.5, 0.5, "no memory samples in this file", transform=ax_mem.transAxes,
                    ha="center", va="center", color="#868e96")
    ax_mem.set_ylabel(f"memory ({unit})")
    ax_mem.set_ylim(bottom=0)
    ax_mem.set_title("memory against the budget", loc="left", fontsize=10)
    ax_mem.grid(alpha=0.3)
    if ax_mem.get_legend_handles_labels()[0]:
        ax_mem.legend(loc="best", fontsize=9, framealpha=0.9)

    # the pressure level
    for lv, colour in zip(Level, _LEVEL_COLOURS):
        ax_lvl.axhspan(lv - 0.5, lv + 0.5, color=colour, lw=0)
    if samples:
        ax_lvl.plot(ts, [int(s.raw_level) for s in samples], color="#868e96", lw=0.8,
                    drawstyle="steps-post", alpha=0.8, label="raw level (this sample)")
        ax_lvl.plot(ts, [int(s.level) for s in samples], color="#c92a2a", lw=2,
                    drawstyle="steps-post", label="level (with hysteresis)")
        ax_lvl.legend(loc="best", fontsize=8, framealpha=0.9)
    else:
        ax_lvl.text(0.5, 0.5, "no samples", transform=ax_lvl.transAxes, ha="center",
                    va="center", color="#868e96")
    ax_lvl.set_yticks([int(lv) for lv in Level], [lv.name for lv in Level])
    ax_lvl.set_ylim(-0.5, 3.5)
    ax_lvl.set_ylabel("pressure level")

    # the micro-batch size of each step
    handles: dict[str, Any] = {}
    if steps:
        ax_mb = axes[2]
        xs = [e["t"] - t0 for e in steps]
        ys = [e["micro_batch"] for e in steps]
        ax_mb.plot(xs, ys, "-o", color="#1c7ed6", ms=2.5, lw=1.4, drawstyle="steps-pre",
                   label="micro-batch size of the step")
        # a decision is marked where the new size starts: the end of the step before
        began = xs[:1] + xs[:-1]
        for action, marker, colour in (("shrink", "v", "#f76707"), ("grow", "^", "#2f9e44")):
            pts = [(x, y) for x, y, e in zip(began, ys, steps) if e.get("action") == action]
            if pts:
                handles[action] = ax_mb.plot(
                    [x for x, _ in pts], [y for _, y in pts], marker, color=colour, ms=9,
                    ls="none", label=action)[0]
        ax_mb.set_ylim(0, max(ys) * 1.15)
        ax_mb.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax_mb.legend(loc="best", fontsize=8, framealpha=0.9)
        ax_mb.set_ylabel("micro-batch (samples)")
        ax_mb.grid(alpha=0.3)
    else:
        ax_lvl.set_title("no step events: the run had no memguard.Guard", loc="right",
                         fontsize=9, color="#868e96")
    axes[-1].set_xlabel("time since start (s)")

    # events across every panel
    labelled = 0
    last_label = -math.inf
    width_s = max([e["t"] - t0 for e in timed] + ts + [1e-9])
    for e in timed:
        kind = _line_kind(e)
        if kind is None:
            continue
        label, colour, style, width = _LINES[kind]
        x = e["t"] - t0
        for ax in axes:
            ax.axvline(x, color=colour, ls=style, lw=width, alpha=0.85)
        # reliefs also get a marker on top: one often shares its time with an OOM's line
        marker = "v" if kind == "relieve" else "none"
        if kind == "relieve":
            ax_mem.plot([x], [1.0], marker, color=colour, ms=7, clip_on=False,
                        transform=ax_mem.get_xaxis_transform())
        handles.setdefault(kind, Line2D([], [], color=colour, ls=style, lw=width,
                                        marker=marker, label=label))
        if kind == "other" and labelled < _MAX_LABELS:
            labelled += 1
            # labels of close events are staggered so they do not overprint
            y = 0.98 if x - last_label > 0.02 * width_s else 0.7
            last_label = x if y == 0.98 else last_label
            ax_mem.text(x, y, f"{e.get('event')} ", transform=ax_mem.get_xaxis_transform(),
                        rotation=90, va="top", ha="right", fontsize=7, color="#495057")
    if timed or samples:
        ends = ts + [e["t"] - t0 for e in timed]
        axes[-1].set_xlim(min(ends + [0.0]), max(ends) + 1e-3 if ends else 1.0)
    order = ["oom_recovered", "oom_gave_up", "shrink", "grow", "relieve", "checkpoint_on",
             "checkpoint_off", "critical", "other"]
    shown = [handles[k] for k in order if k in handles]
    if shown:
        fig.legend(handles=shown, loc="outside lower center", ncols=min(len(shown), 5),
                   fontsize=9, title="events", title_fontsize=9)
    return fig


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
<img alt="memory, pressure level and micro-batch size of {name} over time"
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
    meta, samples, events = load(path)
    summary = summarize(meta, samples, events, path)
    fig = _figure(os.fspath(path), meta, samples, events, summary)
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
    return 0
