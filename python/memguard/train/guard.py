"""The run-time batch throttle: :class:`Guard` and :meth:`Guard.step`.

::

    guard = memguard.Guard(budget="auto")
    with guard:                                   # sampler, gc hooks, allocator
        for batch in loader:
            res = guard.step(batch, loss_fn, optimizer)

``guard.step`` splits each batch into micro-batches of the size the planner
(memguard's C state machine) chose for this step, accumulates their
gradients weighted by their share of the step, and steps the optimizer once:
the effective batch, the learning-rate schedule and the data order stay the
script's. An out-of-memory error inside the step redoes the step from its
first micro-batch at a smaller size, with gradients zeroed, listed buffers
and the RNG restored, and memory released first; nothing of the failed
attempt survives.

A guard is its parts, each in its own module: :class:`~memguard.train.config.GuardConfig`
(the options), :class:`~memguard.memory.room.Room` (the live budget and the
arena following it), :class:`~memguard.train.signals.Signals` (the sampler,
the exporter, the CUDA governor), :class:`~memguard.train.plan.Plan` (the
planner and its escalation), :class:`~memguard.memory.gc_hooks.GcHooks`, and
:class:`~memguard.train.boundary.Boundary`, which has them act between steps
in order; the step itself is a :class:`~memguard.train.step.Transaction`.
:meth:`Guard.infer` plans apart (:class:`~memguard.train.inference.InferencePlan`).
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch

from memguard._common import each
from memguard.memory import arena
from memguard.memory.gc_hooks import GcHooks
from memguard.memory.room import Room
from memguard.telemetry.events import Event
from memguard.train import batch as _batch
from memguard.train.boundary import Boundary
from memguard.train.config import GuardConfig
from memguard.train.distributed import Peers
from memguard.train.engines import check_supported
from memguard.train.inference import InferencePlan, infer
from memguard.train.interrupts import held
from memguard.train.plan import Plan
from memguard.train.signals import Signals
from memguard.train.state import GuardState
from memguard.train.step import GuardOOMError, Output, StepArgs, StepResult, Transaction  # noqa: F401
from memguard.train.transaction import Need

log = logging.getLogger("memguard")

#: Guard(budget=...) when none is given: the "budget" option (MEMGUARD_BUDGET,
#: "auto" unless set)
_OPTION = object()

_active_lock = threading.Lock()   # guards _active
_active: Guard | None = None      # the installed guard of this process


class _OneLoop:
    """A guard serves one training loop: a step or an inference from a
    second thread, while one runs, would interleave two transactions over
    one planner and one model. Refused, naming the thread that runs.

    Each step or inference under way is an entry, held weakly, and counted
    only while the call that made it is on its thread's stack: no interrupt,
    wherever it lands (even in ``__exit__``, before it could deregister, or
    with its traceback kept), can leave the loop taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()      # guards _entries
        self._entries: weakref.WeakSet[_Entry] = weakref.WeakSet()

    def enter(self, what: str) -> _Entry:
        return _Entry(self, what, sys._getframe(1))

    def _add(self, entry: _Entry) -> None:
        me = threading.current_thread()
        with held(), self._lock:          # an interrupt in `with lock:` can skip its __exit__
            live = [e for e in self._entries if e.running()]
            other = next((e.thread for e in live if e.thread is not me), None)
            if other is not None:
                raise RuntimeError(
                    f"Guard.{entry.what}() was called from thread {me.name!r} while thread "
                    f"{other.name!r} runs a step of the same guard: a guard serves one "
                    f"training loop; call it from one thread, or give each loop its own process")
            if entry.what == "step" and live:
                raise RuntimeError("Guard.step() was called from inside a step of the same "
                                   "guard (from loss_fn or a hook): steps do not nest")
            self._entries.add(entry)

    def _drop(self, entry: _Entry) -> None:
        with self._lock:
            self._entries.discard(entry)


class _Entry:
    """One step or inference under way (see :class:`_OneLoop`)."""

    def __init__(self, loop: _OneLoop, what: str, frame: Any) -> None:
        self.loop, self.what, self.frame = loop, what, frame
        self.thread = threading.current_thread()

    def running(self) -> bool:
        """Whether the call that made this entry is still on its thread's stack."""
        if self.thread is threading.current_thread():
            top = sys._getframe()
        else:
            top = sys._current_frames().get(self.thread.ident)
        while top is not None:
            if top is self.frame:
                return True
            top = top.f_back
        return False

    def __enter__(self) -> None:
        self.loop._add(self)

    def __exit__(self, *exc: object) -> None:
        self.loop._drop(self)


class Guard:
    """Keeps training steps inside the memory the process can have by
    splitting batches.

    Args:
        budget: ``"auto"`` (what the process can have now, followed live),
            a size (``"12GiB"``), a share of RAM (``"75%"``), bytes, or
            ``None`` (no budget); by default the ``budget`` option.
        micro_batch: ``"auto"`` or a fixed starting size.
        model: the module trained, for ``no_sync()`` under DDP.
        **options: the other options (``tensor_budget``, ``min_micro_batch``,
            ...), documented in :class:`~memguard.train.config.GuardConfig`.

    Raises:
        ValueError: a bad budget, size or constraint, naming the value.
        TypeError: an option that does not exist.
    """

    def __init__(self, budget: Any = _OPTION, micro_batch: str | int = "auto", *,
                 model: torch.nn.Module | None = None, **options: Any) -> None:
        if budget is _OPTION:
            budget = GuardConfig.default_budget()
        #: the options, checked
        self.config = GuardConfig(budget=budget, micro_batch=micro_batch, **options)
        c = self.config
        self.budget = c.budget
        self.model = model
        self.on_critical = c.on_critical
        #: the live budget and the arena following it
        self.room = Room(budget=c.user_budget_bytes, tensor_budget=c.tensor_budget_bytes,
                         live=c.budget is not None)
        self.gc = GcHooks(min_interval_s=c.gc_interval_s)
        self.signals = Signals(c, on_high=lambda: self.gc.relieve(
            "high", arena_keep=self.boundary.cache_keep()))
        self.gc.on_event = self.signals.event
        self.planner = Plan(c, self.signals.event, lambda: self.on_critical and self.on_critical(self))
        self.boundary = Boundary(self.room, self.signals, self.planner, self.gc, c)
        self.inference = InferencePlan(self.planner.opts)   # infer's own plan: apart
        self._peers: Peers | None = None
        self._peers_checked = False
        self._warned: set[str] = set()   # what was warned about once (buffers, a remainder, fp16 on the CPU)
        self.update_need = Need()        # what each optimizer's updates allocate, learnt
        self._loop = _OneLoop()
        self.installed = False
        self.allocator_error: str | None = None
        #: counters over the run
        self.steps = 0
        self.ooms_recovered = 0
        self.peak_bytes = 0
        self.last: StepResult | None = None

    # -- lifecycle ---------------------------------------------------------------
    def install(self) -> Guard:
        """Route tensor memory to memguard's allocator with the budget where
        it can be, and start the sampler, the CUDA governor where CUDA is in
        use, and gc hooks. Idempotent; a failure leaves nothing installed.

        Raises:
            RuntimeError: another guard is installed in this process (guards
                do not nest: a process has one allocator and one budget).
            ValueError: the budget is below what the process holds already.
        """
        global _active
        if self.installed:
            return self
        with _active_lock:
            if _active is not None:
                raise RuntimeError(
                    "another memguard.Guard is installed in this process: uninstall it "
                    "first, or step with that one (a process has one allocator and one "
                    "budget, so guards do not nest)")
            _active = self
        self.installed = self.boundary.active = True   # from here, uninstall() undoes it
        try:
            if self.config.allocator and "torch" in sys.modules:
                self.allocator_error = self.room.install_arena(self.signals.latest_sample())
            self.boundary.overruns.start()
            self.signals.install(self.room.budget, live=self.budget is not None)
            self.gc.install()
        except BaseException:
            self.uninstall()
            raise
        last = self.room.last
        self.signals.event(Event.INSTALL, budget_bytes=self.budget_bytes,
                           room=last.to_dict() if last else None, allocator=arena.installed(),
                           allocator_error=self.allocator_error)
        return self

    def uninstall(self) -> None:
        """Stop the gc hooks, the governor and the sampler; give tensors back
        to the system allocator if :meth:`install` routed them, with the
        arena's budget as before; every part, even when one raises (the
        first error raised after), the guard unregistered last. Idempotent."""
        global _active
        if not self.installed:
            return
        self.installed = self.boundary.active = False
        try:
            each(self.boundary.overruns.stop, self.gc.uninstall, self.signals.uninstall,
                 self.room.uninstall_arena)
        finally:
            with _active_lock:
                if _active is self:
                    _active = None

    def __enter__(self) -> Guard:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # -- what it plans against ------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        """The process's budget now: the live budget at the last step
        boundary (at install before the first step), capped by the budget
        given; 0 without a budget."""
        if self.budget is None:
            return 0
        if self.room.last is not None and self.room.last.budget_bytes:
            return self.room.last.budget_bytes
        return int(self.room.budget or 0)

    @property
    def sampler(self) -> Any:
        """The telemetry sampler in use (``None`` before :meth:`install`)."""
        return self.signals.sampler

    @property
    def cuda_governor(self) -> Any:
        """The device governor in use: the CUDA one (``None`` until CUDA is),
        or the MPS one given as ``mps=``."""
        return self.signals.governor

    @property
    def checkpoints(self) -> Any:
        """The blocks that may be checkpointed (``None``: none given)."""
        return self.planner.checkpoints

    @property
    def micro_batch(self) -> int:
        """The steps' planned micro-batch size (0 before the first with "auto"; infer's apart)."""
        return self.planner.micro

    def plan(self) -> dict[str, Any]:
        """The planner's state and its last decision with the reason."""
        return self.planner.state()

    @property
    def micro_batch_changes(self) -> int:
        """Decisions that changed the size, OOM redos included."""
        return self.planner.changes

    @property
    def peak_source(self) -> str:
        """Where peaks come from: "arena", "cuda", "rss", "footprint", "none"."""
        return self.boundary.peak.source

    # -- the step ---------------------------------------------------------------------
    def step(self, batch: Any, loss_fn: Callable[[Any], Any], optimizer: torch.optim.Optimizer,
             scaler: Any = None, clip_grad_norm: float | None = None,
             post_step: Callable[[Any], Any] | None = None, restore: Any = (),
             embed_fn: Callable[[Any], Any] | None = None,
             backward: Callable[[torch.Tensor], Any] | None = None,
             pre_step: Callable[[], Any] | None = None,
             before_optimizer_step: Callable[[torch.optim.Optimizer], Any] | None = None,
             ) -> StepResult:
        """One optimizer step over ``batch``, micro-batched as planned, as a
        transaction: whatever ends it (an out-of-memory error anywhere,
        ``optimizer.step()`` included; any exception; ``KeyboardInterrupt``),
        the model, gradients, ``restore`` buffers, optimizer state, AMP
        scaler and RNG are the committed step's or what they were before.

        Args:
            batch: a tensor or a nest of tuples/lists/dicts of tensors (and
                lists of per-sample values), split along dim 0.
            loss_fn: ``loss_fn(micro)`` returns the micro-batch's mean loss,
                ``(loss, weight)``, or an :class:`Output` with ``aux``.
            optimizer: stepped once, gradients zeroed after.
            scaler: a ``torch.amp.GradScaler`` for float16 AMP.
            clip_grad_norm: clip the total gradient norm (after unscaling).
            post_step: called once after the commit with the concatenated
                ``aux`` (EMA, queue updates, centering).
            restore: modules (their buffers), tensors or objects with
                ``state_dict`` that the step changes, restored when it is
                redone or rolled back.
            embed_fn: GradCache for losses that need the whole batch:
                ``embed_fn(micro)`` embeds without a graph, ``loss_fn`` then
                takes all the embeddings (see :mod:`memguard.train.gradcache`).
            backward: runs each backward in place of ``loss.backward()``
                (Lightning's ``manual_backward``).
            pre_step: called once before the first micro-batch, not again
                when the step is redone (a MoCo momentum update).
            before_optimizer_step: ``before_optimizer_step(optimizer)`` once
                the gradients are the whole batch's and unscaled.

        Returns:
            A :class:`StepResult`.

        Raises:
            GuardOOMError: out of memory at the smallest allowed size.
            memguard.NonFiniteLossError: a NaN or infinite loss (without a
                scaler): the step was not taken.
            memguard.OptimizerOOMError: the optimizer step ran out of memory
                also after memory was relieved.
            memguard.PostStepError: ``post_step`` failed after the commit.
        """
        with self._loop.enter("step"):
            n = _batch.checked_size(batch)
            args = StepArgs(batch, n, loss_fn, optimizer, scaler, clip_grad_norm, post_step,
                            restore, embed_fn, backward, pre_step, before_optimizer_step)
            peers = self._peers_for_step()
            micro, begun = self.boundary.begin(batch, n, peers, self.steps, self.budget_bytes)
            return Transaction(self, args, micro, begun, peers, self._warned).run()

    def _peers_for_step(self) -> Peers | None:
        """The ranks to agree with, looked up at the first step (the model's engine checked)."""
        if not self._peers_checked:
            c = self.config
            check_supported(self.model)
            self._peers = Peers.detect(self.model, c.process_group, c.ddp_overlap)
            self._peers_checked = True
        return self._peers

    # -- evaluation -----------------------------------------------------------------
    @contextlib.contextmanager
    def evaluate(self) -> Iterator[Guard]:
        """Run a validation loop under ``no_grad``, micro-batched by
        :meth:`infer`; memory is released when it ends."""
        with torch.no_grad(), contextlib.ExitStack() as stack:
            stack.callback(self.release)
            yield self

    def release(self) -> None:
        """An evaluation loop's end: overruns reported, memory released."""
        self.boundary.overruns.check()
        self.gc.relieve("evaluate", force=True)

    def infer(self, batch: Any, fn: Callable[[Any], Any], *, combine: Any = None) -> Any:
        """``fn`` over ``batch`` in micro-batches of inference's own plan, smaller when memory
        is short (:mod:`memguard.train.inference`); outputs joined (:mod:`.outputs`).

        Raises:
            GuardOOMError: the machine out of memory at the smallest allowed size.
            TypeError: an output leaf neither per-sample nor ruled by ``combine``.
        """
        with self._loop.enter("infer"):
            return infer(self, batch, fn, combine)

    # -- resuming and reporting ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on where this one stopped: the
        planned micro-batch, the checkpointed blocks and the counters (not infer's plan)."""
        return GuardState.of(self).to_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the planner starts at the saved
        micro-batch (growth then waits for calm steps as usual). The state is
        checked whole first; one of another version, or not a mapping, is
        skipped with a warning and the guard keeps its own.

        Raises:
            ValueError: a field missing, unknown or out of range, naming it
                and its value; nothing of the guard changed.
        """
        s = GuardState.read(state)
        if s is None:
            return
        self.planner.restart_at(s.micro_batch)
        if self.checkpoints is not None:
            self.checkpoints.set(s.checkpointed_blocks)      # clamped to the blocks there are
        self.steps, self.ooms_recovered, self.peak_bytes = s.steps, s.ooms_recovered, s.peak_bytes
        self.planner.changes = s.micro_batch_changes

    def summary(self) -> dict[str, Any]:
        """Counters of the run so far."""
        ck = self.checkpoints.n_on if self.checkpoints else 0
        return {"steps": self.steps, "micro_batch": self.micro_batch, "micro_batch_changes":
                self.micro_batch_changes, "ooms_recovered": self.ooms_recovered, "peak_bytes":
                self.peak_bytes, "peak_source": self.peak_source, "checkpointed_blocks": ck,
                "budget_bytes": self.budget_bytes, "gc": self.gc.stats.to_dict(), "plan":
                self.plan(), "infer_micro_batch": self.inference.micro, **self.boundary.said(),
                "time": time.time()}

    def postfix(self) -> dict[str, Any]:
        """A short view of the run for a progress bar: ``bar.set_postfix(guard.postfix())``.

        Returns:
            ``{"mem": "1.2/4.0GiB", "micro": 16, "oom": 1}``: memory now (the
            newest sample's RSS, the arena's reserved bytes before the first
            sample, ``?`` without either) over the budget (no ``/budget``
            without one), the planned micro-batch size and the out-of-memory
            errors recovered.
        """
        s = self.sampler.latest() if self.sampler is not None else None
        used = s.rss_bytes if s is not None else None
        if used is None and arena.installed():
            used = int(arena.stats()["reserved_bytes.current"])
        return {"mem": _used_over_budget(used, self.budget_bytes or None),
                "micro": self.micro_batch, "oom": self.ooms_recovered}


def _used_over_budget(used: int | None, budget: int | None) -> str:
    """``1.2/4.0GiB`` (``512/900MiB`` below a GiB; ``?`` when unknown)."""
    gib = max(used or 0, budget or 0) >= 2**30
    scale, unit, digits = (2**30, "GiB", 1) if gib else (2**20, "MiB", 0)
    mem = "?" if used is None else f"{used / scale:.{digits}f}"
    if budget is not None:
        mem += f"/{budget / scale:.{digits}f}"
    return mem if mem == "?" else mem + unit
