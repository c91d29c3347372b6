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
from collections.abc import Mapping
from typing import IO, Any

from memguard._common import VERSION
from memguard.telemetry.samples import FIELD_NAMES, SCHEMA_NAME, SCHEMA_VERSION, Sample


class Exporter:
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
            "memguard": VERSION,
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
        rec: dict[str, Any] = {"type": "event", "event": str(name), "t": time.time()}
        rec.update(data)
        self._write(rec)


class CsvExporter(Exporter):
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


def open_exporter(path: str | os.PathLike) -> Exporter:
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


