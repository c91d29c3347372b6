"""FSDP2 through Guard.step without memory pressure: what the guard costs.

Two ranks (``torchrun``, gloo, CPU, one thread each) train ``BLOCKS`` MLP
blocks (``WIDTH`` -> 4x -> ``WIDTH``), each block and the root
``fully_shard``ed, AdamW, ``BATCH`` samples per rank. The plain FSDP2 loop
runs interleaved (rounds of ``ROUND`` steps, so that the machine's drift
falls on both alike) with, in turn, the same model through an installed
``Guard`` with its defaults (memory calm: the ranks vote at the boundary
and after the attempt, not before each collective), then one with
``sync_collectives="always"`` (a vote before each of FSDP2's all-gathers
and reduce-scatters). Figures: the median step times, and each guarded
run's ratio to the plain run it was interleaved with.

    pytest benchmarks/bench_fsdp.py --benchmark-only -s
    python benchmarks/bench_fsdp.py [pytest options]   (the same)
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import pytest

from benchlib import ROOT, Figures, fmt

SECTION = "fsdp"
TITLE = "FSDP2 through Guard.step without pressure (2 ranks, gloo, CPU)"
BLOCKS, WIDTH, BATCH = 4, 512, 64
ROUND, ROUNDS, WARMUP = 5, 8, 3
MODES = ("plain", "guarded", "armed")


def _model():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                  torch.nn.Linear(4 * WIDTH, WIDTH)) for _ in range(BLOCKS)]
    model = torch.nn.Sequential(*blocks)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for b in blocks:
        fully_shard(b, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _stepper(mode: str):
    """A function running one step of ``mode``'s run."""
    import torch

    import memguard
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)

    def loss_fn(b):
        return torch.nn.functional.mse_loss(model(b[0]), b[1])

    if mode == "plain":
        def step():
            loss_fn((x, y)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step, None
    guard = memguard.Guard(model=model, forecast_horizon=None, headroom=None,
                           sync_collectives="always" if mode == "armed" else "auto")
    return (lambda: guard.step((x, y), loss_fn, opt)), guard


def worker(out: str) -> None:
    """One rank: the plain run interleaved with each guarded run in turn (a
    process has one installed guard); rank 0 writes the step times."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    plain = _stepper("plain")[0]
    times: dict[str, list[float]] = {}
    armed = {}
    for mode in MODES[1:]:
        step, guard = _stepper(mode)
        with guard:
            for r in range(ROUNDS + WARMUP):
                for m, f in (("plain/" + mode, plain), (mode, step)):
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(ROUND):
                        f()
                    dist.barrier()
                    if r >= WARMUP:
                        times.setdefault(m, []).append((time.perf_counter() - t0) / ROUND)
        armed[mode] = guard._peers.armed_steps
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "armed_steps": armed,
                       "steps": (ROUNDS + WARMUP) * ROUND}, f)
    dist.destroy_process_group()


def launch() -> dict:
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"memguard-bench-fsdp-{os.getpid()}.json")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), ROOT]))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node=2", __file__, "--worker", out], env=env, check=True,
                   timeout=900)
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res


def test_fsdp2_calm(benchmark, figures: Figures) -> None:
    pytest.importorskip("torch.distributed.fsdp")
    figures.section(SECTION, TITLE, summarize)
    res: dict = {}
    benchmark.group = "fsdp2: calm steps"
    benchmark.pedantic(lambda: res.update(launch()), rounds=1, iterations=1)
    figures.record(SECTION, benchmark.fullname, res)


def summarize(records: list[dict]) -> tuple[list[str], dict, dict]:
    lines = [(f"{BLOCKS} MLP blocks {WIDTH}-{4 * WIDTH}-{WIDTH}, batch {BATCH} per rank, "
             f"AdamW; median of {ROUNDS} rounds of {ROUND} steps, interleaved")]
    data, per_test = {}, {}
    for r in records:
        med = {m: statistics.median(v) for m, v in r["times"].items()}
        ratios = {m: med[m] / med["plain/" + m] for m in MODES[1:]}
        for m in MODES[1:]:
            what = "defaults, memory calm" if m == "guarded" else "a vote before every collective"
            lines.append(f"{m} ({what}): {med[m] * 1e3:.1f} ms/step against plain "
                         f"{med['plain/' + m] * 1e3:.1f} ms: {fmt(ratios[m], '.3f')}x; armed "
                         f"{r['armed_steps'][m]} of {r['steps']} steps")
        data = {"median_s": med, "ratios": ratios, "armed_steps": r["armed_steps"]}
        per_test[r["nodeid"]] = {f"{m}_over_plain": v for m, v in ratios.items()}
    return lines, data, per_test


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        raise SystemExit(pytest.main([__file__, "--benchmark-only", *sys.argv[1:]]))
