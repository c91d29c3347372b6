"""CUDA allocator benchmark: memguard's CUDA allocator against PyTorch's native
caching allocator on a ViT-like training step, on one GPU.

Measured, each configuration in its own process (the allocator is chosen
before the process's first CUDA allocation), native and memguard alternating
in order over the repetitions; medians reported:

1. Step time: the median of per-step times over --steps timed steps after
   --warmup untimed ones, each step bracketed by ``torch.cuda.synchronize()``.
   Target: memguard / native <= 1.03.
2. Peak reserved memory: native ``torch.cuda.max_memory_reserved()``,
   memguard ``memguard.stats("cuda")["reserved_bytes.peak"]``, over the whole
   run. Target: memguard / native <= 1.00. Also printed, for honesty (the
   driver rounds allocations up and holds its own context): device memory in
   use at the end of the run, ``total - free`` from ``torch.cuda.mem_get_info``.
3. The budget held: one more memguard run with a budget of the native peak
   reserved rounded up to a MiB. Target: memguard's reserved peak <= budget
   (PASS/FAIL); also reported the out-of-memory errors it raised, the
   allocation retries it needed (cache released, then retried) and its step
   time.

The model is written with torch.nn only: a 16 px patch-embedding conv, a
class token, --depth pre-norm blocks (LayerNorm, fused qkv Linear,
``scaled_dot_product_attention``, LayerNorm, GELU MLP of 4x dim) and a
classification head over 1000 classes; random 224 px images, batch --batch,
AdamW, optionally bfloat16 autocast (--amp). The defaults (ViT-S: dim 384,
depth 12, batch 64) need a few GiB and should take under two minutes on an H100
(7 processes).

Without a CUDA device the benchmark says so, writes ``measured: false`` to
--json if asked, and exits 0.

    python benchmarks/bench_cuda.py [--quick] [--reps N] [--steps N] [--amp] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

MIB = 1 << 20
STEP_TARGET = 1.03
PEAK_TARGET = 1.00
NOT_MEASURED = ("not measured: no CUDA device here; run `python benchmarks/bench_cuda.py` "
                "on a machine with an NVIDIA GPU")


# ---------------------------------------------------------------- the worker
def build_model(torch, dim: int, depth: int, heads: int, image: int, patch: int = 16,
                classes: int = 1000):
    """A ViT-like classifier from torch.nn pieces."""
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.norm2 = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x):
            b, n, _ = x.shape
            qkv = self.qkv(self.norm1(x)).view(b, n, 3, heads, dim // heads)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            a = F.scaled_dot_product_attention(q, k, v)
            x = x + self.proj(a.transpose(1, 2).reshape(b, n, dim))
            return x + self.mlp(self.norm2(x))

    class ViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = nn.Conv2d(3, dim, patch, patch)
            tokens = (image // patch) ** 2 + 1
            self.cls = nn.Parameter(torch.zeros(1, 1, dim))
            self.pos = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
            self.blocks = nn.Sequential(*[Block() for _ in range(depth)])
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, classes)

        def forward(self, x):
            x = self.patch(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
            return self.head(self.norm(self.blocks(x))[:, 0])

    return ViT()


def worker(a: argparse.Namespace) -> dict:
    """Run one configuration in this process; return its figures."""
    import torch

    mode = a.worker
    mg = None
    if mode == "memguard":
        import memguard as mg

        budget = None
        if a.budget is not None:
            budget = int(a.budget) if a.budget.isdigit() else a.budget
        # before anything touches CUDA: the allocator is chosen once per process
        mg.install(device="cuda", allocator="memguard", budget=budget)

    dev = torch.device("cuda")
    torch.manual_seed(0)
    heads = a.heads or max(1, a.dim // 64)
    model = build_model(torch, a.dim, a.depth, heads, a.image).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(a.batch, 3, a.image, a.image, device=dev)
    y = torch.randint(0, 1000, (a.batch,), device=dev)

    def is_oom(exc: BaseException) -> bool:
        if mg is not None:
            return mg.is_oom(exc)
        return isinstance(exc, torch.cuda.OutOfMemoryError)

    failed = 0

    def step() -> bool:
        """One training step; False when it ran out of memory."""
        nonlocal failed
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.amp):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return True
        except RuntimeError as exc:
            if not is_oom(exc):
                raise
        # out of memory: drop what the step held (outside the except block,
        # whose traceback keeps the step's tensors alive) and go on
        opt.zero_grad(set_to_none=True)
        failed += 1
        return False

    t_start = time.perf_counter()
    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ok = step()
        torch.cuda.synchronize()
        if ok:
            times.append(time.perf_counter() - t0)
    seconds = time.perf_counter() - t_start
    free, total = torch.cuda.mem_get_info()

    res = {"mode": mode, "device_name": torch.cuda.get_device_name(dev),
           "torch": torch.__version__, "params": sum(p.numel() for p in model.parameters()),
           "steps_timed": len(times), "steps_failed": failed, "seconds": seconds,
           "step_ms": statistics.median(times) * 1e3 if times else None,
           "device_used_bytes": total - free, "device_total_bytes": total,
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    if mode == "native":
        res.update(reserved_peak_bytes=torch.cuda.max_memory_reserved(dev),
                   allocated_peak_bytes=torch.cuda.max_memory_allocated(dev),
                   num_ooms=torch.cuda.memory_stats(dev).get("num_ooms", 0),
                   num_alloc_retries=torch.cuda.memory_stats(dev).get("num_alloc_retries", 0))
        return res
    s = mg.stats(device="cuda")
    if s.get("num_allocs", 0) <= 0 or s.get("reserved_bytes.peak", 0) <= 0:
        raise SystemExit(f"memguard's CUDA allocator did not serve this run "
                         f"(num_allocs {s.get('num_allocs')}, reserved_bytes.peak "
                         f"{s.get('reserved_bytes.peak')}): the figures would be the native "
                         f"allocator's, not memguard's")
    res.update(reserved_peak_bytes=s["reserved_bytes.peak"],
               allocated_peak_bytes=s["allocated_bytes.peak"],
               num_ooms=s.get("num_ooms", 0), num_alloc_retries=s.get("num_alloc_retries", 0),
               num_allocs=s["num_allocs"], num_cache_hits=s.get("num_cache_hits", 0),
               budget_bytes=s.get("budget_bytes", 0))
    return res


# ---------------------------------------------------------------- the driver
def spawn(a: argparse.Namespace, mode: str, budget: int | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode,
           "--batch", str(a.batch), "--depth", str(a.depth), "--dim", str(a.dim),
           "--heads", str(a.heads), "--image", str(a.image), "--steps", str(a.steps),
           "--warmup", str(a.warmup)]
    if a.amp:
        cmd.append("--amp")
    if budget is not None:
        cmd += ["--budget", str(budget)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    if out.returncode != 0:
        raise SystemExit(f"worker {mode} (budget {budget}) failed:\n"
                         f"{out.stdout[-2000:]}{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_json(path: str | None, data: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
        print(f"wrote {path}")


def med(rs: list, key: str):
    vals = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def ratio(x, y):
    return x / y if x is not None and y else None


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["native", "memguard"], help=argparse.SUPPRESS)
    p.add_argument("--budget", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true",
                   help="1 repetition, batch 16, depth 4, 10 steps after 3 warm-up")
    p.add_argument("--reps", type=int, default=3, help="repetitions of native/memguard (=3)")
    p.add_argument("--batch", type=int, default=64, help="images per step (=64)")
    p.add_argument("--depth", type=int, default=12, help="transformer blocks (=12)")
    p.add_argument("--dim", type=int, default=384, help="model width (=384)")
    p.add_argument("--heads", type=int, default=0, help="attention heads (=dim/64)")
    p.add_argument("--image", type=int, default=224, help="image size in px (=224)")
    p.add_argument("--steps", type=int, default=30, help="timed steps (=30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (=5)")
    p.add_argument("--amp", action="store_true", help="bfloat16 autocast")
    p.add_argument("--json", metavar="PATH", help="write every figure and ratio here")
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a)))
        return 0
    if a.quick:
        a.reps, a.batch, a.depth, a.steps, a.warmup = 1, 16, 4, 10, 3
    a.heads = a.heads or max(1, a.dim // 64)
    settings = {k: getattr(a, k) for k in
                ("reps", "batch", "depth", "dim", "heads", "image", "steps", "warmup", "amp")}

    import torch

    if not torch.cuda.is_available():
        print(NOT_MEASURED)
        write_json(a.json, {"measured": False, "reason": NOT_MEASURED, "settings": settings})
        return 0

    t_start = time.monotonic()
    runs: dict = {"native": [], "memguard": []}
    for rep in range(a.reps):
        # alternate the order so neither allocator always runs first
        for mode in (("native", "memguard") if rep % 2 == 0 else ("memguard", "native")):
            runs[mode].append(spawn(a, mode))
    native_peak = med(runs["native"], "reserved_peak_bytes")
    budget = math.ceil(native_peak / MIB) * MIB
    held = spawn(a, "memguard", budget)

    nat, mgd = runs["native"], runs["memguard"]
    first = nat[0]
    prec = "bf16 autocast" if a.amp else "fp32"
    print(f"memguard CUDA allocator benchmark: {first['device_name']}, torch {first['torch']}, "
          f"ViT dim {a.dim} depth {a.depth} heads {a.heads}, batch {a.batch} x {a.image} px, "
          f"{prec}, {first['params'] / 1e6:.1f} M params")
    print(f"{a.reps} repetition(s) x {a.steps} timed steps after {a.warmup} warm-up, medians; "
          f"ratios memguard / native")
    if first.get("alloc_conf"):
        print(f"note: PYTORCH_CUDA_ALLOC_CONF={first['alloc_conf']} is set for both")
    print()

    s = {"native": {}, "memguard": {}}
    for mode, rs in runs.items():
        s[mode] = {k: med(rs, k) for k in ("step_ms", "reserved_peak_bytes",
                                           "allocated_peak_bytes", "device_used_bytes")}
        s[mode]["steps_failed"] = sum(r["steps_failed"] for r in rs)
    step_ratio = ratio(s["memguard"]["step_ms"], s["native"]["step_ms"])
    peak_ratio = ratio(s["memguard"]["reserved_peak_bytes"], s["native"]["reserved_peak_bytes"])
    used_ratio = ratio(s["memguard"]["device_used_bytes"], s["native"]["device_used_bytes"])
    alloc_ratio = ratio(s["memguard"]["allocated_peak_bytes"],
                        s["native"]["allocated_peak_bytes"])

    print(f"  {'':10}{'step ms':>10}{'reserved peak MiB':>19}{'allocated peak MiB':>20}"
          f"{'device used MiB':>17}")
    for mode in ("native", "memguard"):
        m = s[mode]
        print(f"  {mode:10}{fmt(m['step_ms'], '.2f'):>10}"
              f"{m['reserved_peak_bytes'] / MIB:>19,.0f}{m['allocated_peak_bytes'] / MIB:>20,.0f}"
              f"{m['device_used_bytes'] / MIB:>17,.0f}")
    print(f"  {'ratio':10}{fmt(step_ratio, '.3f'):>10}{fmt(peak_ratio, '.3f'):>19}"
          f"{fmt(alloc_ratio, '.3f'):>20}{fmt(used_ratio, '.3f'):>17}")
    each = ", ".join(f"{r['step_ms']:.2f}" if r["step_ms"] is not None else "-"
                     for r in nat + mgd)
    print(f"  per run step ms (native..., memguard...): {each}")
    failed = s["native"]["steps_failed"] + s["memguard"]["steps_failed"]
    if failed:
        print(f"  WARNING: {failed} step(s) ran out of memory without a budget")
    print()

    step_ok = step_ratio is not None and step_ratio <= STEP_TARGET
    peak_ok = peak_ratio is not None and peak_ratio <= PEAK_TARGET
    held_ok = held["reserved_peak_bytes"] <= budget
    print(f"step time        memguard / native {fmt(step_ratio, '.3f')}x  "
          f"(target <= {STEP_TARGET:.2f}x)  {'PASS' if step_ok else 'FAIL'}")
    print(f"peak reserved    memguard / native {fmt(peak_ratio, '.3f')}x  "
          f"(target <= {PEAK_TARGET:.2f}x)  {'PASS' if peak_ok else 'FAIL'}")
    print(f"budget held      budget {budget / MIB:,.0f} MiB (native peak reserved, rounded up "
          f"to a MiB): memguard reserved peak {held['reserved_peak_bytes'] / MIB:,.1f} MiB  "
          f"{'PASS' if held_ok else 'FAIL'}")
    held_ratio = ratio(held["step_ms"], s["native"]["step_ms"])
    print(f"                 {held['num_ooms']} OOM(s), {held['num_alloc_retries']} alloc "
          f"retries, {held['steps_failed']} step(s) failed, step "
          f"{fmt(held['step_ms'], '.2f')} ms ({fmt(held_ratio, '.3f')}x native)")
    print(f"\n({time.monotonic() - t_start:.0f} s)")

    write_json(a.json, {
        "measured": True, "settings": settings, "device_name": first["device_name"],
        "torch": first["torch"], "params": first["params"], "runs": runs,
        "summary": s,
        "ratios": {"step": step_ratio, "reserved_peak": peak_ratio,
                   "allocated_peak": alloc_ratio, "device_used": used_ratio},
        "targets": {"step": STEP_TARGET, "reserved_peak": PEAK_TARGET},
        "pass": {"step": step_ok, "reserved_peak": peak_ok, "budget_held": held_ok},
        "budget_run": dict(held, budget_requested_bytes=budget, held=held_ok,
                           step_ratio=held_ratio),
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
