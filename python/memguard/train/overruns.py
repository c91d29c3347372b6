"""Allocations served past a guard's tensor budget outside its steps.

A guard installs its tensor budget soft (:func:`memguard.memory.arena.set_soft`):
inside a step's attempts (and :meth:`Guard.infer`'s micro-batches) the
budget refuses, and the refusal is recovered by a smaller micro-batch;
elsewhere (a validation loop the guard does not step, a checkpoint being
written, the user's own code between steps) no split can recover a refusal,
so the arena serves the allocation past the budget instead, after releasing
its whole cache. memguard never fails a run the plain loop would finish.

:class:`Overruns` reports them: an event each time new ones are seen, a
warning once per place (the Lightning stage, where the callback names it),
and a relief (gc collection, allocator trims, CUDA's cache).
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Callable

from memguard._common import size
from memguard.memory import arena
from memguard.telemetry.events import Event


class BudgetOverrunWarning(UserWarning):
    """Memory past the tensor budget was served outside a guarded step."""


class Overruns:
    """Watches the arena's overrun counter for one guard.

    Args:
        event: writes an event (the guard's exporter).
        relieve: releases memory (the guard's gc hooks).
    """

    def __init__(self, event: Callable[..., Any], relieve: Callable[[], Any]) -> None:
        self._event, self._relieve = event, relieve
        self._lock = threading.Lock()
        self._seen: int | None = None   # None: not watching (the guard is not installed)
        self._warned: set[str] = set()
        #: names where the process is now ("Lightning's validate stage");
        #: ``None``: outside a guarded step, unnamed
        self.where: Callable[[], str | None] | None = None

    def start(self) -> None:
        """Watch from now (the guard's install): earlier overruns are not its."""
        with self._lock:
            self._seen = int(arena.stats()["num_overruns"])

    def stop(self) -> None:
        """Stop watching (the guard's uninstall)."""
        with self._lock:
            self._seen = None

    def check(self) -> int:
        """Report the overruns since the last call; how many there were.
        Safe from any thread (the sampler's calls it at every sample)."""
        st = arena.stats()
        with self._lock:
            if self._seen is None:
                return 0
            new, self._seen = int(st["num_overruns"]) - self._seen, int(st["num_overruns"])
        if new <= 0:
            return 0
        where = (self.where() if self.where is not None else None) or "outside a guarded step"
        self._event(Event.OVERRUN, count=new, where=where, last_bytes=st["last_overrun_bytes"],
                    reserved_bytes=st["reserved_bytes.current"], budget_bytes=st["budget_bytes"])
        self._warn_once(where, st)
        self._relieve()
        return new

    def _warn_once(self, where: str, st: dict) -> None:
        with self._lock:
            if where in self._warned:
                return
            self._warned.add(where)
        warnings.warn(
            f"memguard: {where}, tensors passed the tensor budget of "
            f"{size(st['budget_bytes'])} (the last request: {size(st['last_overrun_bytes'])}, "
            f"{size(st['reserved_bytes.current'])} held); memguard served them rather than fail "
            f"a run that fits the machine, since no split recovers a refusal there. Run that "
            f"code through Guard.step / Guard.infer to keep it inside the budget, or raise "
            f"tensor_budget", BudgetOverrunWarning, stacklevel=2)
