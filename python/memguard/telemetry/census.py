"""A census of what the process holds: its live tensors by kind, and its
other Python objects by type, so that a drift forecast can name what grows.

:func:`take` makes one pass over ``gc.get_objects()``; :func:`growing`
compares two censuses and names the groups that grew, largest first. The
census sees what the garbage collector tracks: every tensor that has a
Python object (PyTorch keeps that object alive as long as C++ holds the
tensor, so the activations an autograd graph saved are seen too), and
container objects (not ints, floats or strings, nor dicts and tuples that
hold only those).

It leaves the user's objects as they were: it keeps no reference to any of
them, never runs a collection and never reads a tensor's data. Reading the
size of a tensor's storage gives the storage a Python object that lives as
long as the storage does (PyTorch's rule for every storage it hands out), so
storages are left out of the object counts and counted through their
tensors. torch is never imported here: without it in ``sys.modules`` there
are no tensors to count.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import itertools
import operator
import sys
import time
from typing import Any

# Tensor group key: (device, dtype, shape, holds_graph). Shape is None, and
# device or dtype "?", where a tensor would not say.
TensorKey = tuple

_OBJECT, _TENSOR, _SUBCLASS, _STORAGE, _CENSUS = range(5)
# The C getters of a type's own name: a metaclass cannot intercept them.
_TYPE_MODULE = type.__dict__["__module__"].__get__
_TYPE_QUALNAME = type.__dict__["__qualname__"].__get__
_READ = operator.attrgetter("device", "dtype", "shape", "is_leaf")
_count_elements = collections._count_elements        # Counter's own counting loop


@dataclasses.dataclass(frozen=True)
class Census:
    """What the process held at one step.

    Attributes:
        step: the step it was taken at.
        seconds: what taking it cost (wall time).
        tensors: ``(device, dtype, shape, holds_graph) -> (count, bytes)``,
            e.g. ``("cpu", "float32", (64, 4096), True) -> (412, 432013312)``;
            ``holds_graph``: the tensor has a ``grad_fn``. Bytes are storage
            bytes, each storage counted once, in the group of the tensor
            that covers most of it (a view's base before its views); 0 where
            no memory is held or none can be read (meta, sparse, fake and
            wrapper tensors). A nested tensor's shape is None.
        objects: module-qualified type name (bare for builtins) -> count of
            the other gc-tracked objects, tensors and storages left out.
    """

    __slots__ = ("objects", "seconds", "step", "tensors")
    step: int
    seconds: float
    tensors: dict
    objects: dict


def take(step: int) -> Census:
    """One pass over ``gc.get_objects()``: the live tensors grouped by
    device, dtype, shape and whether they hold an autograd graph, with
    their storage bytes; and the other objects counted by type.

    Objects the census cannot read (types that raise on attribute access,
    tensor subclasses, meta, sparse, nested or fake tensors) are counted
    with what could be read, and 0 bytes; it never raises for them. Earlier
    censuses still alive are not counted. Automatic collection is held off
    while it runs and restored after.

    Args:
        step: the step to record it at.

    Returns:
        The :class:`Census`.
    """
    t0 = time.perf_counter()
    enabled = gc.isenabled()
    gc.disable()                  # no collection may untrack what is being counted
    try:
        tensors, objects = _count()
    except Exception:  # noqa: BLE001 - a census never fails the run it watches
        tensors, objects = {}, {}
    finally:
        if enabled:
            gc.enable()
    return Census(step, time.perf_counter() - t0, tensors, objects)


def _count() -> tuple[dict, dict]:
    """The census's two tables, from one snapshot of the tracked objects.

    Each object is touched once, to read its type; the rest works on the
    list of types: counted at C speed, and the few types the census reads
    (tensors, earlier censuses) found in it by identity.
    """
    objs = gc.get_objects()
    types = list(map(type, objs))
    counts = _type_counts(types)
    torch = sys.modules.get("torch")
    kinds = {t: _kind(t, torch) for t in counts}
    fast, careful, censuses = [], [], []
    for t, k in kinds.items():
        if k in (_TENSOR, _SUBCLASS, _CENSUS):
            found = _of_type(objs, types, t, counts[t])
            (fast if k == _TENSOR else careful if k == _SUBCLASS else censuses).extend(found)
    del objs, types
    tensors = _tensor_groups(fast, careful, torch) if fast or careful else {}
    for c in censuses:
        _discount(c, counts)
    objects: dict[str, int] = {}
    for t, n in counts.items():
        if kinds[t] in (_OBJECT, _CENSUS) and n > 0:
            name = _type_name(t)
            objects[name] = objects.get(name, 0) + n
    return tensors, objects


class _Unhashable:
    """Stands for the types a metaclass made unhashable, in the counts."""


def _type_counts(types: list) -> dict:
    """How many objects of each type; types that cannot be hashed (their
    metaclass defines ``__eq__`` without ``__hash__``) counted together.

    Counted by ``Counter``'s own C helper: ``Counter(types)`` would first ask
    whether a list is a Mapping, and that question leaves negative-cache
    entries in the ABCs below Mapping, objects the next census would count
    as grown."""
    counts: dict = {}
    try:
        _count_elements(counts, types)
        return counts
    except Exception:  # noqa: BLE001 - such a metaclass: rare, so the slow way
        counts = {}
        for t in types:
            try:
                counts[t] = counts.get(t, 0) + 1
            except Exception:  # noqa: BLE001
                counts[_Unhashable] = counts.get(_Unhashable, 0) + 1
        return counts


def _of_type(objs: list, types: list, t: type, n: int) -> list:
    """The ``n`` objects of exactly type ``t``: ``list.index`` finds them
    by identity in one pass that ends at the last of them."""
    out, i = [], -1
    try:
        for _ in range(n):
            i = types.index(t, i + 1)
            out.append(objs[i])
        return out
    except Exception:  # noqa: BLE001 - a metaclass's __eq__ raised: by identity alone
        return list(itertools.compress(objs, map(operator.is_, types, itertools.repeat(t))))


def _kind(t: type, torch: Any) -> int:
    """How the census treats objects of type ``t``, decided once a type."""
    if t is Census:
        return _CENSUS
    if torch is None:
        return _OBJECT
    try:
        if type.__subclasscheck__(torch._C.TensorBase, t):
            return _TENSOR if t is torch.Tensor or t is torch.nn.Parameter else _SUBCLASS
        if type.__subclasscheck__(torch._C.StorageBase, t) or \
                type.__subclasscheck__(torch.storage.TypedStorage, t):
            return _STORAGE
    except Exception:  # noqa: BLE001 - a torch half imported, or without these names
        return _OBJECT
    return _OBJECT


def _type_name(t: type) -> str:
    """``dict`` for builtins, ``package.module.Class`` for the rest."""
    if t is _Unhashable:
        return "(unhashable type)"
    try:
        module, name = _TYPE_MODULE(t), _TYPE_QUALNAME(t)
    except Exception:  # noqa: BLE001 - a type that will not say its name
        return "?"
    if type(name) is not str:
        return "?"
    return name if type(module) is not str or module == "builtins" else f"{module}.{name}"


def _discount(census: Census, counts: dict) -> None:
    """Take an earlier census's own tracked containers out of the counts
    (by type)."""
    mine = [census, census.tensors, census.objects]
    if type(census.tensors) is dict:       # one built by hand may hold anything
        for key, value in census.tensors.items():
            mine += [key, value, key[2]] if type(key) is tuple and len(key) == 4 else [key, value]
    for x in mine:
        if gc.is_tracked(x) and counts.get(type(x), 0) > 0:
            counts[type(x)] -= 1


def _tensor_groups(fast: list, careful: list, torch: Any) -> dict:
    """Count the tensors by group and size their storages, each once."""
    counts: dict = {}
    stores: dict[int, list] = {}          # id(storage) -> [bytes, group, tensor, cover]
    for o in fast:
        try:
            raw = _READ(o)
            n = counts.get(raw, 0)         # hashes the key: raises here if it cannot be
            st = o.untyped_storage()
            sid = id(st)                   # its object lives as long as the storage does
            first = sid not in stores
            nbytes = st.nbytes() if first else 0
        except Exception:  # noqa: BLE001 - e.g. a sparse tensor: no storage to read
            _tally(_careful_read(o, torch), o, counts, stores)
            continue
        counts[raw] = n + 1
        if first:
            stores[sid] = [nbytes, raw, o, None]
        else:
            _store(stores, sid, 0, raw, o)
    if careful:
        ctx = getattr(torch._C, "DisableTorchFunctionSubclass", contextlib.nullcontext)
        with ctx():
            for o in careful:
                _tally(_careful_read(o, torch), o, counts, stores)
    sizes: dict = collections.Counter()
    for nbytes, raw, _, _ in stores.values():
        sizes[raw] += nbytes
    out: dict = {}
    for raw, n in counts.items():
        key = _group(raw)
        held = 0 if key[0] == "meta" else sizes.get(raw, 0)
        c0, b0 = out.get(key, (0, 0))
        out[key] = (c0 + n, b0 + held)
    return out


def _tally(read: tuple, o: Any, counts: dict, stores: dict) -> None:
    """Count a tensor read the careful way, and its storage."""
    raw, sid, nbytes = read
    counts[raw] = counts.get(raw, 0) + 1
    _store(stores, sid, nbytes, raw, o)


def _store(stores: dict, sid: int | None, nbytes: int, raw: tuple, o: Any) -> None:
    """Count a storage once, in the group of the tensor covering most of it."""
    if sid is None:
        return
    entry = stores.get(sid)
    if entry is None:
        stores[sid] = [nbytes, raw, o, None]
        return
    if entry[3] is None:
        entry[3] = _cover(entry[2])
    cover = _cover(o)
    if cover > entry[3]:
        entry[1], entry[2], entry[3] = raw, o, cover


def _cover(o: Any) -> int:
    """The bytes a tensor's own elements span; 0 where it will not say."""
    try:
        return int(o.nbytes)
    except Exception:  # noqa: BLE001
        return 0


def _careful_read(o: Any, torch: Any) -> tuple[tuple, int | None, int]:
    """A tensor of a subclass, or one that raised: each field read apart
    through the base class's own getters, with what it would not say left
    unknown; its storage sized only where it holds memory: not on the meta
    device (a fake tensor's), not where no data was ever allocated (a
    wrapper subclass's)."""
    base = torch._C.TensorBase
    raw = tuple(_field(base, name, o) for name in ("device", "dtype", "shape", "is_leaf"))
    try:
        st = base.untyped_storage(o)
        if st.device.type == "meta" or not st.data_ptr():
            return raw, None, 0
        return raw, id(st), st.nbytes()
    except Exception:  # noqa: BLE001 - no storage: sparse, a wrapper subclass
        return raw, None, 0


def _field(base: type, name: str, o: Any) -> Any:
    try:
        v = base.__dict__[name].__get__(o)
        hash(v)
        return v
    except Exception:  # noqa: BLE001
        return True if name == "is_leaf" else None


def _group(raw: tuple) -> TensorKey:
    """A raw ``(device, dtype, shape, is_leaf)`` as the census's key: plain
    strings and ints, nothing of torch's kept."""
    device, dtype, shape, is_leaf = raw
    dev = "?" if device is None else _text(device)
    dt = "?" if dtype is None else _text(dtype).replace("torch.", "", 1)
    if shape is not None:
        try:
            shape = tuple(d if type(d) is int else _text(d) for d in shape)
        except Exception:  # noqa: BLE001 - a nested tensor's shape
            shape = None
    return (dev, dt, shape, not is_leaf)


def _text(v: Any) -> str:
    try:
        return str(v)
    except Exception:  # noqa: BLE001
        return "?"


# ------------------------------------------------------------------ growth
def growing(before: Census, after: Census, top: int = 2) -> list[dict]:
    """The groups that grew from ``before`` to ``after``, largest first, at
    most ``top``.

    Tensor groups come before Python objects. Among tensor groups, a group
    of tensors that hold autograd graphs and grows by one or more a step
    comes first (the graph keeps activations the census cannot see), then
    the most added bytes; Python objects by the most added. A group grew
    when it holds more tensors or objects than before.

    Returns:
        ``{"what", "kind", "count", "added", "per_step", "bytes",
        "added_bytes"}`` each: ``what`` in words (``"412 tensors of (64,
        4096) float32 that hold autograd graphs, +1 a step"``), ``kind``
        ``"tensors"`` or ``"objects"``, ``count`` and ``bytes`` now (bytes 0
        for objects), ``per_step`` the added count over the steps between
        them (the added count itself where ``after.step`` is not later).
    """
    steps = after.step - before.step
    per = steps if steps > 0 else 1
    rows = []
    for key, (n, b) in after.tensors.items():
        n0, b0 = before.tensors.get(key, (0, 0))
        if n > n0:
            rows.append(_row("tensors", key, n, n - n0, (n - n0) / per, b, b - b0, steps))
    for name, n in after.objects.items():
        n0 = before.objects.get(name, 0)
        if n > n0:
            rows.append(_row("objects", name, n, n - n0, (n - n0) / per, 0, 0, steps))
    rows.sort(key=_rank)
    return [{k: v for k, v in r.items() if k != "_graph"} for r in rows[:max(top, 0)]]


def _row(kind: str, key: Any, n: int, added: int, per_step: float, nbytes: int,
         added_bytes: int, steps: int) -> dict:
    rate = f"+{_rate(per_step)} {'a step' if steps > 0 else 'since the last census'}"
    if kind == "tensors":
        what, graph = f"{_tensors_in_words(key, n)}, {rate}", bool(key[3])
    else:
        what, graph = f"{n:,} {key} object{'' if n == 1 else 's'}, {rate}", False
    return {"what": what, "kind": kind, "count": n, "added": added, "per_step": per_step,
            "bytes": nbytes, "added_bytes": added_bytes, "_graph": graph}


def _rank(r: dict) -> tuple:
    if r["kind"] == "tensors":
        return (0, not (r["_graph"] and r["per_step"] >= 1), -r["added_bytes"], -r["added"],
                r["what"])
    return (1, False, 0, -r["added"], r["what"])


def _tensors_in_words(key: TensorKey, n: int) -> str:
    """``412 tensors of (64, 4096) float32 on cuda:0 that hold autograd graphs``."""
    device, dtype, shape, graph = key
    one = n == 1
    text = f"{n:,} tensor{'' if one else 's'} of {'unknown shape' if shape is None else shape}"
    text += f" {dtype}" + ("" if device == "cpu" else f" on {device}")
    if graph:
        text += " that holds an autograd graph" if one else " that hold autograd graphs"
    return text


def _rate(x: float) -> str:
    """``1``, ``1,200``, ``2.5``, ``0.33``: a count a step as people read it."""
    if x == int(x):
        return f"{int(x):,}"
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}" if x >= 1 else f"{x:.2g}"
