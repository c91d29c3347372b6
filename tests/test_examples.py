"""The training-loop examples in examples/, each run in its short
configuration (``--quick``) as a user would run it, and held to its
invariants: the effective batch never changes, no step is lost, the peak
stays under the budget, and each script's own (queue alignment, once-per-
step updates). Every example writes its summary with ``--summary-json``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytest.importorskip("torch")

EXAMPLES = ROOT / "examples"


def run_example(name: str, tmp_path, *args: str, timeout: float = 300) -> dict:
    """Run examples/<name>.py --quick and return its summary."""
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    proc = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--quick",
                           "--summary-json", str(out), *args],
                          check=False, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    print(proc.stdout[-2000:])
    return summary


def check_common(s: dict) -> None:
    """What every example promises."""
    assert s["steps_done"] == s["steps"], "a step was lost"
    assert s["steps"] > 0
    assert len(set(s["effective_batches"])) == 1, "the effective batch changed"
    assert s["peak_bytes"] <= s["budget_bytes"], "the peak passed the budget"
    assert s["throttled"], "the budget was not tight enough for the throttle to act"


# -- dino_multicrop ------------------------------------------------------------


# -- moco_queue ----------------------------------------------------------------


# -- dinov3_lora_cpu -----------------------------------------------------------


# -- dual_cross_attention ------------------------------------------------------


# -- dreams_lightning ----------------------------------------------------------
def test_dreams_lightning(tmp_path):
    pytest.importorskip("lightning")
    s = run_example("dreams_lightning", tmp_path)
    check_common(s)
    assert s["effective_batches"] == [32] * s["steps"]
    assert all(m > 0 for m in s["masked_peaks"])      # the loss's weights
    assert min(s["micro_batches"]) >= 4               # min_micro_batch


def test_dreams_lightning_ddp_two_processes(tmp_path):
    """strategy="ddp" on 2 CPU processes (gloo): every rank runs the same
    micro-batch plan and ends with the same parameters."""
    pytest.importorskip("lightning")
    s0 = run_example("dreams_lightning", tmp_path, "--devices", "2")
    s1 = json.loads((tmp_path / "dreams_lightning.json.rank1").read_text())
    assert s0["world_size"] == s1["world_size"] == 2
    check_common(s0)
    check_common(s1)
    assert s0["micro_batches"] == s1["micro_batches"]
    assert s0["param_checksum"] == s1["param_checksum"]
