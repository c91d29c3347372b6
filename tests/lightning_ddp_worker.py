"""Lightning runs on two CPU processes (gloo) for tests/test_lightning_ddp.py.

Started as a script: under ``strategy="ddp"`` Lightning starts rank 1 by
running this file again, and under ``"ddp_spawn"`` it spawns both ranks
from it, so the module must stand alone (no ``tests.`` imports).

Each run fits a small MLP over the tokens of each sample, written for
automatic optimization with :class:`MemGuardModule` in front and a
:class:`MemGuardCallback` in the trainer, on each rank's half of every
global batch, and validates it at the epoch's end. Training and validation
log with ``sync_dist=True`` at every call (a collective per call on each
rank: a split step that logged once per micro-batch would leave the ranks
in different collectives).

Out-of-memory errors are real, on rank 1: memguard's arena serves the
tensors, and in one training step and one validation batch the first
forward at the full size (a forward pre-hook on the first layer) lowers
the arena's budget to what the arena holds plus less room than the full
size needs (refused in the step's backward or forward: see :data:`RUNS`):
the budget falls inside the step, where no planner can see it coming. The first forward at a
smaller size, the redo's, lifts it again. Each rank writes what happened
(sizes, retries, arena refusals, calls of ``self.log`` that reached
Lightning, the validation loss Lightning reduced over the ranks) and its
final parameters to ``<out>/<run>/rank<r>.pt``; rank 0 adds the
reference: the same training, unsplit, in one process on the whole global
batches.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import memguard
from memguard.lightning import MemGuardCallback, MemGuardModule
from memguard.memory import arena

D, E, T, H = 8, 4, 64, 256     # features, outputs, tokens per sample, hidden width
BATCH, STEPS, VAL_BATCHES = 16, 4, 2   # per rank
WORLD = 2
SMALL = 64 << 10      # room for the small blocks a step also takes (RNG state, scalars)
ACTIVATION = BATCH * T * H * 4   # bytes of one hidden activation of a full batch

#: the runs: name -> (strategy, ddp_overlap, where rank 1's training step
#: runs out of memory: in its backward, with room for half a step; in its
#: forward, with room for one and a half of the two activations it holds,
#: before DDP's synchronising backward under ddp_overlap)
RUNS = {"ddp_spawn": ("ddp_spawn", False, "backward"),
        "ddp": ("ddp", False, "backward"),
        "ddp-overlap": ("ddp", True, "forward")}


def data(n_batches: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n_batches`` global batches (both ranks' halves), in order."""
    g = torch.Generator().manual_seed(seed)
    n = n_batches * BATCH * WORLD
    return torch.randn(n, T, D, generator=g), torch.randn(n, E, generator=g)


def half(xs: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s half of every global batch, in order."""
    per = xs.reshape(-1, WORLD, BATCH, *xs.shape[1:])[:, rank]
    return per.reshape(-1, *xs.shape[1:])


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(), torch.nn.Linear(H, E))


def loss_of(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(net(x).mean(1), y)


class Net(MemGuardModule, L.LightningModule):
    """The model, as written for automatic optimization; the arena's
    budget falls on rank 1 at ``oom_step`` and at validation batch
    ``val_oom_batch`` (see the module docs)."""

    def __init__(self, oom_step: int, oom_in: str, val_oom_batch: int) -> None:
        super().__init__()
        self.net = make_net()
        self.oom_step, self.oom_in, self.val_oom_batch = oom_step, oom_in, val_oom_batch
        self.low: int | None = None      # the budget's room at the next full-size forward
        self.full = 0                    # what a full training step adds to the arena
        self.lowered = False
        self.logged: collections.Counter = collections.Counter()
        self.val_sizes: list[int] = []
        self.net[0].register_forward_pre_hook(self._squeeze)

    def _squeeze(self, module, inputs) -> None:
        if self.lowered and inputs[0].shape[0] < BATCH:   # the redo, smaller: room again
            arena.set_budget(None)
            self.lowered = False
        if self.low is not None and inputs[0].shape[0] == BATCH:
            arena.trim()      # cached large blocks go back; small ones stay in their slabs
            arena.set_budget(memguard.stats()["reserved_bytes.current"] + self.low + SMALL)
            self.low, self.lowered = None, True

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if batch_idx == 0:
            arena.reset_peaks()
            self.base = memguard.stats()["allocated_bytes.current"]
        if self.global_rank == 1 and batch_idx == self.oom_step:
            self.low = self.full * 3 // 4 if self.oom_in == "backward" else 3 * ACTIVATION // 2

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.full = memguard.stats()["allocated_bytes.peak"] - self.base
        arena.set_budget(None)

    def on_validation_batch_start(self, batch, batch_idx, dataloader_idx=0) -> None:
        if self.global_rank == 1 and batch_idx == self.val_oom_batch:
            self.low = 3 * ACTIVATION // 2    # a full forward holds two at once

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        arena.set_budget(None)

    def log(self, name, *args, **kwargs) -> None:   # counts what reaches Lightning
        self.logged[name] += 1
        super().log(name, *args, **kwargs)

    def training_step(self, batch, batch_idx):
        loss = loss_of(self.net, *batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.val_sizes.append(batch[0].shape[0])
        loss = loss_of(self.net, *batch)
        self.log("val_loss", loss, on_step=True, on_epoch=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Record(L.Callback):
    """What each rank saw, written when the fit ends."""

    def __init__(self, guard_cb: MemGuardCallback, out: str) -> None:
        self.guard_cb, self.out = guard_cb, out
        self.steps: list[tuple[int, int, list[int]]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.refusals = arena.stats()["num_ooms"] if arena.installed() else 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        last = self.guard_cb.guard.last
        self.steps.append((last.micro_batch, last.retries, list(last.tried)))

    def on_fit_end(self, trainer, pl_module) -> None:
        g = self.guard_cb.guard
        record = {
            "rank": trainer.global_rank, "world": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "start_method": getattr(trainer.strategy, "_start_method", None),
            "overlap": g.config.ddp_overlap,
            "steps": self.steps, "global_step": trainer.global_step,
            "ooms_recovered": g.ooms_recovered, "arena": arena.installed(),
            "refusals": (arena.stats()["num_ooms"] if arena.installed() else 0) - self.refusals,
            "peers": g._peers is not None,
            "logged": dict(pl_module.logged), "val_sizes": pl_module.val_sizes,
            "val_loss": float(trainer.callback_metrics["val_loss_epoch"]),
            "state": {k: v.detach().clone() for k, v in pl_module.net.state_dict().items()},
        }
        if trainer.global_rank == 0:
            record["reference"] = reference()
        os.makedirs(self.out, exist_ok=True)
        torch.save(record, os.path.join(self.out, f"rank{trainer.global_rank}.pt"))


def reference() -> dict:
    """The same training unsplit in one process, on the whole global
    batches; its parameters and its validation loss over both ranks' data."""
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    xs, ys = data(STEPS, 1)
    for s in range(STEPS):
        b = slice(s * BATCH * WORLD, (s + 1) * BATCH * WORLD)
        opt.zero_grad()
        loss_of(net, xs[b], ys[b]).backward()
        opt.step()
    with torch.no_grad():
        val = float(loss_of(net, *data(VAL_BATCHES, 2)))
    return {"state": {k: v.detach().clone() for k, v in net.state_dict().items()},
            "val_loss": val}


def loaders(rank: int) -> tuple[DataLoader, DataLoader]:
    train, val = data(STEPS, 1), data(VAL_BATCHES, 2)
    return (DataLoader(TensorDataset(*(half(t, rank) for t in train)), batch_size=BATCH),
            DataLoader(TensorDataset(*(half(t, rank) for t in val)), batch_size=BATCH))


class Loaders(L.LightningDataModule):
    """Each rank's half of every batch (the rank is known once the
    processes run: under ddp_spawn, not before ``fit``)."""

    def train_dataloader(self) -> DataLoader:
        return loaders(self.trainer.global_rank)[0]

    def val_dataloader(self) -> DataLoader:
        return loaders(self.trainer.global_rank)[1]


def run(name: str, out: str) -> None:
    strategy, overlap, oom_in = RUNS[name]
    guard_cb = MemGuardCallback(budget=None, gc_interval_s=0, ddp_overlap=overlap)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_epochs=1,
        num_sanity_val_steps=0, callbacks=[guard_cb, Record(guard_cb, out)], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, log_every_n_steps=1)
    trainer.fit(Net(oom_step=1, oom_in=oom_in, val_oom_batch=0), datamodule=Loaders())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    a = ap.parse_args()
    torch.set_num_threads(1)
    # The spawned runs first: rank 1 of the "ddp" runs runs this file again,
    # and joins those only (the spawned ones are done by then, and spawn
    # their ranks themselves)
    rank1 = "LOCAL_RANK" in os.environ
    for name in sorted(a.runs, key=lambda n: RUNS[n][0] == "ddp"):
        if not rank1 or RUNS[name][0] == "ddp":
            run(name, os.path.join(a.out, name))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
