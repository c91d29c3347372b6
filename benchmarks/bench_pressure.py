"""Memory that follows the machine: real training under a real memory limit
that changes mid-run, the plain loop and memguard side by side.

A ViT-S/16 with LoRA adapters (peft), batch 32 at 224 px, 2 threads (the
first user's story; ``memguard.cli.workload`` builds it) trains inside a memory cgroup
(v1 or v2) with a swap file the benchmark creates and removes; its plain
loop needs about twice the limit. Each configuration is one run in a fresh
process (pytest-benchmark times the run); the figures are its steps:

(a) the limit below the need from the start;
(b) the limit lowered mid-run, from above the plain loop's need to below it;
(c) the limit raised again (the same run as (b), continued);
(d) an out-of-memory error at the whole batch in the first step, then the
    limit raised well above the whole batch's need (memguard alone: the
    plain loop has no batch to give back);
(e) a validation loop (the story's lost epoch), the limit lowered while it
    runs: the plain loop's ``model(batch)`` under ``torch.no_grad()``
    against ``guard.infer(batch, model)`` inside ``guard.evaluate()``,
    predictions kept as numpy values, each batch the same
    (``workload.run_validation``). Its batch (128 at 224 px) fits the
    limit before the drop (about 1.1 GB at its peak) and not after it.
(f) the first user's run with 4 DataLoader workers that each hold 150 MiB
    of their own (a dataset's copy in each worker), under the limit from
    the start: the plain loop against memguard, whose advice on the workers
    (a ``WorkersWarning`` naming them, their memory and what a lower
    ``num_workers`` gives back) is printed with the figures. The workers
    hand out each batch's indices and the batch is gathered in the main
    process, so they add only what they hold.

How (d)'s first step runs out of memory: in memguard's arena, not in the
kernel. The run starts under a limit below the whole batch's need ((a)'s;
a higher one in the quick setting, whose lower limit can read as HIGH
before any step, which quarters the batch without an error). The guard's
live budget is the limit less its 8 % reserve, the arena's budget that
less what the process holds outside the arena (10 % more than at install,
before any step): about 1.6 GB of a 2200 MiB limit, where half the batch's
tensors alone peak at 1.26 GB. The arena refuses the allocation past its
budget (the guard's budget is soft: it refuses inside a step only) and the
step is redone at half the batch; the cgroup never fails an allocation (with
the swap file it swaps instead). The worker records the sizes each step
tried (``tried``) and the arena's refusals (``arena_ooms``), which show it.
The limit rises once the first step is done, while the second may already
have begun under the old one.

Targets (figures, not timed tests):

- (a) memguard's throughput is at least 4x the plain loop's;
- (b) memguard settles within 2 steps of the drop: the first post-drop step
  from which its throughput to the end of (b) (samples over seconds) is at
  least 0.9x (a)'s memguard throughput is at most the third (a run that
  never gets there is OVER); and its throughput from the third post-drop
  step on is at least 0.9x (a)'s; the major faults of each of the last three
  post-drop steps are at most 1 % of the first post-drop step's (none, where
  that one had none); the process's swap at the last post-drop step is 5 %
  of its RSS or less; it never plans below half the size (a) chose;
- (c) it grows back to the whole batch within grow_after + 2 steps (a run
  that never does is OVER);
- (d) its first step ran out of memory at the whole batch (FAIL where it
  did not: the scenario did not happen), and it is back to the whole batch
  within 2 steps of the rise (a run that never gets there is OVER), though
  the whole batch failed under the lower limit;
- at every step boundary, the arena's reserved bytes are at most 1.25x the
  recent peak allocated, plus 64 MiB;
- (e) memguard settles within 2 batches of the drop: the first post-drop
  batch from which its throughput to the end is at least 0.8x its own
  pre-drop throughput (batch 0 left out: start-up) is at most the third
  (OVER where it never gets there); its post-drop throughput is at least
  the plain loop's (never slower: an inference's working set is a few
  layers' activations, so a limit under which the plain loop thrashes
  leaves the process no room at all; at 800 MiB the plain loop loses only
  10-20 % to swap, and memguard's margin over it is the arena's speed);
  its swap grows by at most
  16 MiB from the third post-drop batch to the last, and the major faults
  of each of the last two post-drop batches are at most 1 % of the first
  post-drop batch's.
- (f) memguard's throughput is at least 2x the plain loop's (the issue's
  reference run: 2.85x), and memguard gave its advice on the workers,
  naming all 4 (FAIL where it did not).

The plain loop swaps for tens of seconds a step: it is stopped once it has
run ``plain_max_s`` seconds. Without root, a memory cgroup or swap, the
benchmark skips and says why.

    pytest benchmarks/bench_pressure.py --benchmark-only [-k validation]
"""
from __future__ import annotations

import os
import statistics
import sys

import pytest

from benchlib import Figures, fmt, ratio, share_verdict, verdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

from memguard.cli import workload
from memguard.memory import limits

MiB = 2**20
SECTION = "pressure"
TITLE = "pressure: ViT-S/16 + LoRA under a memory cgroup with swap, the limit changed mid-run"
GROW_AFTER = 8   # Guard's default
TARGETS = {"a_throughput": 4.0, "b_settle_steps": 2, "b_throughput": 0.9,
           "b_faults": 0.01, "b_swap_share": 0.05, "b_min_micro": 0.5,
           "c_steps": GROW_AFTER + 2, "d_steps": 2, "boundary_factor": 1.25,
           "boundary_slack": 64 * MiB, "f_throughput": 2.0}

#: limit (a) and after the drop, limit before it and after the rise, swap
#: file, steps of (a), steps before the drop, after it, after the rise, the
#: plain loop's time cap; (d): its limit before the rise (the whole batch
#: runs out of memory under it, and the next size down does not: QUICK's
#: lower limit starts at HIGH and quarters the batch before any step), its
#: steps under it, then after the rise (to ``high``)
FULL = {"model": workload.VIT_S16, "limit": 2200 * MiB, "high": 5000 * MiB,
        "swap": 4 << 30, "a_steps": 8, "pre": 4, "post": 10, "rise": 12, "plain_max_s": 100,
        "d_limit": 2200 * MiB, "d_pre": 1, "d_post": 5,
        "f_limit": 2200 * MiB, "f_workers": 4, "f_worker_bytes": 150 * MiB, "f_steps": 8}
QUICK = {"model": workload.Model(img=112, batch=64), "limit": 900 * MiB,
         "high": 3000 * MiB, "swap": 2 << 30, "a_steps": 3, "pre": 2, "post": 4, "rise": 4,
         "plain_max_s": 30, "d_limit": 1300 * MiB, "d_pre": 1, "d_post": 3,
         "f_limit": 1400 * MiB, "f_workers": 4, "f_worker_bytes": 50 * MiB, "f_steps": 3}


@pytest.fixture(scope="module")
def settings(quick: bool) -> dict:
    return QUICK if quick else FULL


@pytest.fixture(scope="module")
def swap(figures: Figures, settings: dict):
    why = limits.unavailable()
    if why:
        figures.skip(SECTION, TITLE, f"not measured: {why}")
        pytest.skip(why)
    try:
        with limits.SwapFile(settings["swap"]) as sw:
            yield sw
    except limits.LimitUnavailable as exc:
        figures.skip(SECTION, TITLE, f"not measured: {exc}")
        pytest.skip(str(exc))


def _run(benchmark, figures: Figures, settings: dict, mode: str, scenario: str) -> None:
    figures.section(SECTION, TITLE, summarize)
    s = settings
    if scenario == "a":
        limit, schedule, steps = s["limit"], [], s["a_steps"]
    elif scenario == "d":
        limit, steps = s["d_limit"], s["d_pre"] + s["d_post"]
        schedule = [(s["d_pre"] - 1, s["high"])]
    else:
        drop = s["pre"] - 1
        rise = drop + s["post"]
        limit, steps = s["high"], s["pre"] + s["post"] + s["rise"]
        schedule = [(drop, s["limit"]), (rise, s["high"])]
    out: dict = {}
    benchmark.group = "pressure: whole run"
    benchmark.pedantic(lambda: out.update(r=workload.run(
        mode, limit, schedule, steps=steps, model=s["model"],
        max_seconds=s["plain_max_s"] if mode == "plain" else None)), rounds=1, iterations=1)
    r: workload.Result = out["r"]
    fig = {"mode": mode, "scenario": scenario, "steps": r.steps, "schedule": r.schedule,
           "killed": r.killed, "stopped_by_time": r.stopped_by_time,
           "returncode": r.returncode, "batch": s["model"].batch,
           "limit": s["limit"], "high": s["high"], "pre": s["pre"], "post": s["post"],
           "d_limit": s["d_limit"], "d_pre": s["d_pre"]}
    if mode == "memguard" and r.returncode != 0:
        pytest.fail(f"memguard's run failed (status {r.returncode}):\n{r.stderr}")
    benchmark.extra_info.update(steps_done=len(r.steps), killed=r.killed)
    figures.record(SECTION, benchmark.fullname, fig)


@pytest.mark.parametrize("mode", ["plain", "memguard"])
def test_limit_from_start(benchmark, figures: Figures, settings: dict, swap, mode: str) -> None:
    """(a): the limit below the plain loop's need from the first step."""
    _run(benchmark, figures, settings, mode, "a")


@pytest.mark.parametrize("mode", ["plain", "memguard"])
def test_limit_lowered_then_raised(benchmark, figures: Figures, settings: dict, swap,
                                   mode: str) -> None:
    """(b) and (c): above the need, lowered below it mid-run, raised again."""
    _run(benchmark, figures, settings, mode, "bc")


def test_oom_at_start_then_raised(benchmark, figures: Figures, settings: dict, swap) -> None:
    """(d): out of memory at the whole batch in the first step, then the
    limit raised well above the whole batch's need (memguard alone)."""
    _run(benchmark, figures, settings, "memguard", "d")


@pytest.mark.parametrize("mode", ["plain", "memguard"])
def test_dataloader_workers(benchmark, figures: Figures, settings: dict, swap,
                            mode: str) -> None:
    """(f): 4 DataLoader workers holding 150 MiB each, under the limit
    from the start; memguard's advice on them recorded."""
    figures.section(SECTION, TITLE, summarize)
    s = settings
    out: dict = {}
    benchmark.group = "pressure: whole run"
    benchmark.pedantic(lambda: out.update(r=workload.run(
        mode, s["f_limit"], steps=s["f_steps"], model=s["model"],
        max_seconds=s["plain_max_s"] if mode == "plain" else None,
        workers=s["f_workers"], worker_bytes=s["f_worker_bytes"])), rounds=1, iterations=1)
    r: workload.Result = out["r"]
    if mode == "memguard" and r.returncode != 0:
        pytest.fail(f"memguard's run failed (status {r.returncode}):\n{r.stderr}")
    benchmark.extra_info.update(steps_done=len(r.steps), killed=r.killed)
    figures.record(SECTION, benchmark.fullname, {
        "mode": mode, "scenario": "f", "steps": r.steps, "schedule": r.schedule,
        "killed": r.killed, "stopped_by_time": r.stopped_by_time, "returncode": r.returncode,
        "batch": s["model"].batch, "limit": s["limit"], "high": s["high"], "pre": s["pre"],
        "post": s["post"], "f_limit": s["f_limit"], "f_workers": s["f_workers"],
        "f_worker_bytes": s["f_worker_bytes"]})


# ------------------------------------------------------------------ summary
def _median_s(steps: list[dict]) -> float | None:
    """Median seconds a step, leaving out the first step of a run (start-up)."""
    xs = [s["seconds"] for s in steps if s["step"] > 0] or [s["seconds"] for s in steps]
    return statistics.median(xs) if xs else None


def _steps_line(steps: list[dict]) -> str:
    return " ".join(f"{s['seconds']:.1f}s@{s['micro']}" for s in steps)


def summarize(records: list[dict]) -> tuple[list[str], dict, dict]:
    by = {(r["mode"], r["scenario"]): r for r in records}
    lines: list[str] = []
    data: dict = {"measured": True, "targets": TARGETS}
    per_test: dict[str, dict] = {}
    first = records[0]
    batch = first["batch"]
    lines.append(f"limit {first['limit'] / MiB:,.0f} MiB ((a); (b) from "
                 f"{first['high'] / MiB:,.0f} MiB after step {first['pre'] - 1}, "
                 f"(c) back after {first['post']} more); batch {batch}; seconds@micro-batch "
                 "per step")
    pa, ma = by.get(("plain", "a")), by.get(("memguard", "a"))
    a_s = _median_s(ma["steps"]) if ma else None
    a_micro = statistics.mode(s["micro"] for s in ma["steps"][1:] or ma["steps"]) if ma else None
    for r in (pa, ma):
        if r:
            end = " (killed by the kernel)" if r["killed"] else \
                " (stopped: time cap)" if r["stopped_by_time"] else ""
            last = r["steps"][-1] if r["steps"] else {}
            lines.append(f"(a) {r['mode']:9} {_steps_line(r['steps'])}{end}; swap at the end "
                         f"{last.get('swap_bytes', 0) / MiB:,.0f} MiB")
    if pa and ma:
        tp = ratio(_median_s(pa["steps"]), a_s)
        data["a"] = {"throughput_ratio": tp, "memguard_step_s": a_s, "micro": a_micro,
                     "plain_step_s": _median_s(pa["steps"]), "plain_killed": pa["killed"]}
        v = verdict(tp, TARGETS["a_throughput"], higher_is_better=True)
        per_test[ma["nodeid"]] = {"throughput_vs_plain": tp}
        lines.append(f"(a) memguard / plain throughput {fmt(tp)}x (target >= "
                     f"{TARGETS['a_throughput']:.0f}x)  {v}")
    pb, mb = by.get(("plain", "bc")), by.get(("memguard", "bc"))
    if pb:
        post = [s for s in pb["steps"] if s["step"] >= pb["pre"]]
        lines.append(f"(b) plain     before {_steps_line(pb['steps'][:pb['pre']])} | after the drop "
                     f"{_steps_line(post) or '-'}" + (" (killed)" if pb["killed"] else
                                                     " (stopped: time cap)" if
                                                     pb["stopped_by_time"] else ""))
    if mb:
        data.update(_memguard_bc(mb, a_s, a_micro, lines, per_test))
    md = by.get(("memguard", "d"))
    if md:
        d, v = _memguard_d(md, lines, per_test)
        data["d"] = d
        data.setdefault("verdict", {}).update(v)
    if ("plain", "f") in by or ("memguard", "f") in by:
        data["f"], v = _workers_f(by.get(("plain", "f")), by.get(("memguard", "f")), lines,
                                  per_test)
        data.setdefault("verdict", {}).update(v)
    return lines, data, per_test


def _throughput(steps: list[dict], a_s: float | None) -> float | None:
    """The throughput of ``steps`` (samples over seconds) against (a)'s
    memguard throughput, whose steps take ``a_s`` seconds at the same batch."""
    return ratio(a_s * len(steps), sum(s["seconds"] for s in steps)) if a_s and steps else None


def _settle(post: list[dict], a_s: float | None) -> int | None:
    """The first post-drop step from which the run's throughput, to the end of
    (b), is at least the target share of (a)'s; None when there is none."""
    return next((k for k in range(len(post))
                 if (_throughput(post[k:], a_s) or 0) >= TARGETS["b_throughput"]), None)


def _never(value: int | None, target: int, measured: bool) -> str:
    """The verdict of a step count, where None means the event never came:
    OVER when it was looked for, '-' when there was nothing to look at."""
    if value is None:
        return "OVER" if measured else "-"
    return verdict(value, target)


def _memguard_bc(mb: dict, a_s: float | None, a_micro: int | None, lines: list[str],
                 per_test: dict) -> dict:
    pre, post_n = mb["pre"], mb["post"]
    steps = mb["steps"]
    post = steps[pre:pre + post_n]
    after_rise = steps[pre + post_n:]
    lines.append(f"(b) memguard  before {_steps_line(steps[:pre])} | after the drop "
                 f"{_steps_line(post)}")
    lines.append(f"(c) memguard  after the rise {_steps_line(after_rise)}")
    settle = _settle(post, a_s)
    tp = _throughput(post[TARGETS["b_settle_steps"]:], a_s)
    f1 = post[0]["major_faults"] if post else None
    tail = max((s["major_faults"] for s in post[-3:]), default=None)
    faults = ratio(tail, f1)
    last = post[-1] if post else {}
    swap = ratio(last.get("swap_bytes"), last.get("rss_bytes"))
    low = min((s["micro"] for s in post), default=None)
    low_ratio = ratio(low, a_micro)
    full = mb["batch"]
    grown = next((i + 1 for i, s in enumerate(after_rise) if s["micro"] >= full), None)
    worst, bad = workload.boundary_bound(steps, TARGETS["boundary_factor"],
                                         TARGETS["boundary_slack"])
    b = {"settle_steps": settle, "throughput_ratio": tp, "faults_ratio": faults,
         "first_post_drop_faults": f1, "tail_faults": tail, "swap_share": swap,
         "min_micro": low, "min_micro_ratio": low_ratio}
    c = {"steps_to_full": grown}
    looked = bool(a_s and post)          # (a)'s speed and steps after the drop to judge
    v = {"b_settle_steps": _never(settle, TARGETS["b_settle_steps"], looked),
         "b_throughput": verdict(tp, TARGETS["b_throughput"], higher_is_better=True),
         "b_faults": share_verdict(tail, f1, TARGETS["b_faults"]),
         "b_swap_share": verdict(swap, TARGETS["b_swap_share"]),
         "b_min_micro": verdict(low_ratio, TARGETS["b_min_micro"], higher_is_better=True),
         "c_steps": _never(grown, TARGETS["c_steps"], bool(after_rise)),
         "boundary": "PASS" if worst is not None and bad == 0 else "OVER" if bad else "-"}
    n = TARGETS["b_settle_steps"]
    settled = (f"never settles (target: within {n} post-drop steps)" if settle is None and looked
               else f"settles after {fmt(settle, 'd')} post-drop step(s) (target <= {n})")
    lines.append(f"(b) {settled}  {v['b_settle_steps']}; throughput from post-drop step {n + 1} "
                 f"on {fmt(tp)}x of (a)'s (target >= {TARGETS['b_throughput']})  "
                 f"{v['b_throughput']}")
    lines.append(f"(b) major faults a step: first after the drop {fmt(f1, ',')}, the last three at "
                 f"most {fmt(tail, ',')} = {fmt(faults, '.4f')} of it (target <= "
                 f"{TARGETS['b_faults']} of it)  {v['b_faults']}")
    lines.append(f"(b) swap {last.get('swap_bytes', 0) / MiB:,.0f} MiB of RSS "
                 f"{last.get('rss_bytes', 0) / MiB:,.0f} MiB = {fmt(swap, '.3f')} (target <= "
                 f"{TARGETS['b_swap_share']})  {v['b_swap_share']}; smallest micro-batch "
                 f"{fmt(low, 'd')} against (a)'s {fmt(a_micro, 'd')} (target >= half)  "
                 f"{v['b_min_micro']}")
    back = ("never back to the whole batch after the rise" if grown is None and after_rise
            else f"whole batch again {fmt(grown, 'd')} step(s) after the rise")
    lines.append(f"(c) {back} (target <= {TARGETS['c_steps']} steps)  {v['c_steps']}")
    lines.append(f"boundaries: reserved at most {fmt(worst, '.3f')} of 1.25 x recent peak + "
                 f"64 MiB, {bad} over  {v['boundary']}")
    per_test[mb["nodeid"]] = {"settle_steps": settle, "throughput_vs_a": tp,
                              "steps_to_full_after_rise": grown}
    return {"b": b, "c": c, "boundary_worst": worst, "boundary_over": bad, "verdict": v}


def _memguard_d(md: dict, lines: list[str], per_test: dict) -> tuple[dict, dict]:
    """(d)'s figures and verdicts: whether its first step ran out of memory
    at the whole batch, and how many steps after the rise it is whole again."""
    pre, full, steps = md["d_pre"], md["batch"], md["steps"]
    after_rise = steps[pre:]
    first = steps[0] if steps else {}
    tried = first.get("tried") or []
    oom = bool(tried) and tried[0] >= full and first.get("micro", full) < full
    grown = next((i + 1 for i, s in enumerate(after_rise) if s["micro"] >= full), None)
    v = {"d_oom_at_start": "PASS" if oom else "FAIL" if steps else "-",
         "d_steps": _never(grown, TARGETS["d_steps"], bool(after_rise))}
    lines.append(f"(d) memguard  limit {md['d_limit'] / MiB:,.0f} MiB {_steps_line(steps[:pre])} | "
                 f"after the rise to {md['high'] / MiB:,.0f} MiB {_steps_line(after_rise)}")
    refused = first.get("arena_ooms")
    how = "" if refused is None else f"; {refused} refusal(s) by memguard's arena budget"
    start = (f"out of memory at {', '.join(map(str, tried))}, redone at {first.get('micro')}"
             f"{how}" if oom else
             f"no out-of-memory error at the whole batch ({full}): tried "
             f"{', '.join(map(str, tried)) or 'nothing'}, ran at {first.get('micro', '-')} "
             f"(the planner's reason: {first.get('reason', '-')}; 'high' or 'critical': "
             "pressure before any step, such as the host's stalls), the scenario did not "
             "happen")
    lines.append(f"(d) first step: {start}  {v['d_oom_at_start']}")
    back = ("never back to the whole batch after the rise" if grown is None and after_rise
            else f"whole batch again {fmt(grown, 'd')} step(s) after the rise")
    lines.append(f"(d) {back} (target <= {TARGETS['d_steps']} steps)  {v['d_steps']}")
    per_test[md["nodeid"]] = {"oom_at_start": oom, "steps_to_full_after_rise": grown}
    return {"oom_at_start": oom, "tried": tried, "steps_to_full": grown}, v


# -------------------------------------------------- (e) the validation loop
SECTION_E = "pressure_validation"
TITLE_E = ("pressure (e): a ViT-S/16 + LoRA validation loop under a memory cgroup with swap, "
           "the limit lowered while it runs")
TARGETS_E = {"e_settle_batches": 2, "e_throughput": 0.8, "e_vs_plain": 1.0,
             "e_swap_growth": 16 * MiB, "e_faults": 0.01}

#: (e): the model (its ``batch``: the validation batch), the limit before
#: the drop (the plain loop fits) and after it (it does not), the batches
#: before the drop and after it, the plain loop's time cap
FULL_E = {"model": workload.Model(batch=128), "high": 3000 * MiB, "limit": 800 * MiB,
          "pre": 3, "post": 5, "plain_max_s": 240}
QUICK_E = {"model": workload.Model(img=112, batch=128), "high": 3000 * MiB,
           "limit": 650 * MiB, "pre": 2, "post": 3, "plain_max_s": 90}


@pytest.mark.parametrize("mode", ["plain", "memguard"])
def test_validation_limit_lowered(benchmark, figures: Figures, quick: bool, swap,
                                  mode: str) -> None:
    """(e): a validation loop, the limit lowered below the plain loop's need
    after batch ``pre`` - 1."""
    figures.section(SECTION_E, TITLE_E, summarize_validation)
    s = QUICK_E if quick else FULL_E
    out: dict = {}
    benchmark.group = "pressure: whole run"
    benchmark.pedantic(lambda: out.update(r=workload.run_validation(
        mode, s["high"], [(s["pre"] - 1, s["limit"])], batches=s["pre"] + s["post"],
        model=s["model"], max_seconds=s["plain_max_s"] if mode == "plain" else None)),
        rounds=1, iterations=1)
    r: workload.Result = out["r"]
    if mode == "memguard" and r.returncode != 0:
        pytest.fail(f"memguard's run failed (status {r.returncode}):\n{r.stderr}")
    benchmark.extra_info.update(batches_done=len(r.steps), killed=r.killed)
    figures.record(SECTION_E, benchmark.fullname, {
        "mode": mode, "steps": r.steps, "killed": r.killed, "stopped_by_time": r.stopped_by_time,
        "batch": s["model"].batch, "img": s["model"].img, "high": s["high"],
        "limit": s["limit"], "pre": s["pre"], "post": s["post"]})


def _rate(batches: list[dict], batch: int) -> float | None:
    """Samples a second over ``batches``."""
    return ratio(batch * len(batches), sum(b["seconds"] for b in batches)) if batches else None


def _validation_line(r: dict) -> str:
    pre, steps = r["pre"], r["steps"]
    end = " (killed by the kernel)" if r["killed"] else \
        " (stopped: time cap)" if r["stopped_by_time"] else ""
    last = steps[-1] if steps else {}
    return (f"(e) {r['mode']:9} before {_steps_line(steps[:pre])} | after the drop "
            f"{_steps_line(steps[pre:]) or '-'}{end}; swap at the end "
            f"{last.get('swap_bytes', 0) / MiB:,.0f} MiB")


def summarize_validation(records: list[dict]) -> tuple[list[str], dict, dict]:
    """(e)'s lines, figures and verdicts (see the module's targets)."""
    by = {r["mode"]: r for r in records}
    first, t = records[0], TARGETS_E
    lines = [(f"batch {first['batch']} at {first['img']} px; limit "
              f"{first['high'] / MiB:,.0f} MiB, {first['limit'] / MiB:,.0f} MiB after batch "
              f"{first['pre'] - 1}; seconds@micro-batch per batch")]
    lines += [_validation_line(by[m]) for m in ("plain", "memguard") if m in by]
    data: dict = {"measured": True, "targets": t}
    per_test: dict[str, dict] = {}
    p, m = by.get("plain"), by.get("memguard")
    plain_post = _rate(p["steps"][p["pre"]:], p["batch"]) if p else None
    if m is None:
        return lines, data, per_test
    pre, batch, steps = m["pre"], m["batch"], m["steps"]
    post = steps[pre:]
    before = _rate(steps[1:pre] or steps[:pre], batch)
    settle = next((k for k in range(len(post))
                   if (ratio(_rate(post[k:], batch), before) or 0) >= t["e_throughput"]), None)
    n = t["e_settle_batches"]
    tp = ratio(_rate(post[n:], batch), before)
    vs_plain = ratio(_rate(post, batch), plain_post)
    swap = [b.get("swap_bytes", 0) for b in post[n:]]
    growth = swap[-1] - swap[0] if swap else None
    f1 = post[0]["major_faults"] if post else None
    tail = max((b["major_faults"] for b in post[-2:]), default=None)
    micros = [b["micro"] for b in post]
    e = {"settle_batches": settle, "throughput_ratio": tp, "vs_plain": vs_plain,
         "plain_post_rate": plain_post, "memguard_post_rate": _rate(post, batch),
         "pre_rate": before, "swap_growth_bytes": growth, "first_post_drop_faults": f1,
         "tail_faults": tail, "micro_batches": micros}
    v = {"e_settle_batches": _never(settle, n, bool(before and post)),
         "e_throughput": verdict(tp, t["e_throughput"], higher_is_better=True),
         "e_vs_plain": verdict(vs_plain, t["e_vs_plain"], higher_is_better=True),
         "e_swap_growth": verdict(growth, t["e_swap_growth"]),
         "e_faults": share_verdict(tail, f1, t["e_faults"])}
    settled = ("never settles" if settle is None else
               f"settles after {fmt(settle, 'd')} post-drop batch(es)")
    lines.append(f"(e) memguard {settled} (target <= {n})  {v['e_settle_batches']}; "
                 f"throughput from post-drop batch {n + 1} on "
                 f"{fmt(tp)}x its own before the drop (target >= {t['e_throughput']})  "
                 f"{v['e_throughput']}")
    lines.append(f"(e) after the drop memguard {fmt(e['memguard_post_rate'])} samples/s, plain "
                 f"{fmt(plain_post)}: {fmt(vs_plain)}x (target >= {t['e_vs_plain']:.0f}x)  "
                 f"{v['e_vs_plain']}; micro-batches {micros}")
    lines.append(f"(e) memguard's swap grows {fmt(growth and growth / MiB, ',.0f')} MiB from "
                 f"post-drop batch {n + 1} to the last (target <= "
                 f"{t['e_swap_growth'] / MiB:.0f})  {v['e_swap_growth']}; major faults: first "
                 f"after the drop {fmt(f1, ',')}, the last two at most {fmt(tail, ',')} (target "
                 f"<= {t['e_faults']} of it)  {v['e_faults']}")
    data.update(e=e, verdict=v)
    per_test[m["nodeid"]] = {"settle_batches": settle, "vs_plain": vs_plain}
    for r in records:     # each batch's seconds and size, in the JSON
        per_test.setdefault(r["nodeid"], {}).update(
            batch_seconds=[round(b["seconds"], 2) for b in r["steps"]],
            batch_micro=[b["micro"] for b in r["steps"]])
    return lines, data, per_test
def _workers_f(pf: dict | None, mf: dict | None, lines: list[str],
               per_test: dict) -> tuple[dict, dict]:
    """(f)'s figures and verdicts: each run's steps with the workers' memory,
    memguard's throughput against the plain loop's, and its advice."""
    first = pf or mf
    lines.append(f"(f) limit {first['f_limit'] / MiB:,.0f} MiB from the start, "
                 f"{first['f_workers']} DataLoader workers of "
                 f"{first['f_worker_bytes'] / MiB:,.0f} MiB each")
    for r in (pf, mf):
        if r:
            end = " (killed by the kernel)" if r["killed"] else \
                " (stopped: time cap)" if r["stopped_by_time"] else ""
            last = r["steps"][-1] if r["steps"] else {}
            lines.append(f"(f) {r['mode']:9} {_steps_line(r['steps'])}{end}; workers "
                         f"{last.get('children', '-')} holding "
                         f"{(last.get('children_bytes') or 0) / MiB:,.0f} MiB, swap at the end "
                         f"{last.get('swap_bytes', 0) / MiB:,.0f} MiB")
    tp = ratio(_median_s(pf["steps"]), _median_s(mf["steps"])) if pf and mf else None
    advice = next((s["advice"] for s in mf["steps"] if s.get("advice")), None) if mf else None
    named = advice is not None and f"{mf['f_workers']} DataLoader workers" in advice
    v = {"f_throughput": verdict(tp, TARGETS["f_throughput"], higher_is_better=True),
         "f_advice": "PASS" if named else "FAIL" if mf and mf["steps"] else "-"}
    lines.append(f"(f) memguard / plain throughput {fmt(tp)}x (target >= "
                 f"{TARGETS['f_throughput']:.0f}x)  {v['f_throughput']}")
    lines.append(f"(f) memguard's advice: {advice or 'none'}  {v['f_advice']}")
    if mf:
        per_test[mf["nodeid"]] = {"throughput_vs_plain": tp, "advice": advice}
    return {"throughput_ratio": tp, "advice": advice,
            "memguard_micro": [s["micro"] for s in mf["steps"]] if mf else None}, v


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "--benchmark-only", *sys.argv[1:]]))
