"""What the telemetry sampler costs, measured side by side in one run.

Prints, as medians of interleaved repetitions:

* the cost of one sample (the sampler's own ``sample_cost_us``), hot (back to
  back) and cold (after sleeping one interval, as the thread sees it), for
  the live sources, for every source at once (a slow-source refresh), and for
  a sampler pointed at empty roots (no sources at all);
* the sampling thread's CPU use in percent of one core at 100 ms and 10 ms
  intervals, against memguard's targets (0.1 % and 1 %), next to the same
  thread with empty roots: that baseline is the timed wake-up plus
  bookkeeping, which on virtual machines costs tens of microseconds per wake,
  so the difference is memguard's source-reading cost;
* a per-source reference: ``os.pread`` of a kept-open descriptor for each
  /proc file the sampler reads (Python overhead included).

The last line is ``BENCH_JSON {...}`` with every figure.

Usage: ``python benchmarks/bench_sampler.py [--quick]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

from memguard import _C

#: Thread CPU targets, percent of one core, by interval in milliseconds.
TARGETS_PCT = {100: 0.1, 10: 1.0}

#: Files the sampler reads, for the per-source reference. smaps_rollup is
#: timed once, apart: it walks every mapping and must stay off the periodic path.
PROC_SOURCES = (
    "/proc/self/status",
    "/proc/self/statm",
    "/proc/meminfo",
    "/proc/vmstat",
    "/proc/pressure/memory",
)
SMAPS_ROLLUP = "/proc/self/smaps_rollup"
#: pread of an empty device: the cost of the Python loop and the syscall alone.
PYTHON_FLOOR = "/dev/null"

#: Same buffer size as the C sources use.
READ_BUF = 16384


@dataclass(frozen=True)
class Plan:
    """Repetition counts and window lengths of one run.

    Args:
        cost_reps: interleaved repetitions of the one-sample measurements.
        hot_burst: back-to-back samples per hot measurement.
        thread_reps: interleaved repetitions of the thread windows.
        window_100ms_s: seconds each 100 ms thread window runs.
        window_10ms_s: seconds each 10 ms thread window runs.
        source_reps: repetitions of the per-source preads.
        source_burst: back-to-back preads per hot measurement.
    """

    cost_reps: int
    hot_burst: int
    thread_reps: int
    window_100ms_s: float
    window_10ms_s: float
    source_reps: int
    source_burst: int


FULL = Plan(cost_reps=30, hot_burst=50, thread_reps=5, window_100ms_s=3.0,
            window_10ms_s=1.5, source_reps=9, source_burst=200)
QUICK = Plan(cost_reps=8, hot_burst=50, thread_reps=3, window_100ms_s=1.0,
             window_10ms_s=0.5, source_reps=3, source_burst=200)

COLD_SLEEP_S = 0.1  # one interval at the default 100 ms


def median(xs: list[float]) -> float | None:
    """Median, or None for no data.

    Args:
        xs: values.

    Returns:
        The median of ``xs`` or None when empty.
    """
    return statistics.median(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is not positive.

    Args:
        a: numerator.
        b: denominator.

    Returns:
        The ratio or None.
    """
    if a is None or b is None or b <= 0:
        return None
    return a / b


def rotate(items: list, k: int) -> list:
    """Rotate ``items`` left by ``k`` so each repetition starts elsewhere.

    Args:
        items: the sequence.
        k: repetition index.

    Returns:
        A rotated copy.
    """
    k %= len(items)
    return items[k:] + items[:k]


def make_sampler(interval_ms: int, empty_root: str | None,
                 slow_interval_ms: float | None = None) -> _C.Sampler:
    """Create a sampler with its sources opened.

    Args:
        interval_ms: sampling period.
        empty_root: an empty directory used as both proc and cgroup root, or
            None for the live /proc and /sys/fs/cgroup.
        slow_interval_ms: refresh period of the slow sources for this sampler
            (read when its sources open); None keeps the option's value.

    Returns:
        The sampler, after one sample (which opens and caches its sources).
    """
    s = _C.Sampler(interval_ms=interval_ms, proc_root=empty_root, cgroup_root=empty_root)
    if slow_interval_ms is None:
        s.sample_now()
        return s
    old = _C.option_get("slow_interval_ms")
    _C.option_set("slow_interval_ms", repr(slow_interval_ms))
    try:
        s.sample_now()
    finally:
        _C.option_set("slow_interval_ms", old)
    return s


def measure_sample_costs(plan: Plan, empty_root: str) -> dict:
    """One-sample costs, hot and cold, interleaved across three samplers.

    Args:
        plan: repetition counts.
        empty_root: an empty directory for the no-source baseline.

    Returns:
        ``{variant: {"hot_us", "cold_us", "hot_call_us"}}`` medians, plus
        ``cold_over_hot`` per variant.
    """
    variants: dict[str, _C.Sampler] = {
        "live": make_sampler(100, None),
        # slow sources refreshed on every sample 5 ms or more apart: the cost
        # of a sample that reads everything
        "live_all_sources": make_sampler(100, None, slow_interval_ms=5),
        "empty_roots": make_sampler(100, empty_root),
    }
    hot: dict[str, list[float]] = {k: [] for k in variants}
    cold: dict[str, list[float]] = {k: [] for k in variants}
    call: dict[str, list[float]] = {k: [] for k in variants}
    for rep in range(plan.cost_reps):
        for name in rotate(list(variants), rep):
            s = variants[name]
            time.sleep(COLD_SLEEP_S)
            cold[name].append(s.sample_now()["sample_cost_us"])
            costs, walls = [], []
            for _ in range(plan.hot_burst):
                t0 = time.perf_counter_ns()
                d = s.sample_now()
                walls.append((time.perf_counter_ns() - t0) / 1e3)
                costs.append(d["sample_cost_us"])
            hot[name].append(statistics.median(costs))
            call[name].append(statistics.median(walls))
    out = {}
    for name in variants:
        h, c = median(hot[name]), median(cold[name])
        out[name] = {"hot_us": h, "cold_us": c, "cold_over_hot": ratio(c, h),
                     "hot_call_us": median(call[name])}
    return out


def measure_threads(plan: Plan, empty_root: str) -> dict:
    """Thread CPU use at 100 ms and 10 ms, live and empty roots, interleaved.

    Args:
        plan: repetitions and window lengths.
        empty_root: an empty directory for the no-source baseline.

    Returns:
        Per interval: medians of percent of one core and CPU microseconds
        per wake for live and empty roots, the paired difference (sources),
        the target and the ratios to it.
    """
    configs = [(iv, root) for iv in (100, 10) for root in ("live", "empty_roots")]
    samplers = {c: make_sampler(c[0], None if c[1] == "live" else empty_root) for c in configs}
    pct: dict[tuple, list[float]] = {c: [] for c in configs}
    per_wake: dict[tuple, list[float]] = {c: [] for c in configs}
    wakes: dict[tuple, list[int]] = {c: [] for c in configs}
    for rep in range(plan.thread_reps):
        for c in rotate(configs, rep):
            s = samplers[c]
            window = plan.window_100ms_s if c[0] == 100 else plan.window_10ms_s
            s.start()
            try:
                time.sleep(2 * c[0] / 1000)  # past the first wake of this run
                seq0, cpu0, t0 = s.latest()["seq"], s.cpu_ns(), time.perf_counter_ns()
                time.sleep(window)
                seq1, cpu1, t1 = s.latest()["seq"], s.cpu_ns(), time.perf_counter_ns()
            finally:
                s.stop()
            pct[c].append(100.0 * (cpu1 - cpu0) / (t1 - t0))
            per_wake[c].append((cpu1 - cpu0) / 1e3 / max(seq1 - seq0, 1))
            wakes[c].append(seq1 - seq0)
    out = {}
    for iv in (100, 10):
        live, empty = (iv, "live"), (iv, "empty_roots")
        src_pct = [a - b for a, b in zip(pct[live], pct[empty])]
        src_wake = [a - b for a, b in zip(per_wake[live], per_wake[empty])]
        target = TARGETS_PCT[iv]
        live_pct = median(pct[live])
        out[f"{iv}ms"] = {
            "live_pct": live_pct,
            "empty_roots_pct": median(pct[empty]),
            "sources_pct": median(src_pct),
            "live_us_per_wake": median(per_wake[live]),
            "empty_roots_us_per_wake": median(per_wake[empty]),
            "sources_us_per_wake": median(src_wake),
            "wakes_per_window": median([float(w) for w in wakes[live]]),
            "target_pct": target,
            "live_over_target": ratio(live_pct, target),
            "sources_over_target": ratio(median(src_pct), target),
            "verdict": "PASS" if live_pct is not None and live_pct <= target else "OVER",
            "live_pct_reps": [round(x, 5) for x in pct[live]],
            "empty_roots_pct_reps": [round(x, 5) for x in pct[empty]],
        }
    return out


def open_or_error(path: str) -> tuple[int | None, str | None]:
    """Open ``path`` read-only.

    Args:
        path: file to open.

    Returns:
        ``(fd, None)``, or ``(None, reason)`` when it cannot be opened or read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        return None, e.strerror
    try:
        os.pread(fd, READ_BUF, 0)
    except OSError as e:
        os.close(fd)
        return None, e.strerror
    return fd, None


def timed(fn: Callable[[], object], n: int) -> float:
    """Microseconds per call of ``fn`` over ``n`` back-to-back calls.

    Args:
        fn: the call.
        n: how many.

    Returns:
        Mean microseconds per call.
    """
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / 1e3 / n


def measure_sources(plan: Plan) -> dict:
    """Hot and cold ``os.pread`` of kept-open descriptors, and smaps_rollup once.

    Args:
        plan: repetition counts.

    Returns:
        ``{path: {"hot_us", "cold_us"} or {"error"}}`` plus the one-off
        smaps_rollup read under its own key.
    """
    fds: dict[str, int] = {}
    out: dict[str, dict] = {}
    for path in (*PROC_SOURCES, PYTHON_FLOOR):
        fd, err = open_or_error(path)
        if fd is None:
            out[path] = {"error": err}
        else:
            fds[path] = fd
    hot: dict[str, list[float]] = {p: [] for p in fds}
    cold: dict[str, list[float]] = {p: [] for p in fds}
    try:
        for rep in range(plan.source_reps):
            for path in rotate(list(fds), rep):
                fd = fds[path]
                time.sleep(COLD_SLEEP_S)
                cold[path].append(timed(lambda fd=fd: os.pread(fd, READ_BUF, 0), 1))
                hot[path].append(timed(lambda fd=fd: os.pread(fd, READ_BUF, 0),
                                       plan.source_burst))
    finally:
        for fd in fds.values():
            os.close(fd)
    for path in fds:
        out[path] = {"hot_us": median(hot[path]), "cold_us": median(cold[path])}

    def read_rollup() -> None:
        with open(SMAPS_ROLLUP, "rb", buffering=0) as f:
            f.read()

    try:
        out[SMAPS_ROLLUP] = {"once_us": timed(read_rollup, 1)}
    except OSError as e:
        out[SMAPS_ROLLUP] = {"error": e.strerror}
    return out


LABEL_W = 56  # width of the label column
COL_W = 11  # width of each number column


def fmt(v: float | None, digits: int = 2) -> str:
    """Format a number right-aligned in a column, or a dash for a missing one.

    Args:
        v: value or None.
        digits: decimals.

    Returns:
        The formatted text, COL_W wide.
    """
    return ("-" if v is None else f"{v:.{digits}f}").rjust(COL_W)


def row(label: str, cells: list[str]) -> str:
    """One table line: a label column, then right-aligned cells.

    Args:
        label: first column.
        cells: already formatted cells (see fmt) or text.

    Returns:
        The line.
    """
    return "  " + label.ljust(LABEL_W) + "".join(c.rjust(COL_W) for c in cells)


def print_table(meta: dict, costs: dict, threads: dict, sources: dict) -> None:
    """Print the human-readable tables.

    Args:
        meta: run description.
        costs: from measure_sample_costs.
        threads: from measure_threads.
        sources: from measure_sources.
    """
    print(f"memguard sampler benchmark ({meta['mode']}): Linux {meta['kernel']}, "
          f"{meta['cpus']} CPUs, Python {meta['python']}; medians of interleaved repetitions")
    print()
    print(f"one sample, us (sample_cost_us, timed in C; {meta['cost_reps']} reps)")
    print(row("", ["hot", "cold", "cold/hot", "call(py)"]))
    labels = {
        "live": "live, slow sources cached (usual sample)",
        "live_all_sources": "live, every source read (slow refresh)",
        "empty_roots": "empty roots: no sources (baseline)",
    }
    for key, label in labels.items():
        c = costs[key]
        print(row(label, [fmt(c["hot_us"]), fmt(c["cold_us"]), fmt(c["cold_over_hot"]),
                          fmt(c["hot_call_us"])]))
    print("  hot: back-to-back sample_now(); cold: after sleeping one 100 ms interval;")
    print("  call(py): hot sample_now() timed from Python, building the dict included")
    print()
    print(f"sampler thread, % of one core ({meta['thread_reps']} reps; "
          f"sources = live - empty roots, paired per rep)")
    print(row("", ["live", "empty", "sources", "target", "live/tgt", "verdict", "src/tgt"]))
    for iv in (100, 10):
        t = threads[f"{iv}ms"]
        print(row(f"interval {iv} ms", [
            fmt(t["live_pct"], 4), fmt(t["empty_roots_pct"], 4), fmt(t["sources_pct"], 4),
            fmt(t["target_pct"]), fmt(t["live_over_target"]), t["verdict"],
            fmt(t["sources_over_target"])]))
    for iv in (100, 10):
        t = threads[f"{iv}ms"]
        print(row(f"interval {iv} ms, CPU us per wake", [
            fmt(t["live_us_per_wake"], 1), fmt(t["empty_roots_us_per_wake"], 1),
            fmt(t["sources_us_per_wake"], 1)]))
    print("  empty roots: the same thread with an empty proc_root and cgroup_root, i.e. the")
    print("  timed wake-up plus bookkeeping; on virtual machines that alone is tens of us a wake")
    print()
    print(f"per-source reference, us: os.pread of a kept-open fd, Python overhead included "
          f"({meta['source_reps']} reps)")
    print(row("", ["hot", "cold", "cold-floor"]))
    floor = sources.get(PYTHON_FLOOR, {}).get("cold_us")
    for path in (*PROC_SOURCES, PYTHON_FLOOR):
        r = sources[path]
        label = path + ("  (Python + syscall floor)" if path == PYTHON_FLOOR else "")
        if "error" in r:
            print(row(label, [f"unreadable ({r['error']})"]))
        elif path == PYTHON_FLOOR:
            print(row(label, [fmt(r["hot_us"]), fmt(r["cold_us"])]))
        else:
            over = None if floor is None else r["cold_us"] - floor
            print(row(label, [fmt(r["hot_us"]), fmt(r["cold_us"]), fmt(over)]))
    r = sources[SMAPS_ROLLUP]
    label = f"{SMAPS_ROLLUP} (once; never periodic)"
    if "error" in r:
        print(row(label, [f"unreadable ({r['error']})"]))
    else:
        print(row(label, [fmt(r["once_us"])]))
    print("  cold: one pread after sleeping 100 ms; cold-floor: less the /dev/null cold read")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its tables and the BENCH_JSON line.

    Args:
        argv: command-line arguments (default: sys.argv[1:]).

    Returns:
        Process exit status (0).
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="about 15 s instead of about 75 s")
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else FULL
    meta = {
        "mode": "quick" if args.quick else "full",
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "cost_reps": plan.cost_reps,
        "thread_reps": plan.thread_reps,
        "source_reps": plan.source_reps,
        "window_100ms_s": plan.window_100ms_s,
        "window_10ms_s": plan.window_10ms_s,
        "slow_interval_ms": float(_C.option_get("slow_interval_ms")),
    }
    t_start = time.perf_counter()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        with tempfile.TemporaryDirectory(prefix="memguard-empty-") as empty_root:
            costs = measure_sample_costs(plan, empty_root)
            threads = measure_threads(plan, empty_root)
        sources = measure_sources(plan)
    finally:
        if gc_was:
            gc.enable()
    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    print_table(meta, costs, threads, sources)
    print(f"\n({meta['elapsed_s']} s)")
    print("BENCH_JSON " + json.dumps({"meta": meta, "sample_cost": costs, "thread": threads,
                                      "sources": sources}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
