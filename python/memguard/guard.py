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
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch

from memguard import _C, _batch, allocator
from memguard._options import option
from memguard.accumulation import Accumulator
from memguard.budget import parse_budget
from memguard.checkpoint import Checkpoints
from memguard.checkpoint import wrap as wrap_checkpoints
from memguard.cuda import Governor
from memguard.distributed import Peers
from memguard.gc_hooks import GcHooks
from memguard.room import Room
from memguard.step import GuardOOMError, Snapshot, StepArgs, Transaction
from memguard.step import unpack as _unpack  # noqa: F401  (memguard.lightning reads it here)
from memguard.telemetry import Level, PressureEvent, Sampler, open_exporter
from memguard.telemetry import sample as telemetry_sample
from memguard.transaction import PostStepError, check_finite, optimizer_step

log = logging.getLogger("memguard")


#: Guard(budget=...) when none is given: the "budget" option (MEMGUARD_BUDGET,
#: "auto" unless set)
_OPTION = object()

_active_lock = threading.Lock()   # guards _active
_active: Guard | None = None      # the installed guard of this process


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
    """What :meth:`Guard.step` did.

    Attributes:
        loss: the step's mean loss (weighted like the gradients).
        micro_batch: the micro-batch size the step finished at.
        n_micro: how many micro-batches it took.
        retries: attempts redone after an out-of-memory error.
        peak_bytes: the step's peak memory (arena, CUDA or RSS: see
            :attr:`Guard.peak_source`).
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


class _PeakMeter:
    """A step's peak bytes, from the best source there is: memguard's arena
    when it serves tensors, CUDA's allocator for CUDA batches, else the
    process's peak RSS (``VmHWM``, reset through ``clear_refs``)."""

    def __init__(self, arena_key: str = "allocated_bytes.peak") -> None:
        self.source = "none"
        self._arena_key = arena_key
        self._fds: tuple[int, int, int] | None = None   # (pid, clear_refs, status)

    def start(self, batch: Any) -> int:
        """Reset the peak; returns what the source holds now (the floor a
        step starts from; 0 where unknown)."""
        leaves = _batch.leaves(batch)
        first = next((x for x in leaves if isinstance(x, torch.Tensor)), None)
        if first is not None and first.is_cuda:
            self.source = "cuda"
            self._device = first.device
            self._index = first.device.index if first.device.index is not None \
                else torch.cuda.current_device()
            self._memguard_cuda = _C.cuda_backend() is not None
            if self._memguard_cuda:   # torch's own counters do not work then
                _C.cuda_reset_peaks(self._index)
                return int(_C.cuda_stats(self._index)["allocated_bytes.current"])
            torch.cuda.reset_peak_memory_stats(first.device)
            return int(torch.cuda.memory_allocated(first.device))
        if allocator.installed():
            self.source = "arena"
            _C.arena_reset_peaks()
            return int(_C.arena_stats()["allocated_bytes.current"])
        self.source = "rss"
        fds = self._rss_fds()
        if fds is None:
            return 0
        try:
            os.pwrite(fds[1], b"5", 0)   # 5: peak RSS := current RSS
        except OSError:
            return 0
        return self._status_kib(fds, b"VmRSS:") * 1024

    def _rss_fds(self) -> tuple[int, int, int] | None:
        """/proc/self files kept open (reopened in a forked child: /proc/self
        is resolved when opened)."""
        pid = os.getpid()
        if self._fds is None or self._fds[0] != pid:
            try:
                clear = os.open("/proc/self/clear_refs", os.O_WRONLY)
            except OSError:
                return None
            try:
                status = os.open("/proc/self/status", os.O_RDONLY)
            except OSError:
                os.close(clear)     # not kept: no descriptor leaks per step
                return None
            self._fds = (pid, clear, status)
        return self._fds

    def stop(self) -> int:
        if self.source == "cuda":
            if self._memguard_cuda:
                return int(_C.cuda_stats(self._index)["allocated_bytes.peak"])
            return int(torch.cuda.max_memory_allocated(self._device))
        if self.source == "arena":
            return int(_C.arena_stats()[self._arena_key])
        fds = self._rss_fds() if self.source == "rss" else None
        return 0 if fds is None else self._status_kib(fds, b"VmHWM:") * 1024

    @staticmethod
    def _status_kib(fds: tuple[int, int, int], key: bytes) -> int:
        """A kB field of /proc/self/status (0 when unreadable)."""
        try:
            text = os.pread(fds[2], 8192, 0)
            at = text.find(key)
            if at >= 0:
                return int(text[at + len(key):text.index(b"kB", at)])
        except (OSError, ValueError):
            pass
        return 0


class Guard:
    """Keeps training steps inside a memory budget by splitting batches.

    Args:
        budget: what the process (with its DataLoader workers) may hold:
            ``"auto"`` (what it can have now: see :mod:`memguard.room`), a
            size (``"12GiB"``), a share of RAM (``"75%"``) or bytes, always
            capped by what it can have now, which is re-derived at every
            step boundary; ``None``: no budget. By default the ``budget``
            option (``MEMGUARD_BUDGET``, ``"auto"`` unless set).
        tensor_budget: a cap on what memguard's allocator holds for
            tensors (a size or bytes; ``None``: none beyond what
            ``budget`` leaves them). Where :func:`memguard.install` set an
            allocator budget before, that one is the cap.
        micro_batch: ``"auto"`` (start with the whole batch and let pressure
            and out-of-memory errors decide), or a fixed starting size that
            only out-of-memory errors change.
        min_micro_batch: never split finer than this.
        multiple_of: micro-batches are multiples of this (2 for pair-wise
            attention, 8 for tensor cores); the whole batch is always allowed.
        divisor_of: micro-batches divide this (a queue size).
        telemetry: a path (``.jsonl`` or ``.csv``) or an exporter from
            :func:`memguard.telemetry.open_exporter`; samples and the
            guard's decisions go there.
        model: the module trained, for ``no_sync()`` under DDP.
        allocator: install memguard's allocator in :meth:`install` where it
            can be (=True).
        interval_ms: sampling period of the telemetry sampler.
        grow_after: calm steps before a larger micro-batch is tried (=8).
        retry_after: calm steps before a size that failed is tried again (=64).
        margin: planned sizes keep the predicted peak under the room for
            tensors times (1 - margin) (=0.1).
        gc_interval_s: the least time between two pressure reliefs (=0:
            only their cost limits them, to 5 % of the run's time).
        checkpoint: blocks to checkpoint when shrinking is not enough (a
            ``ModuleList`` such as a ViT's ``blocks``, or what
            :func:`memguard.checkpoint.wrap` returned): at the smallest
            micro-batch and still HIGH, a quarter more of them is
            checkpointed each step; once calm again they are switched off,
            a quarter every ``grow_after`` calm steps, before the
            micro-batch grows.
        on_critical: called as ``on_critical(guard)`` at a step boundary,
            once per CRITICAL episode, when there is nothing left to shrink
            or checkpoint (save a training checkpoint there).
        sampler: a :class:`memguard.Sampler` to take pressure levels from
            instead of starting one (it is started, and stopped on
            :meth:`uninstall` only if the guard started it).
        process_group: under ``torch.distributed`` with more than one
            rank, the ranks that agree on one plan (the DDP model's group,
            or the default one): every rank steps at the smallest size any
            rank proposes, and an out-of-memory error on one rank makes
            every rank redo the step (see :mod:`memguard.distributed`).
        cuda_budget: the budget of the CUDA device the batches are on: a
            size, a share of the device (``"75%"``) or ``"auto"`` (live:
            90 % of what this process holds there plus what is free,
            re-read at every step boundary, so another process taking VRAM
            lowers it and the planner follows); ``None``: no cap. Applied with
            ``torch.cuda.set_per_process_memory_fraction`` (or as memguard's
            CUDA allocator's budget where that is installed), and judged by
            the pressure model like the host budget.
        cuda: the CUDA governor: ``None`` (default) starts one once CUDA is in
            use (at the first step after CUDA was initialised, or at
            :meth:`install` when ``cuda_budget`` is given): each step
            boundary pushes the device's allocator counters into telemetry,
            and rising allocation retries (thrashing) shrink the micro-batch
            like HIGH pressure. ``False``: none. A
            :class:`memguard.cuda.Governor`: that one.
        ddp_overlap: with a DDP ``model``, let DDP synchronise the last
            micro-batch's backward itself, overlapping communication with
            computation; an out-of-memory error inside that backward is
            then not recoverable. By default gradients are all-reduced after
            every rank has finished its backward passes.

    Raises:
        ValueError: a bad budget, size or constraint, naming the value.
    """

    def __init__(self, budget: Any = _OPTION, micro_batch: str | int = "auto", *,
                 tensor_budget: str | int | None = None,
                 min_micro_batch: int = 1, multiple_of: int = 1, divisor_of: int | None = None,
                 telemetry: Any = None, model: torch.nn.Module | None = None,
                 allocator: bool = True, interval_ms: float | None = None,
                 grow_after: int = 8, retry_after: int = 64, margin: float = 0.1,
                 gc_interval_s: float = 0.0, sampler: Sampler | None = None,
                 checkpoint: Any = None,
                 on_critical: Callable[[Guard], Any] | None = None,
                 process_group: Any = None, ddp_overlap: bool = False,
                 cuda_budget: str | int | None = None, cuda: Any = None) -> None:
        def positive_int(name: str, v: Any) -> int:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, not {v!r}")
            return v

        positive_int("min_micro_batch", min_micro_batch)
        positive_int("multiple_of", multiple_of)
        if divisor_of is not None:
            positive_int("divisor_of", divisor_of)
        positive_int("grow_after", grow_after)
        positive_int("retry_after", retry_after)
        if micro_batch == "auto":
            start, fixed = 0, False
        elif isinstance(micro_batch, int) and not isinstance(micro_batch, bool) \
                and micro_batch >= 1:
            start, fixed = micro_batch, True
        else:
            raise ValueError(f"micro_batch must be 'auto' or a positive integer, not "
                             f"{micro_batch!r}")
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), not {margin!r}")
        if budget is _OPTION:
            budget = str(option("budget"))
        #: the budget as given (None: none; "auto": what the process can have)
        self.budget = budget
        user = None if budget is None or _is_auto(budget) else parse_budget(budget)
        tensor = None if tensor_budget is None else parse_budget(tensor_budget)
        if isinstance(tensor_budget, str) and (_is_auto(tensor_budget)
                                               or tensor_budget.strip().endswith("%")):
            raise ValueError(f"tensor_budget {tensor_budget!r} must be a size or bytes")
        self._has_budget = budget is not None
        #: the live budget and the arena following it (see memguard.room)
        self.room = Room(budget=user, tensor_budget=tensor, live=self._has_budget)
        if cuda_budget is not None:
            parse_budget(cuda_budget, total=1 << 40)   # the device's total is known later
        if not (cuda is None or cuda is False or isinstance(cuda, Governor)):
            raise ValueError(f"cuda must be None, False or a memguard.cuda.Governor, "
                             f"not {cuda!r}")
        self._cuda_budget = cuda_budget
        self._cuda_arg = cuda
        #: the CUDA governor in use (None until CUDA is)
        self.cuda_governor: Governor | None = None
        self._own_governor = False
        self.min_micro_batch = min_micro_batch
        self.multiple_of = multiple_of
        self.divisor_of = divisor_of
        self.model = model
        self._planner_opts = {
            "micro": start, "min_micro": min_micro_batch, "multiple_of": multiple_of,
            "divisor_of": divisor_of or 0, "budget_bytes": user or 0,
            "margin": float(margin), "grow_after": grow_after, "retry_after": retry_after,
            "fixed": fixed}
        self._planner = _C.Planner(**self._planner_opts)
        if fixed and self._planner.fit(start) != start:
            raise ValueError(f"micro_batch {start} breaks the constraints min_micro_batch="
                             f"{min_micro_batch}, multiple_of={multiple_of}, "
                             f"divisor_of={divisor_of}")
        self._planner_budget = user or 0
        self.checkpoints: Checkpoints | None = None
        if checkpoint is not None:
            self.checkpoints = checkpoint if isinstance(checkpoint, Checkpoints) \
                else wrap_checkpoints(checkpoint)
        self.on_critical = on_critical
        self._process_group = process_group
        self._ddp_overlap = bool(ddp_overlap)
        self._peers: Peers | None = None
        self._peers_checked = False
        self._grow_after = grow_after
        self._ckpt_calm = 0           # calm boundaries since the last checkpoint change
        self._critical_fired = False  # on_critical ran in this CRITICAL episode
        self._want_allocator = allocator
        self._interval_ms = interval_ms
        self._telemetry_arg = telemetry
        self._exporter: Any = None
        self._own_exporter = False
        self.sampler: Sampler | None = sampler
        self._given_sampler = sampler
        self._own_sampler = False
        self.gc = GcHooks(min_interval_s=gc_interval_s, on_event=self._event)
        self._peak = _PeakMeter()
        self._floor = 0                       # what the peak's source held as the step began
        self._arena_budget_before: int | None = None   # restored by uninstall
        self._level_lock = threading.Lock()   # guards _max_raw and _level
        self._max_raw = Level.OK              # highest raw level since the last step boundary
        self._window_t = 0.0   # samples taken before (epoch s) were of a failed attempt
        self._level = Level.OK                # level of the newest sample
        self._outside_peak = 0                # most held outside the arena since the boundary
        self._warned_buffers: set[str] = set()   # restore buffers warned about
        self._installed = False
        self._allocator_installed_here = False
        self.allocator_error: str | None = None
        self._evaluating = 0
        #: counters over the run
        self.steps = 0
        self.ooms_recovered = 0
        self.micro_batch_changes = 0
        self.peak_bytes = 0
        self.last: StepResult | None = None

    # -- lifecycle ---------------------------------------------------------
    def install(self) -> Guard:
        """Start the telemetry sampler and gc hooks, and route tensor memory
        to memguard's allocator with the budget where it can be. Idempotent.
        A failure leaves nothing installed.

        Raises:
            RuntimeError: another guard is installed in this process (guards
                do not nest: a process has one allocator and one budget).
            ValueError: the budget is below what the process holds already.
        """
        global _active
        if self._installed:
            return self
        with _active_lock:
            if _active is not None:
                raise RuntimeError(
                    "another memguard.Guard is installed in this process: uninstall it "
                    "first, or step with that one (a process has one allocator and one "
                    "budget, so guards do not nest)")
            _active = self
        self._installed = True   # from here, uninstall() undoes what was done
        try:
            self._install_allocator()
            self._start_telemetry()
            if isinstance(self._cuda_arg, Governor) or (
                    self._cuda_arg is None and self._cuda_budget is not None
                    and torch.cuda.is_available()):
                self._start_governor()
            self.gc.install()
        except BaseException:
            self.uninstall()
            raise
        self._event("install", budget_bytes=self.budget_bytes, room=self.room.last.to_dict()
                    if self.room.last else None, allocator=allocator.installed(),
                    allocator_error=self.allocator_error)
        return self

    def _install_allocator(self) -> None:
        """memguard's arena for tensors, with the budget the room leaves
        them; a budget set by memguard.install() before stays as a cap."""
        if not self._want_allocator or "torch" not in sys.modules:
            return
        before = int(_C.arena_stats()["budget_bytes"])
        self._arena_budget_before = before
        if allocator.installed() and before and self.room.tensor_budget is None \
                and self.room.live:
            self.room.tensor_budget = before
        state = self.room.measure(telemetry_sample())
        if self.room.budget and state.budget_bytes <= state.outside_bytes:
            raise ValueError(
                f"budget {_mib(state.budget_bytes)} is below what this process already holds "
                f"outside memguard's allocator ({_mib(state.outside_bytes)}): raise the budget "
                f"(it covers the whole process)")
        try:
            was = allocator.installed()
            allocator.install(budget=state.arena_budget_bytes or None)
            self._allocator_installed_here = not was
        except RuntimeError as exc:   # not ELF, no libc10 imports: run without it
            self.allocator_error = str(exc)
        self.room.last = state

    def _start_telemetry(self) -> None:
        """The exporter and the sampler (the guard's own judges every sample
        against the live budget), with the guard's callbacks."""
        t = self._telemetry_arg
        if t is not None:
            if isinstance(t, (str, os.PathLike)):
                self._exporter, self._own_exporter = open_exporter(t), True
            else:
                self._exporter = t
        if self._given_sampler is not None:
            self.sampler = self._given_sampler
            self._own_sampler = not self.sampler.running
        else:
            self.sampler = Sampler(interval_ms=self._interval_ms,
                                   budget=self.room.budget, live=self._has_budget)
            self._own_sampler = True
        if self._exporter is not None:
            self.sampler.on_sample(self._exporter)
        self.sampler.on_pressure(self._on_pressure)
        self.sampler.on_sample(self._on_sample)
        self.sampler.start()

    def uninstall(self) -> None:
        """Stop the sampler and gc hooks; give torch's allocations back to
        the system allocator if :meth:`install` routed them, and the arena
        the budget it had before. Idempotent."""
        global _active
        if not self._installed:
            return
        self._installed = False
        self.gc.uninstall()
        if self.cuda_governor is not None:
            if self._own_governor:
                self.cuda_governor.uninstall()
            self.cuda_governor = None
        if self.sampler is not None:
            if self._own_sampler:
                self.sampler.stop()   # first: the exporter gets every sample taken
            self.sampler.remove_callback(self._on_pressure)
            self.sampler.remove_callback(self._on_sample)
            if self._exporter is not None:
                self.sampler.remove_callback(self._exporter)
            self.sampler = self._given_sampler
        if self._allocator_installed_here:
            allocator.uninstall()
            self._allocator_installed_here = False
        if self._arena_budget_before is not None:
            _C.arena_set_budget(self._arena_budget_before)
            self._arena_budget_before = None
        if self._own_exporter and self._exporter is not None:
            self._exporter.close()
        self._exporter = None
        with _active_lock:
            if _active is self:
                _active = None

    @property
    def budget_bytes(self) -> int:
        """The process's budget now: the live budget at the last step
        boundary (at install before the first step), capped by the budget
        given; 0 without a budget."""
        if not self._has_budget:
            return 0
        if self.room.last is not None and self.room.last.budget_bytes:
            return self.room.last.budget_bytes
        return int(self.room.budget or 0)

    def __enter__(self) -> Guard:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # -- pressure ----------------------------------------------------------
    def _on_pressure(self, ev: PressureEvent) -> None:
        if ev.new >= Level.HIGH > ev.old:
            self.gc.relieve("high", arena_keep=self._cache_keep())

    def _cache_keep(self) -> int:
        """Arena cache a relief keeps: what the recent steps' working set
        reuses (all of it before a step has run)."""
        keep = self.room.cache_keep()
        return int(_C.arena_stats()["cached_bytes"]) if keep is None else keep

    def _manages_arena(self) -> bool:
        """Whether the arena's budget and cache are this guard's to set."""
        return self._installed and self._want_allocator and allocator.installed()

    def _latest_sample(self) -> Any:
        s = self.sampler.latest() if self.sampler is not None else None
        return s if s is not None else telemetry_sample()

    def _follow_room(self, level: int) -> None:
        """A step boundary: the room now (the live budget, the arena's
        budget and cache following it), and relief while pressure is HIGH
        or above (at most the share of the time GcHooks allows)."""
        before = self.room.last
        with self._level_lock:
            outside, self._outside_peak = self._outside_peak, 0
        if self.steps:
            self.room.record_step(outside)
        state = self.room.boundary(self._latest_sample(), self._manages_arena())
        if before is None or _moved(before.budget_bytes, state.budget_bytes):
            self._event("room", step=self.steps, **state.to_dict())
        if level >= Level.HIGH:
            self.gc.relieve(Level(level).name.lower(), arena_keep=self._cache_keep())
        back = self.room.recover_swap(level)
        if back:
            self._event("swap_in", step=self.steps, swap_bytes=back)

    def _on_sample(self, s: Any) -> None:
        # the callback thread may hand a sample over late: one taken before
        # an out-of-memory retry began was of the attempt the OOM answered
        t = getattr(s, "t", None)
        foot = getattr(s, "footprint_bytes", None)
        outside = foot - (getattr(s, "arena_reserved_bytes", None) or 0) if foot else 0
        with self._level_lock:
            if t is None or t >= self._window_t:
                self._max_raw = max(self._max_raw, s.raw_level)
            self._level = s.level
            self._outside_peak = max(self._outside_peak, outside)

    def _start_governor(self) -> None:
        """Start the CUDA governor (the one given, or a new one)."""
        gov = self._cuda_arg if isinstance(self._cuda_arg, Governor) \
            else Governor("cuda", self._cuda_budget)
        self._own_governor = not isinstance(self._cuda_arg, Governor)
        if gov.sampler is None:
            gov.sampler = self.sampler
        if gov.on_event is None:
            gov.on_event = self._event
        gov.install()
        self.cuda_governor = gov

    def _cuda_level(self) -> int:
        """Push the CUDA device's counters (at a step boundary): the level
        of the CUDA signals. The governor starts once CUDA is in use."""
        if self.cuda_governor is None:
            if self._cuda_arg is not None or not self._installed or \
                    not torch.cuda.is_initialized():
                return Level.OK
            self._start_governor()
        assert self.cuda_governor is not None
        return int(self.cuda_governor.push())

    def _boundary_level(self) -> int:
        """The level a step boundary acts on. Shrinking needs a sample of
        the last step itself at HIGH or above (its raw level, before
        hysteresis: a step already shrunk is not shrunk again for pressure
        it no longer causes); while the hysteresis level stays up the size
        holds (ELEVATED); growth waits for a calm level. The CUDA counters
        pushed now count at once."""
        cuda = self._cuda_level()
        with self._level_lock:
            raw, level = max(self._max_raw, cuda), self._level
            self._max_raw = Level.OK
        if raw >= Level.HIGH:
            return int(raw)
        if level >= Level.ELEVATED:
            return int(Level.ELEVATED)
        return int(raw)

    def _event(self, name: str, data: dict | None = None, **kw: Any) -> None:
        event = getattr(self._exporter, "event", None)   # JSONL, TensorBoard
        if callable(event):
            event(name, **(data or {}), **kw)

    # -- the step ----------------------------------------------------------
    @property
    def micro_batch(self) -> int:
        """The planned micro-batch size (0 before the first step with "auto")."""
        return int(self._planner.state()["micro"])

    @property
    def peak_source(self) -> str:
        """Where peak bytes come from: "arena", "cuda", "rss" (or "none")."""
        return self._peak.source

    def plan(self) -> dict[str, Any]:
        """The planner's state and its last decision with the reason."""
        return self._planner.state()

    def step(self, batch: Any, loss_fn: Callable[[Any], Any], optimizer: torch.optim.Optimizer,
             scaler: Any = None, clip_grad_norm: float | None = None,
             post_step: Callable[[Any], Any] | None = None, restore: Any = (),
             mode: str = "accumulate", embed_fn: Callable[[Any], Any] | None = None,
             backward: Callable[[torch.Tensor], Any] | None = None,
             pre_step: Callable[[], Any] | None = None,
             before_optimizer_step: Callable[[torch.optim.Optimizer], Any] | None = None,
             ) -> StepResult:
        """One optimizer step over ``batch``, micro-batched as planned.

        Args:
            batch: a tensor or a nest of tuples/lists/dicts of tensors (and
                lists of per-sample values), split along dim 0.
            loss_fn: ``loss_fn(micro)`` returns the micro-batch's mean loss,
                ``(loss, weight)``, or an :class:`Output` with ``aux``.
            optimizer: stepped once, gradients zeroed after.
            scaler: a ``torch.amp.GradScaler`` for float16 AMP.
            clip_grad_norm: clip the total gradient norm (after unscaling).
            post_step: called once with the concatenated ``aux`` after the
                optimizer step (EMA, queue updates, centering).
            restore: modules (their buffers), tensors or objects with
                ``state_dict`` that the forward pass changes, restored
                before a step is redone.
            mode: ``"accumulate"`` (each micro-batch's loss on its own), or
                ``"gradcache"`` for losses that need the whole batch
                (in-batch negatives): ``embed_fn(micro)`` embeds each
                micro-batch without a graph, ``loss_fn(embeddings)`` takes
                the whole batch's embeddings, and the micro-batches are
                replayed with the cached embedding gradients (see
                :mod:`memguard.gradcache`); ``aux`` is the embeddings.
            embed_fn: the embedding function of ``"gradcache"`` mode.
            backward: runs each micro-batch's backward in place of
                ``loss.backward()`` (``"accumulate"`` mode); Lightning's
                ``manual_backward`` goes here.
            pre_step: called once before the first micro-batch (a MoCo
                momentum update); not again when the step is redone. What it
                changes is rolled back with the step when listed in
                ``restore`` (a momentum encoder's parameters as tensors:
                ``restore=[*encoder_k.parameters()]``; a module there stands
                for its buffers).
            before_optimizer_step: called as
                ``before_optimizer_step(optimizer)`` once the gradients are
                the whole batch's and unscaled, before clipping and the
                optimizer step: per-parameter clipping, freezing a layer.

        The step is all or nothing: whatever ends it (an out-of-memory error
        anywhere in it, ``optimizer.step()`` included; any exception;
        ``KeyboardInterrupt``), the model, gradients, ``restore`` buffers,
        optimizer state, AMP scaler and RNG are the committed step's or what
        they were before it. Only ``post_step`` runs after the commit.

        Returns:
            A :class:`StepResult`.

        Raises:
            GuardOOMError: out of memory at the smallest allowed size.
            memguard.transaction.NonFiniteLossError: the loss is NaN or
                infinite (without a scaler): the step was not taken.
            memguard.transaction.OptimizerOOMError: the optimizer step ran
                out of memory also after memory was relieved.
            memguard.transaction.PostStepError: ``post_step`` failed after
                the optimizer step was taken (the step is counted).
        """
        if mode not in ("accumulate", "gradcache"):
            raise ValueError(f"mode must be 'accumulate' or 'gradcache', not {mode!r}")
        if (mode == "gradcache") != (embed_fn is not None):
            raise ValueError("mode='gradcache' takes an embed_fn, and only it does")
        n = _batch.batch_size(batch)
        peers = self._peers_for_step()
        micro, begun = self._begin(batch, n, peers)
        args = StepArgs(batch, n, loss_fn, optimizer, scaler, clip_grad_norm, post_step, restore,
                        embed_fn, backward, pre_step, before_optimizer_step)
        done = Transaction(self, args, micro, peers).run()
        return self._finish(done, begun, n, post_step)

    def _begin(self, batch: Any, n: int, peers: Peers | None) -> tuple[int, dict]:
        """The step boundary: the level, the room, the peak meter, the
        planner's decision (agreed by the ranks). Returns the micro-batch
        size and what the step's event records of the plan."""
        level = self._boundary_level()   # first: it pushes the last step's CUDA peaks
        self._follow_room(level)
        self._floor = self._peak.start(batch)
        self._sync_budget()
        plan_level = self._checkpoint_hold(level)
        plan_budget = self._planner_budget
        micro = int(self._planner.begin(n, plan_level))
        if peers is not None:
            agreed = peers.agree([micro])[0]     # the smallest proposal
            if agreed < micro:
                self._planner.agree(agreed)
                micro = agreed
            peers.begin_step()
        plan = self._planner.state()
        self._escalate(level, plan)
        if plan["action"] != "hold":
            self.micro_batch_changes += 1
        return micro, {"plan": plan, "level": int(plan_level), "budget": plan_budget}

    def _before_redo(self, batch: Any, failed: int, nxt: int, peer: bool) -> None:
        """After an out-of-memory error, the state rolled back: memory
        relieved, the peak meter restarted (the planner learns the retry's
        peak), the pressure of the failed attempt forgotten (the OOM already
        shrank for it), and the event and a log line."""
        self.gc.relieve_oom()
        self._floor = self._peak.start(batch)
        with self._level_lock:
            self._max_raw = Level.OK
            self._window_t = time.time()
        self.ooms_recovered += 1
        self.micro_batch_changes += 1
        self._event("oom_recovered", step=self.steps, failed_micro_batch=failed,
                    micro_batch=int(nxt), peer=peer, planner_budget_bytes=self._planner_budget)
        log.warning("memguard: step %d ran out of memory at micro-batch %s%s; redoing it at %d",
                    self.steps, failed, " (on another rank)" if peer else "", int(nxt))

    def _finish(self, done: Any, begun: dict, n: int,
                post_step: Callable[[Any], Any] | None) -> StepResult:
        """The committed step: the planner learns its peak, it is counted and
        recorded, then ``post_step`` runs (an error there says the step is
        done)."""
        plan = self._planner.state() if done.tried else begun["plan"]   # the OOM's decision
        aux = _batch.concat(done.aux) if done.aux else None
        peak = self._peak.stop()
        self._planner.end(done.micro, peak, self._floor)
        if self._peak.source == "arena":
            self.room.record_peak(peak)
        self.peak_bytes = max(self.peak_bytes, peak)
        res = StepResult(loss=done.loss, micro_batch=done.micro, n_micro=done.n_micro,
                         retries=len(done.tried), peak_bytes=peak, aux=aux, weight=done.weight,
                         tried=done.tried)
        self.last = res
        # with the planner's inputs, so a recorded run replays through it
        self._event("step", step=self.steps, micro_batch=done.micro, n_micro=done.n_micro,
                    retries=len(done.tried), peak_bytes=peak, loss=done.loss,
                    action=plan["action"], reason=plan["reason"], batch=n, level=begun["level"],
                    planner_budget_bytes=begun["budget"], floor_bytes=self._floor)
        self.steps += 1
        if post_step is not None:
            try:
                post_step(aux)
            except Exception as exc:   # after the commit: the step is done
                self._event("post_step_failed", step=self.steps - 1, error=repr(exc))
                raise PostStepError(self.steps - 1) from exc
        return res

    def _warn_changed_buffers(self, snapshot: Snapshot) -> None:
        """Once per buffer: a ``restore`` buffer that a split step's forward
        passes changed was updated once per micro-batch, not once per step."""
        for name in snapshot.changed():
            if name in self._warned_buffers:
                continue
            self._warned_buffers.add(name)
            warnings.warn(
                f"memguard: buffer {name} changed during the forward passes of a step split "
                f"into micro-batches, so it was updated once per micro-batch, not once per "
                f"step: move its update to post_step (which gets the step's concatenated aux) "
                f"or pre_step", UserWarning, stacklevel=3)

    def _commit(self, acc: Accumulator, optimizer: torch.optim.Optimizer) -> float:
        """The step's update: a finite loss (without a scaler: with one, the
        scaler skips non-finite steps itself), the hook and clipping, then
        the optimizer step as all or nothing. Returns the step's loss."""
        if acc.scaler is None:
            check_finite(acc.loss)
        acc.prepare()
        return optimizer_step(optimizer, acc.apply,
                              lambda: self.gc.relieve("optimizer", force=True))

    def _checkpoint_hold(self, level: int) -> int:
        """De-escalation comes first: while blocks are checkpointed a calm
        level switches a quarter of them off every grow_after steps, and the
        planner holds the size (it sees ELEVATED) until none is left."""
        ck = self.checkpoints
        if ck is None or not ck.n_on or level != Level.OK:
            self._ckpt_calm = 0
            return level
        self._ckpt_calm += 1
        if self._ckpt_calm >= self._grow_after:
            self._ckpt_calm = 0
            ck.fewer(max(1, len(ck) // 4))
            self._event("checkpoint", step=self.steps, blocks=ck.n_on, reason="calm")
        return int(Level.ELEVATED)

    def _escalate(self, level: int, plan: dict) -> None:
        """At the smallest micro-batch and still HIGH: checkpoint more
        blocks; at CRITICAL with nothing left, call on_critical once."""
        if level < Level.CRITICAL:
            self._critical_fired = False
        if level < Level.HIGH or plan["reason"] != "at_min":
            return
        ck = self.checkpoints
        if ck is not None and ck.n_on < len(ck):
            ck.more(max(1, len(ck) // 4))
            self._event("checkpoint", step=self.steps, blocks=ck.n_on,
                        reason=Level(level).name.lower())
        elif level >= Level.CRITICAL and not self._critical_fired:
            self._critical_fired = True
            self._event("critical", step=self.steps)
            if self.on_critical is not None:
                self.on_critical(self)

    def _peers_for_step(self) -> Peers | None:
        """The ranks to agree with: looked up at the first step, when
        ``torch.distributed`` is initialised with more than one rank."""
        if not self._peers_checked:
            self._peers = Peers.detect(self.model, self._process_group, self._ddp_overlap)
            self._peers_checked = True
        return self._peers

    def _follow_room_now(self) -> None:
        """Within a step (after an out-of-memory error): the room now, the
        arena's budget following it, and the planner's; the cache ages only
        at boundaries."""
        self.room.follow(self._latest_sample(), self._manages_arena())
        self._sync_budget()

    def _sync_budget(self) -> None:
        """The planner plans against the budget of what the peaks measure:
        the arena's budget (the room the live budget leaves tensors) when it
        serves them, the device's for CUDA, the live budget for RSS."""
        budget = self.budget_bytes
        if self._peak.source == "arena":
            budget = _C.arena_stats()["budget_bytes"]
        elif self._peak.source == "cuda":
            gov = self.cuda_governor
            budget = gov.budget_bytes if gov is not None and gov.budget_bytes else \
                (gov.last or {}).get("total_bytes", 0) if gov is not None else 0
        if budget != self._planner_budget:
            self._planner.set_budget(budget)
            self._planner_budget = budget

    # -- evaluation --------------------------------------------------------
    @contextlib.contextmanager
    def evaluate(self) -> Iterator[Guard]:
        """Run a validation loop under ``no_grad``, micro-batched by
        :meth:`infer`; memory is released when it ends."""
        self._evaluating += 1
        try:
            with torch.no_grad():
                yield self
        finally:
            self._evaluating -= 1
            self.gc.relieve("evaluate", force=True)

    def infer(self, batch: Any, fn: Callable[[Any], Any]) -> Any:
        """``fn`` over ``batch`` in micro-batches of the planned size,
        outputs concatenated (detached). An out-of-memory error shrinks the
        size and goes on from the micro-batch that failed.

        Raises:
            GuardOOMError: out of memory at the smallest allowed size.
        """
        n = _batch.batch_size(batch)
        micro = min(self.micro_batch or n, n)
        outs: list = []
        start = 0
        tried: list[int] = []
        with torch.no_grad():
            while start < n:
                stop = min(start + micro, n)
                try:
                    out = fn(_batch.slice_(batch, start, stop))
                except Exception as exc:
                    if not allocator.is_oom(exc):
                        raise
                    tried.append(micro)
                    self._follow_room_now()
                    nxt = self._planner.oom(micro)
                    if nxt is None:
                        raise GuardOOMError(tried, self.min_micro_batch) from exc
                else:
                    outs.append(_batch.detach(out))
                    start = stop
                    continue
                self.gc.relieve_oom()
                self.ooms_recovered += 1
                micro = int(nxt)
        return _batch.concat(outs)

    # -- resuming ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on where this one stopped: the
        planned micro-batch, the checkpointed blocks and the counters."""
        return {
            "version": 1,
            "micro_batch": self.micro_batch,
            "checkpointed_blocks": self.checkpoints.n_on if self.checkpoints else 0,
            "steps": self.steps,
            "ooms_recovered": self.ooms_recovered,
            "micro_batch_changes": self.micro_batch_changes,
            "peak_bytes": self.peak_bytes,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the planner starts at the saved
        micro-batch (growth then waits for calm steps as usual).

        Raises:
            ValueError: not a memguard guard state.
        """
        if not isinstance(state, Mapping) or state.get("version") != 1:
            raise ValueError(f"not a memguard Guard state: {state!r}")
        micro = int(state["micro_batch"])
        if micro and not self._planner_opts["fixed"]:
            self._planner = _C.Planner(**dict(self._planner_opts, micro=micro))
            self._planner_budget = self._planner_opts["budget_bytes"]
        if self.checkpoints is not None:
            self.checkpoints.set(min(int(state["checkpointed_blocks"]), len(self.checkpoints)))
        self.steps = int(state["steps"])
        self.ooms_recovered = int(state["ooms_recovered"])
        self.micro_batch_changes = int(state["micro_batch_changes"])
        self.peak_bytes = int(state["peak_bytes"])

    # -- reporting ---------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Counters of the run so far."""
        return {
            "steps": self.steps,
            "micro_batch": self.micro_batch,
            "micro_batch_changes": self.micro_batch_changes,
            "ooms_recovered": self.ooms_recovered,
            "peak_bytes": self.peak_bytes,
            "peak_source": self.peak_source,
            "checkpointed_blocks": self.checkpoints.n_on if self.checkpoints else 0,
            "budget_bytes": self.budget_bytes,
            "gc": self.gc.stats.to_dict(),
            "plan": self.plan(),
            "time": time.time(),
        }

    def postfix(self) -> dict[str, Any]:
        """A short view of the run for a progress bar: ``bar.set_postfix(guard.postfix())``.

        Returns:
            ``{"mem": "1.2/4.0GiB", "micro": 16, "oom": 1}``: memory now (the
            newest sample's RSS, the arena's reserved bytes before the first
            sample, ``?`` without either) over the budget (no ``/budget``
            without one), the planned micro-batch size (0 before the first
            step with "auto") and the out-of-memory errors recovered.
        """
        s = self.sampler.latest() if self.sampler is not None else None
        used = s.rss_bytes if s is not None else None
        if used is None and allocator.installed():
            used = int(_C.arena_stats()["reserved_bytes.current"])
        budget = self.budget_bytes or None
        gib = max(used or 0, budget or 0) >= 2**30
        scale, unit, digits = (2**30, "GiB", 1) if gib else (2**20, "MiB", 0)
        mem = "?" if used is None else f"{used / scale:.{digits}f}"
        if budget is not None:
            mem += f"/{budget / scale:.{digits}f}"
        if mem != "?":
            mem += unit
        return {"mem": mem, "micro": self.micro_batch, "oom": self.ooms_recovered}


def _is_auto(budget: Any) -> bool:
    return isinstance(budget, str) and budget.strip().lower() == "auto"


def _moved(old: int, new: int) -> bool:
    """Whether a budget moved by more than 1/32 (telemetry's "room" events)."""
    return abs(new - old) * 32 > max(old, new)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"
