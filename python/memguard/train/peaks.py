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
import weakref
from collections.abc import Callable, Mapping
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
        self._finalizers: list[weakref.finalize] = []

    def _open(self) -> None:
        if self._pid == os.getpid():
            return
        self.close()
        self._pid = os.getpid()
        self._status = self._closed_with_self(_open_or_none("/proc/self/status", os.O_RDONLY))

    def _closed_with_self(self, fd: int | None) -> int | None:
        """``fd``, closed by ``os.close`` itself when this reader is
        collected: no finalizer of memguard's runs then (an exception
        raised in one, a Ctrl-C's included, would be lost)."""
        if fd is not None:
            self._finalizers.append(weakref.finalize(self, os.close, fd))
        return fd

    def close(self) -> None:
        """Close the files (they reopen on the next use)."""
        for closing in self._finalizers:
            try:
                closing()
            except OSError:
                pass
        self._finalizers.clear()
        self._clear = self._status = None
        self._pid = -1

    def reset_peak(self) -> bool:
        """Set the high-water mark to the current RSS; whether it could be.
        (Only the pytest plugin resets it: a guard reads the mark.)"""
        self._open()
        if self._clear is None:     # opened on first use
            self._clear = self._closed_with_self(_open_or_none("/proc/self/clear_refs",
                                                               os.O_WRONLY))
        if self._clear is None:
            return False
        try:
            os.pwrite(self._clear, b"5", 0)   # 5: peak RSS := current RSS
        except OSError:
            return False
        return True

    def read(self) -> tuple[int | None, int | None]:
        """(RSS, high-water mark) in bytes, ``None`` where unreadable."""
        text = self._status_text()
        return _kib_field(text, b"VmRSS:"), _kib_field(text, b"VmHWM:")

    def footprint(self) -> int | None:
        """Resident plus swapped-out bytes now (``None`` where unreadable)."""
        text = self._status_text()
        rss = _kib_field(text, b"VmRSS:")
        return None if rss is None else rss + (_kib_field(text, b"VmSwap:") or 0)

    def _status_text(self) -> bytes:
        """``/proc/self/status`` now (empty where unreadable)."""
        self._open()
        if self._status is None:
            return b""
        try:
            return os.pread(self._status, 16384, 0)
        except OSError:
            return b""


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

    def footprint(self) -> int | None:
        """The footprint now (``None`` where unreadable)."""
        return self.read()[0]

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

    A CUDA device's counters are read once per reading (one
    ``memory_stats()``, which ``torch.cuda.memory_allocated`` and
    ``max_memory_allocated`` each rebuild whole), and not at all where a
    reading just taken is handed over: the governor's push at :meth:`start`,
    the update's room at :meth:`now`, the reading after the update at
    :meth:`stop`.

    Args:
        arena_key: the arena counter read as the peak (the finder reads
            ``requested_bytes.peak``, the guard the blocks it holds).
        cuda_key: the CUDA counter read, current and peak:
            ``allocated_bytes`` (the guard's) or ``reserved_bytes`` (the
            finder's: the allocator's segments, which stay reserved until
            its cache is emptied, so that after an empty cache what is
            reserved at the end of a step is its peak even where the step
            did not raise the mark).
        cuda_stats: reads a CUDA device's counters by ordinal, as
            :func:`memguard.memory.cuda.stats` (the default) gives them;
            tests count readings through it.
    """

    def __init__(self, arena_key: str = "allocated_bytes.peak",
                 cuda_stats: Callable[[int], Mapping[str, int]] | None = None,
                 cuda_key: str = "allocated_bytes") -> None:
        self.source = "none"
        self._arena_key = arena_key
        self._cuda_key = cuda_key
        self._rss = process_peak()
        self._cuda_stats = cuda_stats
        self._device: Any = None
        self._index = 0
        self._memguard_cuda = False
        self._mark: int | None = None   # the process's high-water mark at start()
        self._floor = 0
        self._settled: tuple[int, int] | None = None   # the step's last reading (now(settled=))
        #: whether :meth:`stop`'s figure is the step's own peak, not a bound
        self.exact = True

    def start(self, batch: Any, pushed: Mapping[str, int] | None = None) -> int:
        """Mark the start of a step over ``batch``; returns what the source
        holds now (the floor the step starts from; 0 where unknown). The
        process's own peak counters (``VmHWM``, ``ru_maxrss``,
        ``torch.cuda.max_memory_allocated``) are read, never reset: the
        user's readings of them stay true.

        Args:
            batch: the step's batch: its first tensor's device decides.
            pushed: the CUDA counters the governor pushed at this boundary
                (:meth:`memguard.memory.cuda.Governor.counters`), read
                instead of the device's where they are of its device.
        """
        from memguard.train.batch import leaves  # torch: loaded once a step runs

        self._settled = None
        first = next((x for x in leaves(batch) if hasattr(x, "is_cuda")), None)
        if first is not None and first.is_cuda:   # the first tensor's device decides
            return self.start_cuda(first.device, pushed)
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

    def footprint(self) -> int | None:
        """The process's own footprint now (resident plus swapped-out, or
        macOS's footprint; ``None`` where unreadable): one read of a file
        the reader keeps open, cheap at every boundary."""
        return self._rss.footprint()

    def start_cuda(self, device: Any, pushed: Mapping[str, int] | None = None) -> int:
        """:meth:`start` for a step on the CUDA ``device`` (a ``torch.device``)."""
        self._settled = None
        self.source = "cuda"
        self._device = device
        self._index = device.index if device.index is not None else \
            sys.modules["torch"].cuda.current_device()
        self._memguard_cuda = _C.cuda_backend() is not None
        if self._memguard_cuda:   # torch's own counters do not work then
            _C.cuda_reset_peaks(self._index)
            return int(_C.cuda_stats(self._index)[f"{self._cuda_key}.current"])
        if pushed is not None and pushed.get("device") == self._index:
            kind = self._cuda_key.removesuffix("_bytes")
            self._floor, self._mark = int(pushed[f"{kind}_bytes"]), \
                int(pushed[f"{kind}_peak_bytes"])
        else:
            self._floor, self._mark = self._read_cuda()
        return self._floor

    def measures(self, device: Any) -> bool:
        """Whether this step's readings count the memory of tensors on
        ``device`` (a CPU batch may feed a model on a GPU, or on another
        GPU)."""
        if device.type != "cuda":
            return self.source == "arena"
        index = device.index if device.index is not None else \
            sys.modules["torch"].cuda.current_device()
        return self.source == "cuda" and index == self._index

    def _read_cuda(self, stats: Mapping[str, int] | None = None) -> tuple[int, int]:
        """(current, peak) of the counter read (allocated bytes unless told)
        on the step's CUDA device, from ``stats`` where given, else from one
        reading."""
        if stats is None:
            if self._cuda_stats is not None:
                stats = self._cuda_stats(self._index)
            else:
                from memguard.memory import cuda

                stats = cuda.stats(self._index)
        key = self._cuda_key
        return int(stats[f"{key}.current"]), int(stats[f"{key}.peak"])

    def now(self, stats: Mapping[str, int] | None = None,
            settled: bool = False) -> tuple[int, int] | None:
        """(what the source holds now, its peak) where the source counts
        tensors (the arena, a CUDA device), else ``None``. Nothing is reset:
        a part of the step measured between two readings is known exactly
        when it raised the peak. (With PyTorch's CUDA allocator the peak is
        the process's, since torch's counters are not reset: a rise is
        still the part's own.)

        Args:
            stats: the step's CUDA device's counters just read
                (:func:`memguard.memory.cuda.stats`), used instead of
                reading them again.
            settled: nothing of the step allocates after this reading:
                :meth:`stop` takes it instead of reading again.
        """
        if self.source == "arena":
            st = _C.arena_stats()
            out = int(st[self._arena_key.replace(".peak", ".current")]), int(st[self._arena_key])
        elif self.source == "cuda":
            out = self._read_cuda(stats)
        else:
            return None
        if settled:
            self._settled = out
        return out

    def stop(self) -> int:
        """The peak since :meth:`start` (0 where unknown). Where the
        source is the process's own high-water mark (``rss``; ``cuda``
        under PyTorch's allocator), which memguard does not reset, the peak
        is exact when the step raised the mark (:attr:`exact`); otherwise
        the most the step was seen to hold, at its start or end, a lower
        bound that the planner does not learn from."""
        self.exact = True
        settled, self._settled = self._settled, None
        if self.source in ("cuda", "arena"):
            now, peak = settled or self.now() or (0, 0)
            if self.source == "arena" or self._memguard_cuda:   # reset at start()
                return peak
            return self._beyond_mark(now, peak)
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
