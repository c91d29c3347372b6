"""Guard.infer joins its micro-batches' outputs as the unsplit call returns
them, whatever the split, or refuses them by name: with real torch models,
each split forced by a fixed micro-batch size and compared with the same
call over the whole batch."""
from __future__ import annotations

import dataclasses
import re

import pytest

torch = pytest.importorskip("torch")

from memguard import Guard

N = 12
CLASSES = 3
CPU_OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes"
SPLITS = [2, 3, 5, 7]            # 6 x 2; 4 x 3 (dim 0 of a 3x3 matrix); 5, 5, 2; 7, 5


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, CLASSES)).eval()


@pytest.fixture(scope="module")
def batch() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"x": torch.randn(N, 6, generator=g), "y": torch.randint(0, CLASSES, (N,), generator=g),
            "name": [f"s{i}" for i in range(N)]}


def whole(batch: dict, fn, **kw):
    """The unsplit call: a guard's first infer runs the batch whole."""
    guard = Guard(budget=None, allocator=False)
    out = guard.infer(batch, fn, **kw)
    assert guard.micro_batch == 0          # no split was planned
    return out


def split(batch: dict, fn, micro: int, **kw):
    return Guard(budget=None, micro_batch=micro, allocator=False).infer(batch, fn, **kw)


def counted(fn):
    """``fn``, recording the size of each micro-batch it runs on."""
    def run(mb):
        run.sizes.append(len(mb["y"]))
        return fn(mb)
    run.sizes = []
    return run


def metrics(model):
    """What a validation loop returns: per-sample predictions and names, and
    metrics of the micro-batch (a count, a Python accuracy, a 0-d mean loss,
    a confusion matrix)."""
    def fn(mb):
        logits = model(mb["x"])
        pred = logits.argmax(1)
        return {"logits": logits, "name": mb["name"],
                "n_correct": int((pred == mb["y"]).sum()),
                "acc": float((pred == mb["y"]).float().mean()),
                "loss": torch.nn.functional.cross_entropy(logits, mb["y"]),
                "confusion": torch.bincount(mb["y"] * CLASSES + pred,
                                            minlength=CLASSES ** 2).reshape(CLASSES, CLASSES)}
    return fn


RULES = {"n_correct": "sum", "acc": "mean", "loss": "mean", "confusion": "sum"}


@pytest.mark.parametrize("micro", SPLITS)
def test_metrics_with_rules_equal_the_unsplit_call(model, batch, micro):
    fn = counted(metrics(model))
    want = whole(batch, fn, combine=RULES)
    fn.sizes.clear()
    got = split(batch, fn, micro, combine=RULES)
    assert len(fn.sizes) > 1 and sum(fn.sizes) == N
    assert got.keys() == want.keys()
    torch.testing.assert_close(got["logits"], want["logits"])
    assert got["name"] == want["name"] == batch["name"]
    assert got["n_correct"] == want["n_correct"]
    assert got["acc"] == pytest.approx(want["acc"])
    assert got["loss"].shape == () and torch.isclose(got["loss"], want["loss"])
    assert torch.equal(got["confusion"], want["confusion"])
    assert int(got["confusion"].sum()) == N


@pytest.mark.parametrize("leaf, why, micro", [
    (leaf, why, micro) for leaf, why in [
        ("n_correct", "an int"), ("acc", "a float"), ("loss", "a 0-d tensor"),
        ("confusion", "a tensor of shape (3, 3) in a micro-batch of ")]
    for micro in [None, *SPLITS] if (leaf, micro) != ("confusion", 3)])
def test_leaves_that_are_not_per_sample_are_refused_by_name(model, batch, micro, leaf, why):
    """Refused split or whole (at the first call, not when memory runs
    short); a 3x3 matrix over micro-batches of 3 looks per-sample (see the
    next test)."""
    full = metrics(model)

    def fn(mb):
        out = full(mb)
        return {"logits": out["logits"], leaf: out[leaf]}

    call = (lambda: whole(batch, fn)) if micro is None else (lambda: split(batch, fn, micro))
    expected = "a tensor of shape (3, 3) in a micro-batch of 12" if micro is None and \
        leaf == "confusion" else why
    with pytest.raises(TypeError, match=rf"^out\['{leaf}'\] is {re.escape(expected)}.*"
                                        rf"per sample.*combine="):
        call()


def test_the_rule_wins_over_a_shape_that_looks_per_sample(model, batch):
    """Over micro-batches of 3, the 3x3 matrix would be concatenated to 12x3
    by its shape; its rule sums it, as the unsplit call counts."""
    fn = metrics(model)
    want = whole(batch, fn, combine=RULES)["confusion"]
    assert torch.equal(split(batch, fn, 3, combine=RULES)["confusion"], want)
    only = split(batch, lambda mb: {"confusion": fn(mb)["confusion"]}, 3)
    assert only["confusion"].shape == (N, CLASSES)


@pytest.mark.parametrize("micro", SPLITS)
def test_a_mean_is_weighted_by_micro_batch_size(model, batch, micro):
    """A 0-d mean loss, returned bare: 'mean' gives the whole batch's mean
    (not a mean of means, not one value per micro-batch)."""
    def fn(mb):
        return torch.nn.functional.cross_entropy(model(mb["x"]), mb["y"])

    want = whole(batch, fn, combine="mean")
    got = split(batch, fn, micro, combine="mean")
    assert got.shape == () and torch.isclose(got, want)
    with pytest.raises(TypeError, match=r"^out is a 0-d tensor"):
        split(batch, fn, micro)


def test_a_tensor_in_some_micro_batches_and_none_in_others_is_refused(model, batch):
    """The unsplit call returns a tensor (the batch has a sample of class 0);
    a micro-batch with none returns None."""
    y = torch.tensor([0, 1, 2, 1, 2, 1, 2, 2, 0, 1, 0, 2])
    b = {**batch, "y": y}

    def fn(mb):
        logits = model(mb["x"])
        zeros = mb["y"] == 0
        return {"logits": logits, "zero_logits": logits[zeros] if zeros.any() else None}

    assert whole(b, fn, combine={"zero_logits": "cat"})["zero_logits"].shape == (3, CLASSES)
    with pytest.raises(TypeError, match=r"^out\['zero_logits'\] is a Tensor in some "
                                        r"micro-batches and None in others"):
        split(b, fn, 4, combine={"zero_logits": "cat"})


def test_none_in_every_micro_batch_stays_none(model, batch):
    def fn(mb):
        return {"logits": model(mb["x"]), "attention": None}

    assert split(batch, fn, 5)["attention"] is None


@dataclasses.dataclass
class Prediction:
    logits: torch.Tensor
    top: float
    total: torch.Tensor


def test_tuples_dataclasses_and_callable_rules(model, batch):
    def fn(mb):
        logits = model(mb["x"])
        p = Prediction(logits, float(logits.softmax(1).max()), logits.sum())
        return p, [f"{n}!" for n in mb["name"]], (len(mb["y"]), logits.exp())

    rules = ({"top": lambda values, sizes: max(values), "total": "sum"}, None, ("sum", None))
    want = whole(batch, fn, combine=rules)
    got = split(batch, fn, 5, combine=rules)
    assert isinstance(got[0], Prediction) and isinstance(got[2], tuple)
    torch.testing.assert_close(got[0].logits, want[0].logits)
    assert got[0].top == pytest.approx(want[0].top)
    torch.testing.assert_close(got[0].total, want[0].total)
    assert got[1] == want[1]
    assert got[2][0] == want[2][0] == N
    torch.testing.assert_close(got[2][1], want[2][1])


def test_one_dict_per_sample_is_concatenated(model, batch):
    """Detection-style output: a list holding one dict per sample, whose
    tensors have any length."""
    def fn(mb):
        logits = model(mb["x"])
        return [{"boxes": torch.zeros(int(y) + 1, 4), "score": row.max()}
                for y, row in zip(mb["y"], logits)]

    want = whole(batch, fn)
    got = split(batch, fn, 5)
    assert len(got) == N
    for g, w in zip(got, want):
        assert g["boxes"].shape == w["boxes"].shape and torch.isclose(g["score"], w["score"])


def test_a_list_of_tensors_as_long_as_their_dim_0_is_refused(model, batch):
    """Two hidden states of micro-batches of 2: one tensor per sample, or
    batched tensors? A tuple says batched."""
    def as_list(mb):
        h = model[0](mb["x"])
        return [h, h.tanh()]

    with pytest.raises(TypeError, match=r"^out is a list of 2 tensors whose dim 0 is also 2.*"
                                        r"tuple"):
        split(batch, as_list, 2)
    want = whole(batch, lambda mb: tuple(as_list(mb)))
    got = split(batch, lambda mb: tuple(as_list(mb)), 2)
    assert len(got) == 2 and all(torch.allclose(g, w) for g, w in zip(got, want))


def test_an_oom_midway_keeps_the_weights_of_the_sizes_that_ran(model, batch):
    """Micro-batches of 8, then 4 after an out-of-memory error: the mean
    weighs each by the samples it ran."""
    fn = counted(metrics(model))
    want = whole(batch, fn, combine=RULES)
    fn.sizes.clear()
    calls = []

    def failing(mb):
        calls.append(len(mb["y"]))
        if len(calls) == 2:
            raise RuntimeError(CPU_OOM)
        return fn(mb)

    guard = Guard(budget=None, micro_batch=8, allocator=False)
    got = guard.infer(batch, failing, combine=RULES)
    assert fn.sizes == [8, 4] and guard.ooms_recovered == 1
    assert got["n_correct"] == want["n_correct"]
    assert got["acc"] == pytest.approx(want["acc"])
    assert torch.isclose(got["loss"], want["loss"])
    assert torch.equal(got["confusion"], want["confusion"])


@pytest.mark.parametrize("combine, error, match", [
    ({"acc": "avg"}, ValueError, r"^combine\['acc'\] is 'avg': a rule is 'cat', 'sum', 'mean'"),
    ({"acc": 3}, TypeError, r"^combine\['acc'\] is an int: combine= holds rules"),
    ({"accuracy": "mean"}, ValueError, r"^combine has a rule for out\['accuracy'\], which the"),
    ({"acc": {"x": "sum"}}, TypeError, r"^combine has a dict at out\['acc'\]'s place, where"),
    ({"acc": "cat"}, TypeError, r"^out\['acc'\] is a float: 'cat' joins tensors"),
    ({"acc": "mean", "tags": "sum"}, TypeError, r"^out\['tags'\]\[0\] is a str: 'sum' adds"),
    ({"acc": "mean", "name": "sum"}, TypeError,
     r"^out\['name'\] holds \[5, 5, 2\] values in micro-batches of \[5, 5, 2\] samples: 'sum'"),
    (("sum",), TypeError, r"^combine has a tuple at out's place, where the output is a mapping"),
])
def test_a_bad_combine_is_refused_by_name(model, batch, combine, error, match):
    fn = counted(lambda mb: {"logits": model(mb["x"]), "acc": 0.5, "name": mb["name"],
                             "tags": ("val", "v1")})
    with pytest.raises(error, match=match):
        split(batch, fn, 5, combine=combine)
    if error is ValueError and "is 'avg'" in match:
        assert fn.sizes == []              # refused before any micro-batch ran
