"""memguard's budgeted caching allocator for CPU tensors, installed in-process.

:func:`install` rewrites the import slots through which ``libc10.so`` (the
library behind every torch CPU allocation, ``c10::alloc_cpu``) calls
``posix_memalign``, ``free`` and ``realloc``, so tensor storage comes from
memguard's arena: size classes cached for reuse, one reserved address range,
and a budget. An allocation that would pass the budget first releases cached
blocks, then fails the way torch always fails, with
``RuntimeError: ... can't allocate memory ...``; the process goes on and the
next allocation that fits succeeds. :func:`is_oom` recognises that error.
"""
from __future__ import annotations

import sys
import threading
from typing import Any

from memguard import _C
from memguard.budget import parse_budget

_lock = threading.Lock()  # serialises install/uninstall/set_budget from Python

#: Messages of out-of-memory errors across devices and allocators.
_OOM_MESSAGES = (
    "can't allocate memory",         # CPU: c10's DefaultCPUAllocator (memguard's budget too)
    "not enough memory",             # CPU, older torch
    "cuda out of memory",            # CUDA caching allocator
    "out of memory",                 # CUDA driver, cuBLAS and friends
    "mps backend out of memory",     # Apple MPS
    "cannot allocate memory",        # errno text
)


def install(budget: str | int | None = None, cache_limit: str | int | None = None, *,
            device: Any = "cpu", allocator: str | None = None) -> None:
    """Route tensor memory to memguard's allocator, or put PyTorch's CUDA
    allocator under a budget. Idempotent.

    Args:
        budget: the most the allocator may hold (allocated plus cached), see
            :func:`memguard.parse_budget` (on CUDA, a percentage is of the
            device's memory); ``None`` keeps the current budget (none at
            first).
        cache_limit: (CPU) the most freed memory kept cached for reuse (a
            size or a percentage, like a budget); ``None`` keeps the current
            limit (none at first: the cache is bounded by the budget).
        device: ``"cpu"`` (the arena), or ``"cuda"``/``"cuda:N"``.
        allocator: on CUDA, ``"native"`` (default: PyTorch's caching
            allocator, the budget applied with
            ``torch.cuda.set_per_process_memory_fraction``) or ``"memguard"``
            (memguard's CUDA allocator, installed before the first CUDA
            allocation of the process). On the CPU, ``None`` or
            ``"memguard"``.

    Raises:
        RuntimeError: torch is not imported, the platform has no ELF import
            slots, ``libc10.so`` does not import the functions memguard
            rewrites, or the routing did not take effect (a probe tensor
            was not served by the arena); on CUDA: no CUDA device, or CUDA
            memory already allocated when memguard's allocator was asked for.
        ValueError: a bad budget, device or allocator name.
    """
    if str(device) != "cpu":
        _install_cuda(budget, cache_limit, device, allocator)
        return
    if allocator not in (None, "memguard"):
        raise ValueError(f"allocator {allocator!r} is not one memguard installs on the CPU: "
                         f"use None or 'memguard'")
    if "torch" not in sys.modules:
        raise RuntimeError("import torch before memguard.install(): there is no torch "
                           "allocator to route yet")
    import torch

    with _lock:
        if budget is not None:
            _C.arena_set_budget(parse_budget(budget))
        if cache_limit is not None:
            _C.arena_set_cache_limit(parse_budget(cache_limit))
        if _C.installed() or _C.preloaded():
            return  # under `memguard run` every allocation is routed already
        _C.install("libc10.so")
        before = _C.arena_stats()["num_allocs"]
        probe = torch.empty(4096, dtype=torch.uint8)
        took = _C.arena_stats()["num_allocs"] > before
        del probe
        if not took:
            _C.uninstall()
            raise RuntimeError("memguard's allocator was installed but a probe tensor did not "
                               "reach it: this torch build allocates CPU memory elsewhere")


def _install_cuda(budget: str | int | None, cache_limit: str | int | None, device: Any,
                  allocator: str | None) -> None:
    from memguard import cuda

    dev = cuda.parse_device(device)
    if allocator not in (None, "native", "memguard"):
        raise ValueError(f"allocator {allocator!r} is not a CUDA allocator memguard knows: "
                         f"use 'native' or 'memguard'")
    if cache_limit is not None:
        raise ValueError(f"cache_limit {cache_limit!r} applies to the CPU arena only")
    if budget is not None:
        parse_budget(budget, total=1 << 40)   # a bad budget is a ValueError before anything
    if "torch" not in sys.modules:
        raise RuntimeError("import torch before memguard.install(device='cuda')")
    if allocator == "memguard":
        if dev not in (None, 0):
            raise ValueError(f"device {device!r}: memguard's CUDA allocator serves every device "
                             f"of the process; install it with device='cuda'")
        cuda.install_allocator(budget)
        return
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device here (torch.cuda.is_available() is False): "
                           "there is no CUDA allocator to budget")
    if budget is not None:
        cuda.Governor(dev if dev is not None else "cuda", budget).install()


def uninstall() -> None:
    """Give torch's allocations back to the system allocator. Idempotent.

    Tensors allocated while installed stay valid and are freed correctly
    later: memguard keeps handling their frees.
    """
    with _lock:
        _C.uninstall()


def installed() -> bool:
    """Whether tensor allocations go to memguard's arena now (installed in
    process, or the whole process runs under ``memguard run``)."""
    return _C.installed() or _C.preloaded()


def preloaded() -> bool:
    """Whether this process runs under ``memguard run`` (the preload shim)."""
    return _C.preloaded()


def set_budget(budget: str | int | None) -> None:
    """Change the arena's budget (``None``: no budget). Cached blocks above a
    smaller budget are released at once."""
    with _lock:
        _C.arena_set_budget(0 if budget is None else parse_budget(budget))


def set_cache_limit(limit: str | int | None) -> None:
    """Keep at most this much freed memory cached (``None``: no limit beyond
    the budget). A smaller limit releases the excess at once."""
    with _lock:
        _C.arena_set_cache_limit(0 if limit is None else parse_budget(limit))


def stats(device: Any = "cpu") -> dict[str, int]:
    """The allocator's counters, flat, in PyTorch's vocabulary. With
    ``device="cuda"`` (or ``"cuda:N"``): the CUDA allocator's, see
    :func:`memguard.cuda.stats`. On the CPU, the arena's:
    ``allocated_bytes.{current,peak}``, ``reserved_bytes.*``, ``active_bytes.*``,
    ``requested_bytes.*``, ``cached_bytes``, ``budget_bytes``, ``cache_limit_bytes``,
    ``num_allocs``,
    ``num_frees``, ``num_cache_hits``, ``num_ooms``, ``num_trims``,
    ``trimmed_bytes``. Bytes are block sizes (size classes round up by at most
    25 %), except ``requested_bytes``; for blocks under 256 KiB requested
    counts the block size."""
    if str(device) != "cpu":
        from memguard import cuda

        return cuda.stats(device)
    return _C.arena_stats()


def trim(keep: int = 0) -> int:
    """Give cached blocks back to the kernel until at most ``keep`` bytes stay
    cached. Returns the bytes released."""
    return _C.arena_trim(int(keep))


def reset_peaks() -> None:
    """Set every ``*.peak`` counter to its current value."""
    _C.arena_reset_peaks()


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error: ``torch.OutOfMemoryError``
    (CUDA's included), or a ``RuntimeError`` with the CPU (memguard's budget
    included), CUDA or MPS out-of-memory message."""
    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch else None
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    if isinstance(exc, MemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    msg = str(exc).lower()
    return any(m in msg for m in _OOM_MESSAGES)
