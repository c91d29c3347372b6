"""The batch throttle's costs and what it saves, measured side by side.

1. Overhead with no pressure: ``guard.step`` (the whole batch in one
   micro-batch) in a process with the guard installed as a user installs it
   (``Guard(budget="auto")``: sampler, gc hooks and arena running), against
   the same loop, model, batch and seeds without memguard in a process that
   never imports it; 2 threads each. pytest-benchmark times the guarded
   steps; each round is paired with a plain step just before or just after
   it (alternating), and the figure is the median of the paired ratios, so
   it holds what the guard costs around the step as well as in it. Target:
   at most 1.01 (a CPU step; on a GPU, bench_gpu_pressure's no-pressure
   scenario holds it to 1.02).
2. A constrained run: a small transformer trained on batches of 64 whose
   sequence length varies (16 tokens, every fourth batch 64), under a tensor
   budget of half what a full long batch needs (memguard's arena enforces
   it, as a GPU's memory would). The plain loop fails at the first long
   batch; ``accelerate.find_executable_batch_size`` restarts the training
   function with 0.9x the batch until one fits, losing the steps done before
   each restart and ending with a smaller effective batch; memguard finishes
   every step at batch 64. Each round is the whole run in a fresh process
   (pytest-benchmark times the run, not the start-up). Reported: steps
   completed, steps lost, effective batch, and throughput against an
   unconstrained run (memguard's: each round paired with an unconstrained
   run just before or after it, the median of the paired ratios; the
   others': against the unconstrained runs' median). Target for memguard:
   throughput at least 0.7.
3. The cost of a recovered out-of-memory error: a step that fails at the
   whole batch and is redone at half, against the normal step of that batch
   (the whole batch in one piece, with no budget, warm). Each round is
   paired with a normal step run just before or just after it (alternating),
   and the figure is the median of the paired ratios. Target: at most 1.5x.
   Also given against the same step done as 2 x 32 under the budget (a
   guard at micro-batch 32, no failure): the failed attempt's forward pass
   is lost work either way.

    pytest benchmarks/bench_throttle.py --benchmark-only
    python benchmarks/bench_throttle.py [pytest options]   (the same)
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

import pytest

from benchlib import (
    Figures,
    Worker,
    fmt,
    median,
    paired_median,
    pedantic_paired,
    ratio,
    serve,
    verdict,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

BATCH = 64
DIM, HEADS, FF, DEPTH, CLASSES = 256, 4, 1024, 4, 10
SHORT, LONG = 16, 64
SECTION = "throttle"
TARGETS = {"overhead": 1.01, "constrained_throughput": 0.7, "oom_cost": 1.5}
MODES = ["unconstrained", "plain", "accelerate", "memguard"]

#: rounds of each part: (overhead steps, constrained steps, constrained runs,
#: OOM rounds, overhead warm-up steps); the full run and --bench-quick.
FULL = (40, 16, 3, 7, 2)
QUICK = (2, 4, 1, 1, 0)


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
    memguard.memory.arena.reset_peaks()
    plain_step(batch, net, opt, loss_fn)
    return memguard.stats()["allocated_bytes.peak"]


def _timed(fn, *args) -> dict:
    t0 = time.perf_counter()
    fn(*args)
    return {"s": time.perf_counter() - t0}


def overhead_batch():
    """The no-pressure step's batch (seq 32), the same in every process."""
    import torch
    g = torch.Generator().manual_seed(2)
    return (torch.randn(BATCH, 32, DIM, generator=g),
            torch.randint(0, CLASSES, (BATCH,), generator=g))


# ------------------------------------------------------------------ workers
def serve_plain_loop(warmup: int) -> dict:
    """The plain loop in a process of its own, with memguard never imported
    (no sampler, no gc hooks, no arena: what a run without memguard is)."""
    net, opt, loss_fn = build()
    batch = overhead_batch()
    for _ in range(warmup):
        plain_step(batch, net, opt, loss_fn)
    if "memguard" in sys.modules:
        raise RuntimeError("the plain loop's process imported memguard")
    return {"step": lambda: _timed(plain_step, batch, net, opt, loss_fn)}


def serve_guarded_loop(warmup: int) -> dict:
    """The same loop through ``guard.step`` in a process of its own, with the
    guard installed as a user installs it: ``Guard(budget="auto")``, so the
    sampler, the gc hooks and the arena are all there."""
    import memguard
    _, opt, loss_fn = build()
    batch = overhead_batch()
    guard = memguard.Guard(budget="auto").install()
    for _ in range(warmup):
        guard.step(batch, loss_fn, opt)
    return {"step": lambda: _timed(guard.step, batch, loss_fn, opt)}


def serve_constrained(mode: str, steps: int) -> dict:
    import memguard
    memguard.install()
    budget = full_long_peak() // 2 if mode != "unconstrained" else 0
    net, opt, loss_fn = build()
    data = dataset(steps)

    def run() -> dict:
        memguard.memory.arena.set_budget(budget or None)
        memguard.memory.arena.reset_peaks()
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

    return {"run": run}


def serve_oom() -> dict:
    import torch

    import memguard
    memguard.install()
    peak = full_long_peak()
    net, opt, loss_fn = build()
    batch = (torch.randn(BATCH, LONG, DIM), torch.randint(0, CLASSES, (BATCH,)))
    budget = int(peak * 0.8)                        # the whole batch fails, half fits

    last = {"step": None}

    def whole() -> dict:
        memguard.memory.arena.set_budget(None)
        if last["step"] != "whole":     # a normal step is a warm one: warm up first
            plain_step(batch, net, opt, loss_fn)
        last["step"] = "whole"
        return _timed(plain_step, batch, net, opt, loss_fn)

    def half() -> dict:
        memguard.memory.arena.set_budget(budget)
        last["step"] = "half"
        g = memguard.Guard(budget=None, micro_batch=BATCH // 2, allocator=False)
        return _timed(g.step, batch, loss_fn, opt)

    def recovered() -> dict:
        memguard.memory.arena.set_budget(budget)
        last["step"] = "recovered"
        g = memguard.Guard(budget=None, allocator=False)     # starts at the whole batch
        t = time.perf_counter()
        r = g.step(batch, loss_fn, opt)
        t = time.perf_counter() - t
        if r.retries != 1 or r.micro_batch != BATCH // 2:
            raise RuntimeError(f"expected one retry at {BATCH // 2}, got {r}")
        return {"s": t, "relief_s": g.gc.stats.relief_seconds}

    return {"whole": whole, "half": half, "recovered": recovered}


SERVERS = {"plain_loop": serve_plain_loop, "guarded_loop": serve_guarded_loop,
           "constrained": serve_constrained, "oom": serve_oom}


def _setup(kind: str, *args):
    def build_worker() -> dict:
        import torch
        torch.set_num_threads(2)
        return SERVERS[kind](*[int(a) if a.isdigit() else a for a in args])
    return build_worker


def _worker(kind: str, *args, wait: bool = True) -> Worker:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env.pop("LD_PRELOAD", None)
    return Worker(__file__, [kind, *map(str, args)], env=env, wait=wait)


def _section(figures: Figures) -> None:
    figures.section(SECTION, f"batch throttle: transformer {DEPTH}x{DIM}, batch {BATCH}, "
                    "2 threads", summarize)


# --------------------------------------------------------------- benchmarks
@pytest.fixture(scope="module")
def rounds(quick: bool) -> tuple:
    return QUICK if quick else FULL


@pytest.fixture
def loop_workers(rounds: tuple):
    """The plain loop's process and the guarded loop's, started (and ended)
    side by side; gone before the next test."""
    with contextlib.ExitStack() as stack:
        ws = [stack.enter_context(_worker(k, rounds[4], wait=False))
              for k in ("plain_loop", "guarded_loop")]
        for w in ws:
            w.wait_ready()
        yield ws
        for w in ws:
            w.end()


def test_overhead(benchmark, figures: Figures, rounds: tuple, loop_workers: list) -> None:
    """A step at seq 32 with no pressure: guard.step in the guarded process,
    each round paired with a plain step in the plain process just before or
    just after it (alternating)."""
    _section(figures)
    plain, guarded = loop_workers
    benchmark.group = "throttle: step with no pressure (seq 32)"
    own, base = pedantic_paired(benchmark, lambda: guarded.call("step")["s"],
                                lambda: plain.call("step")["s"], rounds[0])
    fig = {"part": "overhead", "step_s": median(own), "plain_step_s": median(base)}
    fig["paired_ratios"], fig["ratio"] = paired_median(own, base)
    benchmark.extra_info.update(step_s=fig["step_s"], ratio_to_plain=fig["ratio"])
    figures.record(SECTION, benchmark.fullname, fig)


@pytest.mark.parametrize("mode", MODES)
def test_constrained(benchmark, figures: Figures, rounds: tuple, mode: str) -> None:
    """The whole constrained run, a fresh worker process each round; each
    round of memguard is paired with an unconstrained run just before or
    just after it (alternating)."""
    _section(figures)
    steps, n = rounds[1], rounds[2]
    runs: list[dict] = []

    def unconstrained() -> float:
        with _worker("constrained", "unconstrained", steps) as w:
            r = w.call("run")
        return r["samples"] / r["seconds"]

    def setup():
        return (_worker("constrained", mode, steps),), {}

    def teardown(w: Worker) -> None:
        w.close()

    benchmark.group = f"throttle: constrained run of {steps} steps"
    if mode == "memguard":
        runs, base = pedantic_paired(benchmark, lambda w: w.call("run"), unconstrained, n,
                                     setup=setup, teardown=teardown)
    else:
        base = []
        benchmark.pedantic(lambda w: runs.append(w.call("run")), setup=setup,
                           teardown=teardown, rounds=n)
    last = runs[-1]
    fig = dict(last, part="constrained",
               throughput=median(r["samples"] / r["seconds"] for r in runs
                                 if r["failed"] is None))
    if base and all(r["failed"] is None for r in runs):
        fig["paired_ratios"], fig["ratio"] = paired_median(
            [r["samples"] / r["seconds"] for r in runs], base)
        benchmark.extra_info.update(throughput_ratio=fig["ratio"])
    benchmark.extra_info.update({k: last.get(k) for k in (
        "steps_done", "steps_lost", "restarts", "batch", "failed", "peak_bytes",
        "budget_bytes")})
    figures.record(SECTION, benchmark.fullname, fig)


@pytest.fixture(scope="module")
def oom_worker():
    with _worker("oom") as w:
        yield w


@pytest.mark.parametrize("step", ["whole", "half", "recovered"])
def test_oom_step(benchmark, figures: Figures, rounds: tuple, oom_worker: Worker,
                  step: str) -> None:
    """Seq 64: the whole batch (no budget), 2 x 32 under the budget, and a step
    that fails at 64 under the budget and is redone at 32, each round of it
    paired with a (warm) whole-batch step, alternately before and after."""
    _section(figures)
    out: list[dict] = []
    paired: list[float] = []
    benchmark.group = "throttle: recovered out-of-memory step (seq 64)"
    if step != "recovered":
        benchmark.pedantic(lambda: out.append(oom_worker.call(step)), rounds=rounds[3],
                           warmup_rounds=1)
    else:
        oom_worker.call(step)           # one unpaired warm-up round
        out, paired = pedantic_paired(benchmark, lambda: oom_worker.call(step),
                                      lambda: oom_worker.call("whole")["s"], rounds[3])
    fig = {"part": "oom", "step": step, "step_s": median(o["s"] for o in out),
           "relief_s": median(o.get("relief_s") for o in out)}
    if paired:
        fig["paired_ratios"], fig["ratio"] = paired_median([o["s"] for o in out], paired)
        benchmark.extra_info.update(ratio_to_whole=fig["ratio"])
    benchmark.extra_info.update(step_s=fig["step_s"])
    figures.record(SECTION, benchmark.fullname, fig)


# ------------------------------------------------------------------ summary
def summarize(records: list[dict]) -> tuple[list[str], dict, dict]:
    lines: list[str] = []
    data: dict = {"targets": TARGETS}
    per_test: dict[str, dict] = {}
    g = next((r for r in records if r["part"] == "overhead"), None)
    if g is not None:
        v = verdict(g["ratio"], TARGETS["overhead"])
        data["overhead"] = {"ratio": g["ratio"], "paired_ratios": g["paired_ratios"],
                            "guard_step_s": g["step_s"], "plain_step_s": g["plain_step_s"],
                            "verdict": v}
        per_test[g["nodeid"]] = {"ratio": g["ratio"], "verdict": v}
        lines.append("1. overhead with no pressure (seq 32): guard.step in a guarded process "
                     "/ plain step in a process without memguard, paired")
        lines.append("   rounds " + ", ".join(f"{x:.3f}" for x in g["paired_ratios"]))
        lines.append(f"   median {g['ratio']:.3f}  (target <= {TARGETS['overhead']})  {v};  "
                     f"steps {g['step_s'] * 1e3:.0f} ms guarded, {g['plain_step_s'] * 1e3:.0f} ms "
                     "plain (medians)")
        lines.append("")
    runs = {r["mode"]: r for r in records if r["part"] == "constrained"}
    if runs:
        base = runs.get("unconstrained", {}).get("throughput")
        any_run = next(iter(runs.values()))
        budget = max(r["budget_bytes"] for r in runs.values())
        lines.append(f"2. constrained run: {any_run['steps_planned']} steps of {BATCH}, seq "
                     f"{SHORT} (every 4th {LONG}), budget {budget / 2**20:.0f} MiB = half a "
                     "full long step's peak")
        lines.append(f"   {'':14}{'done':>6}{'lost':>6}{'restarts':>9}{'batch':>7}"
                     f"{'throughput':>12}{'peak MiB':>10}  note")
        data["constrained"] = {}
        for m in MODES:
            r = runs.get(m)
            if r is None:
                continue
            thr = r.get("ratio", ratio(r["throughput"], base)) if r["failed"] is None else None
            note = r["failed"] or (f"micro-batches {r['micro_batches']}, "
                                   f"{r['ooms_recovered']} OOMs recovered"
                                   if m == "memguard" else "")
            data["constrained"][m] = {k: r.get(k) for k in (
                "steps_planned", "steps_done", "steps_lost", "restarts", "batch", "failed",
                "peak_bytes", "budget_bytes", "micro_batches", "ooms_recovered",
                "paired_ratios")} | {"throughput_ratio": thr}
            per_test[r["nodeid"]] = {"throughput_ratio": thr, "baseline": "unconstrained"}
            shown = f"{thr:>11.2f}x" if thr is not None else f"{'-':>12}"
            lines.append(f"   {m:14}{r['steps_done']:>6}{r['steps_lost']:>6}{r['restarts']:>9}"
                         f"{r['batch']:>7}{shown}{r['peak_bytes'] / 2**20:>10.0f}  {note}")
        mg = data["constrained"].get("memguard", {}).get("throughput_ratio")
        v = verdict(mg, TARGETS["constrained_throughput"], higher_is_better=True)
        data["constrained"]["verdict"] = v
        pr = data["constrained"].get("memguard", {}).get("paired_ratios")
        lines.append(f"   memguard throughput {fmt(mg)}x unconstrained "
                     f"(target >= {TARGETS['constrained_throughput']})  {v}" +
                     (";  paired rounds " + ", ".join(f"{x:.2f}" for x in pr) if pr else ""))
        lines.append("")
    oom = {r["step"]: r for r in records if r["part"] == "oom"}
    if "recovered" in oom:
        rec = oom["recovered"]
        whole = oom.get("whole", {}).get("step_s")
        half = oom.get("half", {}).get("step_s")
        cost = rec["ratio"]
        v = verdict(cost, TARGETS["oom_cost"])
        data["oom"] = {"whole_s": whole, "half_x2_s": half, "recovered_s": rec["step_s"],
                       "relief_s": rec["relief_s"], "cost_ratio": cost,
                       "paired_ratios": rec["paired_ratios"],
                       "over_half_x2": ratio(rec["step_s"], half), "verdict": v}
        per_test[rec["nodeid"]] = {"cost_ratio": cost, "baseline": "whole",
                                   "over_half_x2": ratio(rec["step_s"], half)}
        ms = lambda x: "-" if x is None else f"{x * 1e3:8.1f}"
        lines.append(f"3. recovered OOM (seq {LONG}): the whole batch fails under the budget "
                     f"and the step is redone at {BATCH // 2}; each round paired with a "
                     "whole-batch step")
        lines.append(f"   step of the whole batch (no budget) {ms(whole)} ms")
        lines.append(f"   step at {BATCH // 2} x 2 (under the budget) {ms(half)} ms")
        lines.append(f"   recovered step                  {ms(rec['step_s'])} ms "
                     f"(relief {ms(rec['relief_s']).strip()} ms)")
        lines.append("   recovered / whole, rounds " +
                     ", ".join(f"{x:.2f}" for x in rec["paired_ratios"]))
        lines.append(f"   median {fmt(cost)}x  (target <= {TARGETS['oom_cost']})  {v};  "
                     f"recovered / step at {BATCH // 2} x 2 "
                     f"{fmt(ratio(rec['step_s'], half))}x")
    return lines, data, per_test


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        raise SystemExit(serve(_setup(*sys.argv[2:])))
    raise SystemExit(pytest.main([__file__, "--benchmark-only", *sys.argv[1:]]))
