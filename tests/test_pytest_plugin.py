"""The pytest plugin (memguard.integrations.pytest_plugin), driven through pytester.

Every run is a pytest subprocess: memguard's arena is process-global, so a
budget installed by the plugin must not leak into this process. The plugin
is blocked by its entry-point name and loaded by module, which works
whether or not the installed package registers the entry point.
"""
from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest

pytest_plugins = ["pytester"]

PLUGIN = ("-p", "no:memguard", "-p", "memguard.integrations.pytest_plugin")
MiB = 1 << 20

# Looked up, not imported: pytester puts sys.modules back after each test, and
# torch cannot be imported twice into one process.
needs_torch_linux = pytest.mark.skipif(
    not sys.platform.startswith("linux") or importlib.util.find_spec("torch") is None,
    reason="memguard's allocator needs torch on Linux (ELF)")

BUDGET_TESTS = '''
import pytest
import torch
import memguard as mg

MiB = 1 << 20


@pytest.mark.memguard(budget="512MiB")
def test_under_budget():
    assert mg.installed()
    t = torch.ones(32 * MiB, dtype=torch.uint8)
    assert int(t.sum()) == 32 * MiB


@pytest.mark.memguard(budget="64MiB")
def test_over_budget_swallowed():
    with pytest.raises(RuntimeError):
        torch.empty(256 * MiB, dtype=torch.uint8)


@pytest.mark.memguard(budget="64MiB")
def test_over_budget_raises():
    torch.empty(256 * MiB, dtype=torch.uint8)


def test_next_unaffected():
    assert not mg.installed()
    assert mg.stats()["budget_bytes"] == 0
    t = torch.ones(128 * MiB, dtype=torch.uint8)
    assert int(t[::4096].sum()) == 128 * MiB // 4096


@pytest.mark.memguard(max_rss="32MiB")
def test_rss_over_limit():
    t = torch.ones(96 * MiB, dtype=torch.uint8)
    del t


@pytest.mark.memguard(budget="256MiB", max_rss="1GiB")
def test_both_limits_held(memguard):
    assert memguard.budget_bytes == 256 * MiB
    assert memguard.sampler is not None and memguard.sampler.running
    t = torch.ones(16 * MiB, dtype=torch.uint8)
    assert memguard.test_figures()["rss_peak_bytes"] > 0
    del t
'''


@needs_torch_linux
def test_budget_marker_fails_the_test_and_is_removed_after(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_budget=BUDGET_TESTS)
    result = pytester.runpytest_subprocess(*PLUGIN, "--strict-markers", "-rA", timeout=120)
    out = result.stdout.str()
    result.assert_outcomes(passed=3, failed=3)
    for name in ("test_under_budget", "test_next_unaffected", "test_both_limits_held"):
        assert f"PASSED test_budget.py::{name}" in out
    for name in ("test_over_budget_swallowed", "test_over_budget_raises", "test_rss_over_limit"):
        assert f"FAILED test_budget.py::{name}" in out
    # the swallowed refusal fails the test with the budget, the peaks and the allocation
    # (the report sections; the short summary may repeat them, by terminal width)
    budget_msgs = re.findall(r"^memguard budget '64MiB' \(64\.0 MiB\) exceeded: .*", out,
                             re.MULTILINE)
    assert len(budget_msgs) == 2, out
    for msg in budget_msgs:
        assert re.search(r"the one that crossed the budget asked for "
                         r"(256\.0 MiB \(268435456 bytes\)|an unknown size)", msg), msg
        assert "peak allocated" in msg and "peak reserved" in msg
    # the test that raised keeps its own error, the budget comes as a section
    assert "DefaultCPUAllocator: can't allocate memory" in out
    assert re.search(r"-+ memguard -+", out)
    assert re.search(r"memguard max_rss '32MiB' \(32\.0 MiB\) exceeded: RSS grew by "
                     r"(9[0-9]|1[0-9]{2})\.\d MiB", out), out
    # the marker alone prints no summary
    assert "by peak RSS" not in out


FIGURE_TESTS = '''
import pytest
import torch

MiB = 1 << 20


def test_touch_200():
    t = torch.ones(200 * MiB, dtype=torch.uint8)
    assert int(t[::4096].sum()) == 200 * MiB // 4096


def test_small():
    assert sum(range(1000)) == 499500


@pytest.mark.memguard(budget="1GiB")
def test_tensor_peak():
    t = torch.ones(8 * MiB, dtype=torch.uint8)
    del t


def test_fixture(memguard):
    assert memguard.budget_bytes == 0
    figures = memguard.test_figures()
    assert figures["rss_peak_bytes"] >= figures["rss_start_bytes"] > 0


def test_bench(benchmark):
    benchmark.pedantic(lambda: bytearray(MiB), rounds=3)
'''


@needs_torch_linux
def test_summary_json_and_benchmark_figures(pytester: pytest.Pytester) -> None:
    if importlib.util.find_spec("pytest_benchmark") is None:
        pytest.skip("pytest-benchmark is not installed")
    pytester.makepyfile(test_figures=FIGURE_TESTS)
    path = pytester.path / "out" / "memguard.json"
    bench = pytester.path / "bench.json"
    result = pytester.runpytest_subprocess(
        *PLUGIN, "--memguard", "--memguard-top", "2", f"--memguard-json={path}",
        f"--benchmark-json={bench}", timeout=120)
    result.assert_outcomes(passed=5)
    lines = result.stdout.lines
    at = next(i for i, line in enumerate(lines) if "memguard: top 2 of 5 tests by peak RSS" in line)
    assert lines[at + 1].split()[:2] == ["peak", "RSS"]
    top = lines[at + 2:at + 4]
    assert any(line.endswith("test_figures.py::test_touch_200") for line in top), top
    assert f"written to {path}" in result.stdout.str()

    doc = json.loads(path.read_text())
    tests = {t["nodeid"]: t for t in doc["tests"]}
    assert len(tests) == 5 and doc["window"] == "setup+call"
    touch = tests["test_figures.py::test_touch_200"]
    assert touch["outcome"] == "passed" and touch["duration_s"] > 0
    assert touch["rss_growth_bytes"] >= 150 * MiB
    assert touch["rss_peak_bytes"] >= touch["rss_start_bytes"] + touch["rss_growth_bytes"]
    assert touch["page_faults"] >= 150 * MiB // 4096 // 512   # 4 KiB pages, or 2 MiB ones
    assert touch["tensor_peak_bytes"] is None                 # no arena in this test
    assert touch["pressure_level_max"] in ("OK", "ELEVATED", "HIGH", "CRITICAL")
    assert touch["gc_time_s"] >= 0 and touch["gc_collections"] >= 0
    peak = tests["test_figures.py::test_tensor_peak"]
    assert 8 * MiB <= peak["tensor_peak_bytes"] <= 10 * MiB   # size classes round up by 25 %
    assert peak["budget_bytes"] == 1 << 30 and peak["arena_ooms"] == 0
    assert tests["test_figures.py::test_small"]["rss_growth_bytes"] < 32 * MiB

    extra = json.loads(bench.read_text())["benchmarks"][0]["extra_info"]
    assert extra["memguard_rss_peak_bytes"] > 0
    assert "memguard_tensor_peak_bytes" in extra
    assert extra["memguard_faults_per_round"] == extra["memguard_page_faults"] / 3
    assert extra["memguard_pressure_level_max"] in ("OK", "ELEVATED", "HIGH", "CRITICAL")


def test_bad_marker_is_a_collection_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_bad='''
        import pytest

        @pytest.mark.memguard(budget="lots")
        def test_lots():
            pass

        @pytest.mark.memguard(bogus=1)
        def test_bogus():
            pass

        @pytest.mark.memguard("1GiB")
        def test_positional():
            pass
    ''')
    result = pytester.runpytest_subprocess(*PLUGIN, "--strict-markers", timeout=60)
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    assert "ERROR collecting test_bad.py" in out
    assert "test_bad.py::test_lots: @pytest.mark.memguard(budget='lots'): budget 'lots'" in out
    assert "test_bad.py::test_bogus: @pytest.mark.memguard has no argument bogus=1" in out
    assert "not positional '1GiB'" in out


PLAIN_TESTS = '''
import pytest


def test_pass():
    assert [0] * 1000


def test_fail():
    assert 1 == 2


@pytest.mark.skip(reason="skipped")
def test_skip():
    pass
'''


def test_inactive_unless_asked(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain=PLAIN_TESTS)
    blocked = pytester.runpytest_subprocess("-p", "no:memguard", timeout=60)
    loaded = pytester.runpytest_subprocess(*PLUGIN, timeout=60)
    for result in (blocked, loaded):
        result.assert_outcomes(passed=1, failed=1, skipped=1)
        assert "memguard" not in result.stdout.str()
    assert not [p for p in pytester.path.rglob("*") if p.suffix == ".json" or "memguard" in p.name]
    # asked for, the same tests keep their outcomes
    asked = pytester.runpytest_subprocess(*PLUGIN, "--memguard", timeout=60)
    asked.assert_outcomes(passed=1, failed=1, skipped=1)
    assert "memguard: top 3 of 3 tests by peak RSS" in asked.stdout.str()


def test_peak_rss_without_clear_refs(pytester: pytest.Pytester) -> None:
    # where /proc/self/clear_refs cannot be written, ru_maxrss stands in
    pytester.makeconftest('''
        from memguard.train.peaks import RssPeak

        RssPeak.reset_peak = lambda self: False
    ''')
    pytester.makepyfile(test_hog='''
        def test_hog():
            x = b"\\x01" * (768 << 20)   # past any peak of the start-up
            del x

        def test_after():
            pass
    ''')
    path = pytester.path / "figures.json"
    # through a small shell that forks it: a process exec'd straight from
    # this one starts with this one's high-water mark as its ru_maxrss
    cmd = " ".join([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *PLUGIN,
                    f"--memguard-json={path}"])
    result = pytester.run("sh", "-c", f"{cmd}; exit $?", timeout=60)
    result.assert_outcomes(passed=2)
    hog, after = json.loads(path.read_text())["tests"]
    assert hog["rss_peak_source"] == after["rss_peak_source"] == "ru_maxrss"
    assert hog["rss_growth_bytes"] >= 512 * MiB       # a new high for the process: exact
    assert 0 <= after["rss_growth_bytes"] < 32 * MiB  # no new high: a lower bound
