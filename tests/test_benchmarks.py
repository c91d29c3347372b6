"""The benchmark suite runs under pytest-benchmark and its JSON holds the ratios.

``make bench`` runs ``pytest benchmarks/ --benchmark-only``; here a subset of
it runs with ``--bench-quick`` (smoke-sized workloads), in a subprocess, and
the figures that the targets are about are read back from the benchmark JSON
and the terminal summary. Speed is not judged here: the figures of a quick
run measure nothing.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20
pytest.importorskip("pytest_benchmark")
pytest.importorskip("torch")


def bench_module(name: str):
    """A module of benchmarks/, imported here for its summary function."""
    path = os.path.join(ROOT, "benchmarks")
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


def run_bench(tmp_path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env.pop("LD_PRELOAD", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_suite_is_collected_from_the_benchmarks_directory(tmp_path) -> None:
    out = run_bench(tmp_path, "benchmarks/", "--benchmark-only", "--collect-only", "-q")
    assert out.returncode == 0, out.stdout + out.stderr
    ids = {line.strip() for line in out.stdout.splitlines() if "::" in line}
    for wanted in ("benchmarks/bench_cpu_allocator.py::test_step[vit-b32-jemalloc]",
                   "benchmarks/bench_cpu_allocator.py::test_step[dino-multicrop-glibc]",
                   "benchmarks/bench_throttle.py::test_oom_step[recovered]",
                   "benchmarks/bench_throttle.py::test_constrained[accelerate]",
                   "benchmarks/bench_sampler.py::test_sampler_thread[100]",
                   "benchmarks/bench_cuda.py::test_cuda_budget_held",
                   "benchmarks/bench_pressure.py::test_limit_lowered_then_raised[memguard]",
                   "benchmarks/bench_gpu_pressure.py::test_mid_run[freed]",
                   "benchmarks/bench_pressure.py::test_oom_at_start_then_raised",
                   "benchmarks/bench_fp16_split.py::test_fp16_split",
                   "benchmarks/bench_lightning_ddp.py::test_lightning_ddp_calm"):
        assert wanted in ids, sorted(ids)
    # and `make test` (plain pytest) does not run them: tests/ is the only test
    # path. Every module of tests/ but this one is left out of the collection
    # (they would take seconds to import); a test path that held benchmarks/
    # would still bring its modules in.
    out = run_bench(tmp_path, "--collect-only", "-q", "--ignore-glob=tests/test_[!b]*.py",
                    "--ignore-glob=tests/test_b[!e]*.py")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line]
    assert "tests/test_benchmarks.py::test_suite_is_collected_from_the_benchmarks_directory" \
        in ids, ids[:20]
    assert not [i for i in ids if i.startswith("benchmarks/")]


def test_quick_subset_stores_the_ratios_in_the_json(tmp_path) -> None:
    js = tmp_path / "bench.json"
    nodes = [
        "benchmarks/bench_cpu_allocator.py::test_step[vit-b8-glibc]",
        "benchmarks/bench_cpu_allocator.py::test_step[vit-b8-memguard-inprocess]",
        "benchmarks/bench_throttle.py::test_overhead",
        "benchmarks/bench_throttle.py::test_oom_step",
        # (memguard's rounds are paired with unconstrained runs of their own)
        "benchmarks/bench_throttle.py::test_constrained[memguard]",
        "benchmarks/bench_sampler.py::test_sampler_thread[10]",
        "benchmarks/bench_cuda.py",
    ]
    out = run_bench(tmp_path, *nodes, "--benchmark-only", "--bench-quick",
                    f"--benchmark-json={js}")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "memguard: side-by-side figures" in out.stdout
    data = json.loads(js.read_text())
    mg = data["memguard"]
    assert mg["quick"] is True

    cpu = mg["cpu_allocator"]["vit-b8"]
    assert cpu["glibc"]["step_ratio"] == pytest.approx(1.0)
    inproc = cpu["memguard-inprocess"]
    for k in ("step_ratio", "faults_ratio", "peak_rss_ratio"):
        assert isinstance(inproc[k], float) and inproc[k] > 0, inproc
    assert set(inproc["verdict"]) == {"step_ratio", "faults_ratio", "peak_rss_ratio"}
    # interleaved with glibc: its step ratio is the median of the paired rounds
    assert len(inproc["paired_ratios"]) == 1
    assert inproc["step_ratio"] == pytest.approx(inproc["paired_ratios"][0])
    # and with hand-tuned glibc, the tuning the step-time target stands for
    assert len(inproc["tuned_paired_ratios"]) == 1
    assert inproc["tuned_step_ratio"] == pytest.approx(inproc["tuned_paired_ratios"][0])
    # the floor of each paired glibc step without its kernel time
    assert len(inproc["kernel_floors"]) == 1
    # the warm-up steps' faults, one a step (the figures are of the steps after)
    for c in ("glibc", "memguard-inprocess"):
        assert len(cpu[c]["warmup_faults"]) == 1 and cpu[c]["warmup_faults"][0] >= 0
    assert "faults a warm-up step: glibc " in out.stdout
    # the kernel's share of a step's CPU: the rest, user time, is the step's
    # compute; and all of it is the step's own, no more than every core
    # busy for the step's wall time (not the process's totals)
    for c in ("glibc", "memguard-inprocess"):
        assert 0 <= cpu[c]["sys_s"] < cpu[c]["cpu_s"], cpu[c]
        assert cpu[c]["cpu_s"] <= os.cpu_count() * cpu[c]["step_s"] + 0.05, cpu[c]

    thr = mg["throttle"]
    assert len(thr["overhead"]["paired_ratios"]) == 2
    assert thr["overhead"]["ratio"] > 0
    # the recovered step is paired with a whole-batch step, round by round:
    # its cost is the median of the paired ratios (speed is not judged here)
    oom = thr["oom"]
    assert len(oom["paired_ratios"]) == 1
    assert oom["cost_ratio"] == pytest.approx(statistics.median(oom["paired_ratios"]))
    assert 0 < oom["cost_ratio"] < math.inf and oom["verdict"] in ("PASS", "OVER"), oom
    assert thr["constrained"]["memguard"]["steps_done"] == 4
    assert thr["constrained"]["memguard"]["batch"] == 64
    assert thr["constrained"]["memguard"]["ooms_recovered"] >= 1
    assert thr["constrained"]["memguard"]["throughput_ratio"] > 0
    assert thr["constrained"]["memguard"]["throughput_ratio"] == pytest.approx(
        thr["constrained"]["memguard"]["paired_ratios"][0])    # paired with one round

    th = mg["sampler"]["thread"]["10ms"]
    assert th["target_pct"] == 1.0 and th["live_pct"] > 0

    import torch
    if not torch.cuda.is_available():
        assert mg["cuda"] == {"measured": False, "reason": mg["cuda"]["reason"]}
        assert "not measured" in mg["cuda"]["reason"]

    # each benchmark's own ratios land in its extra_info
    by_name = {b["fullname"]: b for b in data["benchmarks"]}
    extra = by_name["benchmarks/bench_cpu_allocator.py::test_step[vit-b8-memguard-inprocess]"][
        "extra_info"]
    assert extra["baseline"] == "glibc"
    assert extra["step_ratio"] == pytest.approx(inproc["step_ratio"])
    assert extra["faults_per_step"] >= 0 and extra["peak_rss_bytes"] > 0
    rec = by_name["benchmarks/bench_throttle.py::test_oom_step[recovered]"]["extra_info"]
    assert rec["cost_ratio"] == pytest.approx(thr["oom"]["cost_ratio"])
    # pytest-benchmark's own timings are there, one round per step
    assert by_name["benchmarks/bench_throttle.py::test_oom_step[whole]"]["stats"]["rounds"] == 1


def test_fp16_split_skips_the_unsplit_steps_update_and_not_the_splits() -> None:
    """bench_fp16_split's setting, run here on the CPU (a few steps of a
    linear model): the plain run and the guard at the whole batch skip the
    first update alike, bit for bit; the split run skips none and ends at
    twice their scale, its parameters apart from theirs. The figures the
    docs quote."""
    bench = bench_module("bench_fp16_split")
    r = bench.compare("cpu")
    assert r["skipped"] == {"plain": [0], "whole": [0], "split": []}, r["skipped"]
    assert r["whole_equals_plain"] and r["whole_diff_rel"] == 0.0
    assert r["scale_ratio"] == 2.0
    assert 0.01 < r["param_diff_rel"] < 0.1, r["param_diff_rel"]
    lines, _, _ = bench.summarize([dict(r, nodeid="n")])
    assert "updates skipped: plain 1 (steps [0]), guard whole 1, guard split 0 (steps [])" \
        in lines


def test_throttle_overhead_summary_judges_the_paired_processes() -> None:
    """bench_throttle's overhead from made-up rounds: guard.step in a guarded
    process against a plain step in a process without memguard, judged on
    the median of the paired ratios (OVER above 1.01, PASS at or below)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_throttle as bench

    def rec(ratios: list[float]) -> dict:
        return {"part": "overhead", "step_s": 0.26, "plain_step_s": 0.25,
                "paired_ratios": ratios, "ratio": sorted(ratios)[len(ratios) // 2],
                "nodeid": "bench_throttle.py::test_overhead"}

    lines, data, per_test = bench.summarize([rec([1.04, 1.07, 0.98, 1.06, 1.05])])
    assert data["overhead"]["ratio"] == 1.05 and data["overhead"]["verdict"] == "OVER"
    assert data["overhead"]["plain_step_s"] == 0.25 and data["overhead"]["guard_step_s"] == 0.26
    assert per_test["bench_throttle.py::test_overhead"] == {"ratio": 1.05, "verdict": "OVER"}
    assert "   median 1.050  (target <= 1.01)  OVER;  steps 260 ms guarded, 250 ms plain " \
        "(medians)" in lines
    assert "   rounds 1.040, 1.070, 0.980, 1.060, 1.050" in lines
    assert any("a process without memguard" in ln for ln in lines)
    assert "constrained" not in data and "oom" not in data     # only what was measured

    _, data, _ = bench.summarize([rec([1.03, 0.99, 1.01])])
    assert data["overhead"]["verdict"] == "PASS"               # at the target passes
    _, data, _ = bench.summarize([rec([1.03, 0.99, 1.02])])
    assert data["overhead"]["verdict"] == "OVER"               # a hundredth above fails


def test_lightning_ddp_summary_pairs_each_round_with_its_plain_fit() -> None:
    """bench_lightning_ddp from made-up fits: each guarded configuration's
    median step over the plain fit of its round, the median of those
    ratios judged against 1.03 (at it passes, above it does not)."""
    bench = bench_module("bench_lightning_ddp")
    times = {"plain": [[0.10, 0.10, 0.11], [0.20, 0.20, 0.20], [0.10, 0.10, 0.10]],
             "guarded": [[0.11, 0.11, 0.11], [0.206, 0.206, 0.3], [0.10, 0.10, 0.10]],
             "overlap": [[0.10, 0.10, 0.10], [0.20, 0.20, 0.20], [0.103, 0.103, 0.103]]}
    rec = {"times": times, "config": [4, 512, 64, 12, 2, 3], "nodeid": "n"}
    lines, data, per_test = bench.summarize([rec])
    assert data["paired_ratios"]["guarded"] == pytest.approx([1.1, 1.03, 1.0])
    assert data["ratio"] == pytest.approx({"guarded": 1.03, "overlap": 1.0})
    assert data["verdict"] == {"guarded": "PASS", "overlap": "PASS"}
    assert per_test["n"] == {f"{m}_over_plain": v for m, v in data["ratio"].items()}
    assert any(ln.startswith("guarded (defaults") and "median 1.030x (target <= 1.03)  PASS"
               in ln for ln in lines), lines
    times["guarded"][1] = [0.2062] * 3           # 1.031: the median over 1.03
    assert bench.summarize([rec])[1]["verdict"]["guarded"] == "OVER"


def _cpu_rec(workload: str, config: str, step: float, sys_s: float, faults: int,
             rss: int = 1 << 30, **extra) -> dict:
    """A made-up record of bench_cpu_allocator's test_step."""
    return {"workload": workload, "config": config, "image": 224, "depth": 12, "rounds": 3,
            "step_s": step, "sys_s": sys_s, "cpu_s": 2 * step, "faults_per_step": faults,
            "peak_rss_bytes": rss, "warmup_faults": [5000, 12],
            "nodeid": f"{workload}-{config}", **extra}


def test_cpu_allocator_summary_flags_a_step_target_below_the_kernel_floor() -> None:
    bench = bench_module("bench_cpu_allocator")

    # a step with none of its kernel time: 2 s of wall time, 0.1 s of it kernel
    assert bench.kernel_floor({"step_s": 2.0, "sys_s": 0.1}) == pytest.approx(0.95)

    rec = _cpu_rec
    paired = {"paired_ratios": [0.9], "paired_step_ratio": 0.9, "tuned_paired_ratios": [1.0],
              "tuned_step_ratio": 1.0}
    # no jemalloc or preload rows: configurations that could not run are left out
    lines, data, _ = bench.summarize([
        rec("vit-b8", "glibc", 1.0, 0.02, 100),
        rec("vit-b8", "memguard-inprocess", 0.9, 0.01, 0, kernel_floors=[0.98],
            kernel_floor=0.98, **paired),
        rec("vit-b32", "glibc", 1.0, 0.5, 1000),
        rec("vit-b32", "memguard-inprocess", 0.9, 0.01, 0, kernel_floors=[0.5],
            kernel_floor=0.5, **paired),
    ])
    verdicts = {ln.split()[0]: ln for ln in lines if ln.startswith("  ") and " step " in ln}
    # 0.83 lies below a floor of 0.98, above one of 0.5
    assert "step OVER (target below the kernel-side floor 0.980)" in verdicts["vit-b8"]
    assert "floor" not in verdicts["vit-b32"] and "step OVER" in verdicts["vit-b32"]
    assert data["vit-b8"]["memguard-inprocess"]["kernel_floor"] == 0.98
    assert data["vit-b8"]["glibc"]["warmup_faults"] == [5000, 12]
    assert "  faults a warm-up step: glibc 5,000, 12; memguard-inprocess 5,000, 12" in lines


@pytest.mark.parametrize("faults, rss, step, want", [
    # glibc: 1,000 faults a step, 1 GiB, 1 s (0 faults in the second workload)
    ((10, 0), 1 << 30, 0.8, {"step_ratio": "PASS", "faults_ratio": "PASS",
                             "peak_rss_ratio": "PASS"}),
    ((11, 0), 1 << 30, 0.8, {"faults_ratio": "OVER"}),           # over 1 % of glibc's
    ((0, 1), 1 << 30, 0.8, {"faults_ratio": "OVER"}),            # 1 % of no faults is none
    ((0, 0), (1 << 30) + 1, 0.8, {"peak_rss_ratio": "OVER"}),
    ((0, 0), 1 << 30, 0.84, {"step_ratio": "OVER"}),
])
def test_cpu_allocator_summary_judges_each_target(faults, rss, step, want) -> None:
    """Each target of memguard in-process, met and missed, in made-up runs of
    two workloads: glibc with 1,000 faults a step in one, none in the other."""
    bench = bench_module("bench_cpu_allocator")
    records = []
    for w, glibc_faults, mg_faults in zip(("vit-b8", "vit-b32"), (1000, 0), faults):
        records += [_cpu_rec(w, "glibc", 1.0, 0.02, glibc_faults),
                    _cpu_rec(w, "memguard-inprocess", step, 0.01, mg_faults, rss,
                             paired_step_ratio=step)]
    _, data, _ = bench.summarize(records)
    got = {}
    for w in ("vit-b8", "vit-b32"):
        for k, v in data[w]["memguard-inprocess"]["verdict"].items():
            got[k] = v if got.get(k, "PASS") == "PASS" else got[k]
    assert got == dict({k: "PASS" for k in bench.TARGETS}, **want), data


def _pressure_step(i, s, micro, faults=0, swap=0, peak=1000 * MiB, boundary=1000 * MiB,
                   tried=()):
    """One step of a made-up bench_pressure run (``tried``: the sizes that
    ran out of memory in it)."""
    return {"step": i, "seconds": s, "micro": micro, "major_faults": faults,
            "swap_bytes": swap, "rss_bytes": 2000 * MiB, "peak_bytes": peak,
            "boundary_reserved_bytes": boundary, "tried": list(tried),
            "arena_ooms": len(tried)}


def _oom_start(*micros: int) -> list[dict]:
    """(d)'s steps: out of memory at the whole batch (32) in step 0, redone
    at 16, then ``micros`` (step 1 the last under the lower limit)."""
    return [_pressure_step(0, 8.0, 16, tried=[32])] + \
        [_pressure_step(i, 4.0, m) for i, m in enumerate(micros, 1)]


def _pressure_runs(post: list | None = None, rise: list | None = None,
                   plain_s: float = 20.0, d: list | None = None) -> list[dict]:
    """Made-up bench_pressure runs: (a) 4 steps of plain at ``plain_s``,
    memguard at 4 s; (b) the drop after step 1, then the six post-drop
    ``post`` steps (by default two slow steps, then (a)'s speed); (c) the
    ``rise`` steps (by default the whole batch one step after the rise);
    (d) the steps ``d``, the limit raised after the first (by default out of
    memory at 32 in it, 16 in the next, then the whole batch)."""
    step = _pressure_step
    common = {"batch": 32, "limit": 2200 * MiB, "high": 5000 * MiB, "pre": 2, "post": 6,
              "killed": False, "stopped_by_time": False, "d_limit": 2200 * MiB, "d_pre": 1}
    a_plain = dict(common, mode="plain", scenario="a", nodeid="a-plain",
                   steps=[step(i, plain_s, 32) for i in range(4)])
    a_mg = dict(common, mode="memguard", scenario="a", nodeid="a-mg",
                steps=[step(0, 8.0, 16)] + [step(i, 4.0, 16) for i in range(1, 6)])
    if post is None:
        post = [step(2, 16.0, 32, faults=100000), step(3, 8.0, 16, faults=5000)] + \
            [step(i, 4.0, 16, faults=i % 2) for i in range(4, 8)]
    if rise is None:
        rise = [step(8, 4.0, 16), step(9, 6.0, 32), step(10, 4.0, 32)]
    b_mg = dict(common, mode="memguard", scenario="bc", nodeid="bc-mg",
                steps=[step(0, 6.0, 32), step(1, 4.0, 32)] + post + rise)
    d_mg = dict(common, mode="memguard", scenario="d", nodeid="d-mg",
                steps=_oom_start(16, 32, 32, 32) if d is None else d)
    return [a_plain, a_mg, b_mg, d_mg]


def test_pressure_summary_judges_each_target_from_the_steps() -> None:
    """bench_pressure's verdicts from made-up runs that meet every target."""
    bench = bench_module("bench_pressure")
    lines, data, per_test = bench.summarize(_pressure_runs())
    v = data["verdict"]
    assert data["a"]["throughput_ratio"] == 5.0
    # from the third post-drop step on: 4 x 4 s, (a)'s own speed
    assert data["b"]["settle_steps"] == 2 and v["b_settle_steps"] == "PASS"
    assert data["b"]["throughput_ratio"] == 1.0 and v["b_throughput"] == "PASS"
    assert data["b"]["faults_ratio"] == 1 / 100000 and v["b_faults"] == "PASS"
    assert v["b_swap_share"] == "PASS" and v["b_min_micro"] == "PASS"
    assert data["c"]["steps_to_full"] == 2 and v["c_steps"] == "PASS"
    assert v["boundary"] == "PASS" and per_test["bc-mg"]["settle_steps"] == 2
    # (d): out of memory at 32 in step 0; 32 again at the second step after the rise
    assert data["d"] == {"oom_at_start": True, "tried": [32], "steps_to_full": 2}
    assert v["d_oom_at_start"] == "PASS" and v["d_steps"] == "PASS"
    assert per_test["d-mg"] == {"oom_at_start": True, "steps_to_full_after_rise": 2}
    assert "(d) first step: out of memory at 32, redone at 16; 1 refusal(s) by memguard's " \
        "arena budget  PASS" in lines
    assert set(v.values()) == {"PASS"}
    assert any("(a) memguard / plain throughput 5.00x" in ln and ln.endswith("PASS")
               for ln in lines)


@pytest.mark.parametrize("advice, plain_s, want", [
    ("memguard: 4 DataLoader workers (child processes) hold 780 MiB", 16.0,
     {"f_throughput": "PASS", "f_advice": "PASS"}),
    (None, 9.0, {"f_throughput": "UNDER", "f_advice": "FAIL"})])
def test_pressure_summary_of_the_workers_scenario(advice, plain_s, want) -> None:
    """(f): memguard's throughput against the plain loop's (median step, the
    first left out) and its advice naming the 4 workers, printed."""
    bench = bench_module("bench_pressure")
    common = {"batch": 32, "limit": 2200 * MiB, "high": 5000 * MiB, "pre": 2, "post": 6,
              "killed": False, "stopped_by_time": False, "f_limit": 2200 * MiB,
              "f_workers": 4, "f_worker_bytes": 150 * MiB}
    plain = dict(common, mode="plain", scenario="f", nodeid="f-plain",
                 steps=[_pressure_step(i, plain_s, 32) for i in range(4)])
    mg_steps = [dict(_pressure_step(i, 5.0, 8), children=4, children_bytes=780 * MiB)
                for i in range(4)]
    mg_steps[1]["advice"] = advice
    mg = dict(common, mode="memguard", scenario="f", nodeid="f-mg", steps=mg_steps)
    lines, data, per_test = bench.summarize([plain, mg])
    assert {k: data["verdict"][k] for k in want} == want
    assert data["f"]["throughput_ratio"] == plain_s / 5.0
    assert per_test["f-mg"]["advice"] == advice
    assert any(ln.startswith("(f) memguard ") and "workers 4 holding 780 MiB" in ln
               for ln in lines)
    assert f"(f) memguard's advice: {advice or 'none'}  {want['f_advice']}" in lines


def _slow_post(seconds, micro=16, faults=(0,) * 6, swap=0) -> list[dict]:
    return [_pressure_step(2 + k, s, micro, faults=f, swap=swap)
            for k, (s, f) in enumerate(zip(seconds, faults))]


@pytest.mark.parametrize("case, runs, want", [
    # (a): plain only 2.5x slower than memguard
    ("a", {"plain_s": 10.0}, {"a": "UNDER"}),
    # settles at the fourth post-drop step: throughput from the third 4 x 4 / 28 s
    ("late", {"post": _slow_post([16, 16, 16, 4, 4, 4])},
     {"b_settle_steps": "OVER", "b_throughput": "UNDER"}),
    # never settles, below half (a)'s micro-batch, and swapping
    ("never", {"post": _slow_post([9.0] * 6, micro=4, swap=500 * MiB)},
     {"b_settle_steps": "OVER", "b_throughput": "UNDER", "b_min_micro": "UNDER",
      "b_swap_share": "OVER"}),
    # faults fall to 5 % of the first post-drop step's
    ("faults", {"post": _slow_post([4.0] * 6, faults=(100000, 9, 9, 9, 9, 5000))},
     {"b_faults": "OVER"}),
    # none in the first post-drop step, thousands later: 1 % of none is none
    ("faults-late", {"post": _slow_post([4.0] * 6, faults=(0, 9, 9, 9, 9, 5000))},
     {"b_faults": "OVER"}),
    # never back to the whole batch after the rise
    ("no-growth", {"rise": [_pressure_step(i, 4.0, 16) for i in range(8, 11)]},
     {"c_steps": "OVER"}),
    # reserved at a boundary past 1.25 x the recent peak + 64 MiB
    ("boundary", {"rise": [_pressure_step(8, 4.0, 16), _pressure_step(9, 4.0, 32),
                            _pressure_step(10, 4.0, 32, boundary=1400 * MiB)]},
     {"boundary": "OVER"}),
    # (d), the user's story: the size that failed under 2200 MiB stays a
    # ceiling after the rise, the rest of the run at 16
    ("d-stuck", {"d": _oom_start(16, 16, 16, 16)}, {"d_steps": "OVER"}),
    # whole again, but three steps after the rise
    ("d-late", {"d": _oom_start(16, 16, 32, 32)}, {"d_steps": "OVER"}),
    # no error at the whole batch: it started smaller (the scenario did not happen)
    ("d-no-oom", {"d": [_pressure_step(0, 4.0, 16)] + _oom_start(16, 32)[1:]},
     {"d_oom_at_start": "FAIL"}),
])
def test_pressure_summary_fails_each_missed_target(case: str, runs: dict, want: dict) -> None:
    """A made-up run that misses one target (or a few): those verdicts, and
    only those, say so; PASS elsewhere."""
    bench = bench_module("bench_pressure")
    lines, data, _ = bench.summarize(_pressure_runs(**runs))
    got = dict(data["verdict"], a=next(ln.split()[-1] for ln in lines
                                       if ln.startswith("(a) memguard / plain")))
    assert got == dict({k: "PASS" for k in got}, **want), (data, lines)
    if case == "never":
        assert data["b"]["settle_steps"] is None and "(b) never settles" in "\n".join(lines)
        assert data["b"]["throughput_ratio"] == pytest.approx(4 / 9)
    if case == "no-growth":
        assert any(ln.startswith("(c) never back to the whole batch") for ln in lines)
    if case == "d-stuck":
        assert data["d"]["steps_to_full"] is None
        assert "(d) never back to the whole batch after the rise (target <= 2 steps)  OVER" \
            in lines
    if case == "d-no-oom":
        assert any(ln.startswith("(d) first step: no out-of-memory error at the whole batch")
                   and ln.endswith("FAIL") for ln in lines), lines


def _validation_runs(post: list[float] = (30.0, 11.0, 10.0, 10.0, 10.0),
                     faults: list[int] = (5000, 100, 0, 0, 0), swap: int = 0,
                     plain_post: float = 60.0) -> list[dict]:
    """Made-up bench_pressure (e) runs: three batches of 128 at 10 s before
    the drop, then the plain loop's two at ``plain_post`` s and memguard's
    ``post`` (with those ``faults``, its swap growing by ``swap`` a batch
    from the third)."""
    common = {"batch": 128, "img": 224, "high": 3000 * MiB, "limit": 800 * MiB, "pre": 3,
              "post": 5, "killed": False, "stopped_by_time": False}

    def batch(i, s, micro=128, f=0, sw=0):
        return {"step": i, "seconds": s, "micro": micro, "major_faults": f, "swap_bytes": sw,
                "rss_bytes": 900 * MiB}
    before = [batch(i, 10.0) for i in range(3)]
    plain = dict(common, mode="plain", nodeid="e-plain", stopped_by_time=True,
                 steps=before + [batch(3 + k, plain_post) for k in range(2)])
    mg = dict(common, mode="memguard", nodeid="e-mg", steps=before + [
        batch(3 + k, s, 32, f, max(0, k - 1) * swap) for k, (s, f) in enumerate(zip(post, faults))])
    return [plain, mg]


def test_validation_summary_judges_each_target() -> None:
    """bench_pressure (e)'s verdicts from made-up runs that meet every target:
    settled at the second post-drop batch, (its own pre-drop speed from the
    third on), 4.2x the plain loop's post-drop throughput."""
    bench = bench_module("bench_pressure")
    lines, data, per_test = bench.summarize_validation(_validation_runs())
    e = data["e"]
    assert e["settle_batches"] == 1 and e["throughput_ratio"] == 1.0
    assert e["vs_plain"] == pytest.approx((640 / 71) / (256 / 120))
    assert e["swap_growth_bytes"] == 0 and e["micro_batches"] == [32] * 5
    assert set(data["verdict"].values()) == {"PASS"}, lines
    assert per_test["e-mg"]["settle_batches"] == 1
    assert per_test["e-plain"]["batch_seconds"] == [10.0] * 3 + [60.0] * 2


@pytest.mark.parametrize("runs, want", [
    ({"post": [30.0] * 5}, {"e_settle_batches": "OVER", "e_throughput": "UNDER"}),
    ({"plain_post": 10.0}, {"e_vs_plain": "UNDER"}),     # the plain loop faster
    ({"swap": 20 * MiB}, {"e_swap_growth": "OVER"}),
    ({"faults": [5000, 100, 0, 0, 51]}, {"e_faults": "OVER"}),
])
def test_validation_summary_fails_each_missed_target(runs: dict, want: dict) -> None:
    """A made-up (e) run that misses a target: that verdict says so, the
    others PASS."""
    bench = bench_module("bench_pressure")
    lines, data, _ = bench.summarize_validation(_validation_runs(**runs))
    assert data["verdict"] == dict({k: "PASS" for k in data["verdict"]}, **want), lines


def _cuda_rec(mode: str, budget: int = 0, **kw) -> dict:
    """A made-up record of bench_cuda: 1,000 MiB reserved at the peak, 1,300
    MiB of the device in use (300 MiB of it outside the allocator)."""
    settings = {"batch": 64, "depth": 12, "dim": 384, "image": 224, "steps": 30, "warmup": 5,
                "amp": 0}
    rec = {"mode": mode, "budget_requested_bytes": budget, "settings": settings,
           "device_name": "a GPU", "torch": "2.x", "params": 22_000_000, "alloc_conf": None,
           "step_ms": 50.0, "steps_timed": 30, "steps_failed": 0,
           "reserved_peak_bytes": 1000 * MiB, "reserved_bytes": 1000 * MiB,
           "allocated_peak_bytes": 900 * MiB, "device_used_bytes": 1300 * MiB,
           "device_used_peak_bytes": 1300 * MiB, "device_total_bytes": 80 << 30,
           "num_ooms": 0, "num_alloc_retries": 0, "nodeid": f"cuda-{mode}-{budget}"}
    return dict(rec, **kw)


@pytest.mark.parametrize("memguard, held, want", [
    ({}, {}, {}),
    ({"step_ms": 52.0}, {}, {"step_ratio": "OVER"}),
    ({"reserved_peak_bytes": 1001 * MiB}, {}, {"reserved_peak_ratio": "OVER"}),
    ({"steps_failed": 1, "steps_timed": 29}, {}, {"steps_completed": "FAIL"}),
    # the budget run: a step ran out of memory
    ({}, {"steps_failed": 2, "num_ooms": 2}, {"budget_held": "FAIL"}),
    # the device held 2 MiB more than the budget (its counters say otherwise)
    ({}, {"device_used_peak_bytes": 1302 * MiB}, {"budget_held": "FAIL"}),
    # its own reserved peak over the budget
    ({}, {"reserved_peak_bytes": 1001 * MiB}, {"budget_held": "FAIL"}),
])
def test_cuda_summary_judges_each_target(memguard: dict, held: dict, want: dict) -> None:
    """bench_cuda's verdicts from made-up runs (no GPU needed): the budget run
    under native's 1,000 MiB holds only if every step completes and the
    device memory it holds, less what native's run held outside its
    allocator, stays within the budget."""
    bench = bench_module("bench_cuda")
    records = [_cuda_rec("native"), _cuda_rec("memguard", **memguard),
               _cuda_rec("memguard", 1000 * MiB, num_alloc_retries=1200,
                         **dict({"step_ms": 60.0, "reserved_peak_bytes": 1000 * MiB}, **held))]
    lines, data, per_test = bench.summarize(records)
    keys = ("step_ratio", "reserved_peak_ratio", "steps_completed", "budget_held")
    assert data["verdict"] == dict({k: "PASS" for k in keys}, **want), lines
    b = data["budget_run"]
    assert b["outside_allocator_bytes"] == 300 * MiB
    assert data["budget_held"] is (want.get("budget_held", "PASS") == "PASS")
    assert per_test["cuda-memguard-1048576000"]["budget_held"] == data["verdict"]["budget_held"]
    text = "\n".join(lines)
    assert f"within it  {data['verdict']['budget_held']}" in text, text
    if "device_used_peak_bytes" in held:
        assert b["device_over_budget_bytes"] == 2 * MiB
        assert "the device held 2.0 MiB over the budget" in text


def _thread_rec(interval_ms: int, live_pct: float) -> dict:
    return {"kind": "thread", "interval_ms": interval_ms, "nodeid": f"thread-{interval_ms}",
            "target_pct": {100: 0.1, 10: 1.0}[interval_ms], "live_pct": live_pct,
            "empty_roots_pct": live_pct / 2, "sources_pct": live_pct / 2,
            "live_us_per_wake": 50.0, "empty_roots_us_per_wake": 25.0,
            "sources_us_per_wake": 25.0, "wakes_per_window": 30.0,
            "live_pct_rounds": [live_pct]}


def test_sampler_summary_judges_the_thread_against_its_targets() -> None:
    """The sampling thread's CPU share, under and over its target at each interval."""
    bench = bench_module("bench_sampler")
    _, data, per_test = bench.summarize([_thread_rec(100, 0.09), _thread_rec(10, 1.2)])
    assert data["thread"]["100ms"]["verdict"] == "PASS"
    assert data["thread"]["10ms"]["verdict"] == "OVER"
    assert per_test["thread-10"]["live_over_target"] == pytest.approx(1.2)
    _, data, _ = bench.summarize([_thread_rec(100, 0.11), _thread_rec(10, 0.9)])
    assert [data["thread"][k]["verdict"] for k in ("100ms", "10ms")] == ["OVER", "PASS"]


@pytest.mark.parametrize("peak_mb, want", [(90.0, "PASS"), (250.0, "OVER")])
def test_report_summary_judges_the_peak_rss(peak_mb: float, want: str) -> None:
    bench = bench_module("bench_report")
    rec = {"file_mb": 500.0, "samples": 255000, "events": 25000, "write_s": 300.0,
           "wall_s": 70.0, "peak_rss_mb": peak_mb, "small_wall_s": 2.0,
           "small_peak_rss_mb": 80.0, "output": "", "nodeid": "report"}
    lines, data, _ = bench.summarize([rec])
    assert data["verdict"] == want and lines[1].endswith(f"  {want}")


def _throttle_runs(overhead: float = 1.01, throughput: float = 0.9,
                   cost: float = 1.3) -> list[dict]:
    """Made-up bench_throttle records: each part's figure as given."""
    run = {"part": "constrained", "steps_planned": 16, "steps_done": 16, "steps_lost": 0,
           "restarts": 0, "batch": 64, "failed": None, "peak_bytes": 100 * MiB,
           "budget_bytes": 160 * MiB}
    return [
        {"part": "overhead", "step_s": 0.2 * overhead, "plain_step_s": 0.2, "nodeid": "ov",
         "paired_ratios": [overhead, overhead], "ratio": overhead},
        dict(run, mode="unconstrained", throughput=100.0, budget_bytes=0, nodeid="c-u"),
        dict(run, mode="memguard", throughput=100.0 * throughput, micro_batches=[8, 64],
             ooms_recovered=1, paired_ratios=[throughput], ratio=throughput, nodeid="c-m"),
        {"part": "oom", "step": "whole", "step_s": 0.2, "relief_s": None, "nodeid": "o-w"},
        {"part": "oom", "step": "half", "step_s": 0.22, "relief_s": None, "nodeid": "o-h"},
        {"part": "oom", "step": "recovered", "step_s": 0.2 * cost, "relief_s": 0.01,
         "paired_ratios": [cost], "ratio": cost, "nodeid": "o-r"},
    ]


@pytest.mark.parametrize("figures, want", [
    ({}, {}),
    ({"overhead": 1.03}, {"overhead": "OVER"}),
    ({"throughput": 0.6}, {"constrained": "UNDER"}),
    ({"cost": 1.6}, {"oom": "OVER"}),
])
def test_throttle_summary_judges_each_target(figures: dict, want: dict) -> None:
    bench = bench_module("bench_throttle")
    _, data, _ = bench.summarize(_throttle_runs(**figures))
    got = {k: data[k]["verdict"] for k in ("overhead", "constrained", "oom")}
    assert got == dict({k: "PASS" for k in got}, **want)


def _gpu_step(i: int, ms: float, micro: int = 128, n_micro: int = 2, ok: bool = True) -> dict:
    """One step of a made-up bench_gpu_pressure run."""
    return {"step": i, "seconds": ms / 1e3, "ok": ok, "micro": micro, "n_micro": n_micro,
            "retries": 0, "loss": 6.9}


def _gpu_runs(no_pressure: float = 1.01, plain_fits: bool = False, mg_ms: float = 205.0,
              whole_after: int | None = 1, taken_ms: float = 205.0, taken_fails: bool = False,
              splits_fit: bool = True) -> list[dict]:
    """Made-up bench_gpu_pressure records (its quick settings: 8 steps, the
    event after 4, settled from step 3): hand-written 128 x 2 at 200 ms a
    step is the reference (86 x 3 fits too, slower); memguard recovers its
    first step, then runs at ``mg_ms``; freed, the whole batch
    ``whole_after`` steps after the rise; taken, ``taken_ms`` after it."""
    bench = bench_module("bench_gpu_pressure")
    s = dict(bench.QUICK)
    info = {"device_name": "a GPU", "torch": "2.x", "model": "ViT", "params": 86_000_000}
    step = _gpu_step
    pressure = {"level": 20 << 30, "settings": s, "info": info, "planned": s["steps"]}
    plain = dict(pressure, scenario="pressure", mode="plain", nodeid="p-plain",
                 steps=[step(i, 150, 256, 1) for i in range(8)] if plain_fits else
                 [step(0, 90, ok=False)], planned=8)
    split = {"scenario": "pressure", "mode": "split", "settings": s, "level": 20 << 30,
             "nodeid": "p-split", "splits": [
                 {"n_micro": 2, "micro": 128, "fits": splits_fit,
                  "steps": [step(i, 300 if i == 0 else 200) for i in range(4)] if splits_fit
                  else [step(0, 100, ok=False)]},
                 {"n_micro": 3, "micro": 86, "fits": splits_fit,
                  "steps": [step(i, 260, 86, 3) for i in range(4)] if splits_fit
                  else [step(0, 100, ok=False)]}]}
    mg = dict(pressure, scenario="pressure", mode="memguard", nodeid="p-mg",
              steps=[step(0, 500)] + [step(i, mg_ms) for i in range(1, 8)])
    post = [step(4 + i, 150, 256, 1) if whole_after is not None and i + 1 >= whole_after
            else step(4 + i, 200) for i in range(4)]
    freed = dict(pressure, scenario="freed", mode="memguard", nodeid="freed", event_after=4,
                 free_after_event=70 << 30, steps=[step(i, 200) for i in range(4)] + post)
    after = [step(4, 220)] + [step(i, taken_ms) for i in range(5, 8)]
    if taken_fails:
        after = [step(4, 220, ok=False)]
    taken = dict(pressure, scenario="taken", mode="memguard", nodeid="taken", event_after=4,
                 free_after_event=256 << 20, steps=[step(i, 200) for i in range(4)] + after)
    no = {"scenario": "no_pressure", "settings": s, "info": info, "nodeid": "np",
          "plain_burst_s": [0.3] * 6, "memguard_burst_s": [0.3 * no_pressure] * 6}
    return [no, plain, split, mg, freed, taken]


def test_gpu_pressure_summary_judges_each_target() -> None:
    """bench_gpu_pressure's verdicts from made-up runs that meet every target."""
    bench = bench_module("bench_gpu_pressure")
    lines, data, per_test = bench.summarize(_gpu_runs())
    assert data["verdict"] == {"no_pressure": "PASS", "pressure_binds": "PASS",
                               "throughput": "PASS", "steps_to_whole": "PASS",
                               "take_throughput": "PASS", "completed": "PASS"}, lines
    assert data["reference"] == {"throughput": pytest.approx(256 / 0.2), "n_micro": 2}
    assert data["pressure"]["ratio"] == pytest.approx(200 / 205)
    assert data["no_pressure"]["ratio"] == pytest.approx(1.01)
    assert data["freed"]["steps_to_whole"] == 1 and per_test["freed"]["steps_to_whole"] == 1
    assert data["taken"]["ratio"] == pytest.approx(200 / 205)
    text = "\n".join(lines)
    assert "out of memory at step 0, as expected  PASS" in text, text
    assert "hand-written   86 x 3:" in text and "200ms@128x2" in text
    got = bench.parse_settings(bench.QUICK, "batch=128,free=12GiB,room_share=0.6")
    assert (got["batch"], got["free"], got["room_share"]) == (128, 12 << 30, 0.6)
    with pytest.raises(ValueError, match="no setting 'bach'"):
        bench.parse_settings(bench.QUICK, "bach=128")


@pytest.mark.parametrize("made_up, want", [
    ({"no_pressure": 1.03}, {"no_pressure": "OVER"}),
    # the plain loop fit: the holder did not make the batch too large
    ({"plain_fits": True}, {"pressure_binds": "FAIL"}),
    ({"mg_ms": 215.0}, {"throughput": "UNDER"}),
    ({"whole_after": 3}, {"steps_to_whole": "OVER"}),
    ({"whole_after": None}, {"steps_to_whole": "OVER"}),
    ({"taken_ms": 215.0}, {"take_throughput": "UNDER"}),
    ({"taken_fails": True}, {"take_throughput": "FAIL", "completed": "FAIL"}),
    # no hand-written split fits: nothing to judge the throughputs against
    ({"splits_fit": False}, {"throughput": "-", "take_throughput": "-"}),
])
def test_gpu_pressure_summary_fails_each_missed_target(made_up: dict, want: dict) -> None:
    """A made-up run that misses one target: that verdict, and only that one,
    says so."""
    bench = bench_module("bench_gpu_pressure")
    lines, data, _ = bench.summarize(_gpu_runs(**made_up))
    assert data["verdict"] == dict({k: "PASS" for k in data["verdict"]}, **want), lines
    if made_up.get("whole_after", 1) is None:
        assert "never the whole batch after the rise" in "\n".join(lines)


def test_gpu_pressure_holder_holds_what_it_is_told() -> None:
    """The holder process over its pipe, on a made-up 8 GiB device: it holds
    so that the free memory is what it is told (more, less, within its
    tolerance), gives everything back, and stops where it holds nothing."""
    benchlib = bench_module("benchlib")
    bench = bench_module("bench_gpu_pressure")
    gib, tol = 1 << 30, 32 << 20
    with benchlib.Worker(bench.__file__, ["holder", f"fake:{8 * gib}"]) as w:
        for free in (3 * gib, gib, int(6.5 * gib), 5 * gib + 12345):
            r = w.call("hold", free=free)
            assert abs(r["free"] - free) <= tol and r["held"] == 8 * gib - r["free"], (free, r)
        assert w.call("release") == {"free": 8 * gib, "held": 0}
        assert w.call("hold", free=9 * gib) == {"free": 8 * gib, "held": 0, "target": 9 * gib}
        assert w.call("free") == {"free": 8 * gib, "held": 0}
