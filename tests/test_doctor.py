"""``memguard.doctor`` reports what /proc and /sys say, read here independently."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memguard import doctor

PYTHON_DIR = Path(__file__).resolve().parent.parent / "python"
ITEMS = ["platform", "memory", "swap", "PSI", "cgroup", "THP", "overcommit", "jemalloc",
         "torch", "sampler"]


def run_doctor(*args: str) -> subprocess.CompletedProcess:
    """Run ``python -m memguard.doctor`` in a child process.

    Args:
        args: extra command-line arguments.

    Returns:
        The finished process, output captured as text.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PYTHON_DIR), env.get("PYTHONPATH"))
                                        if p)
    for name in ("MEMGUARD_PROC_ROOT", "MEMGUARD_CGROUP_ROOT"):
        env.pop(name, None)  # the test compares against the live /proc and /sys
    return subprocess.run([sys.executable, "-m", "memguard.doctor", *args], env=env,
                          capture_output=True, text=True, timeout=180, check=False)


@pytest.fixture(scope="module")
def rows() -> dict[str, tuple[str, str]]:
    """The doctor's JSON report, torch probe included, keyed by item.

    Returns:
        ``{item: (found, memguard)}``.
    """
    r = run_doctor("--json")
    assert r.returncode == 0, r.stderr
    return {row["item"]: (row["found"], row["memguard"]) for row in json.loads(r.stdout)}


def meminfo_kb(key: str) -> int:
    """One /proc/meminfo value in kB.

    Args:
        key: field name, e.g. ``MemTotal``.

    Returns:
        The value.
    """
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name == key:
            return int(rest.split()[0])
    raise KeyError(key)


def selected(path: str) -> str:
    """The bracketed word of a sysfs choice file.

    Args:
        path: the file.

    Returns:
        The selected word.
    """
    return next(w[1:-1] for w in Path(path).read_text().split() if w.startswith("["))


def test_every_item_reported_with_text(rows: dict[str, tuple[str, str]]) -> None:
    assert list(rows) == ITEMS
    for item, (found, can) in rows.items():
        assert found and can, item


def test_memory_total_matches_meminfo(rows: dict[str, tuple[str, str]]) -> None:
    found, _ = rows["memory"]
    assert f"({meminfo_kb('MemTotal')} kB)" in found


def test_swap_matches_meminfo(rows: dict[str, tuple[str, str]]) -> None:
    found, _ = rows["swap"]
    assert found.startswith("none") == (meminfo_kb("SwapTotal") == 0)


def test_psi_presence_matches_proc(rows: dict[str, tuple[str, str]]) -> None:
    found, can = rows["PSI"]
    path = "/proc/pressure/memory"
    try:
        Path(path).read_text()
    except FileNotFoundError:
        assert found == f"{path} absent"
        assert "headroom and faults only" in can
        return
    except OSError as e:
        assert found == f"{path} unreadable ({e.strerror})"
        return
    assert found.startswith("present: some avg10 ")


def test_thp_mode_matches_sysfs(rows: dict[str, tuple[str, str]]) -> None:
    base = "/sys/kernel/mm/transparent_hugepage"
    if not os.path.exists(f"{base}/enabled"):
        pytest.skip("kernel without transparent huge pages")
    found, _ = rows["THP"]
    assert found.split()[0] == selected(f"{base}/enabled")
    if os.path.exists(f"{base}/defrag"):
        assert f"(defrag: {selected(f'{base}/defrag')})" in found


def test_overcommit_matches_proc(rows: dict[str, tuple[str, str]]) -> None:
    value = Path("/proc/sys/vm/overcommit_memory").read_text().strip()
    found, _ = rows["overcommit"]
    assert found.split()[0] == value


def test_cgroup_version_consistent_with_proc_self_cgroup(
        rows: dict[str, tuple[str, str]]) -> None:
    found, _ = rows["cgroup"]
    lines = [ln.split(":", 2) for ln in Path("/proc/self/cgroup").read_text().splitlines()]
    v1_memory = [p for _, ctl, p in lines if "memory" in ctl.split(",")]
    v2 = [p for hid, ctl, p in lines if hid == "0" and ctl == ""]
    version = found.split()[0]
    if version == "v1":
        assert v1_memory, "v1 reported without a memory line in /proc/self/cgroup"
        assert f"this process in {v1_memory[0]}" in found
    elif version == "v2":
        assert v2, "v2 reported without a 0:: line in /proc/self/cgroup"
    else:
        assert version == "none"
    hybrid = not os.path.exists("/sys/fs/cgroup/cgroup.controllers") and os.path.isdir(
        "/sys/fs/cgroup/unified")
    assert ("hybrid layout" in found) == hybrid


def test_torch_version_from_metadata(rows: dict[str, tuple[str, str]]) -> None:
    import importlib.metadata

    found, _ = rows["torch"]
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        assert found == "not installed"
        return
    assert found.startswith(version)


def test_sampler_cost_measured(rows: dict[str, tuple[str, str]]) -> None:
    found, _ = rows["sampler"]
    assert found.startswith("one sample costs ")
    assert " us back to back " in found


def test_text_report_is_two_columns() -> None:
    r = run_doctor("--no-torch")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "memguard doctor"
    starts = [ln.split()[0] for ln in lines[2:] if ln.startswith("  ") and ln[2] != " "]
    assert starts == ITEMS
    assert "import not tried" in r.stdout


def test_bracketed_picks_the_selected_word() -> None:
    assert doctor.bracketed("always [madvise] never\n") == "madvise"
    assert doctor.bracketed("always defer defer+madvise [madvise] never") == "madvise"
    assert doctor.bracketed("no selection") is None


def test_preload_check_needs_a_clean_run() -> None:
    ok, why = doctor.preload_check("/nonexistent/libjemalloc.so.2")
    assert not ok
    assert "cannot be preloaded" in why
    ok, why = doctor.preload_check("libm.so.6")  # in every glibc system
    assert ok, why


def test_read_text_reports_errors(tmp_path: Path) -> None:
    assert doctor.read_text(str(tmp_path / "missing")) == (None, "absent")
    text, why = doctor.read_text(str(tmp_path))  # a directory cannot be read as a file
    assert text is None
    assert why == f"unreadable ({os.strerror(errno.EISDIR)})"


def test_psi_absent_falls_back_to_headroom_and_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "read_text", lambda path: (None, "absent"))
    item, found, can = doctor.psi_row(None)
    assert item == "PSI"
    assert found.endswith("pressure/memory absent")
    assert can == "pressure comes from headroom and faults only"
