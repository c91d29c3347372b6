"""One rank of the FSDP2 and in-loss collective tests (tests/test_fsdp.py),
started by ``torchrun`` on gloo (CPU).

Every scenario of :data:`SCENARIOS` runs in one launch, one after the other:
a small MLP with each Linear and the root ``fully_shard``ed (or wrapped in
DDP), AdamW, each rank on its half of every global batch, through
``Guard.step``; and the same model trained by the plain unsplit loop, the
reference. Out-of-memory errors are injected on one rank, once: a
``torch.OutOfMemoryError`` raised by a tripwire layer in its forward or its
backward, or by the loss just before its ``all_gather``. Each rank writes
what happened and its parameters (its shards, under FSDP2) to
``<out>/<scenario>/rank<r>.pt``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

from memguard import Guard

D, H, E = 16, 64, 8
STEPS, PER_RANK = 4, 16

#: name -> (engine, micro_batch, oom rank, oom step, where, sync_collectives)
SCENARIOS = {
    "fsdp-micro4": ("fsdp", 4, -1, -1, "", "auto"),
    "fsdp-oom-backward": ("fsdp", "auto", 1, 1, "backward", "always"),
    "fsdp-oom-forward": ("fsdp", "auto", 1, 2, "forward", "always"),
    "fsdp-oom-first-step": ("fsdp", "auto", 1, 0, "backward", "auto"),
    "ddp-gather-oom": ("ddp-gather", "auto", 0, 1, "gather", "always"),
    "ddp-gather-oom-auto": ("ddp-gather", "auto", 0, 0, "gather", "auto"),
    # last: memory calm, so not armed: rank 1 stops the job at once
    "fsdp-oom-calm": ("fsdp", "auto", 1, 2, "backward", "auto"),
}


class Trip:
    """Where and when the injected out-of-memory error fires (once)."""

    def __init__(self, rank: int, step: int, where: str) -> None:
        self.rank, self.step, self.where = rank, step, where
        self.now = -1          # the step running
        self.fired = False

    def due(self, where: str) -> bool:
        if self.fired or where != self.where or self.now != self.step or \
                dist.get_rank() != self.rank:
            return False
        self.fired = True
        return True


class _Backward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, trip):
        ctx.trip = trip
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.trip is not None and ctx.trip.due("backward"):
            raise torch.OutOfMemoryError("injected: out of memory in backward")
        return g, None


class Tripwire(torch.nn.Module):
    """Raises the injected error in its forward or in its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.trip: Trip | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.trip is not None and self.trip.due("forward"):
            raise torch.OutOfMemoryError("injected: out of memory in forward")
        return _Backward.apply(x, self.trip)


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(), Tripwire(),
                               torch.nn.Linear(H, H), torch.nn.GELU(), torch.nn.Linear(H, E))


def shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    world = dist.get_world_size()
    x = torch.randn(STEPS, world * PER_RANK, D, generator=g)
    y = torch.randn(STEPS, world * PER_RANK, E, generator=g)
    r = dist.get_rank()
    return x[:, r * PER_RANK:(r + 1) * PER_RANK], y[:, r * PER_RANK:(r + 1) * PER_RANK]


def gathered_loss(model, x, y, trip: Trip | None):
    """MoCo's pattern: the forward's output all-gathered from every rank
    (no gradient through the others' part), the loss over all of it."""
    out = model(x)
    if trip is not None and trip.due("gather"):
        raise torch.OutOfMemoryError("injected: out of memory before all_gather")
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, out.detach())
    parts[dist.get_rank()] = out
    everything = torch.cat(parts)
    return torch.nn.functional.mse_loss(out, y) + 0.1 * everything.pow(2).mean()


def build(engine: str) -> torch.nn.Module:
    model = make_model()
    if engine == "fsdp":
        return shard(model)
    return torch.nn.parallel.DistributedDataParallel(model)


def local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()


def run(name: str, out: str) -> bool:
    """One scenario; whether it ended without an error."""
    engine, micro, oom_rank, oom_step, where, sync = SCENARIOS[name]
    x, y = data()
    gather = engine == "ddp-gather"
    loss = (lambda m: lambda b: gathered_loss(m, b[0], b[1], None)) if gather else \
        (lambda m: lambda b: torch.nn.functional.mse_loss(m(b[0]), b[1]))

    ref = build(engine)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for s in range(STEPS):
        loss(ref)((x[s], y[s])).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    model = build(engine)
    trip = Trip(oom_rank, oom_step, where)
    for m in model.modules():
        if isinstance(m, Tripwire):
            m.trip = trip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(budget=None, micro_batch=micro, model=model, allocator=False,
                  sync_collectives=sync, forecast_horizon=None)
    step_loss = (lambda b: gathered_loss(model, b[0], b[1], trip)) if gather else loss(model)
    rec: dict = {"micro": [], "tried": [], "error": None, "armed": []}
    t0 = time.perf_counter()
    with guard:
        try:
            for s in range(STEPS):
                trip.now = s
                res = guard.step((x[s], y[s]), step_loss, opt)
                rec["micro"].append(res.micro_batch)
                rec["tried"].append(res.tried)
                rec["armed"].append(guard._peers.armed)
            if engine == "fsdp":            # an evaluation: every rank's forwards alike
                pred = guard.infer(x[0], model)
                rec["infer_equal"] = torch.equal(pred, model(x[0]).detach())
        except RuntimeError as exc:   # what a stranded rank raises (gloo's too), recorded
            rec["error"] = f"{type(exc).__name__}: {exc}"
    rec["seconds"] = time.perf_counter() - t0
    rank = int(os.environ["RANK"])
    rec["fired"] = trip.fired
    rec["state"] = {k: local(p) for k, p in model.state_dict().items()}
    rec["reference"] = {k: local(p) for k, p in ref.state_dict().items()}
    os.makedirs(os.path.join(out, name), exist_ok=True)
    torch.save(rec, os.path.join(out, name, f"rank{rank}.pt"))
    return rec["error"] is None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("scenarios", nargs="+")
    a = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    for name in a.scenarios:
        if not run(name, a.out):           # a stranded rank tore the group down
            return
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
