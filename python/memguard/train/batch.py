"""Splitting a batch into micro-batches and joining per-micro-batch outputs.

A batch is a tensor or any nesting of tuples (named ones too), lists, dicts
and dataclasses around tensors. Tensors of one dimension or more split along
dim 0 (as views, nothing is copied). A list holding no tensors and no
containers is a sequence of samples (file names, captions, as PyTorch's
default collate makes them) and is sliced the same way. Anything else (a
tuple of plain values such as an image size, a 0-d tensor, an int, a string
on its own) is metadata, the same for every micro-batch.

One shape is ambiguous and refused, in the batch a caller gives
(:func:`checked_size`), with a ``ValueError`` that names where it is: a list
of tensors as long as each tensor's dim 0 (one tensor per sample, not yet
stacked, or batched tensors, such as crops, as many as the samples?). A
tuple of tensors is always batched tensors.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import torch


def _is_container(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, Mapping, list, tuple)) or (
        dataclasses.is_dataclass(x) and not isinstance(x, type))


def _is_samples(x: Any) -> bool:
    """A list of plain values: one per sample."""
    return isinstance(x, list) and not any(_is_container(v) for v in x)


def _rebuild(like: Any, values: list) -> Any:
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return type(like)(*values)
    return type(like)(values)


def _map(batch: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to each splittable leaf; other leaves pass through."""
    if isinstance(batch, torch.Tensor):
        return fn(batch) if batch.dim() > 0 else batch
    if _is_samples(batch):
        return fn(batch)
    if isinstance(batch, Mapping):
        mapped = {k: _map(v, fn) for k, v in batch.items()}
        try:
            return mapped if type(batch) is dict else type(batch)(mapped)
        except TypeError:
            return mapped
    if isinstance(batch, (list, tuple)):
        return _rebuild(batch, [_map(v, fn) for v in batch])
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{
            f.name: _map(getattr(batch, f.name), fn) for f in dataclasses.fields(batch)
            if f.init})
    return batch


def leaves(batch: Any) -> list:
    """The splittable leaves of ``batch``, depth first."""
    out: list = []

    def take(x: Any) -> Any:
        out.append(x)
        return x

    _map(batch, take)
    return out


def batch_size(batch: Any) -> int:
    """Samples in ``batch``: the common length of its splittable leaves.

    Raises:
        ValueError: no splittable leaf, or leaves of different lengths.
    """
    sizes = {len(x) if not isinstance(x, torch.Tensor) else x.shape[0] for x in leaves(batch)}
    if not sizes:
        raise ValueError("the batch holds no tensor with a batch dimension and no list of "
                         f"samples to split: {type(batch).__name__}")
    if len(sizes) > 1:
        raise ValueError(f"the batch's tensors and sample lists disagree on the batch size "
                         f"(dim 0): {sorted(sizes)}")
    return sizes.pop()


def checked_size(batch: Any) -> int:
    """:func:`batch_size` of a batch as the caller gave it, refusing first
    what cannot be split safely (see the module's docs). Micro-batches are
    not checked again: one of batched crops may be as long as its crops.

    Raises:
        ValueError: naming where the ambiguous list is, and the two ways out.
    """
    _refuse_unstacked(batch, "batch")
    return batch_size(batch)


def _refuse_unstacked(x: Any, where: str) -> None:
    """Refuse a list of tensors as long as each one's dim 0: one tensor per
    sample (to stack) cannot be told from batched tensors (to split)."""
    if isinstance(x, Mapping):
        for k, v in x.items():
            _refuse_unstacked(v, f"{where}[{k!r}]")
    elif isinstance(x, (list, tuple)):
        if (isinstance(x, list) and len(x) > 1 and all(isinstance(v, torch.Tensor) for v in x)
                and all(v.dim() > 0 and v.shape[0] == len(x) for v in x)):
            raise ValueError(
                f"{where} is a list of {len(x)} tensors of shape {tuple(x[0].shape)}, whose dim 0 "
                f"is also {len(x)}: memguard cannot tell one tensor per sample from batched "
                f"tensors. Stack per-sample tensors (torch.stack, as the DataLoader's default "
                f"collate does), or pass batched tensors as a tuple")
        for i, v in enumerate(x):
            _refuse_unstacked(v, f"{where}[{i}]")
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            _refuse_unstacked(getattr(x, f.name), f"{where}.{f.name}")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What every micro-batch must be: a multiple of ``multiple_of``, a
    divisor of ``divisor_of`` (where given), at least ``least`` samples, and
    never one sample of a batch of more (BatchNorm raises on one; a
    pair-wise loss has no pair).

    A batch of ``n`` at a planned ``size`` is ``n // size`` micro-batches of
    ``size`` and what remains, which is kept as micro-batches where it makes
    valid ones (the largest first: 36 at 64 under ``divisor_of=65536`` is 32
    and 4); else it takes samples from the last full micro-batch where both
    stay valid (13 at 4 is 4, 4, 3 and 2: no micro-batch above the plan);
    else it is merged into the last one (7 at 2 under ``multiple_of=2`` is
    2, 2 and 3, which breaks the constraint as the whole batch of 7 does,
    and no more).
    """
    multiple_of: int = 1
    divisor_of: int | None = None
    least: int = 1

    def valid(self, m: int) -> bool:
        return (m >= max(2, self.least) and m % self.multiple_of == 0
                and (self.divisor_of is None or self.divisor_of % m == 0))

    def of(self, n: int, size: int) -> list[int]:
        """The sizes of the micro-batches of a batch of ``n`` at ``size``."""
        if size >= n:
            return [n]
        out = [size] * (n // size)
        rest = n % size
        while rest:
            m = next((m for m in range(rest, 0, -1) if self.valid(m)), 0)
            if not m:
                self._borrow_or_merge(out, rest)
                break
            out.append(m)
            rest -= m
        return out

    def _borrow_or_merge(self, out: list[int], rest: int) -> None:
        """``rest`` makes no valid micro-batch: it takes samples from the
        last one where both stay valid, else joins it."""
        last = out[-1]
        take = next((k for k in range(1, last) if self.valid(last - k) and
                     self.valid(rest + k)), 0)
        if take:
            out[-1] -= take
            out.append(rest + take)
        else:
            out[-1] += rest


def split(batch: Any, n: int, size: int, sizes: Sizes | None = None) -> list:
    """``batch`` of ``n`` samples as micro-batches of ``size`` samples, what
    remains as ``sizes`` says (by default: no constraint but the one-sample
    rule)."""
    out, start = [], 0
    for m in (sizes or Sizes()).of(n, size):
        out.append(batch if m == n else slice_(batch, start, start + m))
        start += m
    return out


def slice_(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of ``batch``."""
    return _map(batch, lambda x: x[start:stop])


def concat(parts: list) -> Any:
    """Join per-micro-batch outputs of the same structure along dim 0."""
    if not parts:
        return None
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack(parts)
        return torch.cat(parts)
    if _is_samples(first):
        return _rebuild(first, [v for p in parts for v in p])
    if isinstance(first, Mapping):
        return {k: concat([p[k] for p in parts]) for k in first}
    if isinstance(first, (list, tuple)):
        return _rebuild(first, [concat([p[i] for p in parts]) for i in range(len(first))])
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.replace(first, **{
            f.name: concat([getattr(p, f.name) for p in parts])
            for f in dataclasses.fields(first) if f.init})
    return first


def detach(x: Any) -> Any:
    """``x`` with every tensor detached (outputs kept past a step must not
    hold its graph alive)."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, Mapping):
        return {k: detach(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) and not _is_samples(x):
        return _rebuild(x, [detach(v) for v in x])
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{
            f.name: detach(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init})
    return x
