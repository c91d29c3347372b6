"""The CI scripts fail when what they run fails. ``.ci/gpu`` runs only on a
machine with an NVIDIA GPU, so here it runs against stand-ins for
``nvidia-smi`` and ``python3`` that record each call and fail the ones a test
names; what is checked is the script's own control flow."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STAND_IN = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
case "$*" in *"$FAIL_ON"*) [ -n "$FAIL_ON" ] && exit 1;; esac
exit 0
"""


def _run_gpu_script(tmp_path: Path, fail_on: str) -> tuple[int, list[str]]:
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "gpu", repo / ".ci" / "gpu")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python3", "nvidia-smi"):
        (bin_dir / name).write_text(STAND_IN)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls),
           "FAIL_ON": fail_on, "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", str(repo / ".ci" / "gpu")], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    return proc.returncode, calls.read_text().splitlines()


def test_gpu_script_passes_when_every_step_passes(tmp_path):
    rc, calls = _run_gpu_script(tmp_path, fail_on="")
    assert rc == 0
    assert sum("bench_cuda.py" in c for c in calls) == 2
    assert sum("bench_gpu_pressure.py" in c and "--bench-quick" in c for c in calls) == 1


@pytest.mark.parametrize("fail_on", ["tests/test_cuda.py", "--bench-cuda-amp", "-m memguard doctor",
                                     "bench_gpu_pressure.py"])
def test_gpu_script_fails_when_a_step_fails_and_still_runs_the_benchmarks(tmp_path, fail_on):
    rc, calls = _run_gpu_script(tmp_path, fail_on=fail_on)
    assert rc != 0
    assert sum("bench_cuda.py" in c for c in calls) == 2, calls
    assert sum("bench_gpu_pressure.py" in c for c in calls) == 1, calls


def test_gpu_script_stops_when_the_build_fails(tmp_path):
    rc, calls = _run_gpu_script(tmp_path, fail_on="build_ext")
    assert rc != 0
    assert not any("pytest" in c for c in calls), calls
