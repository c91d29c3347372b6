"""PyTorch Lightning integration: one callback, and a mixin for run-time
micro-batching.

::

    from memguard.lightning import MemGuardCallback, MemGuardModule

    class Model(MemGuardModule, L.LightningModule):   # the mixin first
        def training_step(self, batch, batch_idx):     # unchanged
            loss = ...
            self.log("train_loss", loss)
            return loss

    trainer = L.Trainer(callbacks=[MemGuardCallback(budget="12GiB")])

:class:`MemGuardCallback` installs a :class:`memguard.Guard` on ``setup``
(telemetry sampler, gc hooks, memguard's allocator with the budget), logs
memory against budget, the pressure level, the micro-batch, OOMs recovered
and gc time through the trainer's loggers, and keeps the guard's state in
Lightning checkpoints.

Lightning cannot resume a step after an exception in ``training_step`` and
forbids its own gradient accumulation under manual optimization, so
:class:`MemGuardModule` turns manual optimization on and runs each batch
through :meth:`Guard.step`: the class's own ``training_step`` (written as
for automatic optimization: it returns the loss, a dict with ``"loss"`` and
optionally ``"weight"`` and ``"aux"``, or a :class:`memguard.Output`) runs
once per micro-batch, backward goes through ``manual_backward`` (so the
precision plugin scales it), the optimizer steps through Lightning (so the
global step, ``16-mixed`` unscaling and ``on_before_optimizer_step`` hooks
run), learning-rate schedulers step at their configured interval, and values
logged with ``self.log`` inside ``training_step`` are logged once per batch,
averaged over the micro-batches with their weights. An out-of-memory error
inside the step redoes it at a smaller micro-batch; the run goes on. A
``training_step`` that returns ``None`` skips the batch, as in Lightning:
the step is rolled back, on every rank alike under DDP.

The class's ``validation_step``, ``test_step`` and ``predict_step`` (and
Lightning's default ``predict_step``) run through :meth:`Guard.infer` on
the inference plan: micro-batched where memory is short, under the
``no_grad`` or ``inference_mode`` Lightning set, their ``self.log`` values
logged once per batch as the unsplit step logs them (reduced by their
``reduce_fx``, weighted by micro-batch size), and what they return joined
as the unsplit step returns it (``memguard_combine`` sets the rules where
the default does not fit). Memory is released when each validation, test
or predict loop ends, with or without ``fit``.
"""
from __future__ import annotations

import dataclasses
import numbers
import warnings
from collections.abc import Mapping
from typing import Any, Callable, ClassVar

import torch

try:
    from lightning.pytorch import LightningModule
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone package
    from pytorch_lightning import LightningModule  # type: ignore[no-redef]
    from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]

from memguard._common import MiB
from memguard.telemetry import workers_metrics
from memguard.train import outputs
from memguard.train.batch import batch_size
from memguard.train.engines import check_supported
from memguard.train.guard import Guard
from memguard.train.step import SkipStep, unpack

__all__ = ["MemGuardCallback", "MemGuardModule"]



def _stage(trainer: Any) -> str | None:
    """Where a Lightning run is, in words ("in Lightning's validate stage")."""
    stage = getattr(getattr(trainer, "state", None), "stage", None)
    return None if stage is None else f"in Lightning's {getattr(stage, 'value', stage)} stage"


def _resume(guard: Guard, state: Any) -> None:
    """Load a checkpoint's guard state. memguard must not stop a resume that
    would run without it: a damaged state is warned about and skipped, and
    the guard starts fresh (as for a state of another version)."""
    try:
        guard.load_state_dict(state)
    except ValueError as e:
        warnings.warn(f"memguard: the checkpoint's guard state was not loaded ({e}); the "
                      f"guard starts fresh", UserWarning, stacklevel=3)


def _guard_of(trainer: Any) -> Guard | None:
    for cb in trainer.callbacks:
        if isinstance(cb, MemGuardCallback):
            return cb.guard
    return None


def _attach(guard: Guard, trainer: Any) -> None:
    """The model the guard steps: the strategy's, set up by now. Under DDP
    (``ddp``, ``ddp_spawn``) its wrapper, through which the ranks agree and
    the gradients are synchronised; under ``ModelParallelStrategy`` (FSDP2's
    ``fully_shard`` applied in ``configure_model``) and on one device, the
    LightningModule itself. An engine memguard's step cannot run
    (``strategy="fsdp"``, FSDP1; tensor or pipeline parallelism) is refused
    here, before the first step.

    Raises:
        memguard.UnsupportedEngine: naming the engine and what to use instead.
    """
    model = trainer.strategy.model
    check_supported(model)
    guard.model = model


def _epoch_length(guard: Guard, trainer: Any) -> None:
    """The drift forecast counts epochs of the trainer's optimizer steps
    (one a batch under the mixin), unless ``steps_per_epoch`` was given."""
    n = trainer.num_training_batches
    drift = guard.boundary.drift
    if guard.config.steps_per_epoch is None and isinstance(n, int) and n > 0:
        drift.steps_per_epoch = max(1, n // max(1, trainer.accumulate_grad_batches))


class _ReleaseAfterLoops(Callback):
    """Releases memory when a validation, test or predict loop ends (the
    sanity check's too), as :meth:`Guard.evaluate` does."""

    def _guard_now(self) -> Guard | None:
        raise NotImplementedError

    def _release(self) -> None:
        guard = self._guard_now()
        if guard is not None and guard.installed:
            guard.release()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._release()

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self._release()

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        self._release()


class MemGuardCallback(_ReleaseAfterLoops):
    """Installs a :class:`memguard.Guard` for the run and logs its telemetry.

    Args:
        budget: the memory budget (``"auto"``, ``"12GiB"``, ``"75%"``, bytes).
        micro_batch: ``"auto"`` or a fixed starting size (see :class:`Guard`).
        log_every_n_steps: log memguard's metrics every this many training
            batches (=the trainer's ``log_every_n_steps``).
        **guard_kwargs: passed to :class:`memguard.Guard` (``min_micro_batch``,
            ``multiple_of``, ``divisor_of``, ``telemetry``, ``checkpoint``,
            ``on_critical``, ``allocator``, ``interval_ms``, ...).

    Raises:
        ValueError: a bad budget or option, naming the value.
    """

    def __init__(self, budget: str | int | None = "auto", micro_batch: str | int = "auto", *,
                 log_every_n_steps: int | None = None, **guard_kwargs: Any) -> None:
        if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int)
                                              or log_every_n_steps < 1):
            raise ValueError(f"log_every_n_steps must be a positive integer, not "
                             f"{log_every_n_steps!r}")
        self.guard = Guard(budget, micro_batch, **guard_kwargs)
        self._args = (budget, micro_batch, guard_kwargs)
        self.log_every_n_steps = log_every_n_steps
        self._pending: dict | None = None

    # -- spawned processes ---------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """What a spawned process gets (``strategy="ddp_spawn"`` pickles the
        trainer and its callbacks): the guard's options and, once it has
        stepped, its state; not the guard (its sampler, locks and allocator
        are this process's), which is made again there."""
        state = self.__dict__.copy()
        guard = state.pop("guard")
        if state["_pending"] is None and guard.steps:
            state["_pending"] = guard.state_dict()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        budget, micro_batch, guard_kwargs = self._args
        self.guard = Guard(budget, micro_batch, **guard_kwargs)

    # -- lifecycle -----------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.guard.install()
        self.guard.boundary.overruns.where = lambda: _stage(trainer)
        if self._pending is not None:
            _resume(self.guard, self._pending)
            self._pending = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        _attach(self.guard, trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        _epoch_length(self.guard, trainer)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        _attach(self.guard, trainer)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        _attach(self.guard, trainer)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        _attach(self.guard, trainer)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # a fit that raises (Ctrl-C, a bad batch, a failed resume, a pruned
        # trial) skips teardown: the next fit in the process needs the guard gone
        self._end()

    def _guard_now(self) -> Guard | None:
        return self.guard

    def _end(self) -> None:
        self.guard.boundary.overruns.where = None
        self.guard.uninstall()

    # -- checkpoints ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.guard.installed:
            _resume(self.guard, state_dict)
        else:
            self._pending = state_dict

    # -- logging -------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """What is logged: memory (the newest sample's RSS, and the arena's
        allocated bytes when it serves tensors) against the budget, in MiB;
        the pressure level (0 OK .. 3 CRITICAL); the micro-batch; OOMs
        recovered; seconds spent in Python's gc; the DataLoader workers
        (child processes) and their memory in MiB."""
        g = self.guard
        out: dict[str, float] = {
            "memguard/micro_batch": float(g.micro_batch),
            "memguard/ooms_recovered": float(g.ooms_recovered),
            "memguard/micro_batch_changes": float(g.micro_batch_changes),
            "memguard/gc_seconds": float(g.gc.stats.gc_seconds),
        }
        if g.budget_bytes:
            out["memguard/budget_mib"] = g.budget_bytes / MiB
        s = g.sampler.latest() if g.sampler is not None else None
        if s is not None:
            out["memguard/pressure_level"] = float(int(s.level))
            if s.rss_bytes is not None:
                out["memguard/rss_mib"] = s.rss_bytes / MiB
            if s.arena_allocated_bytes is not None:
                out["memguard/arena_allocated_mib"] = s.arena_allocated_bytes / MiB
            out.update(workers_metrics(s))   # memguard/workers, memguard/workers_mib
        if g.last is not None:
            out["memguard/step_peak_mib"] = g.last.peak_bytes / MiB
        return out

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        every = self.log_every_n_steps or trainer.log_every_n_steps or 1
        if batch_idx % every:
            return
        pl_module.log_dict(self.metrics(), on_step=True, on_epoch=False,
                           logger=bool(trainer.loggers), prog_bar=False, batch_size=1)

    def epoch_metrics(self) -> dict[str, float]:
        """What each training epoch's end logs: the growth of the memory
        held between steps in MiB an epoch (0 without a rising trend), and,
        once said, the epochs a forecast leaves and the batch the headroom
        names (see :mod:`memguard.train.drift`, :mod:`memguard.train.headroom`)."""
        drift, found = self.guard.boundary.drift, self.guard.boundary.headroom.found
        rate = drift.trend[0] if drift.trend else 0.0
        out = {"memguard/drift_mib_per_epoch": rate * (drift.steps_per_epoch or 0) / MiB,
               "memguard/drift_mib_per_step": rate / MiB}
        if drift.forecast is not None and drift.forecast.get("epochs_left") is not None:
            out["memguard/forecast_epochs_left"] = float(drift.forecast["epochs_left"])
        if drift.forecast is not None:
            out["memguard/forecast_steps_left"] = float(drift.forecast["steps_left"])
        if found is not None:
            out["memguard/headroom_batch"] = float(found["largest_batch"])
        return out

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        pl_module.log_dict(self.epoch_metrics(), on_step=False, on_epoch=True,
                           logger=bool(trainer.loggers), prog_bar=False, batch_size=1)

    def eval_metrics(self, stage: str) -> tuple[dict[str, float], dict[str, float]]:
        """What an evaluation loop logs (``stage``: ``val`` or ``test``),
        over the loop: the smallest micro-batch of the inference plan, and
        the largest RSS, pressure level and DataLoader workers' count and memory."""
        g = self.guard
        smallest = {f"memguard/{stage}_micro_batch": float(g.inference.micro)}
        largest = {f"memguard/{stage}_{k.partition('/')[2]}": v
                   for k, v in self.metrics().items()
                   if k in ("memguard/rss_mib", "memguard/pressure_level", "memguard/workers",
                            "memguard/workers_mib")}
        return smallest, largest

    def _log_eval(self, trainer: Any, pl_module: Any, stage: str) -> None:
        smallest, largest = self.eval_metrics(stage)
        for values, reduce in ((smallest, "min"), (largest, "max")):
            pl_module.log_dict(values, on_step=False, on_epoch=True, reduce_fx=reduce,
                               logger=bool(trainer.loggers), prog_bar=False, batch_size=1)

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if not trainer.sanity_checking:
            self._log_eval(trainer, pl_module, "val")

    def on_test_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        self._log_eval(trainer, pl_module, "test")


class MemGuardModule:
    """Mixin for a ``LightningModule``: each training batch runs through
    :meth:`memguard.Guard.step` (see the module docs). List it before
    ``LightningModule``.

    Class attributes to set:
        memguard_clip_grad_norm: clip the gradients' total norm (after
            unscaling) before each optimizer step (=None: no clipping;
            Lightning's ``gradient_clip_val`` is not available under manual
            optimization).
        memguard_restore: names of attributes (modules or tensors) whose
            state the forward pass changes, restored before a step is redone
            (BatchNorm modules, queues).
        memguard_combine: how a split ``validation_step``, ``test_step`` or
            ``predict_step`` joins its micro-batches' outputs, by step name
            (``{"validation_step": {"correct": "sum"}}``): the ``combine``
            rules of :meth:`memguard.Guard.infer`. Without one, per-sample
            values are concatenated, numbers and 0-d tensors averaged by
            micro-batch size, other values kept where every micro-batch
            returned the same.

    Override :meth:`memguard_post_step` to act once per batch on the
    concatenated ``aux`` of the micro-batches (EMA, queues, centering).
    Without a :class:`MemGuardCallback` a guard with the default budget is
    made at the first step.
    """

    memguard_clip_grad_norm: float | None = None
    memguard_restore: tuple[str, ...] = ()

    memguard_combine: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        # the class's own steps, or the ones it inherits (a MemGuardModule
        # mixed into an existing LightningModule subclass); Lightning's own
        # validation_step and test_step are left alone (they mean "no such
        # loop"), its predict_step (a forward) is guarded too
        steps = dict(getattr(cls, "_memguard_steps", {}))
        for name, guarded in _GUARDED.items():
            user = getattr(cls, name, None)
            if user is None or getattr(user, "_memguard_wrapped", False):
                continue
            if name != "predict_step" and user is getattr(LightningModule, name, None):
                continue
            steps[name] = user
            setattr(cls, name, guarded)
        cls._memguard_steps = steps

    # -- Lightning hooks -----------------------------------------------------
    @property
    def automatic_optimization(self) -> bool:
        return False

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        if value:
            raise ValueError("a MemGuardModule steps its optimizer itself (manual "
                             "optimization); automatic_optimization cannot be turned on")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        super().on_before_optimizer_step(optimizer)  # type: ignore[misc]
        if self.memguard_clip_grad_norm is not None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.memguard_clip_grad_norm)

    def on_train_epoch_end(self) -> None:
        super().on_train_epoch_end()  # type: ignore[misc]
        _step_schedulers(self, "epoch")


    def memguard_post_step(self, aux: Any) -> None:
        """Called once per batch with the micro-batches' ``aux``, concatenated."""

    @property
    def memguard(self) -> Guard:
        """The guard stepping this module."""
        guard = _guard_of(self.trainer)
        if guard is None:
            guard = self.__dict__.get("_memguard_own")
            if guard is None:
                guard = Guard()
                _attach(guard, self.trainer)
                _epoch_length(guard, self.trainer)
                guard.install()
                self.__dict__["_memguard_own"] = guard
                self.trainer.callbacks.append(_EndOwnGuard(self))
        return guard


class _EndOwnGuard(_ReleaseAfterLoops):
    """Ends the guard a MemGuardModule made for itself (no MemGuardCallback)
    with the run, however the run ends."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def _guard_now(self) -> Guard | None:
        return self.module.__dict__.get("_memguard_own")

    def _end(self) -> None:
        guard = self.module.__dict__.pop("_memguard_own", None)
        if guard is not None:
            guard.uninstall()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._end()


def _step_schedulers(module: Any, interval: str) -> None:
    trainer = module.trainer
    for cfg in trainer.lr_scheduler_configs:
        if cfg.interval != interval:
            continue
        count = trainer.global_step if interval == "step" else trainer.current_epoch + 1
        if count % cfg.frequency:
            continue
        if cfg.reduce_on_plateau:
            value = trainer.callback_metrics.get(cfg.monitor)
            if value is not None:
                cfg.scheduler.step(value)
        else:
            cfg.scheduler.step()


_REDUCE = {"mean": "mean", "sum": "sum", "max": "max", "min": "min",
           torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}


class _LogCollector:
    """``self.log`` calls inside a batch's micro-batches, to be logged once
    per batch as the unsplit call would have logged them. A call that
    raised leaves nothing (an out-of-memory error inside it)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, Any, dict, float]] = []   # (call, name, value, kw, w)
        self.call = 0

    def run(self, module: Any, fn: Callable[[], Any], weight: Callable[[Any], float]) -> Any:
        """``fn()`` with ``module.log`` collecting; the calls' values weigh
        ``weight(out)`` where they give no ``batch_size``."""
        first = len(self.calls)

        def log(name: str, value: Any, *a: Any, **kw: Any) -> None:
            if a:
                raise TypeError("inside a MemGuardModule's steps, pass self.log's options by "
                                "keyword")
            self.calls.append((self.call, name, value, kw, 1.0))

        module.log = log
        try:
            out = fn()
        except BaseException:
            del self.calls[first:]
            raise
        finally:
            del module.log
        w = weight(out)
        self.calls[first:] = [(c, n, v, kw, float(kw.get("batch_size", w)))
                              for c, n, v, kw, _ in self.calls[first:]]
        self.call += 1
        return out

    def values(self, n_calls: int) -> dict[str, tuple[Any, dict]]:
        """Each name's value over the last ``n_calls`` calls (the attempt
        that completed), reduced by its ``reduce_fx``: a mean weighted by
        the micro-batches' weights (Lightning's default), a sum, a max or
        a min; values that are not numbers, the last one. A ``batch_size``
        given in the calls is logged as their sum (the whole batch's)."""
        first = self.call - n_calls
        acc: dict[str, list] = {}
        for call, name, value, kw, w in self.calls:
            if call >= first:
                acc.setdefault(name, []).append((value, kw, w))
        return {name: _reduced(items) for name, items in acc.items()}


def _reduced(items: list[tuple[Any, dict, float]]) -> tuple[Any, dict]:
    """One name's logged values over the micro-batches, reduced (see
    :meth:`_LogCollector.values`), and the options to log them with."""
    kw = dict(items[-1][1])
    values = [v for v, _, _ in items]
    if "batch_size" in kw:
        kw["batch_size"] = int(sum(w for _, _, w in items))
    if not all(isinstance(v, (torch.Tensor, int, float)) for v in values):
        return values[-1], kw
    how = _REDUCE.get(kw.get("reduce_fx", "mean"), "mean")
    t = [torch.as_tensor(v, dtype=torch.float64).detach() for v in values]
    if how == "sum":
        return sum(t).float(), kw
    if how in ("max", "min"):
        return (torch.stack(t).amax(0) if how == "max" else torch.stack(t).amin(0)).float(), kw
    total = sum(w for _, _, w in items) or 1.0
    return (sum(v * w for v, (_, _, w) in zip(t, items)) / total).float(), kw


def _log_once(module: Any, logs: _LogCollector, n_calls: int, n: int) -> None:
    """Log what the micro-batches logged, once for the batch of ``n``."""
    for name, (value, kw) in logs.values(n_calls).items():
        module.log(name, value, **{"batch_size": n, **kw})


def _guarded_training_step(self: Any, batch: Any, batch_idx: int, *args: Any,
                           **kwargs: Any) -> Any:
    guard = self.memguard
    user = type(self)._memguard_steps["training_step"]
    opt = self.optimizers()
    if isinstance(opt, list):
        raise TypeError("MemGuardModule steps one optimizer; configure_optimizers returned "
                        f"{len(opt)}")
    ddp = _ddp_of(guard)
    if ddp is not None:
        # DDP's flag as outside no_sync(): with ddp_overlap, the last
        # micro-batch's backward is DDP's own synchronising one
        ddp.require_backward_grad_sync = True
    logs = _LogCollector()

    def loss_fn(micro: Any) -> Any:
        # the micro-batch's logs weigh what its loss does: the weight the
        # step returned, else its samples
        return logs.run(self, lambda: user(self, micro, batch_idx, *args, **kwargs),
                        lambda out: _loss_weight(out, micro))

    restore = [getattr(self, name) for name in self.memguard_restore]
    try:
        res = guard.step(batch, loss_fn, opt, restore=restore, backward=self.manual_backward,
                         post_step=self.memguard_post_step)
    except SkipStep:                     # rolled back, on every rank alike
        return None
    finally:
        if ddp is not None:
            # this step ran inside DDP's forward: keep DDP from preparing a
            # synchronising backward after it (Lightning's own manual
            # optimization does the same; it sets the flag back after)
            ddp.require_backward_grad_sync = False
    _log_once(self, logs, res.n_micro, batch_size(batch))
    _step_schedulers(self, "step")
    return torch.tensor(res.loss)


def _ddp_of(guard: Guard) -> Any:
    """The guard's model where it is DDP-wrapped (it has DDP's gradient-sync
    flag), else ``None``."""
    model = guard.model
    return model if hasattr(model, "require_backward_grad_sync") else None


def _loss_weight(out: Any, micro: Any) -> float:
    """What a micro-batch's logs weigh: the weight its ``training_step``
    returned, else its samples; checks the output as Lightning would."""
    if out is None:                  # Lightning's way to skip a batch
        raise SkipStep("training_step returned None")
    if isinstance(out, dict) and "loss" not in out:
        raise ValueError("training_step returned a dict without 'loss'")
    w = unpack(out)[1]
    return float(w) if w is not None else float(batch_size(micro))


def _guarded_eval_step(name: str) -> Callable[..., Any]:
    """The ``validation_step``, ``test_step`` or ``predict_step`` that runs
    the class's own through :meth:`Guard.infer`."""

    def step(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        user = type(self)._memguard_steps[name]
        logs = _LogCollector()

        def fn(micro: Any) -> Any:
            return logs.run(self, lambda: user(self, micro, *args, **kwargs),
                            lambda out: float(batch_size(micro)))

        combine = self.memguard_combine.get(name, _as_unsplit)
        out = self.memguard.infer(batch, fn, combine=combine)
        if name != "predict_step":           # Lightning refuses self.log in predict
            _log_once(self, logs, logs.call, batch_size(batch))
        return out

    step.__name__ = step.__qualname__ = name
    step._memguard_wrapped = True  # type: ignore[attr-defined]
    return step


def _as_unsplit(values: list, sizes: list[int]) -> Any:
    """The default join of a split evaluation step's outputs: what is one
    value per sample is concatenated (:mod:`memguard.train.outputs`);
    numbers and 0-d tensors are taken for means over the micro-batch's
    samples (as ``self.log`` averages them) and averaged by size; anything
    else (a string) must be the same in every micro-batch."""
    return outputs.join(values, sizes, _rules(values, sizes, "out"))


def _rules(values: list, sizes: list[int], path: str) -> Any:
    """The ``combine`` rules for ``values`` (one per micro-batch) at ``path``."""
    first = values[0]
    if isinstance(first, Mapping) and all(isinstance(v, Mapping) for v in values):
        return {k: _rules([v.get(k) for v in values], sizes, f"{path}[{k!r}]") for k in first}
    if _placewise(values, sizes):
        return [_rules([v[i] for v in values], sizes, f"{path}[{i}]")
                for i in range(len(first))]
    if _is_array(first) and all(_is_array(v) and v.ndim and len(v) == m
                                for v, m in zip(values, sizes)):
        return _concatenate
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return {f.name: _rules([getattr(v, f.name) for v in values], sizes, f"{path}.{f.name}")
                for f in dataclasses.fields(first) if f.init}
    if isinstance(first, (numbers.Number, torch.Tensor)) and not isinstance(first, bool):
        return "mean" if not isinstance(first, torch.Tensor) or first.dim() == 0 else None
    if first is None or isinstance(first, (Mapping, list, tuple)):
        return None                      # outputs.join joins it, or says why not
    return _same(path)


def _placewise(values: list, sizes: list[int]) -> bool:
    """Whether ``values`` are tuples, or lists that are not one value per
    sample, of one length: structure, joined place by place."""
    first = values[0]
    if not isinstance(first, (tuple, list)) or not all(
            type(v) is type(first) and len(v) == len(first) for v in values):
        return False
    return isinstance(first, tuple) or any(len(v) != m for v, m in zip(values, sizes))


def _is_array(x: Any) -> bool:
    return type(x).__module__ == "numpy" and hasattr(x, "ndim")


def _concatenate(values: list, sizes: list[int]) -> Any:
    """NumPy arrays of one row per sample, one after the other."""
    import numpy as np
    return np.concatenate(values)


def _same(path: str) -> Callable[[list, list], Any]:
    """The rule for a value that is not per sample and not a number (a
    string, a flag): the same in every micro-batch, or refused naming it."""

    def rule(values: list, sizes: list[int]) -> Any:
        if any(v != values[0] for v in values[1:]):
            raise TypeError(
                f"{path} is {values[0]!r} in one micro-batch and "
                f"{next(v for v in values if v != values[0])!r} in another: memguard cannot "
                f"tell what the unsplit step would return; return the same value from every "
                f"micro-batch, or set memguard_combine with a rule at {path}'s place")
        return values[0]

    return rule


_guarded_training_step._memguard_wrapped = True  # type: ignore[attr-defined]
#: the steps a MemGuardModule runs through its guard
_GUARDED = {"training_step": _guarded_training_step,
            **{name: _guarded_eval_step(name)
               for name in ("validation_step", "test_step", "predict_step")}}
