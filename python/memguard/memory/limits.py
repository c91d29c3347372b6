"""Real memory limits: a memory cgroup (v1 or v2) around a process, and a
swap file. The pressure benchmark, the tests that put a run under a limit,
and ``memguard demo`` use them to reproduce what users hit: a process in a
cgroup whose limit is below its need swaps, or is killed by the kernel when
there is no swap.

::

    with limits.SwapFile(4 << 30), limits.MemoryLimit(2200 << 20) as cg:
        proc = subprocess.Popen(cmd)
        cg.add(proc.pid)
        ...
        cg.set(1600 << 20)            # lowered under the running process

Both need root (or a delegated cgroup v2 subtree for the limit). Where they
cannot be made, the constructor or ``__enter__`` raises
:class:`LimitUnavailable` saying why, and :func:`unavailable` says it without
trying; what was made is always removed on exit, on failure too.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import tempfile
import time

CGROUP_ROOT = "/sys/fs/cgroup"
_counter = itertools.count()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class LimitUnavailable(RuntimeError):
    """A memory limit or swap file cannot be made here; the message says why."""


def _hierarchy() -> tuple[int, str]:
    """(version, directory new cgroups are made in) of a writable memory
    controller: v1's own mount, or a v2 hierarchy whose root delegates the
    memory controller.

    Raises:
        LimitUnavailable: there is none.
    """
    v1 = os.path.join(CGROUP_ROOT, "memory")
    if os.path.exists(os.path.join(v1, "memory.limit_in_bytes")):
        if not os.access(v1, os.W_OK):
            raise LimitUnavailable(f"cannot create memory cgroups: {v1} is not writable "
                                   "(run as root)")
        return 1, v1
    for root in (CGROUP_ROOT, os.path.join(CGROUP_ROOT, "unified")):
        try:
            with open(os.path.join(root, "cgroup.controllers")) as f:
                controllers = f.read().split()
        except OSError:
            continue
        if "memory" not in controllers:
            continue
        if not os.access(root, os.W_OK):
            raise LimitUnavailable(f"cannot create memory cgroups: {root} is not writable "
                                   "(run as root)")
        return 2, root
    raise LimitUnavailable("no cgroup memory controller is mounted here "
                           f"({CGROUP_ROOT}/memory for v1, or memory in cgroup.controllers "
                           "for v2)")


class MemoryLimit:
    """A memory cgroup with a limit, made for one run and removed after.

    Args:
        limit_bytes: the limit (``memory.limit_in_bytes`` on v1,
            ``memory.max`` on v2).
        swap: whether the processes in it may swap (v1:
            ``memory.swappiness``; v2: ``memory.swap.max``).

    Raises:
        LimitUnavailable: no writable memory controller here.
        ValueError: a limit that is not a positive number of bytes.
    """

    def __init__(self, limit_bytes: int, *, swap: bool = True) -> None:
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be a positive number of bytes, not "
                             f"{limit_bytes!r}")
        self.version, parent = _hierarchy()
        self.path = os.path.join(parent, f"memguard-{os.getpid()}-{next(_counter)}")
        self._parent = parent
        try:
            os.mkdir(self.path)
        except OSError as exc:
            raise LimitUnavailable(f"cannot create the cgroup {self.path}: {exc}") from exc
        try:
            if self.version == 2:
                self._enable_memory(parent)
                self._write("memory.swap.max", "max" if swap else "0")
            else:
                self._write("memory.swappiness", "60" if swap else "0")
            self.set(limit_bytes)
        except BaseException:
            self.close()
            raise

    def _enable_memory(self, parent: str) -> None:
        with contextlib.suppress(OSError):
            _write(os.path.join(parent, "cgroup.subtree_control"), "+memory")
        if not os.path.exists(os.path.join(self.path, "memory.max")):
            raise LimitUnavailable(f"the memory controller is not delegated to {self.path}")

    def _write(self, name: str, value: str) -> None:
        _write(os.path.join(self.path, name), value)

    def _read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read().strip()

    def set(self, limit_bytes: int) -> None:
        """Change the limit. Lowered below what the processes in it use, the
        kernel reclaims at once: it swaps them out, or, without swap, fails
        with ``OSError`` (v1, EBUSY) or kills one (v2)."""
        self.limit_bytes = int(limit_bytes)
        self._write("memory.max" if self.version == 2 else "memory.limit_in_bytes",
                    str(self.limit_bytes))

    def add(self, pid: int) -> None:
        """Move process ``pid`` (and the children it forks later) in."""
        self._write("cgroup.procs", str(pid))

    @property
    def usage_bytes(self) -> int:
        """What the processes in it use now (RAM; swap not included)."""
        return int(self._read("memory.current" if self.version == 2
                              else "memory.usage_in_bytes"))

    def pids(self) -> list[int]:
        """The processes in it now."""
        try:
            return [int(p) for p in self._read("cgroup.procs").split()]
        except OSError:
            return []

    def close(self, timeout_s: float = 10.0) -> None:
        """Move what is left in it to the parent and remove it. Idempotent."""
        if not os.path.isdir(self.path):
            return
        deadline = time.monotonic() + timeout_s
        while True:
            for pid in self.pids():
                with contextlib.suppress(OSError):   # it exited meanwhile
                    _write(os.path.join(self._parent, "cgroup.procs"), str(pid))
            try:
                os.rmdir(self.path)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)   # a process that is exiting still counts

    def __enter__(self) -> MemoryLimit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SwapFile:
    """A swap file, switched on for a run and off and deleted after.

    Args:
        size_bytes: its size.
        directory: where to make it (=a temporary directory on the file
            system of the system's temporary directory; it must support
            swap files: ext4 and xfs do, tmpfs and overlayfs do not).

    ``__enter__`` raises :class:`LimitUnavailable` when it cannot be made or
    switched on (not root, no ``mkswap``/``swapon``, a file system without
    swap files).
    """

    def __init__(self, size_bytes: int, directory: str | None = None) -> None:
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or \
                size_bytes < (40 << 10):
            raise ValueError(f"size_bytes must be at least 40 KiB, not {size_bytes!r}")
        self.size_bytes = size_bytes
        self.directory = directory
        self.path: str | None = None
        self._on = False

    def __enter__(self) -> SwapFile:
        why = unavailable(swap=True, cgroup=False)
        if why:
            raise LimitUnavailable(why)
        fd, self.path = tempfile.mkstemp(prefix="memguard-swap-", dir=self.directory)
        try:
            os.fchmod(fd, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.size_bytes)
            finally:
                os.close(fd)
            for cmd in (["mkswap", self.path], ["swapon", self.path]):
                out = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if out.returncode != 0:
                    raise LimitUnavailable(f"{' '.join(cmd)} failed: "
                                           f"{(out.stderr or out.stdout).strip()}")
                self._on = cmd[0] == "swapon"
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Switch it off (its pages come back into memory) and delete it.
        Idempotent."""
        if self._on and self.path:
            subprocess.run(["swapoff", self.path], capture_output=True, check=False)
            self._on = False
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)
        self.path = None

    def __exit__(self, *exc: object) -> None:
        self.close()


def unavailable(swap: bool = True, cgroup: bool = True) -> str | None:
    """Why a memory cgroup (``cgroup``) or a swap file (``swap``) cannot be
    made here, or ``None`` when both can be tried."""
    if cgroup:
        try:
            _hierarchy()
        except LimitUnavailable as exc:
            return str(exc)
    if swap:
        if os.geteuid() != 0:
            return "switching a swap file on needs root"
        missing = [c for c in ("mkswap", "swapon", "swapoff") if shutil.which(c) is None]
        if missing:
            return f"{', '.join(missing)} not found (util-linux)"
    return None
