"""LoRA fine-tuning of a frozen ViT backbone on a laptop CPU, with a
validation loop that does not swap.

The run this reproduces in miniature: DINOv3 ViT with LoRA adapters and a
regression head, fine-tuned on a laptop's CPU. Training fitted; the
validation loop, which kept every batch's predictions to score the whole
set at the end, made the machine swap for 13 hours. Its predictions were
kept with their autograd graphs (no ``no_grad``), so each one held on to
the activations of the batch that produced it, and a large validation
batch needed more memory at once than training did.

Here the same loop runs inside a memguard budget:

- training goes through ``guard.step``: the batch is split into
  micro-batches when it does not fit, with the gradients of the whole batch
  in one optimizer step, so the effective batch stays the script's;
- validation runs under ``guard.evaluate()`` and ``guard.infer``: no graph,
  micro-batches of inference's own plan (with no graph, more samples fit
  than in a training micro-batch), predictions detached, and the
  memory released when it ends. The arena's peak during each validation is
  recorded to show it stays flat however many predictions have been kept.

The backbone is a small ViT built here (DINOv3's module names: ``qkv`` and
``proj`` in attention, ``fc1``/``fc2`` in the MLP), frozen; LoRA comes from
peft. Data are synthetic: images whose target is a fixed function of them.

    python examples/dinov3_lora_cpu.py [--quick] [--tensor-budget 40MiB] [--steps N] [--naive]
"""
from __future__ import annotations

import argparse
import json
import resource
import time

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import memguard

IMG, PATCH, DIM, DEPTH, HEADS = 32, 4, 128, 4, 4
BATCH = 32            # the training batch: gradients of 32 samples per optimizer step
VAL_BATCH = 128       # the validation loader's batch, larger than training's
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


def make_data(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and a regression target that depends on them: the contrast
    between the left and right halves, plus a little noise."""
    x = torch.randn(n, 3, IMG, IMG, generator=g)
    x[:, :, :, : IMG // 2] += torch.rand(n, 1, 1, 1, generator=g) * 2
    y = x[..., : IMG // 2].mean((1, 2, 3)) - x[..., IMG // 2:].mean((1, 2, 3))
    return x, y + 0.05 * torch.randn(n, generator=g)



def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short run (tests, a first try)")
    p.add_argument("--budget", default="auto",
                   help='memory budget of the whole process: "auto" (what it can have now), '
                        'a size, or a share of memory (=auto)')
    p.add_argument("--tensor-budget", default="40MiB",
                   help="what memguard's allocator may hold for tensors (=40MiB: the whole batch does not fit)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (=40, quick 12)")
    p.add_argument("--val-every", type=int, default=None, help="steps between validations")
    p.add_argument("--val-size", type=int, default=None, help="validation samples (=1024)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads (=2)")
    p.add_argument("--naive", action="store_true",
                   help="after training, run the original validation loop (no no_grad) once")
    p.add_argument("--summary-json", default=None, help="write the summary here as JSON")
    args = p.parse_args(argv)
    steps = args.steps or (12 if args.quick else 40)
    val_every = args.val_every or (4 if args.quick else 8)
    val_size = args.val_size or (384 if args.quick else 1024)

    torch.set_num_threads(min(args.threads, 2))
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)

    # the "pretrained" backbone: frozen by peft, adapted by LoRA; the head
    # is trained whole (modules_to_save)
    base = ViTRegressor()
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS,
                        modules_to_save=["head"])
    model = get_peft_model(base, config)
    trainable = [n for n, q in model.named_parameters() if q.requires_grad]
    n_trainable = sum(q.numel() for q in model.parameters() if q.requires_grad)
    n_total = sum(q.numel() for q in model.parameters())
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=2e-3,
                            weight_decay=0.01)

    train_x, train_y = make_data(steps * BATCH, g)
    val_x, val_y = make_data(val_size, g)

    def loss_fn(micro: tuple[torch.Tensor, torch.Tensor]) -> memguard.Output:
        x, y = micro
        pred = model(x)
        # aux: one prediction per sample, so post_step sees the step's samples
        return memguard.Output(nn.functional.mse_loss(pred, y), aux=pred)

    effective: list[int] = []
    micro_batches: list[int] = []
    losses: list[float] = []
    val_peaks: list[int] = []
    val_counts: list[int] = []
    val_mse: list[float] = []
    val_micro: list[int] = []
    val_held: list[int] = []
    val_batch_peaks: list[list[int]] = []

    def post_step(aux: torch.Tensor) -> None:
        effective.append(len(aux))

    def validate(guard: memguard.Guard) -> None:
        """Predictions over the whole validation set, kept until the end and
        scored together (what the original loop did). The arena's peak is
        taken batch by batch: it must not grow with the predictions kept."""
        model.eval()
        before = memguard.stats()["allocated_bytes.current"]
        preds, peaks = [], []
        with guard.evaluate():
            for s in range(0, val_size, VAL_BATCH):
                memguard.memory.arena.reset_peaks()
                preds.append(guard.infer(val_x[s:s + VAL_BATCH], model))
                peaks.append(memguard.stats()["allocated_bytes.peak"])
        pred = torch.cat(preds)
        val_peaks.append(max(peaks))
        val_batch_peaks.append(peaks)
        # what the kept predictions hold: their values, no graph
        val_held.append(memguard.stats()["allocated_bytes.current"] - before)
        val_counts.append(len(pred))
        val_mse.append(nn.functional.mse_loss(pred, val_y).item())
        val_micro.append(guard.summary()["infer_micro_batch"])
        del preds, pred
        model.train()

    def naive_validation(size: int) -> dict:
        """The original loop: no no_grad, so every kept prediction holds on
        to the activations of its batch. Under the budget it runs out of
        memory where the laptop started swapping, even in batches of the
        size training found."""
        model.eval()
        before = memguard.stats()["allocated_bytes.current"]
        preds, held = [], []
        error = None
        try:
            for s in range(0, val_size, size):
                preds.append(model(val_x[s:s + size]))
                held.append(memguard.stats()["allocated_bytes.current"] - before)
        except RuntimeError as exc:
            if not memguard.is_oom(exc):
                raise
            error = "out of memory"
        kept = sum(len(q) for q in preds)
        del preds
        model.train()
        return {"batch": size, "predictions": kept, "held_bytes": held, "error": error}

    t0 = time.perf_counter()
    # The process's budget is live ("auto": what it can have now, re-derived
    # at every step boundary); the tensors get what memguard's allocator may
    # hold, --tensor-budget, within it. At this toy scale the interpreter
    # and torch are most of the process, so a budget for the tensors alone
    # is what makes the throttle act.
    # Micro-batches of fewer than 4 images would only add Python overhead.
    guard = memguard.Guard(budget=args.budget, tensor_budget=args.tensor_budget,
                           min_micro_batch=4)
    with guard:
        for i in range(steps):
            batch = (train_x[i * BATCH:(i + 1) * BATCH], train_y[i * BATCH:(i + 1) * BATCH])
            res = guard.step(batch, loss_fn, opt, clip_grad_norm=1.0, post_step=post_step)
            micro_batches.append(res.micro_batch)
            losses.append(res.loss)
            if res.retries:
                print(f"step {i}: out of memory at micro-batch {res.tried}, "
                      f"redone at {res.micro_batch}")
            if (i + 1) % val_every == 0 or i == steps - 1:
                validate(guard)
                print(f"step {i + 1}: loss {res.loss:.4f}, val MSE {val_mse[-1]:.4f} over "
                      f"{val_counts[-1]} samples (micro-batch {val_micro[-1]}), validation "
                      f"peak {mib(val_peaks[-1])}, kept predictions hold "
                      f"{val_held[-1]:,} bytes")
        naive = naive_validation(guard.micro_batch) if args.naive else None
        info = guard.summary()
        tensor_budget = memguard.stats()["budget_bytes"]
    wall = time.perf_counter() - t0

    summary = {
        "steps": steps,
        "steps_done": info["steps"],
        "effective_batches": effective,
        "micro_batches": micro_batches,
        "micro_batch_changes": info["micro_batch_changes"],
        "ooms_recovered": info["ooms_recovered"],
        "peak_bytes": info["peak_bytes"],
        "peak_source": info["peak_source"],
        "budget_bytes": info["budget_bytes"],
        "tensor_budget_bytes": tensor_budget,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "throttled": info["micro_batch_changes"] > 0 or info["ooms_recovered"] > 0,
        "wall_s": round(wall, 2),
        "losses": losses,
        "val_peaks": val_peaks,
        "val_predictions": val_counts,
        "val_size": val_size,
        "val_mse": val_mse,
        "val_micro_batches": val_micro,
        "val_held_bytes": val_held,
        "val_batch_peaks": val_batch_peaks,
        "val_batch": VAL_BATCH,
        "trainable_params": n_trainable,
        "total_params": n_total,
        "trainable_names": trainable,
    }
    print(f"\n{info['steps']}/{steps} steps at effective batch {sorted(set(effective))}, "
          f"micro-batches {micro_batches[0]} -> {micro_batches[-1]} "
          f"({info['micro_batch_changes']} changes, {info['ooms_recovered']} out-of-memory "
          f"errors recovered)")
    print(f"tensor peak {mib(info['peak_bytes'])} of the {mib(tensor_budget)} the "
          f"{mib(info['budget_bytes'])} budget leaves for tensors ({info['peak_source']}); "
          f"process peak RSS {mib(summary['peak_rss_bytes'])}")
    print(f"validation peaks {', '.join(map(mib, val_peaks))} at micro-batches {val_micro}")
    print(f"trainable {n_trainable:,} of {n_total:,} parameters (LoRA and head); "
          f"val MSE {val_mse[0]:.4f} -> {val_mse[-1]:.4f}; wall time {wall:.1f} s")
    if naive is not None:
        summary["naive_validation"] = naive
        held = ", ".join(mib(b) for b in naive["held_bytes"]) or "nothing"
        print(f"the original validation loop (batches of {naive['batch']}, no no_grad) kept "
              f"{naive['predictions']} of {val_size} predictions, holding {held} after each "
              "batch" + (f", then ran {naive['error']}" if naive["error"] else ""))
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
