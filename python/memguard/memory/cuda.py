"""CUDA: govern PyTorch's caching allocator, or replace it with memguard's.

**The governor (default).** PyTorch's own caching allocator stays in charge;
memguard watches and steers it. :class:`Governor` reads
``torch.cuda.memory_stats()`` and ``torch.cuda.mem_get_info()`` at step
boundaries (neither synchronises the device) and pushes the counters into the
telemetry sampler, where the pressure model judges them: allocated bytes
against the CUDA budget like any budget, and any rise of
``num_alloc_retries`` (the allocator had to free its cache and retry a
``cudaMalloc``: it is thrashing) as HIGH. A budget is applied through
``torch.cuda.set_per_process_memory_fraction``, out-of-memory errors are
recorded by an observer attached to the allocator, and fragmentation
(reserved far above allocated) brings one recommendation of
``expandable_segments`` (see ``memguard doctor``). :func:`govern` starts a
governor on its own; a :class:`memguard.Guard` starts one where CUDA is in use.

**memguard's allocator (optional).** :func:`install_allocator` hands CUDA tensor memory to memguard's C allocator
through ``torch.cuda.memory.CUDAPluggableAllocator``: blocks cached by size
class per device and per stream, the budget enforced inside the allocation
(release cache, then fail with ``RuntimeError: CUDA out of memory: ...``), and
its counters in :func:`stats` (``torch.cuda.memory_stats()`` does not work
under a pluggable allocator). It must be installed before the first CUDA
allocation of the process.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from memguard import _C
from memguard._common import is_auto
from memguard.memory import cuda_advice
from memguard.telemetry.budget import parse_budget
from memguard.telemetry.events import Event
from memguard.telemetry.samples import Level

#: torch.cuda.memory_stats() keys -> the counters pushed to the sampler.
_NATIVE_KEYS = {
    "allocated_bytes": "allocated_bytes.all.current",
    "reserved_bytes": "reserved_bytes.all.current",
    "active_bytes": "active_bytes.all.current",
    "allocated_peak_bytes": "allocated_bytes.all.peak",
    "reserved_peak_bytes": "reserved_bytes.all.peak",
    "alloc_retries": "num_alloc_retries",
    "ooms": "num_ooms",
}

#: stats() keys under memguard's allocator -> the same counters.
_MEMGUARD_KEYS = {
    "allocated_bytes": "allocated_bytes.current",
    "reserved_bytes": "reserved_bytes.current",
    "active_bytes": "active_bytes.current",
    "allocated_peak_bytes": "allocated_bytes.peak",
    "reserved_peak_bytes": "reserved_bytes.peak",
    "alloc_retries": "num_alloc_retries",
    "ooms": "num_ooms",
}

_lock = threading.Lock()          # install, budgets, the observer
_installed_allocator: str | None = None   # "memguard" once routed to memguard's allocator
_observer_attached = False
_governors: list[Governor] = []   # live governors the OOM observer reports to


def _torch() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        raise RuntimeError("import torch before using memguard's CUDA support")
    return torch


def parse_device(device: Any) -> int | None:
    """The CUDA ordinal named by ``device``: ``"cuda"`` (the current device,
    returned as ``None``), ``"cuda:1"``, ``1`` or a ``torch.device``.

    Raises:
        ValueError: not a CUDA device.
    """
    if isinstance(device, bool):
        raise ValueError(f"device {device!r} is not a CUDA device")  # noqa: TRY004 - one error type for every bad device
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device {device!r} is not a CUDA device ordinal")
        return device
    text = str(device)
    if text == "cuda":
        index = getattr(device, "index", None)
        return index if isinstance(index, int) else None
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise ValueError(f"device {device!r} is not a CUDA device: use 'cuda', 'cuda:N' or N")


def _ordinal(device: int | None) -> int:
    """A concrete ordinal: the current device for ``None`` (initialises CUDA
    only when it is available)."""
    if device is not None:
        return device
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return int(torch.cuda.current_device())
    return 0


# -- memguard's CUDA allocator -------------------------------------------------

def _loaded_cudart() -> str | None:
    """The CUDA runtime library PyTorch loaded (so memguard calls the same
    copy), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if "/libcudart.so" in path and os.path.exists(path):
                    return path
    except OSError:
        pass
    return None


def install_allocator(budget: str | int | None = None) -> None:
    """Route CUDA tensor memory of every device to memguard's allocator.
    Idempotent (a later call sets the budget only).

    Args:
        budget: each device's budget: a size, a share of the device
            (``"75%"``) or bytes; ``None``: none.

    Raises:
        RuntimeError: torch is not imported, there is no CUDA device, or
            CUDA memory was already allocated (it must come first).
        ValueError: a bad budget.
    """
    if budget is not None:
        parse_budget(budget, total=1 << 40)   # a bad budget is a ValueError before anything
    global _installed_allocator
    torch = _torch()
    with _lock:
        if _installed_allocator == "memguard":
            if budget is not None:
                _set_memguard_budgets(torch, budget)
            return
        if not torch.cuda.is_available():
            raise RuntimeError("memguard's CUDA allocator needs a CUDA device, and "
                               "torch.cuda.is_available() is False on this machine")
        initialised = getattr(torch._C, "_cuda_isAllocatorInitialized", None) or \
            getattr(torch._C, "_accelerator_isAllocatorInitialized", None)
        if torch.cuda.is_initialized() and initialised is not None and initialised():
            raise RuntimeError("memguard's CUDA allocator must be installed before the first "
                               "CUDA allocation of the process, and CUDA memory was already "
                               "allocated: call memguard.memory.cuda.install_allocator() "
                               "right after `import torch`")
        _C.cuda_init("cuda", _loaded_cudart())
        alloc = torch.cuda.memory.CUDAPluggableAllocator(_C.__file__, "mg_cuda_alloc",
                                                         "mg_cuda_free")
        try:
            torch.cuda.memory.change_current_allocator(alloc)
        except RuntimeError as exc:
            raise RuntimeError(
                f"memguard's CUDA allocator must be installed before the first CUDA allocation "
                f"of the process ({exc}): call memguard.memory.cuda.install_allocator() right after "
                f"`import torch`") from None
        _installed_allocator = "memguard"
        if budget is not None:
            _set_memguard_budgets(torch, budget)


def _set_memguard_budgets(torch: Any, budget: str | int) -> None:
    for d in range(torch.cuda.device_count()):
        total = int(torch.cuda.get_device_properties(d).total_memory)
        _C.cuda_set_budget(d, parse_budget(budget, total=total))


def allocator_name() -> str:
    """``"memguard"`` when CUDA tensors come from memguard's allocator (or
    its host backend, in tests), else ``"native"``."""
    return "memguard" if _C.cuda_backend() is not None else "native"


def stats(device: Any = "cuda") -> dict[str, int]:
    """A CUDA device's allocator counters, flat, in the vocabulary of the
    CPU arena's :func:`memguard.stats`: memguard's allocator's own where it is installed
    (``torch.cuda.memory_stats()`` does not work then), else PyTorch's
    caching allocator's under the same names.

    Raises:
        RuntimeError: no CUDA device and no memguard allocator.
        ValueError: not a CUDA device.
    """
    dev = parse_device(device)
    if _C.cuda_backend() is not None:
        return _C.cuda_stats(_ordinal(dev))
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        raise RuntimeError("no CUDA device here: there are no CUDA allocator statistics")
    return flat_native_stats(torch.cuda.memory_stats(_ordinal(dev)))


def flat_native_stats(ms: Mapping[str, Any]) -> dict[str, int]:
    """``torch.cuda.memory_stats()`` in the arena's :func:`memguard.stats` names."""
    out = {}
    for kind in ("allocated", "reserved", "active", "requested"):
        for which in ("current", "peak"):
            out[f"{kind}_bytes.{which}"] = int(ms.get(f"{kind}_bytes.all.{which}", 0))
    out["cached_bytes"] = max(0, out["reserved_bytes.current"] - out["allocated_bytes.current"])
    for k in ("num_alloc_retries", "num_ooms"):
        out[k] = int(ms.get(k, 0))
    out["num_device_allocs"] = int(ms.get("num_device_alloc", 0))
    out["num_device_frees"] = int(ms.get("num_device_free", 0))
    out["num_allocs"] = int(ms.get("allocation.all.allocated", 0))
    out["num_frees"] = int(ms.get("allocation.all.freed", 0))
    return out


# -- the governor ---------------------------------------------------------------

def _on_native_oom(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    """PyTorch's out-of-memory observer: runs on the failing thread, before
    the error is raised; it only records."""
    for g in _governors.copy():   # install/uninstall may change it meanwhile
        if g.device == device or g.device is None:
            g._observe_oom(device, alloc, device_allocated, device_free)


class Governor:
    """Watches one CUDA device for a :class:`memguard.Guard` (which creates
    one on its own where CUDA is available) and steers its allocator.

    Args:
        device: the device (``"cuda"``: the current one at :meth:`install`).
        budget: ``None`` (no cap), a size (``"20GiB"``), a share of the
            device (``"75%"``) or ``"auto"``: live, what this process
            holds on the device plus what is free there, re-read at every
            push (a step boundary), so that another process taking VRAM
            lowers it (no reserve: the planner keeps its own margin, learnt
            from its errors). Under PyTorch's allocator it becomes
            ``set_per_process_memory_fraction``; under memguard's, that
            allocator's budget.
        sampler: the telemetry sampler the counters are pushed to.
        on_event: called as ``on_event(name, data)`` for ``cuda_oom`` and
            ``cuda_advice`` events.
        memory_stats, mem_get_info: where counters come from (default
            ``torch.cuda.memory_stats`` and ``torch.cuda.mem_get_info``, or
            memguard's allocator's counters when it is installed); tests
            replay recorded dictionaries through them.

    Raises:
        ValueError: a bad device or budget.
    """

    def __init__(self, device: Any = "cuda", budget: str | int | None = None, *,
                 sampler: Any = None, on_event: Callable[[str, dict], Any] | None = None,
                 memory_stats: Callable[[int], Mapping[str, Any]] | None = None,
                 mem_get_info: Callable[[int], tuple[int, int]] | None = None) -> None:
        self.device = parse_device(device)
        if budget is not None:
            parse_budget(budget, total=1 << 40)   # validate now: the device total comes later
        self._budget_arg = budget
        self._live = is_auto(budget)
        self.budget_bytes = 0
        self.sampler = sampler
        self.on_event = on_event
        self._memory_stats = memory_stats
        self._mem_get_info = mem_get_info
        self._installed = False
        self._advised = False
        self._fraction_set = False
        self._allocator: str | None = None   # resolved at install
        self.ooms_observed: list[dict[str, int]] = []
        self._model: Any = None
        self.last: dict[str, Any] | None = None
        self.level = Level.OK

    @property
    def allocator(self) -> str:
        """``"memguard"`` or ``"native"``: whose counters this governor reads
        (fixed from :meth:`install` on: the allocator cannot change once CUDA
        memory was allocated)."""
        if self._allocator is not None:
            return self._allocator
        return "memguard" if self._memory_stats is None and allocator_name() == "memguard" \
            else "native"

    def install(self) -> Governor:
        """Resolve the device, apply the budget and attach the OOM observer.
        Idempotent."""
        global _observer_attached
        if self._installed:
            return self
        self.device = _ordinal(self.device)
        self._allocator = None
        self._allocator = self.allocator
        total = self._total()
        if self._live:
            self._follow_device()
        elif self._budget_arg is not None and total:
            self.budget_bytes = parse_budget(self._budget_arg, total=total)
            if self._memory_stats is None:
                self._apply_budget(total)
        with _lock:
            if self._memory_stats is None and self.allocator == "native" and \
                    not _observer_attached:
                torch = sys.modules.get("torch")
                attach = getattr(getattr(torch, "_C", None), "_cuda_attach_out_of_memory_observer",
                                 None)
                if attach is not None:
                    try:
                        attach(_on_native_oom)
                        _observer_attached = True
                    except RuntimeError:   # an allocator without observers
                        pass
            _governors.append(self)
        self._installed = True
        return self

    def uninstall(self) -> None:
        """Stop reporting; a budget applied as a memory fraction is lifted."""
        if not self._installed:
            return
        self._installed = False
        with _lock:
            if self in _governors:
                _governors.remove(self)
        if self._fraction_set:
            torch = sys.modules.get("torch")
            if torch is not None:
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            self._fraction_set = False

    def _follow_device(self) -> None:
        """The live ``"auto"`` budget: what this process holds on the
        device (its allocator's reserved bytes) plus what is free there;
        applied when it moved by more than a 32nd. No reserve is taken
        here: the planner's margin is the one reserve."""
        free, total = self._info()
        if not total:
            return
        ms = self._stats()
        held = int(ms.get("reserved_bytes.current", ms.get("reserved_bytes.all.current", 0)) or 0)
        live = max(1, held + free)
        old = self.budget_bytes
        if not old or abs(live - old) * 32 > max(live, old):
            self.budget_bytes = live
            if self._memory_stats is None:
                self._apply_budget(total)

    def _apply_budget(self, total: int) -> None:
        torch = _torch()
        if self.allocator == "memguard":
            _C.cuda_set_budget(self.device, self.budget_bytes)
        else:
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, self.budget_bytes / total), self.device)
            self._fraction_set = True

    def _total(self) -> int:
        try:
            return int(self._info()[1])
        except (RuntimeError, AssertionError):   # no device to ask
            return 0

    def _info(self) -> tuple[int, int]:
        if self._mem_get_info is not None:
            return self._mem_get_info(self.device)
        torch = _torch()
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def _stats(self) -> Mapping[str, Any]:
        if self._memory_stats is not None:
            return self._memory_stats(self.device)
        if self.allocator == "memguard":
            return _C.cuda_stats(self.device)
        return _torch().cuda.memory_stats(self.device)

    def counters(self) -> dict[str, Any]:
        """The counters a push hands the sampler."""
        ms = self._stats()
        keys = _MEMGUARD_KEYS if "allocated_bytes.current" in ms else _NATIVE_KEYS
        c: dict[str, Any] = {k: int(ms.get(src, 0) or 0) for k, src in keys.items()}
        free, total = self._info()
        c.update(device=int(self.device or 0), free_bytes=int(free), total_bytes=int(total),
                 budget_bytes=self.budget_bytes)
        return c

    def push(self) -> Level:
        """Read the counters and hand them to the sampler (at a step
        boundary). Returns the level of the CUDA signals; without a sampler
        it is judged by the same C model through a private one."""
        if not self._installed:
            self.install()
        if self._live:
            self._follow_device()
        c = self.counters()
        sampler = self.sampler if self.sampler is not None else self._model_sampler()
        self.level = sampler.push_cuda(c)
        self.last = c
        self._advise(c)
        return self.level

    def _model_sampler(self) -> Any:
        """This governor's own never-started sampler, whose pressure model
        judges its pushes when it has no sampler (its own: a baseline of
        retries is one governor's, never another's)."""
        if self._model is None:
            from memguard.telemetry.sampler import Sampler

            self._model = Sampler(interval_ms=1000)
        return self._model

    def _advise(self, c: Mapping[str, int]) -> None:
        """Once: recommend expandable_segments where fragmentation shows:
        the peaks, not the figures between steps (where reserved is above
        allocated by design: the step's freed activations stay cached)."""
        if self._advised or self.allocator == "memguard":
            return
        allocated, reserved = c["allocated_peak_bytes"], c["reserved_peak_bytes"]
        if not cuda_advice.fragmented(allocated, reserved):
            return
        self._advised = True
        found, advice = cuda_advice.expandable_segments_advice(allocated, reserved)
        if self.on_event is not None:
            self.on_event(Event.CUDA_ADVICE, {"found": found, "advice": advice,
                                          "allocated_bytes": allocated,
                                          "reserved_bytes": reserved})
        if not any(cuda_advice.expandable_on(os.environ.get(v))
                   for v in cuda_advice.ALLOC_CONF_VARS):
            warnings.warn(f"memguard: {found}. {advice}", RuntimeWarning, stacklevel=3)

    def _observe_oom(self, device: int, alloc: int, device_allocated: int,
                     device_free: int) -> None:
        ev = {"device": device, "alloc_bytes": alloc, "device_allocated_bytes": device_allocated,
              "device_free_bytes": device_free}
        self.ooms_observed.append(ev)
        if self.on_event is not None:
            self.on_event(Event.CUDA_OOM, ev)


def govern(budget: str | int | None = None, device: Any = "cuda") -> Governor:
    """Put PyTorch's CUDA caching allocator under a budget and watch it: a
    started :class:`Governor` (call its ``uninstall`` to lift the budget).
    A :class:`memguard.Guard` starts its own; this is for scripts without
    one.

    Args:
        budget: ``None`` (watch only), a size (``"20GiB"``), a share of the
            device (``"75%"``), bytes, or ``"auto"`` (live: see
            :class:`Governor`).
        device: ``"cuda"`` (the current device), ``"cuda:N"`` or ``N``.

    Raises:
        RuntimeError: torch is not imported, or there is no CUDA device.
        ValueError: a bad budget or device.
    """
    gov = Governor(device, budget)
    torch = _torch()
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device here (torch.cuda.is_available() is False): "
                           "there is no CUDA allocator to govern")
    return gov.install()


# -- recorded traces ------------------------------------------------------------

def record(path: str | os.PathLike, device: Any = "cuda") -> dict[str, Any]:
    """Append one reading of ``torch.cuda.memory_stats()`` and
    ``torch.cuda.mem_get_info()`` to a JSONL trace (call it at step
    boundaries of a real run); tests replay such traces through
    :class:`Governor`. Returns the record."""
    torch = _torch()
    dev = _ordinal(parse_device(device))
    free, total = torch.cuda.mem_get_info(dev)
    rec = {"device": dev, "memory_stats": dict(torch.cuda.memory_stats(dev)),
           "mem_get_info": [int(free), int(total)]}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def load_trace(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a trace written by :func:`record` (or a fixture in its format)."""
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                out.append(json.loads(line))
    return out


class Replay:
    """Feeds a recorded trace to a :class:`Governor`, one record per push:
    ``Governor(memory_stats=r.memory_stats, mem_get_info=r.mem_get_info)``,
    then :meth:`advance` between pushes."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        if not records:
            raise ValueError("an empty trace cannot be replayed")
        self.records = records
        self.i = 0

    def memory_stats(self, device: int) -> Mapping[str, Any]:
        return self.records[self.i]["memory_stats"]

    def mem_get_info(self, device: int) -> tuple[int, int]:
        free, total = self.records[self.i]["mem_get_info"]
        return int(free), int(total)

    def advance(self) -> bool:
        """Move to the next record; False at the end (the last one stays)."""
        if self.i + 1 < len(self.records):
            self.i += 1
            return True
        return False
