"""What a step puts back when it is redone or rolled back, besides its
gradients and the optimizer's update.

* :class:`Snapshot`: what ``restore=`` lists (modules' buffers, tensors,
  objects with ``state_dict``) and the RNG, as they were when the attempts
  began. A module's buffers are kept by name: a forward that reassigns one
  (``self.seen = self.seen + n``, a queue rebuilt with ``torch.cat``, DINO's
  center) leaves the module holding a new tensor, and the snapshot puts the
  original one back, with its values.
* :class:`PreStepUndo`: what ``pre_step`` wrote (MoCo's momentum update of
  the key encoder), whether or not ``restore=`` lists it. A redone step
  keeps it (the snapshot is taken after ``pre_step``); a rolled-back step
  undoes it. Writes are recorded as ``pre_step`` makes them: before an
  operation writes a tensor in place for the first time, the tensor's
  storage is copied; a tensor whose ``.data`` ``pre_step`` reassigns keeps
  its old data aside. Its cost: a copy of what ``pre_step`` writes (or the
  old data it replaced), until the step ends, and a Python call per tensor
  operation inside ``pre_step``. That copy is memguard's own memory, and
  gives way: when it cannot be made, or the optimizer step needs the room,
  it is dropped, and a step rolled back after that keeps what ``pre_step``
  did, with a warning. A module attribute ``pre_step`` reassigns (a buffer
  set to a new tensor) and Python state (a learning rate) are not recorded.
"""
from __future__ import annotations

import copy
import threading
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Snapshot:
    """State a failed attempt may have changed: buffers of the modules in
    ``restore``, listed tensors, objects with ``state_dict``, and the RNG."""

    def __init__(self, restore: Any) -> None:
        items = restore if isinstance(restore, (list, tuple)) else (restore,)
        # (owner module, name in it, qualified name, the buffer, its values)
        self._buffers: list[tuple[torch.nn.Module, str, str, torch.Tensor, torch.Tensor]] = []
        self._watched: list[int] = []      # indices into _buffers: warned about when changed
        self._saved: list[tuple[Any, Any]] = []
        with torch.no_grad():
            for obj in items:
                if isinstance(obj, torch.nn.Module):
                    self._take_module(obj)
                elif isinstance(obj, torch.Tensor):
                    self._saved.append((obj, obj.detach().clone()))
                elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
                    self._saved.append((obj, copy.deepcopy(obj.state_dict())))
                else:
                    raise TypeError("restore= takes modules (their buffers), tensors, or "
                                    "objects with state_dict/load_state_dict, not "
                                    f"{type(obj).__name__}")
        self.rng = Rng()

    def _take_module(self, module: torch.nn.Module) -> None:
        """Its buffers by name; all but normalisation statistics (BatchNorm's
        differ with the split by design) are watched."""
        for mname, m in module.named_modules():
            norm = isinstance(m, torch.nn.modules.batchnorm._NormBase)
            for bname, b in m._buffers.items():
                if b is None:
                    continue
                name = f"{type(module).__name__}.{mname + '.' if mname else ''}{bname}"
                if not norm:
                    self._watched.append(len(self._buffers))
                self._buffers.append((m, bname, name, b, b.detach().clone()))

    def changed(self) -> list[str]:
        """Names of watched buffers that differ from what they were, in
        value or in identity (reassigned)."""
        changed: list = []
        with torch.no_grad():
            for i in self._watched:
                m, bname, _, b, saved = self._buffers[i]
                now = m._buffers.get(bname)
                same = now is b and now.shape == saved.shape
                changed.append((now != saved).any() if same else True)
            changed = _read_flags(changed)
        return [self._buffers[i][2] for i, f in zip(self._watched, changed) if f]

    def restore(self) -> None:
        """Everything as it was when the snapshot was taken (allocating
        nothing for modules' buffers and listed tensors)."""
        with torch.no_grad():
            for m, bname, _, b, saved in self._buffers:
                if m._buffers.get(bname) is not b:
                    m._buffers[bname] = b
                _copy_back(b, saved)
            for obj, saved in self._saved:
                if isinstance(obj, torch.Tensor):
                    _copy_back(obj, saved)
                else:
                    obj.load_state_dict(copy.deepcopy(saved))
        self.rng.restore()


def _read_flags(flags: list) -> list[bool]:
    """Bools from bools and 0-d bool tensors, read from each device once
    (whether any is set), not once per tensor as ``torch.equal`` would;
    each flag apart only where one is set."""
    out = [f if isinstance(f, bool) else False for f in flags]
    by_device: dict[torch.device, list[int]] = {}
    for k, f in enumerate(flags):
        if not isinstance(f, bool):
            by_device.setdefault(f.device, []).append(k)
    for ks in by_device.values():
        stacked = torch.stack([flags[k] for k in ks])
        if stacked.any().item():
            for k, f in zip(ks, stacked.tolist()):
                out[k] = bool(f)
    return out


def _copy_back(t: torch.Tensor, saved: torch.Tensor) -> None:
    if t.shape != saved.shape:             # resized in place
        t.resize_(saved.shape)
    t.copy_(saved)


class Rng:
    """The CPU generator's state, and every CUDA device's where CUDA is
    initialised (touching CUDA here would initialise it, which a CPU run
    must not pay for; a model or batch on the GPU has initialised it)."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


class PreStepUndo:
    """``pre_step`` run once, with what it writes recorded so that
    :meth:`undo` can put it back (see the module docs). A write it cannot
    record (a copy that runs out of memory, a tensor without a storage of
    its own) stops the recording: ``pre_step`` goes on as in a plain loop,
    and :attr:`complete` says that an undo would not be whole."""

    def __init__(self) -> None:
        self.rng = Rng()
        self._storages: dict[tuple[str, int], tuple[Any, Any]] = {}
        self._data: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.complete = True

    def run(self, pre_step: Callable[[], Any]) -> None:
        with _DataLog(self._data), _WriteLog(self):
            pre_step()

    def give_up(self) -> None:
        """Stop recording and free what was kept (memory is short): a
        rolled-back step will leave what ``pre_step`` did."""
        self._storages.clear()
        self._data.clear()
        self.complete = False

    def undo(self) -> bool:
        """Everything ``pre_step`` wrote, and the RNG, as before it; whether
        that was whole (see :attr:`complete`)."""
        if not self.complete:
            return False
        with torch.no_grad():
            for storage, saved in self._storages.values():
                storage.copy_(saved)
            for t, old in reversed(self._data):
                _DATA.__set__(t, old)
        self.rng.restore()
        return True


#: the C descriptor behind every tensor's ``.data``
_DATA = torch._C.TensorBase.__dict__["data"]


class _DataLog:
    """Records, for every tensor whose ``.data`` this thread reassigns while
    it is active, the data it had. ``.data = ...`` is no tensor operation
    (no dispatch mode sees it): ``torch.Tensor.data`` is shadowed by a
    property while any thread records, and put back after the last one;
    the property logs into the list of the thread that sets, if it records."""

    _lock = threading.Lock()      # guards _users and the shadowing property
    _users = 0                    # threads recording now
    _local = threading.local()    # .log: this thread's list while it records

    def __init__(self, log: list) -> None:
        self.log = log

    def __enter__(self) -> _DataLog:
        cls = type(self)
        with cls._lock:
            if not cls._users:
                torch.Tensor.data = property(_DATA.__get__, _reassign)
            cls._users += 1
        cls._local.log = self.log
        return self

    def __exit__(self, *exc: object) -> None:
        cls = type(self)
        cls._local.log = None
        with cls._lock:
            cls._users -= 1
            if not cls._users and isinstance(torch.Tensor.__dict__.get("data"), property):
                del torch.Tensor.data


def _reassign(t: torch.Tensor, value: torch.Tensor) -> None:
    """``t.data = value``, the old data logged where this thread records."""
    log = getattr(_DataLog._local, "log", None)
    if log is not None:
        log.append((t, _DATA.__get__(t)))
    _DATA.__set__(t, value)


class _WriteLog(TorchDispatchMode):
    """Copies each storage an operation is about to write in place, the
    first time (its schema marks the argument written: ``Tensor(a!)``)."""

    def __init__(self, undo: PreStepUndo) -> None:
        super().__init__()
        self.undo = undo

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.undo.complete:
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(t, torch.Tensor):
                        self._keep(t)
        return func(*args, **kwargs)

    def _keep(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if key not in self.undo._storages and storage.nbytes():
                self.undo._storages[key] = (storage, storage.clone())
        except Exception:          # noqa: BLE001 - out of memory, or no storage to copy
            self.undo.give_up()
