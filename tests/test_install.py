"""`pip install .` in a fresh virtualenv without torch: the build needs no
torch headers and the package imports and samples without torch."""
from __future__ import annotations

import shutil
import subprocess
import sys
import venv

import pytest

from .conftest import ROOT


@pytest.mark.slow
def test_pip_install_in_a_clean_venv_without_torch(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is needed to list the tracked sources")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    src = tmp_path / "src"
    for f in files:
        if f.startswith(("tests/", "benchmarks/")) or f.endswith(".so"):
            continue
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    env_dir = tmp_path / "venv"
    py = env_dir / "bin" / "python"
    # the new environment gets no pip of its own (ensurepip takes seconds):
    # this one's pip installs into it (--python: pip 22.3 and later)
    outer = _pip_version() >= (22, 3)
    venv.EnvBuilder(with_pip=not outer).create(env_dir)
    pip = [sys.executable, "-m", "pip", "--python", str(py)] if outer else \
        [str(py), "-m", "pip"]
    out = subprocess.run([*pip, "install", "-q", str(src)],
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    check = (
        "import importlib.util, json, memguard;"
        "s = memguard.sample();"
        "print(json.dumps([importlib.util.find_spec('torch') is None, s.rss_bytes,"
        " memguard.parse_budget('1GiB'), memguard.__file__]))"
    )
    out = subprocess.run([str(py), "-c", check], capture_output=True, text=True, check=False,
                         cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    no_torch, rss, budget, where = __import__("json").loads(out.stdout)
    assert no_torch and rss > 0 and budget == 2**30
    assert str(env_dir) in where  # the installed copy, not the source tree
    assert sys.executable != str(py)


def _pip_version() -> tuple[int, ...]:
    """This environment's pip version ((0,) without pip)."""
    try:
        from pip import __version__
    except ImportError:
        return (0,)
    return tuple(int(x) for x in __version__.split(".")[:2] if x.isdigit())
