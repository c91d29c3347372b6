"""The commit of a guarded step: the optimizer step, all or nothing where
it can be, and never less able to finish than the plain loop's.

After the micro-batches, :meth:`memguard.Guard.step` commits: the loss must
be finite, then the ``before_optimizer_step`` hook and clipping run, then
the optimizer steps. That last part can fail too: Adam's first step creates
its state (two tensors the size of each parameter), and every step's update
allocates temporaries; an optimizer hook may raise.

:func:`optimizer_step` decides once per update, in this order:

* **what the update allocates** (its *need*): the state it creates (twice
  the size of each parameter that has none yet, as Adam's) and its
  temporaries, measured at this optimizer's last update that created no
  state and raised the step's peak (its peak above what was held before
  it: exact, in the budget's own units); before one
  is measured, estimated as the larger of the parameters' size (a
  ``foreach`` update) and twice the largest one (a for-loop update). An
  update that stays below the forward's peak fits wherever the forward did;
* **the room** the budget leaves (none without a budget to pass: then no
  out-of-memory error is expected of it); when the room is short of the
  need, memory is relieved first; when even all that is not held (the
  arena's free slab blocks counted) is short of it, and the need was
  measured (no state to create, the same parameters as last time), the
  update cannot fit and is never begun: :class:`OptimizerOOMError`, with
  everything as before the step;
* **a backup** of what the update writes (the parameters with gradients,
  their state, the AMP scaler's scale) is taken when an out-of-memory error
  is possible (the room short of twice the need) and the backup fits beside
  the need. It is never taken where it would crowd the update out: an update
  that fits in a plain loop fits under memguard.

Whatever ends the update, it is undone where that is exact: from the
backup; or, without one, where the update had not begun (no parameter,
state tensor or scale was written, as their version counters tell) by
dropping the state it created. An out-of-memory error in an update undone
so is retried once, after memory was relieved; an update that had begun is
never run again on top of itself. One that had begun without a backup
cannot be undone: :class:`OptimizerOOMError` (``rolled_back=False``), or
the exception that stopped it with a note, says so.

Version counters see every in-place operation, not writes through
``.data`` (an optimizer outside ``torch.optim`` may write that way), nor
those of foreach operations under a ``TorchDispatchMode`` (torch 2.13): an
update of such an optimizer, or one begun under such a mode, that failed
without a backup is never called not begun.
"""
from __future__ import annotations

import copy
import math
import sys
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import torch

from memguard import _C
from memguard._common import size
from memguard.memory import arena, cuda
from memguard.memory.oom import is_oom


class NonFiniteLossError(ValueError):
    """The step's loss is not finite: the optimizer step was not taken."""

    def __init__(self, loss: float) -> None:
        self.loss = loss
        super().__init__(
            f"the step's loss is {loss}: the optimizer step was not taken, and the model, "
            "gradients, buffers and optimizer state are as they were before the step")


class OptimizerOOMError(RuntimeError):
    """The optimizer step ran out of memory: rolled back after a second
    try (``rolled_back``), or refused before it began because it cannot fit,
    or part-way through an update that could not be undone.

    Attributes:
        needed_bytes: what the update allocates (state it creates and
            temporaries), as memguard estimated it.
        state_bytes: the state among it.
        held_bytes: what was held where the budget counts (not cache).
        budget_bytes: the budget (0: none).
        room_bytes: what the budget left (``None``: no budget).
        rolled_back: whether everything is as before the step.
    """

    def __init__(self, needed: int, state: int, held: int, budget: int, room: int | None,
                 rolled_back: bool, why: str = "", begun: bool = True) -> None:
        self.needed_bytes, self.state_bytes = needed, state
        self.held_bytes, self.budget_bytes, self.room_bytes = held, budget, room
        self.rolled_back = rolled_back
        have = f"{size(held)} was held" + (
            f" of a budget of {size(budget)}, which left room for {size(room)}"
            if budget and room is not None else "")
        needs = f"it allocates about {size(needed)}" + (
            f" ({size(state)} of it new state)" if state else "")
        if not begun:
            super().__init__(
                f"the optimizer step cannot fit, also after memory was relieved: {needs} (as "
                f"measured at the last steps), while {have}; it was not begun, and the step "
                f"was rolled back (parameters, gradients, buffers and optimizer state as before "
                f"it): raise the budget, hold less outside the step, or use an optimizer with "
                f"less state")
        elif rolled_back:
            super().__init__(
                f"the optimizer step ran out of memory, also after memory was relieved: "
                f"{needs}, while {have}; the step was rolled back (parameters, gradients, "
                f"buffers and optimizer state as before it): raise the budget, hold less "
                f"outside the step, or use an optimizer with less state")
        else:
            super().__init__(
                f"the optimizer step ran out of memory part-way through its update "
                f"({why}): {needs}, while {have}. The step could NOT be rolled back: "
                f"parameters and optimizer state are partly updated; reload the last "
                f"checkpoint")


class PostStepError(RuntimeError):
    """``post_step`` failed after the optimizer step was taken."""

    def __init__(self, step: int) -> None:
        self.step = step
        super().__init__(
            f"post_step failed after the optimizer step of step {step} was taken: that "
            "step is done and counted; do not redo it (the error that stopped post_step "
            "is the cause below)")


def _tensors(state: dict | None) -> list[torch.Tensor]:
    return [v for v in (state or {}).values() if isinstance(v, torch.Tensor)]


def _touched(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters an optimizer step updates: those with gradients."""
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def footprint(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes the next optimizer step writes, bytes of state among them): the
    parameters with gradients and their state; a parameter without state
    yet is counted with twice its size of state to come (Adam's)."""
    total = state = 0
    for p in _touched(optimizer):
        st = optimizer.state.get(p)
        s = sum(t.nbytes for t in _tensors(st)) if st else 2 * p.nbytes
        total += p.nbytes + s
        state += s
    return total, state


def _room(params: list[torch.Tensor],
          stats: dict[str, int] | None = None) -> tuple[int, int] | None:
    """(bytes the next allocations can surely take, bytes they could take
    at most) where an out-of-memory error can happen, ``None`` where none
    is expected (no budget to pass). Under the arena the two differ by its
    free slab blocks: reusable by allocations of their own size class only.
    ``stats``: the CUDA device's counters just read (:func:`_device_stats`)."""
    if params and params[0].is_cuda:
        dev = params[0].device
        free, _ = sys.modules["torch"].cuda.mem_get_info(dev)
        if stats is None:
            stats = cuda.stats(dev)  # torch's counters fail under memguard's allocator
        room = device_room(free, stats)
        return room, room
    if not arena.installed():
        return None
    st = _C.arena_stats()
    budget = st["budget_bytes"]
    if not budget:
        return None
    least = budget - st["reserved_bytes.current"] + st["cached_bytes"]
    return int(least), int(max(least, budget - st["allocated_bytes.current"]))


def _held(params: list[torch.Tensor]) -> tuple[int, int]:
    """(bytes held where the budget counts them, less cache; the budget, 0
    for none), for messages."""
    if params and params[0].is_cuda:
        st = cuda.stats(params[0].device)
        return int(st["reserved_bytes.current"] - st["cached_bytes"]), \
            int(st.get("budget_bytes") or 0)
    if arena.installed():
        st = _C.arena_stats()
        return int(st["reserved_bytes.current"] - st["cached_bytes"]), int(st["budget_bytes"])
    return 0, 0


def device_room(free: int, stats: dict[str, int]) -> int:
    """Bytes a CUDA device can still give: what the driver has free plus the
    allocator's cache, within the budget of memguard's allocator where it
    has one (``stats`` as :func:`memguard.cuda.stats` gives them)."""
    room = free + stats["cached_bytes"]
    if stats.get("budget_bytes"):
        room = min(room, stats["budget_bytes"] - stats["reserved_bytes.current"]
                   + stats["cached_bytes"])
    return max(0, int(room))


def _scale_tensors(scaler: Any) -> list[torch.Tensor]:
    """The AMP scaler's tensors an update writes (its scale and growth)."""
    return [t for t in (getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None))
            if isinstance(t, torch.Tensor)]


class Need:
    """What an optimizer's updates allocate: the state an update creates,
    plus temporaries learnt from the last update measured over the same
    parameters (see the module docs). One per guard, over its optimizers."""

    def __init__(self) -> None:
        # optimizer -> (the parameters' count and bytes, temporaries measured)
        self._temps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def of(self, optimizer: torch.optim.Optimizer,
           params: list[torch.Tensor]) -> tuple[int, int, bool]:
        """(bytes the update allocates, state among them, whether that was
        measured: no state to create, and the same parameters as the update
        measured last)."""
        fresh = sum(2 * p.nbytes for p in params if not optimizer.state.get(p))
        sizes = [p.nbytes for p in params] or [0]
        learnt = self._temps.get(optimizer)
        if learnt is not None and learnt[0] == (len(params), sum(sizes)):
            return fresh + learnt[1], fresh, not fresh
        return fresh + max(sum(sizes), 2 * max(sizes)), fresh, False

    def learn(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
              peak_above: int) -> None:
        """An update of ``params`` that created no state peaked
        ``peak_above`` bytes (as the budget counts them) above what was held
        before it. The least such reading is kept: each is the update's own
        need plus whatever other threads allocated meanwhile, so the least
        is the closest one, and never below the need."""
        key = (len(params), sum(p.nbytes for p in params))
        was = self._temps.get(optimizer)
        least = max(0, peak_above)
        if was is not None and was[0] == key:
            least = min(least, was[1])
        self._temps[optimizer] = (key, least)


#: state values kept as they are (no copy) by an undo
_IMMUTABLE = (int, float, bool, complex, str, bytes, type(None))


def _inner(optimizer: Any) -> Any:
    """The optimizer inside a wrapper that steps it (Lightning's
    ``LightningOptimizer``, a subclass made of the optimizer's own class,
    keeps it as ``.optimizer``)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and \
            optimizer.optimizer is not optimizer:
        optimizer = optimizer.optimizer
    return optimizer


class _Undo:
    """How one update is undone: from a backup of what it writes, or by
    dropping the state it created where it had not begun."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                 scaler: Any, backup: bool) -> None:
        self.optimizer, self.scaler = optimizer, scaler
        state = optimizer.state
        self.fresh = [p for p in params if not state.get(p)]
        written = list(params) + _scale_tensors(scaler)
        plain: list[tuple[dict, str, Any]] = []
        for p in params:
            for k, v in (state.get(p) or {}).items():
                if isinstance(v, torch.Tensor):
                    written.append(v)
                else:
                    plain.append((state[p], k, v if isinstance(v, _IMMUTABLE) else
                                  copy.deepcopy(v)))
        self._written = written
        self._versions = [t._version for t in written]
        self._plain = plain
        # versions count writes of torch.optim's updates, not under a
        # dispatch mode (foreach operations skip them there)
        self._trusted = type(_inner(optimizer)).step.__module__.startswith("torch.") and \
            not torch._C._len_torch_dispatch_stack()   # this thread's modes
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.state: dict[torch.Tensor, dict] = {}
        if backup:
            self._take(params, scaler)

    def _take(self, params: list[torch.Tensor], scaler: Any) -> None:
        with torch.no_grad():
            for t in list(params) + _scale_tensors(scaler):
                self.saved.append((t, t.detach().clone()))
            for p in params:
                st = self.optimizer.state.get(p)
                if st:
                    self.state[p] = {k: v.detach().clone() if isinstance(v, torch.Tensor)
                                     else copy.deepcopy(v) for k, v in st.items()}

    @property
    def backed_up(self) -> bool:
        return bool(self.saved)

    def written(self) -> int:
        """How many parameters, state tensors and state values the update
        wrote (0: it had not begun, as far as version counters see)."""
        n = sum(t._version != v for t, v in zip(self._written, self._versions))
        return n + sum(k not in st or st[k] != v for st, k, v in self._plain)

    def roll_back(self) -> bool:
        """Undo the update; whether it could be (everything as before)."""
        if self.backed_up:
            self._restore()
        elif self.written() or not self._trusted:
            return False
        for p in self.fresh:
            self.optimizer.state.pop(p, None)
        _unstep(self.scaler, self.optimizer)
        return True

    def _restore(self) -> None:
        with torch.no_grad():
            for t, saved in self.saved:
                t.copy_(saved)
            for p, saved in self.state.items():
                live = self.optimizer.state[p]
                for k, v in saved.items():
                    if isinstance(v, torch.Tensor) and isinstance(live.get(k), torch.Tensor) \
                            and live[k].shape == v.shape:
                        live[k].copy_(v)
                    else:
                        live[k] = v.clone() if isinstance(v, torch.Tensor) else v

    def why(self) -> str:
        """Why it cannot be undone, in words."""
        n = self.written()
        if n:
            return f"{n} of its parameters, state tensors and values were already written, " \
                   f"and there was no room for a backup"
        return f"{type(_inner(self.optimizer)).__name__} is not one of torch.optim's, whose writes " \
               f"memguard can see, and there was no room for a backup"


def optimizer_step(optimizer: torch.optim.Optimizer, apply: Callable[[], float],
                   relieve: Callable[[], Any], *, need: Need | None = None,
                   meter: Any = None, scaler: Any = None) -> float:
    """Run ``apply`` (the optimizer step, through the scaler if any) as all
    or nothing where it can be (see the module docs).

    Args:
        optimizer: the optimizer ``apply`` steps.
        apply: the step; returns the step's loss.
        relieve: frees memory (before an update the room cannot hold, and
            before the second try).
        need: the guard's record of what updates allocate (learnt here).
        meter: the step's :class:`~memguard.train.peaks.PeakMeter`, read
            before and after the update to measure it; the reading after
            it is the step's last (:meth:`~memguard.train.peaks.PeakMeter.stop`
            takes it).
        scaler: the AMP scaler ``apply`` steps through.

    Raises:
        OptimizerOOMError: out of memory twice (rolled back), or part-way
            through an update that could not be undone.
        BaseException: what stopped ``apply`` otherwise; everything is as
            before the step, or a note on it says that it is not.
    """
    need = need if need is not None else Need()
    params = _touched(optimizer)
    meter = meter if meter is not None and _measures(meter, params) else None
    for attempt in range(2):
        needed, state, measured = need.of(optimizer, params)
        stats = _device_stats(params)   # one reading: the room's and the meter's
        room = _room(params, stats)
        if not attempt and room is not None and room[1] < needed:   # even counting all
            relieve()
            stats = _device_stats(params)
            room = _room(params, stats)
        if measured and room is not None and room[1] < needed:   # it cannot fit: never begin
            raise OptimizerOOMError(needed, state, *_held(params), room[1], rolled_back=True,
                                    begun=False)
        undo = _undo_for(optimizer, params, scaler, needed, room and room[0])
        # a backup allocated since the reading: read again
        before = meter.now(None if undo.backed_up else stats) if meter is not None else None
        try:
            loss = apply()
        except BaseException as exc:
            undone = undo.roll_back()
            why = "" if undone else undo.why()
            del undo                           # no backup lives on in a traceback
            if not is_oom(exc):
                if not undone:
                    exc.add_note(f"memguard: the optimizer step stopped part-way through its "
                                 f"update ({why}): the step could NOT be rolled back")
                raise
            if attempt or not undone:
                # the update's frames would keep the state it created, and
                # its temporaries, alive as long as the error
                traceback.clear_frames(exc.__traceback__)
                room = _room(params)
                raise OptimizerOOMError(needed, state, *_held(params), room and room[0], undone,
                                        why) from exc
        else:
            after = meter.now(settled=True) if before is not None else None
            if after is not None and not undo.fresh and after[1] > before[1]:   # its own peak
                need.learn(optimizer, params, after[1] - before[0])
            return loss
        relieve()
    raise AssertionError("unreachable")


def _measures(meter: Any, params: list[torch.Tensor]) -> bool:
    """Whether the step's peak meter counts the memory the parameters live
    in (a CPU batch may feed a model on a GPU)."""
    return bool(params) and meter.measures(params[0].device)


def _device_stats(params: list[torch.Tensor]) -> dict[str, int] | None:
    """One reading of the counters of the CUDA device the parameters live
    on (:func:`memguard.memory.cuda.stats`); ``None`` off CUDA."""
    return cuda.stats(params[0].device) if params and params[0].is_cuda else None


def _undo_for(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], scaler: Any,
              needed: int, room: int | None) -> _Undo:
    """How the update will be undone: with a backup where an out-of-memory
    error is possible (the room short of twice the need) and the backup
    fits beside the need; else without."""
    backup = False
    if room is not None and room < 2 * needed:
        written, _ = footprint(optimizer)
        fresh = sum(2 * p.nbytes for p in params if not optimizer.state.get(p))
        backup = room >= (written - fresh) + needed
    try:
        return _Undo(optimizer, params, scaler, backup)
    except Exception as exc:                 # the room was read wrong: go on without one
        if not is_oom(exc):
            raise
        return _Undo(optimizer, params, scaler, False)


def _unstep(scaler: Any, optimizer: Any) -> None:
    """An update undone after the AMP scaler recorded it as stepped (its
    ``update()`` failed): the scaler's record goes back to unscaled, so the
    retry steps with the gradients it already unscaled."""
    states = getattr(scaler, "_per_optimizer_states", None)
    st = states.get(id(optimizer)) if isinstance(states, dict) else None
    stage = st.get("stage") if st else None
    if getattr(stage, "name", None) == "STEPPED":
        st["stage"] = type(stage).UNSCALED


def check_finite(loss: float) -> None:
    """Stop a step whose loss is NaN or infinite, before its update.

    Raises:
        NonFiniteLossError: it is.
    """
    if not math.isfinite(loss):
        raise NonFiniteLossError(loss)


def reset_scaler(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """A rolled-back step leaves the AMP scaler as before it: its record that
    this optimizer's gradients were unscaled this step goes (else the next
    step's ``unscale_`` raises that it already ran)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is not None and hasattr(states, "default_factory"):
        states.pop(id(optimizer), None)
