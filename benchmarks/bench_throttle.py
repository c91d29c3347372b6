"""The batch throttle's costs and what it saves, measured side by side.

1. Overhead with no pressure: ``guard.step`` (guard installed: sampler and
   gc hooks running, the whole batch in one micro-batch) against a plain
   training loop, alternating in one process; median step-time ratio.
   Target: at most 1.02.
2. A constrained run: a small transformer trained on batches of 64 whose
   sequence length varies (16 tokens, every fourth batch 64), under a tensor
   budget of half what a full long batch needs (memguard's arena enforces
   it, as a GPU's memory would). The plain loop fails at the first long
   batch; ``accelerate.find_executable_batch_size`` restarts the training
   function with 0.9x the batch until one fits, losing the steps done before
   each restart and ending with a smaller effective batch; memguard finishes
   every step at batch 64. Reported: steps completed, steps lost, effective
   batch, and throughput against an unconstrained run. Target for memguard:
   throughput at least 0.7.
3. The cost of a recovered out-of-memory error: a step that fails at the
   whole batch and is redone at half, against the normal step of that
   batch (the whole batch in one piece, timed before the budget is set).
   Target: at most 1.5x. Also printed against a normal step at half size:
   the failed attempt's forward pass is lost work either way.

Each part's configurations run in fresh processes (the arena and its budget
are process-wide), interleaved over repetitions; medians are reported.

    python benchmarks/bench_throttle.py [--quick] [--reps N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

BATCH = 64
DIM, HEADS, FF, DEPTH, CLASSES = 256, 4, 1024, 4, 10
SHORT, LONG = 16, 64


# ---------------------------------------------------------------- workload
def build(seed: int = 0):
    import torch
    torch.manual_seed(seed)
    enc = torch.nn.Sequential(*[
        torch.nn.TransformerEncoderLayer(DIM, HEADS, FF, dropout=0.0, batch_first=True)
        for _ in range(DEPTH)])
    net = torch.nn.ModuleDict({"enc": enc, "head": torch.nn.Linear(DIM, CLASSES)})
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def loss_fn(b):
        x, y = b
        return torch.nn.functional.cross_entropy(net["head"](net["enc"](x).mean(1)), y)

    return net, opt, loss_fn


def dataset(steps: int, seed: int = 1) -> list:
    """Samples for ``steps`` batches of BATCH: every fourth batch long."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, LONG if i % 4 == 3 else SHORT, DIM, generator=g),
             torch.randint(0, CLASSES, (BATCH,), generator=g)) for i in range(steps)]


def rebatch(data: list, size: int) -> list:
    """The same samples in order as batches of at most ``size`` (a loader
    rebuilt at that batch size over length buckets: lengths never mix)."""
    return [(x[s:s + size], y[s:s + size]) for x, y in data for s in range(0, BATCH, size)]


def plain_step(batch, net, opt, loss_fn) -> None:
    opt.zero_grad(set_to_none=True)
    loss_fn(batch).backward()
    opt.step()


def full_long_peak() -> int:
    """Peak tensor bytes of one plain step on a full long batch (arena)."""
    import torch

    import memguard
    net, opt, loss_fn = build()
    batch = (torch.randn(BATCH, LONG, DIM), torch.randint(0, CLASSES, (BATCH,)))
    plain_step(batch, net, opt, loss_fn)        # optimizer state exists from here on
    memguard.allocator.reset_peaks()
    plain_step(batch, net, opt, loss_fn)
    return memguard.stats()["allocated_bytes.peak"]


# ------------------------------------------------------------------ workers
def work_overhead(steps: int) -> dict:
    import torch

    import memguard
    net, opt, loss_fn = build()
    batch = (torch.randn(BATCH, 32, DIM), torch.randint(0, CLASSES, (BATCH,)))
    guard = memguard.Guard(budget="auto", allocator=False).install()
    for _ in range(2):                               # warm up both
        plain_step(batch, net, opt, loss_fn)
        guard.step(batch, loss_fn, opt)
    ratios = []
    for i in range(steps):
        # ABBA order, so neither side always runs after the other
        order = (False, True) if i % 2 == 0 else (True, False)
        t = {}
        for use_guard in order:
            t0 = time.perf_counter()
            if use_guard:
                guard.step(batch, loss_fn, opt)
            else:
                plain_step(batch, net, opt, loss_fn)
            t[use_guard] = time.perf_counter() - t0
        ratios.append(t[True] / t[False])
    guard.uninstall()
    return {"ratio": statistics.median(ratios)}


def work_constrained(mode: str, steps: int) -> dict:

    import memguard
    memguard.install()
    budget = full_long_peak() // 2 if mode != "unconstrained" else 0
    net, opt, loss_fn = build()
    data = dataset(steps)
    memguard.allocator.set_budget(budget or None)
    res = {"mode": mode, "budget_bytes": budget, "steps_planned": steps, "steps_done": 0,
           "steps_lost": 0, "restarts": 0, "batch": BATCH, "samples": 0, "failed": None,
           "seconds": 1.0, "peak_bytes": 0}
    t0 = time.perf_counter()
    if mode in ("unconstrained", "plain"):
        try:
            for batch in data:
                plain_step(batch, net, opt, loss_fn)
                res["steps_done"] += 1
                res["samples"] += BATCH
        except RuntimeError as exc:
            if not memguard.is_oom(exc):
                raise
            res["failed"] = f"out of memory at step {res['steps_done']}"
    elif mode == "accelerate":
        try:
            from accelerate.utils import find_executable_batch_size
        except ImportError:
            res["failed"] = "accelerate is not installed"
            return res

        progress = {"done": 0}

        @find_executable_batch_size(starting_batch_size=BATCH)
        def train(batch_size: int) -> int:
            if progress["done"]:
                res["steps_lost"] += progress["done"]
                res["restarts"] += 1
            progress["done"] = 0
            res["batch"] = batch_size
            for batch in rebatch(data, batch_size):   # the loader rebuilt at the new size
                plain_step(batch, net, opt, loss_fn)
                progress["done"] += 1
            return progress["done"]

        try:
            res["steps_done"] = train()
        except RuntimeError as exc:
            res["failed"] = str(exc)[:120]
        res["samples"] = steps * BATCH if res["failed"] is None else 0
    elif mode == "memguard":
        # the arena holds the budget (as a GPU would); the guard plans against it
        guard = memguard.Guard(budget=None, allocator=False).install()
        sizes = set()
        for batch in data:
            r = guard.step(batch, loss_fn, opt)
            sizes.add(r.micro_batch)
            res["steps_done"] += 1
            res["samples"] += BATCH
        res["micro_batches"] = sorted(sizes)
        res["ooms_recovered"] = guard.ooms_recovered
        guard.uninstall()
    res["seconds"] = time.perf_counter() - t0
    res["peak_bytes"] = memguard.stats()["allocated_bytes.peak"]
    return res


def work_oom_cost(reps: int) -> dict:
    import torch

    import memguard
    memguard.install()
    peak = full_long_peak()
    net, opt, loss_fn = build()
    batch = (torch.randn(BATCH, LONG, DIM), torch.randint(0, CLASSES, (BATCH,)))
    full = []
    for _ in range(reps + 1):                          # the whole batch, no budget yet
        t = time.perf_counter()
        plain_step(batch, net, opt, loss_fn)
        full.append(time.perf_counter() - t)
    memguard.allocator.set_budget(int(peak * 0.8))   # the whole batch fails, half fits
    normal, recovered = [], []
    for _ in range(reps + 1):
        g = memguard.Guard(budget=None, micro_batch=BATCH // 2, allocator=False)
        t = time.perf_counter()
        g.step(batch, loss_fn, opt)
        normal.append(time.perf_counter() - t)
        g = memguard.Guard(budget=None, allocator=False)     # starts at the whole batch
        t = time.perf_counter()
        r = g.step(batch, loss_fn, opt)
        recovered.append(time.perf_counter() - t)
        assert r.retries == 1 and r.micro_batch == BATCH // 2, r
    return {"full_s": statistics.median(full[1:]), "normal_s": statistics.median(normal[1:]),
            "recovered_s": statistics.median(recovered[1:]),
            "relief_s": g.gc.stats.relief_seconds}


WORKERS = {"overhead": work_overhead, "constrained": work_constrained, "oom": work_oom_cost}


def spawn(kind: str, *args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env.pop("LD_PRELOAD", None)
    out = subprocess.run([sys.executable, __file__, "--worker", kind, *map(str, args)],
                         env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"worker {kind} {args} failed:\n{out.stdout}{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16, help="steps of the constrained run")
    ap.add_argument("--quick", action="store_true", help="1 repetition, short runs")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        import torch
        torch.set_num_threads(2)
        kind, *args = a.worker
        fn = WORKERS[kind]
        print(json.dumps(fn(*[x if not x.isdigit() else int(x) for x in args])))
        return
    reps, steps = (1, 8) if a.quick else (a.reps, a.steps)
    ov_steps = 6 if a.quick else 20

    print(f"bench_throttle: transformer {DEPTH}x{DIM}, batch {BATCH}, 2 threads, "
          f"{reps} repetition(s)\n")
    overhead, runs, oom = [], {m: [] for m in
                               ("unconstrained", "plain", "accelerate", "memguard")}, []
    for _ in range(reps):
        overhead.append(spawn("overhead", ov_steps))
        for m, results in runs.items():
            results.append(spawn("constrained", m, steps))
        oom.append(spawn("oom", 3 if a.quick else 5))

    ratio = statistics.median(o["ratio"] for o in overhead)
    print("1. overhead with no pressure (seq 32): guard.step / plain step, paired")
    each = ", ".join(f"{o['ratio']:.3f}" for o in overhead)
    print(f"   per repetition {each}   "
          f"median {ratio:.3f}  (target <= 1.02)\n")

    base = statistics.median(r["samples"] / r["seconds"] for r in runs["unconstrained"])
    budget = runs["memguard"][0]["budget_bytes"]
    print(f"2. constrained run: {steps} steps of {BATCH}, seq {SHORT} (every 4th {LONG}), "
          f"budget {budget / 2**20:.0f} MiB = half a full long step's peak")
    print(f"   {'':14}{'done':>6}{'lost':>6}{'restarts':>9}{'batch':>7}"
          f"{'throughput':>12}{'peak MiB':>10}  note")
    for m, rs in runs.items():
        r = rs[-1]
        thr = statistics.median(x["samples"] / x["seconds"] for x in rs) / base
        shown = f"{thr:>11.2f}x" if r["failed"] is None else f"{'-':>12}"
        note = r["failed"] or (f"micro-batches {r['micro_batches']}, "
                               f"{r['ooms_recovered']} OOMs recovered" if m == "memguard" else "")
        print(f"   {m:14}{r['steps_done']:>6}{r['steps_lost']:>6}{r['restarts']:>9}"
              f"{r['batch']:>7}{shown}{r['peak_bytes'] / 2**20:>10.0f}  {note}")
    mg = statistics.median(x["samples"] / x["seconds"] for x in runs["memguard"]) / base
    print(f"   memguard throughput {mg:.2f}x unconstrained (target >= 0.7)\n")

    cost = statistics.median(o["recovered_s"] / o["full_s"] for o in oom)
    half = statistics.median(o["recovered_s"] / o["normal_s"] for o in oom)
    ms = {k: statistics.median(o[k] for o in oom) * 1e3
          for k in ("full_s", "normal_s", "recovered_s", "relief_s")}
    print(f"3. recovered OOM (seq {LONG}): the whole batch fails under the budget and the "
          f"step is redone at {BATCH // 2}")
    print(f"   step of the whole batch (no budget) {ms['full_s']:8.1f} ms")
    print(f"   step at {BATCH // 2} x 2 (under the budget) {ms['normal_s']:8.1f} ms")
    print(f"   recovered step                  {ms['recovered_s']:8.1f} ms "
          f"(relief {ms['relief_s']:.1f} ms)")
    print(f"   recovered / whole-batch step {cost:.2f}x  (target <= 1.5);  "
          f"recovered / step at {BATCH // 2} x 2 {half:.2f}x")


if __name__ == "__main__":
    main()
