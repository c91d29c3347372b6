"""DINO self-distillation with multi-crop, trained inside a memory budget.

A small synthetic version of a DINO training loop (Caron et al., 2021,
"Emerging Properties in Self-Supervised Vision Transformers"):

* a student and a teacher ViT of the same shape, each with a projection
  head; the teacher is an exponential moving average (EMA) of the student
  and gets no gradients;
* every image gives 2 global crops and several local crops (random resized
  crops, flips and brightness jitter of synthetic images); the student sees
  every crop, the teacher the global ones only;
* the loss is the cross-entropy between the teacher's centred, sharpened
  distribution on one global crop and the student's on every other crop.

``memguard.Guard.step`` splits each batch into micro-batches when the whole
batch does not fit the budget. The DINO loss is a mean over images, so the
micro-batches' losses add up to the batch's. Two updates must see the whole
batch however it was split, and happen once per optimizer step: the centre
(a running mean of the teacher's outputs) and the EMA of the teacher. The
loss function returns ``memguard.Output(loss, aux=teacher_outputs)``; the
guard concatenates the micro-batches' ``aux`` and hands the whole batch's
teacher outputs to ``post_step``, where both updates happen.

Run ``python examples/dino_multicrop.py --quick`` for a short run; ``--help``
lists the options.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import memguard


# -- data --------------------------------------------------------------------
def synthetic_images(n: int, size: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` smooth random RGB images: coarse noise upsampled, plus fine noise."""
    coarse = torch.randn(n, 3, 6, 6, generator=gen)
    img = F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
    return img + 0.1 * torch.randn(n, 3, size, size, generator=gen)


def random_resized_crops(images: torch.Tensor, n_crops: int, size: int,
                         scale: tuple[float, float], gen: torch.Generator) -> torch.Tensor:
    """``n_crops`` random resized crops of each image, ``[B, n_crops, 3, size, size]``.

    Each crop covers a random share ``scale`` of the image's area with an
    aspect ratio in [3/4, 4/3], is flipped horizontally half of the time and
    resampled bilinearly to ``size`` (one ``grid_sample`` per crop index).
    """
    b = images.shape[0]
    k = b * n_crops
    area = torch.empty(k).uniform_(*scale, generator=gen)
    log_ratio = torch.empty(k).uniform_(math.log(3 / 4), math.log(4 / 3), generator=gen)
    ratio = log_ratio.exp()
    # half-widths in normalised coordinates ([-1, 1] spans the image)
    w = (area * ratio).sqrt().clamp(max=1.0)
    h = (area / ratio).sqrt().clamp(max=1.0)
    cx = (torch.rand(k, generator=gen) * 2 - 1) * (1 - w)
    cy = (torch.rand(k, generator=gen) * 2 - 1) * (1 - h)
    flip = torch.where(torch.rand(k, generator=gen) < 0.5, -1.0, 1.0)
    theta = torch.zeros(n_crops, b, 2, 3)
    theta[..., 0, 0] = (w * flip).view(n_crops, b)
    theta[..., 0, 2] = cx.view(n_crops, b)
    theta[..., 1, 1] = h.view(n_crops, b)
    theta[..., 1, 2] = cy.view(n_crops, b)
    crops = torch.stack([
        F.grid_sample(images, F.affine_grid(t, [b, 3, size, size], align_corners=False),
                      mode="bilinear", padding_mode="reflection", align_corners=False)
        for t in theta], dim=1)
    return crops * torch.empty(b, n_crops, 1, 1, 1).uniform_(0.6, 1.4, generator=gen)


def make_batch(batch: int, args: argparse.Namespace, gen: torch.Generator
               ) -> dict[str, torch.Tensor]:
    """One batch of multi-crop views: every tensor has the images along dim 0,
    so the guard splits them together."""
    images = synthetic_images(batch, args.image_size, gen)
    return {
        "global": random_resized_crops(images, 2, args.global_size, (0.4, 1.0), gen),
        "local": random_resized_crops(images, args.local_crops, args.local_size,
                                      (0.05, 0.4), gen),
    }


# -- model -------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A small ViT taking crops of any size that is a multiple of the patch:
    the position embedding, learnt for the global crops' grid, is
    interpolated for the local crops' (as DINO's ViT does)."""

    def __init__(self, image_size: int, patch: int, dim: int, depth: int, heads: int) -> None:
        super().__init__()
        self.grid = image_size // patch
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, 1 + self.grid ** 2, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def _pos(self, grid: int) -> torch.Tensor:
        if grid == self.grid:
            return self.pos
        cls, patches = self.pos[:, :1], self.pos[:, 1:]
        d = patches.shape[-1]
        patches = patches.reshape(1, self.grid, self.grid, d).permute(0, 3, 1, 2)
        patches = F.interpolate(patches, size=(grid, grid), mode="bicubic", align_corners=False)
        return torch.cat([cls, patches.permute(0, 2, 3, 1).reshape(1, grid * grid, d)], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        grid = x.shape[-1]
        x = x.flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self._pos(grid)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x[:, 0])


class DINOHead(nn.Module):
    """MLP to a bottleneck, L2-normalised, then a linear layer whose rows
    have unit norm (DINO's weight-normalised last layer with its gain
    frozen at 1) onto ``out_dim`` prototypes."""

    def __init__(self, dim: int, out_dim: int, hidden: int = 128, bottleneck: int = 32) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden),
                                 nn.GELU(), nn.Linear(hidden, bottleneck))
        self.last = nn.Parameter(torch.randn(out_dim, bottleneck) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.normalize(self.mlp(x), dim=-1)
        return F.linear(x, F.normalize(self.last, dim=-1))


class MultiCropNet(nn.Module):
    """Backbone and head over crops of several resolutions: the crops of one
    resolution go through the backbone together, the head takes them all."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.backbone = ViT(args.global_size, args.patch, args.dim, args.depth, args.heads)
        self.head = DINOHead(args.dim, args.out_dim)

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        """``views``: tensors ``[B, n_crops, 3, H, W]``; returns
        ``[B, sum(n_crops), out_dim]``."""
        b = views[0].shape[0]
        feats = [self.backbone(v.flatten(0, 1)).view(b, v.shape[1], -1) for v in views]
        return self.head(torch.cat(feats, dim=1))


class DINOLoss(nn.Module):
    """Cross-entropy between the teacher's centred and sharpened softmax on
    each global crop and the student's softmax on every other crop. The
    centre is a buffer changed only by :meth:`update_center`."""

    def __init__(self, out_dim: int, student_temp: float = 0.1, teacher_temp: float = 0.04,
                 center_momentum: float = 0.9) -> None:
        super().__init__()
        self.student_temp = student_temp
        self.teacher_temp = teacher_temp
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(out_dim))

    def forward(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        """``student [B, n_crops, K]``, ``teacher [B, 2, K]`` (the global crops
        first in both): the mean loss over images."""
        t = F.softmax((teacher - self.center) / self.teacher_temp, dim=-1)
        log_s = F.log_softmax(student / self.student_temp, dim=-1)
        # every (teacher crop, other student crop) pair, per image
        cross = -torch.einsum("bik,bvk->biv", t, log_s)          # [B, 2, n_crops]
        same = torch.eye(2, student.shape[1], dtype=torch.bool)  # a crop with itself
        pairs = cross.masked_fill(same, 0.0).sum(dim=(1, 2))
        return pairs.mean() / (2 * student.shape[1] - 2)

    @torch.no_grad()
    def update_center(self, teacher: torch.Tensor) -> None:
        """Move the centre towards the mean teacher output of a whole batch."""
        mean = teacher.flatten(0, -2).mean(dim=0)
        self.center.mul_(self.center_momentum).add_(mean, alpha=1 - self.center_momentum)


@torch.no_grad()
def ema_update(teacher: nn.Module, student: nn.Module, momentum: float) -> None:
    """teacher := momentum * teacher + (1 - momentum) * student."""
    for pt, ps in zip(teacher.parameters(), student.parameters()):
        pt.mul_(momentum).add_(ps.detach(), alpha=1 - momentum)


# -- training ----------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short run (a few seconds)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (default: 60, or 8 with --quick)")
    p.add_argument("--batch", type=int, default=32, help="images per optimizer step (=32)")
    p.add_argument("--budget", default="auto",
                   help='memory budget of the whole process: "auto" (what it can have now), '
                        'a size, or a share of memory (=auto)')
    p.add_argument("--tensor-budget", default="48MiB",
                   help="what memguard's allocator may hold for tensors (=48MiB: room for the model and a split batch, not for the whole batch)")
    p.add_argument("--min-micro-batch", type=int, default=4)
    p.add_argument("--local-crops", type=int, default=6)
    p.add_argument("--image-size", type=int, default=40)
    p.add_argument("--global-size", type=int, default=24)
    p.add_argument("--local-size", type=int, default=12)
    p.add_argument("--patch", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--out-dim", type=int, default=4096, help="prototypes of the head")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--telemetry", default=None, help="write the guard's samples and "
                   "decisions to this .jsonl file")
    p.add_argument("--summary-json", default=None, help="write the summary here")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 8 if args.quick else 60
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    torch.manual_seed(args.seed)                       # initialisation
    gen = torch.Generator().manual_seed(args.seed)    # the data

    # The process's budget is live ("auto": what it can have now, re-derived
    # at every step boundary); the tensors get what memguard's allocator may
    # hold, --tensor-budget, within it. At this toy scale the interpreter
    # and torch are most of the process, so a budget for the tensors alone
    # is what makes the throttle act.
    guard = memguard.Guard(budget=args.budget, tensor_budget=args.tensor_budget,
                           min_micro_batch=args.min_micro_batch, telemetry=args.telemetry)
    counts = {"center_updates": 0, "ema_updates": 0}
    effective: list[int] = []
    micro_batches: list[int] = []
    events: list[str] = []
    error = None
    t0 = time.perf_counter()
    with guard:
        # built under the guard: the arena's room holds the weights and the
        # optimizer state too, as a GPU's memory would
        student = MultiCropNet(args)
        teacher = MultiCropNet(args)
        teacher.load_state_dict(student.state_dict())
        teacher.requires_grad_(False)
        dino_loss = DINOLoss(args.out_dim)
        optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.04)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda i: 0.5 * (1 + math.cos(math.pi * i / args.steps)))

        def loss_fn(micro: dict[str, torch.Tensor]) -> memguard.Output:
            with torch.no_grad():
                t_out = teacher([micro["global"]])                    # [m, 2, K]
            s_out = student([micro["global"], micro["local"]])        # [m, 2 + L, K]
            # nothing in this forward changes a buffer (no BatchNorm; the
            # centre moves in post_step), so the step needs no restore=
            return memguard.Output(dino_loss(s_out, t_out), aux=t_out)

        def post_step(t_out: torch.Tensor) -> None:
            # once per optimizer step, with the whole batch's teacher outputs
            effective.append(len(t_out))
            dino_loss.update_center(t_out)
            counts["center_updates"] += 1
            # teacher momentum: 0.996 -> 1 on a cosine, as in DINO
            m = 1 - (1 - 0.996) * 0.5 * (1 + math.cos(math.pi * len(effective) / args.steps))
            ema_update(teacher, student, m)
            counts["ema_updates"] += 1

        for step in range(args.steps):
            batch = make_batch(args.batch, args, gen)
            try:
                res = guard.step(batch, loss_fn, optimizer, clip_grad_norm=3.0,
                                 post_step=post_step)
            except memguard.GuardOOMError as exc:
                error = str(exc)
                print(f"step {step}: {exc}")
                break
            schedule.step()
            # what the planner did: a change at the step boundary (the size
            # the step started at), then sizes given up after out of memory
            start = res.tried[0] if res.tried else res.micro_batch
            if micro_batches and start != micro_batches[-1]:
                why = "" if res.tried else f" ({guard.plan()['reason']})"
                events.append(f"{micro_batches[-1]} -> {start}{why} before step {step}")
            if res.tried:
                events.append(f"{' -> '.join(map(str, res.tried))} -> {res.micro_batch} "
                              f"(out of memory) in step {step}")
            micro_batches.append(res.micro_batch)
            print(f"step {step:3d}  loss {res.loss:.4f}  micro-batch {res.micro_batch:3d} "
                  f"x {res.n_micro}  peak {res.peak_bytes / 2**20:5.1f} MiB", flush=True)
            del batch, res
        tensor_budget = memguard.stats()["budget_bytes"]   # the arena's room
    wall = time.perf_counter() - t0
    rss = memguard.sample().rss_bytes or 0

    s = guard.summary()
    summary: dict[str, Any] = {
        "example": "dino_multicrop",
        "steps": args.steps,
        "steps_done": len(effective),
        "effective_batches": effective,
        "micro_batches": micro_batches,
        "micro_batch_changes": s["micro_batch_changes"],
        "ooms_recovered": s["ooms_recovered"],
        "peak_bytes": guard.peak_bytes,
        "budget_bytes": guard.budget_bytes,
        "tensor_budget_bytes": tensor_budget,
        "rss_bytes": rss,
        "peak_source": s["peak_source"],
        "throttled": s["micro_batch_changes"] > 0 or s["ooms_recovered"] > 0,
        "wall_s": round(wall, 3),
        "center_updates": counts["center_updates"],
        "ema_updates": counts["ema_updates"],
        "crops": {"global": 2, "local": args.local_crops},
        "error": error,
    }
    print(f"\nDINO: steps {summary['steps_done']}/{args.steps}, effective batch "
          f"{sorted(set(effective))}, micro-batches {sorted(set(micro_batches), reverse=True)}")
    print(f"micro-batch changes {summary['micro_batch_changes']} "
          f"({'; '.join(events) or 'none'}), "
          f"out-of-memory errors recovered {summary['ooms_recovered']}")
    print(f"tensor peak {guard.peak_bytes / 2**20:.1f} MiB of the arena's "
          f"{tensor_budget / 2**20:.1f} MiB, in a process budget of "
          f"{guard.budget_bytes / 2**20:.1f} MiB (the process holds {rss / 2**20:.1f} MiB now)")
    print(f"centre and teacher updated {counts['center_updates']}/{counts['ema_updates']} "
          f"times; wall {wall:.1f} s")
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if error is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
