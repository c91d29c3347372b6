"""The benchmark suite runs under pytest-benchmark and its JSON holds the ratios.

``make bench`` runs ``pytest benchmarks/ --benchmark-only``; here a subset of
it runs with ``--bench-quick`` (smoke-sized workloads), in a subprocess, and
the figures that the targets are about are read back from the benchmark JSON
and the terminal summary. Speed is not judged here: the figures of a quick
run measure nothing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("pytest_benchmark")
pytest.importorskip("torch")


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
                   "benchmarks/bench_pressure.py::test_limit_lowered_then_raised[memguard]"):
        assert wanted in ids, sorted(ids)
    # and `make test` does not run them: tests/ is the only test path
    out = run_bench(tmp_path, "--collect-only", "-q")
    assert "benchmarks/" not in out.stdout


def test_quick_subset_stores_the_ratios_in_the_json(tmp_path) -> None:
    js = tmp_path / "bench.json"
    nodes = [
        "benchmarks/bench_cpu_allocator.py::test_step[vit-b8-glibc]",
        "benchmarks/bench_cpu_allocator.py::test_step[vit-b8-memguard-inprocess]",
        "benchmarks/bench_throttle.py::test_overhead",
        "benchmarks/bench_throttle.py::test_oom_step",
        "benchmarks/bench_throttle.py::test_constrained[unconstrained]",
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
    # the kernel's share of a step: CPU seconds, at most all of the step's CPU
    for c in ("glibc", "memguard-inprocess"):
        assert 0 <= cpu[c]["sys_s"] <= cpu[c]["cpu_s"], cpu[c]

    thr = mg["throttle"]
    assert len(thr["overhead"]["paired_ratios"]) == 2
    assert thr["overhead"]["ratio"] > 0
    assert thr["oom"]["cost_ratio"] > 1.0      # a failed attempt is never free
    # the recovered step is paired with a whole-batch step, round by round
    assert len(thr["oom"]["paired_ratios"]) == 1
    assert thr["oom"]["cost_ratio"] == pytest.approx(thr["oom"]["paired_ratios"][0])
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


def test_throttle_overhead_summary_judges_the_paired_processes() -> None:
    """bench_throttle's overhead from made-up rounds: guard.step in a guarded
    process against a plain step in a process without memguard, judged on
    the median of the paired ratios (OVER above 1.02, PASS at or below)."""
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
    assert "   median 1.050  (target <= 1.02)  OVER;  steps 260 ms guarded, 250 ms plain " \
        "(medians)" in lines
    assert "   rounds 1.040, 1.070, 0.980, 1.060, 1.050" in lines
    assert any("a process without memguard" in ln for ln in lines)
    assert "constrained" not in data and "oom" not in data     # only what was measured

    _, data, _ = bench.summarize([rec([1.03, 0.99, 1.02])])
    assert data["overhead"]["verdict"] == "PASS"               # at the target passes


def test_cpu_allocator_summary_flags_a_step_target_below_the_kernel_floor() -> None:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_cpu_allocator as bench

    # a step with none of its kernel time: 2 s of wall time, 0.1 s of it kernel
    assert bench.kernel_floor({"step_s": 2.0, "sys_s": 0.1}) == pytest.approx(0.95)

    def rec(workload: str, config: str, step: float, sys_s: float, faults: int, **extra):
        return {"workload": workload, "config": config, "image": 224, "rounds": 3,
                "step_s": step, "sys_s": sys_s, "cpu_s": 2 * step, "faults_per_step": faults,
                "peak_rss_bytes": 1 << 30, "warmup_faults": [5000, 12],
                "nodeid": f"{workload}-{config}", **extra}

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


def test_pressure_summary_judges_each_target_from_the_steps() -> None:
    """bench_pressure's verdicts from made-up runs: (a) 4 steps of plain at
    20 s, memguard at 4 s; (b) the drop after step 1, two slow steps, then
    (a)'s speed; (c) the whole batch one step after the rise."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_pressure as bench

    MiB = 2**20

    def step(i, s, micro, faults=0, swap=0, peak=1000 * MiB, boundary=1000 * MiB):
        return {"step": i, "seconds": s, "micro": micro, "major_faults": faults,
                "swap_bytes": swap, "rss_bytes": 2000 * MiB, "peak_bytes": peak,
                "boundary_reserved_bytes": boundary}

    common = {"batch": 32, "limit": 2200 * MiB, "high": 5000 * MiB, "pre": 2, "post": 6,
              "killed": False, "stopped_by_time": False}
    a_plain = dict(common, mode="plain", scenario="a", nodeid="a-plain",
                   steps=[step(i, 20.0, 32) for i in range(4)])
    a_mg = dict(common, mode="memguard", scenario="a", nodeid="a-mg",
                steps=[step(0, 8.0, 16)] + [step(i, 4.0, 16) for i in range(1, 6)])
    post = [step(2, 16.0, 32, faults=100000), step(3, 8.0, 16, faults=5000)] + \
        [step(i, 4.0, 16, faults=i % 2) for i in range(4, 8)]
    b_mg = dict(common, mode="memguard", scenario="bc", nodeid="bc-mg",
                steps=[step(0, 6.0, 32), step(1, 4.0, 32)] + post +
                [step(8, 4.0, 16), step(9, 6.0, 32), step(10, 4.0, 32)])
    lines, data, per_test = bench.summarize([a_plain, a_mg, b_mg])
    v = data["verdict"]
    assert data["a"]["throughput_ratio"] == 5.0
    # from the third post-drop step on: 4 x 4 s, (a)'s own speed
    assert data["b"]["settle_steps"] == 2 and v["b_settle_steps"] == "PASS"
    assert data["b"]["faults_ratio"] == 1 / 100000 and v["b_faults"] == "PASS"
    assert v["b_swap_share"] == "PASS" and v["b_min_micro"] == "PASS"
    assert data["c"]["steps_to_full"] == 2 and v["c_steps"] == "PASS"
    assert v["boundary"] == "PASS" and per_test["bc-mg"]["settle_steps"] == 2
    # a run that never settles and plans below half of (a)'s size
    slow = dict(b_mg, steps=[step(0, 6.0, 32), step(1, 4.0, 32)] +
                [step(i, 9.0, 4, swap=500 * MiB) for i in range(2, 8)])
    _, data, _ = bench.summarize([a_plain, a_mg, slow])
    v = data["verdict"]
    assert data["b"]["settle_steps"] is None and v["b_settle_steps"] == "-"
    assert v["b_min_micro"] == "UNDER" and v["b_swap_share"] == "OVER"
    assert data["c"]["steps_to_full"] is None
    assert any("(a) memguard / plain throughput 5.00x" in ln for ln in lines)
