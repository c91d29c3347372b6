"""memguard's budgeted caching allocator for CPU tensors, installed in-process.

:func:`install` rewrites the import slots through which ``libc10.so`` (the
library behind every torch CPU allocation, ``c10::alloc_cpu``) calls
``posix_memalign``, ``free`` and ``realloc``, so tensor storage comes from
memguard's arena: size classes cached for reuse, one reserved address range,
and a budget. An allocation that would pass the budget first releases cached
blocks, then fails the way torch always fails, with
``RuntimeError: ... can't allocate memory ...``; the process goes on and the
next allocation that fits succeeds. :func:`memguard.is_oom` recognises that error,
and :func:`explain` adds a note to it (PEP 678) naming memguard's budget, the
request and what was held, so that a refusal by the budget is not taken for
the machine running out: an uncaught one gets it on its way to the
traceback, a guard's :class:`~memguard.GuardOOMError` carries it.
"""
from __future__ import annotations

import sys
import threading

from memguard import _C
from memguard._common import size
from memguard.memory.oom import is_oom
from memguard.telemetry.budget import parse_budget

_lock = threading.Lock()  # serialises install/uninstall/set_budget from Python
_explained = 0            # the arena's refusals already named in a note

def install(budget: str | int | None = None, cache_limit: str | int | None = None) -> None:
    """Route CPU tensor memory to memguard's arena. Idempotent. (CUDA:
    :func:`memguard.memory.cuda.govern` and :func:`memguard.memory.cuda.install_allocator`.)

    Args:
        budget: the most the arena may hold (allocated plus cached), see
            :func:`memguard.parse_budget`; ``None`` keeps the current budget
            (none at first).
        cache_limit: the most freed memory kept cached for reuse (a size or
            a percentage, like a budget); ``None`` keeps the current limit
            (none at first: the cache is bounded by the budget).

    Raises:
        RuntimeError: torch is not imported, the platform has no ELF import
            slots, ``libc10.so`` does not import the functions memguard
            rewrites, or the routing did not take effect (a probe tensor
            was not served by the arena).
        ValueError: a bad budget or cache limit.
    """
    if "torch" not in sys.modules:
        raise RuntimeError("import torch before memguard.install(): there is no torch "
                           "allocator to route yet")
    import torch

    with _lock:
        _hook_uncaught()
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


def stats() -> dict[str, int]:
    """The arena's counters, flat, in PyTorch's vocabulary:
    ``allocated_bytes.{current,peak}``, ``reserved_bytes.*``, ``active_bytes.*``,
    ``requested_bytes.*``, ``cached_bytes``, ``budget_bytes``, ``cache_limit_bytes``,
    ``num_allocs``, ``num_frees``, ``num_cache_hits``, ``num_ooms``, ``num_trims``,
    ``trimmed_bytes`` (and more: see the allocator's page of the docs). Bytes
    are block sizes (size classes round up by at most 25 %), except
    ``requested_bytes``, which counts what callers asked for. A CUDA device's: :func:`memguard.memory.cuda.stats`."""
    return _C.arena_stats()


def set_soft(soft: bool) -> None:
    """Make the budget soft (``True``): outside :func:`strict` sections, an
    allocation the budget cannot hold releases the whole cache and is served
    past the budget, counted in ``num_overruns`` (and
    ``last_overrun_bytes``), instead of failing. A guard installs its
    tensor budget soft: only inside its steps, where a refusal is recovered,
    does the budget refuse. ``False`` (the default) refuses everywhere.
    The shared budget of ``memguard run --budget`` is always hard."""
    _C.arena_set_soft(bool(soft))


class strict:
    """The section, in any thread, where a soft budget refuses what it
    cannot hold (a guarded step's attempts, where the refusal is
    recovered)::

        with arena.strict():
            ...

    One at a time: a process has one guard, stepping one loop. An
    interrupt can land between the opening and the ``with`` block, leaving
    it open: the guard's step closes it again whatever ends it
    (:meth:`close`, idempotent)."""

    __slots__ = ()

    def __enter__(self) -> None:
        _C.arena_strict(True)

    def __exit__(self, *exc: object) -> None:
        _C.arena_strict(False)

    @staticmethod
    def close() -> None:
        """Close the section, open or not."""
        _C.arena_strict(False)


def trim(keep: int = 0) -> int:
    """Give cached blocks back to the kernel until at most ``keep`` bytes stay
    cached. Returns the bytes released."""
    return _C.arena_trim(int(keep))


def reset_peaks() -> None:
    """Set every ``*.peak`` counter to its current value."""
    _C.arena_reset_peaks()


def explain(exc: BaseException) -> bool:
    """Add a note to an out-of-memory error that memguard's budget caused:
    the budget, the request refused and what the arena held. Only the first
    explanation of each refusal is added; an error the budget did not cause
    (no budget, or no refusal since the last note) is left alone. Needs
    Python 3.11's ``add_note``; before it, nothing is added.

    Returns:
        Whether a note was added.
    """
    global _explained
    if not hasattr(exc, "add_note") or not is_oom(exc):
        return False
    st = _C.arena_stats()
    with _lock:
        if st["num_ooms"] <= _explained or not st["budget_bytes"]:
            return False
        _explained = st["num_ooms"]
    held = st["tree_reserved_bytes"] or st["reserved_bytes.current"]
    exc.add_note(f"memguard: the allocation of {size(st['last_oom_bytes'])} was refused by "
                 f"memguard's budget of {size(st['budget_bytes'])} while {size(held)} was held "
                 f"(not by the machine): raise the budget (memguard.install(budget=...), "
                 f"Guard(budget=... or tensor_budget=...), MEMGUARD_BUDGET), or give None for none")
    return True


def _hook_uncaught() -> None:
    """Explain uncaught out-of-memory errors before they are printed, in
    every thread. Installed once, chaining to the hooks there were."""
    if getattr(sys.excepthook, "_memguard", False):
        return
    previous, previous_thread = sys.excepthook, threading.excepthook

    def hook(kind, exc, tb):
        explain(exc)
        previous(kind, exc, tb)

    def thread_hook(args):
        if args.exc_value is not None:
            explain(args.exc_value)
        previous_thread(args)

    hook._memguard = True                 # type: ignore[attr-defined]
    sys.excepthook, threading.excepthook = hook, thread_hook
