"""A run's drift as ``memguard report`` and ``memguard doctor`` show it.

Two events say it (:mod:`memguard.telemetry.events`): ``forecast``, a slow
growth of the memory held between steps that reaches the budget within a
horizon, with the census's largest growing groups; and ``headroom``, a
whole batch that peaks well below the budget. Here they become words (one
summary row each, the doctor's advice) and, on the report's memory panel,
lines: the baseline (each step's ``floor_bytes``, what the run held as the
step began) and each forecast's trend, from its first step through the
event to where it meets the budget it reaches.

Pure functions of the events' dicts; the report hands in its axes, so
matplotlib is never imported here.
"""
from __future__ import annotations

import html
from typing import Any

from memguard._common import MiB, finite, size

#: growing groups a summary row names
GROWING_SHOWN = 3
#: growing groups kept of each forecast (the report's page lists them)
GROWING_KEPT = 10
BASELINE_COLOUR = "#0b7285"
FORECAST_COLOUR = "#c2255c"

# (times, bytes) of a forecast's trend: its first step, the event, the reach
Trend = tuple[list[float], list[float]]


def duration(s: float) -> str:
    """Seconds as people read them: ``45 s``, ``12.5 min``, ``3.2 h``, ``2.1 days``."""
    for unit, n in (("days", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.1f} {unit}"
    return f"{s:.0f} s"


def _mib(n: float) -> str:
    """Bytes as MiB, to three figures below 100 MiB."""
    m = n / MiB
    return f"{m:,.0f}" if abs(m) >= 100 else f"{m:.3g}"


def _int(v: Any) -> str:
    """A count as ``1,524``; ``?`` where it is missing."""
    f = finite(v)
    return "?" if f is None else f"{int(f):,}"


def _dicts(v: Any) -> list[dict]:
    """The dicts of a list field (``growing``, ``queue``); none where it is not a list."""
    return [g for g in v if isinstance(g, dict)] if isinstance(v, list) else []


def _source(e: dict, missing: str) -> str:
    """What an event measured, as people write it: ``arena``, ``CUDA``, ``RSS``;
    ``missing`` where it does not say."""
    src = str(e.get("source") or missing)
    return {"rss": "RSS", "cuda": "CUDA"}.get(src, src)


def compact(e: dict) -> dict:
    """An event to keep: its fields, its growing groups cut to :data:`GROWING_KEPT`."""
    return {**e, "growing": _dicts(e.get("growing"))[:GROWING_KEPT]} if "growing" in e else e


def forecast_text(e: dict) -> str:
    """A ``forecast`` event's figures in words: the rate, since when, and what
    is left until the budget (steps, epochs where known, time)."""
    rates = [f"{_mib(r)} MiB/{per}" for r, per in ((finite(e.get("rate_bytes_per_step")), "step"),
                                                    (finite(e.get("rate_bytes_per_epoch")), "epoch"))
             if r is not None]
    left = [f"{_int(e.get('steps_left'))} steps"]
    if finite(e.get("epochs_left")) is not None:
        left.append(f"{e['epochs_left']:.1f} epochs")
    if finite(e.get("seconds_left")) is not None:
        left.append(duration(e["seconds_left"]))
    grows = rates[0] + (f" ({rates[1]})" if len(rates) > 1 else "") if rates else "at a rate"
    return (f"{_source(e, 'the')} memory held between steps grows {grows} since step "
            f"{_int(e.get('since_step'))}: {size(finite(e.get('level_bytes')))} at step "
            f"{_int(e.get('step'))}, reaching the budget of {size(finite(e.get('budget_bytes')))} "
            f"at step {_int(e.get('reach_step'))} ({', '.join(left)} left)")


def growing_text(e: dict, n: int = GROWING_SHOWN) -> str:
    """What the census found growing, the largest ``n`` groups, each with the
    bytes it added; ``""`` where it found none."""
    named = []
    for g in _dicts(e.get("growing"))[:n]:
        added = finite(g.get("added_bytes"))
        named.append(str(g.get("what") or "?") + (f" (+{size(added)})" if added else ""))
    return ", ".join(named)


def headroom_text(e: dict) -> str:
    """A ``headroom`` event in words: used/budget, the largest batch the peak
    model fits, and the batch/queue pairs where there are any."""
    peak, budget = finite(e.get("peak_bytes")), finite(e.get("budget_bytes"))
    parts = [_source(e, "")] if e.get("source") else []
    if peak is not None and budget:
        parts.append(f"{100 * peak / budget:.0f} %")
    used = f"{size(peak)}/{size(budget)}" + (f" ({', '.join(parts)})" if parts else "")
    capped = "; capped: not extrapolated further" if e.get("capped") else ""
    text = (f"step {_int(e.get('step'))}: the whole batch of {_int(e.get('batch'))} peaked at "
            f"{used}; the peak model "
            f"fits a batch of {_int(e.get('largest_batch'))} (predicted peak "
            f"{size(finite(e.get('predicted_peak_bytes')))}{capped})")
    pairs = [f"batch {_int(q.get('batch'))} with queue {_int(q.get('queue'))}"
             for q in _dicts(e.get("queue"))]
    return text + (f"; with a queue near the current one: {', '.join(pairs)}" if pairs else "")


def rows(forecast: dict | None, forecasts: int, headroom: dict | None) -> list[tuple[str, str]]:
    """The summary's rows of the drift: the last forecast (with what grows)
    and the headroom, each only where the run has one."""
    out = []
    if forecast is not None:
        grows = growing_text(forecast)
        out.append(("growth forecast", (f"the last of {forecasts}: " if forecasts > 1 else "")
                    + forecast_text(forecast) + (f"; what grows: {grows}" if grows else "")))
    if headroom is not None:
        out.append(("batch headroom", headroom_text(headroom)))
    return out


def growing_html(forecast: dict | None) -> str:
    """The report page's list of the last forecast's growing groups; ``""`` without one."""
    groups = _dicts((forecast or {}).get("growing"))
    if not groups:
        return ""
    cols = ("what", "kind", "count", "added", "per_step", "bytes", "added_bytes")
    head = "".join(f"<th>{c.replace('_', ' ')}</th>" for c in cols)
    body = "\n".join("<tr>" + "".join(f"<td>{html.escape(_cell(g.get(c), c))}</td>" for c in cols)
                     + "</tr>" for g in groups)
    return (f'<h2>what grows (the last forecast)</h2>\n<table class="growing">\n'
            f'<tr class="head">{head}</tr>\n{body}\n</table>\n')


def _cell(v: Any, col: str) -> str:
    """One figure of a growing group: sizes in bytes as people read them."""
    if v is None:
        return "-"
    return size(finite(v)) if col.endswith("bytes") else str(v)


def step_time(ts: list[float], steps: list[float], step: float | None) -> float | None:
    """When ``step`` ended, from the run's (time, step) points so far: the
    last stretch of steps that reaches it, interpolated between kept points;
    None where no step at or before it was seen."""
    if step is None:
        return None
    for i in range(len(steps) - 1, -1, -1):
        if steps[i] <= step:
            if steps[i] == step or i + 1 == len(steps) or steps[i + 1] <= steps[i]:
                return ts[i] if steps[i] == step else None
            frac = (step - steps[i]) / (steps[i + 1] - steps[i])
            return ts[i] + frac * (ts[i + 1] - ts[i])
    return None


def trend(e: dict, t_since: float | None) -> Trend | None:
    """A forecast's trend line: its value at ``since_step`` (at ``t_since``,
    when that step ended), at the event, and at the reach, where it meets
    ``budget_bytes``. Times not in the run come from the event's own
    seconds per step; None where its figures give no line."""
    t, step, since = finite(e.get("t")), finite(e.get("step")), finite(e.get("since_step"))
    level, rate = finite(e.get("level_bytes")), finite(e.get("rate_bytes_per_step"))
    budget, left = finite(e.get("budget_bytes")), finite(e.get("steps_left"))
    if None in (t, step, since, level, rate, budget) or rate <= 0 or since > step:
        return None
    left = (budget - level) / rate if left is None else left
    secs = finite(e.get("seconds_left"))
    per_step = secs / left if secs is not None and left > 0 else None
    if per_step is None and t_since is not None and step > since:
        per_step = (t - t_since) / (step - since)
    if per_step is None:
        return None
    t_since = t - (step - since) * per_step if t_since is None else t_since
    t_reach = t + (secs if secs is not None else left * per_step)
    return [t_since, t, t_reach], [level - rate * (step - since), level, budget]


def x_end(trends: list[Trend], t0: float, left: float, right: float) -> float:
    """The figure's right edge: the run's end, moved out to the furthest reach
    but by one run's length at most, so the run itself stays readable."""
    reach = max((xs[-1] - t0 for xs, _ in trends), default=right)
    return max(right, min(reach, right + max(right - left, 1.0)))


def draw(ax: Any, floor: tuple[list[float], list[float]], trends: list[Trend], t0: float,
         scale: float, end: float) -> bool:
    """The baseline and each forecast's trend on the memory panel, times from
    ``t0``, bytes in ``scale``; a reach past ``end`` is named at the edge.
    Returns whether anything was drawn."""
    xs, ys = floor
    if xs:
        ax.plot([x - t0 for x in xs], [y / scale for y in ys], "-", color=BASELINE_COLOUR,
                lw=1.4, label="baseline (held between steps)")
    for n, (tx, ty) in enumerate(trends):
        _draw_trend(ax, [x - t0 for x in tx], [y / scale for y in ty], end, first=n == 0)
    return bool(xs or trends)


def _draw_trend(ax: Any, x: list[float], y: list[float], end: float, first: bool) -> None:
    """One trend: measured (since the first step to the event), extended (to
    the reach), and the budget it reaches, marked where it is met."""
    def label(text: str) -> str:
        return text if first else "_nolegend_"

    ax.plot(x[:2], y[:2], "-", color=FORECAST_COLOUR, lw=1.8, label=label("growth trend"))
    ax.plot(x[1:], y[1:], "--", color=FORECAST_COLOUR, lw=1.4,
            label=label("trend extended to the budget"))
    ax.plot([x[0], x[2]], [y[2], y[2]], ":", color=FORECAST_COLOUR, lw=1.2,
            label=label("the budget it reaches"))
    if x[2] <= end:
        ax.plot(x[2], y[2], "X", color=FORECAST_COLOUR, ms=9, ls="none")
        return
    # past the edge: the line runs out there, and says where it is going
    y_end = y[1] + (y[2] - y[1]) * (end - x[1]) / (x[2] - x[1])
    ax.text(end, y_end, f"meets it {duration(x[2] - x[1])} after the forecast \u2192 ", ha="right",
            va="bottom", fontsize=8, color=FORECAST_COLOUR)
