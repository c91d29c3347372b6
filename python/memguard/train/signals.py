"""What a guard hears between steps: the telemetry sampler's levels, the
CUDA governor's counters, and where its events go.

The sampler's callbacks run on its own thread; the step reads what they
gathered at its boundary (:meth:`Signals.boundary_level`). A level that
shrinks the plan must come from a sample of the last step itself at HIGH or
above, not from the hysteresis level alone: a step already shrunk is not
shrunk again for pressure it no longer causes.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from typing import Any, Callable

from memguard import _C
from memguard._common import each, size
from memguard._options import MemguardConfigWarning
from memguard.memory.cuda import Governor
from memguard.memory.mps import MpsGovernor
from memguard.telemetry.events import Event
from memguard.telemetry.exporters import ExportStoppedWarning, open_exporter
from memguard.telemetry.sampler import Sampler
from memguard.telemetry.samples import Level, PressureEvent, sample
from memguard.train.config import GuardConfig


class Signals:
    """The sampler, the exporter and the CUDA governor of one guard.

    Args:
        config: the guard's options (telemetry, sampler, interval_ms,
            cuda, cuda_budget).
        on_high: called when the sampler's level rises to HIGH or above.
    """

    def __init__(self, config: GuardConfig, on_high: Callable[[], Any]) -> None:
        self._config = config
        self._on_high = on_high
        self.exporter: Any = None
        self._own_exporter = False
        self._opened = False            # the telemetry path was opened once: append to it
        self._events_failed = False     # the exporter's event() raised: no more events
        self.sampler: Sampler | None = config.sampler
        self._own_sampler = False
        #: the device governor in use: CUDA's (None until CUDA is), or the MPS one given
        self.governor: Governor | MpsGovernor | None = None
        self._own_governor = False
        #: the CUDA counters pushed at this boundary, read from the device
        #: itself (``None``: none were): the step's peak meter starts from them
        self.cuda_pushed: dict[str, Any] | None = None
        self._running = False
        self._lock = threading.Lock()   # guards the four fields below
        self._max_raw = Level.OK        # highest raw level since the last boundary
        self._window_t = 0.0            # samples taken before (epoch s) were of a failed attempt
        self._level = Level.OK          # level of the newest sample
        self._outside_peak = 0          # most held outside the arena since the boundary
        self._delivered: Any = None     # the newest sample the callbacks delivered
        #: called on the sampler's thread after each sample is taken in
        self.after_sample: Callable[[], Any] | None = None

    # -- lifecycle -------------------------------------------------------------
    def install(self, budget: int | None, live: bool) -> None:
        """Open the exporter, start the sampler (judging samples against
        ``budget``, live or not) and, where asked for, the governor."""
        c = self._config
        if c.telemetry is not None:
            if isinstance(c.telemetry, (str, os.PathLike)):
                # a guard installed again (Lightning's validate, then fit)
                # goes on in its file: the earlier run's records stay
                self.exporter = open_exporter(c.telemetry, append=self._opened)
                self._own_exporter = self._opened = True
            else:
                self.exporter = c.telemetry
        if c.sampler is not None:
            self.sampler, self._own_sampler = c.sampler, not c.sampler.running
        else:
            self.sampler = Sampler(interval_ms=c.interval_ms, budget=budget, live=live)
            self._own_sampler = True
        if self.exporter is not None:
            self.sampler.on_sample(self.exporter)
        self.sampler.on_pressure(self._on_pressure)
        self.sampler.on_sample(self._on_sample)
        self.sampler.start()
        self._running = True
        if budget and sample().footprint_bytes is None:
            warnings.warn(
                f"memguard: the {_C.PLATFORM} platform layer cannot see what this process "
                f"holds, so the budget of {size(budget)} is not enforced; steps still split "
                f"and recover from out-of-memory errors", MemguardConfigWarning, stacklevel=4)
        torch = sys.modules.get("torch")
        if c.mps is not None:
            self.governor, self._own_governor = c.mps.install(), False
        elif isinstance(c.cuda, Governor) or (c.cuda is None and c.cuda_budget is not None
                                              and torch is not None and
                                              torch.cuda.is_available()):
            self._start_governor()

    def uninstall(self) -> None:
        """Stop what :meth:`install` started (the sampler first: the exporter
        gets every sample taken), and close an exporter opened from a path.
        Every part runs even when one raises."""
        self._running = False
        each(self._stop_governor, self._stop_sampler, self._close_exporter)

    def _stop_governor(self) -> None:
        governor, self.governor = self.governor, None
        if governor is not None and self._own_governor:
            governor.uninstall()

    def _stop_sampler(self) -> None:
        sampler, self.sampler = self.sampler, self._config.sampler
        if sampler is None:
            return
        try:
            if self._own_sampler:
                sampler.stop()
        finally:
            for fn in (self._on_pressure, self._on_sample, self.exporter):
                if fn is not None:
                    sampler.remove_callback(fn)

    def _close_exporter(self) -> None:
        exporter, self.exporter = self.exporter, None
        if self._own_exporter and exporter is not None:
            exporter.close()

    def event(self, name: Event | str, data: dict | None = None, **kw: Any) -> None:
        """Write an event where the exporter takes them (JSONL, TensorBoard).
        An exporter whose ``event`` raises (a user's object) gets no more
        events, with one warning: telemetry never fails the step."""
        write = getattr(self.exporter, "event", None)
        if callable(write) and not self._events_failed:
            try:
                write(name, **(data or {}), **kw)
            except Exception as exc:  # noqa: BLE001 - said once, then no more events
                self._events_failed = True
                warnings.warn(f"memguard: telemetry events to {self.exporter!r} stopped: "
                              f"{type(exc).__name__}: {exc}; the run goes on without them",
                              ExportStoppedWarning, stacklevel=2)

    # -- the sampler's thread ----------------------------------------------------
    def _on_pressure(self, ev: PressureEvent) -> None:
        if ev.new >= Level.HIGH > ev.old:
            self._on_high()

    def _on_sample(self, s: Any) -> None:
        # the callback thread may hand a sample over late: one taken before
        # an out-of-memory retry began was of the attempt the OOM answered
        t = getattr(s, "t", None)
        foot = getattr(s, "footprint_bytes", None)
        outside = foot - (getattr(s, "arena_reserved_bytes", None) or 0) if foot else 0
        with self._lock:
            if t is None or t >= self._window_t:
                self._max_raw = max(self._max_raw, s.raw_level)
            self._level = s.level
            self._delivered = s
            self._outside_peak = max(self._outside_peak, outside)
        if self.after_sample is not None:
            self.after_sample()

    # -- at a step boundary --------------------------------------------------------
    def latest_sample(self) -> Any:
        """The newest sample (one taken now when the sampler has none)."""
        s = self.sampler.latest() if self.sampler is not None else None
        return s if s is not None else sample()

    def delivered(self) -> Any:
        """The newest sample the sampler's callbacks delivered (``None``
        before the first): read between an inference's micro-batches, where
        taking or converting a sample would cost more than reading it."""
        with self._lock:
            return self._delivered

    def take_outside_peak(self) -> int:
        """The most held outside the arena since the last call."""
        with self._lock:
            out, self._outside_peak = self._outside_peak, 0
        return out

    def forget_attempt(self) -> None:
        """An out-of-memory error already shrank the plan: the failed
        attempt's pressure does not count again."""
        with self._lock:
            self._max_raw = Level.OK
            self._window_t = time.time()

    def boundary_level(self) -> int:
        """The level a step boundary acts on: HIGH or above from a sample of
        the last step (before hysteresis) shrinks; while the hysteresis level
        stays up the size holds (ELEVATED); growth waits for a calm level.
        The CUDA counters pushed now count at once."""
        cuda = self._cuda_level()
        with self._lock:
            raw, level = max(self._max_raw, cuda), self._level
            self._max_raw = Level.OK
        if raw >= Level.HIGH:
            return int(raw)
        if level >= Level.ELEVATED:
            return int(Level.ELEVATED)
        return int(raw)

    def _cuda_level(self) -> int:
        """Push the device's counters: the level of the CUDA signals. The
        governor starts once CUDA is in use."""
        self.cuda_pushed = None
        if self.governor is None:
            torch = sys.modules.get("torch")
            if self._config.cuda is not None or not self._running or torch is None \
                    or not torch.cuda.is_initialized():
                return Level.OK
            self._start_governor()
        gov = self.governor
        assert gov is not None
        level = int(gov.push())
        if isinstance(gov, Governor) and not gov.replayed:
            self.cuda_pushed = gov.last
        return level

    def _start_governor(self) -> None:
        """The governor given, or a new one for the configured budget."""
        c = self._config
        given = isinstance(c.cuda, Governor)
        gov = c.cuda if given else Governor("cuda", c.cuda_budget)
        self._own_governor = not given
        if gov.sampler is None:
            gov.sampler = self.sampler
        if gov.on_event is None:
            gov.on_event = self.event
        gov.install()
        self.governor = gov
