"""MoCo contrastive learning inside a memory budget: a queue of negatives
(v2) or in-batch negatives through GradCache (v3).

A small synthetic version of two MoCo training loops:

``--variant v2`` (the default; He et al., 2020, and Chen et al., 2020,
"Improved Baselines with Momentum Contrastive Learning"): a query encoder
trained by backpropagation, a key encoder that follows it by momentum, and
a queue of the keys of past batches as negatives. The InfoNCE loss of a
query needs its own key and the queue only, so it is a mean over samples and
micro-batches add up to the batch. The queue is a registered buffer with a
pointer; the keys of a step are enqueued once per optimizer step, in
``post_step``, which gets the whole batch's keys (the ``aux`` of
``memguard.Output``) concatenated over the micro-batches. The queue size is
a multiple of the batch, so the pointer always lands on a multiple of the
batch and a batch never wraps around the end of the queue.

``--variant v3`` (Chen et al., 2021, "An Empirical Study of Training
Self-Supervised Vision Transformers"): no queue; each query is contrasted
with the momentum encoder's keys of every sample in the batch, so the loss
needs the whole batch at once. ``guard.step(..., embed_fn=model.embed)``
embeds the micro-batches without a graph, computes that
loss on the whole batch's embeddings, and backpropagates micro-batch by
micro-batch.

``--find-batch`` (v2) sizes the run up front instead of splitting it:
``memguard.find_batch_size(..., queue_size=)`` finds the largest batch whose
whole step fits the tensor budget and moves the queue to the multiple of it
nearest ``--queue-size`` (a queue of 65536 and a batch of 96 become 65568),
where ``divisor_of=`` could only answer a power of two.

Run ``python examples/moco_queue.py --quick`` for a short run; ``--help``
lists the options.
"""
from __future__ import annotations

import argparse
import copy
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
    coarse = torch.randn(n, 3, 5, 5, generator=gen)
    img = F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
    return img + 0.1 * torch.randn(n, 3, size, size, generator=gen)


def augment(images: torch.Tensor, size: int, gen: torch.Generator) -> torch.Tensor:
    """One MoCo v2-style view of each image: a random resized crop (20-100 %
    of the area), a horizontal flip half of the time, a per-channel colour
    gain, grey scale for a fifth of the images, and noise."""
    b = images.shape[0]
    area = torch.empty(b).uniform_(0.2, 1.0, generator=gen)
    ratio = torch.empty(b).uniform_(math.log(3 / 4), math.log(4 / 3), generator=gen).exp()
    w = (area * ratio).sqrt().clamp(max=1.0)    # half-widths in [-1, 1] coordinates
    h = (area / ratio).sqrt().clamp(max=1.0)
    theta = torch.zeros(b, 2, 3)
    theta[:, 0, 0] = w * torch.where(torch.rand(b, generator=gen) < 0.5, -1.0, 1.0)
    theta[:, 0, 2] = (torch.rand(b, generator=gen) * 2 - 1) * (1 - w)
    theta[:, 1, 1] = h
    theta[:, 1, 2] = (torch.rand(b, generator=gen) * 2 - 1) * (1 - h)
    grid = F.affine_grid(theta, [b, 3, size, size], align_corners=False)
    view = F.grid_sample(images, grid, mode="bilinear", padding_mode="reflection",
                         align_corners=False)
    view = view * torch.empty(b, 3, 1, 1).uniform_(0.6, 1.4, generator=gen)
    grey = torch.rand(b, 1, 1, 1, generator=gen) < 0.2
    view = torch.where(grey, view.mean(dim=1, keepdim=True).expand_as(view), view)
    return view + 0.05 * torch.randn(view.shape, generator=gen)


def make_batch(args: argparse.Namespace, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Two augmented views of a batch of images, samples along dim 0."""
    images = synthetic_images(args.batch, args.image_size, gen)
    return augment(images, args.crop_size, gen), augment(images, args.crop_size, gen)


# -- model -------------------------------------------------------------------
def mlp(dim_in: int, hidden: int, dim_out: int, norm: bool) -> nn.Sequential:
    """Linear, (LayerNorm), ReLU, Linear."""
    mid: list[nn.Module] = [nn.LayerNorm(hidden)] if norm else []
    return nn.Sequential(nn.Linear(dim_in, hidden), *mid, nn.ReLU(inplace=True),
                         nn.Linear(hidden, dim_out))


class ConvEncoder(nn.Module):
    """A small ResNet-like stem: four conv-norm-ReLU layers, global average
    pooling, and a projection MLP. ``norm="batch"`` is MoCo v2's BatchNorm;
    ``norm="group"`` treats every sample on its own, as GradCache needs."""

    def __init__(self, width: int, dim: int, hidden: int, norm: str) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for c, stride in ((width, 1), (2 * width, 2), (4 * width, 2), (4 * width, 1)):
            layers += [nn.Conv2d(c_in, c, 3, stride=stride, padding=1, bias=False),
                       nn.BatchNorm2d(c) if norm == "batch" else nn.GroupNorm(8, c),
                       nn.ReLU(inplace=True)]
            c_in = c
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        # MoCo v2's head has no norm; MoCo v3's has BatchNorm, LayerNorm here
        self.projector = mlp(c_in, hidden, dim, norm=norm != "batch")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(self.features(x))


@torch.no_grad()
def momentum_update(target: nn.Module, online: nn.Module, m: float) -> None:
    """target := m * target + (1 - m) * online, parameter by parameter."""
    for pt, po in zip(target.parameters(), online.parameters()):
        pt.mul_(m).add_(po.detach(), alpha=1 - m)


class MoCoV2(nn.Module):
    """Query and key encoders and the queue of negative keys.

    The queue ``[queue_size, dim]`` and its pointer are buffers, so they are
    saved with the model; they change only in :meth:`enqueue`.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.temperature = args.temperature
        self.encoder_q = ConvEncoder(args.width, args.dim, args.hidden, norm="batch")
        self.encoder_k = copy.deepcopy(self.encoder_q).requires_grad_(False)
        self.register_buffer("queue", F.normalize(torch.randn(args.queue_size, args.dim), dim=1))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))

    def loss(self, micro: tuple[torch.Tensor, torch.Tensor]) -> memguard.Output:
        """InfoNCE of each query against its key (the positive) and the
        queue (the negatives), averaged over the micro-batch; ``aux`` is the
        keys, for :meth:`enqueue`."""
        im_q, im_k = micro
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            k = F.normalize(self.encoder_k(im_k), dim=1)
        l_pos = (q * k).sum(dim=1, keepdim=True)
        l_neg = q @ self.queue.T
        logits = torch.cat([l_pos, l_neg], dim=1) / self.temperature
        labels = torch.zeros(len(q), dtype=torch.long)     # the positive is column 0
        return memguard.Output(F.cross_entropy(logits, labels), aux=k)

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor) -> int:
        """Replace the oldest keys of the queue with ``keys``; returns the
        new pointer. The queue size being a multiple of ``len(keys)``, the
        keys never wrap around its end."""
        n, size = len(keys), len(self.queue)
        ptr = int(self.queue_ptr)
        if size % n or ptr % n:
            raise RuntimeError(f"queue misaligned: {n} keys at pointer {ptr} of {size}")
        self.queue[ptr:ptr + n] = keys
        self.queue_ptr.fill_((ptr + n) % size)
        return int(self.queue_ptr)


class MoCoV3(nn.Module):
    """Base encoder with a predictor, and a momentum encoder (no predictor)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.temperature = args.temperature
        self.base = ConvEncoder(args.width, args.dim, args.hidden, norm="group")
        self.predictor = mlp(args.dim, args.hidden, args.dim, norm=True)
        self.momentum = copy.deepcopy(self.base).requires_grad_(False)

    def embed(self, micro: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Queries of both views, and the momentum encoder's keys (no
        gradient): every row depends on its own sample only."""
        x1, x2 = micro
        out = {"q1": self.predictor(self.base(x1)), "q2": self.predictor(self.base(x2))}
        with torch.no_grad():
            out["k1"] = self.momentum(x1)
            out["k2"] = self.momentum(x2)
        return out

    def contrastive(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """InfoNCE of each query against every key of the batch: its own
        sample's is the positive, the others' the negatives."""
        logits = F.normalize(q, dim=1) @ F.normalize(k, dim=1).T / self.temperature
        labels = torch.arange(len(q))
        return F.cross_entropy(logits, labels) * (2 * self.temperature)

    def loss(self, emb: dict[str, torch.Tensor]) -> torch.Tensor:
        """The symmetrised loss over the whole batch's embeddings."""
        return self.contrastive(emb["q1"], emb["k2"]) + self.contrastive(emb["q2"], emb["k1"])


# -- training ----------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=("v2", "v3"), default="v2",
                   help="v2: queue of negatives; v3: in-batch negatives with GradCache")
    p.add_argument("--quick", action="store_true", help="a short run (a few seconds)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (default: 80 for v2, 40 for v3, 10 with --quick)")
    p.add_argument("--batch", type=int, default=64, help="images per optimizer step (=64)")
    p.add_argument("--queue-size", type=int, default=4096,
                   help="negative keys in the queue (v2), a multiple of --batch (=4096; "
                        "with --find-batch, moved to a multiple of the batch found)")
    p.add_argument("--budget", default="auto",
                   help='memory budget of the whole process: "auto" (what it can have now), '
                        'a size, or a share of memory (=auto)')
    p.add_argument("--tensor-budget", default="28MiB",
                   help="what memguard's allocator may hold for tensors (=28MiB: room for the model and a split batch, not for the whole batch)")
    p.add_argument("--min-micro-batch", type=int, default=4)
    p.add_argument("--image-size", type=int, default=40)
    p.add_argument("--crop-size", type=int, default=32)
    p.add_argument("--width", type=int, default=16, help="channels of the first conv layer")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dim", type=int, default=128, help="key and query dimension")
    p.add_argument("--temperature", type=float, default=None,
                   help="softmax temperature (default: 0.2 for v2, 1.0 for v3)")
    p.add_argument("--momentum", type=float, default=0.99,
                   help="key encoder momentum (=0.99; v3: from it to 1 on a cosine)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: 0.03 with SGD for v2, 1e-3 with AdamW for v3)")
    p.add_argument("--find-batch", action="store_true",
                   help="v2: train at the largest batch whose step fits --tensor-budget, with "
                        "the queue moved to the multiple of it nearest --queue-size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--telemetry", default=None, help="write the guard's samples and "
                   "decisions to this .jsonl file")
    p.add_argument("--summary-json", default=None, help="write the summary here")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 10 if args.quick else 80 if args.variant == "v2" else 40
    if args.temperature is None:
        args.temperature = 0.2 if args.variant == "v2" else 1.0
    if args.lr is None:
        args.lr = 0.03 if args.variant == "v2" else 1e-3
    if args.find_batch and args.variant != "v2":
        p.error("--find-batch sizes v2's batch and queue; v3 has no queue")
    if args.variant == "v2" and args.queue_size % args.batch and not args.find_batch:
        p.error(f"--queue-size {args.queue_size} must be a multiple of --batch {args.batch}: "
                "a batch of keys must never wrap around the end of the queue")
    return args


def probe_batch_size(args: argparse.Namespace) -> memguard.BatchSizeResult:
    """``--find-batch``: the largest batch whose whole v2 step (forward,
    backward, optimizer step) fits ``--tensor-budget``, and the queue for
    it. The probes train a throwaway model, built under memguard's arena as
    the guard builds the real one, so its weights, optimizer state and
    queue count as they will."""
    model = MoCoV2(args)
    optimizer = torch.optim.SGD(model.encoder_q.parameters(), lr=args.lr, momentum=0.9)

    def step(batch: tuple[torch.Tensor, ...]) -> None:
        optimizer.zero_grad(set_to_none=True)
        model.loss(batch).loss.backward()
        optimizer.step()

    sample = make_batch(args, torch.Generator().manual_seed(args.seed))
    # the finder judges the bytes a step requests; the arena charges its
    # blocks, which round requests up by up to 25 %: a margin of 0.2 keeps
    # the size inside the budget
    return memguard.find_batch_size(step, sample, budget=args.tensor_budget, margin=0.2,
                                    queue_size=args.queue_size)


def find_batch(args: argparse.Namespace) -> dict[str, Any]:
    """Set ``args.batch`` and ``args.queue_size`` to what fits; what was found."""
    memguard.install(budget=args.tensor_budget)
    try:
        res = probe_batch_size(args)
    finally:
        memguard.uninstall()
    if res.size == 0:
        raise SystemExit(f"--find-batch: no batch fits --tensor-budget {args.tensor_budget}: "
                         f"{res.note}")
    print(f"find_batch_size: batch {res.size} (was {args.batch}), queue {res.queue_size} "
          f"(was {args.queue_size}), probes {[n for n, _ in res.probes]}")
    args.batch, args.queue_size = res.size, res.queue_size
    return {"size": res.size, "queue_size": res.queue_size, "probes": res.probes,
            "measured_peak_bytes": res.measured_peak_bytes}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    found = find_batch(args) if args.find_batch else None
    torch.manual_seed(args.seed)                       # initialisation
    gen = torch.Generator().manual_seed(args.seed)    # the data

    # v2: BatchNorm normalises each micro-batch on its own (as it does per
    # GPU in distributed MoCo), so micro-batches of one size keep the
    # statistics alike: divisor_of=batch allows only sizes that split the
    # batch evenly. As the batch divides the queue, so does every
    # micro-batch: enqueuing per micro-batch would stay aligned too.
    # v3: GroupNorm, any split computes the same loss; no constraint.
    divisor = args.batch if args.variant == "v2" else None
    # The process's budget is live ("auto": what it can have now, re-derived
    # at every step boundary); the tensors get what memguard's allocator may
    # hold, --tensor-budget, within it. At this toy scale the interpreter
    # and torch are most of the process, so a budget for the tensors alone
    # is what makes the throttle act.
    guard = memguard.Guard(budget=args.budget, tensor_budget=args.tensor_budget,
                           min_micro_batch=args.min_micro_batch, divisor_of=divisor,
                           telemetry=args.telemetry)
    effective: list[int] = []
    micro_batches: list[int] = []
    queue_ptrs: list[int] = []
    counts = {"enqueued": 0, "momentum_updates": 0}
    events: list[str] = []
    error = None
    t0 = time.perf_counter()
    with guard:
        # built under the guard: the arena's room holds the weights, the
        # optimizer state and the queue too, as a GPU's memory would
        if args.variant == "v2":
            model: nn.Module = MoCoV2(args)
            params = list(model.encoder_q.parameters())
            optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
        else:
            model = MoCoV3(args)
            params = list(model.base.parameters()) + list(model.predictor.parameters())
            optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda i: 0.5 * (1 + math.cos(math.pi * i / args.steps)))

        def post_step_v2(keys: torch.Tensor) -> None:
            # once per optimizer step, with the keys of the whole batch. The
            # key encoder moves after the query encoder's step, so the next
            # step's keys come from the updated one, as in MoCo's forward.
            effective.append(len(keys))
            momentum_update(model.encoder_k, model.encoder_q, args.momentum)
            counts["momentum_updates"] += 1
            queue_ptrs.append(model.enqueue(keys))
            counts["enqueued"] += len(keys)

        def post_step_v3(emb: dict[str, torch.Tensor]) -> None:
            effective.append(len(emb["q1"]))
            # MoCo v3's schedule: momentum from its base value to 1 on a cosine
            m = 1 - (1 - args.momentum) * 0.5 * (1 + math.cos(math.pi * len(effective)
                                                             / args.steps))
            momentum_update(model.momentum, model.base, m)
            counts["momentum_updates"] += 1

        for step in range(args.steps):
            batch = make_batch(args, gen)
            try:
                if args.variant == "v2":
                    # BatchNorm updates running statistics in forward: a
                    # step redone after an out-of-memory error puts them back
                    res = guard.step(batch, model.loss, optimizer, post_step=post_step_v2,
                                     restore=[model.encoder_q, model.encoder_k])
                else:
                    # embed_fn runs twice per micro-batch (without, then with
                    # a graph); the momentum keys are recomputed in the second
                    # pass, the price of keeping them beside the queries
                    res = guard.step(batch, model.loss, optimizer, post_step=post_step_v3,
                                     embed_fn=model.embed)
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
            ptr = f"  queue pointer {queue_ptrs[-1]:4d}" if queue_ptrs else ""
            print(f"step {step:3d}  loss {res.loss:.4f}  micro-batch {res.micro_batch:3d} "
                  f"x {res.n_micro}  peak {res.peak_bytes / 2**20:5.1f} MiB{ptr}", flush=True)
            del batch, res
        tensor_budget = memguard.stats()["budget_bytes"]   # the arena's room
    wall = time.perf_counter() - t0
    rss = memguard.sample().rss_bytes or 0

    s = guard.summary()
    v2 = args.variant == "v2"
    summary: dict[str, Any] = {
        "example": "moco_queue",
        "variant": args.variant,
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
        "effective_batch": args.batch,
        "divisor_of": divisor,
        "queue_size": args.queue_size if v2 else None,
        "found": found,
        "queue_ptrs": queue_ptrs,
        "enqueued": counts["enqueued"],
        "momentum_updates": counts["momentum_updates"],
        "error": error,
    }
    print(f"\nMoCo {args.variant}: steps {summary['steps_done']}/{args.steps}, effective batch "
          f"{sorted(set(effective))}, micro-batches {sorted(set(micro_batches), reverse=True)}")
    print(f"micro-batch changes {summary['micro_batch_changes']} "
          f"({'; '.join(events) or 'none'}), "
          f"out-of-memory errors recovered {summary['ooms_recovered']}")
    if v2:
        print(f"queue {args.queue_size} keys: {counts['enqueued']} enqueued, pointer always a "
              f"multiple of {args.batch}: {all(p % args.batch == 0 for p in queue_ptrs)}")
    print(f"tensor peak {guard.peak_bytes / 2**20:.1f} MiB of the arena's "
          f"{tensor_budget / 2**20:.1f} MiB, in a process budget of "
          f"{guard.budget_bytes / 2**20:.1f} MiB (the process holds {rss / 2**20:.1f} MiB now)")
    print(f"key encoder updated {counts['momentum_updates']} times; wall {wall:.1f} s")
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if error is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
