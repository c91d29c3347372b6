"""gc hooks: every Python collection timed, and memory released when
pressure rises.

:class:`GcHooks` times each collection through ``gc.callbacks``. Its
:meth:`~GcHooks.relieve` does one full ``gc.collect()`` (skipped while the
script has automatic collection off and collects on its own schedule,
unless forced), the system allocator's trim (``malloc_trim(0)`` under
glibc, a purge of every jemalloc arena when jemalloc serves ``malloc``), a
release of memguard's arena cache down to what the caller says the next
steps reuse, and ``torch.cuda.empty_cache()`` where CUDA is in use. It is
rate-limited by its own cost: a relief waits until its last one's duration
is at most ``max_share`` of the time since that one began (5 %: a 200 ms
relief at most every 4 s), and at least ``min_interval_s``. The guard calls
it at every step boundary under HIGH or CRITICAL, on a rise to HIGH, and
after an evaluation loop; before redoing a step that ran out of memory it
calls the lighter :meth:`~GcHooks.relieve_oom`.
"""
from __future__ import annotations

import gc
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from memguard import _C
from memguard.telemetry.events import Event


@dataclass
class GcStats:
    """Python collections seen and relief runs done."""
    collections: list[int] = field(default_factory=lambda: [0, 0, 0])  # per generation
    gc_seconds: float = 0.0           # time inside collections, all generations
    max_pause_s: float = 0.0          # longest single collection
    collected: int = 0
    uncollectable: int = 0
    reliefs: int = 0                  # relieve() runs that did something
    relief_seconds: float = 0.0
    released_bytes: int = 0           # given back by the arena's cache release

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["collections"] = list(self.collections)
        return d


class GcHooks:
    """Times Python collections; releases memory under pressure.

    Args:
        min_interval_s: the least time between two :meth:`relieve` runs
            that are not forced (=0: the cost alone limits them).
        max_share: the most of the wall time reliefs that are not forced
            may take (=0.05).
        on_event: called with ``(name, data)`` after each relief
            (telemetry).
    """

    def __init__(self, min_interval_s: float = 0.0, max_share: float = 0.05,
                 on_event: Callable[[str, dict], Any] | None = None) -> None:
        if not min_interval_s >= 0:
            raise ValueError(f"min_interval_s must be >= 0, not {min_interval_s!r}")
        if not 0 < max_share <= 1:
            raise ValueError(f"max_share must be in (0, 1], not {max_share!r}")
        self.min_interval_s = float(min_interval_s)
        self.max_share = float(max_share)
        self.on_event = on_event
        self.stats = GcStats()
        self._t0: float | None = None   # start of the collection under way (GIL-serialised)
        self._lock = threading.Lock()   # one relief at a time; guards _last, _last_cost
        self._last = -float("inf")      # when the last relief began (monotonic s)
        self._last_cost = 0.0           # how long it took
        self._clock: Callable[[], float] = time.monotonic  # _last and due() read it (tests set it)
        self._installed = False

    def install(self) -> GcHooks:
        """Start timing collections. Idempotent."""
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def uninstall(self) -> None:
        """Stop timing collections. Idempotent."""
        if self._installed:
            try:
                gc.callbacks.remove(self._callback)
            except ValueError:
                pass
            self._installed = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        if self._t0 is None:
            return
        dt = time.perf_counter() - self._t0
        self._t0 = None
        s = self.stats
        gen = info.get("generation", 2)
        s.collections[gen if 0 <= gen <= 2 else 2] += 1
        s.gc_seconds += dt
        s.max_pause_s = max(s.max_pause_s, dt)
        s.collected += info.get("collected", 0)
        s.uncollectable += info.get("uncollectable", 0)

    def relieve_oom(self) -> dict:
        """Before a step is redone after an out-of-memory error: collect the
        young generations (the failed attempt's cycles are young; a full
        collection costs 100 ms and more with torch loaded), whatever the
        gc setting, and empty CUDA's cache. No trim: memguard's arena
        releases cached blocks itself, as much as an allocation needs, and
        what the failed attempt freed is what the retry reuses without
        faulting it in again."""
        t0 = time.perf_counter()
        done: dict[str, Any] = {"reason": "oom", "gc_collected": gc.collect(1)}
        _empty_cuda_cache(done)
        with self._lock:
            self._count(done, t0)
        return self._report(done)

    def due(self) -> bool:
        """Whether a relief that is not forced would run now."""
        wait = max(self.min_interval_s, self._last_cost / self.max_share)
        return self._clock() - self._last >= wait

    def relieve(self, reason: str = "pressure", *, force: bool = False,
                collect: bool | None = None, arena_keep: int = 0) -> dict | None:
        """Release what memory can be released now.

        Args:
            reason: recorded with the event ("high", "oom", "evaluate", ...).
            force: ignore the rate limit.
            collect: run ``gc.collect()``; ``None``: only while automatic
                collection is on (a script that turned it off collects on
                its own schedule).
            arena_keep: bytes of memguard's arena cache to keep (what the
                next steps reuse warm); the rest goes back to the kernel.

        Returns:
            What was done (``None`` when rate-limited).
        """
        with self._lock:
            if not force and not self.due():
                return None
            self._last = self._clock()
            t0 = time.perf_counter()
            done: dict[str, Any] = {"reason": reason}
            if collect or (collect is None and gc.isenabled()):
                done["gc_collected"] = gc.collect()
            done["system_trim"] = _C.system_trim()
            done["arena_released_bytes"] = _C.arena_trim(max(0, int(arena_keep)))
            _empty_cuda_cache(done)
            if _C.cuda_backend() is not None:   # memguard's CUDA allocator
                done["cuda_released_bytes"] = _C.cuda_trim(-1)
            self._count(done, t0)
        return self._report(done)

    def _count(self, done: dict[str, Any], t0: float) -> None:
        """Book one relief in the stats (self._lock held)."""
        done["seconds"] = time.perf_counter() - t0
        self._last_cost = done["seconds"]
        s = self.stats
        s.reliefs += 1
        s.relief_seconds += done["seconds"]
        s.released_bytes += done.get("arena_released_bytes", 0)

    def _report(self, done: dict[str, Any]) -> dict[str, Any]:
        if self.on_event is not None:
            self.on_event(Event.RELIEVE, done)
        return done


def _empty_cuda_cache(done: dict[str, Any]) -> None:
    """``torch.cuda.empty_cache()`` where CUDA is in use (never initialises it)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        done["cuda_empty_cache"] = True
