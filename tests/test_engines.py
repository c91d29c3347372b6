"""memguard.train.engines.check_supported: the distributed engines memguard's
step runs (one process, DDP, FSDP2 and HSDP) pass; FSDP1, tensor
parallelism and pipeline parallelism are refused with
:class:`memguard.UnsupportedEngine`, naming the engine and what to use
instead. Real DDP, FSDP2 and tensor-parallel modules on a one-rank gloo
group; FSDP1 needs an accelerator to be built, so its instance here is made
without its constructor (the check is a type check)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
nn = torch.nn

import memguard
from memguard.train.engines import UnsupportedEngine, check_supported

INSTEAD = ("use FSDP2 (torch.distributed.fsdp.fully_shard; in Lightning, ModelParallelStrategy "
           "with fully_shard in configure_model) or DDP")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def mesh(*shape: int, names: tuple[str, ...] | None = None):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def fsdp1() -> nn.Module:
    """A FullyShardedDataParallel wrapper around a Linear, made without its
    constructor (which refuses a machine without an accelerator)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    m = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(m)
    m._fsdp_wrapped_module = nn.Linear(4, 2)
    return m


def tensor_parallel(m: nn.Module, tp_mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    return parallelize_module(m, tp_mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})


def refused(model) -> str:
    with pytest.raises(UnsupportedEngine) as info:
        check_supported(model)
    assert isinstance(info.value, TypeError)
    assert INSTEAD in str(info.value)
    return str(info.value)


def test_the_engines_memguard_steps_pass(gloo_group):
    """None, a plain module, DDP, FSDP2 (root and a layer), HSDP (FSDP2 on
    a replicate x shard mesh, whose placements are Replicate then Shard)."""
    from torch.distributed.fsdp import fully_shard
    check_supported(None)
    check_supported(mlp())
    check_supported(nn.parallel.DistributedDataParallel(mlp()))
    m = mlp()
    fully_shard(m[0], mesh=mesh(1))
    fully_shard(m, mesh=mesh(1))
    check_supported(m)
    hsdp = fully_shard(mlp(), mesh=mesh(1, 1, names=("replicate", "shard")))
    assert type(hsdp[0].weight.placements[0]).__name__ == "Replicate"
    check_supported(hsdp)
    assert memguard.UnsupportedEngine is UnsupportedEngine


def test_fsdp1_is_refused_wherever_it_wraps():
    assert "the model is wrapped in FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel, " \
        "what Lightning's strategy=\"fsdp\" uses)" in refused(fsdp1())
    assert "the model's module '1' is wrapped in FSDP1" in refused(nn.Sequential(nn.ReLU(),
                                                                                 fsdp1()))


def test_tensor_parallelism_is_refused_alone_and_with_fsdp2(gloo_group):
    """parallelize_module on a 1-D mesh; and on the 'tp' dimension of a 2-D
    mesh whose 'dp' dimension fully_shard shards: inside an FSDP2 module,
    but placed (Shard, Shard), which FSDP2 alone does not make."""
    from torch.distributed.fsdp import fully_shard
    said = refused(tensor_parallel(mlp(), mesh(1, names=("tp",))))
    assert "the model's parameter '0.weight' is tensor-parallel (a DTensor placed " \
        "(Shard(dim=0),) on a 1-D mesh ('tp',): torch.distributed.tensor.parallel." \
        "parallelize_module)" in said
    two = mesh(1, 1, names=("dp", "tp"))
    m = fully_shard(tensor_parallel(mlp(), two["tp"]), mesh=two["dp"])
    assert "'0.weight' is tensor-parallel (a DTensor placed (Shard(dim=0), Shard(dim=0)) on a " \
        "2-D mesh ('dp', 'tp')" in refused(m)


def test_pipeline_stages_and_schedules_are_refused(gloo_group):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    stage = PipelineStage(nn.Linear(4, 2), 0, 1, torch.device("cpu"))
    assert "the model is a pipeline-parallel PipelineStage (torch.distributed.pipelining)" \
        in refused(stage)
    assert "pipeline-parallel ScheduleGPipe" in refused(ScheduleGPipe(stage, 2))
