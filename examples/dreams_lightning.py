"""DreaMS-style masked-peak pretraining on PyTorch Lightning, kept inside a
memory budget by memguard.

Each sample is a synthetic mass spectrum: up to 64 peaks of (m/z,
intensity), padded. A share of the peaks is masked and a transformer over
the peaks predicts their m/z; the loss is a mean over masked peaks, so each
micro-batch's loss is weighted by its masked-peak count: the gradients are
those of the whole batch's mean over all of its masked peaks, whatever the
split.

The integration is two lines: the ``MemGuardModule`` mixin in front of
``LightningModule`` (``training_step`` stays as written for automatic
optimization; it returns the loss and its weight), and ``MemGuardCallback``
in the trainer's callbacks. As the DreaMS run does, it validates before
``fit`` and after each epoch; the validation steps, at a larger batch, run
on the guard's inference plan. Run::

    python examples/dreams_lightning.py                 # 1 process
    python examples/dreams_lightning.py --devices 2     # DDP on 2 CPU processes
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from memguard.lightning import MemGuardCallback, MemGuardModule

MAX_PEAKS = 64


class Spectra(Dataset):
    """Synthetic spectra: peaks of a few fragment series (m/z in 50-1000,
    intensities decaying along each series), so masked m/z values can be
    inferred from the unmasked ones."""

    def __init__(self, n: int, seed: int, mask_rate: float = 0.2) -> None:
        g = torch.Generator().manual_seed(seed)
        self.mz = torch.zeros(n, MAX_PEAKS)
        self.intensity = torch.zeros(n, MAX_PEAKS)
        self.valid = torch.zeros(n, MAX_PEAKS, dtype=torch.bool)
        for i in range(n):
            k = int(torch.randint(16, MAX_PEAKS + 1, (1,), generator=g))
            base = 50 + 300 * torch.rand(4, generator=g)
            step = 14.0 + 30 * torch.rand(4, generator=g)
            idx = torch.arange(k) % 4
            rank = torch.arange(k) // 4
            self.mz[i, :k] = (base[idx] + step[idx] * rank).clamp(max=1000)
            self.intensity[i, :k] = torch.exp(-0.2 * rank) * torch.rand(k, generator=g)
            self.valid[i, :k] = True
        self.masked = (torch.rand(n, MAX_PEAKS, generator=g) < mask_rate) & self.valid
        self.masked[:, 0] = True    # at least one masked peak per spectrum

    def __len__(self) -> int:
        return len(self.mz)

    def __getitem__(self, i: int) -> dict:
        return {"mz": self.mz[i], "intensity": self.intensity[i], "valid": self.valid[i],
                "masked": self.masked[i]}


class FourierMz(nn.Module):
    """m/z as sines and cosines over wavelengths from 0.1 to 1000."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        freqs = torch.exp(torch.linspace(math.log(2 * math.pi / 1000), math.log(2 * math.pi / 0.1),
                                         dim // 2))
        self.register_buffer("freqs", freqs, persistent=False)

    def forward(self, mz: torch.Tensor) -> torch.Tensor:
        a = mz[..., None] * self.freqs
        return torch.cat([a.sin(), a.cos()], -1)


class PeakTransformer(MemGuardModule, L.LightningModule):
    def __init__(self, dim: int = 96, depth: int = 3, heads: int = 4, lr: float = 3e-4,
                 total_steps: int = 100) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.mz_embed = FourierMz(dim)
        self.proj = nn.Linear(dim + 1, dim)
        self.mask_token = nn.Parameter(torch.zeros(dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 1)

    def forward(self, batch: dict) -> torch.Tensor:
        x = self.proj(torch.cat([self.mz_embed(batch["mz"]), batch["intensity"][..., None]], -1))
        x = torch.where(batch["masked"][..., None], self.mask_token.to(x.dtype), x)
        x = self.encoder(x, src_key_padding_mask=~batch["valid"])
        return self.head(x).squeeze(-1) * 1000.0     # predicted m/z

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        pred = self(batch).float()
        m = batch["masked"]
        err = (pred - batch["mz"]).abs() / 1000.0
        n_masked = m.sum()
        loss = (err * m).sum() / n_masked
        self.log("train_loss", loss, prog_bar=True)
        # the mean over masked peaks, weighted by their count; aux: per-spectrum counts
        return {"loss": loss, "weight": n_masked, "aux": m.sum(1)}

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        # guarded too: split where memory is short, logged as the unsplit
        # step logs it (batch_size: the masked peaks the mean is over)
        pred = self(batch).float()
        m = batch["masked"]
        err = ((pred - batch["mz"]).abs() / 1000.0 * m).sum() / m.sum()
        self.log("val_loss", err, batch_size=int(m.sum()), sync_dist=True)

    def memguard_post_step(self, aux: torch.Tensor) -> None:
        self.samples_per_step.append(int(aux.numel()))
        self.masked_per_step.append(int(aux.sum()))

    def on_train_start(self) -> None:
        self.samples_per_step: list[int] = []
        self.masked_per_step: list[int] = []

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, self.hparams.lr,
                                                    total_steps=self.hparams.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Record(L.Callback):
    """The micro-batch each step ran at."""

    def __init__(self, guard_cb: MemGuardCallback) -> None:
        self.guard_cb = guard_cb
        self.micro: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.micro.append(self.guard_cb.guard.last.micro_batch)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run (tests)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--budget", default="auto",
                    help='memory budget of the process: "auto" (what it can have now), a '
                         'size, or a share of memory (=auto)')
    ap.add_argument("--tensor-budget", default="64MiB",
                    help="what memguard's allocator may hold for tensors (=64MiB: less than "
                         "a full batch needs)")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--precision", default="32", choices=["32", "bf16-mixed"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--summary-json", default=None)
    a = ap.parse_args(argv)
    steps = a.steps or (8 if a.quick else 60)
    torch.set_num_threads(max(1, 2 // a.devices))
    L.seed_everything(a.seed, verbose=False)

    data = Spectra(steps * a.batch * a.devices, a.seed)
    loader = DataLoader(data, batch_size=a.batch, shuffle=True, drop_last=True)
    val = DataLoader(Spectra(4 * a.batch * a.devices, a.seed + 1), batch_size=2 * a.batch)
    model = PeakTransformer(total_steps=steps)
    # The process's budget is live; the tensors get what memguard's
    # allocator may hold, --tensor-budget, within it (at this toy scale the
    # interpreter and torch are most of the process).
    guard_cb = MemGuardCallback(budget=a.budget, tensor_budget=a.tensor_budget, min_micro_batch=4)
    record = Record(guard_cb)
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=a.devices,
        strategy="ddp" if a.devices > 1 else "auto", precision=a.precision,
        callbacks=[guard_cb, record], logger=L.loggers.CSVLogger("out", name="dreams"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=1)
    t0 = time.perf_counter()
    val_before = trainer.validate(model, val, verbose=False)[0]["val_loss"]
    trainer.fit(model, loader, val)
    wall = time.perf_counter() - t0

    g = guard_cb.guard
    summary = {
        "steps": steps,
        "steps_done": trainer.global_step,
        "effective_batches": model.samples_per_step,
        "masked_peaks": model.masked_per_step,
        "micro_batches": record.micro,
        "micro_batch_changes": g.micro_batch_changes,
        "ooms_recovered": g.ooms_recovered,
        "peak_bytes": g.peak_bytes,
        "peak_source": g.peak_source,
        "budget_bytes": g.budget_bytes,
        "throttled": g.micro_batch_changes > 0 or g.ooms_recovered > 0,
        "wall_s": wall,
        "world_size": trainer.world_size,
        "rank": trainer.global_rank,
        "precision": a.precision,
        "final_loss": float(trainer.callback_metrics.get("train_loss", float("nan"))),
        "val_loss_before": val_before,
        "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
        "val_micro_batch": g.inference.micro,
        # the same on every rank when DDP keeps the replicas in step
        "param_checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
    }
    print(f"[rank {trainer.global_rank}] steps {summary['steps_done']}/{steps}, micro-batch "
          f"{record.micro[0] if record.micro else '-'} -> {g.micro_batch} "
          f"({g.micro_batch_changes} changes), OOMs recovered {g.ooms_recovered}, peak "
          f"{g.peak_bytes / 2**20:.1f} MiB of a {g.budget_bytes / 2**20:.0f} MiB budget "
          f"({g.peak_source}), validation {val_before:.3f} -> {summary['val_loss']:.3f} at "
          f"micro-batch {g.inference.micro}, {wall:.1f} s")
    if a.summary_json:
        path = a.summary_json if trainer.global_rank == 0 else \
            f"{a.summary_json}.rank{trainer.global_rank}"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(summary, f)
    return summary


if __name__ == "__main__":
    main()
