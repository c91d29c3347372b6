"""What ``memguard report`` needs for a long run's telemetry.

A JSONL file of about 500 MB is written in a temporary directory the way a
guarded run writes it (:class:`memguard.telemetry.JsonlExporter`, samples
from a real sampler every 100 ms, varied over time; step events every
second; reliefs, out-of-memory recoveries and a script's own events now
and then): about 7 hours of a run. ``python -m memguard report FILE -o
FILE.png`` then runs on it as a child process, and again on a file of 100
samples written the same way, for its start-up cost.
The figures are the command's wall time and its peak RSS (``ru_maxrss`` of
the command, measured as ``/usr/bin/time`` does), against memguard's
target: under 200 MB, whatever the file's size. The files are deleted
afterwards.

    pytest benchmarks/bench_report.py --benchmark-only
    python benchmarks/bench_report.py [pytest options]   (the same)
"""
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import time

import pytest

from benchlib import ROOT, Figures, fmt, verdict

sys.path.insert(0, os.path.join(ROOT, "python"))

from memguard.telemetry import JsonlExporter, Level, Sampler

MB = 10**6
SECTION = "report"
TITLE = "memguard report: a long run's telemetry, peak RSS and wall time"
TARGET_RSS_MB = 200
#: bytes of telemetry written, full and under --bench-quick
SIZES = {False: 500 * MB, True: 20 * MB}
SMALL_SAMPLES = 100
INTERVAL_S = 0.1
STEP_EVERY = 10           # samples a step


def write_run(path: str, size: int | None = None, samples: int | None = None) -> dict:
    """Write a guarded run's telemetry: until the file holds ``size`` bytes or
    ``samples`` samples. Returns what was written (bytes, samples, events)."""
    base = Sampler(budget="8GiB").sample_now()
    t0 = time.time()
    n = events = 0
    with JsonlExporter(path, meta={"note": "bench_report"}) as ex:
        while (size is None or os.path.getsize(path) < size) and \
                (samples is None or n < samples):
            for _ in range(1000 if samples is None else min(1000, samples - n)):
                n += 1
                events += _record(ex, base, n, t0 + n * INTERVAL_S)
    return {"bytes": os.path.getsize(path), "samples": n, "events": events}


def _record(ex: JsonlExporter, base, n: int, t: float) -> int:
    """One sample at ``t`` and the events that fall there; the events written."""
    hour = (n * INTERVAL_S) / 3600
    # a leak that the gc relieves every ~40 minutes, plus noise and rare spikes
    rss = int(2.0e9 + 1.5e9 * (hour % 0.7) + 5e7 * math.sin(n / 7.0)
              + (1.5e9 if n % 9973 == 0 else 0))
    level = Level(min(3, int(3 * (hour % 0.7) / 0.7 + (n % 9973 == 0))))
    ex(dataclasses.replace(base, t=t, seq=n, rss_bytes=rss, level=level, raw_level=level,
                           arena_allocated_bytes=rss // 2, arena_reserved_bytes=rss // 2 + 2**28,
                           budget_bytes=8 << 30, arena_budget_bytes=6 << 30))
    written = 0
    if n % STEP_EVERY == 0:
        micro = 32 if level < Level.HIGH else 16
        action = "shrink" if level == Level.HIGH and n % 2000 == 0 else "keep"
        ex.event("step", t=t, step=n // STEP_EVERY, micro_batch=micro, n_micro=32 // micro,
                 retries=0, peak_bytes=rss // 2, loss=1.0 / (1 + hour), action=action,
                 reason="ok", batch=32, level=level.name, planner_budget_bytes=6 << 30,
                 floor_bytes=2**20)
        written += 1
    if n % 25000 == 0:
        ex.event("relieve", t=t, reason="high", gc_collected=100, seconds=0.05)
        ex.event("validation_start", t=t, epoch=n // 25000)
        written += 2
    if n % 99991 == 0:
        ex.event("oom_recovered", t=t, step=n // STEP_EVERY, failed_micro_batch=32,
                 micro_batch=16, peer=False)
        written += 1
    return written


# Runs a command, then prints its wall time and peak RSS, as /usr/bin/time
# does. The command is a child of this small launcher, not of pytest: a
# child's ru_maxrss counts what it shared with its parent before exec.
TIMED = r'''
import resource, subprocess, sys, time
t = time.perf_counter()
code = subprocess.run(sys.argv[1:]).returncode
wall = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(f"TIMED {wall} {peak // 1024 if sys.platform == 'darwin' else peak}", file=sys.stderr)
sys.exit(code)
'''


def run_report(src: str) -> dict:
    """``memguard report src`` as a child process: its wall time and peak RSS."""
    out = src + ".png"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    r = subprocess.run([sys.executable, "-c", TIMED, sys.executable, "-m", "memguard", "report",
                        src, "-o", out], env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.fail(f"memguard report exited with {r.returncode}:\n{r.stderr[-2000:]}")
    os.unlink(out)
    wall, kib = r.stderr.strip().splitlines()[-1].split()[1:]
    return {"wall_s": float(wall), "peak_rss_mb": int(kib) * 1024 / MB,
            "output": r.stdout.strip()}


def test_report_of_a_long_run(benchmark, figures: Figures, quick: bool, tmp_path) -> None:
    figures.section(SECTION, TITLE, summarize)
    big, small = str(tmp_path / "long.jsonl"), str(tmp_path / "short.jsonl")
    try:
        t = time.perf_counter()
        written = write_run(big, size=SIZES[quick])
        write_s = time.perf_counter() - t
        write_run(small, samples=SMALL_SAMPLES)
        res: dict = {}
        benchmark.group = "report: one run of memguard report"
        benchmark.pedantic(lambda: res.update(run_report(big)), rounds=1, iterations=1)
        base = run_report(small)
    finally:
        for p in (big, small):
            if os.path.exists(p):
                os.unlink(p)
    fig = {"file_mb": written["bytes"] / MB, "samples": written["samples"],
           "events": written["events"], "write_s": write_s, "wall_s": res["wall_s"],
           "peak_rss_mb": res["peak_rss_mb"], "small_wall_s": base["wall_s"],
           "small_peak_rss_mb": base["peak_rss_mb"], "output": res["output"]}
    benchmark.extra_info.update(peak_rss_mb=fig["peak_rss_mb"], file_mb=fig["file_mb"])
    figures.record(SECTION, benchmark.fullname, fig)


def summarize(records: list[dict]) -> tuple[list[str], dict, dict]:
    r = records[0]
    v = verdict(r["peak_rss_mb"], TARGET_RSS_MB)
    hours = r["samples"] * INTERVAL_S / 3600
    lines = [
        (f"file {r['file_mb']:,.0f} MB: {r['samples']:,} samples ({hours:.1f} h at "
         f"{INTERVAL_S * 1000:.0f} ms) and {r['events']:,} events, written in "
         f"{r['write_s']:.0f} s"),
        (f"memguard report: {r['wall_s']:.1f} s ({r['file_mb'] / r['wall_s']:.1f} MB/s), "
         f"peak RSS {r['peak_rss_mb']:.0f} MB (target < {TARGET_RSS_MB} MB)  {v}"),
        (f"the same on {SMALL_SAMPLES} samples: {r['small_wall_s']:.1f} s, peak RSS "
         f"{r['small_peak_rss_mb']:.0f} MB; the long file costs "
         f"{fmt(r['peak_rss_mb'] - r['small_peak_rss_mb'], '.0f')} MB more"),
    ]
    data = {k: v for k, v in r.items() if k not in ("nodeid", "output")}
    data.update(target_rss_mb=TARGET_RSS_MB, verdict=v)
    return lines, data, {r["nodeid"]: {"peak_rss_mb": r["peak_rss_mb"]}}


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "--benchmark-only", *sys.argv[1:]]))
