"""``memguard demo``: a training run whose memory runs short, without memguard
and with it.

Where it can set a memory limit (root and a cgroup memory controller: see
:mod:`memguard.memory.limits`), the demo trains the same ViT (:mod:`memguard.cli.workload`)
twice under one limit, one run after the other: the plain loop, then the
same loop through ``memguard.Guard(budget="auto")``. It creates no swap file:
on a machine without swap the kernel kills the plain loop once a step needs
more than the limit, while memguard's run finishes every step at the same
effective batch; where the machine swaps, the plain loop swaps (it is
stopped after ``--plain-seconds``). Elsewhere, or with ``--budget-only``,
memguard's run alone trains under a budget of its own, and the process
stays within it.

Each run writes its samples and steps to a JSONL file in ``--out``; the demo
draws them side by side (``demo-report.png``): memory against the limit or
budget over time, and the samples trained. ``memguard report`` draws either
run on its own.

    memguard demo [--out DIR] [--limit SIZE] [--steps N] [--budget-only]
"""
from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from memguard._common import MiB
from memguard.cli import workload
from memguard.memory import limits
from memguard.telemetry.budget import parse_budget

#: the demo's workload: a ViT on 112 px images, batch 64; its plain loop
#: peaks near 2.4 GB, memguard's whole batch near 1.6 GB of RSS
MODEL = workload.Model(img=112, batch=64)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``memguard demo`` to the command's parser."""
    p = sub.add_parser("demo", help="training under a memory limit, without memguard and with it",
                       description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out", help="directory for the telemetry and the report")
    p.add_argument("--limit", default="1000MiB",
                   help="the memory limit (or, budget-only, memguard's budget) (=1000MiB)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (=10)")
    p.add_argument("--plain-seconds", type=float, default=90,
                   help="stop the plain loop after this long (=90)")
    p.add_argument("--budget-only", action="store_true",
                   help="memguard's run alone, under a budget: no cgroup")
    p.set_defaults(fn=_command, parser=p)


def _checked(a: argparse.Namespace) -> argparse.Namespace:
    """The options, with the limit in bytes; a bad one ends in a usage error."""
    try:
        a.limit_bytes = parse_budget(a.limit)
    except ValueError as exc:
        a.parser.error(str(exc))
    if a.steps < 1:
        a.parser.error(f"--steps must be at least 1, not {a.steps}")
    return a


def _run(mode: str, a: argparse.Namespace, limit: int | None) -> dict[str, Any]:
    path = os.path.join(a.out, f"demo-{mode}.jsonl")

    def show(rec: dict) -> None:
        print(f"  {mode:8} step {rec['step']:3d}: micro-batch {rec['micro']:3d}, "
              f"{rec['seconds']:5.1f} s, RSS {rec['rss_bytes'] / MiB:6,.0f} MiB, "
              f"swap {rec['swap_bytes'] / MiB:5,.0f} MiB", flush=True)

    r = workload.run(mode, limit, steps=a.steps, model=MODEL, telemetry=path,
                     max_seconds=a.plain_seconds if mode == "plain" else None,
                     budget=a.limit if limit is None else "auto", on_step=show)
    end = ("killed by the kernel (out of memory)" if r.killed else
           f"stopped after {a.plain_seconds:g} s" if r.stopped_by_time else
           "done" if r.returncode == 0 else f"failed (status {r.returncode})")
    print(f"  {mode}: {len(r.steps)}/{a.steps} steps, {end}")
    if r.returncode not in (0, None) and not r.killed and not r.stopped_by_time:
        print(r.stderr)
    return {"mode": mode, "path": path, "steps": r.steps, "end": end, "killed": r.killed,
            "done": len(r.steps)}


def _command(args: argparse.Namespace) -> int:
    """Run the demo; 0 when memguard's run finished every step."""
    a = _checked(args)
    os.makedirs(a.out, exist_ok=True)
    why = "--budget-only" if a.budget_only else limits.unavailable(swap=False)
    limit = None if why else a.limit_bytes
    mib = a.limit_bytes / MiB
    if limit:
        print(f"memguard demo: a ViT ({MODEL.img} px, batch {MODEL.batch}) under a "
              f"{mib:,.0f} MiB memory limit, the plain loop and then memguard")
        runs = [_run("plain", a, limit), _run("memguard", a, limit)]
    else:
        print(f"memguard demo: a ViT ({MODEL.img} px, batch {MODEL.batch}) through memguard "
              f"under a budget of {mib:,.0f} MiB (no memory limit here: {why})")
        runs = [_run("memguard", a, None)]
    png = os.path.join(a.out, "demo-report.png")
    draw(runs, a.limit_bytes, "limit" if limit else "budget", png, MODEL.batch)
    with open(os.path.join(a.out, "demo-summary.json"), "w") as f:
        json.dump({"limit_bytes": a.limit_bytes, "cgroup": bool(limit),
                   "runs": [{k: r[k] for k in ("mode", "done", "end", "killed", "path")}
                            for r in runs]}, f, indent=1)
    print(f"report: {png}; telemetry: {', '.join(r['path'] for r in runs)}")
    return 0 if runs[-1]["done"] == a.steps else 1


def draw(runs: list[dict], line_bytes: int, line_name: str, out: str, batch: int) -> None:
    """Both runs on one time axis: each one's footprint (resident and
    swapped-out bytes) against the limit or budget, and the samples it
    trained."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from memguard.telemetry import read_jsonl

    colours = {"plain": "#e03131", "memguard": "#1c7ed6"}
    fig = Figure(figsize=(11, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_mem, ax_done = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    fig.suptitle(f"memguard demo: the same training, {line_name} "
                 f"{line_bytes / MiB:,.0f} MiB", fontsize=13)
    for r in runs:
        _, samples, events = read_jsonl(r["path"])
        if not samples:
            continue
        t0 = samples[0].t
        ts = [s.t - t0 for s in samples]
        foot = [math.nan if s.footprint_bytes is None else s.footprint_bytes / MiB
                for s in samples]
        c = colours[r["mode"]]
        ax_mem.plot(ts, foot, "-", color=c, lw=1.6, label=f"{r['mode']}: {r['end']}")
        steps = [e for e in events if e.get("event") == "step"]
        ax_done.step([0] + [e["t"] - t0 for e in steps],
                     [0] + [batch * (i + 1) for i in range(len(steps))], where="post",
                     color=c, lw=1.6, label=r["mode"])
        if r["killed"]:
            ax_mem.plot([ts[-1]], [foot[-1]], "x", color=c, ms=12, mew=3)
    ax_mem.axhline(line_bytes / MiB, ls="--", color="black", lw=1.4, label=line_name)
    ax_mem.set_ylabel("footprint (RSS + swap), MiB")
    ax_mem.legend(loc="upper left", fontsize=9)
    ax_mem.grid(alpha=0.3)
    ax_done.set_ylabel("samples trained")
    ax_done.set_xlabel("seconds")
    ax_done.legend(loc="upper left", fontsize=9)
    ax_done.grid(alpha=0.3)
    fig.savefig(out)


