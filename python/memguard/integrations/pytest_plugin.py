"""A pytest plugin: memory figures per test, and tests run under a budget.

Load it with ``-p memguard.integrations.pytest_plugin`` (installed, memguard also
registers it as the ``pytest11`` entry point ``memguard``, so ``-p
no:memguard`` turns it off). Loaded, it imports the ``memguard`` package
(its C extension, not torch) and registers the marker, and does nothing
else until asked: ``--memguard``, the ``memguard`` marker or the
``memguard`` fixture. torch is imported only where a budget or the fixture
needs it.

``pytest --memguard`` measures every test from the start of its setup
(before its fixtures are created) to the end of its call (the test
function), so memory a fixture allocates for the test counts and teardown,
which only frees, does not:

- ``rss_peak_bytes`` and ``rss_growth_bytes``: the process's peak RSS in
  that window and its rise over the RSS at the start. The kernel's
  high-water mark is reset by writing ``5`` to ``/proc/self/clear_refs``
  and read back as ``VmHWM`` (``rss_peak_source`` ``"VmHWM"``); where
  ``clear_refs`` cannot be written, ``getrusage``'s ``ru_maxrss``
  (``"ru_maxrss"``: exact when the test set a new high for the process, else
  the larger of the RSS at start and at the end, a lower bound);
- ``tensor_peak_bytes`` and ``tensor_reserved_peak_bytes``: memguard's
  arena (``allocated_bytes.peak`` and ``reserved_bytes.peak``, reset at the
  start), when it serves tensors; else ``None``;
- ``page_faults`` (minor plus major) and ``major_page_faults``;
- ``gc_time_s`` and ``gc_collections``: Python's collections during the
  window (``gc.callbacks``);
- ``pressure_level_max``: the highest pressure level of a
  :class:`memguard.Sampler` at 50 ms running for the session (the level in
  effect when the test starts, and every sample taken during it).

The terminal summary lists the ``--memguard-top N`` tests (10; 0 for all)
with the largest RSS growth; ``--memguard-json PATH`` (which implies
``--memguard``) writes every test's record, with ``nodeid``, ``outcome``
and ``duration_s`` (setup, call and teardown), as JSON. With
pytest-benchmark, a test that uses the ``benchmark`` fixture gets the
figures in its ``extra_info`` (``memguard_*`` keys).

The marker runs a test under limits, with or without ``--memguard``::

    @pytest.mark.memguard(budget="512MiB")   # memguard's arena, enforced
    @pytest.mark.memguard(max_rss="2GiB")    # the process's RSS growth, checked

``budget`` installs memguard's allocator with that budget from the start
of the test's setup to the end of its teardown (torch is imported) and
then puts back the budget and installation state there were before. If the
arena refused any allocation meanwhile, the test fails, even if it caught
the error, naming the budget, the peaks and the refused allocation; so
does a test whose RSS grew by more than ``max_rss``. Unknown or positional
arguments and values :func:`memguard.parse_budget` rejects are collection
errors.

The ``memguard`` fixture gives the test a live :class:`memguard.Guard`
(no budget of its own and ``allocator=False``: the marker's budget, where
there is one, is its budget and the arena's), installed for the test; its
``sampler`` is the session's when ``--memguard`` is on, and its
``test_figures()`` returns the test's figures so far.

Under pytest-xdist each worker measures its own tests and writes its own
JSON (``PATH`` with the worker's id before the suffix, ``run.gw0.json``);
the summary, printed by the controller, has nothing to list then.

``clear_refs`` resets the high-water mark of the whole process, so under
``--memguard`` (or a ``max_rss`` marker) a test that reads ``VmHWM`` or
``ru_maxrss`` itself sees the peak since its own start, not the process's.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import memguard
from memguard._common import size, unwritable
from memguard.memory import arena
from memguard.memory.gc_hooks import GcHooks
from memguard.telemetry import parse_budget
from memguard.train.peaks import process_peak

try:
    import resource
except ImportError:  # not POSIX
    resource = None  # type: ignore[assignment]

__all__ = ["MemguardPlugin"]

#: the name the plugin's state object is registered under
PLUGIN_NAME = "memguard-measure"
#: the period of the session's sampler
INTERVAL_MS = 50
#: keyword arguments the marker takes
MARKER_KEYS = ("budget", "max_rss")
_MARKER_HELP = (
    "memguard(budget=None, max_rss=None): run the test under memguard's allocator with "
    "this budget (the test fails if an allocation is refused), and/or fail it if the "
    "process's RSS grows by more than max_rss"
)
_MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024   # ru_maxrss: bytes there, KiB here


def _size(n: int | None) -> str:
    """Bytes for people: ``"1.5 GiB"``, ``"200.0 MiB"``, ``"12 B"``; ``"-"`` for ``None``."""
    return "-" if n is None else size(n)


# -- the marker ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MarkerSpec:
    """A test's ``memguard`` marker arguments, merged (the closest mark wins)."""

    budget: str | int | None = None
    max_rss: str | int | None = None
    budget_bytes: int | None = None
    max_rss_bytes: int | None = None


def marker_spec(item: pytest.Item) -> MarkerSpec | None:
    """The item's ``memguard`` marker arguments, checked; ``None`` without a marker.

    Raises:
        ValueError: positional or unknown arguments, or a budget or limit
            :func:`memguard.parse_budget` rejects; the message names them.
    """
    marks = list(item.iter_markers("memguard"))
    if not marks:
        return None
    merged: dict[str, Any] = {}
    for mark in marks:                        # closest first
        if mark.args:
            raise ValueError(
                f"@pytest.mark.memguard takes keyword arguments only "
                f"({', '.join(k + '=' for k in MARKER_KEYS)}), not positional "
                f"{', '.join(repr(a) for a in mark.args)}")
        unknown = sorted(set(mark.kwargs) - set(MARKER_KEYS))
        if unknown:
            raise ValueError(
                f"@pytest.mark.memguard has no argument "
                f"{', '.join(f'{k}={mark.kwargs[k]!r}' for k in unknown)}: "
                f"use {' and '.join(k + '=' for k in MARKER_KEYS)}")
        for k, v in mark.kwargs.items():
            merged.setdefault(k, v)
    sizes: dict[str, int | None] = {}
    for key in MARKER_KEYS:
        value = merged.get(key)
        if value is None:
            sizes[key] = None
            continue
        try:
            sizes[key] = parse_budget(value)
        except ValueError as exc:
            raise ValueError(f"@pytest.mark.memguard({key}={value!r}): {exc}") from None
    return MarkerSpec(budget=merged.get("budget"), max_rss=merged.get("max_rss"),
                      budget_bytes=sizes["budget"], max_rss_bytes=sizes["max_rss"])


def _rusage() -> tuple[int, int, int]:
    """(minor faults, major faults, max RSS in bytes) of this process."""
    if resource is None:
        return 0, 0, 0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_minflt, ru.ru_majflt, ru.ru_maxrss * _MAXRSS_UNIT


# -- one test's window ---------------------------------------------------------
@dataclasses.dataclass
class _Window:
    """What was read when a test's window opened, and what it saw since."""

    spec: MarkerSpec | None
    t0: float                          # time.time(), the clock of samples
    rss_start: int | None
    hwm_reset: bool                    # VmHWM measures this window
    faults0: tuple[int, int, int]
    gc_s0: float
    gc_n0: int
    arena_at_start: bool
    ooms0: int | None
    level_max: int | None = None
    figures: dict[str, Any] | None = None
    problems: list[str] = dataclasses.field(default_factory=list)
    # the marker's budget: what to put back
    budget_installed: bool = False
    was_installed: bool = False
    prev_budget: int = 0


_WINDOW = pytest.StashKey[_Window]()


class MemguardPlugin:
    """The plugin's state for one pytest run: options, the session's sampler,
    gc timing, open windows and the records of finished tests."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        json_path = config.getoption("memguard_json")
        self.json_path = os.path.abspath(json_path) if json_path else None
        worker = getattr(config, "workerinput", {}).get("workerid")
        if self.json_path is not None and worker:   # pytest-xdist: one file per worker
            stem, ext = os.path.splitext(self.json_path)
            self.json_path = f"{stem}.{worker}{ext}"
        if self.json_path is not None:     # its directory is made now, as --junitxml's is
            try:
                os.makedirs(os.path.dirname(self.json_path), exist_ok=True)
            except OSError as exc:
                raise pytest.UsageError(f"--memguard-json {json_path!r}: cannot create "
                                        f"{os.path.dirname(self.json_path)!r}: "
                                        f"{exc.strerror or exc}") from None
        #: figures are recorded for every test
        self.enabled = bool(config.getoption("memguard")) or self.json_path is not None
        self.top = int(config.getoption("memguard_top"))
        #: the session's sampler (only with --memguard)
        self.sampler: Any = None
        self.records: list[dict[str, Any]] = []
        self._pending: dict[str, tuple[dict[str, Any], _Window]] = {}   # by nodeid
        self._rss = process_peak()
        self._lock = threading.Lock()          # guards the open window's level
        self._open: _Window | None = None
        self._gc: Any = None                   # the session's GcHooks (with the sampler)
        self.json_error: str | None = None     # why --memguard-json could not be written

    # -- session -------------------------------------------------------------
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if not self.enabled:
            return

        self._gc = GcHooks().install()
        self.sampler = memguard.Sampler(interval_ms=INTERVAL_MS)
        self.sampler.on_sample(self._on_sample)
        self.sampler.start()

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self._stop()
        if self.enabled and self.json_path is not None:
            self._write_json(self.json_path)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self._stop()
        self._rss.close()

    def _stop(self) -> None:
        if self.sampler is not None:
            self.sampler.remove_callback(self._on_sample)
            self.sampler.stop()
            self.sampler = None
        if self._gc is not None:
            self._gc.uninstall()
            self._gc = None

    def _gc_figures(self) -> tuple[float, int] | None:
        """Seconds in collections and collections so far (None: not timed)."""
        if self._gc is None:
            return None
        st = self._gc.stats
        return st.gc_seconds, sum(st.collections)

    def _on_sample(self, s: Any) -> None:
        """On the sampler's callback thread: a sample taken inside the open
        window raises its level (samples are matched by their time, so one
        delivered late is not counted for the next test)."""
        with self._lock:
            w = self._open
            if w is not None and s.t >= w.t0:   # (a closed window is no longer open)
                w.level_max = max(w.level_max or 0, int(s.level))

    # -- collection ----------------------------------------------------------
    @pytest.hookimpl(hookwrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector) -> Iterator[None]:
        """Check the ``memguard`` markers of the items collected: bad
        arguments make this collector's report an error that names them."""
        outcome = yield
        report: pytest.CollectReport = outcome.get_result()
        if not report.passed or not report.result:
            return
        errors = []
        for node in report.result:
            if not isinstance(node, pytest.Item):
                continue
            try:
                marker_spec(node)
            except ValueError as exc:
                errors.append(f"{node.nodeid}: {exc}")
        if errors:
            report.outcome = "failed"
            report.longrepr = "\n".join(errors)
            report.result = []

    # -- running a test ------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Before the test's fixtures: put the marker's budget in place and
        open the test's window."""
        try:   # again: marks may have been added after collection
            spec = marker_spec(item)
        except ValueError as exc:
            pytest.fail(f"{item.nodeid}: {exc}", pytrace=False)
        if not (self.enabled or spec is not None or "memguard" in _fixturenames(item)):
            return
        w = self._open_window(item, spec)
        if spec is not None and spec.budget_bytes is not None:
            self._install_budget(w, spec)
            arena.reset_peaks()
            w.arena_at_start = True
            w.ooms0 = int(memguard.stats()["num_ooms"])

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        """After the test function: close the window, judge the limits."""
        yield
        w = item.stash.get(_WINDOW, None)
        if w is None or w.figures is not None:
            return
        self._close_window(w)
        if self.enabled:
            self._benchmark_info(item, w)

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item,
                                  call: pytest.CallInfo[None]) -> Iterator[None]:
        """A test that passed the limits' checks fails when it broke one; one
        that failed already gets the reason as a report section."""
        outcome = yield
        if call.when != "call":
            return
        w = item.stash.get(_WINDOW, None)
        if w is None or not w.problems:
            return
        report: pytest.TestReport = outcome.get_result()
        msg = "\n".join(w.problems)
        if report.passed and not hasattr(report, "wasxfail"):
            report.outcome = "failed"
            report.longrepr = msg
        else:
            report.sections.append(("memguard", msg))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Iterator[None]:
        """Close a window setup left open; after the fixtures' teardown, put
        the budget back as it was."""
        w = item.stash.get(_WINDOW, None)
        if w is not None and w.figures is None:
            self._close_window(w)
        yield
        if w is not None and w.budget_installed:
            self._restore_budget(w)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        pending = self._pending.get(report.nodeid)
        if pending is None:
            return
        rec, w = pending
        rec["duration_s"] += report.duration
        xfail = hasattr(report, "wasxfail")
        if report.when == "call":
            if xfail:
                rec["outcome"] = "xfailed" if report.skipped else "xpassed"
            else:
                rec["outcome"] = report.outcome
        elif report.failed:
            if rec["outcome"] in (None, "passed"):
                rec["outcome"] = "error"
        elif report.skipped and rec["outcome"] is None:
            rec["outcome"] = "xfailed" if xfail else "skipped"
        if report.when == "teardown":
            del self._pending[report.nodeid]
            if rec["outcome"] is None:
                rec["outcome"] = "passed"
            rec.update(w.figures or {})
            self.records.append(rec)

    # -- windows -------------------------------------------------------------
    def _open_window(self, item: pytest.Item, spec: MarkerSpec | None) -> _Window:
        installed = memguard.installed()
        arena.reset_peaks()
        hwm_reset = self._rss.reset_peak()
        rss, _ = self._rss.read()
        minf, majf, maxrss = _rusage()
        gc_s0, gc_n0 = self._gc_figures() or (0.0, 0)
        w = _Window(spec=spec, t0=time.time(), rss_start=rss, hwm_reset=hwm_reset,
                    faults0=(minf, majf, maxrss), gc_s0=gc_s0, gc_n0=gc_n0,
                    arena_at_start=installed,
                    ooms0=int(memguard.stats()["num_ooms"]) if installed else None)
        if self.sampler is not None:
            latest = self.sampler.latest()
            if latest is not None:
                w.level_max = int(latest.level)
        item.stash[_WINDOW] = w
        with self._lock:
            self._open = w
        if self.enabled:
            rec = {"nodeid": item.nodeid, "outcome": None, "duration_s": 0.0}
            self._pending[item.nodeid] = (rec, w)
        return w

    def figures(self, item: pytest.Item) -> dict[str, Any]:
        """The item's figures: final once its window closed, else so far
        (``{}`` when it is not measured)."""
        w = item.stash.get(_WINDOW, None)
        if w is None:
            return {}
        if w.figures is not None:
            return dict(w.figures)
        return self._measure(w, time.time())

    def _measure(self, w: _Window, t1: float) -> dict[str, Any]:
        """The window's figures up to now."""
        rss_now, hwm = self._rss.read()
        minf, majf, maxrss = _rusage()
        if w.hwm_reset and hwm is not None:
            peak, source = hwm, "VmHWM"
        elif maxrss > w.faults0[2]:
            peak, source = maxrss, "ru_maxrss"
        else:
            known = [v for v in (w.rss_start, rss_now) if v is not None]
            peak, source = (max(known) if known else None), "ru_maxrss"
        if peak is not None and w.rss_start is not None:
            peak = max(peak, w.rss_start)   # the kernel's RSS counters lag by a few pages
        growth = None if peak is None or w.rss_start is None else peak - w.rss_start
        installed = memguard.installed()
        st = memguard.stats() if (installed or w.arena_at_start) else None
        gcf = self._gc_figures()
        level = w.level_max
        if self.sampler is not None:
            n = min(4096, int((t1 - w.t0) * 1000 / INTERVAL_MS) + 4)
            for s in self.sampler.history(n):
                if w.t0 <= s.t <= t1:
                    level = max(level or 0, int(s.level))
        return {
            "rss_start_bytes": w.rss_start,
            "rss_peak_bytes": peak,
            "rss_growth_bytes": growth,
            "rss_peak_source": source,
            "tensor_peak_bytes": None if st is None else int(st["allocated_bytes.peak"]),
            "tensor_reserved_peak_bytes": None if st is None else int(st["reserved_bytes.peak"]),
            "arena_ooms": None if st is None or w.ooms0 is None
            else int(st["num_ooms"]) - w.ooms0,
            "page_faults": (minf - w.faults0[0]) + (majf - w.faults0[1]),
            "major_page_faults": majf - w.faults0[1],
            "gc_time_s": None if gcf is None else gcf[0] - w.gc_s0,
            "gc_collections": None if gcf is None else gcf[1] - w.gc_n0,
            "pressure_level_max": None if level is None else memguard.Level(level).name,
            "window_s": t1 - w.t0,
        }

    def _close_window(self, w: _Window) -> None:
        """Take the window's final figures and judge the marker's limits."""
        t1 = time.time()
        with self._lock:
            if self._open is w:
                self._open = None
        figures = self._measure(w, t1)
        spec = w.spec
        figures["budget_bytes"] = spec.budget_bytes if spec is not None else None
        figures["max_rss_bytes"] = spec.max_rss_bytes if spec is not None else None
        w.figures = figures
        if spec is None:
            return
        if spec.budget_bytes is not None and figures["arena_ooms"]:
            n = figures["arena_ooms"]
            crossing = memguard.stats().get("last_oom_bytes")   # newer arenas only
            what = "an unknown size" if not crossing else f"{_size(crossing)} ({crossing} bytes)"
            w.problems.append(
                f"memguard budget {spec.budget!r} ({_size(spec.budget_bytes)}) exceeded: "
                f"the arena refused {n} allocation{'s' if n > 1 else ''} during the test; "
                f"the {'last ' if n > 1 else ''}one that crossed the budget asked for {what}; "
                f"peak allocated {_size(figures['tensor_peak_bytes'])}, peak reserved "
                f"{_size(figures['tensor_reserved_peak_bytes'])}")
        growth = figures["rss_growth_bytes"]
        if spec.max_rss_bytes is not None and growth is not None and growth > spec.max_rss_bytes:
            w.problems.append(
                f"memguard max_rss {spec.max_rss!r} ({_size(spec.max_rss_bytes)}) exceeded: "
                f"RSS grew by {_size(growth)} during the test (from "
                f"{_size(figures['rss_start_bytes'])} to a peak of "
                f"{_size(figures['rss_peak_bytes'])}, {figures['rss_peak_source']})")

    # -- the marker's budget -------------------------------------------------
    def _install_budget(self, w: _Window, spec: MarkerSpec) -> None:
        try:
            import torch  # noqa: F401 - memguard routes torch's allocations
        except ImportError as exc:
            pytest.fail(f"@pytest.mark.memguard(budget={spec.budget!r}) needs torch: {exc}",
                        pytrace=False)
        w.was_installed = memguard.installed()
        w.prev_budget = int(memguard.stats()["budget_bytes"])
        try:
            memguard.install(budget=spec.budget_bytes)
        except (RuntimeError, ValueError) as exc:
            arena.set_budget(w.prev_budget or None)
            pytest.fail(f"@pytest.mark.memguard(budget={spec.budget!r}): memguard's allocator "
                        f"could not be installed: {exc}", pytrace=False)
        w.budget_installed = True

    def _restore_budget(self, w: _Window) -> None:
        w.budget_installed = False
        arena.set_budget(w.prev_budget or None)
        if not w.was_installed:
            memguard.uninstall()
            memguard.trim()   # the arena's cache serves nobody now

    # -- pytest-benchmark ----------------------------------------------------
    def _benchmark_info(self, item: pytest.Item, w: _Window) -> None:
        bench = getattr(item, "funcargs", {}).get("benchmark")
        extra = getattr(bench, "extra_info", None)
        if not isinstance(extra, dict) or w.figures is None:
            return
        f = w.figures
        rounds = getattr(getattr(getattr(bench, "stats", None), "stats", None), "rounds", None)
        extra.update({
            "memguard_rss_peak_bytes": f["rss_peak_bytes"],
            "memguard_rss_growth_bytes": f["rss_growth_bytes"],
            "memguard_tensor_peak_bytes": f["tensor_peak_bytes"],
            "memguard_page_faults": f["page_faults"],
            "memguard_faults_per_round": f["page_faults"] / rounds if rounds else None,
            "memguard_pressure_level_max": f["pressure_level_max"],
        })

    # -- reporting -----------------------------------------------------------
    def _write_json(self, path: str) -> None:
        doc = {
            "schema": "memguard.pytest",
            "schema_version": 1,
            "memguard_version": memguard.__version__,
            "window": "setup+call",
            "sampler_interval_ms": INTERVAL_MS,
            "tests": self.records,
        }
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")
        except OSError as exc:     # the session's results stand: say so, do not crash
            self.json_error = f"cannot write --memguard-json {path!r}: {unwritable(exc, path)}"

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.enabled:
            return
        tr = terminalreporter
        if self.json_error is not None:
            tr.write_line(f"memguard: {self.json_error}", red=True)
        rows = list(self.records)
        if not rows:
            tr.write_sep("=", "memguard: no test measured")
            return
        # by what the test itself added to the peak: the process's baseline
        # (interpreter, torch) is the same for every test and would hide it
        rows.sort(key=lambda r: (r.get("rss_growth_bytes") or 0, r.get("rss_peak_bytes") or 0),
                  reverse=True)
        shown = rows if self.top <= 0 else rows[:self.top]
        tr.write_sep("=", f"memguard: top {len(shown)} of {len(rows)} tests by peak RSS growth")
        head = (f"{'peak RSS':>10} {'RSS growth':>10} {'tensor peak':>11} {'faults':>8} "
                f"{'gc ms':>7} {'pressure':>8} {'time s':>7}  {'outcome':<8} test")
        tr.write_line(head)
        for r in shown:
            gc_ms = "-" if r.get("gc_time_s") is None else f"{r['gc_time_s'] * 1000:.1f}"
            tr.write_line(
                f"{_size(r.get('rss_peak_bytes')):>10} {_size(r.get('rss_growth_bytes')):>10} "
                f"{_size(r.get('tensor_peak_bytes')):>11} {r.get('page_faults', 0):>8} "
                f"{gc_ms:>7} {r.get('pressure_level_max') or '-':>8} "
                f"{r['duration_s']:>7.2f}  {r['outcome']:<8} {r['nodeid']}")
        if self.json_path is not None and self.json_error is None:
            tr.write_line(f"memguard: every test's figures written to {self.json_path}")


def _fixturenames(item: pytest.Item) -> tuple[str, ...]:
    return tuple(getattr(item, "fixturenames", ()))


def _plugin(config: pytest.Config) -> MemguardPlugin:
    plugin = config.pluginmanager.get_plugin(PLUGIN_NAME)
    assert isinstance(plugin, MemguardPlugin)
    return plugin


# -- module-level hooks ---------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("memguard", "memory figures per test (memguard)")
    group.addoption("--memguard", action="store_true", default=False,
                    help="record each test's peak RSS, tensor peak, page faults, gc time and "
                         "pressure level; list the tests with the largest RSS growth")
    group.addoption("--memguard-top", type=int, default=10, metavar="N",
                    help="tests listed in the memguard summary (default 10, 0 for all)")
    group.addoption("--memguard-json", default=None, metavar="PATH",
                    help="write every test's memguard figures to PATH as JSON "
                         "(implies --memguard)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _MARKER_HELP)
    if not config.pluginmanager.has_plugin(PLUGIN_NAME):
        config.pluginmanager.register(MemguardPlugin(config), PLUGIN_NAME)


@pytest.fixture(name="memguard")
def memguard_fixture(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A live :class:`memguard.Guard` for the test: installed without a
    budget of its own and without installing the allocator (the
    ``memguard`` marker's budget, where given, is the guard's budget and
    the arena's), uninstalled after. ``guard.sampler`` is the session's
    sampler under ``--memguard``, else one of its own at 50 ms;
    ``guard.test_figures()`` returns the test's figures so far."""
    import torch  # noqa: F401 - the guard needs torch

    plugin = _plugin(request.config)
    item = request.node
    w = item.stash.get(_WINDOW, None)
    spec = w.spec if w is not None else None
    sampler = plugin.sampler if plugin.sampler is not None else memguard.Sampler(interval_ms=INTERVAL_MS)
    guard = memguard.Guard(budget=spec.budget_bytes if spec is not None else None, allocator=False,
                     sampler=sampler)
    guard.test_figures = functools.partial(plugin.figures, item)  # type: ignore[attr-defined]
    guard.install()
    try:
        yield guard
    finally:
        guard.uninstall()
