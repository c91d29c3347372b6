"""Apple's MPS device: govern PyTorch's MPS allocator as :mod:`memguard.cuda`'s
governor governs the CUDA one.

On Apple silicon the GPU shares the machine's memory, and PyTorch's MPS
allocator caps what it will hold at a high watermark, 1.7 times Metal's
``recommendedMaxWorkingSetSize`` unless ``PYTORCH_MPS_HIGH_WATERMARK_RATIO``
says otherwise. :class:`MpsGovernor` reads ``torch.mps``'s counters at step
boundaries: ``current_allocated_memory()`` (tensors),
``driver_allocated_memory()`` (everything Metal holds for the process, the
allocator's cache included) and ``recommended_max_memory()``. They are judged
by the same C pressure model as the CUDA counters: the driver's bytes (which
PyTorch's limit bounds) against the budget. A budget is applied through
``torch.mps.set_per_process_memory_fraction`` (a share of the recommended
size, at most 2), and where the driver's bytes pass the budget's high
threshold (``budget_high``, 90 %) with a cache to give back,
``torch.mps.empty_cache()`` gives it back before they are judged.

The counters are not in the telemetry samples (their ``cuda_*`` fields are a
CUDA device's); the governor keeps its last reading in ``last``. An
out-of-memory error on MPS prints the same three figures, and
:func:`reading_from_oom` reads them back, so recorded errors replay.
"""
from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from memguard._common import is_auto
from memguard._options import option
from memguard.telemetry.budget import parse_budget
from memguard.telemetry.samples import Level

#: torch.mps.set_per_process_memory_fraction accepts 0 to 2
MAX_FRACTION = 2.0
#: PyTorch's default high watermark, as a share of Metal's recommended size
DEFAULT_WATERMARK = 1.7
#: the budget "auto" takes of Metal's recommended size
AUTO_SHARE = 0.9


@dataclass(frozen=True)
class MpsReading:
    """What ``torch.mps`` says at one moment, in bytes."""

    allocated_bytes: int      # current_allocated_memory(): tensors
    driver_bytes: int         # driver_allocated_memory(): all Metal holds, cache included
    recommended_bytes: int    # recommended_max_memory(): Metal's working-set size

    @property
    def cached_bytes(self) -> int:
        """What the driver holds beyond the tensors (the allocator's cache and
        other Metal allocations)."""
        return max(0, self.driver_bytes - self.allocated_bytes)


def read_torch() -> MpsReading:
    """The live reading of ``torch.mps``.

    Raises:
        RuntimeError: torch is not imported or has no MPS device.
    """
    mps = _mps()
    return MpsReading(int(mps.current_allocated_memory()), int(mps.driver_allocated_memory()),
                      int(mps.recommended_max_memory()))


_UNITS = {"bytes": 1, "KB": 1 << 10, "KiB": 1 << 10, "MB": 1 << 20, "MiB": 1 << 20,
          "GB": 1 << 30, "GiB": 1 << 30}
_OOM = re.compile(r"MPS allocated: ([\d.]+) (\w+), other allocations: ([\d.]+) (\w+), "
                  r"max allowed: ([\d.]+) (\w+)\)")


def reading_from_oom(message: str, watermark_ratio: float = DEFAULT_WATERMARK) -> MpsReading:
    """The reading an MPS out-of-memory error printed: its "MPS allocated",
    "other allocations" and "max allowed" figures (the allocator's units are
    binary whatever it calls them), the recommended size being the maximum
    allowed over the high-watermark ratio.

    Raises:
        ValueError: the message holds no such figures.
    """
    m = _OOM.search(message)
    if m is None:
        raise ValueError(f"no MPS allocator figures in {message[:120]!r}")
    alloc, other, allowed = (int(float(m[i]) * _UNITS[m[i + 1]]) for i in (1, 3, 5))
    return MpsReading(alloc, alloc + other, int(allowed / watermark_ratio))


class MpsGovernor:
    """Watches the MPS device and steers PyTorch's allocator there.

    Args:
        budget: ``None`` (judged against Metal's recommended size, nothing
            applied), a size (``"12GiB"``), a share of the recommended size
            (``"75%"``), bytes, or ``"auto"`` (90 % of the recommended size).
        read: where readings come from (default :func:`read_torch`); tests
            replay recorded ones.
        set_fraction, empty_cache: ``torch.mps``'s by default.

    Raises:
        ValueError: a bad budget.
    """

    def __init__(self, budget: str | int | None = None, *,
                 read: Callable[[], MpsReading] | None = None,
                 set_fraction: Callable[[float], Any] | None = None,
                 empty_cache: Callable[[], Any] | None = None) -> None:
        if budget is not None and not is_auto(budget):
            parse_budget(budget, total=1 << 40)   # validate now: the size comes later
        self._budget_arg = budget
        self._read = read or read_torch
        self._set_fraction = set_fraction or (lambda f: _mps().set_per_process_memory_fraction(f))
        self._empty_cache = empty_cache or (lambda: _mps().empty_cache())
        self._model: Any = None
        self.budget_bytes = 0
        self.fraction: float | None = None   # applied to torch, when a budget was
        self.level = Level.OK
        self.last: MpsReading | None = None
        self.released_bytes = 0              # given back by empty_cache, in all
        self._peak = 0

    def install(self) -> MpsGovernor:
        """Read the recommended size and apply the budget. Idempotent.

        Raises:
            ValueError: a budget above twice the recommended size, which
                ``set_per_process_memory_fraction`` cannot express.
        """
        if self._model is not None:
            return self
        r = self._read()
        recommended = r.recommended_bytes
        if self._budget_arg is None:
            self.budget_bytes = recommended
        else:
            self.budget_bytes = (int(AUTO_SHARE * recommended) if is_auto(self._budget_arg)
                                 else parse_budget(self._budget_arg, total=recommended))
            fraction = self.budget_bytes / recommended
            if fraction > MAX_FRACTION:
                raise ValueError(
                    f"MPS budget {self._budget_arg!r} is {fraction:.2f} times Metal's "
                    f"recommended size ({recommended} bytes); torch.mps takes at most "
                    f"{MAX_FRACTION:g} times it")
            self._set_fraction(fraction)
            self.fraction = fraction
        from memguard.telemetry.sampler import Sampler  # never started: a pressure model

        self._model = Sampler(interval_ms=1000)
        return self

    def push(self) -> Level:
        """Read the counters at a step boundary, give the cache back where
        the driver's bytes pass the budget's high threshold, and judge what
        the driver then holds. Returns the level."""
        self.install()
        r = self._read()
        if r.cached_bytes and r.driver_bytes > option("budget_high") * self.budget_bytes:
            self._empty_cache()
            after = self._read()
            self.released_bytes += max(0, r.driver_bytes - after.driver_bytes)
            r = after
        self._peak = max(self._peak, r.driver_bytes)
        self.level = self._model.push_cuda(self.counters(r))
        self.last = r
        return self.level

    def counters(self, r: MpsReading) -> dict[str, int]:
        """A reading in the counters the pressure model judges. PyTorch's
        MPS limit bounds everything Metal holds for the process, so the
        driver's bytes stand as the allocated ones; the tensors are the
        active ones."""
        return {"device": 0, "allocated_bytes": r.driver_bytes,
                "reserved_bytes": r.driver_bytes, "active_bytes": r.allocated_bytes,
                "allocated_peak_bytes": self._peak, "reserved_peak_bytes": self._peak,
                "alloc_retries": 0, "ooms": 0,
                "free_bytes": max(0, r.recommended_bytes - r.driver_bytes),
                "total_bytes": r.recommended_bytes, "budget_bytes": self.budget_bytes}

    def uninstall(self) -> None:
        """Lift the budget: torch's high watermark goes back to
        ``PYTORCH_MPS_HIGH_WATERMARK_RATIO``, or 1.7 where it is unset."""
        if self.fraction is not None:
            self._set_fraction(default_watermark())
            self.fraction = None
        self._model = None


def default_watermark() -> float:
    """The high-watermark ratio PyTorch's MPS allocator starts with."""
    try:
        return float(os.environ.get("PYTORCH_MPS_HIGH_WATERMARK_RATIO", DEFAULT_WATERMARK))
    except ValueError:
        return DEFAULT_WATERMARK


def govern(budget: str | int | None = None) -> MpsGovernor:
    """Put PyTorch's MPS allocator under a budget and watch it: a started
    :class:`MpsGovernor`.

    Raises:
        RuntimeError: torch is not imported, or there is no MPS device.
        ValueError: a bad budget.
    """
    _mps()
    return MpsGovernor(budget).install()


def replay(readings: Iterable[MpsReading]) -> Callable[[], MpsReading]:
    """A ``read`` for :class:`MpsGovernor` that returns ``readings`` in
    turn, the last one for ever after."""
    it, last = iter(readings), None

    def read() -> MpsReading:
        nonlocal last
        last = next(it, last)
        if last is None:
            raise RuntimeError("no recorded MPS readings")
        return last
    return read


def _mps() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        raise RuntimeError("torch is not imported: there is no MPS allocator to govern")
    backend = getattr(getattr(torch, "backends", None), "mps", None)
    if backend is None or not backend.is_available():
        raise RuntimeError("no MPS device here (torch.backends.mps.is_available() is False): "
                           "there is no MPS allocator to govern")
    return torch.mps
