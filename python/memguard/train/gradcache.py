"""GradCache: micro-batched backward for a loss over the whole batch.

Contrastive losses with in-batch negatives (SimCLR, MoCo v3, CLIP) compare
every sample with every other one, so the loss cannot be split into
per-micro-batch terms the way :class:`memguard.Accumulator` splits a mean.
GradCache (Gao et al., 2021, "Scaling Deep Contrastive Learning Batch Size
under Memory Limited Setup") splits the *encoder* instead:

1. embed every micro-batch without a graph (cheap: only the embeddings stay);
2. compute the whole batch's loss on the concatenated embeddings, made leaf
   tensors, and backpropagate it to them: the cached embedding gradients;
3. embed every micro-batch again, this time with a graph, and backpropagate
   its slice of the cached gradients into the parameters.

By the chain rule the parameter gradients are the whole batch's, while the
encoder's activations only ever exist for one micro-batch at a time.

Requirements on ``embed_fn``:

* **per-sample independence.** A sample's embedding may depend only on that
  sample (and on the RNG). BatchNorm in training mode normalises over the
  batch, so a micro-batch's statistics are not the batch's: GradCache with
  BatchNorm computes something else than the unsplit step, and also updates
  the running statistics twice (once per pass). Use LayerNorm or GroupNorm,
  or BatchNorm in eval mode.
* **repeatability.** The second pass must compute what the first one did;
  the RNG (CPU, and CUDA's where initialised before the call) is put back
  before each micro-batch's second pass, so dropout draws the same masks.
  Other randomness (a Python ``random`` call, NumPy, another device's
  generator) is not replayed.

Dropout masks, split versus unsplit. GradCache reproduces exactly the
micro-batch-wise forward (``concat(embed_fn(m) for m in micro_batches)``
with graphs, then one backward). Whether that forward draws the same
dropout masks as one forward over the whole batch depends on the order in
which the RNG is consumed. On CPU (checked on torch 2.13) a dropout mask is
drawn element by element from one generator stream, so a single dropout
call on rows ``0..B-1`` draws the same mask as consecutive calls on rows
``0..m-1``, ``m..2m-1``, ...: an encoder with one dropout layer on a
``[samples, ...]`` tensor gets the unsplit masks. With two dropout layers
(or two views encoded by separate calls) the unsplit forward draws layer 1
for all rows then layer 2, the split one interleaves them per micro-batch,
and the masks differ: the gradients then equal the unsplit step's in
distribution only, which is all any micro-batching can give. CUDA's fused
dropout advances a Philox offset per call rather than drawing element by
element, so expect split masks to differ there even with one layer (not
checked here: no GPU).
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import torch

from memguard.train import batch as _batch
from memguard.train.snapshot import Rng

__all__ = ["gradcache_backward"]


def _grad_leaves(x: Any) -> list[torch.Tensor]:
    """The floating-point tensors of an embedding nest, depth first: the
    leaves gradients flow through. Integer tensors and sample lists that
    ``embed_fn`` may return alongside are handed to ``loss_fn`` as
    constants."""
    return [t for t in _batch.leaves(x)
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]


def _as_leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
        return x.detach().requires_grad_(True)
    return x


def gradcache_backward(batch: Any, n: int, micro: int, embed_fn: Callable[[Any], Any],
                       loss_fn: Callable[[Any], torch.Tensor], scaler: Any = None, *,
                       model: torch.nn.Module | None = None,
                       sizes: _batch.Sizes | None = None) -> tuple[float, Any]:
    """One step's backward for a loss over the whole batch, in micro-batches.

    Parameter gradients are *added* to ``.grad`` (zero them before, step
    after): they are the gradients of ``loss_fn(embed_fn(batch))``, the
    whole batch's loss, with no weighting to undo. Parameters used by
    ``loss_fn`` itself (CLIP's ``logit_scale``, a projection head applied
    in the loss) get theirs from the loss's backward.

    ``embed_fn`` runs twice per micro-batch: first under ``torch.no_grad()``
    with the RNG state recorded before each micro-batch, then with grads on
    and the RNG put back to that state, so dropout draws the same masks in
    both passes. After the call the RNG is where it would be after the
    micro-batch-wise forward (each micro-batch embedded once, then the loss
    computed): the replay consumes nothing on balance, and the next step
    draws fresh masks.

    With ``micro >= n`` there is one micro-batch and nothing to cache: the
    step is the plain ``loss_fn(embed_fn(batch)).backward()``, bit for bit.

    Args:
        batch: a tensor or a nest of tensors (see :mod:`memguard.train.batch`),
            split along dim 0.
        n: the samples in ``batch``.
        micro: samples per micro-batch (what remains as ``sizes`` says).
        embed_fn: ``embed_fn(micro_batch)`` returns embeddings: a tensor or
            a nest of tensors (a tuple for CLIP's two towers), each with the
            micro-batch's samples along dim 0. Each sample's embedding must
            depend on that sample only (no BatchNorm in training mode).
        loss_fn: ``loss_fn(embeddings)`` with the whole batch's embeddings
            (concatenated leaf by leaf) returns the step's loss, a scalar.
        scaler: a ``torch.amp.GradScaler``: the loss is scaled before its
            backward, so the cached and the parameter gradients are scaled
            too (``scaler.step`` unscales them).
        model: the module trained; where it has ``no_sync`` (DDP, FSDP),
            every replayed micro-batch but the last runs under it, so the
            gradients are all-reduced once.
        sizes: what every micro-batch must be (:class:`memguard.train.batch.Sizes`;
            by default, never one sample of a batch of more).

    Returns:
        ``(loss, embeddings)``: the loss as a float (unscaled) and the whole
        batch's embeddings, detached (a queue or a monitor may keep them).

    Raises:
        ValueError: ``n`` or ``micro`` is not a positive integer, ``n`` is
            not the batch's size, an embedding is not per-sample (its dim 0
            is not the micro-batch's size), or the loss is not a scalar
            tensor that depends on the embeddings.
        RuntimeError: the second pass returned embeddings of another
            structure or shape than the first (``embed_fn`` is not
            repeatable).
    """
    for name, v in (("n", n), ("micro", micro)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, not {v!r}")
    size = _batch.batch_size(batch)
    if size != n:
        # split() trusts n; a wrong one would drop or repeat samples silently
        raise ValueError(f"n={n} but the batch holds {size} samples")

    if micro >= n:
        # One micro-batch: caching would run the encoder twice for nothing.
        with torch.enable_grad():
            emb = embed_fn(batch)
            _check_per_sample(emb, n)
            loss = _check_loss(loss_fn(emb))
            (scaler.scale(loss) if scaler is not None else loss).backward()
        return float(loss.detach()), _batch.detach(emb)

    parts = _batch.split(batch, n, micro, sizes)
    sizes = [_batch.batch_size(p) for p in parts]

    # 1. Embeddings without graphs; the RNG state before each micro-batch
    #    is what its replay starts from.
    states: list[Rng] = []
    cached: list[Any] = []
    with torch.no_grad():
        for part, m in zip(parts, sizes):
            states.append(Rng())
            emb = embed_fn(part)
            _check_per_sample(emb, m)
            cached.append(emb)
    del emb
    shapes = [[tuple(t.shape) for t in _grad_leaves(e)] for e in cached]

    # 2. The whole batch's loss on leaf embeddings: their .grad is the cache.
    full = _batch._map(_batch.concat(cached), _as_leaf)
    del cached    # the concatenation is a copy: the per-micro outputs can go
    leaves = _grad_leaves(full)
    with torch.enable_grad():
        loss = _check_loss(loss_fn(full))
        (scaler.scale(loss) if scaler is not None else loss).backward()
    # None: the loss did not use that leaf (e.g. one tower of two).
    grads = [t.grad for t in leaves]
    loss_value = float(loss.detach())
    del loss, leaves
    after = Rng()   # the loss may draw too (sampled negatives)

    # 3. Replay each micro-batch with a graph, backpropagating its slice.
    no_sync = getattr(model, "no_sync", None)
    start = 0
    for i, (part, m, state) in enumerate(zip(parts, sizes, states)):
        last = i == len(parts) - 1
        state.restore()
        sync = contextlib.nullcontext() if last or no_sync is None else no_sync()
        with sync, torch.enable_grad():
            outs = _grad_leaves(embed_fn(part))
            if [tuple(t.shape) for t in outs] != shapes[i]:
                raise RuntimeError(
                    "embed_fn returned embeddings of other shapes on its second pass over "
                    f"micro-batch {i} ({[tuple(t.shape) for t in outs]} after {shapes[i]}): "
                    "GradCache needs it to repeat its first pass")
            pairs = [(o, g[start:start + m]) for o, g in zip(outs, grads)
                     if g is not None and o.requires_grad]
            if pairs:   # a frozen tower's outputs carry no gradient
                torch.autograd.backward([o for o, _ in pairs],
                                        grad_tensors=[g for _, g in pairs])
            del outs, pairs   # this micro-batch's graph goes before the next one's
        start += m
    after.restore()
    return loss_value, _batch.detach(full)


def _tensors(x: Any) -> list[torch.Tensor]:
    """Every tensor in a nest, 0-d ones included (``_batch.leaves`` skips
    those: in a batch they are shared by all samples)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, Mapping):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [t for f in dataclasses.fields(x) for t in _tensors(getattr(x, f.name))]
    return []


def _check_per_sample(emb: Any, m: int) -> None:
    leaves = [t for t in _tensors(emb) if t.is_floating_point() or t.is_complex()]
    if not leaves:
        raise ValueError("embed_fn returned no floating-point tensor: there is nothing to "
                         f"cache gradients for ({type(emb).__name__})")
    # A 0-d output (a temperature, a per-micro-batch statistic) would be
    # stacked into one value per micro-batch, not per sample: no slice of
    # the cached gradients would belong to it.
    bad = [tuple(t.shape) for t in leaves if t.dim() == 0 or t.shape[0] != m]
    if bad:
        raise ValueError(f"embed_fn returned tensors of shapes {bad} for {m} samples: every "
                         "embedding must hold one row per sample along dim 0")


def _check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor (the whole batch's loss), "
                         f"not {what}")
    if not loss.requires_grad:
        # backward() would say only "does not require grad"; name the cause
        raise ValueError("the loss does not depend on the embeddings (it has no grad_fn): "
                         "there is no gradient to send back through embed_fn")
    return loss
