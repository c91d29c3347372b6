"""Activation checkpointing that can be switched on and off, block by block,
while the run goes on.

::

    ckpt = memguard.train.checkpoint.wrap(model.blocks)   # nothing checkpointed yet
    ckpt.set(4)          # the first 4 blocks recompute their activations in backward
    ckpt.more(); ckpt.fewer(2); ckpt.set(0)

Each block's ``forward`` is wrapped on the instance, so the module tree, the
parameter names and ``state_dict`` stay as they were. A checkpointed block
runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` with
the RNG state preserved, so dropout draws the same masks in the recomputation
and the gradients equal the un-checkpointed ones. Under ``no_grad`` (evaluation)
blocks run plainly.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as _checkpoint

_ATTR = "_memguard_checkpoint"


class _Switch:
    """One wrapped block: its original bound forward and whether it is on."""

    def __init__(self, block: torch.nn.Module) -> None:
        self.block = block
        self.orig = block.forward
        self.on = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.on and torch.is_grad_enabled():
            return _checkpoint(self.orig, *args, use_reentrant=False,
                               preserve_rng_state=True, **kwargs)
        return self.orig(*args, **kwargs)


class Checkpoints:
    """Switchable checkpointing over an ordered set of blocks; the first
    :attr:`n_on` blocks are checkpointed (activations of early blocks live
    longest, so they are the first worth recomputing)."""

    def __init__(self, switches: list[_Switch]) -> None:
        self._switches = switches

    def __len__(self) -> int:
        return len(self._switches)

    @property
    def n_on(self) -> int:
        """Blocks checkpointed now."""
        return sum(s.on for s in self._switches)

    def set(self, n: int) -> int:
        """Checkpoint the first ``n`` blocks (clamped to 0..len); returns n."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"the number of checkpointed blocks must be an int, not {n!r}")
        n = max(0, min(n, len(self)))
        for i, s in enumerate(self._switches):
            s.on = i < n
        return n

    def more(self, k: int = 1) -> int:
        """Checkpoint ``k`` more blocks; returns how many are on."""
        return self.set(self.n_on + k)

    def fewer(self, k: int = 1) -> int:
        """Checkpoint ``k`` fewer blocks; returns how many are on."""
        return self.set(self.n_on - k)

    def unwrap(self) -> None:
        """Give every block its own forward back."""
        for s in self._switches:
            s.block.__dict__.pop("forward", None)
            s.block.__dict__.pop(_ATTR, None)
        self._switches = []


def wrap(modules: torch.nn.Module | Iterable[torch.nn.Module]) -> Checkpoints:
    """Make ``modules`` (a ``ModuleList``/``Sequential`` such as a ViT's
    ``blocks``, a list of modules, or one module) switchable between normal
    and checkpointed execution. Nothing is checkpointed until
    :meth:`Checkpoints.set`.

    Raises:
        TypeError: something that is not a module.
        ValueError: a block already wrapped, or no block at all.
    """
    blocks = [modules] if isinstance(modules, torch.nn.Module) and not isinstance(
        modules, (torch.nn.ModuleList, torch.nn.Sequential)) else list(modules)
    if not blocks:
        raise ValueError("nothing to checkpoint: no blocks given")
    switches = []
    for b in blocks:
        if not isinstance(b, torch.nn.Module):
            raise TypeError(f"checkpoint.wrap takes modules, not {type(b).__name__}")
        if _ATTR in b.__dict__:
            raise ValueError(f"{type(b).__name__} block is already wrapped for checkpointing")
    for b in blocks:
        s = _Switch(b)
        b.__dict__[_ATTR] = s
        b.forward = s.forward   # the instance attribute wins over the class's forward
        switches.append(s)
    return Checkpoints(switches)
