"""Memory telemetry: samples taken by a C thread off the GIL, a pressure
level with hysteresis, callbacks on a Python thread, and exporters.

Sampling happens in C at a fixed interval (default 100 ms, 5 ms at least)
into a ring buffer; nothing on that path allocates or takes the GIL. A
Python dispatcher thread waits on the C side's eventfds with the GIL
released and runs the callbacks, so a slow or failing callback never delays
sampling. A callback that raises goes to :func:`sys.unraisablehook` and
sampling goes on.
"""
from __future__ import annotations

import atexit
import csv
import dataclasses
import enum
import io
import json
import math
import os
import platform
import sys
import threading
import time
import types
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO, Any, Callable

from memguard import _C
from memguard.budget import parse_budget

#: Version of the sample schema written by the exporters (2: arena_* fields;
#: 3: cuda_* fields; 4: the footprint, the process tree and the live budget).
SCHEMA_VERSION = 4
SCHEMA_NAME = "memguard.telemetry"


class Level(enum.IntEnum):
    """Memory pressure, ordered: compare with ``>=``."""

    OK = 0
    ELEVATED = 1
    HIGH = 2
    CRITICAL = 3


@dataclass(frozen=True)
class Sample:
    """One telemetry sample. Units are in the field names; a field is ``None``
    when its source is absent or unreadable here (never a made-up zero).

    Rates (``*_per_s``) and stall fractions (``*_stall``, the share of the
    interval since the previous sample that tasks spent stalled on memory)
    need a previous sample and are ``None`` on the first. PSI averages are
    percentages as the kernel reports them. ``swap_in_pages`` and friends are
    system-wide counters from ``/proc/vmstat``; faults are this process's.
    ``footprint_bytes`` is what a budget bounds: resident plus swapped-out
    bytes, plus what the process's children hold alone. ``budget_bytes`` is
    the budget the sample was judged against: with a live sampler, what the
    process can have now (``budget_source`` says what bound it), capped by
    ``user_budget_bytes``.
    """

    t: float  # seconds since the epoch
    seq: int
    interval_s: float | None
    sample_cost_us: float
    # the process
    rss_bytes: int | None
    rss_peak_bytes: int | None
    swap_bytes: int | None
    minor_faults: int | None
    major_faults: int | None
    minor_faults_per_s: float | None
    major_faults_per_s: float | None
    # the system
    mem_total_bytes: int | None
    mem_available_bytes: int | None
    swap_total_bytes: int | None
    swap_free_bytes: int | None
    swap_in_pages: int | None
    swap_out_pages: int | None
    system_major_faults: int | None
    swap_in_pages_per_s: float | None
    swap_out_pages_per_s: float | None
    # PSI (/proc/pressure/memory)
    psi_some_avg10: float | None
    psi_some_avg60: float | None
    psi_some_total_us: int | None
    psi_full_avg10: float | None
    psi_full_avg60: float | None
    psi_full_total_us: int | None
    psi_some_stall: float | None
    psi_full_stall: float | None
    # the memory cgroup (v1 or v2)
    cgroup_version: int | None
    cgroup_usage_bytes: int | None
    cgroup_limit_bytes: int | None
    cgroup_high_bytes: int | None
    cgroup_working_set_bytes: int | None
    cgroup_oom_events: int | None
    cgroup_oom_kill_events: int | None
    cgroup_psi_some_avg10: float | None
    cgroup_psi_full_avg10: float | None
    cgroup_psi_some_total_us: int | None
    cgroup_psi_full_total_us: int | None
    cgroup_psi_some_stall: float | None
    cgroup_psi_full_stall: float | None
    # pressure
    budget_bytes: int | None
    budget_used_fraction: float | None
    headroom_fraction: float | None
    raw_level: Level
    level: Level
    reasons: tuple[str, ...]
    # memguard's arena, when installed (memguard.install or memguard run)
    arena_allocated_bytes: int | None = None
    arena_reserved_bytes: int | None = None
    arena_cached_bytes: int | None = None
    arena_budget_bytes: int | None = None
    arena_ooms: int | None = None
    arena_budget_used_fraction: float | None = None
    # a CUDA device's allocator, pushed at step boundaries (memguard.cuda)
    cuda_device: int | None = None
    cuda_allocated_bytes: int | None = None
    cuda_reserved_bytes: int | None = None
    cuda_active_bytes: int | None = None
    cuda_allocated_peak_bytes: int | None = None
    cuda_reserved_peak_bytes: int | None = None
    cuda_alloc_retries: int | None = None
    cuda_ooms: int | None = None
    cuda_new_retries: int | None = None
    cuda_free_bytes: int | None = None
    cuda_total_bytes: int | None = None
    cuda_budget_bytes: int | None = None
    cuda_age_ns: int | None = None
    cuda_budget_used_fraction: float | None = None
    # what the budget bounds: the process's resident and swapped bytes, and
    # its children's own (DataLoader workers); where the budget came from
    footprint_bytes: int | None = None
    children: int | None = None
    children_bytes: int | None = None
    budget_source: str | None = None      # "user", "cgroup" or "host"
    user_budget_bytes: int | None = None  # the budget asked for, when one was

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Sample:
        """Build a sample from the C layer's dict or an exported record."""
        kw = {f.name: d.get(f.name) for f in _FIELDS}
        kw["level"] = _level(kw["level"])
        kw["raw_level"] = _level(kw["raw_level"])
        kw["reasons"] = tuple(kw["reasons"] or ())
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: levels by name, reasons as a list."""
        d = {f.name: getattr(self, f.name) for f in _FIELDS}
        d["level"] = self.level.name
        d["raw_level"] = self.raw_level.name
        d["reasons"] = list(self.reasons)
        return d


_FIELDS = dataclasses.fields(Sample)
FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in _FIELDS)


def _level(v: Any) -> Level:
    if isinstance(v, str):
        return Level[v]
    return Level(0 if v is None else v)


@dataclass(frozen=True)
class PressureEvent:
    """The pressure level changed from ``old`` to ``new`` at ``sample``."""

    old: Level
    new: Level
    sample: Sample


def _report_callback_error(cb: Callable[..., Any]) -> None:
    exc_type, exc, tb = sys.exc_info()
    sys.unraisablehook(
        types.SimpleNamespace(
            exc_type=exc_type,
            exc_value=exc,
            exc_traceback=tb,
            err_msg="Exception ignored in memguard telemetry callback",
            object=cb,
        )
    )


_live: weakref.WeakSet[Sampler] = weakref.WeakSet()


class Sampler:
    """The telemetry sampler.

    Args:
        interval_ms: sampling period, 5 to 60000 ms (default: option
            ``interval_ms``, 100).
        budget: a budget for the pressure model (see
            :func:`memguard.parse_budget`); ``None`` for none.
        ring_size: samples kept for :meth:`history` (default 4096).
        proc_root, cgroup_root: where procfs and the cgroup hierarchy are
            mounted; tests point them at recorded fixture trees.
        pressure: thresholds overriding the options, e.g.
            ``{"psi_high": 0.2, "calm_samples": 5}``.
        export: a path ending in ``.jsonl`` or ``.csv``; every sample is
            written there until :meth:`stop`.
        live: judge every sample against what the process can have at that
            moment (:func:`memguard.budget.live_budget`), capped by
            ``budget`` when one is given; ``None``: live when ``budget`` is
            ``"auto"``.

    Raises:
        ValueError: bad interval, budget, thresholds or export path.
    """

    def __init__(
        self,
        interval_ms: float | None = None,
        budget: str | int | None = None,
        *,
        ring_size: int | None = None,
        proc_root: str | None = None,
        cgroup_root: str | None = None,
        pressure: Mapping[str, float] | None = None,
        export: str | os.PathLike | None = None,
        live: bool | None = None,
    ) -> None:
        if interval_ms is not None and not (5 <= interval_ms <= 60000):
            raise ValueError(f"interval_ms {interval_ms!r} is out of range: use 5 to 60000")
        if ring_size is not None and ring_size < 2:
            raise ValueError(f"ring_size {ring_size!r} must be at least 2")
        auto = isinstance(budget, str) and budget.strip().lower() == "auto"
        self._live = auto if live is None else bool(live)
        self._budget = 0 if budget is None or auto else parse_budget(budget)
        self._c = _C.Sampler(
            interval_ms=float(interval_ms or 0),
            ring_size=int(ring_size or 0),
            budget_bytes=self._budget,
            proc_root=None if proc_root is None else os.fspath(proc_root),
            cgroup_root=None if cgroup_root is None else os.fspath(cgroup_root),
            pressure=dict(pressure) if pressure else None,
            live=self._live,
        )
        self._lock = threading.Lock()  # guards the callback lists and thread state
        self._on_sample: list[Callable[[Sample], Any]] = []
        self._on_pressure: list[Callable[[PressureEvent], Any]] = []
        self._thread: threading.Thread | None = None
        self._stop_evt = threading.Event()  # one per callback-thread run, set by stop()
        self._dispatch_lock = threading.Lock()  # one _dispatch at a time
        self._last_seq = 0
        self._last_level = Level.OK
        self._exporter: _Exporter | None = None
        self._export_path = export
        #: samples overwritten in the ring before the dispatcher saw them
        self.dropped = 0
        _live.add(self)

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> Sampler:
        """Start sampling (and the callback thread). Idempotent."""
        with self._lock:
            if self._thread is not None:
                return self
            opened = None
            if self._export_path is not None and self._exporter is None:
                opened = self._exporter = open_exporter(self._export_path)
                self._on_sample.append(opened)
                self._c.notify_samples(True)
            try:
                self._c.start()
            except BaseException:
                if opened is not None:
                    self._on_sample.remove(opened)
                    self._exporter = None
                    opened.close()
                raise
            self._stop_evt = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(self._stop_evt,), name="memguard-telemetry",
                daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling; callbacks see every sample taken before this. Idempotent."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            self._c.stop()
            self._stop_evt.set()
            self._c.wake()
            exporter, self._exporter = self._exporter, None
        if thread is not threading.current_thread():
            thread.join()
        if exporter is not None:
            with self._lock:
                if exporter in self._on_sample:
                    self._on_sample.remove(exporter)
            exporter.close()

    @property
    def running(self) -> bool:
        """Whether the sampling thread runs."""
        return self._c.running

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- readings ----------------------------------------------------------
    def latest(self) -> Sample | None:
        """The newest sample, or ``None`` before the first."""
        d = self._c.latest()
        return None if d is None else Sample.from_dict(d)

    def history(self, n: int | None = None) -> list[Sample]:
        """Up to ``n`` newest samples still in the ring, oldest first."""
        newest = self._c.latest()
        if newest is None:
            return []
        n = newest["seq"] if n is None else n
        if n <= 0:
            return []
        after = max(newest["seq"] - n, 0)
        samples, _ = self._c.since(after, n)
        return [Sample.from_dict(d) for d in samples]

    def sample_now(self) -> Sample:
        """Take one sample on this thread; only while not running.

        Raises:
            RuntimeError: the sampling thread is running.
        """
        return Sample.from_dict(self._c.sample_now())

    @property
    def budget_bytes(self) -> int | None:
        """The budget asked for, or ``None`` (for a live sampler: none, or
        ``"auto"``; each sample's ``budget_bytes`` is the live one)."""
        return self._budget or None

    @property
    def live(self) -> bool:
        """Whether samples are judged against the live budget."""
        return self._live

    def set_budget(self, budget: str | int | None, live: bool | None = None) -> None:
        """Change the budget from the next sample on (``"auto"``: the live
        budget alone); ``live`` as in the constructor (``None``: keep it,
        unless ``budget`` is ``"auto"``)."""
        auto = isinstance(budget, str) and budget.strip().lower() == "auto"
        new = 0 if budget is None or auto else parse_budget(budget)
        self._budget = new
        if auto or live is not None:
            self._live = auto or bool(live)
            self._c.set_live(self._live)
        self._c.set_budget(self._budget)

    def push_cuda(self, counters: Mapping[str, int | None]) -> Level:
        """Hand the sampler a CUDA device's allocator counters (keys:
        ``device``, ``allocated_bytes``, ``reserved_bytes``, ``active_bytes``,
        ``allocated_peak_bytes``, ``reserved_peak_bytes``, ``alloc_retries``,
        ``ooms``, ``free_bytes``, ``total_bytes``, ``budget_bytes``): every
        later sample carries them until the next push. Returns the level of
        the CUDA signals alone (budget use; HIGH when allocation retries
        rose since the last push), judged at once."""
        return Level(self._c.push_cuda(dict(counters)))

    @property
    def cpu_seconds(self) -> float:
        """CPU time spent by the C sampling thread."""
        return self._c.cpu_ns() / 1e9

    # -- callbacks ---------------------------------------------------------
    def on_sample(self, fn: Callable[[Sample], Any]) -> Callable[[Sample], Any]:
        """Call ``fn(sample)`` for every sample, on the callback thread.

        Returns ``fn``, so this works as a decorator.
        """
        with self._lock:
            self._on_sample.append(fn)
            self._c.notify_samples(True)
        return fn

    def on_pressure(
        self, fn: Callable[[PressureEvent], Any]
    ) -> Callable[[PressureEvent], Any]:
        """Call ``fn(event)`` whenever the pressure level changes."""
        with self._lock:
            self._on_pressure.append(fn)
        return fn

    def remove_callback(self, fn: Callable[..., Any]) -> None:
        """Forget ``fn`` (registered with either method)."""
        with self._lock:
            for lst in (self._on_sample, self._on_pressure):
                while fn in lst:
                    lst.remove(fn)
            self._c.notify_samples(bool(self._on_sample))

    # -- the callback thread -----------------------------------------------
    def _run(self, stop_evt: threading.Event) -> None:
        while True:
            stopping = stop_evt.is_set()
            self._c.wait(0 if stopping else 1.0)
            self._dispatch()
            if stopping:
                return

    def _dispatch(self) -> None:
        with self._dispatch_lock:
            with self._lock:
                on_sample = list(self._on_sample)
                on_pressure = list(self._on_pressure)
            if not on_sample and not on_pressure:
                d = self._c.latest()  # nobody listens: just keep up
                if d is not None:
                    self._last_seq = d["seq"]
                    self._last_level = Level(d["level"])
                return
            # every sample in order, so no level change is missed or merged
            while True:
                batch, dropped = self._c.since(self._last_seq, 1024)
                self.dropped += dropped
                if not batch:
                    return
                for d in batch:
                    self._deliver(Sample.from_dict(d), on_sample, on_pressure)

    def _deliver(self, s: Sample, on_sample: list, on_pressure: list) -> None:
        self._last_seq = s.seq
        for cb in on_sample:
            try:
                cb(s)
            except Exception:  # noqa: BLE001 - a failing callback must not stop telemetry
                _report_callback_error(cb)
        if s.level != self._last_level:
            ev = PressureEvent(old=self._last_level, new=s.level, sample=s)
            self._last_level = s.level
            for cb in on_pressure:
                try:
                    cb(ev)
                except Exception:  # noqa: BLE001 - as above
                    _report_callback_error(cb)

    def _after_fork_in_child(self) -> None:
        # The C layer stopped itself in the child; the dead callback thread's
        # bookkeeping goes, and so does the exporter: its file is the
        # parent's, and its lock may have been held at the fork.
        self._lock = threading.Lock()
        self._dispatch_lock = threading.Lock()
        self._stop_evt = threading.Event()
        self._thread = None
        if self._exporter is not None:
            self._on_sample.remove(self._exporter)
            self._exporter = None
        self._export_path = None


def _after_fork_in_child() -> None:
    for s in list(_live):
        s._after_fork_in_child()


def _stop_all_at_exit() -> None:
    for s in list(_live):
        try:
            s.stop()
        except Exception:  # noqa: BLE001 - exiting anyway; report, do not raise
            _report_callback_error(s.stop)


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_stop_all_at_exit)


# -- one synchronous reading ----------------------------------------------
_oneshot_lock = threading.Lock()
_oneshot: _C.Sampler | None = None


def sample() -> Sample:
    """One synchronous reading of every source.

    Successive calls share state, so from the second on, rates and stall
    fractions cover the time since the previous call.
    """
    global _oneshot
    with _oneshot_lock:
        if _oneshot is None:
            _oneshot = _C.Sampler(interval_ms=100)
        return Sample.from_dict(_oneshot.sample_now())


def _reset_oneshot_in_child() -> None:
    global _oneshot, _oneshot_lock
    _oneshot_lock = threading.Lock()
    _oneshot = None


os.register_at_fork(after_in_child=_reset_oneshot_in_child)


# -- exporters -------------------------------------------------------------
class _Exporter:
    """Base: a callable taking samples, writing to a file, closable."""

    def __init__(self, path: str | os.PathLike | IO[str]) -> None:
        if isinstance(path, io.TextIOBase):
            self._f: IO[str] = path
            self._owns = False
        else:
            os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
            # kept open for the exporter's life; close() closes it
            self._f = open(  # noqa: SIM115
                os.fspath(path), "w", buffering=1, encoding="utf-8", newline=""
            )
            self._owns = True
        self._lock = threading.Lock()

    def __call__(self, s: Sample) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flush, and close the file if this exporter opened it."""
        with self._lock:
            if self._f.closed:
                return
            self._f.flush()
            if self._owns:
                self._f.close()

    def __enter__(self) -> _Exporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _json_safe(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


class JsonlExporter(_Exporter):
    """Write samples as JSON lines.

    The first line is a header ``{"type": "meta", "schema": ..., "schema_version": 1,
    "fields": [...], ...}``; each sample is ``{"type": "sample", ...fields}``;
    :meth:`event` writes ``{"type": "event", "event": name, "t": ..., ...}``.
    """

    def __init__(
        self, path: str | os.PathLike | IO[str], meta: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(path)
        head = {
            "type": "meta",
            "schema": SCHEMA_NAME,
            "schema_version": SCHEMA_VERSION,
            "fields": list(FIELD_NAMES),
            "t": time.time(),
            "pid": os.getpid(),
            "host": platform.node(),
            "memguard": _version(),
        }
        head.update(meta or {})
        self._write(head)

    def _write(self, rec: Mapping[str, Any]) -> None:
        line = json.dumps({k: _json_safe(v) for k, v in rec.items()}, separators=(",", ":"))
        with self._lock:
            if not self._f.closed:
                self._f.write(line + "\n")

    def __call__(self, s: Sample) -> None:
        rec: dict[str, Any] = {"type": "sample"}
        rec.update(s.to_dict())
        self._write(rec)

    def event(self, name: str, **data: Any) -> None:
        """Write one event record (gc run, shrink, OOM recovered, ...)."""
        rec: dict[str, Any] = {"type": "event", "event": name, "t": time.time()}
        rec.update(data)
        self._write(rec)


class CsvExporter(_Exporter):
    """Write samples as CSV: a header row, then one row per sample. The first
    column, ``schema_version``, carries the schema version on every row."""

    def __init__(self, path: str | os.PathLike | IO[str]) -> None:
        super().__init__(path)
        self._w = csv.writer(self._f)
        self._w.writerow(("schema_version",) + FIELD_NAMES)

    def __call__(self, s: Sample) -> None:
        d = s.to_dict()
        row = [SCHEMA_VERSION] + [
            "" if d[k] is None else (" ".join(d[k]) if k == "reasons" else d[k])
            for k in FIELD_NAMES
        ]
        with self._lock:
            if not self._f.closed:
                self._w.writerow(row)


def open_exporter(path: str | os.PathLike) -> _Exporter:
    """A JSONL or CSV exporter, chosen by the file's suffix.

    Raises:
        ValueError: the suffix is neither ``.jsonl`` nor ``.csv``.
    """
    p = os.fspath(path)
    if p.endswith(".jsonl"):
        return JsonlExporter(p)
    if p.endswith(".csv"):
        return CsvExporter(p)
    raise ValueError(f"telemetry export path {p!r} must end in .jsonl or .csv")


def read_jsonl(path: str | os.PathLike) -> tuple[dict[str, Any], list[Sample], list[dict]]:
    """Read a JSONL telemetry file back: (meta, samples, events).

    Raises:
        ValueError: not a memguard telemetry file, or a newer schema.
    """
    meta: dict[str, Any] = {}
    samples: list[Sample] = []
    events: list[dict] = []
    with open(os.fspath(path), encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            kind = rec.get("type")
            if kind == "meta":
                if rec.get("schema") != SCHEMA_NAME:
                    raise ValueError(f"{os.fspath(path)!r} is not a memguard telemetry file")
                if rec.get("schema_version", 0) > SCHEMA_VERSION:
                    raise ValueError(
                        f"{os.fspath(path)!r} has schema version {rec['schema_version']}, "
                        f"newer than this memguard's {SCHEMA_VERSION}"
                    )
                meta = rec
            elif kind == "sample":
                samples.append(Sample.from_dict(rec))
            elif kind == "event":
                events.append(rec)
            else:
                raise ValueError(f"{os.fspath(path)!r} line {n}: unknown record type {kind!r}")
    if not meta:
        raise ValueError(f"{os.fspath(path)!r} has no memguard telemetry header")
    return meta, samples, events


def _version() -> str:
    from memguard import __version__

    return __version__
