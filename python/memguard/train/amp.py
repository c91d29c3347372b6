"""float16 mixed precision on the CPU, warned about once per guard.

A CPU has no float16 tensor cores (outside the few with AMX-FP16): float16
autocast there computes no faster than float32 and adds a cast of every
weight and activation it lowers, and a ``GradScaler`` only guards against an
overflow float16 brings (and skips the updates it overflows). bfloat16
autocast keeps float32's range, needs no scaler, and is what CPUs
accelerate: it is left alone.

The check runs once per guard, on its first step's first micro-batch, and
reads no tensor's value: the scaler given, the autocast state around the
step, the casts in that micro-batch's graph (autocast entered inside
``loss_fn`` has ended by the time the guard sees its loss), and the devices
of the optimizer's parameters.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

#: at most this many nodes of a loss's graph are looked at for float16 casts
GRAPH_NODES = 4096

MESSAGE = (
    "memguard: {what} in a step whose parameters are all on the CPU saves nothing: a CPU has "
    "no float16 tensor cores (outside the few with AMX-FP16), so float16 autocast costs a cast "
    "of each weight and activation it lowers, and a GradScaler only skips the updates float16 "
    "overflows. Use bfloat16 autocast (torch.autocast('cpu', dtype=torch.bfloat16)) without a "
    "scaler, or float32")


def _autocast_fp16() -> bool:
    """Whether float16 autocast for the CPU is on here (torch 2.0's API before 2.4's)."""
    try:
        return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    except (AttributeError, TypeError):
        return torch.is_autocast_cpu_enabled() and torch.get_autocast_cpu_dtype() == torch.float16


def _graph_casts_fp16(loss: Any) -> bool:
    """Whether the graph behind ``loss`` casts to float16 (autocast entered
    inside ``loss_fn``): a ``ToCopyBackward`` node whose input is float16,
    among the first :data:`GRAPH_NODES` nodes. Needs the nodes' input
    metadata (torch 2.4 on); ``False`` without it."""
    fn = getattr(loss, "grad_fn", None)
    seen, todo = set(), [fn] if fn is not None else []
    while todo and len(seen) < GRAPH_NODES:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node).__name__.startswith("ToCopyBackward"):
            meta = getattr(node, "_input_metadata", None)
            if meta is None:
                return False
            if any(getattr(m, "dtype", None) == torch.float16 for m in meta):
                return True
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return False


def _all_on_cpu(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer has parameters, all of them on the CPU."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return bool(params) and all(p.device.type == "cpu" for p in params)


def cpu_fp16(loss: Any, scaler: Any, optimizer: torch.optim.Optimizer) -> str | None:
    """What float16 mixed precision a CPU step uses ("float16 autocast",
    "a GradScaler", or both in words), or ``None``: none, bfloat16, or a
    parameter off the CPU. ``loss`` is the first micro-batch's (``None``:
    no graph to look at)."""
    what = []
    if _autocast_fp16() or (loss is not None and _graph_casts_fp16(loss)):
        what.append("float16 autocast")
    if scaler is not None and getattr(scaler, "is_enabled", lambda: True)():
        what.append("a GradScaler")
    if not what or not _all_on_cpu(optimizer):
        return None
    return " with ".join(what)


def warn_cpu_fp16(loss: Any, scaler: Any, optimizer: torch.optim.Optimizer,
                  stacklevel: int) -> bool:
    """Warn where :func:`cpu_fp16` finds float16 mixed precision on the CPU,
    naming the line ``stacklevel`` frames up from this function's caller
    (1: the caller). Returns whether it warned."""
    what = cpu_fp16(loss, scaler, optimizer)
    if what is None:
        return False
    warnings.warn(MESSAGE.format(what=what), UserWarning, stacklevel=stacklevel + 1)
    return True
