"""What one telemetry reading holds: :class:`Sample`, its pressure
:class:`Level`, and :func:`sample` for one synchronous reading."""
from __future__ import annotations

import dataclasses
import enum
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memguard import _C

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
    # a CUDA device's allocator, pushed at step boundaries (memguard.memory.cuda)
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
    # its children's own (DataLoader workers; other ranks of the job left
    # out); where the budget came from
    footprint_bytes: int | None = None
    children: int | None = None
    children_bytes: int | None = None
    budget_source: str | None = None      # "user", "cgroup" or "host"
    user_budget_bytes: int | None = None  # the budget asked for, when one was
    # the operating system's own signals (macOS): memory its compressor
    # occupies, pages compressed since boot and their rate, and the kernel's
    # level (1 normal, 2 warn, 4 critical)
    compressed_bytes: int | None = None
    compressions: int | None = None
    compressions_per_s: float | None = None
    os_pressure_level: int | None = None

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
