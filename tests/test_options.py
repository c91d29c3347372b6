"""Options: MEMGUARD_* environment variables and configure()."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import memguard

from .conftest import check_pace, wait_for


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MEMGUARD_")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, check=False,
                          text=True, timeout=60)


def test_defaults():
    opts = memguard.options()
    assert opts["interval_ms"] == 100
    assert opts["budget"] == "auto"
    assert opts["calm_samples"] == 10


def test_configure_sets_and_validates(restore_options):
    memguard.configure(interval_ms=20, psi_high=0.25)
    assert memguard.option("interval_ms") == 20
    assert memguard.option("psi_high") == 0.25
    with pytest.raises(ValueError, match="'2'"):
        memguard.configure(interval_ms=2)  # below 5 ms
    with pytest.raises(ValueError, match="'often'"):
        memguard.configure(interval_ms="often")
    with pytest.raises(ValueError, match="'12 parsecs'"):
        memguard.configure(budget="12 parsecs")
    with pytest.raises(ValueError, match="intervall_ms"):
        memguard.configure(intervall_ms=20)
    assert memguard.option("interval_ms") == 20  # a failed set changes nothing


def test_configured_interval_reaches_new_samplers(restore_options):
    """A sampler made after configure() never samples faster than the
    interval configured, which is longer than the default (100 ms): one
    on the default would take its 3 samples in 0.2 s."""
    memguard.configure(interval_ms=250)
    s = memguard.Sampler()
    t0 = time.monotonic()
    with s:
        assert wait_for(lambda: len(s.history()) >= 3)
    check_pace(s.history(), 0.25, time.monotonic() - t0)


def test_environment_is_read():
    out = _run("import memguard, json; print(json.dumps(memguard.options()))",
               MEMGUARD_INTERVAL_MS="20", MEMGUARD_PSI_HIGH="0.3")
    assert out.returncode == 0, out.stderr
    opts = json.loads(out.stdout)
    assert opts["interval_ms"] == 20 and opts["psi_high"] == 0.3


def test_bad_environment_value_warns_and_keeps_default():
    out = _run("import memguard; print(memguard.option('interval_ms'))",
               MEMGUARD_INTERVAL_MS="fast")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "100.0"
    assert "MEMGUARD_INTERVAL_MS=fast is not a valid value" in out.stderr
    assert "MemguardConfigWarning" in out.stderr


def test_unknown_environment_name_warns():
    out = _run("import memguard", MEMGUARD_INTERVALL_MS="20")
    assert out.returncode == 0
    assert "MEMGUARD_INTERVALL_MS is not a memguard option" in out.stderr
