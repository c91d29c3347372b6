"""Exact gradient accumulation over micro-batches a script already splits.

::

    acc = memguard.accumulate(model, optimizer, scaler=scaler, clip_grad_norm=1.0)
    for micro in acc.iterate(micro_batches):     # no_sync() on all but the last
        loss = criterion(model(micro["x"]), micro["y"])
        acc.backward(loss, weight=len(micro["x"]))
    acc.step()                                   # divide, unscale, clip, step, zero

Each loss is a mean over its micro-batch; weighting it by its samples (or a
caller's weight, such as a count of masked tokens) and dividing the summed
gradients by the total weight gives the gradients of the whole batch's
mean loss, so the optimizer step is the unsplit step's.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

_NOTHING = "nothing to step: no micro-batch with a positive weight was accumulated"


def _weight(w: Any) -> float:
    w = float(w.detach().item() if isinstance(w, torch.Tensor) else w)
    if not w >= 0.0 or w == float("inf"):
        raise ValueError(f"a micro-batch weight must be finite and non-negative, not {w!r}")
    return w


class Accumulator:
    """Accumulates weighted micro-batch gradients, then steps once.

    Args:
        model: the module being trained; when it has ``no_sync`` (DDP,
            FSDP) every micro-batch from :meth:`iterate` but the last runs
            under it, so gradients are all-reduced once per step. ``None``
            for no synchronisation.
        optimizer: the optimizer to step.
        scaler: a ``torch.amp.GradScaler`` for float16 mixed precision.
        clip_grad_norm: clip the gradients' total 2-norm to this after
            unscaling (``None``: no clipping).
        total_weight: the step's total weight when known in advance (the
            batch's sample count): each loss is then scaled by
            ``weight / total_weight`` at once, and a step whose single
            micro-batch is the whole batch is bit-for-bit the unsplit one.
            ``None``: divide the gradients by the summed weights in
            :meth:`step`.
        backward: runs the backward pass of each weighted loss in place of
            ``loss.backward()`` (Lightning's ``manual_backward``, which
            applies its precision plugin's loss scaling).
        before_optimizer_step: called as ``before_optimizer_step(optimizer)``
            once the gradients are the whole batch's and unscaled, before
            clipping and the optimizer step (Lightning's
            ``on_before_optimizer_step``): per-parameter clipping, freezing a
            layer by dropping its gradients.
    """

    def __init__(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer, *,
                 scaler: Any = None, clip_grad_norm: float | None = None,
                 total_weight: float | None = None,
                 backward: Callable[[torch.Tensor], Any] | None = None,
                 before_optimizer_step: Callable[[torch.optim.Optimizer], Any] | None = None,
                 ) -> None:
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be positive, not {clip_grad_norm!r}")
        if total_weight is not None and not total_weight > 0:
            raise ValueError(f"total_weight must be positive, not {total_weight!r}")
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.clip_grad_norm = clip_grad_norm
        self.total_weight = total_weight
        self._backward = backward
        self._before_step = before_optimizer_step
        self.weight = 0.0          # summed weights of the micro-batches so far
        self.micro_batches = 0
        self._normalized = False
        self._loss: torch.Tensor | None = None  # weighted loss sum, detached
        self._value: float | None = None        # :attr:`loss`, once read from the device

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _divide_grads(self, by: float) -> None:
        grads = [p.grad for p in self._params() if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, by)

    def iterate(self, items: Iterable[Any]) -> Iterator[Any]:
        """Yield ``items``; all but the last inside the model's ``no_sync()``."""
        items = list(items)
        no_sync = getattr(self.model, "no_sync", None)
        for i, item in enumerate(items):
            last = i == len(items) - 1
            with (contextlib.nullcontext() if last or no_sync is None else no_sync()):
                yield item

    def backward(self, loss: torch.Tensor, weight: Any = 1.0) -> None:
        """Backward of ``loss`` (a mean over its micro-batch) weighted by
        ``weight`` (its samples, or the caller's count)."""
        w = _weight(weight)
        scale = w / self.total_weight if self.total_weight is not None else w
        scaled = loss if scale == 1.0 else loss * scale
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        if self._backward is not None:
            self._backward(scaled)
        else:
            scaled.backward()
        self.weight += w
        self.micro_batches += 1
        term = loss.detach().float() * w
        self._loss = term if self._loss is None else self._loss + term
        self._value = None

    def close_weights(self, last_weight: Any) -> None:
        """Before the last micro-batch's backward, once every weight is known:
        fix the total weight (the weights so far and ``last_weight``) and
        divide the gradients accumulated so far by it, so that the last
        backward completes the rank's weighted mean by itself. DDP's
        synchronising backward (``ddp_overlap``) then averages means, as a
        deferred all-reduce after :meth:`normalize` does.

        Raises:
            ValueError: the weights sum to 0.
        """
        if self.total_weight is not None:
            return
        total = self.weight + _weight(last_weight)
        if not total > 0:
            raise ValueError(_NOTHING)
        self._divide_grads(total)
        self.total_weight = total

    def add_whole_batch(self, loss: float, micro_batches: int) -> None:
        """Record gradients of the whole batch's loss accumulated elsewhere
        (GradCache): :meth:`step` then neither divides nor rescales them."""
        self.total_weight = None
        self.weight = 1.0
        self.micro_batches += micro_batches
        self._loss = None
        self._value = float(loss)

    @property
    def loss(self) -> float:
        """The step's mean loss so far (weighted like its gradients): read
        from the device once after the last backward (the one wait for the
        device a step needs, as the plain loop's ``loss.item()``), then
        kept until another micro-batch is added."""
        if self._value is None:
            if self._loss is None or self.weight == 0:
                return float("nan")
            self._value = float(self._loss) / self.weight
        return self._value

    def reset(self) -> None:
        """Forget the accumulated micro-batches and their gradients."""
        self.optimizer.zero_grad(set_to_none=True)
        self.weight = 0.0
        self.micro_batches = 0
        self._normalized = False
        self._loss = None
        self._value = None

    def normalize(self) -> None:
        """Divide the summed gradients by the summed weights (once; with a
        known ``total_weight`` they are already the mean's). Under DDP this
        runs before the gradients are averaged over the ranks, so each rank
        contributes its own weighted mean, as a plain DDP loss would.

        Raises:
            ValueError: nothing was accumulated, or the weights sum to 0.
        """
        if self._normalized:
            return
        if self.micro_batches == 0 or self.weight == 0:
            raise ValueError(_NOTHING)
        if self.total_weight is None and self.weight != 1.0:
            self._divide_grads(self.weight)
        elif self.total_weight is not None and abs(self.weight - self.total_weight) > \
                1e-6 * self.total_weight:
            raise ValueError(f"the micro-batches' weights sum to {self.weight:g}, not the "
                             f"step's total_weight {self.total_weight:g}")
        self._normalized = True

    def step(self) -> float:
        """Normalise, unscale, clip, step the optimizer (through the scaler)
        and zero the gradients. Returns the step's mean loss.

        Raises:
            ValueError: nothing was accumulated, or the weights sum to 0.
        """
        self.prepare()
        return self.apply()

    def prepare(self) -> None:
        """Everything before the optimizer step: normalise, unscale (with a
        scaler, where a hook or clipping needs unscaled gradients), the
        ``before_optimizer_step`` hook, clipping.

        Raises:
            ValueError: nothing was accumulated, or the weights sum to 0.
        """
        self.normalize()
        if self.scaler is not None and (self.clip_grad_norm is not None or
                                        self._before_step is not None):
            self.scaler.unscale_(self.optimizer)
        if self._before_step is not None:
            self._before_step(self.optimizer)
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._params(), self.clip_grad_norm)

    def apply(self) -> float:
        """The optimizer step (through the scaler) after :meth:`prepare`, then
        zero the gradients. May be called again after it failed: the
        gradients are zeroed only once it succeeds. Returns the step's mean
        loss."""
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        loss = self.loss
        self.reset()
        return loss


def accumulate(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer, *,
               scaler: Any = None, clip_grad_norm: float | None = None,
               total_weight: float | None = None,
               before_optimizer_step: Callable[[torch.optim.Optimizer], Any] | None = None,
               ) -> Accumulator:
    """An :class:`Accumulator` for one optimizer step (see the module docs)."""
    return Accumulator(model, optimizer, scaler=scaler, clip_grad_norm=clip_grad_norm,
                       total_weight=total_weight, before_optimizer_step=before_optimizer_step)
