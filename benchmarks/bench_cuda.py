"""CUDA allocator benchmark: memguard's CUDA allocator against PyTorch's native
caching allocator on a ViT-like training step, on one GPU.

Each configuration runs in its own worker process (the allocator is chosen
before the process's first CUDA allocation); pytest-benchmark times its
steps from here, each step bracketed by ``torch.cuda.synchronize()`` in the
worker, after --warmup untimed ones. Figures:

1. Step time: the median of the steps as the worker timed them.
   Target: memguard / native <= 1.03; and memguard's run completes every
   step (PASS/FAIL: a step that ran out of memory is left out of the median).
2. Peak reserved memory: native ``torch.cuda.max_memory_reserved()``,
   memguard ``memguard.cuda.stats()["reserved_bytes.peak"]``, over the whole
   run. Target: memguard / native <= 1.00. Also given, for honesty (the
   driver rounds allocations up and holds its own context): device memory in
   use at the end of the run, ``total - free`` from ``torch.cuda.mem_get_info``.
3. The budget held: one more memguard run with a budget of the native peak
   reserved rounded up to a MiB. Target (PASS/FAIL): every step of it
   completes (none runs out of memory), and the device memory it holds stays
   within the budget: the device's memory in use (``total - free``, read
   after every step), less what the native run held outside its allocator
   (its device memory in use at the end less its
   ``torch.cuda.memory_reserved()`` then: the CUDA context, the libraries'
   handles, loaded kernels), at most the budget. The allocator's own reserved
   peak, which it keeps under the budget by construction, must be too. Also
   reported: the out-of-memory errors it raised, the allocation retries it
   needed (cache released, then retried) and its step time. The device's
   memory in use is the whole device's: the GPU must be this run's alone.

The model is written with torch.nn only: a 16 px patch-embedding conv, a
class token, 12 pre-norm blocks (LayerNorm, fused qkv Linear,
``scaled_dot_product_attention``, LayerNorm, GELU MLP of 4x dim) and a
classification head over 1000 classes; random 224 px images, batch 64,
AdamW (ViT-S: dim 384), fp32, or bfloat16 autocast with --bench-cuda-amp. It
needs a few GiB and takes about a minute on an H100.

Without a CUDA device every benchmark here is skipped, saying so, and the
summary reports the figures as not measured.

    pytest benchmarks/bench_cuda.py --benchmark-only [--bench-cuda-amp]
    python benchmarks/bench_cuda.py [pytest options]   (the same)
"""
from __future__ import annotations

import math
import os
import sys
import time

import pytest

from benchlib import Figures, Worker, fmt, median, ratio, require_cuda, serve, verdict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

MIB = 1 << 20
TARGETS = {"step_ratio": 1.03, "reserved_peak_ratio": 1.00}
NOT_MEASURED = ("not measured: no CUDA device here; run `pytest benchmarks/bench_cuda.py "
                "--benchmark-only` on a machine with an NVIDIA GPU")
SECTION = "cuda"

#: Model and run sizes: the full run and --bench-quick.
FULL = {"batch": 64, "depth": 12, "dim": 384, "image": 224, "steps": 30, "warmup": 5}
QUICK = {"batch": 16, "depth": 4, "dim": 384, "image": 224, "steps": 5, "warmup": 2}


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


def worker(mode: str, batch: int, depth: int, dim: int, image: int, amp: int,
           budget: int = 0) -> dict:
    """Build one configuration in this process; return its commands."""
    import torch

    mg = None
    if mode == "memguard":
        import memguard as mg

        # before anything touches CUDA: the allocator is chosen once per process
        mg.cuda.install_allocator(budget=budget or None)

    dev = torch.device("cuda")
    torch.manual_seed(0)
    heads = max(1, dim // 64)
    model = build_model(torch, dim, depth, heads, image).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, 3, image, image, device=dev)
    y = torch.randint(0, 1000, (batch,), device=dev)
    failed = {"n": 0}
    used = {"peak": 0}

    def device_used() -> int:
        free, total = torch.cuda.mem_get_info(dev)
        return total - free

    def is_oom(exc: BaseException) -> bool:
        if mg is not None:
            return mg.is_oom(exc)
        return isinstance(exc, torch.cuda.OutOfMemoryError)

    def train_step() -> bool:
        """One training step; False when it ran out of memory."""
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bool(amp)):
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
        failed["n"] += 1
        return False

    def step() -> dict:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ok = train_step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        used["peak"] = max(used["peak"], device_used())    # after the timing
        return {"ms": ms, "ok": ok}

    def figures() -> dict:
        free, total = torch.cuda.mem_get_info()
        res = {"device_name": torch.cuda.get_device_name(dev), "torch": torch.__version__,
               "params": sum(p.numel() for p in model.parameters()),
               "steps_failed": failed["n"], "device_used_bytes": total - free,
               "device_used_peak_bytes": max(used["peak"], total - free),
               "device_total_bytes": total,
               "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
        if mg is None:
            st = torch.cuda.memory_stats(dev)
            return dict(res, reserved_peak_bytes=torch.cuda.max_memory_reserved(dev),
                        reserved_bytes=torch.cuda.memory_reserved(dev),
                        allocated_peak_bytes=torch.cuda.max_memory_allocated(dev),
                        num_ooms=st.get("num_ooms", 0),
                        num_alloc_retries=st.get("num_alloc_retries", 0))
        s = mg.cuda.stats()
        if s.get("num_allocs", 0) <= 0 or s.get("reserved_bytes.peak", 0) <= 0:
            raise RuntimeError(
                f"memguard's CUDA allocator did not serve this run (num_allocs "
                f"{s.get('num_allocs')}, reserved_bytes.peak {s.get('reserved_bytes.peak')}): "
                "the figures would be the native allocator's, not memguard's")
        return dict(res, reserved_peak_bytes=s["reserved_bytes.peak"],
                    reserved_bytes=s["reserved_bytes.current"],
                    allocated_peak_bytes=s["allocated_bytes.peak"],
                    num_ooms=s.get("num_ooms", 0),
                    num_alloc_retries=s.get("num_alloc_retries", 0),
                    num_allocs=s["num_allocs"], num_cache_hits=s.get("num_cache_hits", 0),
                    budget_bytes=s.get("budget_bytes", 0))

    return {"step": step, "figures": figures}


# ------------------------------------------------------------- benchmarks
TITLE = "CUDA allocator: memguard's against PyTorch's native one"


@pytest.fixture(scope="module")
def cuda(figures: Figures) -> None:
    require_cuda(figures, SECTION, TITLE, NOT_MEASURED)


@pytest.fixture(scope="module")
def settings(quick: bool, request: pytest.FixtureRequest) -> dict:
    return dict(QUICK if quick else FULL,
                amp=int(bool(request.config.getoption("--bench-cuda-amp"))))


def _run(benchmark, figures: Figures, settings: dict, mode: str, budget: int = 0) -> dict:
    figures.section(SECTION, TITLE, summarize)
    s = settings
    args = [mode, *(str(s[k]) for k in ("batch", "depth", "dim", "image", "amp")), str(budget)]
    steps: list[dict] = []
    with Worker(__file__, args) as w:
        for _ in range(s["warmup"]):
            w.call("step")
        benchmark.group = "cuda allocator: ViT training step"
        benchmark.pedantic(lambda: steps.append(w.call("step")), rounds=s["steps"])
        fig = w.call("figures")
    fig.update(mode=mode, budget_requested_bytes=budget, settings=s,
               step_ms=median(x["ms"] for x in steps if x["ok"]),
               steps_timed=sum(x["ok"] for x in steps))
    benchmark.extra_info.update({k: fig[k] for k in (
        "step_ms", "reserved_peak_bytes", "allocated_peak_bytes", "device_used_bytes",
        "device_used_peak_bytes", "steps_failed", "num_ooms", "num_alloc_retries")})
    figures.record(SECTION, benchmark.fullname, fig)
    return fig


@pytest.mark.parametrize("mode", ["native", "memguard"])
def test_cuda_step(benchmark, figures: Figures, settings: dict, cuda: None, mode: str) -> None:
    _run(benchmark, figures, settings, mode)


def test_cuda_budget_held(benchmark, figures: Figures, settings: dict, cuda: None) -> None:
    """memguard under a budget of the native run's peak reserved bytes."""
    native = [r for r in figures.records.get(SECTION, []) if r["mode"] == "native"
              and not r["budget_requested_bytes"]]
    if not native:
        pytest.skip("needs test_cuda_step[native] earlier in the same run")
    budget = math.ceil(native[-1]["reserved_peak_bytes"] / MIB) * MIB
    _run(benchmark, figures, settings, "memguard", budget)


# ------------------------------------------------------------------ summary
def summarize(records: list[dict]) -> tuple[list[str], dict, dict]:
    lines: list[str] = []
    per_test: dict[str, dict] = {}
    runs = {r["mode"]: r for r in records if not r["budget_requested_bytes"]}
    held = next((r for r in records if r["budget_requested_bytes"]), None)
    nat, mgd = runs.get("native"), runs.get("memguard")
    data: dict = {"measured": True, "targets": TARGETS, "runs": runs, "budget_run": held}
    first = nat or mgd
    s = first["settings"]
    prec = "bf16 autocast" if s["amp"] else "fp32"
    lines.append(f"{first['device_name']}, torch {first['torch']}, ViT dim {s['dim']} depth "
                 f"{s['depth']}, batch {s['batch']} x {s['image']} px, {prec}, "
                 f"{first['params'] / 1e6:.1f} M params; {s['steps']} timed steps after "
                 f"{s['warmup']} warm-up, medians")
    if first.get("alloc_conf"):
        lines.append(f"note: PYTORCH_CUDA_ALLOC_CONF={first['alloc_conf']} is set for both")
    lines.append(f"  {'':10}{'step ms':>10}{'reserved peak MiB':>19}{'allocated peak MiB':>20}"
                 f"{'device used MiB':>17}")
    for mode, r in (("native", nat), ("memguard", mgd)):
        if r:
            lines.append(f"  {mode:10}{fmt(r['step_ms'], '.2f'):>10}"
                         f"{r['reserved_peak_bytes'] / MIB:>19,.0f}"
                         f"{r['allocated_peak_bytes'] / MIB:>20,.0f}"
                         f"{r['device_used_bytes'] / MIB:>17,.0f}")
    if nat and mgd:
        rs = {"step_ratio": ratio(mgd["step_ms"], nat["step_ms"]),
              "reserved_peak_ratio": ratio(mgd["reserved_peak_bytes"],
                                           nat["reserved_peak_bytes"]),
              "allocated_peak_ratio": ratio(mgd["allocated_peak_bytes"],
                                            nat["allocated_peak_bytes"]),
              "device_used_ratio": ratio(mgd["device_used_bytes"], nat["device_used_bytes"])}
        data["ratios"] = rs
        data["verdict"] = {k: verdict(rs[k], t) for k, t in TARGETS.items()}
        per_test[mgd["nodeid"]] = dict(rs, baseline="native")
        lines.append(f"  {'ratio':10}{fmt(rs['step_ratio'], '.3f'):>10}"
                     f"{fmt(rs['reserved_peak_ratio'], '.3f'):>19}"
                     f"{fmt(rs['allocated_peak_ratio'], '.3f'):>20}"
                     f"{fmt(rs['device_used_ratio'], '.3f'):>17}")
        lines.append(f"step time      memguard / native {fmt(rs['step_ratio'], '.3f')}x "
                     f"(target <= {TARGETS['step_ratio']:.2f}x)  {data['verdict']['step_ratio']}")
        lines.append(f"peak reserved  memguard / native {fmt(rs['reserved_peak_ratio'], '.3f')}x "
                     f"(target <= {TARGETS['reserved_peak_ratio']:.2f}x)  "
                     f"{data['verdict']['reserved_peak_ratio']}")
    if mgd:
        v = "PASS" if mgd["steps_failed"] == 0 else "FAIL"
        data.setdefault("verdict", {})["steps_completed"] = v
        lines.append(f"steps          memguard's run: {mgd['steps_failed']} step(s) ran out of "
                     f"memory (target 0)  {v}")
    if nat and nat["steps_failed"]:
        lines.append(f"WARNING: {nat['steps_failed']} step(s) of the native run ran out of memory")
    if held:
        data["budget_run"] = dict(held, **budget_figures(held, nat))
        b = data["budget_run"]
        data["budget_held"] = b["verdict"] == "PASS"
        data.setdefault("verdict", {})["budget_held"] = b["verdict"]
        per_test[held["nodeid"]] = {"budget_held": b["verdict"],
                                    "device_over_budget_bytes": b["device_over_budget_bytes"]}
        lines.extend(budget_lines(b, nat))
    return lines, data, per_test


def budget_figures(held: dict, nat: dict | None) -> dict:
    """The budget run judged: every step completed, the device memory it held
    (its device's memory in use, less what native's run held outside its
    allocator) and its allocator's reserved peak within the budget."""
    budget = held["budget_requested_bytes"]
    outside = nat["device_used_bytes"] - nat["reserved_bytes"] if nat else None
    device = None if outside is None else held["device_used_peak_bytes"] - outside
    fails = []
    if held["steps_failed"]:
        fails.append(f"{held['steps_failed']} step(s) ran out of memory")
    if device is not None and device > budget:
        fails.append(f"the device held {(device - budget) / MIB:,.1f} MiB over the budget")
    if held["reserved_peak_bytes"] > budget:
        fails.append("the allocator reserved more than the budget")
    v = "FAIL" if fails else "-" if device is None else "PASS"
    return {"outside_allocator_bytes": outside, "device_held_bytes": device,
            "device_over_budget_bytes": None if device is None else device - budget,
            "failures": fails, "verdict": v}


def _mib(x: float | None) -> str:
    return fmt(None if x is None else x / MIB, ",.1f")


def budget_lines(b: dict, nat: dict | None) -> list[str]:
    """The budget run's lines of the summary, from :func:`budget_figures`'s ``b``."""
    why = f" ({'; '.join(b['failures'])})" if b["failures"] else ""
    pad = " " * 15
    return [
        (f"budget held    budget {_mib(b['budget_requested_bytes'])} MiB (native peak reserved, "
         f"rounded up to a MiB): every step completed, device memory held and reserved peak "
         f"within it  {b['verdict']}{why}"),
        (f"{pad}device memory in use at most {_mib(b['device_used_peak_bytes'])} MiB, less "
         f"{_mib(b['outside_allocator_bytes'])} MiB outside the allocator (native's run) = "
         f"{_mib(b['device_held_bytes'])} MiB held; reserved peak "
         f"{_mib(b['reserved_peak_bytes'])} MiB"),
        (f"{pad}{b['num_ooms']} OOM(s), {b['num_alloc_retries']} alloc retries, "
         f"{b['steps_failed']} step(s) failed, step {fmt(b['step_ms'], '.2f')} ms "
         f"({fmt(ratio(b['step_ms'], nat and nat['step_ms']), '.3f')}x native)")]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        m, *nums = sys.argv[2:]
        raise SystemExit(serve(lambda: worker(m, *map(int, nums))))
    raise SystemExit(pytest.main([__file__, "--benchmark-only", *sys.argv[1:]]))
