"""What a split step changes under float16 autocast with a GradScaler.

A split step sums each weight's gradient over a micro-batch in float16
(autocast's backward matmuls), then accumulates the micro-batches in the
parameters' float32 ``.grad``. The unsplit step's float16 sum runs over the
whole batch: scaled by the GradScaler it can pass float16's largest value
(65504) where a micro-batch's, a fraction of it, does not. The unsplit step
then finds an infinite gradient, skips its update and halves the scale; the
split step applies its update and keeps the scale. Nothing else differs: at
the whole batch a guarded step is the plain step, bit for bit.

Three runs of the same model, data, seeds and scaler, ``STEPS`` steps each:
the plain loop, a guard at the whole batch, a guard at a fixed
``MICRO`` (of ``BATCH``). The model is a linear regression on inputs and
targets chosen so that, at the initial scale of 2**16, the whole batch's
scaled weight gradient is about 1.5 times 65504 (and below it at half the
scale), while a micro-batch's, an eighth of it, stays well below: the
setting where the two differ, as they did on a ViT-B/16 on an H200 (see
docs/throttle.md). Figures:
updates skipped (the steps whose scale dropped), the final scale of each
run and the split run's over the plain run's, and how far the split run's
parameters end from the plain run's, relative to the plain run's update
over the run (``|p_split - p_plain| / |p_plain - p_0|``, norms over all
parameters). On a CUDA device it runs there (float16 autocast and
``GradScaler("cuda")``); elsewhere on the CPU (``GradScaler("cpu")``, which
memguard warns saves nothing there: the warning is expected and silenced).

    pytest benchmarks/bench_fp16_split.py --benchmark-only -s
    python benchmarks/bench_fp16_split.py [pytest options]   (the same)
"""
from __future__ import annotations

import os
import sys
import warnings

import pytest

from benchlib import ROOT, Figures, fmt

sys.path.insert(0, os.path.join(ROOT, "python"))

SECTION = "fp16_split"
TITLE = "float16 AMP: a split step against the unsplit one (GradScaler skips)"
BATCH, MICRO, STEPS = 128, 16, 12
D_IN, D_OUT = 64, 8
INIT_SCALE = 2.0**16
#: inputs around X_MEAN (all positive) and targets TARGET below the start:
#: each sample's weight gradient has the same sign, so the batch's float16
#: sum grows with the samples summed: INIT_SCALE * 2 * 6 * 1 / D_OUT = 98304
#: for the whole batch (mse_loss's mean over BATCH * D_OUT), 12288 for 16
X_MEAN, TARGET = 1.0, -6.0
LR = 0.01


def _setup(device: str):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(D_IN, D_OUT).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler(device, init_scale=INIT_SCALE)
    g = torch.Generator().manual_seed(1)
    data = [(X_MEAN + 0.1 * torch.randn(BATCH, D_IN, generator=g),
             TARGET + 0.1 * torch.randn(BATCH, D_OUT, generator=g)) for _ in range(STEPS)]
    return model, opt, scaler, [(x.to(device), y.to(device)) for x, y in data]


def _loss(model, batch, device: str):
    import torch

    with torch.autocast(device, dtype=torch.float16):
        out = model(batch[0])
    return torch.nn.functional.mse_loss(out.float(), batch[1])


def run(device: str, micro: int | None) -> dict:
    """One run of ``STEPS`` steps: the plain loop (``micro`` None) or a
    guard at ``micro``. Returns its scales after each step, the steps
    whose update was skipped, and its parameters at the start and end."""
    import torch

    import memguard

    model, opt, scaler, data = _setup(device)
    p0 = torch.cat([p.detach().flatten() for p in model.parameters()]).double().cpu()
    scales, skipped = [], []
    guard = None
    if micro is not None:
        guard = memguard.Guard(budget=None, micro_batch=micro, allocator=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="memguard: .* saves nothing")
        for i, batch in enumerate(data):
            before = scaler.get_scale()
            if guard is None:
                opt.zero_grad(set_to_none=True)
                scaler.scale(_loss(model, batch, device)).backward()
                scaler.step(opt)
                scaler.update()
            else:
                res = guard.step(batch, lambda b: _loss(model, b, device), opt, scaler=scaler)
                assert res.micro_batch == micro
            scales.append(scaler.get_scale())
            if scales[-1] < before:
                skipped.append(i)
    p = torch.cat([q.detach().flatten() for q in model.parameters()]).double().cpu()
    return {"scales": scales, "skipped": skipped, "p0": p0, "p": p}


def compare(device: str) -> dict:
    """The three runs and the figures comparing them, on one thread (one
    order of reductions; the workload is tiny, threads would only wait)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain, whole, split = run(device, None), run(device, BATCH), run(device, MICRO)
    finally:
        torch.set_num_threads(threads)
    update = float((plain["p"] - plain["p0"]).norm())
    return {
        "device": device, "batch": BATCH, "micro": MICRO, "steps": STEPS,
        "init_scale": INIT_SCALE,
        "skipped": {k: r["skipped"] for k, r in
                    (("plain", plain), ("whole", whole), ("split", split))},
        "final_scale": {k: r["scales"][-1] for k, r in
                        (("plain", plain), ("whole", whole), ("split", split))},
        "scale_ratio": split["scales"][-1] / plain["scales"][-1],
        "whole_equals_plain": bool((whole["p"] == plain["p"]).all()) and
                              whole["scales"] == plain["scales"],
        "param_diff_rel": float((split["p"] - plain["p"]).norm()) / update if update else None,
        "whole_diff_rel": float((whole["p"] - plain["p"]).norm()) / update if update else None,
    }


def test_fp16_split(benchmark, figures: Figures) -> None:
    import torch

    figures.section(SECTION, TITLE, summarize)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res: dict = {}
    benchmark.group = "fp16 split: plain, guard whole, guard split"
    benchmark.pedantic(lambda: res.update(compare(device)), rounds=1, iterations=1)
    benchmark.extra_info.update(scale_ratio=res["scale_ratio"],
                                param_diff_rel=res["param_diff_rel"])
    figures.record(SECTION, benchmark.fullname, res)


def summarize(records: list[dict]) -> tuple[list[str], dict, dict]:
    r = records[0]
    sk = r["skipped"]
    lines = [
        (f"{r['device']}: batch {r['batch']}, split at {r['micro']}, {r['steps']} steps, "
         f"float16 autocast + GradScaler(init_scale={r['init_scale']:g})"),
        (f"updates skipped: plain {len(sk['plain'])} (steps {sk['plain']}), guard whole "
         f"{len(sk['whole'])}, guard split {len(sk['split'])} (steps {sk['split']})"),
        (f"final scale: plain {r['final_scale']['plain']:g}, guard whole "
         f"{r['final_scale']['whole']:g}, guard split {r['final_scale']['split']:g} "
         f"(split / plain {r['scale_ratio']:g})"),
        (f"guard whole == plain bit for bit: {r['whole_equals_plain']}; split vs plain "
         f"parameters: {fmt(r['param_diff_rel'], '.3f')} of the plain run's update"),
    ]
    data = {k: v for k, v in r.items() if k != "nodeid"}
    return lines, data, {r["nodeid"]: {"scale_ratio": r["scale_ratio"],
                                       "param_diff_rel": r["param_diff_rel"]}}


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "--benchmark-only", *sys.argv[1:]]))
