"""The memguard command: sample, watch, doctor and the demo."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memguard.cli.watch import format_line
from memguard.telemetry import Level, read_jsonl

from .conftest import check_pace


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memguard", *args], capture_output=True, check=False,
                          text=True, timeout=timeout)


def test_sample_json():
    out = run("sample", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["rss_bytes"] > 0 and d["level"] in Level.__members__


def test_sample_line():
    out = run("sample")
    assert out.returncode == 0 and out.stdout.startswith("rss ")


def test_watch_exports_and_stops(tmp_path):
    """It stops after --duration with every sample exported, sampled no
    faster than --interval, and prints the samples --print-every apart:
    checked against the samples' own times, which a loaded machine only
    makes fewer and later."""
    path = tmp_path / "w.jsonl"
    out = run("watch", "--interval", "20", "--duration", "0.6", "--print-every", "0.2",
              "--export", str(path))
    assert out.returncode == 0, out.stderr
    _, samples, _ = read_jsonl(path)
    assert [s.seq for s in samples] == list(range(1, len(samples) + 1))
    check_pace(samples[1:], 0.02)  # the first is the sources' check, before the thread
    shown, last = [], 0.0
    for s in samples:
        if s.t - last >= 0.2:
            shown.append(format_line(s))
            last = s.t
    assert [ln for ln in out.stdout.splitlines() if ln.startswith("rss ")] == shown


def test_bad_budget_is_an_error_message_not_a_traceback():
    out = run("watch", "--budget", "lots", "--duration", "0.1")
    assert out.returncode == 2
    assert "'lots'" in out.stderr and "Traceback" not in out.stderr


def test_doctor_runs():
    out = run("doctor")
    assert out.returncode == 0, out.stderr
    assert "PSI" in out.stdout or "psi" in out.stdout


@pytest.mark.slow
def test_demo_under_a_budget_stays_within_it(tmp_path):
    """Budget-only: memguard's run alone, every step done, its process never
    above its budget line, and the side-by-side figure drawn."""
    out = run("demo", "--budget-only", "--steps", "2", "--limit", "1000MiB",
              "--out", str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "memguard: 2/2 steps, done" in out.stdout
    summary = json.loads((tmp_path / "demo-summary.json").read_text())
    assert summary["cgroup"] is False and [r["mode"] for r in summary["runs"]] == ["memguard"]
    _, samples, events = read_jsonl(tmp_path / "demo-memguard.jsonl")
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 2 and samples
    assert all(s.budget_bytes <= 1000 * 2**20 for s in samples)
    # the footprint stays under the budget; the first samples, taken while
    # the guard installs, are of the interpreter and torch alone
    assert max(s.footprint_bytes for s in samples) <= 1000 * 2**20
    assert (tmp_path / "demo-report.png").stat().st_size > 10_000


@pytest.mark.slow
def test_demo_side_by_side_under_a_limit(tmp_path):
    """Under a real memory limit (root, a memory cgroup) and no swap file:
    the plain loop is killed by the kernel, or, where the machine swaps,
    falls behind; memguard's run does every step."""
    from memguard.memory import limits
    why = limits.unavailable(swap=False)
    if why:
        pytest.skip(f"no memory cgroup here: {why}")
    out = run("demo", "--steps", "2", "--limit", "1000MiB", "--plain-seconds", "60",
              "--out", str(tmp_path), timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((tmp_path / "demo-summary.json").read_text())
    plain, mg = summary["runs"]
    assert summary["cgroup"] and plain["mode"] == "plain" and mg["mode"] == "memguard"
    assert mg["done"] == 2 and mg["end"] == "done"
    assert plain["killed"] or plain["done"] < 2 or "stopped" in plain["end"]
    _, samples, _ = read_jsonl(tmp_path / "demo-memguard.jsonl")
    assert max(s.footprint_bytes for s in samples) <= 1000 * 2**20