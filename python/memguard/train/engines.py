"""Distributed engines memguard's step cannot run, refused by name.

A guarded step redoes a step that ran out of memory, on every rank alike:
every rank must be able to stop between micro-batches and start the step
again with nothing of the failed attempt left. memguard does that for a
model on one process, under DDP (``DistributedDataParallel``, Lightning's
``strategy="ddp"``) and under FSDP2 (``torch.distributed.fsdp.fully_shard``,
Lightning's ``ModelParallelStrategy`` with ``fully_shard`` in
``configure_model``). :func:`check_supported` refuses, with
:class:`UnsupportedEngine` naming the engine and what to use instead:

* FSDP1, ``torch.distributed.fsdp.FullyShardedDataParallel`` anywhere in
  the model (Lightning's ``strategy="fsdp"`` wraps the module in it): its
  flat parameters are gathered and its gradients reduce-scattered inside
  every micro-batch, by a state machine memguard cannot reset after a
  failed attempt;
* tensor parallelism (``torch.distributed.tensor.parallel.parallelize_module``):
  parameters that are DTensors outside any FSDP2 module, or inside one with
  placements FSDP2 does not make. FSDP2 shards a parameter on its mesh's
  one dimension (``Shard``), or on the second of HSDP's two after
  ``Replicate``; any other placement is another engine's. A tensor-parallel
  forward runs collectives within its group in every layer, sized by the
  micro-batch, which the ranks of a step do not agree on;
* pipeline parallelism (``torch.distributed.pipelining``: a stage, a
  schedule, or the ``Pipe`` a split model is): a stage runs part of the
  forward and backward of micro-batches the schedule sends between ranks,
  not a step memguard can split and redo.

Nothing is imported here: an engine whose module the process never
imported has made no model, so the check costs a walk over the parameters
at most, and only where DTensors exist.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["UnsupportedEngine", "check_supported"]

_INSTEAD = ("use FSDP2 (torch.distributed.fsdp.fully_shard; in Lightning, ModelParallelStrategy "
            "with fully_shard in configure_model) or DDP (DistributedDataParallel; in Lightning, "
            "strategy=\"ddp\")")


class UnsupportedEngine(TypeError):
    """The model is run by a distributed engine memguard's step does not
    support; the message names it and what to use instead."""


def check_supported(model: Any) -> None:
    """Refuse a model memguard cannot step (see the module docs).

    Args:
        model: the trained module (DDP- or FSDP-wrapped, or not), a pipeline
            stage or schedule, or ``None`` (nothing to check).

    Raises:
        UnsupportedEngine: FSDP1, tensor parallelism or pipeline parallelism,
            named, with what to use instead.
    """
    if model is None:
        return
    for check in (_pipeline, _fsdp1, _tensor_parallel):
        said = check(model)
        if said is not None:
            raise UnsupportedEngine(f"memguard: {said}, which memguard's step does not support: "
                                    f"{_INSTEAD}")


def _loaded(module: str, *names: str) -> tuple[type, ...]:
    """The classes ``names`` of ``module`` where the process imported it
    (none were made otherwise); those it lacks (another torch) left out."""
    mod = sys.modules.get(module)
    found = (getattr(mod, n, None) for n in names) if mod is not None else ()
    return tuple(c for c in found if isinstance(c, type))


def _pipeline(model: Any) -> str | None:
    """A pipeline stage, a schedule, or a ``Pipe`` (in the model too)."""
    kinds = _loaded("torch.distributed.pipelining.stage", "_PipelineStageBase") + \
        _loaded("torch.distributed.pipelining.schedules", "_PipelineSchedule")
    if kinds and isinstance(model, kinds):
        return (f"the model is a pipeline-parallel {type(model).__name__} "
                f"(torch.distributed.pipelining)")
    pipe = _loaded("torch.distributed.pipelining._IR", "Pipe")
    if pipe and isinstance(model, torch.nn.Module) and \
            any(isinstance(m, pipe) for m in model.modules()):
        return "the model is split into pipeline stages (torch.distributed.pipelining.Pipe)"
    return None


def _fsdp1(model: Any) -> str | None:
    """FSDP1 anywhere in the module tree."""
    fsdp = _loaded("torch.distributed.fsdp", "FullyShardedDataParallel")
    if not fsdp or not isinstance(model, torch.nn.Module):
        return None
    for name, m in model.named_modules():
        if isinstance(m, fsdp):
            where = f"the model's module {name!r} is" if name else "the model is"
            return (f"{where} wrapped in FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel, "
                    f"what Lightning's strategy=\"fsdp\" uses)")
    return None


def _tensor_parallel(model: Any) -> str | None:
    """The first DTensor parameter that is not FSDP2's alone."""
    dtensor = _loaded("torch.distributed.tensor", "DTensor")
    if not dtensor or not isinstance(model, torch.nn.Module):
        return None
    found = _foreign_dtensor(model, "", False, dtensor[0], _loaded("torch.distributed.fsdp",
                                                                    "FSDPModule"))
    if found is None:
        return None
    name, p = found
    mesh = p.device_mesh
    dims = f" {tuple(mesh.mesh_dim_names)}" if mesh.mesh_dim_names else ""
    return (f"the model's parameter {name!r} is tensor-parallel (a DTensor placed {tuple(p.placements)} "
            f"on a {mesh.ndim}-D mesh{dims}: torch.distributed.tensor.parallel."
            f"parallelize_module)")


def _foreign_dtensor(module: torch.nn.Module, prefix: str, sharded: bool, dtensor: type,
                     fsdp2: tuple[type, ...]) -> tuple[str, Any] | None:
    """(name, parameter) of the first DTensor parameter of ``module``'s tree
    that is outside every FSDP2 module (``sharded``: inside one), or inside
    one with placements FSDP2 does not make."""
    sharded = sharded or (bool(fsdp2) and isinstance(module, fsdp2))
    for name, p in module.named_parameters(recurse=False):
        if isinstance(p, dtensor) and not (sharded and _fsdp2_placements(p.placements)):
            return prefix + name, p
    for name, child in module.named_children():
        found = _foreign_dtensor(child, f"{prefix}{name}.", sharded, dtensor, fsdp2)
        if found is not None:
            return found
    return None


def _fsdp2_placements(placements: tuple) -> bool:
    """FSDP2's own placements: ``Shard`` on a 1-D mesh, or ``Replicate``
    then ``Shard`` on HSDP's 2-D one (types compared exactly: a strided
    shard is tensor parallelism's with FSDP2)."""
    from torch.distributed.tensor import Replicate, Shard
    *outer, last = placements
    return type(last) is Shard and len(outer) <= 1 and all(type(p) is Replicate for p in outer)
