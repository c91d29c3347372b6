"""The drift forecast against leaks run to their end.

An MLP (``D_IN`` -> ``HIDDEN`` -> 4, batch ``BATCH``) trains under a guard
with a tensor budget of ``BUDGET``. For ``FLAT`` steps it keeps nothing;
from then on every step keeps its hidden activation, either with its
autograd graph (a list: ``kept.append(h)``) or detached into a dict cache.
The run goes on until the guard gives up: a step that no longer fits at
micro-batch 1 under the budget (``GuardOOMError``), the step where the
budget was reached. Figures per leak: the steps from the leak's start to
the forecast, the step it forecast against the step the run ended, the
error in steps and as a share of the steps the forecast gave, the rate it
read against the bytes kept a step, and what its two censuses cost.

    pytest benchmarks/bench_drift.py --benchmark-only -s
    python benchmarks/bench_drift.py [pytest options]   (the same)
"""
from __future__ import annotations

import os
import sys
import warnings

import pytest

from benchlib import ROOT, Figures, fmt

sys.path.insert(0, os.path.join(ROOT, "python"))

SECTION = "drift"
TITLE = "drift forecast: leaks run under a tensor budget until the guard gives up"
D_IN, HIDDEN, BATCH = 32, 4096, 64
BUDGET = 384 << 20
FLAT, MAX_STEPS = 40, 3000


def run(leak: str) -> dict:
    """One leak to its end: the forecast's figures and the step it ended."""
    import torch

    import memguard
    from memguard.train.drift import ForecastWarning

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept: list = []
    cache: dict = {}
    step = 0

    def loss_fn(b):
        h = model[1](model[0](b[0]))
        if step >= FLAT:
            if leak == "graph":
                kept.append(h)
            else:
                cache[len(cache)] = h.detach().clone()
        return torch.nn.functional.cross_entropy(model[2](h), b[1])

    guard = memguard.Guard(tensor_budget=BUDGET, headroom=None)
    ended = None
    with guard, warnings.catch_warnings():
        warnings.simplefilter("ignore", ForecastWarning)
        for step in range(MAX_STEPS):
            batch = (torch.randn(BATCH, D_IN), torch.randint(0, 4, (BATCH,)))
            try:
                guard.step(batch, loss_fn, opt)
            except memguard.GuardOOMError:
                ended = step
                break
    f = guard.boundary.drift.forecast or {}
    return {"leak": leak, "flat": FLAT, "ended": ended, "forecast_step": f.get("step"),
            "reach_step": f.get("reach_step"), "rate": f.get("rate_bytes_per_step"),
            "kept_per_step": BATCH * HIDDEN * 4, "census_s": f.get("census_s"),
            "growing": [g["what"] for g in f.get("growing") or []]}


@pytest.mark.parametrize("leak", ["graph", "dict"])
def test_leak_to_its_end(benchmark, figures: Figures, leak: str) -> None:
    figures.section(SECTION, TITLE, summarize)
    res: dict = {}
    benchmark.group = "drift: leak to its end"
    benchmark.pedantic(lambda: res.update(run(leak)), rounds=1, iterations=1)
    figures.record(SECTION, benchmark.fullname, res)


def _errors(r: dict) -> tuple[int | None, float | None]:
    if r["ended"] is None or r["reach_step"] is None:
        return None, None
    err = r["reach_step"] - r["ended"]
    return err, err / max(1, r["ended"] - r["forecast_step"])


def summarize(records: list[dict]) -> tuple[list[str], dict, dict]:
    lines = [(f"MLP {D_IN}-{HIDDEN}-4, batch {BATCH}, tensor budget {BUDGET >> 20} MiB, "
              f"leak from step {FLAT}")]
    per_test = {}
    for r in records:
        err, rel = _errors(r)
        after = None if r["forecast_step"] is None else r["forecast_step"] - r["flat"]
        lines.append(
            f"{r['leak']}: forecast {after} steps after the leak began (step "
            f"{r['forecast_step']}), reach forecast at step {r['reach_step']}, ended at step "
            f"{r['ended']}: error {err} steps ({fmt(rel, '.1%')} of the steps it gave); rate "
            f"{fmt((r['rate'] or 0) / 2**20, '.2f')} MiB/step (kept "
            f"{r['kept_per_step'] / 2**20:.2f} MiB/step); censuses {fmt(r['census_s'], '.3f')} s")
        lines.append(f"  named: {'; '.join(r['growing'])}")
        per_test[r["nodeid"]] = {"steps_to_forecast": after, "error_steps": err,
                                 "error_share": rel}
    data = {r["leak"]: {k: v for k, v in r.items() if k != "nodeid"} for r in records}
    return lines, data, per_test


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "--benchmark-only", *sys.argv[1:]]))
