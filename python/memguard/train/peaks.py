"""A step's peak memory, from the best source there is: memguard's arena when
it serves tensors, the CUDA allocator for CUDA batches, else the process's
peak RSS (``VmHWM`` of ``/proc/self/status``, reset through
``/proc/self/clear_refs``).

:class:`RssPeak` is the one reader of the RSS high-water mark (the pytest
plugin uses it too); :class:`PeakMeter` picks the source per step. Importing
this module does not import torch.
"""
from __future__ import annotations

import os
import sys
from typing import Any

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
        self._clear = _open_or_none("/proc/self/clear_refs", os.O_WRONLY)
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
        """Set the high-water mark to the current RSS; whether it could be."""
        self._open()
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
    "rss", or "none" before the first step).

    Args:
        arena_key: the arena counter read as the peak (the finder reads
            ``requested_bytes.peak``, the guard the blocks it holds).
    """

    def __init__(self, arena_key: str = "allocated_bytes.peak") -> None:
        self.source = "none"
        self._arena_key = arena_key
        self._rss = RssPeak()
        self._device: Any = None
        self._index = 0
        self._memguard_cuda = False

    def start(self, batch: Any) -> int:
        """Reset the peak for a step over ``batch``; returns what the source
        holds now (the floor the step starts from; 0 where unknown)."""
        from memguard.train.batch import leaves  # torch: loaded once a step runs

        first = next((x for x in leaves(batch) if hasattr(x, "is_cuda")), None)
        if first is not None and first.is_cuda:   # the first tensor's device decides
            return self._start_cuda(first.device)
        if arena.installed():
            self.source = "arena"
            _C.arena_reset_peaks()
            return int(_C.arena_stats()["allocated_bytes.current"])
        self.source = "rss"
        if not self._rss.reset_peak():
            return 0
        return self._rss.read()[0] or 0

    def _start_cuda(self, device: Any) -> int:
        torch = sys.modules["torch"]
        self.source = "cuda"
        self._device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._memguard_cuda = _C.cuda_backend() is not None
        if self._memguard_cuda:   # torch's own counters do not work then
            _C.cuda_reset_peaks(self._index)
            return int(_C.cuda_stats(self._index)["allocated_bytes.current"])
        torch.cuda.reset_peak_memory_stats(device)
        return int(torch.cuda.memory_allocated(device))

    def stop(self) -> int:
        """The peak since :meth:`start` (0 where unknown)."""
        if self.source == "cuda":
            if self._memguard_cuda:
                return int(_C.cuda_stats(self._index)["allocated_bytes.peak"])
            return int(sys.modules["torch"].cuda.max_memory_allocated(self._device))
        if self.source == "arena":
            return int(_C.arena_stats()[self._arena_key])
        if self.source == "rss":
            return self._rss.read()[1] or 0
        return 0
