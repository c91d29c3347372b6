"""``memguard demo``: a short CPU training run with live memory telemetry.

A small ViT-like model trains on synthetic images while the sampler runs at
50 ms under a budget. Every few epochs a validation pass keeps its
predictions attached to the autograd graph, the mistake behind many runs that
swap during validation: memory climbs, the pressure level rises with it, and
it falls back after the pass ends and the graph is freed. The run writes
every sample and event to a JSONL file and ends with a summary.
"""
from __future__ import annotations

import argparse
import gc
import os
import time

from memguard.budget import parse_budget
from memguard.cli import format_line
from memguard.telemetry import JsonlExporter, Level, PressureEvent, Sample, Sampler


def _model(torch, dim: int, depth: int, classes: int):
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=dim * 4, batch_first=True)
    return nn.Sequential(
        nn.Conv2d(3, dim, kernel_size=8, stride=8),  # 32x32 -> 4x4 patches
        nn.Flatten(2),
        Transpose(torch),
        nn.TransformerEncoder(layer, num_layers=depth, enable_nested_tensor=False),
        Mean(torch),
        nn.Linear(dim, classes),
    )


def Transpose(torch):
    class _T(torch.nn.Module):
        def forward(self, x):
            return x.transpose(1, 2)

    return _T()


def Mean(torch):
    class _M(torch.nn.Module):
        def forward(self, x):
            return x.mean(dim=1)

    return _M()


def _malloc_trim() -> bool:
    """Give glibc's free heap pages back to the system; False where there is no glibc."""
    import ctypes

    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 on success."""
    p = argparse.ArgumentParser(prog="memguard demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=20, help="training time (=20)")
    p.add_argument("--out", default="out/demo-telemetry.jsonl", help="JSONL telemetry file")
    p.add_argument("--budget", default=None,
                   help="budget; default: resident memory after warm-up + 768 MiB")
    p.add_argument("--interval", type=float, default=50, help="sampling period in ms (=50)")
    p.add_argument("--validate-every", type=int, default=3,
                   help="epochs (20 steps each) between validation passes (=3)")
    args = p.parse_args(argv)

    import torch

    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model = _model(torch, dim=128, depth=4, classes=10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x_all = torch.randn(512, 3, 32, 32)
    y_all = torch.randint(0, 10, (512,))

    def train_step(i: int) -> float:
        idx = torch.randint(0, 512, (32,))
        loss = torch.nn.functional.cross_entropy(model(x_all[idx]), y_all[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())

    train_step(0)  # warm-up: allocator caches, lazy init
    gc.collect()

    probe = Sampler(interval_ms=args.interval)
    base = probe.sample_now().rss_bytes or 0
    budget = parse_budget(args.budget) if args.budget else base + 768 * 2**20
    sampler = Sampler(interval_ms=args.interval, budget=budget)
    exporter = JsonlExporter(args.out, meta={"demo": "cpu-vit", "budget_bytes": budget})
    sampler.on_sample(exporter)
    last_print = [0.0]
    levels_seen = {Level.OK}

    def show(s: Sample) -> None:
        levels_seen.add(s.level)
        if s.t - last_print[0] >= 1.0:
            last_print[0] = s.t
            print(f"  [{s.seq:5d}] {format_line(s)}", flush=True)

    def on_pressure(ev: PressureEvent) -> None:
        print(f"  pressure {ev.old.name} -> {ev.new.name} "
              f"({', '.join(ev.sample.reasons) or 'calm'})", flush=True)
        exporter.event("pressure", old=ev.old.name, new=ev.new.name,
                       reasons=list(ev.sample.reasons))

    sampler.on_sample(show)
    sampler.on_pressure(on_pressure)
    print(f"memguard demo: budget {budget / 2**20:,.0f} MiB, sampling every "
          f"{args.interval:g} ms, telemetry -> {args.out}")
    sampler.start()
    t0 = time.monotonic()
    steps = 0
    epoch = 0
    try:
        while time.monotonic() - t0 < args.seconds:
            for _ in range(20):
                train_step(steps)
                steps += 1
            epoch += 1
            if epoch % max(1, args.validate_every) == 0:
                # validation that forgets no_grad() and keeps every output
                exporter.event("validation_start", epoch=epoch)
                kept = []
                for i in range(0, 512, 32):
                    kept.append(model(x_all[i:i + 32]))
                    kept.append(model(x_all[i:i + 32] * 0.5))
                    time.sleep(0.02)
                preds = torch.cat(kept).argmax(1)
                exporter.event("validation_end", epoch=epoch,
                               accuracy=float((preds[:512] == y_all).float().mean()))
                del kept, preds
                before = sampler.latest()
                gc.collect()
                trimmed = _malloc_trim()
                exporter.event("trim", malloc_trim=trimmed,
                               rss_before_bytes=before.rss_bytes if before else None)
    finally:
        sampler.stop()
        exporter.close()
    samples = len(sampler.history())
    peak = max((s.rss_peak_bytes or 0) for s in sampler.history())
    print(f"done: {steps} steps in {time.monotonic() - t0:.1f} s, {samples} samples, "
          f"peak RSS {peak / 2**20:,.0f} MiB of a {budget / 2**20:,.0f} MiB budget, "
          f"levels seen: {', '.join(lv.name for lv in sorted(levels_seen))}, "
          f"sampler CPU {sampler.cpu_seconds / max(time.monotonic() - t0, 1e-9):.3%} of a core")
    print(f"telemetry written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
