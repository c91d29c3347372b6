"""The telemetry sampler: samples taken by a C thread off the GIL, a
pressure level with hysteresis, and callbacks on a Python thread.

Sampling happens in C at a fixed interval (default 100 ms, 5 ms at least)
into a ring buffer; nothing on that path allocates or takes the GIL. A
Python dispatcher thread waits on the C side's eventfds with the GIL
released and runs the callbacks, so a slow or failing callback never delays
sampling. A callback that raises goes to :func:`sys.unraisablehook` and
sampling goes on.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import types
import weakref
from collections.abc import Mapping
from typing import Any, Callable

from memguard import _C
from memguard._common import is_auto
from memguard.telemetry.budget import parse_budget
from memguard.telemetry.exporters import Exporter, check_export_path, open_exporter
from memguard.telemetry.samples import Level, PressureEvent, Sample

#: CPython's ``UnraisableHookArgs``, the one type the default
#: :func:`sys.unraisablehook` accepts; it has no importable name, but it is a
#: tuple subclass (None where an interpreter has no such type).
_HOOK_ARGS: type | None = next((t for t in tuple.__subclasses__()
                                if t.__name__ == "UnraisableHookArgs"), None)


def _hook_args(exc_type: Any, exc: Any, tb: Any, err_msg: str, obj: object) -> Any:
    """What :func:`sys.unraisablehook` takes, for the exception given."""
    if _HOOK_ARGS is not None:
        return _HOOK_ARGS((exc_type, exc, tb, err_msg, obj))
    return types.SimpleNamespace(exc_type=exc_type, exc_value=exc, exc_traceback=tb,
                                 err_msg=err_msg, object=obj)


def _report_callback_error(cb: Callable[..., Any]) -> None:
    """Hand the exception being handled to :func:`sys.unraisablehook`, as
    the interpreter does for a failing ``gc`` callback; never raises, so the
    callback thread outlives any callback (and any hook)."""
    hook = sys.unraisablehook
    try:
        hook(_hook_args(*sys.exc_info(), "Exception ignored in memguard telemetry callback",
                        cb))
    except BaseException:  # noqa: BLE001 - as the interpreter does: the default hook says why
        try:
            sys.__unraisablehook__(_hook_args(*sys.exc_info(),
                                              "Exception ignored in sys.unraisablehook", hook))
        except BaseException:  # noqa: BLE001, S110 - nowhere left to report; telemetry goes on
            pass


_live: weakref.WeakSet[Sampler] = weakref.WeakSet()


RING_MAX = 1 << 20     # the ring_size option's upper bound


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
            written there from :meth:`start` (which raises ``ValueError``
            for another suffix) until :meth:`stop`.
        live: judge every sample against what the process can have at that
            moment (:func:`memguard.memory.room.live_budget`), capped by
            ``budget`` when one is given; ``None``: live when ``budget`` is
            ``"auto"``.

    Raises:
        ValueError: bad interval, budget or thresholds.
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
        if ring_size is not None and (isinstance(ring_size, bool) or not isinstance(ring_size, int)
                                      or not 2 <= ring_size <= RING_MAX):
            raise ValueError(f"ring_size {ring_size!r} is out of range: use an integer from 2 "
                             f"to {RING_MAX}")
        if export is not None:
            check_export_path(export)
        auto = is_auto(budget)
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
        self._exporter: Exporter | None = None
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
        auto = is_auto(budget)
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
            # every sample in order, so no level change is missed or merged;
            # the callbacks are read again for each batch, so one registered
            # while this thread is behind hears every sample taken after it
            while True:
                with self._lock:
                    on_sample = list(self._on_sample)
                    on_pressure = list(self._on_pressure)
                if not on_sample and not on_pressure:
                    d = self._c.latest()  # nobody listens: just keep up
                    if d is not None:
                        self._last_seq = d["seq"]
                        self._last_level = Level(d["level"])
                    return
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
            except BaseException:  # noqa: BLE001 - a failing callback must not stop telemetry
                _report_callback_error(cb)
        if s.level != self._last_level:
            ev = PressureEvent(old=self._last_level, new=s.level, sample=s)
            self._last_level = s.level
            for cb in on_pressure:
                try:
                    cb(ev)
                except BaseException:  # noqa: BLE001 - as above
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
