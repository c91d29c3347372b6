"""CPU allocator benchmark: a training step's time, page faults and peak RSS
under plain glibc, hand-tuned glibc, jemalloc preloaded alone, memguard's
preload shim (`memguard run`) and memguard in-process (`memguard.install()`).

Every configuration runs in its own process (the allocator is chosen at
process start); repetitions are interleaved across configurations and the
medians reported, with ratios against plain glibc measured in the same run.

Workloads: a ViT-S encoder (dim 384, depth 12, 6 heads, 16 px patches of
224 px images, or --image N) at batch 8 and 32, and a DINO-like multi-crop
step (batch 8: 2 global crops at the image size and 6 local ones at 96 px
through the same encoder), 2 threads each.

    python benchmarks/bench_cpu_allocator.py [--quick] [--reps N] [--steps N] [--image N]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

from memguard import run as mrun

CONFIGS = ["glibc", "glibc-tuned", "jemalloc", "memguard-preload", "memguard-inprocess"]
WORKLOADS = ["vit-b8", "vit-b32", "dino-multicrop"]


def config_env(name: str) -> dict | None:
    """The environment of a configuration, or None where it cannot run here."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MEMGUARD_", "MALLOC_", "LD_PRELOAD"))}
    env["OMP_NUM_THREADS"] = "2"
    je = mrun.find_jemalloc()
    if name == "glibc-tuned":
        # the usual hand tuning: keep big blocks on the heap and never trim it
        env["MALLOC_MMAP_THRESHOLD_"] = str(32 << 20)
        env["MALLOC_TRIM_THRESHOLD_"] = str(1 << 40)
        env["MALLOC_TOP_PAD_"] = str(64 << 20)
    elif name == "jemalloc":
        if not je:
            return None
        env["LD_PRELOAD"] = je
    elif name == "memguard-preload":
        env = mrun.preload_env(jemalloc=True, env=env)
    return env


# ---------------------------------------------------------------- the worker
def worker(config: str, workload: str, steps: int, image: int) -> dict:
    """Run one workload in this process; return its figures."""
    import torch

    if config == "memguard-inprocess":
        import memguard

        memguard.install()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    dim, depth, heads = 384, 12, 6

    class ViT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = torch.nn.Conv2d(3, dim, 16, 16)
            self.cls = torch.nn.Parameter(torch.zeros(1, 1, dim))
            layer = torch.nn.TransformerEncoderLayer(dim, heads, dim * 4, dropout=0.0,
                                                     activation="gelu", batch_first=True,
                                                     norm_first=True)
            self.blocks = torch.nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
            self.head = torch.nn.Linear(dim, 256)

        def forward(self, x):
            x = self.patch(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
            return self.head(self.blocks(x)[:, 0])

    model = ViT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if workload == "dino-multicrop":
        crops = [torch.randn(8, 3, image, image) for _ in range(2)] + \
                [torch.randn(8, 3, 96, 96) for _ in range(6)]
    else:
        crops = [torch.randn(8 if workload == "vit-b8" else 32, 3, image, image)]

    def step():
        out = [model(c) for c in crops]
        loss = sum(o.float().pow(2).mean() for o in out)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(2):
        step()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"step_s": statistics.median(times), "faults_per_step": (r1.ru_minflt - r0.ru_minflt)
            / steps, "peak_rss_bytes": r1.ru_maxrss * 1024}


# ---------------------------------------------------------------- the driver
def run_one(config: str, workload: str, steps: int, image: int) -> dict | None:
    env = config_env(config)
    if env is None:
        return None
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, __file__, "--worker", config, workload, str(steps),
                          str(image)],
                         env=env, capture_output=True, text=True, timeout=900, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{config}/{workload} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", nargs=4, metavar=("CONFIG", "WORKLOAD", "STEPS", "IMAGE"),
                   help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="1 repetition, 3 steps, 112 px")
    p.add_argument("--image", type=int, default=224, help="image size in px (=224)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    if args.worker:
        c, w, n, img = args.worker
        print(json.dumps(worker(c, w, int(n), int(img))))
        return 0
    reps, steps = (1, 3) if args.quick else (args.reps, args.steps)
    image = 112 if args.quick else args.image
    t_start = time.monotonic()
    results: dict = {w: {c: [] for c in CONFIGS} for w in WORKLOADS}
    for rep in range(reps):
        for w in WORKLOADS:
            # rotate the order each repetition so no configuration always goes first
            order = CONFIGS[rep % len(CONFIGS):] + CONFIGS[:rep % len(CONFIGS)]
            for c in order:
                r = run_one(c, w, steps, image)
                if r is not None:
                    results[w][c].append(r)
    print(f"memguard CPU allocator benchmark: {os.cpu_count()} CPUs, 2 threads, {image} px, "
          f"{reps} repetition(s) x {steps} steps, medians; ratios against plain glibc\n")
    summary = {}
    hdr = (f"  {'configuration':<20}{'step s':>9}{'ratio':>8}{'faults/step':>13}"
           f"{'ratio':>9}{'peak RSS MiB':>14}{'ratio':>8}")
    for w in WORKLOADS:
        print(f"{w}\n{hdr}")
        base = results[w]["glibc"]
        b_t = statistics.median(r["step_s"] for r in base)
        b_f = statistics.median(r["faults_per_step"] for r in base)
        b_m = statistics.median(r["peak_rss_bytes"] for r in base)
        summary[w] = {}
        for c in CONFIGS:
            rs = results[w][c]
            if not rs:
                print(f"  {c:<20}{'not available here':>40}")
                continue
            t = statistics.median(r["step_s"] for r in rs)
            f = statistics.median(r["faults_per_step"] for r in rs)
            m = statistics.median(r["peak_rss_bytes"] for r in rs)
            summary[w][c] = {"step_s": t, "step_ratio": t / b_t, "faults_per_step": f,
                             "faults_ratio": f / b_f if b_f else None,
                             "peak_rss_bytes": m, "peak_rss_ratio": m / b_m}
            fr = f"{f / b_f:.3f}" if b_f else "-"
            print(f"  {c:<20}{t:>9.3f}{t / b_t:>8.2f}{f:>13,.0f}{fr:>9}"
                  f"{m / 2**20:>14,.0f}{m / b_m:>8.2f}")
        print()
    print("targets for memguard-inprocess: step ratio <= 0.83, faults ratio <= 0.01, "
          "peak RSS ratio <= 1.00")
    for w in WORKLOADS:
        s = summary[w].get("memguard-inprocess")
        if s:
            ok = (s["step_ratio"] <= 0.83, (s["faults_ratio"] or 0) <= 0.01,
                  s["peak_rss_ratio"] <= 1.0)
            print(f"  {w:<16} step {'PASS' if ok[0] else 'OVER'}  faults "
                  f"{'PASS' if ok[1] else 'OVER'}  peak RSS {'PASS' if ok[2] else 'OVER'}")
    print(f"\n({time.monotonic() - t_start:.0f} s)")
    print("BENCH_JSON " + json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
