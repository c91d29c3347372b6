"""One guarded step as a transaction, in three levels (Composer's
``_train_batch`` / ``_train_microbatches`` / ``_train_microbatch``):

* the step (:meth:`Transaction.run`) attempts, then commits or rolls back:
  whatever ends it, nothing of a step that did not commit survives;
* the attempt (:meth:`Transaction._attempt`) runs the micro-batches at one
  size and knows nothing of retries; an out-of-memory error comes out of it
  as a decision (:meth:`Transaction._redo_after`) to redo the step smaller,
  or to give up;
* the micro-batch (:meth:`Transaction._micro_batch`): one forward and one
  backward.

Under DDP the ranks agree through :meth:`memguard.train.distributed.Peers.vote`,
before any gradient leaves a rank (see :mod:`memguard.train.distributed`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import torch

from memguard.memory import arena
from memguard.memory.oom import is_oom
from memguard.telemetry.events import Event
from memguard.train import amp
from memguard.train import batch as _batch
from memguard.train.accumulation import Accumulator
from memguard.train.distributed import PeerOOM, Peers
from memguard.train.gradcache import gradcache_backward
from memguard.train.interrupts import held
from memguard.train.snapshot import PreStepUndo, Snapshot
from memguard.train.transaction import PostStepError, check_finite, optimizer_step, reset_scaler

if TYPE_CHECKING:
    from memguard.train.guard import Guard

log = logging.getLogger("memguard")

_PEER_SKIPPED = "another rank's loss_fn skipped this batch: every rank skips it"
_PEER_WEIGHTLESS = ("another rank's micro-batch weights sum to 0: it has no weighted mean "
                    "to average with this one's")
_SHARDED_WEIGHTS = ("loss_fn returned a weight under FSDP2, whose backward reduce-scatters "
                    "each micro-batch's gradients before the step's weights are all known: "
                    "return the micro-batch's mean loss without a weight (micro-batches are "
                    "then weighted by their samples), or train under DDP")


@dataclasses.dataclass
class Output:
    """What a ``loss_fn`` may return instead of a bare loss.

    Attributes:
        loss: the micro-batch's mean loss.
        weight: its weight in the step (default: its sample count).
        aux: tensors (or a nest of them) to concatenate over the step's
            micro-batches and hand to ``post_step`` once per step.
    """
    loss: torch.Tensor
    weight: Any = None
    aux: Any = None


@dataclasses.dataclass
class StepResult:
    """What :meth:`memguard.Guard.step` did.

    Attributes:
        loss: the step's mean loss (weighted like the gradients).
        micro_batch: the micro-batch size the step finished at.
        n_micro: how many micro-batches it took.
        retries: attempts redone after an out-of-memory error.
        peak_bytes: the step's peak memory (arena, CUDA or RSS: see
            :attr:`memguard.Guard.peak_source`).
        aux: the concatenated ``aux`` of the micro-batches, or ``None``.
        weight: the step's total weight.
        tried: sizes that ran out of memory in this step.
    """
    loss: float
    micro_batch: int
    n_micro: int
    retries: int
    peak_bytes: int
    aux: Any = None
    weight: float = 0.0
    tried: list[int] = dataclasses.field(default_factory=list)


class SkipStep(Exception):
    """Raised by a ``loss_fn`` to skip the batch (PyTorch Lightning's
    ``training_step`` returning ``None``): the step is rolled back whole, on
    every rank alike under DDP, and the exception goes on to the caller."""


class GuardOOMError(RuntimeError):
    """A step, or an inference (:meth:`memguard.Guard.infer`), ran out of
    memory at every micro-batch size the guard may use.

    Attributes:
        tried: the sizes that ran out of memory, in order.
        inference: whether it was an inference.
    """

    def __init__(self, tried: list[int], min_micro_batch: int, inference: bool = False) -> None:
        self.tried = list(tried)
        self.inference = inference
        sizes = f"({', '.join(map(str, tried))}; min_micro_batch={min_micro_batch})"
        if inference:    # no graph, no gradients: nothing to checkpoint
            advice = ("lower min_micro_batch or raise the budget (an inference runs one "
                      "micro-batch at a time: even the smallest did not fit)")
        else:
            advice = "lower min_micro_batch, raise the budget, or checkpoint activations"
        super().__init__(f"out of memory at every micro-batch size tried for this "
                         f"{'inference' if inference else 'step'} {sizes}: {advice}")


def gave_up(tried: list[int], min_micro_batch: int, cause: BaseException | None,
            inference: bool = False) -> GuardOOMError:
    """The error for a step (or an inference) that ran out of memory at
    every size; where memguard's budget refused the last allocation, a note
    (on it and on its cause) says so."""
    err = GuardOOMError(tried, min_micro_batch, inference)
    if cause is not None and arena.explain(cause):
        err.add_note(cause.__notes__[-1])
    return err


def unpack(out: Any) -> tuple[torch.Tensor, Any, Any]:
    """(loss, weight or None, aux or None) from what a loss_fn returned."""
    if isinstance(out, torch.Tensor):
        return out, None, None
    if isinstance(out, tuple) and not hasattr(out, "_fields") and len(out) == 2:
        return out[0], out[1], None
    if isinstance(out, Mapping) and "loss" in out:
        return out["loss"], out.get("weight"), out.get("aux")
    if hasattr(out, "loss"):
        return out.loss, getattr(out, "weight", None), getattr(out, "aux", None)
    raise TypeError("loss_fn must return a loss tensor, (loss, weight), a mapping with "
                    f"'loss', or an object with .loss (memguard.Output), not {type(out)!r}")


@dataclasses.dataclass
class StepArgs:
    """What :meth:`memguard.Guard.step` was given (see there)."""
    batch: Any
    n: int
    loss_fn: Callable[[Any], Any]
    optimizer: torch.optim.Optimizer
    scaler: Any = None
    clip_grad_norm: float | None = None
    post_step: Callable[[Any], Any] | None = None
    restore: Any = ()
    embed_fn: Callable[[Any], Any] | None = None
    backward: Callable[[torch.Tensor], Any] | None = None
    pre_step: Callable[[], Any] | None = None
    before_optimizer_step: Callable[[torch.optim.Optimizer], Any] | None = None

    def __post_init__(self) -> None:
        if not callable(self.loss_fn):
            raise ValueError(f"loss_fn must be callable, not {self.loss_fn!r}")  # noqa: TRY004 - one error type for every bad argument
        for name in ("post_step", "embed_fn", "backward", "pre_step", "before_optimizer_step"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise ValueError(f"{name} must be callable, not {fn!r}")


@dataclasses.dataclass
class _Redo:
    """Out of memory at ``failed``: redo the step at ``next`` (0: give up,
    ``cause`` the error; ``refused``: another rank cannot do the step). A
    redo keeps no error: its traceback would keep the failed attempt's
    frames, and their tensors, alive into the retry."""
    failed: int
    next: int
    peer: bool
    cause: BaseException | None = None
    refused: BaseException | None = None


class Transaction:
    """One step of a guard (see the module docs)."""

    def __init__(self, guard: Guard, args: StepArgs, micro: int, begun: dict,
                 peers: Peers | None, warned: set[str]) -> None:
        self.g, self.a, self.micro, self.peers = guard, args, micro, peers
        self.begun = begun                 # the boundary's plan, level and budget
        self.warned = warned               # restore buffers warned about, over the run
        self.snapshot: Snapshot | None = None    # taken after pre_step
        self.pre_undo: PreStepUndo | None = None
        self.acc = Accumulator(guard.model, args.optimizer, scaler=args.scaler,
                               clip_grad_norm=args.clip_grad_norm, backward=args.backward,
                               before_optimizer_step=args.before_optimizer_step)
        # under DDP, gradients leave a rank only after every rank said it
        # has not run out of memory: in DDP's last backward (overlap), or
        # in one vote after all backward passes (deferred)
        self.deferred = peers is not None and (not peers.overlap or args.embed_fn is not None)
        self.tried: list[int] = []
        self.aux: list = []
        self._voted = False                # this attempt's gradients may have left the rank
        self._used_anywhere: list[bool] = []
        self._rolled_back = False

    # -- the step ------------------------------------------------------------
    def run(self) -> StepResult:
        """The step: the attempts, which whatever ends rolls the step back;
        then, with signals held (:mod:`memguard.train.interrupts`), the
        commit, its count and ``post_step``. A signal that arrives meanwhile
        is delivered after ``post_step``, and says the step was committed."""
        committed = False
        try:
            self._begin()
            with arena.strict():       # a refusal is recovered here (overruns.py)
                self._attempts()
            with held():
                try:
                    with arena.strict():
                        loss = self._commit()
                except BaseException:
                    self._roll_back()
                    raise
                committed = True
                res = self._record(loss)
                self._post_step(res)
            return res
        except BaseException as exc:
            if committed:
                if not isinstance(exc, PostStepError):
                    exc.add_note(f"memguard: step {self.g.steps - 1} was committed and counted "
                                 f"before this stopped it: do not redo it")
            elif not self._rolled_back:
                with held():
                    self._roll_back()
            raise
        finally:
            arena.strict.close()       # an interrupt may have landed as one opened
            self._forget()

    def _begin(self) -> None:
        """Gradients zeroed (a step owns them), ``pre_step`` run once with
        its writes recorded, then the snapshot a redo restores (so a redo
        keeps what ``pre_step`` did, and a roll back undoes it)."""
        a = self.a
        a.optimizer.zero_grad(set_to_none=True)
        if a.pre_step is not None:
            self.pre_undo = PreStepUndo()
            self.pre_undo.run(a.pre_step)
        self.snapshot = Snapshot(a.restore)

    def _attempts(self) -> None:
        """Attempt until the micro-batches are done (redoing the step
        smaller after an out-of-memory error), and, deferred under DDP,
        all-reduce the gradients."""
        while (redo := self._attempt_or_redo()) is not None:
            self._reset_attempt()          # out of the except block: its frames are gone
            self._redo(redo)
        if self.deferred:
            self.peers.finish(self._used_anywhere)
        if self.acc.micro_batches > 1:
            self._warn_changed_buffers()

    def _record(self, loss: float) -> StepResult:
        """The committed step: the guard counts it, the planner learns its
        peak, and its event records the planner's inputs (a recorded run
        replays through it)."""
        g, begun = self.g, self.begun
        step = g.steps
        g.steps += 1                       # first: the count agrees with the commit
        plan = g.planner.state() if self.tried else begun["plan"]   # the OOM's decision
        peak = g.boundary.end(self.micro, self.a.n, step)  # before the aux is joined: the update's reading holds
        aux = _batch.concat(self.aux) if self.aux else None
        g.peak_bytes = max(g.peak_bytes, peak)
        g.last = StepResult(loss=loss, micro_batch=self.micro, n_micro=self._n_micro,
                            retries=len(self.tried), peak_bytes=peak, aux=aux,
                            weight=self._weight, tried=self.tried)
        g.signals.event(Event.STEP, step=step, micro_batch=self.micro, n_micro=self._n_micro,
                        retries=len(self.tried), peak_bytes=peak, loss=loss,
                        action=plan["action"], reason=plan["reason"], batch=self.a.n,
                        level=begun["level"], planner_budget_bytes=begun["budget"],
                        floor_bytes=g.boundary.floor, timed_s=g.boundary.seconds or None)
        return g.last

    def _post_step(self, res: StepResult) -> None:
        """``post_step`` with the step's aux; an error there says the step
        is done."""
        if self.a.post_step is None:
            return
        try:
            self.a.post_step(res.aux)
        except Exception as exc:   # after the commit: the step is done
            self.g.signals.event(Event.POST_STEP_FAILED, step=self.g.steps - 1, error=repr(exc))
            raise PostStepError(self.g.steps - 1) from exc

    def _commit(self) -> float:
        """The step's update: a finite loss (without a scaler: with one, the
        scaler skips non-finite steps itself), the hook and clipping, then
        the optimizer step as all or nothing. Returns the step's loss.

        The loss is read from the device here, once, after the last
        backward: the check and the result share that read, and the
        update is not waited for (the next step's boundary overlaps it)."""
        acc = self.acc
        self._n_micro, self._weight = acc.micro_batches, acc.weight
        loss = acc.loss
        if acc.scaler is None:
            check_finite(loss)
        acc.prepare()
        return optimizer_step(self.a.optimizer, acc.apply, self._relieve_for_update,
                              need=self.g.update_need, meter=self.g.boundary.peak,
                              scaler=acc.scaler)

    def _relieve_for_update(self) -> None:
        """Room for an optimizer step that is short of it: memguard's own
        record of pre_step's writes goes first, then a relief."""
        if self.pre_undo is not None:
            self.pre_undo.give_up()
        self.g.gc.relieve("optimizer", force=True)

    def _warn_changed_buffers(self) -> None:
        """Once per buffer: a ``restore`` buffer that a split step's forward
        passes changed was updated once per micro-batch, not once per step."""
        for name in self.snapshot.changed():
            if name in self.warned:
                continue
            self.warned.add(name)
            warnings.warn(
                f"memguard: buffer {name} changed during the forward passes of a step split "
                f"into micro-batches, so it was updated once per micro-batch, not once per "
                f"step: move its update to post_step (which gets the step's concatenated aux) "
                f"or pre_step", UserWarning, stacklevel=4)

    def _roll_back(self) -> None:
        """Nothing of the step survives: gradients, restored state, what
        pre_step wrote, the scaler's record of this step, DDP's state."""
        self._rolled_back = True
        self.acc.reset()
        if self.snapshot is not None:
            self.snapshot.restore()
        if self.pre_undo is not None and not self.pre_undo.undo():
            warnings.warn(
                "memguard: the step was rolled back, but what pre_step did was kept: its "
                "record was dropped (memory was short, or pre_step wrote a tensor without a "
                "storage of its own); redoing this batch repeats pre_step", UserWarning,
                stacklevel=5)
        if self.peers is not None:
            self.peers.reset()
        if self.a.scaler is not None:
            reset_scaler(self.a.scaler, self.a.optimizer)

    def _reset_attempt(self) -> None:
        """Before a redo: as at the step's first attempt (pre_step done)."""
        self.acc.reset()
        self.snapshot.restore()
        if self.peers is not None:
            self.peers.reset()

    def _forget(self) -> None:
        """Drop what the step kept for its own use, so that an error (whose
        traceback holds this transaction) keeps none of it alive."""
        self.snapshot = self.pre_undo = None
        self.aux = []

    def _redo(self, redo: _Redo) -> None:
        """Give up, or get ready to redo the step at the smaller size."""
        if redo.refused is not None:
            raise redo.refused
        if not redo.next:
            self.g.signals.event(Event.OOM_GAVE_UP, tried=self.tried, peer=redo.peer)
            raise gave_up(self.tried, self.g.config.min_micro_batch, redo.cause) from redo.cause
        g = self.g
        g.boundary.restart(self.a.batch)
        g.ooms_recovered += 1
        g.planner.changes += 1
        g.signals.event(Event.OOM_RECOVERED, step=g.steps, failed_micro_batch=redo.failed,
                        micro_batch=redo.next, peer=redo.peer, planner_budget_bytes=g.planner.budget)
        log.warning("memguard: step %d ran out of memory at micro-batch %s%s; redoing it at %d",
                    g.steps, redo.failed, " (on another rank)" if redo.peer else "", redo.next)
        self.micro = redo.next

    # -- the attempt -----------------------------------------------------------
    def _attempt_or_redo(self) -> _Redo | None:
        """One attempt at the planned size: ``None`` once its micro-batches
        are done (and, in the deferred mode, agreed); on an out-of-memory
        error here or on another rank, what to redo at.

        Raises:
            what is not an out-of-memory error, and an out-of-memory error
            after this rank's gradients began to leave it (DDP's own
            synchronising backward: the other ranks are in its all-reduces).
        """
        self._voted = False
        try:
            peers = self.peers
            n_micro = len(self.g.config.sizes.of(self.a.n, self.micro))
            with peers.attempt(self.deferred, self._vote_before, n_micro) if peers is not None \
                    else contextlib.nullcontext():
                self.aux = self._attempt()
            if peers is not None:
                peers.attempt_done()
            if self.deferred:
                self._agree_done()
            return None
        except SkipStep:
            if self.peers is not None and not self._voted:   # the others learn it at their vote
                self._voted = True
                self.peers.vote(self.peers.SKIP, 0, deferred=self.deferred)
            raise
        except PeerOOM as exc:
            self.tried.append(self.micro)
            if exc.next:
                self.g.planner.agree(exc.next, failed=exc.failed)
                return _Redo(self.micro, exc.next, True)
            return _Redo(self.micro, 0, True, cause=exc)
        except Exception as exc:
            if not is_oom(exc) or self._voted:
                raise
            self.tried.append(self.micro)
            return self._redo_after(exc)

    def _redo_after(self, exc: BaseException) -> _Redo:
        """This rank ran out of memory: the planner's next size, agreed with
        the other ranks (the smallest; 0 when one gives up)."""
        g = self.g
        g.boundary.follow_now(g.budget_bytes)   # the room may have fallen during the step
        nxt = g.planner.oom(self.micro)
        if self.peers is None:
            return _Redo(self.micro, nxt, False, cause=None if nxt else exc)
        stranded = self.peers.stranded()
        if stranded is not None:           # no vote can reach the others
            self.peers.abort()
            stranded.__cause__ = exc
            return _Redo(self.micro, 0, False, refused=stranded)
        vote = self.peers.vote(self.peers.OOM, nxt, deferred=self.deferred)
        if vote.outcome == "weightless":       # another rank's step cannot be done
            refused = ValueError(_PEER_WEIGHTLESS)
            refused.__cause__ = exc
            return _Redo(self.micro, 0, False, refused=refused)
        if vote.outcome == "skip":
            return _Redo(self.micro, 0, False, refused=SkipStep(_PEER_SKIPPED))
        if vote.next and vote.next != nxt:
            g.planner.agree(vote.next)
        return _Redo(self.micro, vote.next, False, cause=None if vote.next else exc)

    def _attempt(self) -> list:
        """The micro-batches at the planned size: their aux, detached."""
        a = self.a
        sizes = self._sizes()
        if a.embed_fn is not None:
            loss, emb = gradcache_backward(a.batch, a.n, self.micro, a.embed_fn, a.loss_fn,
                                           a.scaler, model=None if self.deferred
                                           else self.g.model, sizes=sizes)
            if "amp" not in self.warned:
                self._check_amp(None, stacklevel=6)
            self.acc.add_whole_batch(loss, len(sizes.of(a.n, self.micro)))
            return [emb]
        # Sample weights are known up front: scale each loss by its share at
        # once, so one micro-batch of the whole batch is the plain step.
        self.acc.total_weight = float(a.n)
        self._caller_weights: bool | None = None
        items = _batch.split(a.batch, a.n, self.micro, sizes)
        auxes: list = []
        for i, micro_batch in enumerate(self.acc.iterate(items)):
            aux = self._micro_batch(micro_batch, last=i == len(items) - 1)
            if aux is not None:
                auxes.append(_batch.detach(aux))
        return auxes

    def _sizes(self) -> _batch.Sizes:
        """The guard's constraints on micro-batches; a split whose last
        micro-batch had to take a remainder that breaks them (the batch
        itself breaks them) is warned about once."""
        sizes = self.g.config.sizes
        parts = sizes.of(self.a.n, self.micro)
        if len(parts) > 1 and parts[-1] != self.micro and not sizes.valid(parts[-1]) \
                and "remainder" not in self.warned:
            self.warned.add("remainder")
            warnings.warn(
                f"memguard: a batch of {self.a.n} split at {self.micro} leaves a remainder "
                f"that makes no micro-batch of its own under multiple_of="
                f"{sizes.multiple_of}, divisor_of={sizes.divisor_of}, min_micro_batch="
                f"{sizes.least}: the last micro-batch takes it ({parts[-1]} samples), as "
                f"the whole batch would", UserWarning, stacklevel=6)
        return sizes

    def _check_amp(self, loss: Any, stacklevel: int) -> None:
        """Once per guard, on its first step's first micro-batch (before its
        backward, while its graph is there): a warning where the step uses
        float16 autocast or a GradScaler with every parameter on the CPU
        (:mod:`memguard.train.amp`). ``stacklevel`` counts the frames from
        this method's caller to the caller of :meth:`Guard.step`, whose line
        the warning names."""
        self.warned.add("amp")
        amp.warn_cpu_fp16(loss, self.a.scaler, self.a.optimizer, stacklevel=stacklevel + 1)

    def _agree_done(self, weightless: ValueError | None = None) -> None:
        """The ranks agree before gradients leave this one; a rank whose
        weights sum to 0 (``weightless``, its error) makes every rank raise,
        instead of leaving the others waiting."""
        if self.deferred:
            try:
                self.acc.normalize()           # each rank's weighted mean, then the average
            except ValueError as exc:
                weightless = exc
        used = self.peers.prepare(self.deferred)
        self._voted = True
        vote = self.peers.vote(self.peers.WEIGHTLESS if weightless else self.peers.OK,
                               self.micro, used or None, deferred=self.deferred)
        if vote.outcome != "ok":
            self._raise_for(vote, weightless)
        self._used_anywhere = vote.used_anywhere

    def _vote_before(self, collective: str) -> None:
        """Armed: before each collective of the attempt, the ranks vote,
        and what another rank voted (an out-of-memory error, a skipped
        batch) is raised here, as at the step's own vote."""
        vote = self.peers.vote(self.peers.OK, self.micro, deferred=self.deferred)
        if vote.outcome != "ok":
            self._voted = True             # this rank has voted what ends the attempt
            self._raise_for(vote)

    def _raise_for(self, vote: Any, weightless: ValueError | None = None) -> None:
        """What a vote other than "ok" makes every rank raise."""
        if vote.outcome == "oom":
            raise PeerOOM(vote.next, self.micro)
        self.peers.reset()
        if vote.outcome == "skip":
            raise SkipStep(_PEER_SKIPPED)
        raise weightless or ValueError(_PEER_WEIGHTLESS)

    # -- the micro-batch -------------------------------------------------------
    def _micro_batch(self, micro_batch: Any, last: bool) -> Any:
        """One forward and backward, its loss weighted by its share; its aux.
        Before the last backward with DDP synchronising it (overlap), the
        ranks agree, the rank's caller weights all known."""
        loss, weight, aux = unpack(self.a.loss_fn(micro_batch))
        caller = weight is not None
        if self._caller_weights is None:
            self._caller_weights = caller
            if caller:
                self.acc.total_weight = None
        elif self._caller_weights != caller:
            raise ValueError("loss_fn returned a weight for some micro-batches and not "
                             "for others")
        if caller and self.peers is not None and self.peers.sharded:
            raise ValueError(_SHARDED_WEIGHTS)
        if weight is None:
            weight = _batch.batch_size(micro_batch)
        if "amp" not in self.warned:
            self._check_amp(loss, stacklevel=7)
        if last and self.peers is not None and not self.deferred:
            # DDP averages in this backward: the rank's weighted mean must
            # be complete when it ends, its caller's weights all known now
            try:
                self.acc.close_weights(weight)
            except ValueError as exc:
                self._agree_done(exc)          # raises on every rank
                raise
            self._agree_done()
        self.acc.backward(loss, weight)
        return aux
