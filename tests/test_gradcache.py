"""memguard.train.gradcache.gradcache_backward: micro-batched backward of a loss with
in-batch negatives gives the unsplit step.

Each comparison runs a model and its deep copy side by side, several SGD
(momentum) steps: one through a reference step, the other through
``gradcache_backward`` and the same optimizer step.

References. Without dropout the reference is the plain unsplit step,
``loss_fn(embed_fn(batch)).backward()``. With dropout it is the
micro-batch-wise forward with graphs (``loss_fn(concat(embed_fn(m) for m in
micro_batches)).backward()``): the same math with the masks the split
forward draws, which GradCache must replay exactly. Whether those are the
unsplit step's masks depends on how the RNG is consumed:
``test_dropout_masks_*`` pin down what torch 2.13's CPU generator does (one
dropout layer: the same masks; two: different ones).

Tolerances (fp32), as in test_guard.py: ``rtol=1e-5`` (~80 ulps) with an
absolute floor of ``1e-6`` times each tensor's largest entry. GradCache
changes only the order in which gradient terms are summed (per micro-batch,
through the cached embedding gradients); a wrong slice, a missing RNG
replay or in-batch negatives restricted to a micro-batch move parameters by
percents of an update, which ``test_*_differs`` checks the tolerance sees.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memguard
from memguard.train import batch as _batch
from memguard.train import gradcache
from memguard.train.gradcache import gradcache_backward

RTOL = 1e-5
ATOL_SCALE = 1e-6
N = 16
D_IN, HIDDEN, D_OUT = 12, 32, 16
TEMPERATURE = 0.1
STEPS = 3


# -- models, data, losses --------------------------------------------------------

class Encoder(nn.Module):
    """A per-sample MLP encoder (LayerNorm, not BatchNorm) with ``n_dropout``
    Dropout layers. Linear layers act on the last dim, so a batch of two
    views ``[samples, 2, D_IN]`` is encoded in one call."""

    def __init__(self, p: float = 0.1, n_dropout: int = 2, d_in: int = D_IN,
                 hidden: int = HIDDEN, d_out: int = D_OUT, depth: int = 2) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = d_in
        for i in range(depth):
            layers += [nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.GELU()]
            if i >= depth - n_dropout:
                layers.append(nn.Dropout(p))
            width = hidden
        layers.append(nn.Linear(width, d_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def views(n: int = N, seed: int = 1, steps: int = STEPS, d_in: int = D_IN) -> list[torch.Tensor]:
    """Batches of two augmented views per sample, ``[n, 2, d_in]``, from a
    private generator (the global RNG is dropout's alone)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        base = torch.randn(n, 1, d_in, generator=g)
        out.append(base + 0.3 * torch.randn(n, 2, d_in, generator=g))
    return out


def nt_xent(z: torch.Tensor, temperature: float = TEMPERATURE) -> torch.Tensor:
    """SimCLR's loss over ``z`` of shape ``[samples, 2, d]``: each view's
    positive is the other view of its sample, every other of the 2N-2
    embeddings in the batch is a negative."""
    n = z.shape[0]
    z = F.normalize(torch.cat([z[:, 0], z[:, 1]]), dim=1)
    sim = (z @ z.T) / temperature
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(sim, target)


def encoder_twins(seed: int = 0, **kw: Any):
    torch.manual_seed(seed)
    a = Encoder(**kw)
    b = copy.deepcopy(a)
    return a, sgd(a.parameters()), b, sgd(b.parameters())


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def plain_step(opt: torch.optim.Optimizer, batch: Any, embed_fn: Callable[[Any], Any],
               loss_fn: Callable[[Any], torch.Tensor], scaler: Any = None) -> float:
    """The unsplit step."""
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(embed_fn(batch))
    _finish(opt, loss, scaler)
    return float(loss.detach())


def microwise_step(opt: torch.optim.Optimizer, batch: Any, micro: int,
                   embed_fn: Callable[[Any], Any], loss_fn: Callable[[Any], torch.Tensor],
                   scaler: Any = None) -> float:
    """The split forward with every micro-batch's graph kept: GradCache's
    math, and its RNG consumption, without its memory saving."""
    opt.zero_grad(set_to_none=True)
    n = _batch.batch_size(batch)
    emb = _batch.concat([embed_fn(m) for m in _batch.split(batch, n, micro)])
    loss = loss_fn(emb)
    _finish(opt, loss, scaler)
    return float(loss.detach())


def _finish(opt: torch.optim.Optimizer, loss: torch.Tensor, scaler: Any) -> None:
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def gradcache_step(opt: torch.optim.Optimizer, batch: Any, micro: int,
                   embed_fn: Callable[[Any], Any], loss_fn: Callable[[Any], torch.Tensor],
                   scaler: Any = None, **kw: Any) -> tuple[float, Any]:
    opt.zero_grad(set_to_none=True)
    loss, emb = gradcache_backward(batch, _batch.batch_size(batch), micro, embed_fn, loss_fn,
                                   scaler, **kw)
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()
    return loss, emb


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    atol = ATOL_SCALE * float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=atol,
                               msg=lambda m: f"{what}: {m}")


def assert_same_params(ref: nn.Module, got: nn.Module) -> None:
    for (name, p), q in zip(ref.named_parameters(), got.parameters()):
        _close(q.detach(), p.detach(), f"parameter {name}")


def params_differ(ref: nn.Module, got: nn.Module) -> bool:
    """Some parameter is outside the tolerance the equality tests allow."""
    for p, q in zip(ref.parameters(), got.parameters()):
        try:
            _close(q.detach(), p.detach(), "")
        except AssertionError:
            return True
    return False


# -- SimCLR: one tensor of embeddings ----------------------------------------------

@pytest.mark.parametrize("micro", [4, 5, 3])
def test_without_dropout_equals_the_unsplit_step(micro):
    ref, ref_opt, gc_model, gc_opt = encoder_twins(p=0.0)
    for batch in views():
        ref_loss = plain_step(ref_opt, batch, ref, nt_xent)
        loss, emb = gradcache_step(gc_opt, batch, micro, gc_model, nt_xent)
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        assert isinstance(emb, torch.Tensor) and emb.shape == (N, 2, D_OUT)
        assert not emb.requires_grad and emb.grad_fn is None
        assert_same_params(ref, gc_model)


def test_returned_embeddings_are_the_batch_embeddings():
    torch.manual_seed(0)
    model = Encoder(p=0.0)
    batch = views(steps=1)[0]
    with torch.no_grad():
        want = model(batch)
    _, emb = gradcache_backward(batch, N, 5, model, nt_xent)
    _close(emb, want, "embeddings")


def test_naive_accumulation_differs():
    """In-batch negatives restricted to each micro-batch (what plain gradient
    accumulation computes) lands outside the tolerance: the equality tests
    above can tell GradCache from it."""
    ref, ref_opt, naive, naive_opt = encoder_twins(p=0.0)
    for batch in views():
        plain_step(ref_opt, batch, ref, nt_xent)
        naive_opt.zero_grad(set_to_none=True)
        for m in _batch.split(batch, N, 4):
            (nt_xent(naive(m)) * (len(m) / N)).backward()
        naive_opt.step()
    assert params_differ(ref, naive)


@pytest.mark.parametrize("micro", [4, 5])
def test_with_dropout_equals_the_microbatchwise_step(micro):
    ref, ref_opt, gc_model, gc_opt = encoder_twins(p=0.1, n_dropout=2)
    torch.manual_seed(123)
    ref_losses = []
    ref_rng = []
    for batch in views():
        ref_losses.append(microwise_step(ref_opt, batch, micro, ref, nt_xent))
        ref_rng.append(torch.get_rng_state())
    torch.manual_seed(123)
    for batch, want_loss, want_rng in zip(views(), ref_losses, ref_rng):
        loss, _ = gradcache_step(gc_opt, batch, micro, gc_model, nt_xent)
        assert loss == pytest.approx(want_loss, rel=1e-6)
        # The replay consumed nothing on balance: the next step draws what
        # the micro-batch-wise run's next step draws.
        assert torch.equal(torch.get_rng_state(), want_rng)
    assert_same_params(ref, gc_model)


def test_with_dropout_but_without_rng_replay_differs(monkeypatch):
    """The RNG replay is what makes the dropout case equal: with the
    restores turned off the second pass draws other masks."""
    ref, ref_opt, gc_model, gc_opt = encoder_twins(p=0.1, n_dropout=2)
    torch.manual_seed(123)
    for batch in views():
        microwise_step(ref_opt, batch, 4, ref, nt_xent)
    monkeypatch.setattr(gradcache.Rng, "restore", lambda self: None)
    torch.manual_seed(123)
    for batch in views():
        gradcache_step(gc_opt, batch, 4, gc_model, nt_xent)
    assert params_differ(ref, gc_model)


def test_dropout_masks_one_layer_equal_the_unsplit_step():
    """torch 2.13, CPU: a dropout mask is drawn element by element from one
    generator stream, so dropout on rows 0..m-1, then m..2m-1, ... draws the
    mask one call on all rows draws. With a single dropout layer (both views
    encoded in one call) GradCache is the unsplit step, dropout on."""
    ref, ref_opt, gc_model, gc_opt = encoder_twins(p=0.1, n_dropout=1)
    torch.manual_seed(7)
    for batch in views():
        plain_step(ref_opt, batch, ref, nt_xent)
    torch.manual_seed(7)
    for batch in views():
        gradcache_step(gc_opt, batch, 5, gc_model, nt_xent)
    assert_same_params(ref, gc_model)


def test_dropout_masks_two_layers_differ_from_the_unsplit_step():
    """With two dropout layers the unsplit forward draws layer 1's mask for
    all rows, then layer 2's; the split forward interleaves them micro-batch
    by micro-batch, so the masks (and the step) differ: this is why the
    dropout reference is the micro-batch-wise step."""
    ref, ref_opt, split, split_opt = encoder_twins(p=0.1, n_dropout=2)
    torch.manual_seed(7)
    for batch in views():
        plain_step(ref_opt, batch, ref, nt_xent)
    torch.manual_seed(7)
    for batch in views():
        microwise_step(split_opt, batch, 4, split, nt_xent)
    assert params_differ(ref, split)


def test_rng_after_the_call_when_the_loss_draws_too():
    """A loss that draws from the RNG (a jittered temperature) sees the
    state after all first passes, as in the micro-batch-wise step, and the
    call leaves the RNG where that step leaves it."""
    def jittered(z: torch.Tensor) -> torch.Tensor:
        return nt_xent(z, TEMPERATURE * (1.0 + 0.5 * float(torch.rand(()))))

    ref, ref_opt, gc_model, gc_opt = encoder_twins(p=0.1)
    batch = views(steps=1)[0]
    torch.manual_seed(5)
    want = microwise_step(ref_opt, batch, 5, ref, jittered)
    want_rng = torch.get_rng_state()
    torch.manual_seed(5)
    loss, _ = gradcache_step(gc_opt, batch, 5, gc_model, jittered)
    assert loss == pytest.approx(want, rel=1e-6)
    assert torch.equal(torch.get_rng_state(), want_rng)
    assert_same_params(ref, gc_model)


@pytest.mark.parametrize("micro", [16, 20])
def test_one_micro_batch_is_the_plain_step(micro):
    """micro >= n: embed once, with a graph, bit for bit the plain step."""
    ref, ref_opt, gc_model, gc_opt = encoder_twins(p=0.1)
    calls = []

    def embed(x: torch.Tensor) -> torch.Tensor:
        calls.append(len(x))
        return gc_model(x)

    for seed, batch in enumerate(views()):
        torch.manual_seed(seed)
        plain_step(ref_opt, batch, ref, nt_xent)
        torch.manual_seed(seed)
        gradcache_step(gc_opt, batch, micro, embed, nt_xent)
    assert calls == [N] * STEPS
    for p, q in zip(ref.parameters(), gc_model.parameters()):
        assert torch.equal(p, q)


def test_embed_fn_runs_twice_first_without_grad():
    torch.manual_seed(0)
    model = Encoder()
    calls = []

    def embed(x: torch.Tensor) -> torch.Tensor:
        calls.append((len(x), torch.is_grad_enabled()))
        return model(x)

    gradcache_backward(views(steps=1)[0], N, 5, embed, nt_xent)
    # 16 at 5: the remainder of one sample borrows one from the last micro-batch
    assert calls == [(5, False), (5, False), (4, False), (2, False),
                     (5, True), (5, True), (4, True), (2, True)]
    assert all(p.grad is not None for p in model.parameters())


def count_all_reduces(ddp: nn.Module, when: Callable[[], Any]) -> list[tuple[int, Any]]:
    """Count what a DistributedDataParallel all-reduces, through a comm hook:
    the list returned gets, for each bucket, its index and what ``when()``
    says at that moment; the hook then all-reduces the bucket as DDP's
    default one does."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    seen: list[tuple[int, Any]] = []

    def hook(group, bucket):   # DDP accepts no annotation but GradBucket here
        seen.append((bucket.index(), when()))
        return allreduce_hook(group, bucket)

    ddp.register_comm_hook(None, hook)
    return seen


def test_under_ddp_the_gradients_are_all_reduced_once_in_the_last_replay(gloo_group):
    """A real DistributedDataParallel (one-process gloo group) as ``model``:
    every replay but the last runs under its no_sync(), so DDP all-reduces
    each bucket once per step, in the last replay's backward; the
    gradients are the unsplit step's. (Without no_sync each replay's
    backward would all-reduce; with it on the last one too, none would.)"""
    ref, ref_opt, module, opt = encoder_twins(p=0.0)
    ddp = torch.nn.parallel.DistributedDataParallel(module)
    calls: list[bool] = []      # embed_fn calls, with or without grad

    def embed(x: torch.Tensor) -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        return ddp(x)

    seen = count_all_reduces(ddp, lambda: len(calls))
    for step, batch in enumerate(views(steps=2)):    # DDP rebuilds its buckets after step 0
        calls.clear()
        seen.clear()
        ref_opt.zero_grad(set_to_none=True)
        nt_xent(ref(batch)).backward()
        opt.zero_grad(set_to_none=True)
        gradcache_backward(batch, N, 4, embed, nt_xent, model=ddp)
        assert calls == [False] * 4 + [True] * 4
        buckets = [b for b, _ in seen]
        assert buckets and sorted(buckets) == sorted(set(buckets)), (step, seen)
        assert {c for _, c in seen} == {8}, (step, seen)   # after the last replay
        for (name, p), q in zip(ref.named_parameters(), module.parameters()):
            # as a whole (entries that cancel to nothing differ by more than RTOL)
            gap = float((q.grad - p.grad).norm() / p.grad.norm())
            assert gap < RTOL, f"step {step}: gradient of {name} is {gap:.1e} off"
        ref_opt.step()
        opt.step()
    assert_same_params(ref, module)


# -- CLIP: two towers, a tuple (or dict) of embeddings ------------------------------

VOCAB, TOKENS = 50, 6


class TwoTowers(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.image = Encoder(p=p)
        self.text = nn.EmbeddingBag(VOCAB, 24, mode="mean")
        self.text_head = nn.Sequential(nn.Dropout(p), nn.Linear(24, D_OUT))
        # a parameter of the loss, not of the towers: its gradient comes
        # from the loss's own backward
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))


def clip_pairs(n: int = N, seed: int = 2, steps: int = STEPS) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, D_IN, generator=g),
             torch.randint(0, VOCAB, (n, TOKENS), generator=g)) for _ in range(steps)]


def clip_loss(img: torch.Tensor, txt: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    img, txt = F.normalize(img, dim=1), F.normalize(txt, dim=1)
    logits = logit_scale.exp() * img @ txt.T
    target = torch.arange(len(img))
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def clip_fns(model: TwoTowers, structure: str):
    def embed(batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
        img = model.image(batch[0])
        txt = model.text_head(model.text(batch[1]))
        return (img, txt) if structure == "tuple" else {"image": img, "text": txt}

    def loss(emb: Any) -> torch.Tensor:
        img, txt = emb if structure == "tuple" else (emb["image"], emb["text"])
        return clip_loss(img, txt, model.logit_scale)

    return embed, loss


@pytest.mark.parametrize("structure", ["tuple", "dict"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("micro", [4, 5])
def test_clip_two_towers(structure, dropout, micro):
    torch.manual_seed(0)
    ref = TwoTowers(dropout)
    got = copy.deepcopy(ref)
    ref_opt, got_opt = sgd(ref.parameters()), sgd(got.parameters())
    ref_embed, ref_loss = clip_fns(ref, structure)
    got_embed, got_loss = clip_fns(got, structure)
    torch.manual_seed(11)
    for batch in clip_pairs():
        if dropout:
            microwise_step(ref_opt, batch, micro, ref_embed, ref_loss)
        else:
            plain_step(ref_opt, batch, ref_embed, ref_loss)
    torch.manual_seed(11)
    for batch in clip_pairs():
        _, emb = gradcache_step(got_opt, batch, micro, got_embed, got_loss)
        leaves = list(emb) if structure == "tuple" else [emb["image"], emb["text"]]
        assert [tuple(t.shape) for t in leaves] == [(N, D_OUT), (N, D_OUT)]
    assert_same_params(ref, got)
    # logit_scale moved: the loss's own parameters were trained too
    assert float(got.logit_scale.detach()) != pytest.approx(math.log(1 / 0.07), abs=1e-4)


def test_frozen_tower_unused_output_and_constant_leaves():
    """A frozen text tower (its embeddings carry no graph), an output the
    loss ignores (no cached gradient) and an integer tensor passed along as
    a constant: each is skipped in the replay, the rest is the plain step."""
    torch.manual_seed(0)
    ref = TwoTowers(0.0)
    for mod in (ref.text, ref.text_head):
        mod.requires_grad_(False)
    got = copy.deepcopy(ref)
    ref_opt, got_opt = sgd(ref.parameters()), sgd(got.parameters())

    def fns(model: TwoTowers):
        def embed(batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
            img = model.image(batch[0])
            txt = model.text_head(model.text(batch[1]))
            return img, txt, img.norm(dim=1), (batch[1] > VOCAB // 2).sum(dim=1)

        def loss(emb: Any) -> torch.Tensor:
            img, txt, _norms, counts = emb
            assert counts.dtype == torch.int64 and counts.shape == (N,)
            return clip_loss(img, txt, model.logit_scale)

        return embed, loss

    for batch in clip_pairs():
        plain_step(ref_opt, batch, *fns(ref))
        gradcache_step(got_opt, batch, 5, *fns(got))
    assert_same_params(ref, got)
    assert all(p.grad is None for p in got.text.parameters())


# -- AMP GradScaler ------------------------------------------------------------------

@pytest.mark.parametrize("init_scale, factor, steps", [(2.0**16, 1.0, STEPS), (2.0**127, 4.0, 5)])
def test_grad_scaler(init_scale, factor, steps):
    """Cached gradients are of the scaled loss, so the parameter gradients
    are scaled like the plain step's and scaler.step unscales them. At
    2**127 the scaled (four-fold) loss's gradients overflow: both runs find
    non-finite gradients in the same steps, skip them and back off to the
    same scale until the steps go through."""
    def loss_fn(z: torch.Tensor) -> torch.Tensor:
        return factor * nt_xent(z)


    ref, ref_opt, gc_model, gc_opt = encoder_twins(p=0.0)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    gc_scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    skipped = []
    for batch in views(steps=steps):
        ref_opt.zero_grad(set_to_none=True)
        ref_scaler.scale(loss_fn(ref(batch))).backward()
        gc_opt.zero_grad(set_to_none=True)
        gradcache_backward(batch, N, 5, gc_model, loss_fn, gc_scaler)
        ref_finite = all(bool(torch.isfinite(p.grad).all()) for p in ref.parameters())
        gc_finite = all(bool(torch.isfinite(q.grad).all()) for q in gc_model.parameters())
        assert gc_finite == ref_finite
        skipped.append(not ref_finite)
        if ref_finite:
            # the gradients carry the scale (an unscaled cache would leave
            # them init_scale times smaller); norms compare them as a whole,
            # free of the entries that cancel to nothing
            for (name, p), q in zip(ref.named_parameters(), gc_model.parameters()):
                assert float(q.grad.norm()) == pytest.approx(float(p.grad.norm()), rel=RTOL), \
                    name
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        gc_scaler.step(gc_opt)
        gc_scaler.update()
        assert gc_scaler.get_scale() == ref_scaler.get_scale()
    if init_scale == 2.0**127:
        assert skipped[0] and not all(skipped), skipped
    else:
        assert not any(skipped), skipped
    assert_same_params(ref, gc_model)


# -- memory --------------------------------------------------------------------------

def test_peak_memory_is_lower_than_the_unsplit_backward():
    """A wide encoder over 256 samples (512 views): the unsplit backward
    holds every layer's activations for all of them; GradCache holds one
    micro-batch's (32 samples) plus the embeddings and the loss's graph."""
    n, micro = 256, 32
    was = memguard.installed()
    try:
        memguard.install()
    except RuntimeError as exc:
        pytest.skip(f"memguard's allocator cannot be installed here: {exc}")
    try:
        torch.manual_seed(0)
        model = Encoder(p=0.1, d_in=64, hidden=1024, d_out=64, depth=4)
        batch = views(n=n, steps=1, d_in=64)[0]

        def peak(run: Callable[[], Any]) -> int:
            # gradients exist already (zeroed): both runs only accumulate
            model.zero_grad(set_to_none=False)
            base = memguard.stats()["allocated_bytes.current"]
            memguard.memory.arena.reset_peaks()
            run()
            return memguard.stats()["allocated_bytes.peak"] - base

        nt_xent(model(batch)).backward()          # create the .grad tensors
        plain = peak(lambda: nt_xent(model(batch)).backward())
        cached = peak(lambda: gradcache_backward(batch, n, micro, model, nt_xent))
        assert plain > 0 and cached > 0
        assert cached < 0.5 * plain, (cached, plain)
    finally:
        if not was:
            memguard.uninstall()


# -- errors --------------------------------------------------------------------------

def _model() -> Encoder:
    torch.manual_seed(0)
    return Encoder(p=0.0)


def test_rejects_bad_sizes():
    model, batch = _model(), views(steps=1)[0]
    with pytest.raises(ValueError, match="n=15 but the batch holds 16"):
        gradcache_backward(batch, 15, 4, model, nt_xent)
    for micro in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="micro must be a positive integer"):
            gradcache_backward(batch, N, micro, model, nt_xent)


@pytest.mark.parametrize("micro", [4, 16])
@pytest.mark.parametrize("embed, match", [
    (lambda m, x: m(x)[:1], r"shapes \[\(1, 2, 16\)\]"),
    (lambda m, x: (m(x), m(x).sum()), r"shapes \[\(\)\]"),
    (lambda m, x: ["a"] * len(x), "no floating-point tensor"),
])
def test_rejects_embeddings_that_are_not_per_sample(micro, embed, match):
    model, batch = _model(), views(steps=1)[0]
    with pytest.raises(ValueError, match=match):
        gradcache_backward(batch, N, micro, lambda x: embed(model, x), lambda e: e[0].sum())


@pytest.mark.parametrize("micro", [4, 16])
@pytest.mark.parametrize("loss, match", [
    (lambda z: z.sum(dim=1), "scalar tensor"),
    (lambda z: 1.0, "scalar tensor"),
    (lambda z: torch.tensor(1.0), "does not depend on the embeddings"),
])
def test_rejects_bad_losses(micro, loss, match):
    model, batch = _model(), views(steps=1)[0]
    with pytest.raises(ValueError, match=match):
        gradcache_backward(batch, N, micro, model, loss)


def test_rejects_an_embed_fn_that_does_not_repeat():
    model, batch = _model(), views(steps=1)[0]
    calls = []

    def embed(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        z = model(x)
        return z if len(calls) <= 4 else z[:, :1]   # the replay drops a view

    with pytest.raises(RuntimeError, match="second pass over micro-batch 0"):
        gradcache_backward(batch, N, 4, embed, nt_xent)


# -- through Guard.step ----------------------------------------------------------------

@pytest.mark.parametrize("micro", [4, 5])
def test_guard_step_gradcache_mode_equals_the_microbatchwise_step_with_dropout(micro):
    """Guard.step(embed_fn=...) with dropout on: the same parameters as
    the split forward with graphs (the math GradCache reproduces), and the
    same as the unsplit step when dropout is off."""
    from memguard import Guard

    for p, reference in ((0.1, "microwise"), (0.0, "plain")):
        ref, ref_opt, gc_model, gc_opt = encoder_twins(p=p)
        guard = Guard(budget=None, micro_batch=micro, allocator=False)
        for batch in views():
            torch.manual_seed(7)
            if reference == "microwise":
                ref_loss = microwise_step(ref_opt, batch, micro, ref, nt_xent)
            else:
                ref_loss = plain_step(ref_opt, batch, ref, nt_xent)
            torch.manual_seed(7)
            res = guard.step(batch, nt_xent, gc_opt, embed_fn=gc_model)
            assert res.loss == pytest.approx(ref_loss, rel=1e-6)
            assert res.n_micro == len(_batch.Sizes().of(N, micro)) and res.micro_batch == micro
            assert res.aux.shape == (N, 2, D_OUT)
            assert all(q.grad is None for q in gc_model.parameters())
        assert_same_params(ref, gc_model)


def test_guard_step_gradcache_recovers_from_an_oom_in_the_replay():
    """An out-of-memory error while replaying a micro-batch with its graph
    redoes the step at half the size: the result equals a step at that
    size."""
    from memguard import Guard

    ref, ref_opt, gc_model, gc_opt = encoder_twins(p=0.1)
    calls = {"n": 0}

    def embed(x):
        calls["n"] += 1
        if torch.is_grad_enabled() and calls["n"] == 3:   # attempt 1: 2 passes, then a replay
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to "
                               "allocate 1 bytes")
        return gc_model(x)

    batch = views(steps=1)[0]
    torch.manual_seed(3)
    microwise_step(ref_opt, batch, 4, ref, nt_xent)
    torch.manual_seed(3)
    res = Guard(budget=None, micro_batch=8, allocator=False).step(
        batch, nt_xent, gc_opt, embed_fn=embed)
    assert res.retries == 1 and res.tried == [8] and res.micro_batch == 4
    assert_same_params(ref, gc_model)


def test_guard_step_gradcache_under_ddp_all_reduces_once_through_the_guard(gloo_group):
    """Guard.step(embed_fn=...) with a real DistributedDataParallel model
    (one-process gloo group): the guard runs every pass under no_sync()
    (DDP all-reduces nothing) and all-reduces the gradients itself once,
    after the ranks agreed; the steps are the unsplit ones."""
    from memguard import Guard

    ref, ref_opt, module, opt = encoder_twins(p=0.0)
    ddp = torch.nn.parallel.DistributedDataParallel(module)
    seen = count_all_reduces(ddp, lambda: None)
    guard = Guard(budget=None, micro_batch=4, model=ddp, allocator=False)
    for batch in views(steps=2):
        plain_step(ref_opt, batch, ref, nt_xent)
        res = guard.step(batch, nt_xent, opt, embed_fn=ddp)
        assert res.n_micro == N // 4
    assert seen == []
    # per step: one bucket of gradients (on one rank the plan and the
    # out-of-memory vote need no all-reduce)
    assert guard._peers.collectives == 1 * 2
    assert_same_params(ref, module)


def test_guard_step_callable_errors():
    """GradCache is chosen by embed_fn alone; what must be callable is
    checked before the step begins, and the error names the value."""
    from memguard import Guard

    model, opt, _, _ = encoder_twins()
    guard = Guard(budget=None, allocator=False)
    batch = views(steps=1)[0]
    with pytest.raises(ValueError, match="embed_fn must be callable, not 'model'"):
        guard.step(batch, nt_xent, opt, embed_fn="model")
    with pytest.raises(ValueError, match="post_step must be callable"):
        guard.step(batch, nt_xent, opt, post_step=3)
    with pytest.raises(TypeError, match="mode"):
        guard.step(batch, nt_xent, opt, mode="gradcache", embed_fn=model)
    assert guard.steps == 0
