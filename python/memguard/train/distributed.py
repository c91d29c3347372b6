"""Micro-batch plans agreed among the ranks of a DDP run.

Under ``torch.distributed`` every rank runs the same plan. :class:`Peers`
carries the two small all-reduces a guarded step needs:

* at the step boundary, the smallest of the ranks' proposed sizes (a rank
  under pressure shrinks every rank);
* once per attempt, an out-of-memory flag with the size to redo the step
  at, agreed before any gradient leaves a rank: a rank that runs out of
  memory stops, says so, and every rank redoes the step at the same smaller
  size. Nobody waits in a collective that a failed rank will never join.

Gradients are synchronised in one of two ways:

* ``overlap=False`` (the default): every micro-batch's backward runs under
  ``no_sync()``, the flag is agreed after the last one, and the averaged
  gradients are all-reduced afterwards: large ones in place, small ones
  copied into buckets (the only memory this mode adds). An out-of-memory
  error anywhere in forward or backward is recovered.
* ``overlap=True``: all micro-batches but the last run under ``no_sync()``;
  the flag is agreed after the last forward and DDP's own synchronising
  backward overlaps communication with computation. An out-of-memory error
  *inside* that backward cannot be recovered (the other ranks are already
  in DDP's all-reduces), and training stops with it.

A model sharded with FSDP2 (``fully_shard``) reduce-scatters every
micro-batch's gradients in its backward, as it does unsplit (accumulating
unsharded gradients would cost the whole model on every rank); the vote
comes after the attempt. Collectives inside an attempt (FSDP2's, or a
loss's all-gather under DDP) are voted before, while memory is tight
(:mod:`memguard.train.collectives`); after an out-of-memory error FSDP2's
per-iteration state is reset (``FSDPModule.reset_iter_state``) before the
step is redone.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from memguard.train import collectives
from memguard.train.collectives import Attempt, StrandedCollective

_BUCKET_BYTES = 25 << 20   # DDP's default bucket size
_IN_PLACE_BYTES = 1 << 20  # gradients this large are all-reduced where they are


def _dist() -> Any:
    import torch.distributed as dist
    return dist


def fsdp2_roots(model: torch.nn.Module | None) -> list[torch.nn.Module]:
    """The outermost FSDP2 (``fully_shard``) modules of ``model``: those
    whose per-iteration state a failed attempt resets."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    if model is None:
        return []
    if isinstance(model, FSDPModule):
        return [model]
    return [r for child in model.children() for r in fsdp2_roots(child)]


@dataclasses.dataclass(frozen=True)
class Vote:
    """What the ranks agreed on in one :meth:`Peers.vote`.

    Attributes:
        outcome: ``"ok"``; ``"oom"`` (a rank ran out of memory: every rank
            redoes the step); ``"weightless"`` (a rank's micro-batch weights
            sum to 0: every rank raises); ``"skip"`` (a rank's loss_fn
            skipped the batch: every rank rolls the step back and skips it).
            The worst one a rank voted wins.
        next: the smallest size a rank proposed (after an out-of-memory
            error: the size to redo the step at; 0: a rank gives up).
        used_anywhere: for each synchronised parameter, whether any rank
            had a gradient for it (deferred mode; else empty).
    """
    outcome: str
    next: int
    used_anywhere: list[bool]


class PeerOOM(Exception):
    """Another rank ran out of memory: the step is redone at ``next``
    (0: a rank is at its smallest size and gives up)."""

    def __init__(self, next_micro: int, failed: int) -> None:
        super().__init__(f"a peer rank ran out of memory at micro-batch {failed}")
        self.next = next_micro
        self.failed = failed


class Peers:
    """The ranks of a process group, agreeing on plans (see module docs).

    Args:
        model: the trained module; a ``DistributedDataParallel`` one has its
            gradients synchronised as described above.
        group: the process group (the model's, or the default one).
        overlap: let DDP's synchronising backward run for the last
            micro-batch (see module docs).
    """

    def __init__(self, model: torch.nn.Module | None, group: Any = None,
                 overlap: bool = False) -> None:
        dist = _dist()
        from torch.nn.parallel import DistributedDataParallel
        self.ddp = model if isinstance(model, DistributedDataParallel) else None
        if group is None and self.ddp is not None:
            group = self.ddp.process_group
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.overlap = overlap and self.ddp is not None
        backend = str(dist.get_backend(group))
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if backend == "nccl" else torch.device("cpu")
        self._param_sync: bool | None = None
        self._armed = False    # a synchronising forward may have run this attempt
        self._flats: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        self.collectives = 0   # all-reduces issued, for tests and telemetry
        #: FSDP2's outermost modules: their gradients leave in every backward
        self.fsdp_roots = fsdp2_roots(model)
        self.sharded = bool(self.fsdp_roots)
        #: this step's attempts vote before each collective (begin_plan)
        self.armed = False
        self.armed_steps = 0   # steps armed, for tests and telemetry
        #: whether an attempt issued collectives (None: none has run yet)
        self.inside: bool | None = None
        self._attempt: Attempt | None = None
        self._n_micro = 1
        #: collectives per micro-batch, where every attempt so far issued
        #: the same number per micro-batch (None: unknown or not steady)
        self._per_micro: int | None = None
        self._unsteady = False
        collectives.install()
        # the votes' tensors, made once (for every parameter, whether or not
        # it trains now): a vote after an out-of-memory error must not
        # allocate under the budget that was just exhausted
        width = max(4, 2 + (len(list(self.ddp.parameters())) if self.ddp is not None else 0))
        self._host = torch.zeros(width, dtype=torch.int64)
        self._wire = self._host if self.device.type == "cpu" else \
            torch.zeros(width, dtype=torch.int64, device=self.device)

    @staticmethod
    def detect(model: torch.nn.Module | None, group: Any = None,
               overlap: bool = False) -> Peers | None:
        """Peers when ``torch.distributed`` is initialised with more than one
        rank, or the model is wrapped in DDP whatever the world size (a
        script that wraps it on one device: an out-of-memory error inside
        DDP's synchronising backward leaves its reducer mid-way, so such a
        model runs its micro-batches as the deferred mode does); else
        ``None``."""
        try:
            dist = _dist()
        except ImportError:
            return None
        if not (dist.is_available() and dist.is_initialized()):
            return None
        from torch.nn.parallel import DistributedDataParallel
        if dist.get_world_size(group) < 2 and not isinstance(model, DistributedDataParallel) \
                and not fsdp2_roots(model):
            return None
        return Peers(model, group, overlap)

    def agree(self, values: list[int]) -> list[int]:
        """The element-wise minimum of ``values`` over the ranks, through
        tensors made in advance (nothing is allocated)."""
        if self.world == 1:        # FSDP2 on one rank: nobody to agree with
            return list(values)
        k, staged = len(values), self._wire is not self._host
        host, wire = self._host[:k], self._wire[:k]
        host.numpy()[:] = values
        if staged:
            wire.copy_(host)
        collectives.original("all_reduce")(wire, op=_dist().ReduceOp.MIN, group=self.group)
        self.collectives += 1
        if staged:
            host.copy_(wire)
        return host.tolist()

    #: a rank's state in a vote, ordered: the minimum over the ranks wins
    OK, OOM, WEIGHTLESS, SKIP = 0, -1, -2, -3

    def vote(self, state: int, next_micro: int, used: list[int] | None = None,
             deferred: bool = False) -> Vote:
        """One all-reduce carrying this rank's state (:attr:`OK`,
        :attr:`OOM`, :attr:`WEIGHTLESS` or :attr:`SKIP`), the size it proposes, and in the
        deferred mode which parameters it has gradients for (``used``, from
        :meth:`prepare`; none: a rank that ran out of memory before it had
        any). Built and read here only, so every rank sends the same
        layout."""
        width = len(self.params()) if deferred and self.ddp is not None else 0
        used = list(used) if used is not None else [0] * width
        if len(used) != width:
            raise ValueError(f"a vote carries {width} parameter flags, not {len(used)}")
        res = self.agree([state, next_micro] + [-u for u in used])
        outcome = {self.OK: "ok", self.OOM: "oom", self.WEIGHTLESS: "weightless",
                   self.SKIP: "skip"}[res[0]]
        return Vote(outcome, res[1], [v < 0 for v in res[2:]])

    # -- per step ------------------------------------------------------------
    def begin_plan(self, micro: int, tight: bool) -> int:
        """The step's size (the smallest any rank proposes), and whether its
        attempts vote before each collective (:attr:`armed`): where any rank
        finds memory tight and attempts issue collectives (or none has run
        yet), with another rank to strand. One all-reduce for both."""
        agreed, calm = self.agree([micro, 0 if tight else 1])
        self.armed = not calm and self.world > 1 and self.inside is not False
        self.armed_steps += self.armed
        return agreed

    def begin_step(self) -> None:
        """Remember DDP's buffer-sync flag, which a redone step restores so
        every rank's first forward issues the same collectives."""
        if self.ddp is not None:
            self._param_sync = self.ddp.require_forward_param_sync

    def attempt(self, deferred: bool, vote: Any, n_micro: int) -> contextlib.AbstractContextManager:
        """The context an attempt of ``n_micro`` micro-batches runs in: its
        collectives counted, and voted before through ``vote(name)`` where
        the step is :attr:`armed`; all of them under ``no_sync()`` when
        DDP's gradients are all-reduced afterwards."""
        self._armed = self.ddp is not None and not deferred
        per = self._per_micro
        self._attempt = Attempt(vote if self.armed else None,
                                None if per is None else per * n_micro)
        self._n_micro = n_micro
        stack = contextlib.ExitStack()
        stack.enter_context(collectives.attempt_of(self._attempt))
        if self.ddp is not None and deferred:
            stack.enter_context(self.ddp.no_sync())
        return stack

    def attempt_done(self) -> None:
        """The attempt's micro-batches ran: whether attempts issue
        collectives is known from now on, and how many each micro-batch
        issues (while every attempt agrees)."""
        a = self._attempt
        if a is None:
            return
        self.inside = bool(self.inside) or a.issued > 0
        per, rest = divmod(a.issued, self._n_micro)
        if rest or self._unsteady or per != (self._per_micro if self._per_micro is not None
                                             else per):
            self._per_micro, self._unsteady = None, True    # attempts differ: never trusted
        else:
            self._per_micro = per

    def stranded(self, a: Attempt | None = None) -> StrandedCollective | None:
        """After this rank ran out of memory in attempt ``a`` (the step's
        last by default): the error to stop with where the others may wait
        in a collective it cannot join (the attempt was not armed and
        attempts issue collectives, or the error came from inside one);
        ``None`` where a vote reaches them."""
        a = a if a is not None else self._attempt
        if a is None or self.world < 2:
            return None
        if a.failed_inside:
            where = f"inside torch.distributed.{a.failed_inside}, which the other ranks joined"
        elif a.expected is not None and a.issued == a.expected:
            return None          # past the attempt's last collective: the others vote next
        elif a.vote is None and (self.sharded or self.inside or a.issued):
            last = f" (the last issued: torch.distributed.{a.last})" if a.last else ""
            where = (f"between the collectives of a step that memory did not make tight "
                     f"(its agreement was not armed){last}")
        else:
            return None
        return StrandedCollective(
            f"memguard: rank {self.rank} ran out of memory {where}: the other ranks wait in "
            f"a collective this rank cannot join, so the step cannot be redone. Guard("
            f"sync_collectives='always') votes before every collective of every step, "
            f"which makes any such error recoverable")

    def abort(self) -> None:
        """Tear the process group down, so that the other ranks fail now
        instead of waiting for its timeout."""
        with contextlib.suppress(RuntimeError, ValueError):   # already torn down
            _dist().destroy_process_group()

    def reset(self) -> None:
        """Before a step is redone: put DDP back as it was at the step's
        start. With ``overlap`` a rank may have prepared the reducer for a
        synchronising backward that never ran; every rank resets it alike."""
        for root in self.fsdp_roots:
            reset = getattr(root, "reset_iter_state", None)
            if reset is None:
                raise RuntimeError("memguard: redoing an FSDP2 step needs "
                                   "FSDPModule.reset_iter_state (torch 2.13 or later)")
            reset()
        if self.ddp is None:
            return
        if self._param_sync is not None:
            self.ddp.require_forward_param_sync = self._param_sync
        if self._armed:
            self.ddp.reducer._reset_state()

    def params(self) -> list[torch.Tensor]:
        """The parameters whose gradients are synchronised, in the same
        order on every rank."""
        if self.ddp is None:
            return []
        return [p for p in self.ddp.parameters() if p.requires_grad]

    def prepare(self, deferred: bool) -> list[int]:
        """After the backward passes, before the agreement (deferred mode):
        give every synchronised parameter a gradient (zeros where this rank
        has none) and lay the gradients out, pre-divided by the world size,
        in the buckets :meth:`finish` all-reduces. Whatever this allocates
        is allocated while an out-of-memory error can still be recovered.

        Returns:
            1 for each parameter that had a gradient here, 0 otherwise.
        """
        if self.ddp is None or not deferred:
            return []
        used = []
        grads = []
        for p in self.params():
            used.append(int(p.grad is not None))
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        scale = 1.0 / self.world
        self._flats = []
        for bucket in _buckets(grads):
            if len(bucket) == 1 and bucket[0].is_contiguous():
                flat = bucket[0].view(-1)
                flat.mul_(scale)
            else:
                flat = torch.cat([g.reshape(-1) for g in bucket])
                flat.mul_(scale)
            self._flats.append((bucket, flat))
        return used

    def finish(self, used_anywhere: list[bool]) -> None:
        """After the agreement: all-reduce the buckets :meth:`prepare` laid
        out (in place; all issued at once, then waited for) and copy them
        back; a parameter no rank had a gradient for gets ``None`` again."""
        if self.ddp is None:
            return
        dist = _dist()
        works = [dist.all_reduce(flat, group=self.group, async_op=True)
                 for _, flat in self._flats]
        self.collectives += len(works)
        for work in works:
            work.wait()
        for bucket, flat in self._flats:
            if flat.data_ptr() == bucket[0].data_ptr() and len(bucket) == 1:
                continue
            off = 0
            for g in bucket:
                k = g.numel()
                g.copy_(flat[off:off + k].view_as(g))
                off += k
        self._flats = []
        for p, anywhere in zip(self.params(), used_anywhere):
            if not anywhere:
                p.grad = None
        # the next forward broadcasts buffers, as after a DDP synchronising step
        self.ddp.require_forward_param_sync = True


def _buckets(grads: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Gradients to all-reduce together: a large contiguous one alone and in
    place (no copy), small ones in runs of one dtype and device up to
    DDP's bucket size (their copy is what the deferred mode costs)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if nbytes >= _IN_PLACE_BYTES and g.is_contiguous():
            yield [g]
            continue
        if bucket and (size + nbytes > _BUCKET_BYTES or g.dtype != bucket[0].dtype
                       or g.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += nbytes
    if bucket:
        yield bucket
