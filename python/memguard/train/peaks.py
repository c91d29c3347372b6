"""A step's peak memory, from the best source there is: memguard's arena when
it serves tensors, the CUDA allocator for CUDA batches, else the process's
own peak: on Linux its peak RSS (``VmHWM`` of ``/proc/self/status``, read
but never reset, so ``ru_maxrss``, ``VmHWM`` and ``/usr/bin/time`` stay
true: a step's peak is known when it raised the mark), on macOS its peak
footprint (``proc_pid_rusage``'s ``ri_interval_max_phys_footprint``, an
interval counter reset by ``proc_reset_footprint_interval``). With
PyTorch's CUDA allocator, ``torch.cuda``'s peak counters are read the same
way, never reset.

:func:`process_peak` gives the one reader of the process's peak for this
system (the pytest plugin uses it too); :class:`PeakMeter` picks the source
per step. Importing this module does not import torch.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Any, Union

from memguard import _C
from memguard.memory import arena


class RssPeak:
    """The process's RSS and its high-water mark. The two ``/proc/self``
    files stay open; a forked child closes the descriptors it inherited and
    opens its own (``/proc/self`` is resolved when a file is opened)."""

    def __init__(self) -> None:
        self._pid = -1
        self._clear: int | None = None
        self._status: int | None = None

    def _open(self) -> None:
        if self._pid == os.getpid():
            return
        self.close()
        self._pid = os.getpid()
        self._status = _open_or_none("/proc/self/status", os.O_RDONLY)

    def close(self) -> None:
        """Close the files (they reopen on the next use)."""
        for fd in (self._clear, self._status):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._clear = self._status = None
        self._pid = -1

    def reset_peak(self) -> bool:
        """Set the high-water mark to the current RSS; whether it could be.
        (Only the pytest plugin resets it: a guard reads the mark.)"""
        self._open()
        if self._clear is None:     # opened on first use
            self._clear = _open_or_none("/proc/self/clear_refs", os.O_WRONLY)
        if self._clear is None:
            return False
        try:
            os.pwrite(self._clear, b"5", 0)   # 5: peak RSS := current RSS
        except OSError:
            return False
        return True

    def read(self) -> tuple[int | None, int | None]:
        """(RSS, high-water mark) in bytes, ``None`` where unreadable."""
        self._open()
        if self._status is None:
            return None, None
        try:
            text = os.pread(self._status, 16384, 0)
        except OSError:
            return None, None
        return _kib_field(text, b"VmRSS:"), _kib_field(text, b"VmHWM:")

    def __del__(self) -> None:
        if self._pid == os.getpid():
            self.close()


class FootprintPeak:
    """macOS's peak footprint: what Activity Monitor shows (compressed pages
    included), its high-water mark reset per step. The reset is libproc's
    ``proc_reset_footprint_interval``, which the SDK's public headers do not
    declare: it is looked up at run time, and without it (or off macOS)
    the peak is unknown, as :class:`RssPeak`'s is without ``/proc``."""

    #: rusage_info_v4 (<sys/resource.h>): a 16-byte UUID, then 35 uint64 fields
    FLAVOR_V4, SIZE_V4 = 4, 16 + 35 * 8
    FOOTPRINT_AT, INTERVAL_MAX_AT = 16 + 7 * 8, 16 + 33 * 8   # ri_phys_footprint, its peak

    def __init__(self, libc: Any = None) -> None:
        if libc is None and sys.platform == "darwin":
            libc = ctypes.CDLL(None)
        self._usage = getattr(libc, "proc_pid_rusage", None)
        self._reset = getattr(libc, "proc_reset_footprint_interval", None)

    def reset_peak(self) -> bool:
        """Set the peak to the current footprint; whether it could be."""
        return self._reset is not None and self._reset(os.getpid()) == 0

    def read(self) -> tuple[int | None, int | None]:
        """(footprint, its peak since the reset) in bytes, ``None`` where
        unreadable."""
        if self._usage is None:
            return None, None
        buf = ctypes.create_string_buffer(self.SIZE_V4)
        if self._usage(os.getpid(), self.FLAVOR_V4, buf) != 0:
            return None, None
        now = int.from_bytes(buf.raw[self.FOOTPRINT_AT:self.FOOTPRINT_AT + 8], sys.byteorder)
        peak = int.from_bytes(buf.raw[self.INTERVAL_MAX_AT:self.INTERVAL_MAX_AT + 8],
                              sys.byteorder)
        return now, (peak if self._reset is not None else None)

    def close(self) -> None:
        """Nothing is held open."""


ProcessPeak = Union[RssPeak, FootprintPeak]


def process_peak() -> ProcessPeak:
    """The reader of this process's own peak on this system."""
    return FootprintPeak() if sys.platform == "darwin" else RssPeak()


def _open_or_none(path: str, flags: int) -> int | None:
    try:
        return os.open(path, flags)
    except OSError:
        return None


def _kib_field(text: bytes, name: bytes) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes (``None`` if absent)."""
    at = text.find(name)
    if at < 0:
        return None
    try:
        return int(text[at + len(name):text.index(b"kB", at)]) * 1024
    except ValueError:
        return None


class PeakMeter:
    """Measures one step's peak bytes: :meth:`start` before it, :meth:`stop`
    after; :attr:`source` says where the figure came from ("arena", "cuda",
    "rss", "footprint" on macOS, or "none" before the first step).

    Args:
        arena_key: the arena counter read as the peak (the finder reads
            ``requested_bytes.peak``, the guard the blocks it holds).
    """

    def __init__(self, arena_key: str = "allocated_bytes.peak") -> None:
        self.source = "none"
        self._arena_key = arena_key
        self._rss = process_peak()
        self._device: Any = None
        self._index = 0
        self._memguard_cuda = False
        self._mark: int | None = None   # the process's high-water mark at start()
        self._floor = 0
        #: whether :meth:`stop`'s figure is the step's own peak, not a bound
        self.exact = True

    def start(self, batch: Any) -> int:
        """Mark the start of a step over ``batch``; returns what the source
        holds now (the floor the step starts from; 0 where unknown). The
        process's own peak counters (``VmHWM``, ``ru_maxrss``,
        ``torch.cuda.max_memory_allocated``) are read, never reset: the
        user's readings of them stay true."""
        from memguard.train.batch import leaves  # torch: loaded once a step runs

        first = next((x for x in leaves(batch) if hasattr(x, "is_cuda")), None)
        if first is not None and first.is_cuda:   # the first tensor's device decides
            return self._start_cuda(first.device)
        if arena.installed():
            self.source = "arena"
            _C.arena_reset_peaks()               # memguard's own counters
            return int(_C.arena_stats()["allocated_bytes.current"])
        if isinstance(self._rss, FootprintPeak):
            # macOS: an interval peak of its own, which only this resets
            self.source = "footprint"
            if not self._rss.reset_peak():
                return 0
            return self._rss.read()[0] or 0
        self.source = "rss"
        now, self._mark = self._rss.read()
        self._floor = now or 0
        return self._floor

    def _start_cuda(self, device: Any) -> int:
        torch = sys.modules["torch"]
        self.source = "cuda"
        self._device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._memguard_cuda = _C.cuda_backend() is not None
        if self._memguard_cuda:   # torch's own counters do not work then
            _C.cuda_reset_peaks(self._index)
            return int(_C.cuda_stats(self._index)["allocated_bytes.current"])
        self._mark = int(torch.cuda.max_memory_allocated(device))
        self._floor = int(torch.cuda.memory_allocated(device))
        return self._floor

    def now(self) -> tuple[int, int] | None:
        """(what the source holds now, its peak) where the source counts
        tensors (the arena, a CUDA device), else ``None``. Nothing is reset:
        a part of the step measured between two readings is known exactly
        when it raised the peak. (With PyTorch's CUDA allocator the peak is
        the process's, since torch's counters are not reset: a rise is
        still the part's own.)"""
        if self.source == "arena":
            st = _C.arena_stats()
            return int(st[self._arena_key.replace(".peak", ".current")]), int(st[self._arena_key])
        if self.source != "cuda":
            return None
        if self._memguard_cuda:
            st = _C.cuda_stats(self._index)
            return int(st["allocated_bytes.current"]), int(st["allocated_bytes.peak"])
        torch = sys.modules["torch"]
        return int(torch.cuda.memory_allocated(self._device)), \
            int(torch.cuda.max_memory_allocated(self._device))

    def stop(self) -> int:
        """The peak since :meth:`start` (0 where unknown). Where the
        source is the process's own high-water mark (``rss``; ``cuda``
        under PyTorch's allocator), which memguard does not reset, the peak
        is exact when the step raised the mark (:attr:`exact`); otherwise
        the most the step was seen to hold, at its start or end, a lower
        bound that the planner does not learn from."""
        self.exact = True
        if self.source == "cuda":
            if self._memguard_cuda:
                return int(_C.cuda_stats(self._index)["allocated_bytes.peak"])
            now, mark = self.now() or (0, 0)
            return self._beyond_mark(now, mark)
        if self.source == "arena":
            return int(_C.arena_stats()[self._arena_key])
        if self.source == "rss":
            now, mark = self._rss.read()
            return self._beyond_mark(now or 0, mark)
        if self.source == "footprint":
            return self._rss.read()[1] or 0
        return 0

    def _beyond_mark(self, now: int, mark: int | None) -> int:
        """The step's peak from a high-water mark nobody reset: the mark
        when the step raised it, else a lower bound (not :attr:`exact`)."""
        if mark is not None and self._mark is not None and mark > self._mark:
            return mark
        self.exact = False
        return max(self._floor, now)
