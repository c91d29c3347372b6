"""The commit of a guarded step: the optimizer step as all or nothing.

After the micro-batches, :meth:`memguard.Guard.step` commits: the loss must
be finite, then the ``before_optimizer_step`` hook and clipping run, then
the optimizer steps. That last part can run out of memory too: Adam's
first step creates its state (two tensors the size of each parameter), and
every step's update allocates temporaries. An out-of-memory error there must
neither leave half the parameters updated nor half of them with state (the
next step would fail with ``KeyError: 'exp_avg'``).

:func:`optimizer_step` therefore takes a backup of what the update writes
(the parameters that have gradients, and their state) when an
out-of-memory error is possible, that is, when the room left under the
budget is short of three times what the update touches (the update's
temporaries are at most about twice it, foreach or not); on such an error
it puts the backup back and forgets the state the step created, relieves
memory and tries once more. When that fails too, :class:`OptimizerOOMError`
names the size of what the optimizer needs, and everything is as before the
step. With more room than that, or without a budget to pass, there is no
backup (it would cost a copy of the parameters and their state every step),
and an out-of-memory error drops the state the step created: exact for Adam
and its kind (they create all of it before they update anything) and for
foreach SGD; :class:`OptimizerOOMError` then says when the update had begun
without a backup.
"""
from __future__ import annotations

import copy
import math
import sys
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
    """The optimizer step ran out of memory twice (the second time after
    memory was relieved): the step was rolled back."""

    def __init__(self, needed: int, state: int) -> None:
        self.needed_bytes = needed
        self.state_bytes = state
        super().__init__(
            f"the optimizer step ran out of memory, also after memory was relieved: it "
            f"updates {size(needed)} of parameters and state ({size(state)} of it state, "
            f"kept from now on), which this budget cannot hold besides the model; the step "
            f"was rolled back (parameters, gradients, buffers and optimizer state as before "
            f"it): raise the budget, or use an optimizer with less state")


class PostStepError(RuntimeError):
    """``post_step`` failed after the optimizer step was taken."""

    def __init__(self, step: int) -> None:
        self.step = step
        super().__init__(
            f"post_step failed after the optimizer step of step {step} was taken: that "
            "step is done and counted; do not redo it (the error that stopped post_step "
            "is the cause below)")


def _tensors(state: dict) -> list[torch.Tensor]:
    return [v for v in state.values() if isinstance(v, torch.Tensor)]


def _touched(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters an optimizer step updates: those with gradients."""
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def footprint(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes the next optimizer step writes, bytes of state among them): the
    parameters with gradients and their state; a parameter without state
    yet is counted with twice its size of state to come (Adam's)."""
    params = _touched(optimizer)
    total = state = 0
    for p in params:
        total += p.nbytes
        st = optimizer.state.get(p)
        s = sum(t.nbytes for t in _tensors(st)) if st else 2 * p.nbytes
        total += s
        state += s
    return total, state


def _room(params: list[torch.Tensor]) -> int | None:
    """Bytes the next allocations may still take where an out-of-memory
    error can happen, ``None`` where none is expected (no budget to pass)."""
    if params and params[0].is_cuda:
        dev = params[0].device
        free, _ = sys.modules["torch"].cuda.mem_get_info(dev)
        return device_room(free, cuda.stats(dev))  # torch's counters fail under memguard's
    if not arena.installed():
        return None
    st = _C.arena_stats()
    if not st["budget_bytes"]:
        return None
    return int(st["budget_bytes"] - st["reserved_bytes.current"] + st["cached_bytes"])


def device_room(free: int, stats: dict[str, int]) -> int:
    """Bytes a CUDA device can still give: what the driver has free plus the
    allocator's cache, within the budget of memguard's allocator where it
    has one (``stats`` as :func:`memguard.cuda.stats` gives them)."""
    room = free + stats["cached_bytes"]
    if stats.get("budget_bytes"):
        room = min(room, stats["budget_bytes"] - stats["reserved_bytes.current"]
                   + stats["cached_bytes"])
    return max(0, int(room))


class _Backup:
    """What an optimizer step writes, as it was: the parameters with
    gradients, their state, and which of them had none."""

    def __init__(self, optimizer: torch.optim.Optimizer, copy_tensors: bool) -> None:
        params = _touched(optimizer)
        self.fresh = [p for p in params if not optimizer.state.get(p)]
        self.params: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.state: dict[torch.Tensor, dict] = {}
        if not copy_tensors:
            return
        with torch.no_grad():
            self.params = [(p, p.detach().clone()) for p in params]
            for p in params:
                st = optimizer.state.get(p)
                if st:
                    self.state[p] = {k: v.detach().clone() if isinstance(v, torch.Tensor)
                                     else copy.deepcopy(v) for k, v in st.items()}

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        for p in self.fresh:
            optimizer.state.pop(p, None)
        with torch.no_grad():
            for p, saved in self.params:
                p.copy_(saved)
            for p, saved in self.state.items():
                live = optimizer.state[p]
                for k, v in saved.items():
                    if isinstance(v, torch.Tensor) and isinstance(live.get(k), torch.Tensor) \
                            and live[k].shape == v.shape:
                        live[k].copy_(v)
                    else:
                        live[k] = v.clone() if isinstance(v, torch.Tensor) else v


def optimizer_step(optimizer: torch.optim.Optimizer, apply: Callable[[], float],
                   relieve: Callable[[], Any]) -> float:
    """Run ``apply`` (the optimizer step, through the scaler if any) as all
    or nothing (see the module docs); ``relieve`` frees memory before the
    second try.

    Raises:
        OptimizerOOMError: out of memory twice; everything is as before.
    """
    needed, state = footprint(optimizer)
    room = _room(_touched(optimizer))
    for attempt in range(2):
        try:
            backup = _Backup(optimizer, copy_tensors=room is not None and room < 3 * needed)
        except Exception as exc:
            if not is_oom(exc):
                raise
            if attempt:
                raise OptimizerOOMError(needed, state) from exc
            relieve()
            continue
        try:
            return apply()
        except Exception as exc:
            if not is_oom(exc):
                raise
            backup.restore(optimizer)
            del backup
            if attempt:
                raise OptimizerOOMError(needed, state) from exc
        relieve()
    raise AssertionError("unreachable")


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
