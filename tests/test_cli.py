"""The memguard command: sample, watch, doctor and the demo."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memguard.telemetry import Level, read_jsonl


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
    path = tmp_path / "w.jsonl"
    out = run("watch", "--interval", "20", "--duration", "0.6", "--print-every", "0.2",
              "--export", str(path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("rss ") >= 2
    _, samples, _ = read_jsonl(path)
    assert 15 <= len(samples) <= 40


def test_bad_budget_is_an_error_message_not_a_traceback():
    out = run("watch", "--budget", "lots", "--duration", "0.1")
    assert out.returncode == 2
    assert "'lots'" in out.stderr and "Traceback" not in out.stderr


def test_doctor_runs():
    out = run("doctor")
    assert out.returncode == 0, out.stderr
    assert "PSI" in out.stdout or "psi" in out.stdout


@pytest.mark.slow
def test_demo_shows_pressure_rising_and_falling(tmp_path):
    path = tmp_path / "demo.jsonl"
    out = run("demo", "--seconds", "9", "--validate-every", "1", "--out", str(path),
              timeout=180)
    assert out.returncode == 0, out.stderr
    assert "done:" in out.stdout and str(path) in out.stdout
    meta, samples, events = read_jsonl(path)
    assert meta["demo"] == "cpu-vit" and samples
    levels = [s.level for s in samples]
    assert max(levels) >= Level.HIGH  # the validation leak crossed the budget
    kinds = [e["event"] for e in events]
    assert "validation_start" in kinds and "trim" in kinds
    rises = [e for e in events if e["event"] == "pressure"]
    assert rises and all(e["old"] != e["new"] for e in rises)
    assert all(s.budget_bytes == meta["budget_bytes"] for s in samples)
