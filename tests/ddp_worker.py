"""One rank of the DDP tests (tests/test_ddp.py), started by ``torchrun``.

Each rank trains a small student MLP over the tokens of each sample (with a registered buffer, so DDP's
buffer broadcasts run too) under ``DistributedDataParallel`` on gloo, on its
half of every global batch, through ``Guard.step``. Optionally a frozen,
wide teacher runs without gradients in the loss (MoCo's key encoder,
DINO's teacher): its temporaries make the forward pass the step's peak.

Out-of-memory errors are real: the rank that should run out installs
memguard's allocator, measures its own step's peak at the full and at half
the size, and at the chosen steps lowers the arena's budget between the
two; or (``--oom-in-backward``) lowers it inside a backward pass to what
the arena holds, so that the backward's next large allocation is refused.
Each rank writes what happened, the arena's refusals among it, and its
final parameters to ``<out>/rank<r>.pt``; the rank that ran out then
uninstalls the allocator, so that the next run of a launch of several
(``--scenarios``) starts without it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import memguard
from memguard import Guard, GuardOOMError
from memguard.memory import arena as allocator
from memguard.train.step import SkipStep

D, E, T, H = 16, 8, 192, 512   # features, outputs, tokens per sample, hidden width
SMALL = 64 << 10      # room for the small blocks a step also takes (RNG state, scalars)


def make_models(teacher: bool, h: int) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    torch.manual_seed(0)
    student = torch.nn.Sequential(torch.nn.Linear(D, h), torch.nn.GELU(),
                                  torch.nn.Linear(h, E))
    student.register_buffer("scale", torch.ones(E))
    t = None
    if teacher:
        t = torch.nn.Sequential(torch.nn.Linear(D, 8 * h), torch.nn.GELU(),
                                torch.nn.Linear(8 * h, E))
        t.requires_grad_(False)
    return student, t


def make_data(steps: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` global batches of ``batch`` samples (every rank's share)."""
    g = torch.Generator().manual_seed(1)
    return (torch.randn(steps, batch, T, D, generator=g),
            torch.randn(steps, batch, E, generator=g))


def loss_of(model: torch.nn.Module, teacher: torch.nn.Module | None,
            x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x).mean(1)
    if teacher is not None:
        with torch.no_grad():
            y = y + teacher(x).mean(1)
    return torch.nn.functional.mse_loss(out, y)


def masked_loss_of(model: torch.nn.Module, x: torch.Tensor,
                   y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A caller-weighted loss: the mean over the samples whose first target
    is positive (a masked-token count's kind), and that count as weight."""
    per_sample = (model(x).mean(1) - y).pow(2).mean(1)
    mask = (y[:, 0] > 0).to(per_sample.dtype)
    count = mask.sum()
    return (per_sample * mask).sum() / count.clamp(min=1), count


def reference(steps: int, world_batch: int, teacher: bool, h: int,
              caller_weights: bool = False, world: int = 2) -> dict[str, torch.Tensor]:
    """Single-process training at the same effective batch; with caller
    weights, each rank's weighted mean averaged over the ranks (DDP's way)."""
    model, t = make_models(teacher, h)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = make_data(steps, world_batch)
    for s in range(steps):
        opt.zero_grad()
        if caller_weights:
            per = world_batch // world
            sum(masked_loss_of(model, xs[s, r * per:(r + 1) * per],
                               ys[s, r * per:(r + 1) * per])[0]
                for r in range(world)).div(world).backward()
        else:
            loss_of(model, t, xs[s], ys[s]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def peak_of(model: torch.nn.Module, teacher: torch.nn.Module | None,
            x: torch.Tensor, y: torch.Tensor) -> int:
    """What one forward and backward adds to the arena at its peak (DDP's
    hooks stay idle: this runs on the bare module)."""
    allocator.reset_peaks()
    base = memguard.stats()["allocated_bytes.current"]
    loss_of(model, teacher, x, y).backward()
    model.zero_grad(set_to_none=True)
    return memguard.stats()["allocated_bytes.peak"] - base


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenarios", default=None,
                    help="a JSON list of argument lists, each run in turn in this one "
                         "process group (each with its own --out); the others are ignored")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16, help="per rank")
    ap.add_argument("--micro-batch", default="auto")
    ap.add_argument("--teacher", action="store_true")
    ap.add_argument("--hidden", type=int, default=H)
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--oom-rank", type=int, default=-1)
    ap.add_argument("--oom-at", type=int, nargs="*", default=[],
                    help="steps before which the OOM rank's budget is lowered")
    ap.add_argument("--tiny-budget", action="store_true",
                    help="the OOM rank cannot fit even one sample")
    ap.add_argument("--caller-weights", action="store_true",
                    help="a masked loss weighted by its count (no teacher)")
    ap.add_argument("--weightless-rank", type=int, default=-1,
                    help="with --caller-weights: this rank's weights are 0 at --weightless-at")
    ap.add_argument("--weightless-at", type=int, default=-1)
    ap.add_argument("--skip-rank", type=int, default=-1,
                    help="this rank's loss_fn skips the batch (SkipStep) after its forward ...")
    ap.add_argument("--skip-at", type=int, default=-1, help="... at this step, in its last "
                    "micro-batch")
    ap.add_argument("--oom-in-backward", type=int, default=-1,
                    help="the OOM rank runs out of memory inside the backward of this step's "
                         "last micro-batch (its first attempt): DDP's reducer is mid-way")
    return ap.parse_args(argv)


def main() -> None:
    a = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    if a.scenarios is None:
        run(a)
    else:
        with open(a.scenarios) as f:
            for argv in json.load(f):
                run(parse(argv))
                dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's finalisation: gloo's worker threads can
    # still be torn down then and abort the process ("terminate called
    # without an active exception", seen once in a few hundred runs), after
    # the record was written and the group destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(a: argparse.Namespace) -> None:
    """One scenario on this rank: train, then write its record."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, teacher = make_models(a.teacher, a.hidden)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    xs, ys = make_data(a.steps, a.batch * world)
    mine = slice(rank * a.batch, (rank + 1) * a.batch)

    oom_here = rank == a.oom_rank
    extra = 0
    if oom_here:
        memguard.install()
        x, y = xs[0, mine], ys[0, mine]
        full = peak_of(model, teacher, x, y)
        half = peak_of(model, teacher, x[:a.batch // 2], y[:a.batch // 2])
        extra = (full + half) // 2   # room for a half-size step, not a full one

    # an out-of-memory error inside backward: once the gradient of the
    # hidden activations is made (the output layer's gradients are done),
    # the budget falls to what the arena holds allocated, and the backward's
    # next large allocation (GELU's gradient, [micro, T, hidden]) is refused
    backward_oom = {"armed": 0, "low": False}   # backward passes to let through, + 1

    def lower_in_backward(grad):
        if backward_oom["armed"]:
            backward_oom["armed"] -= 1
            if not backward_oom["armed"]:
                allocator.set_budget(memguard.stats()["allocated_bytes.current"])
                backward_oom["low"] = True
        return grad

    def watch_hidden(module, inputs, out):
        if out.requires_grad:
            out.register_hook(lower_in_backward)

    if oom_here and a.oom_in_backward >= 0:
        model[1].register_forward_hook(watch_hidden)
    ooms_before = allocator.stats()["num_ooms"]

    micro = a.micro_batch if a.micro_batch == "auto" else int(a.micro_batch)
    guard = Guard(budget=None, micro_batch=micro, model=ddp, ddp_overlap=a.overlap,
                  allocator=oom_here, gc_interval_s=0)
    record: dict = {"micro": [], "retries": [], "tried": [], "loss": [], "reasons": []}
    with guard:
        for s in range(a.steps):
            low = None
            if oom_here:
                allocator.set_budget(None)
                if s in a.oom_at:
                    # cached large blocks go back; small ones stay reserved
                    # in their slabs, for the step to reuse
                    allocator.trim()
                    low = 4096 if a.tiny_budget else \
                        memguard.stats()["reserved_bytes.current"] + extra + SMALL
            weightless = rank == a.weightless_rank and s == a.weightless_at
            skip = [rank == a.skip_rank and s == a.skip_at,
                    max(1, a.batch // int(micro)) if micro != "auto" else 1]
            lowered = [low is None]
            if oom_here and s == a.oom_in_backward:   # the last micro-batch's backward
                backward_oom["armed"] = max(1, a.batch // int(micro)) if micro != "auto" else 1

            def loss_fn(b, weightless=weightless, low=low, lowered=lowered, skip=skip):
                if backward_oom["low"]:      # the redo after the refusal: room again
                    allocator.set_budget(None)
                    backward_oom["low"] = False
                if skip[0]:
                    skip[1] -= 1
                    if not skip[1]:          # as a training_step that looked at its loss
                        loss_of(ddp, teacher, *b)
                        raise SkipStep("this rank skips the batch")
                if not lowered[0]:
                    # the budget falls inside the step, where no planner can
                    # see it coming: the step runs out of memory
                    allocator.set_budget(low)
                    lowered[0] = True
                if not a.caller_weights:
                    return loss_of(ddp, teacher, *b)
                loss, count = masked_loss_of(ddp, *b)
                return (loss, count * 0) if weightless else (loss, count)

            try:
                res = guard.step((xs[s, mine], ys[s, mine]), loss_fn, opt)
            except GuardOOMError as exc:
                record["gave_up"] = exc.tried
                break
            except SkipStep as exc:       # skipped on every rank alike
                record.setdefault("skipped", []).append((s, str(exc)))
                continue
            except ValueError as exc:     # a step no rank could do: every rank says so
                record.setdefault("errors", []).append((s, str(exc)))
                continue
            record["micro"].append(res.micro_batch)
            record["retries"].append(res.retries)
            record["tried"].append(res.tried)
            record["loss"].append(res.loss)
            record["reasons"].append(guard.plan()["reason"])
    if oom_here:
        allocator.set_budget(None)
    record["ooms_recovered"] = guard.ooms_recovered
    record["arena_refusals"] = allocator.stats()["num_ooms"] - ooms_before
    record["last_refused_bytes"] = allocator.stats()["last_oom_bytes"]
    record["collectives"] = guard._peers.collectives if guard._peers else 0
    record["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        record["reference"] = reference(a.steps, a.batch * world, a.teacher, a.hidden,
                                        a.caller_weights, world)
    torch.save(record, os.path.join(a.out, f"rank{rank}.pt"))
    if oom_here:
        memguard.uninstall()      # the next run of the launch starts without the allocator


if __name__ == "__main__":
    main()
