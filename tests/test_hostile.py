"""Misuse, as a careless or hostile user commits it: every case gets a clear,
early error that names the value and says what would be valid, and nothing
runs away. (Batches: tests/test_batch.py; Lightning's skipped batch:
tests/test_lightning.py and tests/test_ddp.py; the C parsers: tests/test_fuzz.py.)
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch

import memguard
from memguard.cli import run as cli_run
from memguard.telemetry import JsonlExporter, SkippedLinesWarning, read_jsonl
from tests.conftest import ROOT

MiB = 1 << 20


def python(code: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with memguard importable."""
    e = dict(os.environ, PYTHONPATH=str(ROOT / "python"), **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=e, timeout=300, check=False, **kw)


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return python(f"import sys; from memguard.cli import main; sys.exit(main({list(args)!r}))",
                  env)


# -- find_batch_size --------------------------------------------------------------

def _wide(batch: torch.Tensor) -> None:
    """A step whose peak is linear in the batch: about 2.3 KiB a sample."""
    torch.nn.functional.gelu(batch @ torch.ones(64, 256)).sum()


def _within_5_percent(res, limit: float) -> None:
    """The size found is within 5 % of the largest that fits, as
    tests/test_finder.py holds the finder to: it fits, and 5.3 % more does
    not (the step's peak grows with the batch, so no larger size fits
    either), measured as the finder measures: bytes asked of memguard's
    arena."""
    assert res.peak_source == "arena" and 0 < res.size and res.measured_peak_bytes <= limit, res
    over = int(res.size / 0.95) + 1
    installed = memguard.memory.arena.installed()
    if not installed:
        memguard.install()
    try:
        x = torch.zeros(over, 64)
        memguard.memory.arena.reset_peaks()
        _wide(x)
        peak = memguard.stats()["requested_bytes.peak"]
    finally:
        if not installed:
            memguard.uninstall()
    assert peak > limit, (f"{over} samples fit too ({peak} <= {limit:.0f} bytes): "
                          f"{res.size} is more than 5 % short of the largest size that fits")


def test_a_huge_first_probe_is_bounded_and_still_finds_what_fits(arena):
    """first_probe=10**9 (64 GB of batch) is never built: probes are capped
    by what the budget can hold of the batch and run under the arena's bound;
    the size found fits and is within 5 % of the largest that does."""
    budget = 256 * MiB
    res = memguard.find_batch_size(_wide, torch.zeros(8, 64), budget=budget, first_probe=10**9)
    assert max(size for size, _ in res.probes) * 64 * 4 <= budget
    assert "bounded" in res.note
    _within_5_percent(res, budget * 0.9)


def test_a_first_probe_above_what_fits_is_shrunk_not_given_up():
    """first_probe=10**6 where about 100k fit: the probe does not fit, so
    the finder comes down to a size that does (it used to say "nothing
    fits")."""
    res = memguard.find_batch_size(_wide, torch.zeros(8, 64), budget=256 * MiB,
                                   first_probe=10**6)
    assert res.probes[0][0] <= 10**6
    _within_5_percent(res, 256 * MiB * 0.9)


def test_a_peak_that_does_not_grow_with_the_batch_is_reported_not_extrapolated(arena):
    """A step whose memory does not depend on the batch (a fixed 64 MiB
    workspace) used to be extrapolated to 10**12 samples and end in a bare
    MemoryError."""
    def fixed(batch):
        torch.ones(16 * MiB).sum()

    res = memguard.find_batch_size(fixed, torch.zeros(8, 4), budget="1GiB")
    assert "does not depend on the batch" in res.note
    assert res.size == max(size for size, _ in res.probes) <= 32


@pytest.mark.parametrize("kw, match", [
    ({"first_probe": 0}, "first_probe must be a positive integer, not 0"),
    ({"first_probe": True}, "first_probe must be a positive integer, not True"),
    ({"first_probe": "8"}, "first_probe must be a positive integer, not '8'"),
    ({"max_size": 2.5}, "max_size must be an integer >= min_size, not 2.5"),
    ({"margin": "0.1"}, r"margin must be in \[0, 1\), not '0.1'"),
])
def test_find_batch_size_validates_its_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        memguard.find_batch_size(_wide, torch.zeros(8, 64), budget="1GiB", **kw)


def test_find_batch_size_refuses_an_empty_batch_and_a_non_callable():
    with pytest.raises(ValueError, match="sample_batch holds no samples"):
        memguard.find_batch_size(_wide, torch.zeros(0, 64), budget="1GiB")
    with pytest.raises(ValueError, match="step_fn must be callable .* not 'step'"):
        memguard.find_batch_size("step", torch.zeros(8, 64), budget="1GiB")


# -- budgets -------------------------------------------------------------------------

HUGE = "larger than memguard can hold (at most 4 EiB, 2**62 bytes); pass None for no budget"


@pytest.mark.parametrize("value", [2**64 + 4096, 10**30, 2**62 + 1, "99999999999999999999TiB",
                                   str(2**62 + 1)])
def test_budgets_beyond_what_memguard_holds_are_refused_not_wrapped(value):
    with pytest.raises(ValueError, match=re.escape(f"budget {value!r} is {HUGE}")):
        memguard.parse_budget(value)
    assert memguard.parse_budget(2**62) == 2**62


def test_huge_budgets_everywhere_name_the_value(arena):
    for make in (lambda: memguard.Guard(budget=2**64 + 4096),
                 lambda: memguard.Guard(budget=None, tensor_budget=10**30),
                 lambda: memguard.Sampler(budget=10**30),
                 lambda: memguard.install(budget=10**30)):
        with pytest.raises(ValueError, match="larger than memguard can hold"):
            make()
    assert memguard.stats()["budget_bytes"] == 0      # the failed install changed nothing


def test_auto_without_readable_memory_figures_says_so():
    out = python("""
        import memguard
        try:
            memguard.parse_budget("auto")
        except ValueError as exc:
            print(exc)
        """, env={"MEMGUARD_PROC_ROOT": "/nonexistent"})
    assert "budget 'auto' is taken of this machine's memory, and memguard could not read it" \
        in out.stdout, out.stdout + out.stderr
    assert "/nonexistent/meminfo" in out.stdout and '"12GiB"' in out.stdout


# -- environment and options -------------------------------------------------------

def test_a_non_utf8_environment_value_is_a_warning_not_a_failed_import():
    env = dict(os.environb)
    env[b"MEMGUARD_INTERVAL_MS"] = b"\xff1"
    env[b"PYTHONPATH"] = str(ROOT / "python").encode()
    code = "import memguard; print(memguard.option('interval_ms'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == b"100.0"
    assert b"MEMGUARD_INTERVAL_MS=\\xff1 is not a valid value; using the default" in out.stderr


def test_thresholds_out_of_order_in_the_environment_fall_back_with_a_warning():
    out = python("""
        import memguard
        memguard.Sampler()                       # used to fail: "cannot create the sampler"
        print(memguard.option("budget_high"))
        """, env={"MEMGUARD_BUDGET_HIGH": "0.5"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0.9"
    assert ("budget_elevated=0.8, budget_high=0.5, budget_critical=0.97 are out of order: they "
            "must rise from elevated to critical (from MEMGUARD_* variables); using the "
            "defaults for all three") in out.stderr


def test_configure_is_all_or_nothing(restore_options):
    with pytest.raises(ValueError, match="psi_elevated=0.05, psi_high=0.01, psi_critical=0.4 "
                                         "are out of order: they must rise"):
        memguard.configure(interval_ms=10, psi_high=0.01)
    assert memguard.option("psi_high") == 0.15 and memguard.option("interval_ms") == 100
    with pytest.raises(ValueError, match="headroom_elevated=0.15, headroom_high=0.2, .* must fall"):
        memguard.configure(headroom_high=0.2)
    with pytest.raises(ValueError, match="unknown memguard option 'bogus'"):
        memguard.configure(interval_ms=10, bogus=1)
    assert memguard.option("interval_ms") == 100
    memguard.configure(psi_elevated=0.3, psi_high=0.5, psi_critical=0.8)   # in order: fine
    assert memguard.option("psi_high") == 0.5


def test_variables_no_option_reads_are_reported():
    out = python("import memguard", env={"MEMGUARD_DEBUG": "1", "MEMGUARD_PRELOAD": "1"})
    assert "MEMGUARD_DEBUG is not a memguard option" in out.stderr
    assert "MEMGUARD_PRELOAD is not a memguard option" in out.stderr


# -- a refusal by memguard's budget says so ----------------------------------------

NOTE = "refused by memguard's budget of 64.0 MiB"


def test_an_uncaught_refusal_names_memguards_budget():
    out = python("""
        import torch, memguard
        memguard.install(budget="64MiB")
        torch.ones(1 << 28)
        """)
    assert out.returncode == 1
    assert "can't allocate memory" in out.stderr
    assert f"memguard: the allocation of 1.0 GiB was {NOTE}" in out.stderr, out.stderr
    assert "(not by the machine)" in out.stderr


def test_a_caught_refusal_is_still_an_oom_and_is_explained_once(arena):
    from memguard.memory import arena as allocator

    allocator.set_budget(64 * MiB)
    try:
        torch.ones(1 << 28)
    except RuntimeError as exc:
        assert memguard.is_oom(exc)
        assert allocator.explain(exc) and NOTE in exc.__notes__[-1]
        assert not allocator.explain(exc)          # one note per refusal
    else:
        pytest.fail("the budget did not refuse")


def test_an_oom_the_budget_did_not_cause_gets_no_note(arena):
    exc = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert memguard.is_oom(exc) and not memguard.memory.arena.explain(exc)
    assert not hasattr(exc, "__notes__")


def test_a_guard_giving_up_carries_the_note(arena):
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randn(4, 256)
    room = memguard.stats()["reserved_bytes.current"] + (512 << 10)   # 4 MiB will not fit
    guard = memguard.Guard(budget=None, tensor_budget=room, micro_batch=4)
    with guard, pytest.raises(memguard.GuardOOMError) as info:
        guard.step(batch, lambda b: model(b).sum() + torch.ones(1 << 20).sum(), opt)
    assert any("refused by memguard's budget of" in n and "(not by the machine)" in n
               for n in info.value.__notes__)


@pytest.mark.parametrize("code, error", [
    ("import torch; torch.ones(1 << 28)", "can't allocate memory"),
    ("bytearray(1 << 30)", "MemoryError"),
])
def test_memguard_run_says_when_its_budget_refused(code, error):
    try:
        cli_run.shim_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    out = cli("run", "--budget", "256MiB", "--", sys.executable, "-c", code)
    assert out.returncode == 1 and error in out.stderr
    assert "memguard: the budget of 256.0 MiB (memguard run --budget, MEMGUARD_BUDGET) " \
           "refused 1 allocation(s)" in out.stderr, out.stderr
    assert "the last of 1.0 GiB" in out.stderr
    ok = cli("run", "--budget", "256MiB", "--", sys.executable, "-c", "print('fine')")
    assert ok.returncode == 0 and "memguard:" not in ok.stderr


# -- reports and plugins ---------------------------------------------------------------

def _run_file(tmp_path, *bad_lines: str):
    path = tmp_path / "run.jsonl"
    with JsonlExporter(path) as exp:
        for _ in range(3):
            exp(memguard.sample())
    with open(path, "a") as f:
        f.writelines(line + "\n" for line in bad_lines)
    return path


@pytest.mark.parametrize("line, why", [
    ('{"type": "sample", "t": 17000', "line 5: not JSON (Expecting ',' delimiter, cut short)"),
    ('{"type": "sample", "t": "x"}', "line 5: time 't' is 'x', not a finite number"),
    ('{"type": "sample", "t": NaN}', "line 5: time 't' is nan, not a finite number"),
    ('{"type": "sample", "t": 1.0, "rss_bytes": "lots"}', "line 5: rss_bytes is 'lots'"),
    ("[1, 2]", "line 5: a JSON list, not a record"),
])
def test_a_bad_line_is_skipped_and_named_by_number(tmp_path, line, why):
    path = _run_file(tmp_path, line)
    with pytest.warns(SkippedLinesWarning, match=re.escape(f"skipped 1 unreadable line(s) ({why}")):
        _, samples, _ = read_jsonl(path)
    assert len(samples) == 3


def test_memguard_report_draws_a_run_with_bad_lines(tmp_path):
    pytest.importorskip("matplotlib")
    path = _run_file(tmp_path, '{"type": "sample", "t": 17', '{"type": "sample", "t": "x"}')
    out = cli("report", str(path), "-o", str(tmp_path / "r.png"))
    assert out.returncode == 0, out.stderr
    assert "memguard report: " in out.stderr and "skipped 2 unreadable line(s)" in out.stderr
    assert (tmp_path / "r.png").exists()


def test_nothing_creates_a_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="cannot write telemetry to .*: the directory .*nope' "
                                         "does not exist"):
        JsonlExporter(tmp_path / "nope" / "run.jsonl")
    pytest.importorskip("matplotlib")
    from memguard.cli.report import report
    with pytest.raises(ValueError, match="cannot write report .*: the directory .* does not"):
        report(_run_file(tmp_path), tmp_path / "nope" / "r.png")
    assert not (tmp_path / "nope").exists()


def test_pytest_json_where_no_directory_can_be_made_is_a_usage_error(tmp_path):
    """--memguard-json makes its directory, as pytest's --junitxml does; where
    it cannot (a file is in the way), the session stops at once with one
    line, not at its end in a raw FileNotFoundError."""
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert True\n")
    (tmp_path / "afile").write_text("")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--memguard-json", str(tmp_path / "afile" / "m.json"), "test_one.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
                         env=dict(os.environ, PYTHONPATH=str(ROOT / "python")))
    assert out.returncode == 4, out.stdout + out.stderr
    assert "--memguard-json" in out.stderr and "cannot create" in out.stderr
    assert "File exists" in out.stderr and "Traceback" not in out.stderr


def test_cli_misuse_prints_one_line_not_a_traceback(tmp_path):
    out = cli("watch", "--duration", "1", "--export", str(tmp_path / "nope" / "w.jsonl"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "cannot write telemetry to" in out.stderr and "does not exist" in out.stderr
    out = cli("demo", "--budget", "junk")
    assert out.returncode == 2 and "unrecognized arguments: --budget junk" in out.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    out = cli("watch", "--duration", "1", env={"MEMGUARD_PROC_ROOT": str(empty)})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"no memory figures could be read under proc_root {str(empty)!r}" in out.stderr


# -- samplers and threads --------------------------------------------------------------

def test_sampler_arguments_are_checked_when_given():
    with pytest.raises(ValueError, match="ring_size 1000000000000 is out of range: use an "
                                         "integer from 2 to 1048576"):
        memguard.Sampler(ring_size=10**12)
    with pytest.raises(ValueError, match=r"telemetry export path 'x.txt' must end in \.jsonl"):
        memguard.Sampler(export="x.txt")


def test_one_guard_from_two_threads_is_refused():
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = memguard.Guard(budget=None, allocator=False)
    inside, release, errors = threading.Event(), threading.Event(), []

    def slow_loss(b):
        inside.set()
        release.wait(30)
        return model(b).sum()

    def other():
        inside.wait(30)
        try:
            guard.step(torch.randn(4, 8), lambda b: model(b).sum(), opt)
        except RuntimeError as exc:
            errors.append(str(exc))
        finally:
            release.set()

    with guard:
        t = threading.Thread(target=other, name="second-loop")
        t.start()
        before = [p.detach().clone() for p in model.parameters()]
        guard.step(torch.randn(4, 8), slow_loss, opt)
        t.join(30)
        assert guard.steps == 1
    assert len(errors) == 1
    assert "Guard.step() was called from thread 'second-loop' while thread 'MainThread' runs " \
           "a step of the same guard" in errors[0]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_step_inside_a_step_is_refused():
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = memguard.Guard(budget=None, allocator=False)

    def nested(b):
        guard.step(b, lambda m: model(m).sum(), opt)

    with guard, pytest.raises(RuntimeError, match="steps do not nest"):
        guard.step(torch.randn(4, 8), nested, opt)


def test_jsonl_records_read_back_after_a_warning_are_the_good_ones(tmp_path):
    path = _run_file(tmp_path, "garbage")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedLinesWarning)
        meta, samples, events = read_jsonl(path)
    assert meta["schema"] == "memguard.telemetry" and len(samples) == 3 and events == []
    assert json.loads(path.read_text().splitlines()[0])["type"] == "meta"
