"""The census of live objects (memguard.telemetry.census): real leaks named
by what grows, a loop that keeps nothing named by nothing, storages counted
once, the user's objects left alone, odd objects survived, and the words."""
from __future__ import annotations

import ast
import gc
import sys
import warnings
import weakref

import pytest

from memguard.telemetry import census
from memguard.telemetry.census import Census, growing

from .conftest import ROOT

torch = pytest.importorskip("torch")

F32 = "float32"


def _added(before: Census, after: Census, key: tuple) -> tuple[int, int]:
    """(tensors, bytes) the group ``key`` gained from ``before`` to ``after``."""
    n0, b0 = before.tensors.get(key, (0, 0))
    n1, b1 = after.tensors.get(key, (0, 0))
    return n1 - n0, b1 - b0


# ------------------------------------------------------------------ real leaks
def test_activations_kept_with_their_graphs_are_named_first():
    """A list keeping one (63, 4096) activation (a shape no other test keeps) with its graph a step: that
    group comes first, though a detached group beside it adds more bytes."""
    w = torch.randn(256, 4096, requires_grad=True)
    x = torch.randn(63, 256)
    kept, bigger = [], []

    def step() -> None:
        kept.append(torch.tanh(x @ w))          # tanh saves its output: one (63, 4096) a step
        bigger.append(torch.zeros(63, 8192))    # twice the bytes, no graph

    step()
    before = census.take(1)
    for _ in range(6):
        step()
    after = census.take(7)
    grew = growing(before, after)
    assert [g["what"] for g in grew] == [
        "7 tensors of (63, 4096) float32 that hold autograd graphs, +1 a step",
        "7 tensors of (63, 8192) float32, +1 a step"]
    first = grew[0]
    assert first["kind"] == "tensors" and (first["count"], first["added"]) == (7, 6)
    assert first["per_step"] == 1.0
    assert (first["bytes"], first["added_bytes"]) == (7 * 63 * 4096 * 4, 6 * 63 * 4096 * 4)


def test_a_cache_of_detached_features_is_named_without_a_graph():
    w = torch.randn(32, 256, requires_grad=True)
    cache: dict[int, torch.Tensor] = {}
    x = torch.randn(62, 32)
    before = census.take(0)
    for i in range(8):
        cache[i] = torch.relu(x @ w).detach()
    after = census.take(4)                      # a census every 4 steps: 2 features a step
    grew = growing(before, after)
    assert grew[0]["what"] == "8 tensors of (62, 256) float32, +2 a step"
    assert (grew[0]["added"], grew[0]["added_bytes"]) == (8, 8 * 62 * 256 * 4)
    assert not any("graph" in g["what"] for g in grew)


def test_a_loop_that_keeps_nothing_grows_nothing():
    """Nothing grows, the censuses taken meanwhile and still held included."""
    w = torch.randn(256, 512, requires_grad=True)
    x = torch.randn(64, 256)

    def step() -> None:
        torch.tanh(x @ w).sum().backward()
        with torch.no_grad():
            w.sub_(0.1 * w.grad)
        w.grad = None

    step()
    step()
    before = census.take(2)
    for _ in range(3):
        step()
    meanwhile = census.take(5)
    for _ in range(3):
        step()
    after = census.take(8)
    assert growing(before, after, top=10) == []
    assert after.tensors == before.tensors
    assert "memguard.telemetry.census.Census" not in after.objects
    assert meanwhile.step == 5


# ------------------------------------------------------------------ storages
def test_views_share_their_storage_bytes():
    """Views are counted as tensors, their storage once: in the group of the
    base that covers it, whose Python object PyTorch keeps alive while a
    view holds it; a detached slice holds (and is charged) the whole storage."""
    before = census.take(0)
    base = torch.zeros(100, 1024)
    gc.collect(0)                               # the base is older: the census meets the views first
    rows = [base[i] for i in range(100)]
    del base                                    # the views keep it
    kept = torch.zeros(50, 512)[3].detach()     # the only tensor left on its storage
    after = census.take(1)
    assert _added(before, after, ("cpu", F32, (100, 1024), False)) == (1, 100 * 1024 * 4)
    assert _added(before, after, ("cpu", F32, (1024,), False)) == (100, 0)
    assert _added(before, after, ("cpu", F32, (512,), False)) == (1, 50 * 512 * 4)
    del rows, kept


# ------------------------------------------------------------- hands off
def test_the_census_keeps_no_reference_and_collects_nothing(monkeypatch):
    leaked = torch.randn(1000)
    tensor_ref = weakref.ref(leaked)
    node = _Node()
    node_ref = weakref.ref(node)
    refs = sys.getrefcount(leaked), sys.getrefcount(node)

    def collect(*args: object) -> int:
        raise AssertionError("the census ran a collection")

    monkeypatch.setattr(gc, "collect", collect)
    assert gc.isenabled()
    c = census.take(0)
    assert gc.isenabled()                       # held off while it ran, restored
    assert (sys.getrefcount(leaked), sys.getrefcount(node)) == refs
    del leaked, node
    assert tensor_ref() is None and node_ref() is None   # the census outlives them
    assert c.tensors[("cpu", F32, (1000,), False)][0] >= 1
    assert c.objects[f"{__name__}._Node"] == 1
    for key, value in c.tensors.items():       # nothing of torch's kept, only words and ints
        device, dtype, shape, graph = key
        assert type(device) is str and type(dtype) is str and type(graph) is bool, key
        assert shape is None or all(type(d) is int for d in shape), key
        assert all(type(v) is int for v in value), value


def test_a_process_that_turned_gc_off_keeps_it_off(monkeypatch):
    monkeypatch.setattr(gc, "get_objects", lambda: [[]])
    gc.disable()
    try:
        assert census.take(0).objects == {"list": 1}
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_without_torch_imported_there_are_only_objects(monkeypatch):
    """The module imports torch nowhere at its top level, and a census in
    a process without torch neither imports it nor counts tensors."""
    tree = ast.parse((ROOT / "python/memguard/telemetry/census.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [n for n in top if "torch" in ast.unparse(n)]
    objs = [torch.zeros(3), {}, {"k": []}]
    monkeypatch.setattr(gc, "get_objects", lambda: list(objs))
    monkeypatch.delitem(sys.modules, "torch")
    c = census.take(0)
    assert "torch" not in sys.modules
    assert c.tensors == {} and c.objects == {"torch.Tensor": 1, "dict": 2}


# ------------------------------------------------------------- odd objects
class _Node:
    """A plain object of a type no other test makes."""


class _Touchy:
    """Raises on every attribute read, ``__class__`` included."""

    def __getattribute__(self, name: str) -> object:
        raise RuntimeError(f"no {name}")


class _UnhashableMeta(type):
    def __eq__(cls, other: object) -> bool:     # and so no __hash__: its classes are unhashable
        raise RuntimeError("compared")


class _Unhashable(metaclass=_UnhashableMeta):
    pass


class _Prickly(torch.Tensor):
    """A tensor subclass whose own code raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError("torch function")

    @property
    def device(self):
        raise RuntimeError("device")


def test_odd_objects_are_counted_without_raising(monkeypatch):
    """Fed to the census as the whole snapshot: an object that raises on
    every attribute, an unhashable class, a tensor subclass whose own code
    raises, and tensors without a storage worth sizing (FakeTensor itself,
    a wrapper with a meta storage, takes 4 s to import: _Wrapper stands in)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # nested tensors warn that they are a prototype
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    plain = torch.zeros(7, 9)
    odd = [_Touchy(), _Unhashable(), _UnhashableMeta("Made", (), {}),
           plain, plain.as_subclass(_Prickly), torch.empty(1 << 20, device="meta"),
           torch.ones(1013).to_sparse(), nested, _Wrapper((61, 67)),
           torch.empty(5, device="meta").as_subclass(_Prickly)]
    monkeypatch.setattr(gc, "get_objects", lambda: list(odd))
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # nor does it make torch warn
        c = census.take(0)
    assert c.objects == {f"{__name__}._Touchy": 1, "(unhashable type)": 1,
                         f"{__name__}._UnhashableMeta": 1}
    assert c.tensors == {
        ("cpu", F32, (7, 9), False): (2, 7 * 9 * 4),   # the subclass read past its own code
        ("meta", F32, (1 << 20,), False): (1, 0),
        ("meta", F32, (5,), False): (1, 0),
        ("cpu", F32, (1013,), False): (1, 0),          # sparse: no storage to size
        ("cpu", F32, None, False): (1, 5 * 4),         # nested: its shape is no tuple
        ("cpu", "float16", (61, 67), False): (1, 0),   # a wrapper: no data of its own
    }


class _Wrapper(torch.Tensor):
    """A tensor with no data of its own, as FakeTensor and DTensor are."""

    @staticmethod
    def __new__(cls, size: tuple) -> _Wrapper:
        return torch.Tensor._make_wrapper_subclass(cls, size, dtype=torch.float16, device="cpu")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} dispatched")


# ------------------------------------------------------------------ words
def _c(step: int, tensors: dict | None = None, objects: dict | None = None) -> Census:
    return Census(step, 0.0, tensors or {}, objects or {})


def test_growing_counts_per_step_and_says_it_in_words():
    cuda = ("cuda:0", F32, (256,), False)
    graph = ("cpu", F32, (64, 4096), True)
    before = _c(10, {cuda: (3000, 3000 * 1024), graph: (402, 402 << 20)},
                {"dict": 4800, "list": 10, "tuple": 7})
    after = _c(20, {cuda: (3100, 3100 * 1024), graph: (412, 412 << 20)},
               {"dict": 5000, "list": 10, "tuple": 5, "mypkg.Record": 1})
    grew = growing(before, after, top=10)
    assert [g["what"] for g in grew] == [
        "412 tensors of (64, 4096) float32 that hold autograd graphs, +1 a step",
        "3,100 tensors of (256,) float32 on cuda:0, +10 a step",
        "5,000 dict objects, +20 a step",
        "1 mypkg.Record object, +0.1 a step"]
    assert grew[1] == {"what": grew[1]["what"], "kind": "tensors", "count": 3100, "added": 100,
                       "per_step": 10.0, "bytes": 3100 * 1024, "added_bytes": 100 * 1024}
    assert grew[2] == {"what": grew[2]["what"], "kind": "objects", "count": 5000, "added": 200,
                       "per_step": 20.0, "bytes": 0, "added_bytes": 0}
    assert growing(before, after) == grew[:2]
    assert growing(before, after, top=0) == []
    assert growing(_c(20, {cuda: (3, 0)}, {"dict": 1}), _c(30, {cuda: (2, 0)})) == []


def test_growing_ranks_graphs_then_bytes_then_counts():
    """A graph group growing by one or more a step leads whatever its
    bytes; below one a step it ranks by bytes like any other."""
    slow_graph = ("cpu", F32, (8,), True)
    big = ("cpu", F32, (1024, 1024), False)
    small = ("cpu", F32, (4,), False)
    before = _c(0, {slow_graph: (0, 0), big: (1, 4 << 20), small: (0, 0)},
                {"dict": 0, "list": 0})
    after = _c(100, {slow_graph: (10, 320), big: (3, 12 << 20), small: (500, 8000)},
               {"dict": 30, "list": 900})
    order = [g["what"] for g in growing(before, after, top=10)]
    assert order == ["3 tensors of (1024, 1024) float32, +0.02 a step",
                     "500 tensors of (4,) float32, +5 a step",
                     "10 tensors of (8,) float32 that hold autograd graphs, +0.1 a step",
                     "900 list objects, +9 a step",
                     "30 dict objects, +0.3 a step"]
    fast = _c(10, {slow_graph: (10, 320), big: (3, 12 << 20)})
    assert growing(_c(0, {big: (1, 4 << 20)}), fast)[0]["what"] == \
        "10 tensors of (8,) float32 that hold autograd graphs, +1 a step"


def test_growing_without_steps_between_is_per_census():
    one = ("cuda:1", "bfloat16", (), True)
    grew = growing(_c(5, {}), _c(5, {one: (1, 2)}))
    assert grew[0]["what"] == \
        "1 tensor of () bfloat16 on cuda:1 that holds an autograd graph, +1 since the last census"
    assert grew[0]["per_step"] == 1.0
    assert growing(_c(9, {}, {"dict": 1}), _c(5, {}, {"dict": 4}))[0]["per_step"] == 3.0
