"""What the telemetry sampler costs.

pytest-benchmark times, in this process:

* one sample (``Sampler.sample_now()``), hot (back to back) and cold (after
  sleeping one 100 ms interval, as the thread sees it), for the live sources,
  for every source at once (a slow-source refresh), and for a sampler pointed
  at empty roots (no sources at all); the sampler's own C-timed
  ``sample_cost_us`` goes beside it;
* the sampling thread at 100 ms and 10 ms intervals: each round is a window
  of the thread running on the live sources (the time column is the window's
  length), paired with a window of the same thread on empty roots just
  before it. The figures are the thread's CPU use in percent of one core,
  against memguard's targets (0.1 % and 1 %), and its CPU per wake; the empty
  roots' figure is the timed wake-up plus bookkeeping, which on virtual
  machines costs tens of microseconds per wake, so the difference is
  memguard's source-reading cost;
* a per-source reference: ``os.pread`` of a kept-open descriptor for each
  /proc file the sampler reads (Python overhead included).

    pytest benchmarks/bench_sampler.py --benchmark-only
    python benchmarks/bench_sampler.py [pytest options]   (the same)
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass

import pytest

from benchlib import Figures, fmt, median, ratio, verdict
from memguard import _C

#: Thread CPU targets, percent of one core, by interval in milliseconds.
TARGETS_PCT = {100: 0.1, 10: 1.0}

#: Files the sampler reads, for the per-source reference. smaps_rollup is
#: timed apart: it walks every mapping and must stay off the periodic path.
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
COLD_SLEEP_S = 0.1  # one interval at the default 100 ms
SECTION = "sampler"

#: Sampler variants: (interval ms, empty roots?, slow-source refresh ms or None).
VARIANTS = {
    "live": (100, False, None),
    # slow sources refreshed on every sample 5 ms or more apart: the cost of
    # a sample that reads everything
    "live_all_sources": (100, False, 5.0),
    "empty_roots": (100, True, None),
}
LABELS = {
    "live": "live, slow sources cached (usual sample)",
    "live_all_sources": "live, every source read (slow refresh)",
    "empty_roots": "empty roots: no sources (baseline)",
}


@dataclass(frozen=True)
class Plan:
    """Rounds and window lengths of one run."""

    hot_rounds: int
    cold_rounds: int
    thread_rounds: int
    window_100ms_s: float
    window_10ms_s: float
    source_hot_rounds: int
    source_cold_rounds: int


FULL = Plan(hot_rounds=1500, cold_rounds=30, thread_rounds=5, window_100ms_s=3.0,
            window_10ms_s=1.5, source_hot_rounds=1800, source_cold_rounds=9)
QUICK = Plan(hot_rounds=100, cold_rounds=3, thread_rounds=1, window_100ms_s=0.5,
             window_10ms_s=0.2, source_hot_rounds=100, source_cold_rounds=2)


def make_sampler(interval_ms: int, empty_root: str | None,
                 slow_interval_ms: float | None = None) -> _C.Sampler:
    """A sampler with its sources opened (after one sample).

    Args:
        interval_ms: sampling period.
        empty_root: an empty directory used as both proc and cgroup root, or
            None for the live /proc and /sys/fs/cgroup.
        slow_interval_ms: refresh period of the slow sources for this sampler
            (read when its sources open); None keeps the option's value.
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


@pytest.fixture(scope="module")
def plan(quick: bool) -> Plan:
    return QUICK if quick else FULL


@pytest.fixture(scope="module")
def empty_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("memguard-empty"))


@pytest.fixture(scope="module")
def samplers(empty_root: str) -> dict:
    return {name: make_sampler(iv, empty_root if empty else None, slow)
            for name, (iv, empty, slow) in VARIANTS.items()}


def _section(figures: Figures) -> None:
    figures.section(SECTION, "telemetry sampler: cost of a sample and of the thread",
                    summarize)


# ---------------------------------------------------------------- one sample
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("when", ["hot", "cold"])
def test_sample(benchmark, figures: Figures, plan: Plan, samplers: dict, when: str,
                variant: str) -> None:
    _section(figures)
    s = samplers[variant]
    costs: list[float] = []
    benchmark.group = f"sampler: one sample, {when}"
    if when == "hot":
        benchmark.pedantic(lambda: costs.append(s.sample_now()["sample_cost_us"]),
                           rounds=plan.hot_rounds, warmup_rounds=10)
    else:
        benchmark.pedantic(lambda: costs.append(s.sample_now()["sample_cost_us"]),
                           setup=lambda: time.sleep(COLD_SLEEP_S), rounds=plan.cold_rounds)
    fig = {"kind": "sample", "when": when, "variant": variant,
           "sample_cost_us": median(costs),
           "call_us": benchmark.stats.stats.median * 1e6}
    benchmark.extra_info.update(sample_cost_us=fig["sample_cost_us"])
    figures.record(SECTION, benchmark.fullname, fig)


# ------------------------------------------------------------ the thread
def _window(s: _C.Sampler, interval_ms: int, seconds: float) -> dict:
    """Run the sampler thread for ``seconds``; its CPU use over the window."""
    s.start()
    try:
        time.sleep(2 * interval_ms / 1000)  # past the first wake of this run
        seq0, cpu0, t0 = s.latest()["seq"], s.cpu_ns(), time.perf_counter_ns()
        time.sleep(seconds)
        seq1, cpu1, t1 = s.latest()["seq"], s.cpu_ns(), time.perf_counter_ns()
    finally:
        s.stop()
    wakes = max(seq1 - seq0, 1)
    return {"pct": 100.0 * (cpu1 - cpu0) / (t1 - t0), "us_per_wake": (cpu1 - cpu0) / 1e3 / wakes,
            "wakes": seq1 - seq0}


@pytest.mark.parametrize("interval_ms", [100, 10])
def test_sampler_thread(benchmark, figures: Figures, plan: Plan, empty_root: str,
                        interval_ms: int) -> None:
    _section(figures)
    live, empty = make_sampler(interval_ms, None), make_sampler(interval_ms, empty_root)
    seconds = plan.window_100ms_s if interval_ms == 100 else plan.window_10ms_s
    live_w: list[dict] = []
    empty_w: list[dict] = []
    benchmark.group = "sampler: thread window (time = window length; CPU in extra_info)"
    benchmark.pedantic(lambda: live_w.append(_window(live, interval_ms, seconds)),
                       setup=lambda: empty_w.append(_window(empty, interval_ms, seconds)),
                       rounds=plan.thread_rounds)
    src_pct = [a["pct"] - b["pct"] for a, b in zip(live_w, empty_w)]
    src_wake = [a["us_per_wake"] - b["us_per_wake"] for a, b in zip(live_w, empty_w)]
    target = TARGETS_PCT[interval_ms]
    fig = {"kind": "thread", "interval_ms": interval_ms, "target_pct": target,
           "live_pct": median(w["pct"] for w in live_w),
           "empty_roots_pct": median(w["pct"] for w in empty_w),
           "sources_pct": median(src_pct),
           "live_us_per_wake": median(w["us_per_wake"] for w in live_w),
           "empty_roots_us_per_wake": median(w["us_per_wake"] for w in empty_w),
           "sources_us_per_wake": median(src_wake),
           "wakes_per_window": median(float(w["wakes"]) for w in live_w),
           "live_pct_rounds": [round(w["pct"], 5) for w in live_w]}
    benchmark.extra_info.update({k: fig[k] for k in ("live_pct", "empty_roots_pct",
                                                      "sources_pct", "live_us_per_wake",
                                                      "target_pct")})
    figures.record(SECTION, benchmark.fullname, fig)


# ------------------------------------------------------ per-source reference
@pytest.mark.parametrize("path", [*PROC_SOURCES, PYTHON_FLOOR])
def test_proc_read(benchmark, figures: Figures, plan: Plan, path: str) -> None:
    _section(figures)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        os.pread(fd, READ_BUF, 0)
    except OSError as e:
        pytest.skip(f"{path} is not readable here: {e.strerror}")
    try:
        cold = []
        for _ in range(plan.source_cold_rounds):
            time.sleep(COLD_SLEEP_S)
            t0 = time.perf_counter_ns()
            os.pread(fd, READ_BUF, 0)
            cold.append((time.perf_counter_ns() - t0) / 1e3)
        benchmark.group = "sampler: os.pread of a kept-open /proc file, hot"
        benchmark.pedantic(os.pread, args=(fd, READ_BUF, 0), rounds=plan.source_hot_rounds,
                           warmup_rounds=10)
    finally:
        os.close(fd)
    fig = {"kind": "source", "path": path, "hot_us": benchmark.stats.stats.median * 1e6,
           "cold_us": statistics.median(cold)}
    benchmark.extra_info.update(cold_us=fig["cold_us"])
    figures.record(SECTION, benchmark.fullname, fig)


def test_smaps_rollup_once(benchmark, figures: Figures) -> None:
    """smaps_rollup walks every mapping: the reason it is never read periodically."""
    _section(figures)

    def read_rollup() -> None:
        with open(SMAPS_ROLLUP, "rb", buffering=0) as f:
            f.read()

    try:
        read_rollup()
    except OSError as e:
        pytest.skip(f"{SMAPS_ROLLUP} is not readable here: {e.strerror}")
    benchmark.group = "sampler: smaps_rollup (never periodic)"
    benchmark.pedantic(read_rollup, rounds=3)
    figures.record(SECTION, benchmark.fullname,
                   {"kind": "rollup", "once_us": benchmark.stats.stats.median * 1e6})


# ------------------------------------------------------------------ summary
def _row(label: str, cells: list[str], width: int = 52) -> str:
    return "  " + label.ljust(width) + "".join(c.rjust(11) for c in cells)


def summarize(records: list[dict]) -> tuple[list[str], dict, dict]:
    """The sample, thread and per-source tables; thread ratios to the targets."""
    lines: list[str] = []
    data: dict = {"slow_interval_ms": float(_C.option_get("slow_interval_ms")),
                  "sample_cost_us": {}, "thread": {}, "sources": {}}
    per_test: dict[str, dict] = {}
    samples = {(r["variant"], r["when"]): r for r in records if r["kind"] == "sample"}
    if samples:
        lines.append("one sample, us (sample_cost_us timed in C; call: sample_now() "
                     "timed from Python, the dict included)")
        lines.append(_row("", ["hot", "cold", "cold/hot", "hot call"]))
        for v, label in LABELS.items():
            hot, cold = samples.get((v, "hot"), {}), samples.get((v, "cold"), {})
            if not hot and not cold:
                continue
            h, c = hot.get("sample_cost_us"), cold.get("sample_cost_us")
            data["sample_cost_us"][v] = {"hot_us": h, "cold_us": c,
                                         "cold_over_hot": ratio(c, h),
                                         "hot_call_us": hot.get("call_us")}
            lines.append(_row(label, [fmt(h), fmt(c), fmt(ratio(c, h)),
                                      fmt(hot.get("call_us"))]))
        lines.append("")
    threads = {r["interval_ms"]: r for r in records if r["kind"] == "thread"}
    if threads:
        lines.append("sampler thread, % of one core (sources = live - empty roots, "
                     "paired per round)")
        lines.append(_row("", ["live", "empty", "sources", "target", "live/tgt", "verdict"]))
        for iv, t in sorted(threads.items(), reverse=True):
            over = ratio(t["live_pct"], t["target_pct"])
            v = verdict(t["live_pct"], t["target_pct"])
            data["thread"][f"{iv}ms"] = {k: v_ for k, v_ in t.items()
                                         if k not in ("kind", "nodeid")} | {
                "live_over_target": over,
                "sources_over_target": ratio(t["sources_pct"], t["target_pct"]), "verdict": v}
            per_test[t["nodeid"]] = {"live_over_target": over, "verdict": v}
            lines.append(_row(f"interval {iv} ms", [
                fmt(t["live_pct"], ".4f"), fmt(t["empty_roots_pct"], ".4f"),
                fmt(t["sources_pct"], ".4f"),
                fmt(t["target_pct"]), fmt(over), v]))
        for iv, t in sorted(threads.items(), reverse=True):
            lines.append(_row(f"interval {iv} ms, CPU us per wake", [
                fmt(t["live_us_per_wake"], ".1f"), fmt(t["empty_roots_us_per_wake"], ".1f"),
                fmt(t["sources_us_per_wake"], ".1f")]))
        lines.append("")
    sources = [r for r in records if r["kind"] in ("source", "rollup")]
    if sources:
        floor = next((r["cold_us"] for r in sources if r.get("path") == PYTHON_FLOOR), None)
        lines.append("per-source reference, us: os.pread of a kept-open fd, Python included")
        lines.append(_row("", ["hot", "cold", "cold-floor"]))
        for r in sources:
            if r["kind"] == "rollup":
                data["sources"][SMAPS_ROLLUP] = {"once_us": r["once_us"]}
                lines.append(_row(f"{SMAPS_ROLLUP} (never periodic)", [fmt(r["once_us"])]))
                continue
            over = None if floor is None or r["path"] == PYTHON_FLOOR else r["cold_us"] - floor
            data["sources"][r["path"]] = {"hot_us": r["hot_us"], "cold_us": r["cold_us"]}
            lines.append(_row(r["path"], [fmt(r["hot_us"]), fmt(r["cold_us"]), fmt(over)]))
    return lines, data, per_test


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "--benchmark-only", *sys.argv[1:]]))
