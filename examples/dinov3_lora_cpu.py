"""LoRA fine-tuning of a frozen ViT backbone on a laptop CPU: a training
epoch, then a validation loop on a machine that other programs have filled.

The run this reproduces in miniature: DINOv3 ViT-S/16 with LoRA adapters
and a regression head, fine-tuned on a laptop's CPU with 4 DataLoader
workers of about 200 MB each. The epoch took 14 hours, 13 of them in its
validation loop (488 batches), swapping. Its predictions were plain values
(``np.array(all_predictions)``), not tensors kept with their graphs: what
swapped was each validation batch's activations, a batch sized for the
memory there was when the run started, in a machine other programs had
filled since.

Here the same epoch runs inside a memguard budget:

- the data come through DataLoader workers (``--workers``), each holding
  its share of the dataset: the samples it has made, kept (as an image
  dataset's workers keep what they decoded);
- training goes through ``guard.step``: the batch is split into
  micro-batches when it does not fit, with the gradients of the whole batch
  in one optimizer step, so the effective batch stays the script's;
- while the validation loop runs, another program (a separate process, the
  "hog") takes memory in steps, up to ``--hog-mib``;
- validation runs under ``guard.evaluate()`` and ``guard.infer``: no graph,
  and at every micro-batch boundary inference's own plan looks at the room
  the process has now: once the hog has taken it, the micro-batch shrinks
  before anything swaps or runs out of memory. Predictions are gathered as
  numpy values, as the original loop did.

The machine: by default the budget is what the process and its workers
hold once training starts plus ``--room`` (a machine with that much left),
and the hog, a child of the script, counts against it as memguard counts
what a process's children hold: it runs the same way on any machine, in
seconds, and takes little memory. The real pressure: run the script in a
memory cgroup with the live budget (``--budget auto``), a hog that takes
most of the limit, and the full-size model's memory at stake, e.g.

    systemd-run --scope -p MemoryMax=1G -p MemorySwapMax=1G \
        python examples/dinov3_lora_cpu.py --budget auto --tensor-budget none \
        --hog-mib 500 --val-batch 512

(memguard then reads the room from the cgroup: its limit less what the
others in it, the hog and the workers, use). In a 1 GiB cgroup with swap,
the first validation batch of 512 ran whole (a 300 MiB peak), the next ones
at micro-batches of 14 to 10 once the hog had taken its memory.

The backbone is a small ViT built here (DINOv3's module names: ``qkv`` and
``proj`` in attention, ``fc1``/``fc2`` in the MLP), frozen; LoRA comes from
peft. Data are synthetic: images whose target is a fixed function of them.

    python examples/dinov3_lora_cpu.py [--quick] [--workers N] [--hog-mib M] [--room R]
"""
from __future__ import annotations

import argparse
import itertools
import json
import resource
import subprocess
import sys
import time

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils.data import DataLoader, Dataset

import memguard

IMG, PATCH, DIM, DEPTH, HEADS = 32, 4, 128, 4, 4
BATCH = 32            # the training batch: gradients of 32 samples per optimizer step
VAL_BATCH = 128       # the validation loader's batch, larger than training's (no graph)
# peft matches a string of target modules against whole module names: the
# attention and MLP linears of the blocks, not the patch embedding (also
# called `proj`, as in timm and DINOv3)
LORA_TARGETS = r"blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(fc1|fc2))"


class Attention(nn.Module):
    """Multi-head self-attention with DINOv3's layer names."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # the explicit softmax keeps its (b, heads, n, n) scores for backward,
        # as an eager ViT's attention does: memory that grows with the batch
        attn = (q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, PATCH, stride=PATCH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class ViTRegressor(nn.Module):
    """A small ViT (class token, learned positions) and a regression head
    on the class token."""

    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(DIM)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, DIM))
        self.pos_embed = nn.Parameter(torch.randn(1, (IMG // PATCH) ** 2 + 1, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x)[:, 0]).squeeze(-1)


# -- data --------------------------------------------------------------------
def make_sample(i: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``i``: an image and a regression target that depends on it (the
    contrast between its left and right halves, plus a little noise); the
    same in every process."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    x = torch.randn(3, IMG, IMG, generator=g)
    x[:, :, : IMG // 2] += torch.rand(1, generator=g) * 2
    y = x[..., : IMG // 2].mean() - x[..., IMG // 2:].mean()
    return x, y + 0.05 * torch.randn((), generator=g)


class Images(Dataset):
    """``n`` synthetic samples; a process keeps each sample it has made (a
    DataLoader worker ends up holding its share of the set, as an image
    dataset's workers hold what they decoded)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i not in self.kept:
            self.kept[i] = make_sample(i, self.seed)
        return self.kept[i]


def loader(data: Images, batch: int, workers: int, shuffle: bool) -> DataLoader:
    return DataLoader(data, batch_size=batch, shuffle=shuffle, num_workers=workers,
                      generator=torch.Generator().manual_seed(data.seed),
                      multiprocessing_context="fork" if workers else None)


# -- the other program ---------------------------------------------------------
HOG = """
import sys
held = []
for line in sys.stdin:
    held.append(bytearray(int(line)))      # zero-filled: every page touched
    print(sum(map(len, held)), flush=True)
"""


class Hog:
    """Another program that takes memory when told to: a separate process
    holding ``take(n)`` more bytes each time, touched, until it is closed."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.held = 0

    def take(self, n: int) -> None:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        self.held = int(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def footprint() -> int:
    """What this process and its children hold now, as memguard counts it."""
    return memguard.sample().footprint_bytes or 0


# -- validation ----------------------------------------------------------------
def validate(guard: memguard.Guard, model: nn.Module, val: DataLoader, hog_bytes: int) -> dict:
    """The validation loop: the whole set's predictions gathered as numpy
    values (the original loop's ``np.array(all_predictions)``) and scored at
    the end. The other program starts with it and takes ``hog_bytes`` in
    two halves, before the second batch and the third: the batches from the
    third on run in what it left. Per batch: the micro-batch inference
    settled on, the arena's peak and budget (the room tensors had), the
    hog's bytes and the seconds."""
    model.eval()
    hog = Hog() if hog_bytes else None
    preds: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    rows: list[dict] = []
    t0 = time.perf_counter()
    try:
        with guard.evaluate():
            for k, (x, y) in enumerate(val):
                if hog is not None and k in (1, 2):
                    hog.take(hog_bytes // 2)
                t = time.perf_counter()
                memguard.memory.arena.reset_peaks()
                preds.append(guard.infer(x, model).numpy())
                targets.append(y.numpy())
                st = memguard.stats()
                rows.append({"micro": guard.inference.micro, "seconds": time.perf_counter() - t,
                             "peak_bytes": st["allocated_bytes.peak"],
                             "tensor_room_bytes": st["budget_bytes"],
                             "hog_bytes": hog.held if hog else 0})
    finally:
        if hog is not None:
            hog.close()
    model.train()
    pred, target = np.concatenate(preds), np.concatenate(targets)
    return {"val_s": round(time.perf_counter() - t0, 2), "val_predictions": len(pred),
            "val_prediction_type": type(pred).__name__, "val_held_bytes": pred.nbytes,
            "val_mse": float(np.mean((pred - target) ** 2)),
            "val_target_var": float(np.var(target)), "val_batches": rows,
            "hog_bytes": hog_bytes, "infer_changes": guard.inference.changes}


def report(s: dict) -> None:
    """The run in a few lines."""
    rows = s["val_batches"]
    print(f"\n{s['steps_done']}/{s['steps']} steps at effective batch "
          f"{sorted(set(s['effective_batches']))}, micro-batches {s['micro_batches'][0]} -> "
          f"{s['micro_batches'][-1]} ({s['micro_batch_changes']} changes, "
          f"{s['ooms_recovered']} out-of-memory errors recovered), {s['workers']} DataLoader "
          f"workers; budget {mib(s['budget_bytes'])} ({mib(s['room_bytes'])} left at the start)")
    print(f"validation of {s['val_predictions']} samples in batches of {s['val_batch']}, the "
          f"other program taking {mib(s['hog_bytes'])}: micro-batch, room for tensors and "
          "seconds a batch")
    for k, r in enumerate(rows):
        print(f"  batch {k:3}: micro {r['micro']:4}, peak {mib(r['peak_bytes'])} of "
              f"{mib(r['tensor_room_bytes'])}, other program {mib(r['hog_bytes'])}, "
              f"{r['seconds']:.2f} s")
    print(f"predictions: {s['val_prediction_type']} of {s['val_held_bytes']:,} bytes; val MSE "
          f"{s['val_mse']:.4f} (target variance {s['val_target_var']:.4f}); training "
          f"{s['train_s']:.1f} s, validation {s['val_s']:.1f} s; trainable "
          f"{s['trainable_params']:,} of {s['total_params']:,} parameters")


# -- the run -------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short run (tests, a first try)")
    p.add_argument("--budget", default=None,
                   help='memory budget of the whole process and its children: "auto" (what '
                        'it can have now: the real machine, or the cgroup), a size, or by '
                        'default what it holds when training starts plus --room')
    p.add_argument("--room", default="320MiB",
                   help="what the machine has left for the run when training starts "
                        "(=320MiB; the default budget)")
    p.add_argument("--tensor-budget", default="40MiB",
                   help="what memguard's allocator may hold for tensors (=40MiB: the whole "
                        "training batch does not fit; none: no cap)")
    p.add_argument("--hog-mib", type=int, default=None,
                   help="what the other program takes while validation runs, in MiB "
                        "(=the room less 24 MiB; 0: no other program)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (=2)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps of the epoch "
                                                           "(=40, quick 12)")
    p.add_argument("--val-size", type=int, default=None, help="validation samples (=2048, "
                                                              "quick 768)")
    p.add_argument("--val-batch", type=int, default=VAL_BATCH,
                   help=f"the validation loader's batch (={VAL_BATCH})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads (=2)")
    p.add_argument("--summary-json", default=None, help="write the summary here as JSON")
    return p.parse_args(argv)


def build_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The "pretrained" backbone, frozen by peft and adapted by LoRA; the
    head is trained whole (modules_to_save)."""
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS,
                        modules_to_save=["head"])
    model = get_peft_model(ViTRegressor(), config)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=2e-3,
                            weight_decay=0.01)
    return model, opt


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    steps = args.steps or (12 if args.quick else 40)
    val_size = args.val_size or (768 if args.quick else 2048)
    torch.set_num_threads(min(args.threads, 2))
    torch.manual_seed(args.seed)
    model, opt = build_model()
    train = loader(Images(steps * BATCH, args.seed), BATCH, args.workers, shuffle=True)
    val = loader(Images(val_size, args.seed + 1), args.val_batch, args.workers, shuffle=False)

    def loss_fn(micro: tuple[torch.Tensor, torch.Tensor]) -> memguard.Output:
        x, y = micro
        pred = model(x)
        # aux: one prediction per sample, so post_step sees the step's samples
        return memguard.Output(nn.functional.mse_loss(pred, y), aux=pred)

    effective: list[int] = []
    micro_batches: list[int] = []
    losses: list[float] = []

    # The budget: what the machine has left for the run, counted against what
    # it holds with its workers started (the first batch makes them start).
    batches = iter(train)
    first = next(batches)
    room = memguard.telemetry.parse_budget(args.room)
    budget = args.budget or footprint() + room
    hog_bytes = (room - 24 * 2**20 if args.hog_mib is None else args.hog_mib * 2**20)
    tensor_budget = None if args.tensor_budget == "none" else args.tensor_budget
    # Micro-batches of fewer than 4 images would only add Python overhead.
    guard = memguard.Guard(budget=budget, tensor_budget=tensor_budget, min_micro_batch=4)
    t0 = time.perf_counter()
    with guard:
        for i, batch in enumerate(itertools.chain([first], batches)):
            res = guard.step(batch, loss_fn, opt, clip_grad_norm=1.0,
                             post_step=lambda aux: effective.append(len(aux)))
            micro_batches.append(res.micro_batch)
            losses.append(res.loss)
            if res.retries:
                print(f"step {i}: out of memory at micro-batch {res.tried}, "
                      f"redone at {res.micro_batch}")
        train_s = time.perf_counter() - t0
        print(f"epoch: {guard.steps} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"micro-batches {micro_batches[0]} -> {micro_batches[-1]} ({train_s:.1f} s)")
        tensor_room = memguard.stats()["budget_bytes"]    # the tensors' room in training
        v = validate(guard, model, val, hog_bytes)
        info = guard.summary()
    wall = time.perf_counter() - t0
    summary = {
        "steps": steps, "steps_done": info["steps"], "effective_batches": effective,
        "micro_batches": micro_batches, "micro_batch_changes": info["micro_batch_changes"],
        "ooms_recovered": info["ooms_recovered"], "peak_bytes": info["peak_bytes"],
        "peak_source": info["peak_source"], "budget_bytes": info["budget_bytes"],
        "tensor_budget_bytes": tensor_room, "room_bytes": room, "workers": args.workers,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "throttled": info["micro_batch_changes"] > 0 or info["ooms_recovered"] > 0,
        "wall_s": round(wall, 2), "train_s": round(train_s, 2), "losses": losses,
        "val_size": val_size, "val_batch": args.val_batch, **v,
        "trainable_params": sum(q.numel() for q in model.parameters() if q.requires_grad),
        "total_params": sum(q.numel() for q in model.parameters()),
        "trainable_names": [n for n, q in model.named_parameters() if q.requires_grad],
    }
    report(summary)
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
