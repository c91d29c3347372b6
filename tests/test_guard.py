"""memguard.Guard.step and memguard.accumulate: a throttled step is the plain step.

Every comparison runs a model and its deep copy side by side: one through a
plain loop (zero_grad, loss on the whole batch, backward, optional clip,
step), the other through ``Guard.step`` with a fixed ``micro_batch`` (which
turns off pressure-driven changes, so the split is deterministic) and no
``install()``.

Tolerances (fp32). Splitting changes only the order in which per-sample
gradient terms are summed, so the two runs differ by a few ulps per step:
``rtol=1e-5`` is ~80 ulps of fp32 (eps 1.19e-7), far above what 4 steps
accumulate (measured: < 1e-5 relative on entries of normal size) and far
below what a wrong weighting does (weighting micro-batches equally instead
of by their samples moves parameters by 10-100 % of an update). Entries
that cancel to almost nothing (a parameter crossing zero, a momentum of a
gradient that changed sign) keep the absolute error of the larger terms they
came from, so a relative bound cannot hold for them; they get an absolute
floor of ``1e-6`` times the tensor's largest entry (about 8 ulps at that
scale; measured need: < 7e-8 times it). For parameters of size ~1 this is
the suggested atol=1e-6; for Adam's second moments (~1e-5) it scales down
instead of hiding them.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import sys
import types
from collections import namedtuple
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memguard
from memguard.train.batch import Sizes

RTOL = 1e-5
ATOL_SCALE = 1e-6      # absolute floor, relative to each tensor's largest entry
D_IN, D_OUT = 4, 3


# -- helpers -------------------------------------------------------------------

def mlp(seed: int = 0, batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(D_IN, 16)]
    if batch_norm:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.Tanh(), nn.Linear(16, D_OUT)]
    return nn.Sequential(*layers)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.01),
}


def twins(opt: str = "sgd_momentum", seed: int = 0, **kw: Any):
    """(plain model, its optimizer, throttled model, its optimizer), equal."""
    a = mlp(seed, **kw)
    b = copy.deepcopy(a)
    return a, OPTIMIZERS[opt](a.parameters()), b, OPTIMIZERS[opt](b.parameters())


def data(n: int, seed: int = 1, steps: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, D_IN, generator=g), torch.randn(n, D_OUT, generator=g))
            for _ in range(steps)]


def guard(micro: int, **kw: Any) -> memguard.Guard:
    return memguard.Guard(budget=None, micro_batch=micro, allocator=False, **kw)


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any,
               loss_fn: Callable[[Any], torch.Tensor], clip: float | None = None,
               scaler: Any = None) -> tuple[float, float | None]:
    """The unsplit reference step; returns (loss, total grad norm before clipping)."""
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(batch)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    norm = None
    if scaler is not None:
        if clip is not None:
            scaler.unscale_(opt)
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        scaler.step(opt)
        scaler.update()
    else:
        if clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
    return float(loss.detach()), norm


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, exact: bool) -> None:
    if exact:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
        return
    atol = ATOL_SCALE * float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=atol,
                               msg=lambda m: f"{what}: {m}")


def assert_same_state(plain: nn.Module, plain_opt: torch.optim.Optimizer,
                      thr: nn.Module, thr_opt: torch.optim.Optimizer,
                      exact: bool = False) -> None:
    """Parameters, buffers and optimizer state of the throttled run match the plain run."""
    for (name, p), q in zip(plain.named_parameters(), thr.parameters()):
        _close(q.detach(), p.detach(), f"parameter {name}", exact)
        assert q.grad is None, f"{name}: the step left gradients behind"
    for (name, b), c in zip(plain.named_buffers(), thr.buffers()):
        _close(c, b, f"buffer {name}", exact)
    sa, sb = plain_opt.state_dict()["state"], thr_opt.state_dict()["state"]
    assert sa and sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for name, v in sa[k].items():
            _close(sb[k][name], v, f"optimizer state {k}.{name}", exact)


def assert_trained(model: nn.Module, initial: nn.Module) -> None:
    """The comparison means something only if the parameters moved."""
    moved = max(float((p - q).detach().abs().max()) for p, q in
                zip(model.parameters(), initial.parameters()))
    assert moved > 1e-3, moved


def mse_fn(model: nn.Module) -> Callable[[Any], torch.Tensor]:
    return lambda batch: F.mse_loss(model(batch[0]), batch[1])


# -- the core claim: N throttled steps are N plain steps ----------------------------

@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("clip", [None, 0.1])
@pytest.mark.parametrize(("n", "micro"), [(32, 8), (37, 5), (37, 36), (37, 1), (24, 7)])
def test_matches_plain_steps(n, micro, clip, opt):
    a, oa, b, ob = twins(opt)
    initial = copy.deepcopy(a)
    g = guard(micro)
    for batch in data(n):
        loss, norm = plain_step(a, oa, batch, mse_fn(a), clip)
        if clip is not None:
            assert norm > 2 * clip          # clipping really happened
        res = g.step(batch, mse_fn(b), ob, clip_grad_norm=clip)
        assert res.n_micro == len(Sizes().of(n, micro))   # a remainder of 1 merged
        assert res.micro_batch == micro
        assert res.retries == 0 and res.tried == []
        assert res.weight == n
        assert res.aux is None
        assert res.loss == pytest.approx(loss, rel=RTOL)
    assert g.steps == 4 and g.micro_batch == micro
    assert g.micro_batch_changes == 0
    assert_trained(a, initial)
    assert_same_state(a, oa, b, ob)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("clip", [None, 0.1])
@pytest.mark.parametrize("micro", [37, 64])
def test_whole_batch_is_bit_identical(micro, clip, opt):
    a, oa, b, ob = twins(opt)
    g = guard(micro)
    for batch in data(37):
        loss, _ = plain_step(a, oa, batch, mse_fn(a), clip)
        res = g.step(batch, mse_fn(b), ob, clip_grad_norm=clip)
        assert res.n_micro == 1 and res.micro_batch == 37
        # the reported loss is summed as loss * 37 in fp32, then divided by 37
        assert res.loss == pytest.approx(loss, rel=1e-6)
    assert_same_state(a, oa, b, ob, exact=True)


def test_fixed_micro_batch_does_not_change_over_steps():
    sizes = []
    m = mlp()
    opt = OPTIMIZERS["sgd_momentum"](m.parameters())

    def loss_fn(batch):
        sizes.append(len(batch[0]))
        return F.mse_loss(m(batch[0]), batch[1])

    g = guard(8)
    for batch in data(20, steps=10):
        assert g.step(batch, loss_fn, opt).micro_batch == 8
    assert sizes == [8, 8, 4] * 10
    assert g.plan()["reason"] == "fixed"


def test_fixed_micro_batch_survives_a_small_batch():
    m = mlp()
    opt = OPTIMIZERS["sgd_momentum"](m.parameters())
    g = guard(8)
    small, big = data(5, steps=1)[0], data(37, steps=1)[0]
    assert g.step(small, mse_fn(m), opt).n_micro == 1
    res = g.step(big, mse_fn(m), opt)
    assert (res.micro_batch, res.n_micro) == (8, 5)


# -- caller weights --------------------------------------------------------------

N_W, MICRO_W = 37, 5


def masked_data(seed: int = 2, steps: int = 3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x, y = torch.randn(N_W, D_IN, generator=g), torch.randn(N_W, D_OUT, generator=g)
        mask = torch.rand(N_W, generator=g) < 0.5
        mask[10:15] = False              # one micro-batch of 5 with nothing masked: weight 0
        mask[35:] = True                 # the short last micro-batch counts
        out.append({"x": x, "y": y, "mask": mask, "idx": torch.arange(N_W)})
    return out


def masked_sum(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    per = (model(batch["x"]) - batch["y"]).pow(2).sum(-1)
    return (per * batch["mask"]).sum(), batch["mask"].sum()


RETURNS: dict[str, Callable[[torch.Tensor, torch.Tensor, dict], Any]] = {
    "tuple_tensor_weight": lambda loss, w, b: (loss, w),
    "tuple_int_weight": lambda loss, w, b: (loss, int(w)),
    "output": lambda loss, w, b: memguard.Output(loss=loss, weight=w, aux=b["idx"]),
    "dict": lambda loss, w, b: {"loss": loss, "weight": w},
    "dict_with_aux": lambda loss, w, b: {"loss": loss, "weight": w, "aux": b["idx"]},
}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("ret", sorted(RETURNS))
def test_caller_weights(ret, opt):
    a, oa, b, ob = twins(opt)
    initial = copy.deepcopy(a)
    weights_seen: list[float] = []

    def plain_loss(batch):
        total, count = masked_sum(a, batch)
        return total / count

    def loss_fn(batch):
        total, count = masked_sum(b, batch)
        weights_seen.append(int(count))
        # a mean over the masked subset; 0 (not NaN) when nothing is masked
        return RETURNS[ret](total / count.clamp(min=1), count, batch)

    posts: list = []
    g = guard(MICRO_W)
    for batch in masked_data():
        loss, _ = plain_step(a, oa, batch, plain_loss)
        weights_seen.clear()
        res = g.step(batch, loss_fn, ob, post_step=posts.append)
        assert weights_seen[2] == 0 and len(weights_seen) == 8
        assert res.weight == int(batch["mask"].sum()) == sum(weights_seen)
        assert res.loss == pytest.approx(loss, rel=RTOL)
        assert res.n_micro == 8
        if "aux" in ret or ret == "output":
            assert torch.equal(res.aux, torch.arange(N_W))
        else:
            assert res.aux is None
    assert len(posts) == 3
    assert_trained(a, initial)
    assert_same_state(a, oa, b, ob)


def test_caller_weights_differ_from_sample_weights():
    """The masked-mean reference is not the sample-weighted one: weights matter."""
    a, oa, b, ob = twins()
    batch = masked_data(steps=1)[0]
    plain_step(a, oa, batch, lambda bt: masked_sum(a, bt)[0] / masked_sum(a, bt)[1])

    def unweighted(bt):
        total, count = masked_sum(b, bt)
        return total / count.clamp(min=1)

    guard(MICRO_W).step(batch, unweighted, ob)
    diff = max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))
    assert diff > 1e-3


def test_mixed_weight_returns_raise_and_leave_no_gradients():
    m = mlp()
    before = copy.deepcopy(m)
    opt = OPTIMIZERS["sgd_momentum"](m.parameters())
    calls = []

    def loss_fn(batch):
        calls.append(1)
        loss = F.mse_loss(m(batch[0]), batch[1])
        return (loss, 3) if len(calls) == 1 else loss

    with pytest.raises(ValueError, match="weight for some micro-batches"):
        guard(4).step(data(10, steps=1)[0], loss_fn, opt)
    assert all(p.grad is None for p in m.parameters())
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before.parameters()))


# -- nested batch structures -----------------------------------------------------

Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


N_S, MICRO_S = 12, 5


def _captions(n: int) -> list[str]:
    return ["c" + "x" * (i % 4) + f"#{i}" for i in range(n)]


def _caption_weights(captions: list[str]) -> torch.Tensor:
    return torch.tensor([float(len(c.split("#")[0])) for c in captions])


STRUCTURES: dict[str, tuple[Callable, Callable]] = {
    # name: (build(x, y) -> batch, loss(model, batch, seen) -> per-sample mean loss)
    "tuple": (lambda x, y: (x, y),
              lambda m, b, seen: F.mse_loss(m(b[0]), b[1])),
    "dict": (lambda x, y: {"x": x, "y": y},
             lambda m, b, seen: F.mse_loss(m(b["x"]), b["y"])),
    "namedtuple": (lambda x, y: Pair(x, y),
                   lambda m, b, seen: F.mse_loss(m(b.x), b.y)),
    "dataclass": (lambda x, y: Batch(x, y),
                  lambda m, b, seen: F.mse_loss(m(b.x), b.y)),
    "crops": (lambda x, y: [x, x.flip(1), x * 0.5, x + 1.0, -x],
              lambda m, b, seen: sum(F.mse_loss(m(c), m(b[0]).detach() * 0.5) for c in b)),
    "captions": (lambda x, y: {"x": x, "y": y, "captions": _captions(len(x)),
                               "idx": torch.arange(len(x))},
                 lambda m, b, seen: (seen.append((b["captions"], b["idx"].tolist())),
                                     ((m(b["x"]) - b["y"]).pow(2).mean(-1)
                                      * _caption_weights(b["captions"])).mean())[1]),
    "scalar_leaf": (lambda x, y: {"x": x, "y": y, "temp": TEMP},
                    lambda m, b, seen: (seen.append(b["temp"]),
                                        F.mse_loss(m(b["x"]) / b["temp"], b["y"]))[1]),
}
TEMP = torch.tensor(0.7)


def _size(name: str, batch: Any) -> int:
    return len(batch[0]) if name in ("tuple", "crops") else \
        len(batch.x) if name in ("namedtuple", "dataclass") else len(batch["x"])


@pytest.mark.parametrize("name", sorted(STRUCTURES))
def test_nested_structures(name):
    build, loss_of = STRUCTURES[name]
    a, oa, b, ob = twins("adamw")
    initial = copy.deepcopy(a)
    seen: list = []
    sizes: list[int] = []

    def loss_fn(batch):
        assert type(batch) is type(build(*data(2, steps=1)[0]))
        sizes.append(_size(name, batch))
        return loss_of(b, batch, seen)

    g = guard(MICRO_S)
    for x, y in data(N_S, steps=3):
        batch = build(x, y)
        loss, _ = plain_step(a, oa, batch, lambda bt: loss_of(a, bt, []))
        res = g.step(batch, loss_fn, ob)
        assert res.loss == pytest.approx(loss, rel=RTOL)
    assert sizes == [5, 5, 2] * 3
    assert_trained(a, initial)
    assert_same_state(a, oa, b, ob)
    if name == "captions":
        assert len(seen) == 9
        for captions, idx in seen:     # every micro-batch saw its own captions
            assert captions == [_captions(N_S)[i] for i in idx]
        assert [i for _, idx in seen[:3] for i in idx] == list(range(N_S))
    if name == "scalar_leaf":
        assert len(seen) == 9 and all(t is TEMP for t in seen)


# -- bf16 autocast ---------------------------------------------------------------

def bf16_fn(model: nn.Module, dtypes: list) -> Callable[[Any], torch.Tensor]:
    def fn(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(batch[0])
        dtypes.append(out.dtype)
        return F.mse_loss(out.float(), batch[1])
    return fn


@pytest.mark.parametrize(("n", "micro"), [(32, 8), (37, 5)])
def test_bf16_autocast_sgd(n, micro):
    """bf16 rounds each micro-batch's activations and gradients to 8 bits
    (unit roundoff 2^-9), so the split and unsplit runs differ by rounding at
    that level, not fp32's. Parameters after 4 SGD-momentum steps are compared
    to within 2 % of the largest parameter update of the run (rtol 0): the
    measured gap is 0.2-0.4 % of it over seeds and splits, while weighting
    micro-batches wrongly moves them by 15-30 % of it."""
    a, oa, b, ob = twins("sgd_momentum")
    initial = copy.deepcopy(a)
    dtypes: list = []
    g = guard(micro)
    for batch in data(n):
        loss, _ = plain_step(a, oa, batch, bf16_fn(a, []))
        res = g.step(batch, bf16_fn(b, dtypes), ob)
        assert res.loss == pytest.approx(loss, rel=2e-2)
    assert dtypes and all(d == torch.bfloat16 for d in dtypes)
    update = max(float((p - q).detach().abs().max()) for p, q in
                 zip(a.parameters(), initial.parameters()))
    assert update > 1e-2
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=2e-2 * update)
    for sa, sb in zip(oa.state_dict()["state"].values(), ob.state_dict()["state"].values()):
        buf = sa["momentum_buffer"]
        torch.testing.assert_close(sb["momentum_buffer"], buf, rtol=0,
                                   atol=2e-2 * float(buf.abs().max()))


def test_bf16_autocast_adamw_first_moments():
    """AdamW's update is about lr * sign(gradient) for small gradients, which
    bf16 noise flips, so its parameters have no tight bound; its moments are
    (after one step) linear and quadratic in the gradients and are compared
    to within 2 % (4 %) of each tensor's largest entry."""
    a, oa, b, ob = twins("adamw")
    batch = data(37, steps=1)[0]
    plain_step(a, oa, batch, bf16_fn(a, []))
    guard(5).step(batch, bf16_fn(b, []), ob)
    for sa, sb in zip(oa.state_dict()["state"].values(), ob.state_dict()["state"].values()):
        for name, frac in (("exp_avg", 2e-2), ("exp_avg_sq", 4e-2)):
            torch.testing.assert_close(sb[name], sa[name], rtol=0,
                                       atol=frac * float(sa[name].abs().max()))


# -- aux and post_step -----------------------------------------------------------

def test_aux_concatenated_and_post_step_once_per_step():
    n, micro = 23, 4
    m = mlp()
    opt = OPTIMIZERS["sgd_momentum"](m.parameters())
    calls: list = []
    snapshots: list = []
    idx_all = torch.arange(n)

    def loss_fn(batch):
        x, y, idx = batch
        out = m(x)
        return memguard.Output(loss=F.mse_loss(out, y),
                               aux={"idx": idx, "out": out, "first": idx[:1] * 0 + idx[0]})

    def post_step(aux):
        calls.append(aux)
        # after the optimizer step, with the gradients zeroed
        assert all(p.grad is None for p in m.parameters())
        snapshots.append([p.detach().clone() for p in m.parameters()])

    g = guard(micro)
    for x, y in data(n, steps=3):
        before = [p.detach().clone() for p in m.parameters()]
        with torch.no_grad():
            expected_out = m(x)
        res = g.step((x, y, idx_all), loss_fn, opt, post_step=post_step)
        assert len(calls) == g.steps
        aux = calls[-1]
        assert aux is res.aux
        assert torch.equal(aux["idx"], idx_all)
        assert torch.equal(aux["first"], torch.arange(0, n, micro))
        assert not aux["out"].requires_grad and aux["out"].grad_fn is None
        torch.testing.assert_close(aux["out"], expected_out, rtol=RTOL, atol=1e-6)
        assert any(not torch.equal(s, p) for s, p in zip(snapshots[-1], before))
        assert all(torch.equal(s, p) for s, p in zip(snapshots[-1], m.parameters()))
    assert len(calls) == 3


def test_post_step_without_aux_gets_none():
    m = mlp()
    opt = OPTIMIZERS["sgd_momentum"](m.parameters())
    calls: list = []
    guard(3).step(data(7, steps=1)[0], mse_fn(m), opt, post_step=calls.append)
    assert calls == [None]


def test_aux_dataclass_is_detached():
    @dataclasses.dataclass
    class Aux:
        out: torch.Tensor

    m = mlp()
    opt = OPTIMIZERS["sgd_momentum"](m.parameters())

    def loss_fn(batch):
        out = m(batch[0])
        return memguard.Output(loss=F.mse_loss(out, batch[1]), aux=Aux(out))

    res = guard(3).step(data(7, steps=1)[0], loss_fn, opt)
    assert isinstance(res.aux, Aux) and res.aux.out.shape == (7, D_OUT)
    assert res.aux.out.grad_fn is None


# -- GradScaler ------------------------------------------------------------------

@pytest.mark.parametrize("clip", [None, 0.1])
@pytest.mark.parametrize(("n", "micro"), [(37, 5), (37, 37)])
def test_grad_scaler(n, micro, clip):
    """torch.amp.GradScaler("cpu") with fp32 compute: scaling by a power of
    two is exact, so the fp32 tolerances hold (and micro == batch is exact)."""
    a, oa, b, ob = twins("adamw")
    sa, sb = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    assert sa.is_enabled()
    g = guard(micro)
    for batch in data(n):
        loss, norm = plain_step(a, oa, batch, mse_fn(a), clip, scaler=sa)
        if clip is not None:
            assert norm > 2 * clip
        res = g.step(batch, mse_fn(b), ob, scaler=sb, clip_grad_norm=clip)
        assert res.loss == pytest.approx(loss, rel=RTOL)
    assert sb.get_scale() == sa.get_scale() == 65536.0
    assert_same_state(a, oa, b, ob, exact=micro == n)


def test_grad_scaler_overflow_skips_like_the_plain_step():
    a, oa, b, ob = twins("adamw")
    before = copy.deepcopy(a)
    sa = torch.amp.GradScaler("cpu", init_scale=2.0 ** 120)
    sb = torch.amp.GradScaler("cpu", init_scale=2.0 ** 120)
    g = guard(5)
    batch = data(37, steps=1)[0]

    def big(model):     # gradients of ~1e4 times 2^120 overflow fp32 (3.4e38)
        return lambda bt: F.mse_loss(model(bt[0]), bt[1]) * 1e4

    plain_step(a, oa, batch, big(a), scaler=sa)
    g.step(batch, big(b), ob, scaler=sb)
    assert sa.get_scale() == sb.get_scale() == 2.0 ** 119     # both backed off
    for p, q, r in zip(a.parameters(), b.parameters(), before.parameters()):
        assert torch.equal(p, r) and torch.equal(q, r)        # both skipped the step
    assert all(p.grad is None for p in b.parameters())


# -- the documented difference: layers that mix samples --------------------------

def test_batch_norm_whole_batch_is_exact_but_split_differs():
    """BatchNorm in train mode normalises with each micro-batch's statistics,
    so a split step is not the plain step (documented). With the whole batch
    as one micro-batch it is, running statistics included."""
    a, oa, b, ob = twins(batch_norm=True)
    for batch in data(16, steps=2):
        plain_step(a, oa, batch, mse_fn(a))
        guard(16).step(batch, mse_fn(b), ob)
    assert_same_state(a, oa, b, ob, exact=True)

    c, oc, d, od = twins(batch_norm=True)
    for batch in data(16, steps=2):
        plain_step(c, oc, batch, mse_fn(c))
        res = guard(4).step(batch, mse_fn(d), od)
        assert math.isfinite(res.loss)
    gap = max(float((p - q).detach().abs().max()) for p, q in zip(c.parameters(), d.parameters()))
    assert gap > 1e-4


# -- no_sync ---------------------------------------------------------------------

class SyncCounting(nn.Module):
    """A model with DDP's no_sync() that records when it is inside it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(D_IN, D_OUT)
        self.entered = 0
        self.syncing_off = False
        self.forward_flags: list[bool] = []
        self.backward_flags: list[bool] = []
        self.net.weight.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        self.backward_flags.append(self.syncing_off)

    @contextlib.contextmanager
    def no_sync(self):
        self.entered += 1
        self.syncing_off = True
        try:
            yield
        finally:
            self.syncing_off = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_flags.append(self.syncing_off)
        return self.net(x)


def test_accumulate_iterate_no_sync_all_but_last():
    m = SyncCounting()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    acc = memguard.accumulate(m, opt)
    x, y = data(10, steps=1)[0]
    items = list(zip(x.split(3), y.split(3)))
    for mx, my in acc.iterate(items):
        acc.backward(F.mse_loss(m(mx), my), weight=len(mx))
    assert m.entered == 3
    assert m.forward_flags == [True, True, True, False]
    assert m.backward_flags == [True, True, True, False]
    assert not m.syncing_off
    acc.step()

    m.forward_flags.clear()
    for mx, my in acc.iterate(items[:1]):
        acc.backward(F.mse_loss(m(mx), my), weight=len(mx))
    assert m.entered == 3 and m.forward_flags == [False]


@pytest.mark.parametrize(("micro", "flags"), [(4, [True, True, False]), (10, [False])])
def test_guard_uses_model_no_sync(micro, flags):
    m = SyncCounting()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = guard(micro, model=m)
    g.step(data(10, steps=1)[0], mse_fn(m), opt)
    assert m.forward_flags == flags and m.backward_flags == flags
    assert m.entered == flags.count(True)


# -- memguard.accumulate directly ------------------------------------------------

@pytest.mark.parametrize("total", [None, 37.0])
@pytest.mark.parametrize("clip", [None, 0.1])
def test_accumulate_manual_split_matches_plain(clip, total):
    a, oa, b, ob = twins("adamw")
    initial = copy.deepcopy(a)
    for x, y in data(37):
        loss, _ = plain_step(a, oa, (x, y), mse_fn(a), clip)
        acc = memguard.accumulate(b, ob, clip_grad_norm=clip, total_weight=total)
        for mx, my in acc.iterate(zip(x.split(5), y.split(5))):
            acc.backward(F.mse_loss(b(mx), my), weight=torch.tensor(len(mx)))
        assert acc.micro_batches == 8 and acc.weight == 37
        assert acc.loss == pytest.approx(loss, rel=RTOL)
        assert acc.step() == pytest.approx(loss, rel=RTOL)
        assert acc.micro_batches == 0 and acc.weight == 0
        assert math.isnan(acc.loss)
    assert_trained(a, initial)
    assert_same_state(a, oa, b, ob)


def test_accumulate_single_piece_with_total_weight_is_exact():
    a, oa, b, ob = twins("sgd_momentum")
    for x, y in data(37):
        plain_step(a, oa, (x, y), mse_fn(a), 0.1)
        acc = memguard.accumulate(b, ob, clip_grad_norm=0.1, total_weight=37)
        acc.backward(F.mse_loss(b(x), y), weight=37)
        acc.step()
    assert_same_state(a, oa, b, ob, exact=True)


def test_accumulate_close_weights_before_the_last_backward():
    """Closing the weights before the last backward (what DDP's synchronising
    backward needs) gives the gradients normalize() gives after it."""
    a, oa, b, ob = twins("adamw")
    for x, y in data(12, steps=3):
        pieces = list(zip(x.split(5), y.split(5)))
        weights = [3.0, 0.0, 2.0]
        for m, o, close in ((a, oa, False), (b, ob, True)):
            acc = memguard.accumulate(m, o)
            for i, ((mx, my), w) in enumerate(zip(pieces, weights)):
                if close and i == len(pieces) - 1:
                    acc.close_weights(w)
                    assert acc.total_weight == 5.0
                acc.backward(F.mse_loss(m(mx), my), weight=w)
            acc.normalize()
            if close:
                grads = [p.grad.clone() for p in b.parameters()]
                for p, q in zip(a.parameters(), grads):
                    torch.testing.assert_close(p.grad, q, rtol=RTOL, atol=1e-7)
        oa.step(), ob.step()
        oa.zero_grad(), ob.zero_grad()
    assert_same_state(a, oa, b, ob)
    m = mlp()
    acc = memguard.accumulate(m, OPTIMIZERS["sgd_momentum"](m.parameters()))
    with pytest.raises(ValueError, match="nothing to step"):
        acc.close_weights(0)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), torch.tensor(-2.0)])
def test_accumulate_rejects_bad_weights(bad):
    m = mlp()
    acc = memguard.accumulate(m, OPTIMIZERS["sgd_momentum"](m.parameters()))
    x, y = data(4, steps=1)[0]
    with pytest.raises(ValueError, match=str(float(bad))):
        acc.backward(F.mse_loss(m(x), y), weight=bad)
    assert all(p.grad is None for p in m.parameters())    # nothing was accumulated
    assert acc.micro_batches == 0


def test_accumulate_step_with_nothing_accumulated():
    m = mlp()
    before = copy.deepcopy(m)
    opt = OPTIMIZERS["sgd_momentum"](m.parameters())
    acc = memguard.accumulate(m, opt)
    with pytest.raises(ValueError, match="nothing to step"):
        acc.step()
    x, y = data(4, steps=1)[0]
    acc.backward(F.mse_loss(m(x), y), weight=0)            # only zero weights
    with pytest.raises(ValueError, match="nothing to step"):
        acc.step()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before.parameters()))
    assert not opt.state


def test_accumulate_total_weight_mismatch():
    m = mlp()
    before = copy.deepcopy(m)
    opt = OPTIMIZERS["sgd_momentum"](m.parameters())
    acc = memguard.accumulate(m, opt, total_weight=10)
    for x, y in data(4, steps=2):
        acc.backward(F.mse_loss(m(x), y), weight=4)
    with pytest.raises(ValueError, match=r"sum to 8, not the step's total_weight 10"):
        acc.step()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before.parameters()))


@pytest.mark.parametrize(("kw", "text"), [({"clip_grad_norm": 0}, "clip_grad_norm.*0"),
                                          ({"clip_grad_norm": -1.0}, "clip_grad_norm.*-1.0"),
                                          ({"total_weight": 0}, "total_weight.*0"),
                                          ({"total_weight": float("nan")}, "total_weight.*nan")])
def test_accumulate_rejects_bad_arguments(kw, text):
    m = mlp()
    with pytest.raises(ValueError, match=text):
        memguard.accumulate(m, OPTIMIZERS["sgd_momentum"](m.parameters()), **kw)


def test_accumulate_without_model():
    a, oa, b, ob = twins()
    x, y = data(9, steps=1)[0]
    plain_step(a, oa, (x, y), mse_fn(a))
    acc = memguard.accumulate(None, ob)
    for mx, my in acc.iterate([(x[:4], y[:4]), (x[4:], y[4:])]):
        acc.backward(F.mse_loss(b(mx), my), weight=len(mx))
    acc.step()
    assert_same_state(a, oa, b, ob)


# -- bad inputs --------------------------------------------------------------------

@pytest.mark.parametrize(("kw", "text"), [
    ({"micro_batch": 0}, "micro_batch must be 'auto' or a positive integer, not 0"),
    ({"micro_batch": "big"}, "not 'big'"),
    ({"micro_batch": True}, "not True"),
    ({"micro_batch": -1}, "not -1"),
    ({"micro_batch": 2.0}, "not 2.0"),
    ({"min_micro_batch": 0}, "min_micro_batch must be a positive integer, not 0"),
    ({"multiple_of": 0}, "multiple_of must be a positive integer, not 0"),
    ({"divisor_of": 0}, "divisor_of must be a positive integer, not 0"),
    ({"margin": 1.5}, "margin must be in \\[0, 1\\), not 1.5"),
    ({"margin": -0.1}, "not -0.1"),
    ({"multiple_of": 3, "divisor_of": 64}, "multiple_of=3, divisor_of=64"),
    ({"micro_batch": 5, "multiple_of": 2}, "micro_batch 5 breaks .*multiple_of=2"),
    ({"micro_batch": 6, "divisor_of": 64}, "micro_batch 6 breaks .*divisor_of=64"),
    ({"micro_batch": 2, "min_micro_batch": 4}, "micro_batch 2 breaks .*min_micro_batch=4"),
])
def test_guard_rejects_bad_arguments(kw, text):
    kw.setdefault("micro_batch", "auto")
    with pytest.raises(ValueError, match=text):
        memguard.Guard(budget=None, allocator=False, **kw)


def test_guard_accepts_allowed_constraints():
    g = memguard.Guard(budget=None, micro_batch=8, multiple_of=4, divisor_of=64,
                       min_micro_batch=2, allocator=False)
    assert g.micro_batch == 8


def test_batch_with_disagreeing_sizes():
    m = mlp()
    opt = OPTIMIZERS["sgd_momentum"](m.parameters())
    with pytest.raises(ValueError, match=r"\[6, 7\]"):
        guard(2).step({"x": torch.randn(6, D_IN), "y": torch.randn(7, D_OUT)}, mse_fn(m), opt)
    assert not opt.state


def test_loss_fn_returning_a_string():
    m = mlp()
    before = copy.deepcopy(m)
    opt = OPTIMIZERS["sgd_momentum"](m.parameters())

    def loss_fn(batch):
        F.mse_loss(m(batch[0]), batch[1]).backward()   # leaves gradients behind
        return "loss"

    with pytest.raises(TypeError, match="<class 'str'>"):
        guard(3).step(data(7, steps=1)[0], loss_fn, opt)
    assert all(p.grad is None for p in m.parameters())
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before.parameters()))
    assert not opt.state


def test_budget_covers_the_whole_process():
    """The arena gets what the budget leaves once the memory the process
    already holds outside it is counted; a budget below that is an error."""
    import memguard
    from memguard.memory import arena as allocator

    if memguard.sample().footprint_bytes is None:
        pytest.skip(f"the {memguard._C.PLATFORM} layer cannot see what the process holds")
    g = memguard.Guard(budget="1MiB")
    with pytest.raises(ValueError, match="1.0 MiB is below what this process already holds"):
        g.install()
    assert not g.installed
    rss = memguard.sample().rss_bytes
    g = memguard.Guard(budget=rss + (256 << 20))
    try:
        g.install()
    except ValueError:
        pytest.fail("a budget above what the process holds was refused")
    try:
        if g.allocator_error is None:
            room = allocator.stats()["budget_bytes"]
            state = g.room.last
            assert room == state.arena_budget_bytes == state.budget_bytes - state.outside_bytes
            assert state.budget_bytes == rss + (256 << 20) and state.source == "user"
            # what the process holds outside the arena, a tenth more before any step
            held = memguard.sample().footprint_bytes - allocator.stats()["reserved_bytes.current"]
            assert 0.9 * held < state.outside_bytes < 1.1 * held + (64 << 20)
    finally:
        g.uninstall()


def test_macos_footprint_peak_reads_rusage_v4_and_resets_per_step():
    """The macOS peak reader against libproc's two calls, as a fake libc
    gives them (the struct as <sys/resource.h> lays it out): the footprint
    and its interval peak at their offsets; without the reset, no peak."""
    import ctypes

    from memguard.train.peaks import FootprintPeak, PeakMeter, process_peak

    calls = []

    def usage(pid, flavor, buf):
        calls.append(("usage", pid, flavor))
        raw = bytearray(FootprintPeak.SIZE_V4)
        raw[FootprintPeak.FOOTPRINT_AT:FootprintPeak.FOOTPRINT_AT + 8] = \
            (3 << 30).to_bytes(8, sys.byteorder)
        raw[FootprintPeak.INTERVAL_MAX_AT:FootprintPeak.INTERVAL_MAX_AT + 8] = \
            (5 << 30).to_bytes(8, sys.byteorder)
        ctypes.memmove(buf, bytes(raw), len(raw))
        return 0

    libc = types.SimpleNamespace(proc_pid_rusage=usage,
                                 proc_reset_footprint_interval=lambda pid: calls.append(
                                     ("reset", pid)) or 0)
    fp = FootprintPeak(libc)
    assert FootprintPeak.SIZE_V4 == 296 and FootprintPeak.INTERVAL_MAX_AT == 280
    assert fp.reset_peak() and fp.read() == (3 << 30, 5 << 30)
    assert calls == [("reset", os.getpid()), ("usage", os.getpid(), 4)]
    assert FootprintPeak(types.SimpleNamespace(proc_pid_rusage=usage)).read() == (3 << 30, None)
    assert not FootprintPeak(types.SimpleNamespace()).reset_peak()
    m = PeakMeter()
    m._rss = fp
    assert m.start(torch.zeros(2, 3)) == 3 << 30 and m.source == "footprint"
    assert m.stop() == 5 << 30
    # off macOS nothing is looked up: this system's reader is the RSS one
    assert type(process_peak()).__name__ == ("FootprintPeak" if sys.platform == "darwin"
                                             else "RssPeak")
    if sys.platform != "darwin":
        assert FootprintPeak().read() == (None, None) and not FootprintPeak().reset_peak()


def test_a_step_whose_exit_was_interrupted_does_not_block_the_next():
    """An interrupt that lands in the step's exit before it deregistered,
    its traceback kept (a notebook keeps the last one): the next step
    runs; a step from inside a step is still refused."""
    from memguard.train.guard import _Entry

    a, oa, _, _ = twins("sgd_momentum")
    g = guard(8)
    real = _Entry.__exit__

    def interrupted(self, *exc):
        raise KeyboardInterrupt

    _Entry.__exit__ = interrupted
    try:
        with pytest.raises(KeyboardInterrupt) as kept:
            g.step(data(16)[0], mse_fn(a), oa)
    finally:
        _Entry.__exit__ = real
    assert kept.value.__traceback__ is not None
    g.step(data(16)[1], mse_fn(a), oa)              # not "steps do not nest"
    with pytest.raises(RuntimeError, match="steps do not nest"):
        g.step(data(16)[2], lambda b: g.step(b, mse_fn(a), oa), oa)
