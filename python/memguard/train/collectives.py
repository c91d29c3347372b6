"""Collectives inside a step that an out-of-memory error cannot strand.

FSDP2 all-gathers parameters in every forward and reduce-scatters gradients
in every backward; MoCo's forward all-gathers keys, DINO's loss
all-reduces its center. When one rank runs out of memory between two of
them, the others are already waiting in the next, which the failed rank
never joins: a plain vote from it would meet their collective (gloo aborts
on the size mismatch; NCCL hangs).

While a guarded step's attempt runs, the collectives of
``torch.distributed`` go through :func:`collective`: with the agreement
*armed*, each is preceded by one vote of the ranks (the same all-reduce the
step's own vote is, so a failed rank's vote meets the others wherever they
are). A rank that ran out of memory votes once; the others learn it at
their next collective, raise there, and every rank redoes the step. The
allocation that fails comes before the collective it feeds (FSDP2 sizes its
buffers before it issues), so no collective is left half done.

Armed costs one small all-reduce per collective. It is armed only while
memory is tight (the ranks agree on it at the step's boundary: see
:meth:`memguard.train.distributed.Peers.begin_plan`); while calm an
out-of-memory error among collectives cannot be redone, and the failed rank
raises :class:`StrandedCollective` at once, naming the last collective,
instead of leaving the others to a timeout.

Functions bound by name before memguard wrapped them (``from
torch.distributed import all_gather`` at import time) are not seen.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

#: the collectives of ``torch.distributed`` that every rank of a group joins
NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
         "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor",
         "reduce_scatter_single", "_reduce_scatter_base", "broadcast", "reduce", "gather",
         "scatter", "all_to_all", "all_to_all_single", "barrier", "all_gather_object",
         "broadcast_object_list", "all_reduce_coalesced", "gather_object",
         "scatter_object_list", "monitored_barrier")

_original: dict[str, Callable[..., Any]] = {}
_inside = threading.local()     # a collective's own collectives (``*_object``) are not voted
_lock = threading.Lock()


class StrandedCollective(RuntimeError):
    """A rank ran out of memory where the other ranks may wait in a
    collective it cannot join: the step cannot be redone."""


class Attempt:
    """What one attempt's collectives see: counted always, voted before
    when ``vote`` is given (``vote(name)`` raises where another rank ran
    out of memory)."""

    def __init__(self, vote: Callable[[str], None] | None) -> None:
        self.vote = vote
        self.issued = 0              # collectives issued by this attempt
        self.last = ""               # the name of the last one
        self.failed_inside = ""      # one that ran out of memory after its vote

    def before(self, name: str) -> None:
        if self.vote is not None:
            self.vote(name)
        self.issued += 1
        self.last = name


_current: Attempt | None = None


def install() -> None:
    """Route ``torch.distributed``'s collectives through :func:`collective`
    (once per process; a pass-through outside a guarded attempt)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    with _lock:
        for name in NAMES:
            fn = getattr(dist, name, None)
            if fn is None or name in _original:
                continue
            _original[name] = fn
            wrapped = _wrap(name, fn)
            setattr(dist, name, wrapped)
            if getattr(c10d, name, None) is fn:
                setattr(c10d, name, wrapped)


def original(name: str) -> Callable[..., Any]:
    """``torch.distributed``'s own ``name`` (memguard's votes use it)."""
    fn = _original.get(name)
    if fn is None:
        import torch.distributed as dist
        fn = getattr(dist, name)
    return fn


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def collective(*args: Any, **kwargs: Any) -> Any:
        attempt = _current
        if attempt is None or getattr(_inside, "depth", 0):
            return fn(*args, **kwargs)
        attempt.before(name)
        _inside.depth = 1
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            from memguard.memory.oom import is_oom
            if is_oom(exc):          # the others are inside this one
                attempt.failed_inside = name
            raise
        finally:
            _inside.depth = 0
    return collective


class attempt_of:
    """Context: the collectives issued in it belong to ``attempt``."""

    def __init__(self, attempt: Attempt) -> None:
        self.attempt = attempt

    def __enter__(self) -> Attempt:
        global _current
        _current = self.attempt
        return self.attempt

    def __exit__(self, *exc: object) -> None:
        global _current
        _current = None
