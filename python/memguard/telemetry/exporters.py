"""Telemetry files: JSONL (samples and the guard's events) and CSV, and
:func:`read_jsonl` to read a JSONL run back."""
from __future__ import annotations

import csv
import io
import json
import math
import os
import platform
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import IO, Any, BinaryIO, Callable

from memguard._common import VERSION, finite, size, unwritable
from memguard.telemetry.samples import FIELD_NAMES, SCHEMA_NAME, SCHEMA_VERSION, Level, Sample


class ExportStoppedWarning(UserWarning):
    """An exporter could not write its file (a full disk, a lost mount) and
    writes no more; the run it watches goes on."""


def warn_export_stopped(where: str, exc: OSError) -> None:
    """Say that writing telemetry to ``where`` failed with ``exc`` and
    stopped (its exporter says so once)."""
    warnings.warn(f"memguard: telemetry to {where!r} stopped: {exc}; the run goes on "
                  f"without it", ExportStoppedWarning, stacklevel=3)


class Exporter:
    """Base: a callable taking samples, writing to a file, closable.

    A write, flush or close that raises :class:`OSError` (a full disk, a
    lost mount) stops the exporter with one :class:`ExportStoppedWarning`:
    telemetry never fails the step, the sample or the uninstall it serves.
    """

    def __init__(self, path: str | os.PathLike | IO[str], append: bool = False) -> None:
        self._stopped = False  # an OSError ended its writing
        if isinstance(path, io.TextIOBase):
            self._f: IO[str] = path
            self._owns = False
            self._where = str(getattr(path, "name", repr(path)))
        else:
            where = os.fspath(path)
            try:
                # kept open for the exporter's life; close() closes it
                self._f = open(where, "a" if append else "w", buffering=1,  # noqa: SIM115
                               encoding="utf-8", newline="")
            except OSError as exc:
                raise ValueError(f"cannot write telemetry to {where!r}: "
                                 f"{unwritable(exc, where)}") from exc
            self._owns = True
            self._where = where
        self._lock = threading.Lock()

    def __call__(self, s: Sample) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flush, and close the file if this exporter opened it."""
        self._io(self._finish)

    def _finish(self) -> None:
        self._f.flush()
        if self._owns:
            self._f.close()

    def _io(self, op: Callable[..., Any], *args: Any) -> None:
        """``op(*args)`` on the file unless it is closed or the exporter
        stopped; an OSError stops the exporter (closing a file it opened)
        and warns."""
        with self._lock:
            if self._stopped or self._f.closed:
                return
            try:
                op(*args)
                return
            except OSError as exc:
                self._stopped, error = True, exc
            if self._owns:
                try:
                    self._f.close()  # flushes what is left, fails again, and closes
                except OSError:
                    pass
        warn_export_stopped(self._where, error)

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _json_safe(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


class JsonlExporter(Exporter):
    """Write samples as JSON lines.

    The first line is a header ``{"type": "meta", "schema": ..., "schema_version": 4,
    "fields": [...], ...}``; each sample is ``{"type": "sample", ...fields}``;
    :meth:`event` writes ``{"type": "event", "event": name, "t": ..., ...}``.
    """

    def __init__(self, path: str | os.PathLike | IO[str], meta: Mapping[str, Any] | None = None,
                 append: bool = False) -> None:
        super().__init__(path, append)
        head = {
            "type": "meta",
            "schema": SCHEMA_NAME,
            "schema_version": SCHEMA_VERSION,
            "fields": list(FIELD_NAMES),
            "t": time.time(),
            "pid": os.getpid(),
            "host": platform.node(),
            "memguard": VERSION,
        }
        head.update(meta or {})
        self._write(head)

    def _write(self, rec: Mapping[str, Any]) -> None:
        line = json.dumps({k: _json_safe(v) for k, v in rec.items()}, separators=(",", ":"))
        self._io(self._f.write, line + "\n")

    def __call__(self, s: Sample) -> None:
        rec: dict[str, Any] = {"type": "sample"}
        rec.update(s.to_dict())
        self._write(rec)

    def event(self, name: str, **data: Any) -> None:
        """Write one event record (gc run, shrink, OOM recovered, ...)."""
        rec: dict[str, Any] = {"type": "event", "event": str(name), "t": time.time()}
        rec.update(data)
        self._write(rec)


class CsvExporter(Exporter):
    """Write samples as CSV: a header row, then one row per sample. The first
    column, ``schema_version``, carries the schema version on every row."""

    def __init__(self, path: str | os.PathLike | IO[str], append: bool = False) -> None:
        super().__init__(path, append)
        self._w = csv.writer(self._f)
        if not append:
            self._io(self._w.writerow, ("schema_version",) + FIELD_NAMES)

    def __call__(self, s: Sample) -> None:
        d = s.to_dict()
        row = [SCHEMA_VERSION] + [
            "" if d[k] is None else (" ".join(d[k]) if k == "reasons" else d[k])
            for k in FIELD_NAMES
        ]
        self._io(self._w.writerow, row)


def open_exporter(path: str | os.PathLike, append: bool = False) -> Exporter:
    """A JSONL or CSV exporter, chosen by the file's suffix; ``append``:
    after what the file holds (a JSONL file gets another header, which
    readers take in their stride), else in place of it.

    Raises:
        ValueError: the suffix is neither ``.jsonl`` nor ``.csv``.
    """
    p = check_export_path(path)
    return JsonlExporter(p, append=append) if p.endswith(".jsonl") else CsvExporter(p, append)


def check_export_path(path: str | os.PathLike) -> str:
    """``path`` as text, if it names a telemetry file this package writes.

    Raises:
        ValueError: the suffix is neither ``.jsonl`` nor ``.csv``.
    """
    p = os.fspath(path)
    if not p.endswith((".jsonl", ".csv")):
        raise ValueError(f"telemetry export path {p!r} must end in .jsonl or .csv")
    return p


#: A telemetry line longer than this is skipped unread (a record is a few KiB).
MAX_LINE_BYTES = 1 << 20
#: A line still going on after this many bytes ends the reading: what follows
#: is not JSON lines (``/dev/zero``, a disk image) or has no end.
MAX_SKIP_BYTES = 1 << 28
_READ_BUFFER = 1 << 16
_SHOWN = 5              # skipped lines a warning names


def bounded_lines(f: BinaryIO) -> Iterator[tuple[int, bytes, str | None]]:
    """The lines of a binary file, numbered from 1, never holding more than
    :data:`MAX_LINE_BYTES` of one.

    Yields:
        ``(number, line, None)``; or ``(number, b"", why)`` for a line longer
        than :data:`MAX_LINE_BYTES`, skipped unread. A line that has not ended
        after :data:`MAX_SKIP_BYTES` is the last one: the rest is not read.
    """
    n = 0
    while line := f.readline(MAX_LINE_BYTES + 1):
        n += 1
        if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
            yield n, line, None
            continue
        skipped = len(line)
        while line and not line.endswith(b"\n") and skipped <= MAX_SKIP_BYTES:
            line = f.readline(MAX_LINE_BYTES)
            skipped += len(line)
        if line and not line.endswith(b"\n"):
            yield n, b"", (f"goes on past {size(MAX_SKIP_BYTES)} without a newline; "
                           f"the rest of the file is not read")
            return
        yield n, b"", f"longer than {size(MAX_LINE_BYTES)}, not read"


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[str, dict[str, Any] | Sample]]:
    """Stream a JSONL telemetry file, in memory bounded by :data:`MAX_LINE_BYTES`
    whatever its length.

    A line that cannot be read (cut short when a run was killed, not JSON or
    not UTF-8, longer than :data:`MAX_LINE_BYTES`, a sample whose fields are
    not numbers) is skipped; once the file is read to its end, one
    :class:`SkippedLinesWarning` counts the skipped lines and names the first
    few by number and why.

    Yields:
        ``("meta", header)`` first, then ``("sample", Sample)`` and
        ``("event", record)`` in file order (a later header: ``("meta", ...)``
        again).

    Raises:
        ValueError: not a memguard telemetry file (no header on its first
            record), or a newer schema.
        OSError: the file cannot be opened or read.
    """
    where = os.fspath(path)
    meta = False
    skipped: list[tuple[int, str]] = []   # the first _SHOWN
    count = 0
    with open(where, "rb", buffering=_READ_BUFFER) as f:
        for n, raw, why in bounded_lines(f):
            if why is None and not raw.strip():
                continue
            rec, why = _record(raw) if why is None else (None, why)
            if rec is not None and rec.get("type") == "meta":
                _check_meta(where, rec)
                meta = True
                yield "meta", rec
            elif not meta:
                raise ValueError(f"{where!r} is not memguard telemetry: line {n} comes before "
                                 f"any memguard header ({why or 'not a header record'})")
            elif why is not None:
                count += 1
                if len(skipped) < _SHOWN:
                    skipped.append((n, why))
            elif rec["type"] == "sample":
                yield "sample", Sample.from_dict(rec)
            else:
                yield "event", rec
    if not meta:
        raise ValueError(f"{where!r} has no memguard telemetry header")
    if count:
        shown = "; ".join(f"line {n}: {why}" for n, why in skipped)
        more = f"; and {count - len(skipped)} more" if count > len(skipped) else ""
        warnings.warn(f"{where}: skipped {count} unreadable line(s) ({shown}{more})",
                      SkippedLinesWarning, stacklevel=2)


def read_jsonl(path: str | os.PathLike) -> tuple[dict[str, Any], list[Sample], list[dict]]:
    """Read a JSONL telemetry file back: (meta, samples, events).

    The file is read by :func:`iter_jsonl` (a large one is better streamed
    with it): unreadable lines are skipped, and one
    :class:`SkippedLinesWarning` names them.

    Raises:
        ValueError: not a memguard telemetry file (no header on its first
            record), or a newer schema.
    """
    meta: dict[str, Any] = {}
    samples: list[Sample] = []
    events: list[dict] = []
    for kind, rec in iter_jsonl(path):
        if kind == "meta":
            meta = rec
        elif kind == "sample":
            samples.append(rec)
        else:
            events.append(rec)
    return meta, samples, events


class SkippedLinesWarning(UserWarning):
    """:func:`read_jsonl` skipped lines of a telemetry file it could not read."""


def _check_meta(where: str, rec: dict) -> None:
    if rec.get("schema") != SCHEMA_NAME:
        raise ValueError(f"{where!r} is not a memguard telemetry file")
    version = rec.get("schema_version", 0)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ValueError(f"{where!r} has schema version {version!r}, newer than this "
                         f"memguard's {SCHEMA_VERSION}")


def _record(raw: bytes) -> tuple[dict | None, str | None]:
    """(the record, None), or (what could be parsed, why it is unreadable)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text ({exc.reason} at byte {exc.start})"
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"not JSON ({exc.msg}{', cut short' if exc.pos >= len(line.rstrip()) else ''})"
    if not isinstance(rec, dict):
        return None, f"a JSON {type(rec).__name__}, not a record"
    kind = rec.get("type")
    if kind not in ("meta", "sample", "event"):
        return rec, f"unknown record type {kind!r}"
    if kind == "meta":
        return rec, None
    if finite(rec.get("t")) is None:
        return rec, f"time 't' is {rec.get('t')!r}, not a finite number"
    if kind == "sample":
        return rec, _sample_fault(rec)
    return rec, None if isinstance(rec.get("event"), str) else "an event without a name"


def _sample_fault(rec: dict) -> str | None:
    for name in FIELD_NAMES:
        v = rec.get(name)
        if name in ("level", "raw_level"):
            if v is not None and v not in Level.__members__ and v not in range(len(Level)):
                return f"{name} is {v!r}, not a pressure level"
        elif name == "reasons":
            if v is not None and not (isinstance(v, list) and all(isinstance(r, str) for r in v)):
                return f"reasons is {v!r}, not a list of names"
        elif name == "budget_source":
            if v is not None and not isinstance(v, str):
                return f"budget_source is {v!r}, not a name"
        elif v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            return f"{name} is {v!r}, not a number"
    return None


