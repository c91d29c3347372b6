"""PyTorch Lightning integration: one callback, and a mixin for run-time
micro-batching.

::

    from memguard.integrations.lightning import MemGuardCallback, MemGuardModule

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
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone package
    from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]

from memguard._common import MiB
from memguard.train.batch import batch_size
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


class MemGuardCallback(Callback):
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
        self.log_every_n_steps = log_every_n_steps
        self._pending: dict | None = None

    # -- lifecycle -----------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.guard.install()
        self.guard.boundary.overruns.where = lambda: _stage(trainer)
        if self._pending is not None:
            _resume(self.guard, self._pending)
            self._pending = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # the strategy has wrapped the module by now (DDP): the guard's ranks
        # agree through it and its no_sync()
        model = trainer.strategy.model
        self.guard.model = model if model is not pl_module else None

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # a fit that raises (Ctrl-C, a bad batch, a failed resume, a pruned
        # trial) skips teardown: the next fit in the process needs the guard gone
        self._end()

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
        from memguard.telemetry.workers import workers_metrics

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
        pl_module.log_dict(self.metrics(), on_step=True, on_epoch=False, logger=True,
                           prog_bar=False, batch_size=1)


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

    Override :meth:`memguard_post_step` to act once per batch on the
    concatenated ``aux`` of the micro-batches (EMA, queues, centering).
    Without a :class:`MemGuardCallback` a guard with the default budget is
    made at the first step.
    """

    memguard_clip_grad_norm: float | None = None
    memguard_restore: tuple[str, ...] = ()

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        # the class's own training_step, or the one it inherits (a
        # MemGuardModule mixed into an existing LightningModule subclass)
        user = getattr(cls, "training_step", None)
        if user is not None and not getattr(user, "_memguard_wrapped", False):
            cls._memguard_user_step = user
            cls.training_step = _guarded_training_step

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
                model = self.trainer.strategy.model
                guard.model = model if model is not self else None
                guard.install()
                self.__dict__["_memguard_own"] = guard
                self.trainer.callbacks.append(_EndOwnGuard(self))
        return guard


class _EndOwnGuard(Callback):
    """Ends the guard a MemGuardModule made for itself (no MemGuardCallback)
    with the run, however the run ends."""

    def __init__(self, module: Any) -> None:
        self.module = module

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


class _LogCollector:
    """``self.log`` calls inside the micro-batches, to be logged once."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, Any, dict, float]] = []   # (call, name, value, kw, w)
        self.call = 0

    def values(self, n_micro: int) -> dict[str, tuple[Any, dict]]:
        """Each name's weighted mean over the successful attempt's calls
        (the last ``n_micro`` training_step calls)."""
        first = self.call - n_micro
        acc: dict[str, list] = {}
        for call, name, value, kw, w in self.calls:
            if call < first:
                continue
            acc.setdefault(name, []).append((value, kw, w))
        out = {}
        for name, items in acc.items():
            kw = items[-1][1]
            tensors = [v for v, _, _ in items]
            if all(isinstance(v, (torch.Tensor, int, float)) for v in tensors):
                total = sum(w for _, _, w in items) or 1.0
                mean = sum(torch.as_tensor(v, dtype=torch.float64).detach() * w
                           for v, _, w in items) / total
                out[name] = (mean.float(), kw)
            else:
                out[name] = (tensors[-1], kw)
        return out


def _guarded_training_step(self: Any, batch: Any, batch_idx: int, *args: Any,
                           **kwargs: Any) -> Any:
    guard = self.memguard
    user = type(self)._memguard_user_step
    opt = self.optimizers()
    if isinstance(opt, list):
        raise TypeError("MemGuardModule steps one optimizer; configure_optimizers returned "
                        f"{len(opt)}")
    ddp = guard.model
    if ddp is not None and hasattr(ddp, "require_backward_grad_sync"):
        # this step runs inside DDP's forward: keep DDP from preparing a
        # synchronising backward after it; memguard synchronises the gradients
        ddp.require_backward_grad_sync = False
    logs = _LogCollector()
    real_log = self.log

    def log(name: str, value: Any, *a: Any, **kw: Any) -> None:
        if a:
            raise TypeError("inside a MemGuardModule's training_step, pass self.log's options "
                            "by keyword")
        logs.calls.append((logs.call, name, value, kw, 1.0))   # weighed on return

    def loss_fn(micro: Any) -> Any:
        first = len(logs.calls)
        self.log = log
        try:
            out = user(self, micro, batch_idx, *args, **kwargs)
        finally:
            del self.log
            logs.call += 1
        if out is None:                  # Lightning's way to skip a batch
            raise SkipStep("training_step returned None")
        if isinstance(out, dict) and "loss" not in out:
            raise ValueError("training_step returned a dict without 'loss'")
        # the micro-batch's logs weigh what its loss does: the weight the
        # step returned, else its samples
        w = unpack(out)[1]
        w = float(w) if w is not None else float(batch_size(micro))
        logs.calls[first:] = [(c, n, v, kw, w) for c, n, v, kw, _ in logs.calls[first:]]
        return out

    restore = [getattr(self, name) for name in self.memguard_restore]
    try:
        res = guard.step(batch, loss_fn, opt, restore=restore, backward=self.manual_backward,
                         post_step=self.memguard_post_step)
    except SkipStep:                     # rolled back, on every rank alike
        return None
    n = batch_size(batch)
    for name, (value, kw) in logs.values(res.n_micro).items():
        real_log(name, value, **{"batch_size": n, **kw})
    _step_schedulers(self, "step")
    return torch.tensor(res.loss)


_guarded_training_step._memguard_wrapped = True  # type: ignore[attr-defined]
