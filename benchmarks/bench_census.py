"""What a census of the process's objects costs (``memguard.telemetry.census``).

A fresh child process imports torch and ``transformers``, builds a
``ViTModel`` from a default ``ViTConfig`` (ViT-B/16, random init, nothing
downloaded; a torch.nn encoder of the same size where ``transformers`` is
not installed), runs one forward and backward, and leaks 10,000 tensors as
a training loop would: half of them small outputs that hold autograd
graphs, in a list, half detached features in a dict. It then takes censuses
back to back, each paired with a bare ``gc.get_objects()`` just before it
(the floor: the one pass over the objects that any census needs). The
figures are the census's time, its ratio to the floor, its cost per tracked
object, and what it found; and ``growing()`` on the two newest censuses.

    pytest benchmarks/bench_census.py --benchmark-only
    python benchmarks/bench_census.py [pytest options]   (the same)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchlib import ROOT, Figures, fmt, median

SECTION = "census"
TITLE = "census: one pass over the objects of a process holding a ViT-B/16 and a leak"
#: (leaked tensors, census rounds, ViT-B/16 or a tiny ViT), full and under --bench-quick
PLANS = {False: (10_000, 7, True), True: (1_000, 2, False)}

CHILD = r'''
import gc, json, statistics, sys, time
import torch
leaked, rounds, full = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(1)
size = {} if full else dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=128, image_size=32, patch_size=8)
try:
    import transformers
    transformers.logging.set_verbosity_error()
    model = transformers.ViTModel(transformers.ViTConfig(**size))
    name = "transformers ViTModel" + (" (ViT-B/16, random init)" if full else " (tiny)")
    pixels = torch.randn(2, 3, model.config.image_size, model.config.image_size)
    model(pixel_values=pixels).last_hidden_state.sum().backward()
except ImportError:
    dim, depth = (768, 12) if full else (64, 2)
    layer = torch.nn.TransformerEncoderLayer(dim, 12 if full else 2, 4 * dim, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, depth)
    name = f"torch.nn TransformerEncoder ({dim}, depth {depth}; transformers not installed)"
    model(torch.randn(2, 197, dim)).sum().backward()
w = torch.randn(16, requires_grad=True)
graphs = [w * i for i in range(leaked // 2)]
features = {i: torch.randn(256) for i in range(leaked - leaked // 2)}

from memguard.telemetry import census
census.take(0)
takes, floors, found = [], [], None
for r in range(rounds):
    t = time.perf_counter(); objs = gc.get_objects(); floors.append(time.perf_counter() - t)
    del objs
    before, found = found, census.take(r)
    takes.append(found.seconds)
graphs.append(w * -1.0)
after = census.take(found.step + 1)
t = time.perf_counter(); grew = census.growing(found, after); grow_s = time.perf_counter() - t
print(json.dumps({
    "model": name, "leaked": leaked, "rounds": rounds,
    "gc_objects": len(gc.get_objects()),
    "tensors": sum(n for n, _ in found.tensors.values()),
    "tensor_groups": len(found.tensors), "object_types": len(found.objects),
    "tensor_bytes": sum(b for _, b in found.tensors.values()),
    "take_s": takes, "floor_s": floors,
    "ratios": [a / b for a, b in zip(takes, floors)],
    "growing_s": grow_s, "growing": [g["what"] for g in grew],
}))
'''


def run_child(leaked: int, rounds: int, full: bool) -> dict:
    """The census measured in a fresh process; its figures."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps([leaked, rounds, full])],
                       env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.fail(f"the census child exited with {r.returncode}:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_census(benchmark, figures: Figures, quick: bool) -> None:
    pytest.importorskip("torch")
    figures.section(SECTION, TITLE, summarize)
    res: dict = {}
    benchmark.group = "census: a child process, its censuses timed inside it"
    benchmark.pedantic(lambda: res.update(run_child(*PLANS[quick])), rounds=1, iterations=1)
    fig = dict(res, take_median_s=median(res["take_s"]), floor_median_s=median(res["floor_s"]),
               ratio=median(res["ratios"]))
    benchmark.extra_info.update(take_median_s=fig["take_median_s"], ratio=fig["ratio"],
                                gc_objects=fig["gc_objects"])
    figures.record(SECTION, benchmark.fullname, fig)


def summarize(records: list[dict]) -> tuple[list[str], dict, dict]:
    r = records[0]
    per_obj_ns = r["take_median_s"] / r["gc_objects"] * 1e9
    lines = [
        (f"{r['model']}, {r['leaked']:,} tensors leaked: {r['gc_objects']:,} tracked objects, "
        f"{r['tensors']:,} tensors in {r['tensor_groups']} groups "
        f"({r['tensor_bytes'] / 2**20:,.0f} MiB), {r['object_types']:,} object types"),
        (f"census: {fmt(r['take_median_s'] * 1e3, '.0f')} ms (median of {r['rounds']}; "
        f"{fmt(per_obj_ns, '.0f')} ns an object), {fmt(r['ratio'])}x a bare "
        f"gc.get_objects() ({fmt(r['floor_median_s'] * 1e3, '.0f')} ms), paired"),
        f"growing(): {fmt(r['growing_s'] * 1e3, '.2f')} ms; it named: "
        + "; ".join(r["growing"]),
    ]
    data = {k: v for k, v in r.items() if k != "nodeid"}
    data["ns_per_object"] = per_obj_ns
    return lines, data, {r["nodeid"]: {"ratio": r["ratio"]}}


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "--benchmark-only", *sys.argv[1:]]))
