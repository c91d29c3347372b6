"""The Lightning mixin under DDP without memory pressure: what it costs.

Two ranks (Lightning's ``strategy="ddp"``, gloo, CPU, one thread each)
train ``BLOCKS`` MLP blocks (``WIDTH`` -> 4x -> ``WIDTH``) with AdamW on
``BATCH`` samples per rank. Plain: the LightningModule as written for
automatic optimization. Guarded: the same class with ``MemGuardModule`` in
front and a ``MemGuardCallback`` with its defaults (``budget="auto"``: on
this machine's memory, no pressure), so every batch runs through
``Guard.step`` whole; and the same with ``ddp_overlap=True`` (DDP's own
backward synchronises the last micro-batch, overlapping its all-reduces
with the backward, as the plain run's does). All in one launch, the runs
interleaved: each round fits every configuration for ``STEPS`` steps, in
an order that turns round by round, so the machine's drift falls on all
alike. A step's time runs from one batch's end to the next's (the loop's
hooks, logging and data included), the first ``WARMUP`` of each fit left
out; each fit's figure is its median step. Figures: the median steps, and
each guarded configuration's ratio to the plain run of its round, the
median over the rounds. Target: at most 1.03.

    pytest benchmarks/bench_lightning_ddp.py --benchmark-only -s
    python benchmarks/bench_lightning_ddp.py [pytest options]   (the same)
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import pytest

from benchlib import ROOT, Figures, fmt, verdict

SECTION = "lightning_ddp"
TITLE = "Lightning DDP: MemGuardModule + MemGuardCallback without pressure (2 ranks, gloo, CPU)"
TARGET = 1.03
#: (blocks, width, batch per rank, steps a fit, warm-up steps, rounds): the
#: full run and --bench-quick
FULL = (4, 512, 64, 10, 2, 16)
QUICK = (1, 64, 8, 3, 1, 1)
#: the configurations: name -> the MemGuardCallback's options (None: plain)
MODES = {"plain": None, "guarded": {}, "overlap": {"ddp_overlap": True}}


def _classes(blocks: int, width: int):
    """The plain LightningModule, the guarded one (the mixin in front), and
    a callback taking the time at each batch's end."""
    import lightning.pytorch as L
    import torch

    from memguard.lightning import MemGuardModule

    class Plain(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(*[
                torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                    torch.nn.Linear(4 * width, width)) for _ in range(blocks)])

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Guarded(MemGuardModule, Plain):
        pass

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *args) -> None:
            self.ends.append(time.perf_counter())

    return Plain, Guarded, Clock


def _fit(mode: str, cfg: tuple, data) -> list[float]:
    """One fit of ``mode``: its step times after the warm-up."""
    import lightning.pytorch as L

    from memguard.lightning import MemGuardCallback
    blocks, width, _, steps, warmup, _ = cfg
    plain, guarded, clock_class = _classes(blocks, width)
    clock = clock_class()
    callbacks = [clock]
    if MODES[mode] is not None:
        callbacks.insert(0, MemGuardCallback(**MODES[mode]))
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=steps,
                        callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(plain() if mode == "plain" else guarded(), data)
    return [b - a for a, b in zip(clock.ends[warmup:], clock.ends[warmup + 1:])]


def worker(out: str, quick: bool) -> None:
    """Both ranks (Lightning runs this file again as rank 1): the rounds of
    fits; rank 0 writes the step times."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    cfg = QUICK if quick else FULL
    _, width, batch, steps, _, rounds = cfg
    g = torch.Generator().manual_seed(1)
    n = batch * steps
    data = DataLoader(TensorDataset(torch.randn(n, width, generator=g),
                                    torch.randn(n, width, generator=g)), batch_size=batch)
    names = list(MODES)
    times: dict[str, list[list[float]]] = {m: [] for m in names}
    for r in range(rounds):
        for mode in names[r % len(names):] + names[:r % len(names)]:
            times[mode].append(_fit(mode, cfg, data))
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "config": cfg}, f)


def launch(quick: bool) -> dict:
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"),
                       f"memguard-bench-lightning-ddp-{os.getpid()}.json")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), ROOT]))
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    args = [sys.executable, __file__, "--worker", out] + (["--quick"] if quick else [])
    subprocess.run(args, env=env, check=True, timeout=1800, stdout=subprocess.DEVNULL,
                   cwd=os.environ.get("TMPDIR", "/tmp"))
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res


def test_lightning_ddp_calm(benchmark, figures: Figures, quick: bool) -> None:
    pytest.importorskip("lightning")
    figures.section(SECTION, TITLE, summarize)
    res: dict = {}
    benchmark.group = "lightning ddp: calm steps"
    benchmark.pedantic(lambda: res.update(launch(quick)), rounds=1, iterations=1)
    figures.record(SECTION, benchmark.fullname, res)


def summarize(records: list[dict]) -> tuple[list[str], dict, dict]:
    """Each guarded configuration against the plain run, round by round."""
    lines: list[str] = []
    data: dict = {}
    per_test: dict = {}
    for r in records:
        blocks, width, batch, steps, warmup, rounds = r["config"]
        med = {m: [statistics.median(f) for f in fits] for m, fits in r["times"].items()}
        lines.append(f"{blocks} MLP blocks {width}-{4 * width}-{width}, batch {batch} per rank, "
                     f"AdamW; {rounds} rounds of one {steps}-step fit each, interleaved "
                     f"(the first {warmup} steps of a fit left out)")
        data = {"median_step_s": {m: statistics.median(v) for m, v in med.items()},
                "paired_ratios": {}, "ratio": {}, "verdict": {}}
        for m in MODES:
            if m == "plain":
                continue
            pairs = [a / b for a, b in zip(med[m], med["plain"])]
            ratio = statistics.median(pairs)
            data["paired_ratios"][m], data["ratio"][m] = pairs, ratio
            data["verdict"][m] = verdict(ratio, TARGET)
            what = ("defaults: gradients all-reduced after the backward"
                    if m == "guarded" else "ddp_overlap=True: DDP's backward syncs")
            lines.append(f"{m} ({what}): {data['median_step_s'][m] * 1e3:.1f} ms/step against "
                         f"plain {data['median_step_s']['plain'] * 1e3:.1f} ms: median "
                         f"{fmt(ratio, '.3f')}x (target <= {TARGET})  {data['verdict'][m]}")
            lines.append("   rounds " + ", ".join(f"{x:.3f}" for x in pairs))
        per_test[r["nodeid"]] = {f"{m}_over_plain": v for m, v in data["ratio"].items()}
    return lines, data, per_test


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2], "--quick" in sys.argv[3:])
    else:
        raise SystemExit(pytest.main([__file__, "--benchmark-only", *sys.argv[1:]]))
