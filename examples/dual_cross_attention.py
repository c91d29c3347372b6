"""Fine-grained classification with pair-wise cross-attention between the
images of a batch, under a memory budget.

A dual cross-attention ViT in the manner of DCAL (fine-grained visual
categorisation): besides the usual self-attention stream, a pair-wise
stream with the same weights lets each image attend to the tokens of
another image as well as its own, a regulariser that makes the model look
past the features the two images share. The batch is made of pairs:
sample 2i attends to 2i+1 and 2i+1 to 2i. That couples samples inside
the batch, so a split must never cut a pair: ``Guard(multiple_of=2)``
keeps every micro-batch even (and pairs start at even offsets, so they stay
whole), and the model refuses an odd batch.

The rest is a usual recipe on a small machine: bfloat16 autocast (on CPU
here), an effective batch of 16, and activation checkpointing of the
blocks that memguard switches on block by block when the smallest
micro-batch is still under pressure, and off again, a quarter of the
blocks every 8 calm steps, when it is not (``Guard(checkpoint=model.blocks)``,
see :mod:`memguard.train.checkpoint`). ``--checkpoint-blocks 4`` starts with
every block checkpointed: the whole batch then fits, and memguard turns
checkpointing off as the run stays calm.

    python examples/dual_cross_attention.py [--quick] [--tensor-budget 24MiB] [--checkpoint-blocks N]
"""
from __future__ import annotations

import argparse
import json
import resource
import time

import torch
from torch import nn

import memguard

IMG, PATCH, DIM, DEPTH, HEADS, CLASSES = 32, 4, 64, 4, 4, 10
BATCH = 16            # the effective batch: 8 pairs per optimizer step


def partner(t: torch.Tensor) -> torch.Tensor:
    """Each sample's pair partner along dim 0: 2i <-> 2i+1."""
    return t.unflatten(0, (-1, 2)).flip(1).flatten(0, 1)


class Attention(nn.Module):
    """Self-attention, or pair-wise cross-attention: queries of an image
    against the keys and values of itself and its partner."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, pair: bool = False) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if pair:
            k = torch.cat([k, partner(k)], dim=2)
            v = torch.cat([v, partner(v)], dim=2)
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    """A transformer block run on both streams with the same weights."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def one(self, x: torch.Tensor, pair: bool) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), pair)
        return x + self.mlp(self.norm2(x))

    def forward(self, sa: torch.Tensor,
                pw: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.one(sa, False), None if pw is None else self.one(pw, True)


class DualViT(nn.Module):
    """Self-attention stream for prediction; in training, a pair-wise
    stream too, whose classification loss is added."""

    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, DIM, PATCH, stride=PATCH)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, DIM))
        self.pos_embed = nn.Parameter(torch.randn(1, (IMG // PATCH) ** 2 + 1, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor,
                pairs: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if pairs and len(x) % 2:
            raise ValueError(f"pair-wise attention needs an even batch, not {len(x)}: "
                             "split batches with Guard(multiple_of=2)")
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        sa = torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed
        pw = sa if pairs else None
        for blk in self.blocks:
            sa, pw = blk(sa, pw)
        logits = self.head(self.norm(sa)[:, 0])
        return logits, None if pw is None else self.head(self.norm(pw)[:, 0])


def make_data(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Classes that differ in fine detail (a faint class-specific pattern in
    one small patch of otherwise random images), in pairs of random images
    as a pair sampler would deliver them: images, labels, pair ids."""
    protos = torch.randn(CLASSES, 3, 8, 8, generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = torch.randn(n, 3, IMG, IMG, generator=g)
    x[:, :, 12:20, 12:20] += 1.5 * protos[y]
    return x, y, torch.arange(n) // 2



def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short run (tests, a first try)")
    p.add_argument("--budget", default="auto",
                   help='memory budget of the whole process: "auto" (what it can have now), '
                        'a size, or a share of memory (=auto)')
    p.add_argument("--tensor-budget", default="24MiB",
                   help="what memguard's allocator may hold for tensors (=24MiB: the whole batch does not fit)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (=60, quick 12)")
    p.add_argument("--checkpoint-blocks", type=int, default=0,
                   help="blocks checkpointed from the start (=0); memguard switches more on "
                        "under pressure at the smallest micro-batch, and off when calm")
    p.add_argument("--no-checkpoint", action="store_true",
                   help="do not let memguard checkpoint the blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads (=2)")
    p.add_argument("--summary-json", default=None, help="write the summary here as JSON")
    args = p.parse_args(argv)
    steps = args.steps or (12 if args.quick else 60)

    torch.set_num_threads(min(args.threads, 2))
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    model = DualViT()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-4, total_steps=steps)
    train_x, train_y, train_pair = make_data(steps * BATCH, g)
    broken_pairs = [0]

    def loss_fn(micro: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> memguard.Output:
        x, y, pair = micro
        # a split that cut a pair would pair strangers: count it
        broken_pairs[0] += int(len(pair) % 2 or (pair[0::2] != pair[1::2]).any())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, pair_logits = model(x, pairs=True)
            loss = nn.functional.cross_entropy(logits, y) \
                + nn.functional.cross_entropy(pair_logits, y)
        # aux: per-sample correctness, so post_step sees every sample of the step
        return memguard.Output(loss, aux=(logits.argmax(-1) == y).float())

    effective: list[int] = []
    accuracy: list[float] = []
    micro_batches: list[int] = []
    checkpointed: list[int] = []
    losses: list[float] = []

    def post_step(aux: torch.Tensor) -> None:
        effective.append(len(aux))
        accuracy.append(aux.mean().item())

    t0 = time.perf_counter()
    # The process's budget is live ("auto": what it can have now, re-derived
    # at every step boundary); the tensors get what memguard's allocator may
    # hold, --tensor-budget, within it. At this toy scale the interpreter
    # and torch are most of the process, so a budget for the tensors alone
    # is what makes the throttle act.
    guard = memguard.Guard(budget=args.budget, tensor_budget=args.tensor_budget, multiple_of=2,
                           min_micro_batch=2,
                           checkpoint=None if args.no_checkpoint else model.blocks)
    if guard.checkpoints is not None:
        guard.checkpoints.set(args.checkpoint_blocks)
    with guard:
        for i in range(steps):
            at = slice(i * BATCH, (i + 1) * BATCH)
            batch = (train_x[at], train_y[at], train_pair[at])
            res = guard.step(batch, loss_fn, opt, clip_grad_norm=1.0, post_step=post_step)
            sched.step()
            n_ckpt = guard.checkpoints.n_on if guard.checkpoints is not None else 0
            micro_batches.append(res.micro_batch)
            checkpointed.append(n_ckpt)
            losses.append(res.loss)
            if res.retries:
                print(f"step {i}: out of memory at micro-batch {res.tried}, "
                      f"redone at {res.micro_batch}")
            if i == 0 or micro_batches[-1] != micro_batches[-2] \
                    or checkpointed[-1] != checkpointed[-2] or i == steps - 1:
                print(f"step {i}: loss {res.loss:.3f}, micro-batch {res.micro_batch} x "
                      f"{res.n_micro}, {n_ckpt}/{DEPTH} blocks checkpointed, peak "
                      f"{mib(res.peak_bytes)}")
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
        "batch": BATCH,
        "losses": losses,
        "train_accuracy": accuracy,
        "checkpointed_blocks": checkpointed,
        "blocks": DEPTH,
        "micro_batches_even": all(m % 2 == 0 or m == BATCH for m in micro_batches),
        "broken_pairs": broken_pairs[0],
    }
    k = max(1, steps // 4)
    print(f"\n{info['steps']}/{steps} steps at effective batch {sorted(set(effective))}, "
          f"micro-batches {sorted(set(micro_batches))} ({info['micro_batch_changes']} changes, "
          f"{info['ooms_recovered']} out-of-memory errors recovered)")
    print(f"tensor peak {mib(info['peak_bytes'])} of the {mib(tensor_budget)} the "
          f"{mib(info['budget_bytes'])} budget leaves for tensors ({info['peak_source']}); "
          f"process peak RSS {mib(summary['peak_rss_bytes'])}")
    print(f"blocks checkpointed: at most {max(checkpointed)} of {DEPTH}, {checkpointed[-1]} at "
          f"the end")
    print(f"loss {sum(losses[:k]) / k:.3f} -> {sum(losses[-k:]) / k:.3f} (mean of the first "
          f"and last {k} steps); wall time {wall:.1f} s")
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
