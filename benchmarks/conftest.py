"""memguard's benchmark suite on pytest-benchmark.

``make bench`` runs ``pytest benchmarks/ --benchmark-only``. pytest-benchmark
times each configuration; the side-by-side figures the targets are about
(ratios against plain glibc, against a plain training loop, against an
unconstrained run) are computed here from the figures each benchmark
records, printed in the terminal summary and stored in the benchmark JSON:
under ``"memguard"`` at the top level, and each benchmark's own ratios in its
``extra_info``.

``--bench-quick`` shrinks every workload to a smoke run (seconds, not
minutes); its figures say nothing about speed.
"""
from __future__ import annotations

import pytest

from benchlib import Figures

_FIGURES = Figures()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("memguard benchmarks")
    group.addoption("--bench-quick", action="store_true",
                    help="small workloads and few rounds: checks the suite runs, "
                         "measures nothing")
    group.addoption("--bench-cuda-amp", action="store_true",
                    help="bench_cuda: bfloat16 autocast instead of fp32")
    group.addoption("--bench-gpu-pressure", default=None, metavar="KEY=VALUE,...",
                    help="bench_gpu_pressure: settings to change (batch=128,free=12GiB,...)")


@pytest.fixture(scope="session")
def quick(request: pytest.FixtureRequest) -> bool:
    """True under --bench-quick."""
    return bool(request.config.getoption("--bench-quick"))


@pytest.fixture(scope="session")
def figures() -> Figures:
    """The session's figures, summarised at the end."""
    return _FIGURES


def _summaries(config: pytest.Config) -> dict:
    cached = getattr(config, "_memguard_bench_summaries", None)
    if cached is None:
        cached = _FIGURES.summarize()
        config._memguard_bench_summaries = cached
    return cached


def pytest_benchmark_update_json(config: pytest.Config, benchmarks: list,
                                 output_json: dict) -> None:
    summaries = _summaries(config)
    per_test: dict[str, dict] = {}
    for _, _, each in summaries.values():
        per_test.update(each)
    for bench in output_json.get("benchmarks", []):
        extra = per_test.get(bench.get("fullname"))
        if extra:
            bench.setdefault("extra_info", {}).update(extra)
    output_json["memguard"] = {name: data for name, (_, data, _) in summaries.items()}
    output_json["memguard"]["quick"] = bool(config.getoption("--bench-quick"))


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    summaries = _summaries(config)
    if not summaries:
        return
    tr = terminalreporter
    tr.write_sep("=", "memguard: side-by-side figures")
    if config.getoption("--bench-quick"):
        tr.write_line("(--bench-quick: smoke-sized workloads; these figures measure nothing)")
    for name, (lines, _, _) in summaries.items():
        tr.write_line("")
        tr.write_line(_FIGURES.titles[name], bold=True)
        for line in lines:
            tr.write_line(line)
