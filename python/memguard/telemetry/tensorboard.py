"""Telemetry as TensorBoard scalars.

::

    from memguard.telemetry.tensorboard import TensorBoardExporter

    tb = TensorBoardExporter("runs/exp1")
    guard = memguard.Guard(budget="auto", telemetry=tb)   # samples and events go to tb
    with guard:
        for batch in loader:
            guard.step(batch, loss_fn, optimizer)
    tb.close()

Like the JSONL and CSV exporters it is a callable taking a
:class:`~memguard.telemetry.Sample` (``sampler.on_sample(tb)``, or
``Guard(telemetry=tb)``, which registers it and leaves closing it to you)
with an :meth:`~TensorBoardExporter.event` method taking the guard's events
(``step``, ``oom_recovered``, ``relieve``, ``checkpoint``, ...): the guard
forwards its events to any exporter with ``event``, this one included. A
script passes events on itself only where the guard's telemetry is another
exporter and ``tb`` is attached with ``sampler.on_sample(tb)``. Samples are written at their ``seq``,
events at the training step (the ``step`` field, or the last one seen), both
with their wall time.

``torch.utils.tensorboard`` (and so the ``tensorboard`` package) is imported
when an exporter is made, never by ``import memguard``.
"""
from __future__ import annotations

import os
import threading
import time
from collections import Counter
from typing import Any, Callable

from memguard._common import finite
from memguard.telemetry.events import Event
from memguard.telemetry.exporters import warn_export_stopped
from memguard.telemetry.samples import Sample

#: Scalar tag -> sample field; a field that is None in a sample is skipped.
SAMPLE_TAGS: dict[str, str] = {
    "memory/rss_bytes": "rss_bytes",
    "memory/budget_bytes": "budget_bytes",
    "memory/arena_allocated_bytes": "arena_allocated_bytes",
    "memory/arena_reserved_bytes": "arena_reserved_bytes",
    "memory/mem_available_bytes": "mem_available_bytes",
    "memory/swap_bytes": "swap_bytes",
    "pressure/level": "level",
    "pressure/raw_level": "raw_level",
    "pressure/budget_used_fraction": "budget_used_fraction",
    "pressure/headroom_fraction": "headroom_fraction",
    "pressure/psi_some_stall": "psi_some_stall",
    "pressure/major_faults_per_s": "major_faults_per_s",
    "pressure/swap_in_pages_per_s": "swap_in_pages_per_s",
}

#: Scalar tag -> field of a ``step`` event.
STEP_TAGS: dict[str, str] = {
    "throttle/micro_batch": "micro_batch",
    "throttle/n_micro": "n_micro",
    "throttle/retries": "retries",
    "throttle/peak_bytes": "peak_bytes",
    "throttle/loss": "loss",
}

#: Events counted as a running total under a tag of their own.
COUNTED_TAGS: dict[str, str] = {
    Event.OOM_RECOVERED.value: "throttle/ooms_recovered",
    Event.OOM_GAVE_UP.value: "throttle/ooms_gave_up",
    Event.RELIEVE.value: "gc/reliefs",
    Event.CRITICAL.value: "throttle/critical",
}


class TensorBoardExporter:
    """Write telemetry samples and guard events as TensorBoard scalars.

    Like the file exporters, an :class:`OSError` from writing (a full disk)
    stops it with one :class:`~memguard.telemetry.ExportStoppedWarning`.

    Args:
        log_dir: the run's directory (what ``tensorboard --logdir`` points at
            or below).
        flush_secs: seconds between flushes of the event file (=10).

    Raises:
        ImportError: ``torch.utils.tensorboard`` cannot be imported (torch
            or the ``tensorboard`` package is missing).
    """

    def __init__(self, log_dir: str | os.PathLike, flush_secs: float = 10) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError("TensorBoardExporter needs torch and the tensorboard package "
                              f"(pip install tensorboard): {exc}") from exc
        self.log_dir = os.fspath(log_dir)
        self._w = SummaryWriter(log_dir=self.log_dir, flush_secs=flush_secs)
        self._lock = threading.Lock()   # samples come from the sampler's thread, events not
        self._closed = False
        self._step = 0                  # training step of the newest step event
        self._counts: Counter[str] = Counter()

    def _add(self, tag: str, value: Any, step: int, walltime: float | None) -> None:
        v = finite(value)
        if v is not None:
            self._w.add_scalar(tag, v, global_step=step, walltime=walltime)

    def _io(self, op: Callable[..., Any], *args: Any) -> None:
        """``op(*args)`` under the lock unless closed; an OSError closes the
        writer and warns."""
        with self._lock:
            if self._closed:
                return
            try:
                op(*args)
                return
            except OSError as exc:
                self._closed, error = True, exc
            try:
                self._w.close()
            except OSError:
                pass
        warn_export_stopped(self.log_dir, error)

    def __call__(self, s: Sample) -> None:
        """Write one sample's scalars at step ``s.seq``."""
        self._io(self._sample, s)

    def _sample(self, s: Sample) -> None:
        for tag, field in SAMPLE_TAGS.items():
            self._add(tag, getattr(s, field), s.seq, s.t)

    def event(self, name: Event | str, **data: Any) -> None:
        """Write one event: a ``step`` as its throttle scalars, a
        ``checkpoint`` as the blocks checkpointed, a ``forecast`` as its
        rate and steps left, a ``headroom`` as its largest batch, and any event as the
        running count of its kind (``throttle/ooms_recovered``,
        ``gc/reliefs``, ``events/<name>`` for others). Fields that are not
        numbers are left out."""
        self._io(self._event, str(name), data)

    def _event(self, name: str, data: dict[str, Any]) -> None:
        t = finite(data.get("t")) or time.time()
        step = finite(data.get("step"))
        if step is not None:
            self._step = int(step)
        if name == Event.STEP:
            for tag, field in STEP_TAGS.items():
                self._add(tag, data.get(field), self._step, t)
            return
        if name == Event.CHECKPOINT:
            self._add("throttle/checkpointed_blocks", data.get("blocks"), self._step, t)
        elif name == Event.RELIEVE:
            self._add("gc/relief_seconds", data.get("seconds"), self._step, t)
            self._add("gc/arena_released_bytes", data.get("arena_released_bytes"),
                      self._step, t)
        elif name == Event.FORECAST:
            self._add("drift/rate_bytes_per_step", data.get("rate_bytes_per_step"),
                      self._step, t)
            self._add("drift/steps_left", data.get("steps_left"), self._step, t)
        elif name == Event.HEADROOM:
            self._add("headroom/largest_batch", data.get("largest_batch"), self._step, t)
        self._counts[name] += 1
        self._add(COUNTED_TAGS.get(name, f"events/{name}"), self._counts[name],
                  self._step, t)

    def flush(self) -> None:
        """Write what is buffered to the event file now."""
        self._io(self._w.flush)

    def close(self) -> None:
        """Flush and close the event file. Idempotent."""
        self._io(self._finish)

    def _finish(self) -> None:
        self._closed = True
        self._w.close()

    def __enter__(self) -> TensorBoardExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
