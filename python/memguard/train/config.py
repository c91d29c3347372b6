"""What a :class:`memguard.Guard` is asked to do: its options, checked once.

``Guard(budget, micro_batch, **options)`` builds a :class:`GuardConfig`; a
bad value raises ``ValueError`` naming it, an unknown option ``TypeError``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from memguard._common import is_auto
from memguard._options import option
from memguard.telemetry.budget import parse_budget


def _positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive integer, not {v!r}")
    return v


def _check_horizon(h: Any) -> None:
    """``forecast_horizon``: ``None``, ``"auto"``, a positive int of steps
    or ``"N epochs"``."""
    if h is None or h == "auto":
        return
    if isinstance(h, int) and not isinstance(h, bool) and h > 0:
        return
    parts = h.split() if isinstance(h, str) else []
    if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) > 0 and \
            parts[1] in ("epoch", "epochs"):
        return
    raise ValueError(f"forecast_horizon must be None, 'auto', a positive number of steps or "
                     f"'N epochs', not {h!r}")


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    """A guard's options.

    Attributes:
        budget: what the process (with its DataLoader workers) may hold:
            ``"auto"`` (what it can have now: see :mod:`memguard.memory.room`),
            a size (``"12GiB"``), a share of RAM (``"75%"``) or bytes, always
            capped by what it can have now, which is re-derived at every
            step boundary; ``None``: no budget. By default the ``budget``
            option (``MEMGUARD_BUDGET``, ``"auto"`` unless set).
        micro_batch: ``"auto"`` (start with the whole batch and let pressure
            and out-of-memory errors decide), or a fixed starting size that
            only out-of-memory errors change.
        tensor_budget: a cap on what memguard's allocator holds for tensors
            (a size or bytes; ``None``: none beyond what ``budget`` leaves
            them). Where :func:`memguard.install` set an arena budget
            before, that one is the cap.
        min_micro_batch: never split finer than this (=1).
        multiple_of: micro-batches are multiples of this (2 for pair-wise
            attention, 8 for tensor cores); the whole batch is always
            allowed (=1).
        divisor_of: micro-batches divide this (a queue size).
        telemetry: a path (``.jsonl`` or ``.csv``) or an exporter from
            :func:`memguard.telemetry.open_exporter`; samples and the
            guard's events go there.
        allocator: install memguard's allocator at install where it can be
            (=True).
        interval_ms: the telemetry sampler's period (=the ``interval_ms``
            option, 100).
        grow_after: calm steps before a larger micro-batch is tried (=8).
        retry_after: calm steps before a size that failed is tried again
            where the room is unknown (=64); with a room, the size is a
            ceiling until the room rises by a quarter over its room then.
        margin: the least margin: planned sizes keep the predicted peak
            under the room for tensors times (1 - margin), where the margin
            is learnt from the planner's own prediction errors (twice their
            root-mean-square, widened by an out-of-memory error at a size
            it said fits) and never below this (=0.03).
        gc_interval_s: the least time between two pressure reliefs (=0: only
            their cost limits them, to 5 % of the run's time).
        sampler: a :class:`memguard.Sampler` to take pressure levels from
            instead of starting one (started if it is not running, and then
            stopped at uninstall).
        checkpoint: blocks to checkpoint when shrinking is not enough (a
            ``ModuleList`` such as a ViT's ``blocks``, or what
            :func:`memguard.checkpoint.wrap` returned): at the smallest
            micro-batch and still HIGH, a quarter more of them is
            checkpointed each step; once calm again they are switched off, a
            quarter every ``grow_after`` calm steps, before the micro-batch
            grows.
        on_critical: called as ``on_critical(guard)`` at a step boundary,
            once per CRITICAL episode, when there is nothing left to shrink
            or checkpoint (save a training checkpoint there).
        process_group: under ``torch.distributed`` with more than one rank,
            the ranks that agree on one plan (the DDP model's group, or the
            default one): every rank steps at the smallest size any rank
            proposes, and an out-of-memory error on one rank makes every
            rank redo the step (see :mod:`memguard.train.distributed`).
        ddp_overlap: with a DDP model, let DDP synchronise the last
            micro-batch's backward itself, overlapping communication with
            computation; an out-of-memory error inside that backward is then
            not recoverable. By default gradients are all-reduced after
            every rank has finished its backward passes.
        sync_collectives: under ``torch.distributed``, when the ranks vote
            before each collective inside a step (FSDP2's all-gathers and
            reduce-scatters, a loss's all-gather), which makes an
            out-of-memory error between them recoverable on every rank
            (:mod:`memguard.train.collectives`): ``"auto"`` while memory is
            tight, ``"always"`` at every step.
        cuda_budget: the budget of the CUDA device the batches are on: a
            size, a share of the device (``"75%"``) or ``"auto"`` (live: 90 %
            of what this process holds there plus what is free, re-read at
            every step boundary); ``None``: no cap. Applied with
            ``torch.cuda.set_per_process_memory_fraction`` (or as memguard's
            CUDA allocator's budget where that is installed).
        cuda: the CUDA governor: ``None`` starts one once CUDA is in use (at
            the first step after CUDA was initialised, or at install when
            ``cuda_budget`` is given); ``False``: none; a
            :class:`memguard.cuda.Governor`: that one.
        mps: a :class:`memguard.mps.MpsGovernor` for Apple's GPU, whose
            level counts at every step boundary as a CUDA governor's does
            (``None``: none; not with a CUDA governor).
        forecast_horizon: how far ahead a slow growth of the memory held
            between steps is forecast (:mod:`memguard.train.drift`): steps
            (an int), ``"N epochs"``, ``"auto"`` (3 epochs where
            ``steps_per_epoch`` is known, at least 1000 steps; else 1000
            steps) or ``None`` (no forecast).
        steps_per_epoch: optimizer steps in an epoch, where known (the
            Lightning callback sets it): forecasts then say epochs too.
        headroom: when the whole batch peaks under this share of the budget
            for several steps, say once which larger batch fits
            (:mod:`memguard.train.headroom`; =0.6: MoCo on an 8 GB card at
            4.6 GB is under it; ``None``: never).
    """

    budget: Any = "auto"
    micro_batch: str | int = "auto"
    tensor_budget: str | int | None = None
    min_micro_batch: int = 1
    multiple_of: int = 1
    divisor_of: int | None = None
    telemetry: Any = None
    allocator: bool = True
    interval_ms: float | None = None
    grow_after: int = 8
    retry_after: int = 64
    margin: float = 0.03
    gc_interval_s: float = 0.0
    sampler: Any = None
    checkpoint: Any = None
    on_critical: Callable[[Any], Any] | None = None
    process_group: Any = None
    ddp_overlap: bool = False
    sync_collectives: str = "auto"
    cuda_budget: str | int | None = None
    cuda: Any = None
    mps: Any = None
    forecast_horizon: Any = "auto"
    steps_per_epoch: int | None = None
    headroom: float | None = 0.6
    #: the budget asked for in bytes (``None``: none, or ``"auto"``)
    user_budget_bytes: int | None = dataclasses.field(init=False, default=None)
    #: ``tensor_budget`` in bytes
    tensor_budget_bytes: int | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        for name in ("min_micro_batch", "multiple_of", "grow_after", "retry_after"):
            _positive_int(name, getattr(self, name))
        if self.divisor_of is not None:
            _positive_int("divisor_of", self.divisor_of)
        if self.steps_per_epoch is not None:
            _positive_int("steps_per_epoch", self.steps_per_epoch)
        _check_horizon(self.forecast_horizon)
        if self.sync_collectives not in ("auto", "always"):
            raise ValueError(f"sync_collectives must be 'auto' or 'always', not "
                             f"{self.sync_collectives!r}")
        h = self.headroom
        if h is not None and (isinstance(h, bool) or not isinstance(h, (int, float))
                              or not 0 < h < 1):
            raise ValueError(f"headroom must be a share in (0, 1) or None, not {h!r}")
        mb = self.micro_batch
        if mb != "auto" and (isinstance(mb, bool) or not isinstance(mb, int) or mb < 1):
            raise ValueError(f"micro_batch must be 'auto' or a positive integer, not {mb!r}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), not {self.margin!r}")
        if self.budget is not None and not is_auto(self.budget):
            object.__setattr__(self, "user_budget_bytes", parse_budget(self.budget))
        tb = self.tensor_budget
        if isinstance(tb, str) and (is_auto(tb) or tb.strip().endswith("%")):
            raise ValueError(f"tensor_budget {tb!r} must be a size or bytes")
        if tb is not None:
            object.__setattr__(self, "tensor_budget_bytes", parse_budget(tb))
        if self.cuda_budget is not None:
            parse_budget(self.cuda_budget, total=1 << 40)   # the device's total comes later
        from memguard.memory.cuda import Governor

        if not (self.cuda is None or self.cuda is False or isinstance(self.cuda, Governor)):
            raise ValueError(f"cuda must be None, False or a memguard.cuda.Governor, "
                             f"not {self.cuda!r}")
        from memguard.memory.mps import MpsGovernor

        if not (self.mps is None or isinstance(self.mps, MpsGovernor)):
            raise ValueError(f"mps must be None or a memguard.mps.MpsGovernor, not {self.mps!r}")
        if self.mps is not None and (self.cuda not in (None, False) or self.cuda_budget):
            raise ValueError("a guard steers one device's allocator: give mps= or the CUDA "
                             "options (cuda=, cuda_budget=), not both")

    @classmethod
    def default_budget(cls) -> str:
        """The budget when none is given: the ``budget`` option."""
        return str(option("budget"))

    @property
    def sizes(self) -> Any:
        """What every micro-batch must be (a :class:`~memguard.train.batch.Sizes`)."""
        from memguard.train.batch import Sizes  # torch: loaded once a step runs
        return Sizes(self.multiple_of, self.divisor_of, self.min_micro_batch)

    @property
    def fixed(self) -> bool:
        """Whether the micro-batch size was given (only OOMs change it)."""
        return self.micro_batch != "auto"
