"""memguard.train.batch: splitting batches into micro-batches and joining outputs."""
from __future__ import annotations

import dataclasses
import re
from collections import namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memguard.train import batch as _batch

B = 7
Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    names: list
    scale: float = 1.0


def _x(n: int = B) -> torch.Tensor:
    return torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)


def _y(n: int = B) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64) * 10


def _names(n: int = B) -> list:
    return [f"img{i}.jpg" for i in range(n)]


STRUCTURES = {
    "tensor": lambda n: _x(n),
    "tuple": lambda n: (_x(n), _y(n)),
    "list": lambda n: [_x(n), _y(n)],
    "dict": lambda n: {"x": _x(n), "y": _y(n)},
    "namedtuple": lambda n: Pair(_x(n), _y(n)),
    "dataclass": lambda n: Sample(_x(n), _names(n), 2.0),
    "crops": lambda n: [_x(n), _x(n) + 1, _x(n)[:, :2], _x(n)[:, :2] - 1],
    "captions": lambda n: {"x": _x(n), "captions": _names(n)},
    "scalar_leaves": lambda n: {"x": _x(n), "temp": torch.tensor(0.5), "k": 3, "tag": "run"},
    "nested": lambda n: {"a": (_x(n), {"y": _y(n), "names": _names(n), "size": (224, 224)}),
                         "b": [Pair(_x(n), _y(n))]},
}


def assert_same(a, b) -> None:
    """Structure, types and values identical (tensors compared exactly)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            assert_same(u, v)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a == b


@pytest.mark.parametrize("name", sorted(STRUCTURES))
def test_batch_size(name):
    assert _batch.batch_size(STRUCTURES[name](B)) == B
    assert _batch.batch_size(STRUCTURES[name](1)) == 1


@pytest.mark.parametrize(("n", "size", "rule", "want"), [
    (7, 2, {"multiple_of": 2}, [2, 2, 3]),        # 7 is odd: one micro-batch carries it
    (7, 3, {"multiple_of": 3}, [3, 4]),
    (13, 4, {"multiple_of": 4}, [4, 4, 5]),
    (13, 4, {}, [4, 4, 3, 2]),                    # never one sample (BatchNorm raises),
    (9, 8, {}, [7, 2]),                           # nor one above the plan where avoidable
    (14, 4, {}, [4, 4, 4, 2]),
    (12, 8, {"multiple_of": 4}, [8, 4]),          # a valid remainder stays its own
    (100, 64, {"divisor_of": 65536}, [64, 32, 4]),  # each divides the queue
    (100, 64, {"divisor_of": 65536, "least": 8}, [64, 36]),
    (96, 32, {"divisor_of": 65536}, [32, 32, 32]),
    (10, 4, {"least": 3}, [4, 3, 3]),
    (11, 4, {"multiple_of": 2, "least": 4}, [4, 7]),   # 3 left, and no pair to borrow
    (5, 1, {}, [1] * 5),                          # a planned size of one is the plan's
    (5, 8, {"multiple_of": 2}, [5]),              # the whole batch is always allowed
])
def test_micro_batch_sizes_keep_the_constraints(n, size, rule, want):
    """Every micro-batch keeps multiple_of, divisor_of and min_micro_batch
    and is never one sample of a batch of more; a remainder that cannot be
    a valid micro-batch goes into the last one, which then breaks a
    constraint only as the whole batch does."""
    sizes = _batch.Sizes(**rule)
    assert sizes.of(n, size) == want
    assert sum(want) == n
    parts = _batch.split(torch.arange(n), n, size, sizes)
    assert [len(p) for p in parts] == want
    assert torch.equal(torch.cat(parts), torch.arange(n))


@pytest.mark.parametrize("name", sorted(STRUCTURES))
@pytest.mark.parametrize("size", [1, 3, 6, 7, 100])
def test_split_concat_round_trip(name, size):
    """Micro-batches of ``size`` and the remainder, which a micro-batch of
    one sample would be: then it borrows from the last one (7 at 3 is 3, 2
    and 2)."""
    batch = STRUCTURES[name](B)
    parts = _batch.split(batch, B, size)
    sizes = [_batch.batch_size(p) for p in parts]
    want = {1: [1] * 7, 3: [3, 2, 2], 6: [5, 2], 7: [7], 100: [7]}[size]
    assert sizes == want
    starts = [sum(want[:i]) for i in range(len(want))]
    for p, start, m in zip(parts, starts, want):
        # each piece is exactly the matching slice of the whole batch
        assert_same(p, _batch.slice_(batch, start, start + m))
        assert_same(p, STRUCTURES[name](B) if m == B else _expected_slice(name, start, m))
    joined = _batch.concat(parts)
    if name == "scalar_leaves" and len(parts) > 1:
        # a 0-d leaf is not split, and concat stacks 0-d values (one per piece)
        assert torch.equal(joined.pop("temp"), torch.full((len(parts),), 0.5))
        batch.pop("temp")
    assert_same(joined, batch)


def _expected_slice(name: str, start: int, size: int):
    """Build the slice independently of _batch, from a fresh batch."""
    stop = start + size
    full = STRUCTURES[name](B)

    def cut(v):
        if isinstance(v, torch.Tensor):
            return v[start:stop] if v.dim() else v
        if isinstance(v, dict):
            return {k: cut(u) for k, u in v.items()}
        if isinstance(v, Pair):
            return Pair(cut(v.x), cut(v.y))
        if isinstance(v, Sample):
            return Sample(cut(v.x), v.names[start:stop], v.scale)
        if isinstance(v, (list, tuple)):
            if all(isinstance(u, str) for u in v):
                return v[start:stop]
            return type(v)(cut(u) for u in v)
        return v

    return cut(full)


def test_slice_keeps_structure_and_replicates_scalars():
    temp = torch.tensor(0.5)
    batch = {"x": _x(), "captions": _names(), "temp": temp, "k": 3, "tag": "run",
             "pair": Pair(_x(), _y())}
    part = _batch.slice_(batch, 2, 5)
    assert torch.equal(part["x"], _x()[2:5])
    assert part["captions"] == ["img2.jpg", "img3.jpg", "img4.jpg"]
    assert part["temp"] is temp                   # 0-d tensors are the same for every piece
    assert part["k"] == 3 and part["tag"] == "run"
    assert isinstance(part["pair"], Pair)
    assert torch.equal(part["pair"].y, torch.tensor([20, 30, 40]))


def test_split_returns_views_sharing_storage():
    x = _x(10)
    parts = _batch.split({"x": x, "pair": (x, x[:, 0])}, 10, 4)
    assert [p["x"].shape[0] for p in parts] == [4, 4, 2]
    for i, p in enumerate(parts):
        for t in (p["x"], p["pair"][0], p["pair"][1]):
            assert t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert p["x"].data_ptr() == x[i * 4].data_ptr()
    parts[1]["x"][0, 0] = -1.0                     # a write through a piece reaches the batch
    assert x[4, 0].item() == -1.0


def test_split_whole_batch_is_the_batch_itself():
    batch = {"x": _x()}
    assert _batch.split(batch, B, B)[0] is batch
    assert _batch.split(batch, B, B + 5)[0] is batch


def test_batch_size_errors():
    with pytest.raises(ValueError, match=r"\[4, 5\]"):
        _batch.batch_size({"x": torch.zeros(4, 2), "y": torch.zeros(5)})
    with pytest.raises(ValueError, match=r"\[3, 4\]"):
        _batch.batch_size((torch.zeros(4, 2), ["a", "b", "c"]))
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        _batch.batch_size({"temp": torch.tensor(1.0), "k": 3})
    with pytest.raises(ValueError, match="int"):
        _batch.batch_size(5)


def test_metadata_tuples_are_the_same_for_every_micro_batch():
    """A tuple of plain values (an image size, a split name) is metadata,
    even when its length happens to be the batch size; a list of plain
    values is per sample."""
    batch = {"x": _x(2), "meta": ("train", 224), "names": ["a.jpg", "b.jpg"]}
    assert _batch.batch_size(batch) == 2
    first, second = _batch.split(batch, 2, 1)
    assert first["meta"] == second["meta"] == ("train", 224)
    assert first["names"] == ["a.jpg"] and second["names"] == ["b.jpg"]


@pytest.mark.parametrize("where, batch", [
    ("batch", [torch.zeros(4) for _ in range(4)]),
    ("batch['x']", {"x": [torch.zeros(3, 2) for _ in range(3)], "y": torch.zeros(3)}),
    ("batch[1]", (torch.zeros(2, 5), [torch.zeros(2), torch.zeros(2)])),
])
def test_unstacked_per_sample_tensors_are_refused(where, batch):
    """A list of tensors as long as their dim 0 may be one tensor per sample
    (split along its features, it would be silently wrong): refused, naming
    where it is and the two ways out."""
    with pytest.raises(ValueError, match=rf"^{re.escape(where)} is a list of .*torch\.stack.*tuple"):
        _batch.checked_size(batch)
    _batch.batch_size(batch)               # micro-batches are not checked again


def test_batched_tensors_in_a_tuple_or_a_longer_list_split():
    crops = [torch.zeros(4, 3), torch.zeros(4, 3)]          # two crops of a batch of 4
    assert _batch.checked_size(crops) == 4
    assert _batch.checked_size(tuple(torch.zeros(3, 2) for _ in range(3))) == 3


def test_leaves_depth_first():
    x, y = _x(), _y()
    names = _names()
    got = _batch.leaves({"a": x, "b": (y, {"c": names}), "t": torch.tensor(1.0)})
    assert len(got) == 3
    assert got[0] is x and got[1] is y and got[2] is names


def test_concat_edge_cases():
    assert _batch.concat([]) is None
    only = {"x": _x()}
    assert _batch.concat([only]) is only
    # 0-d tensors (a per-micro-batch scalar) stack into one value per piece
    assert torch.equal(_batch.concat([torch.tensor(1.0), torch.tensor(2.0)]),
                       torch.tensor([1.0, 2.0]))
    # samples lists flatten; non-splittable values keep the first piece's
    got = _batch.concat([{"n": ["a"], "k": 1}, {"n": ["b", "c"], "k": 1}])
    assert got == {"n": ["a", "b", "c"], "k": 1}
    joined = _batch.concat([Pair(torch.ones(2), ["p"]), Pair(torch.zeros(1), ["q", "r"])])
    assert isinstance(joined, Pair)
    assert torch.equal(joined.x, torch.tensor([1.0, 1.0, 0.0]))
    assert joined.y == ["p", "q", "r"]
    # a tuple of plain values is metadata: the first piece's, as for an int
    meta = _batch.concat([(torch.ones(1), (224, 224)), (torch.ones(2), (224, 224))])
    assert meta[1] == (224, 224) and meta[0].shape == (3,)


def test_detach_structures():
    w = torch.ones(3, requires_grad=True)
    out = w * 2
    names = ["a", "b", "c"]
    aux = {"out": out, "pair": Pair(out, out.sum()), "list": [out], "names": names, "k": 4}
    d = _batch.detach(aux)
    assert set(d) == set(aux)
    for t in (d["out"], d["pair"].x, d["pair"].y, d["list"][0]):
        assert not t.requires_grad and t.grad_fn is None
    assert torch.equal(d["out"], out.detach())
    assert isinstance(d["pair"], Pair)
    assert d["names"] is names and d["k"] == 4
    assert out.requires_grad                       # the original keeps its graph


def test_detach_dataclass():
    w = torch.ones(2, requires_grad=True)
    d = _batch.detach(Sample(w * 3, ["a", "b"]))
    assert isinstance(d, Sample)
    assert not d.x.requires_grad and d.x.grad_fn is None
    assert torch.equal(d.x, torch.full((2,), 3.0)) and d.names == ["a", "b"]


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 200), size=st.integers(1, 250), width=st.integers(0, 3))
def test_split_property(n, size, width):
    x = torch.arange(n * max(width, 1), dtype=torch.float32).reshape(n, -1) if width \
        else torch.arange(n)
    batch = {"x": x, "names": [str(i) for i in range(n)], "t": torch.tensor(7)}
    parts = _batch.split(batch, n, size)
    sizes = [_batch.batch_size(p) for p in parts]
    assert sum(sizes) == n and (sizes == [n] or max(sizes[:-1]) <= size)
    assert sizes[-1] <= size or sizes[-1] < 2 * size == 4   # 1 left at 2 can only merge
    assert min(sizes) > 1 or size == 1 or n == 1
    assert sizes[:-2] == [size] * len(sizes[:-2])    # only the last two may differ
    for p in parts:
        assert p["names"] == [str(int(v)) for v in p["x"].reshape(len(p["names"]), -1)[:, 0]
                              // max(width, 1)]
    joined = _batch.concat(parts)
    assert torch.equal(joined["x"], x)
    assert joined["names"] == batch["names"]
    # concat of a plain tensor split is the tensor
    assert torch.equal(_batch.concat(_batch.split(x, n, size)), x)
