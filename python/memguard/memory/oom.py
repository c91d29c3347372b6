"""Telling an out-of-memory error from any other, across devices and
allocators."""
from __future__ import annotations

import sys

#: Messages of out-of-memory errors across devices and allocators.
_OOM_MESSAGES = (
    "can't allocate memory",         # CPU: c10's DefaultCPUAllocator (memguard's budget too)
    "not enough memory",             # CPU, older torch
    "cuda out of memory",            # CUDA caching allocator
    "out of memory",                 # CUDA driver, cuBLAS and friends
    "mps backend out of memory",     # Apple MPS
    "cannot allocate memory",        # errno text
)


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
