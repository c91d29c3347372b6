"""Memory telemetry: what the process and the machine hold, sampled by a C
thread off the GIL, judged as a pressure level, and written to files.

The data path: :mod:`~memguard.telemetry.samples` (one reading),
:mod:`~memguard.telemetry.sampler` (the thread and its callbacks),
:mod:`~memguard.telemetry.exporters` (JSONL and CSV files, TensorBoard in
:mod:`~memguard.telemetry.tensorboard`), :mod:`~memguard.telemetry.events`
(the names of what the guard records), :mod:`~memguard.telemetry.budget`
(budgets as people write them), :mod:`~memguard.telemetry.workers` (the
process's DataLoader workers, apart from its own footprint),
:mod:`~memguard.telemetry.census` (the live tensors and objects, and what
grows between two censuses).
"""
from memguard.telemetry.budget import parse_budget
from memguard.telemetry.events import Event
from memguard.telemetry.exporters import (
    CsvExporter,
    ExportStoppedWarning,
    JsonlExporter,
    SkippedLinesWarning,
    open_exporter,
    read_jsonl,
)
from memguard.telemetry.sampler import Sampler
from memguard.telemetry.samples import (
    FIELD_NAMES,
    SCHEMA_NAME,
    SCHEMA_VERSION,
    Level,
    PressureEvent,
    Sample,
    sample,
)
from memguard.telemetry.workers import workers_metrics

__all__ = [
    "FIELD_NAMES",
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "CsvExporter",
    "Event",
    "ExportStoppedWarning",
    "JsonlExporter",
    "Level",
    "PressureEvent",
    "Sample",
    "Sampler",
    "SkippedLinesWarning",
    "open_exporter",
    "parse_budget",
    "read_jsonl",
    "sample",
    "workers_metrics",
]
