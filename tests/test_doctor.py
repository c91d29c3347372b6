"""``memguard.cli.doctor`` reports what /proc and /sys say, read here independently."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memguard import _C, cli
from memguard.cli import doctor
from memguard.memory import cuda_advice

PYTHON_DIR = Path(__file__).resolve().parent.parent / "python"
ITEMS = ["platform", "layer", "memory", "swap", "PSI", "cgroup", "THP", "overcommit", "jemalloc",
         "torch", "cuda allocator", "sampler"]
MiB = 1024 * 1024
GiB = 1024 * MiB
OLD, NEW = "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"


def run_doctor(*args: str) -> subprocess.CompletedProcess:
    """Run ``python -m memguard doctor`` in a child process.

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
    return subprocess.run([sys.executable, "-m", "memguard", "doctor", *args], env=env,
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


def test_layer_row_says_what_the_layer_sees() -> None:
    full = {f: 1 for _, f in doctor.SEEN_BY}
    item, found, can = doctor.layer_row(full)
    assert item == "layer" and found == f"{_C.PLATFORM}: sees " + ", ".join(
        n for n, _ in doctor.SEEN_BY)
    blind = {"minor_faults": 7, "rss_peak_bytes": 1, "mem_total_bytes": 2, "rss_bytes": None}
    _, found, can = doctor.layer_row(blind)
    assert found.startswith(f"{_C.PLATFORM}: sees peak RSS, page faults, memory total; "
                            "cannot see RSS, footprint, process swap")
    assert can.endswith("a budget cannot be enforced without the footprint")
    live = doctor.layer_row(doctor.take_sample()[0])[1]   # this machine's, through /proc
    assert live.startswith("linux: sees RSS, peak RSS, footprint,")
    assert live.endswith("cannot see compressor, the kernel's pressure level")  # macOS's


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
    starts = [ln[2:].split("  ")[0] for ln in lines[2:] if ln.startswith("  ") and ln[2] != " "]
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


def test_cuda_allocator_row_without_telemetry_reports_the_setting(
        rows: dict[str, tuple[str, str]]) -> None:
    found, can = rows["cuda allocator"]
    assert found == "no CUDA figures (reserved and allocated bytes unknown)"
    on = any(cuda_advice.expandable_on(os.environ.get(n)) for n in (OLD, NEW))
    assert can.startswith("expandable_segments is already on (" if on
                          else "expandable_segments is not on (")
    assert can.endswith("memguard doctor --telemetry RUN.jsonl")


def test_fragmentation_threshold_both_sides() -> None:
    gap = cuda_advice.FRAGMENTATION_MIN_BYTES
    assert gap == 512 * MiB and cuda_advice.FRAGMENTATION_RATIO == 1.5
    assert cuda_advice.fragmented(gap * 2, gap * 3)          # exactly 1.5x and exactly 512 MiB
    assert not cuda_advice.fragmented(gap * 2, gap * 3 - 1)  # a byte under both
    assert not cuda_advice.fragmented(4 * GiB, 6 * GiB - 1)  # 1.5x less a byte
    assert cuda_advice.fragmented(4 * GiB, 6 * GiB)
    assert not cuda_advice.fragmented(100 * MiB, 600 * MiB)  # 6x but only 500 MiB cached
    assert cuda_advice.fragmented(100 * MiB, 612 * MiB)
    assert cuda_advice.fragmented(0, gap)


def test_advice_on_the_fragmented_side_gives_the_export_line() -> None:
    found, advice = cuda_advice.expandable_segments_advice(4 * GiB, 6 * GiB, {})
    assert found == ("reserved 6.0 GiB, allocated 4.0 GiB (1.5x): 2.0 GiB held in cached "
                     "segments but not allocated (fragmentation)")
    assert advice.endswith(": export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                           "PYTORCH_ALLOC_CONF=expandable_segments:True")
    assert "cannot be reused for allocations of other sizes" in advice
    assert "grow in place" in advice
    assert f"is not on ({OLD} unset, {NEW} unset)" in advice


def test_advice_below_the_threshold_says_fine_and_gives_the_setting() -> None:
    env = {OLD: "max_split_size_mb:128"}
    found, advice = cuda_advice.expandable_segments_advice(4 * GiB, 6 * GiB - 1, env)
    assert "fragmentation" not in found
    assert advice.startswith("reserved/allocated figures are fine")
    assert advice.endswith(f"expandable_segments is not on ({OLD}=max_split_size_mb:128, "
                           f"{NEW} unset)")
    assert "export" not in advice
    found, advice = cuda_advice.expandable_segments_advice(3 * GiB, 3 * GiB + 511 * MiB, env)
    assert advice.startswith("reserved/allocated figures are fine")


def test_advice_merges_with_the_options_of_each_variable() -> None:
    env = {OLD: "max_split_size_mb:128", NEW: "garbage_collection_threshold:0.6"}
    _, advice = cuda_advice.expandable_segments_advice(1 * GiB, 2 * GiB, env)
    assert advice.endswith(
        f"export {OLD}=max_split_size_mb:128,expandable_segments:True "
        f"{NEW}=garbage_collection_threshold:0.6,expandable_segments:True")


def test_merge_alloc_conf_replaces_an_explicit_false() -> None:
    assert cuda_advice.merge_alloc_conf(None) == "expandable_segments:True"
    assert cuda_advice.merge_alloc_conf("") == "expandable_segments:True"
    assert (cuda_advice.merge_alloc_conf("expandable_segments:False,max_split_size_mb:64")
            == "expandable_segments:True,max_split_size_mb:64")
    assert (cuda_advice.merge_alloc_conf(" max_split_size_mb:64 , expandable_segments : false,"
                                    "expandable_segments:False")
            == "max_split_size_mb:64,expandable_segments:True")
    env = {OLD: "expandable_segments:False", NEW: "max_split_size_mb:64"}
    assert not cuda_advice.expandable_on(env[OLD])
    _, advice = cuda_advice.expandable_segments_advice(1 * GiB, 2 * GiB, env)
    assert advice.endswith(f"export {OLD}=expandable_segments:True "
                           f"{NEW}=max_split_size_mb:64,expandable_segments:True")
    assert advice.count("expandable_segments:False") == 1  # in the setting shown, not the line


@pytest.mark.parametrize("env", [
    {OLD: "expandable_segments:True"},
    {NEW: "max_split_size_mb:64,expandable_segments:TRUE"},
    {OLD: "expandable_segments:False", NEW: "expandable_segments:1"},
])
def test_already_on_in_either_variable(env: dict[str, str]) -> None:
    found, advice = cuda_advice.expandable_segments_advice(1 * GiB, 2 * GiB, env)
    assert found.endswith("(fragmentation)")
    assert advice.startswith("expandable_segments is already on (")
    assert "nothing to set" in advice
    assert "export" not in advice
    _, advice = cuda_advice.expandable_segments_advice(None, None, env)
    assert advice.startswith("expandable_segments is already on (")


def test_no_figures_gives_the_setting_and_how_to_get_them() -> None:
    found, advice = cuda_advice.expandable_segments_advice(None, 2 * GiB, {NEW: "expandable_segments:0"})
    assert found == "no CUDA figures (reserved and allocated bytes unknown)"
    assert advice == (f"expandable_segments is not on ({OLD} unset, "
                      f"{NEW}=expandable_segments:0); for reserved and allocated figures "
                      f"from a run: memguard doctor --telemetry RUN.jsonl")


def doctor_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, tuple[str, str]]:
    """Run ``memguard doctor`` in this process with ``--no-torch --json``.

    Args:
        capsys: pytest's output capture.
        args: extra command-line arguments.

    Returns:
        ``{item: (found, memguard)}``.
    """
    assert cli.main(["doctor", *args, "--no-torch", "--json"]) == 0
    out = capsys.readouterr().out
    return {row["item"]: (row["found"], row["memguard"]) for row in json.loads(out)}


def test_telemetry_file_gives_the_worst_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OLD, "max_split_size_mb:128")
    monkeypatch.delenv(NEW, raising=False)
    lines = [
        {"type": "meta", "schema": "memguard.telemetry", "schema_version": 2},
        {"type": "sample", "seq": 1, "rss_bytes": 1000},  # no CUDA fields
        {"type": "sample", "seq": 2, "cuda_allocated_bytes": 3 * GiB,
         "cuda_reserved_bytes": 4 * GiB, "cuda_reserved_peak_bytes": 4 * GiB,
         "cuda_alloc_retries": 0},
        {"type": "sample", "seq": 3, "cuda_allocated_bytes": 2 * GiB,
         "cuda_reserved_bytes": 5 * GiB, "cuda_reserved_peak_bytes": 5 * GiB,
         "cuda_alloc_retries": 1},
        {"type": "event", "event": "oom_recovered", "t": 1.0, "seq": 4,
         "cuda_allocated_bytes": 1, "cuda_reserved_bytes": 100 * GiB},
        {"type": "sample", "seq": 5, "cuda_allocated_bytes": 4 * GiB,
         "cuda_reserved_bytes": 4 * GiB + 1, "cuda_reserved_peak_bytes": 6 * GiB,
         "cuda_alloc_retries": 3},
        {"type": "sample", "seq": 6, "cuda_allocated_bytes": None, "cuda_reserved_bytes": None},
    ]
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n{not json\n[1, 2]\n")
    rows = doctor_json(capsys, "--telemetry", str(path))
    assert list(rows) == ITEMS, "no forecast or headroom event, no row"
    found, can = rows["cuda allocator"]
    assert found == (f"at the largest reserved of 3 samples in {path} (seq 3): reserved "
                     f"5.0 GiB, allocated 2.0 GiB (2.5x): 3.0 GiB held in cached segments but "
                     f"not allocated (fragmentation); reserved peak 6.0 GiB; 3 allocation "
                     f"retries (the caching allocator freed its cache and retried: thrashing)")
    assert can.endswith(f"export {OLD}=max_split_size_mb:128,expandable_segments:True "
                        f"{NEW}=expandable_segments:True")


def test_telemetry_forecast_and_headroom_rows(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The last forecast and the last headroom of the file, each a row with its advice."""
    growing = [{"what": "torch.Tensor float32 (256, 1024) at train.py:42", "kind": "tensor",
                "count": 15, "added": 15, "per_step": 1.0, "bytes": 15 * MiB,
                "added_bytes": 15 * MiB}, {"what": "list at data.py:7", "added_bytes": 2048}]
    forecast = {"type": "event", "event": "forecast", "t": 2.0, "step": 20, "source": "rss",
                "level_bytes": GiB, "rate_bytes_per_step": 3 * MiB, "rate_bytes_per_epoch": None,
                "epochs_left": None, "budget_bytes": 4 * GiB, "steps_left": 1024,
                "reach_step": 1044, "seconds_left": 7200.0, "since_step": 4, "growing": growing}
    headroom = {"type": "event", "event": "headroom", "t": 0.3, "step": 3, "source": "arena",
                "peak_bytes": 150 * MiB, "budget_bytes": GiB, "batch": 8, "largest_batch": 48,
                "predicted_peak_bytes": 900 * MiB, "capped": False, "queue": None}
    lines = [{"type": "meta", "schema": "memguard.telemetry", "schema_version": 2},
             {"type": "event", "event": "step", "t": 0.1, "step": 0, "floor_bytes": GiB},
             dict(headroom, largest_batch=16), headroom, dict(forecast, step=10), forecast]
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    rows = doctor_json(capsys, "--telemetry", str(path))
    assert list(rows) == [*ITEMS[:-1], "growth forecast", "batch headroom", "sampler"]
    found, can = rows["growth forecast"]
    assert found == ("RSS memory held between steps grows 3 MiB/step since step 4: 1.0 GiB at "
                     "step 20, reaching the budget of 4.0 GiB at step 1,044 (1,024 steps, "
                     "2.0 h left)")
    assert can == (f"what grows: torch.Tensor float32 (256, 1024) at train.py:42 (+15.0 MiB), "
                   f"list at data.py:7 (+2.0 KiB); see memguard report {path}")
    found, can = rows["batch headroom"]
    assert found == ("step 3: the whole batch of 8 peaked at 150.0 MiB/1.0 GiB (arena, 15 %); "
                     "the peak model fits a batch of 48 (predicted peak 900.0 MiB)")
    assert can == "a batch of 48 fits by the peak model: try it, or memguard.find_batch_size"


def test_telemetry_without_cuda_figures_or_missing(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cpu.jsonl"
    path.write_text(json.dumps({"type": "sample", "seq": 1, "rss_bytes": 1}) + "\n")
    rows = doctor_json(capsys, "--telemetry", str(path))
    assert list(rows) == ITEMS
    found, can = rows["cuda allocator"]
    assert found == (f"no samples with CUDA figures in {path}; no CUDA figures "
                     f"(reserved and allocated bytes unknown)")
    assert can.endswith("memguard doctor --telemetry RUN.jsonl")
    missing = tmp_path / "missing.jsonl"
    rows = doctor_json(capsys, "--telemetry", str(missing))
    assert list(rows) == ITEMS
    assert rows["cuda allocator"][0].startswith(f"telemetry {missing} absent; ")
    found, _ = doctor_json(capsys, "--telemetry", str(tmp_path))["cuda allocator"]
    assert found.startswith(f"telemetry {tmp_path} unreadable ({os.strerror(errno.EISDIR)}); ")


def test_telemetry_line_over_the_cap_is_skipped_unread(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    lines = [
        {"type": "sample", "seq": 1, "cuda_allocated_bytes": GiB, "cuda_reserved_bytes": 2 * GiB},
        # a well-formed sample of 50 MiB: read whole, it would be the worst
        {"type": "sample", "seq": 2, "cuda_allocated_bytes": 1, "cuda_reserved_bytes": 900 * GiB,
         "pad": "x" * 50 * MiB},
        {"type": "sample", "seq": 3, "cuda_allocated_bytes": GiB, "cuda_reserved_bytes": 3 * GiB},
    ]
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    found, _ = doctor_json(capsys, "--telemetry", str(path))["cuda allocator"]
    assert found.startswith(f"at the largest reserved of 2 samples in {path} (seq 3): "
                            f"reserved 3.0 GiB, allocated 1.0 GiB"), found
    assert found.endswith("; 1 line(s) not read (line 2: longer than 1.0 MiB, not read)")


def test_telemetry_from_dev_zero_ends_in_bounded_memory() -> None:
    """An endless line: read up to a cap, then the doctor says so and goes on.
    The child's address space is limited, so a reader that took the line whole
    fails at once instead of taking the machine's memory."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (512 * MiB, 512 * MiB))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(PYTHON_DIR), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-m", "memguard", "doctor", "--no-torch", "--json",
                        "--telemetry", "/dev/zero"], env=env, capture_output=True, text=True,
                       timeout=120, check=False, preexec_fn=limit)
    assert r.returncode == 0, r.stderr[-3000:]
    found = {row["item"]: row["found"] for row in json.loads(r.stdout)}["cuda allocator"]
    assert found.startswith("no samples with CUDA figures in /dev/zero; "), found
    assert found.endswith("; 1 line(s) not read (line 1: goes on past 256.0 MiB without a "
                          "newline; the rest of the file is not read)"), found
