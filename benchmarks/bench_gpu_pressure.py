"""GPU pressure: a ViT trained beside another process that holds device
memory, the plain loop, hand-written accumulation and memguard side by side.

A second process, the *holder*, allocates device memory until the device
has a set amount free, and takes more or gives it back on a command over
its pipe (``hold``, ``release``). The training process is a ``transformers``
``ViTForImageClassification`` (random init from a ``ViTConfig``; ViT-B/16,
batch 256 at 224 px, AdamW, bfloat16 autocast; where ``transformers`` is
not installed, the same ViT written with torch.nn, as the summary says).
Each configuration is one run in a fresh process; pytest-benchmark times
the run, and the figures are its steps, timed in the worker (each step
reads its loss, as a loop would; the device is synchronised before the
first and after the last step of a run).

The free memory under pressure is what the trainer may still take once its
model is on the device: room for its gradients and AdamW's state and
``room_share`` (0.75) of the whole batch's activations, calibrated from the
plain loop's peak reserved bytes at the whole batch (``free=`` sets it).

Scenarios:

1. **No pressure**: the plain loop and memguard, each in its own process,
   runs of ``burst`` steps alternated (which goes first alternates too).
   Target: memguard / plain at most 1.02 (the median of the paired ratios).
2. **Under pressure** (the free memory as above): the plain loop (expected
   to run out of memory: a plain loop that fits means the pressure did not
   bind, and the other figures mean nothing: FAIL); hand-written
   accumulation at each even split of the batch, fewest micro-batches first
   (256: 128 x 2, 86 x 3, 64 x 4, 52 x 5, ...) until one fits, and
   ``extra_splits`` more (at most ``max_split`` micro-batches): the best one
   that fits is the reference; memguard
   with ``Guard(budget=None, cuda_budget="auto")``. Target: memguard's
   settled throughput (from its step ``settle`` on) at least 0.95x the
   reference's (from its second step on).
3. **Freed mid-run**: under pressure for ``event_after`` steps, then the
   holder gives back everything. Target: memguard runs the whole batch in
   one micro-batch within 2 steps of the rise.
4. **Taken mid-run**: under pressure for ``event_after`` steps, then the
   holder takes all but ``take_leave`` of what is free. Targets: every step
   completes, and the throughput after the take (from its second step on)
   at least 0.95x the reference's.

Every memguard run of every scenario finishes each step it is given (FAIL
otherwise), and writes its telemetry (``Guard(telemetry=...)``) to
``$OUT/gpu-pressure/<scenario>.jsonl`` (``OUT`` defaults to ``out``), for a
planner-trace fixture.

``--bench-quick`` keeps the model and the batch and runs fewer steps (a
couple of minutes on an H100); ``--bench-gpu-pressure key=value,...`` sets
any of the settings below (``batch=128,hidden=384,heads=6,free=12GiB``).
Without a CUDA device the benchmarks skip and the summary says why.

    pytest benchmarks/bench_gpu_pressure.py --benchmark-only [--bench-quick]
    python benchmarks/bench_gpu_pressure.py [pytest options]   (the same)
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import time
from typing import Any

import pytest

from benchlib import (
    Figures,
    Worker,
    fmt,
    median,
    paired_median,
    pedantic_paired,
    ratio,
    require_cuda,
    serve,
    verdict,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

MiB, GiB = 1 << 20, 1 << 30
SECTION = "gpu_pressure"
TITLE = "GPU pressure: ViT training beside a process that holds device memory"
NOT_MEASURED = ("not measured: no CUDA device here; run `pytest benchmarks/bench_gpu_pressure.py "
                "--benchmark-only` on a machine with an NVIDIA GPU")
TARGETS = {"no_pressure": 1.02, "throughput": 0.95, "steps_to_whole": 2, "take_throughput": 0.95}

#: The model (ViT-B/16), the batch, the pressure and the runs' lengths: the
#: full run, and --bench-quick (the same model and batch, fewer steps).
FULL = {"batch": 256, "image": 224, "patch": 16, "hidden": 768, "layers": 12, "heads": 12,
        "classes": 1000, "room_share": 0.75, "free": 0, "slack": 512 * MiB,
        "take_leave": 256 * MiB, "steps": 16, "split_steps": 8, "extra_splits": 1, "max_split": 16,
        "settle": 3,
        "event_after": 6, "after_event": 8, "warmup": 3, "rounds": 12, "burst": 3}
QUICK = dict(FULL, steps=8, split_steps=4, extra_splits=0, event_after=4, after_event=4,
             warmup=2, rounds=6, burst=2)


# ----------------------------------------------------------------- the holder
class FakeDevice:
    """A device of ``total`` bytes that only counts (the holder's protocol,
    tested without a GPU)."""

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0

    def free(self) -> int:
        return self.total - self.used

    def alloc(self, n: int) -> Any:
        self.used += n
        return n

    def release(self, block: Any) -> None:
        self.used -= block


class CudaDevice:
    """The current CUDA device, through torch's allocator: a block is a
    tensor, given back to the driver at once."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        torch.cuda.init()

    def free(self) -> int:
        return int(self.torch.cuda.mem_get_info()[0])

    def alloc(self, n: int) -> Any:
        try:
            return self.torch.empty(n, dtype=self.torch.uint8, device="cuda")
        except self.torch.cuda.OutOfMemoryError:
            return None

    def release(self, block: Any) -> None:
        del block
        self.torch.cuda.empty_cache()


class Holder:
    """Holds device memory so that the device has a set amount free.

    Args:
        device: what it allocates from (:class:`CudaDevice`, :class:`FakeDevice`).
        chunk: the largest block it allocates at once (blocks are given back
            whole, last first).
        tolerance: how far from the target the device's free memory may end.
    """

    def __init__(self, device: Any, chunk: int = GiB, tolerance: int = 32 * MiB) -> None:
        self.device, self.chunk, self.tolerance = device, chunk, tolerance
        self.blocks: list[tuple[Any, int]] = []

    @property
    def held(self) -> int:
        return sum(n for _, n in self.blocks)

    def hold(self, free: int) -> dict:
        """Allocate or give back until ``free`` bytes are free on the device
        (within the tolerance, or as near as it can: all given back, or
        nothing more to take)."""
        for _ in range(256):
            now = self.device.free()
            if now > free + self.tolerance:
                n = min(now - free, self.chunk)
                block = self.device.alloc(n)
                if block is None:          # another process took it meanwhile
                    break
                self.blocks.append((block, n))
            elif now < free - self.tolerance and self.blocks:
                block, _ = self.blocks.pop()
                self.device.release(block)
            else:
                break
        return {"free": self.device.free(), "held": self.held, "target": free}

    def release(self) -> dict:
        """Give everything back."""
        while self.blocks:
            block, _ = self.blocks.pop()
            self.device.release(block)
        return {"free": self.device.free(), "held": 0}


def holder_worker(spec: str) -> dict:
    """The holder process: ``cuda`` or ``fake:BYTES``."""
    device = FakeDevice(int(spec[5:])) if spec.startswith("fake:") else CudaDevice()
    h = Holder(device)
    return {"hold": lambda free: h.hold(int(free)), "release": h.release,
            "free": lambda: {"free": device.free(), "held": h.held}}


# ---------------------------------------------------------------- the trainer
def even_split(n: int, k: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``k`` micro-batches of ``n`` samples whose sizes
    differ by at most one, the larger first (256 in 3: 86, 85, 85)."""
    q, r = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        stop = start + q + (i < r)
        out.append((start, stop))
        start = stop
    return out


def build_vit(torch: Any, s: dict) -> tuple[Any, str]:
    """The ViT, and what it is: ``transformers``' ``ViTForImageClassification``
    from a ``ViTConfig`` (random init), or the same shape in torch.nn where
    ``transformers`` is not installed."""
    try:
        import transformers
    except ImportError:
        from bench_cuda import build_model

        model = build_model(torch, s["hidden"], s["layers"], s["heads"], s["image"],
                            s["patch"], s["classes"])
        return model, "torch.nn ViT (transformers is not installed)"
    cfg = transformers.ViTConfig(
        image_size=s["image"], patch_size=s["patch"], hidden_size=s["hidden"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        intermediate_size=4 * s["hidden"], num_labels=s["classes"])
    return (transformers.ViTForImageClassification(cfg),
            f"transformers {transformers.__version__} ViTForImageClassification")


def trainer_worker(mode: str, n_micro: int = 1, telemetry: str = "", **s: Any) -> dict:
    """The training process: ``plain`` (the whole batch), ``split`` (hand-
    written accumulation over ``n_micro`` even micro-batches) or
    ``memguard``; its commands."""
    import torch

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model, kind = build_vit(torch, s)
    model.to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n = s["batch"]
    x = torch.randn(n, 3, s["image"], s["image"], device=dev)
    y = torch.randint(0, s["classes"], (n,), device=dev)
    torch.cuda.synchronize()
    setup_reserved = torch.cuda.memory_reserved(dev)
    cross_entropy = torch.nn.functional.cross_entropy
    guard = None
    if mode == "memguard":
        import memguard

        guard = memguard.Guard(budget=None, cuda_budget="auto", telemetry=telemetry or None)
        guard.install()
        atexit.register(guard.uninstall)     # the telemetry file is closed at exit
    parts = even_split(n, n_micro)
    done = {"steps": 0}

    def loss_of(xb: Any, yb: Any) -> Any:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(xb)
        return cross_entropy(getattr(out, "logits", out).float(), yb)

    def hand_written() -> dict:
        opt.zero_grad(set_to_none=True)
        if len(parts) == 1:                  # the plain loop
            loss = loss_of(x, y)
            loss.backward()
            opt.step()
            return {"loss": loss.item(), "micro": n, "n_micro": 1, "retries": 0}
        total = None
        for a, b in parts:
            loss = loss_of(x[a:b], y[a:b])
            (loss * ((b - a) / n)).backward()
            term = loss.detach() * (b - a)
            total = term if total is None else total + term
        opt.step()
        return {"loss": (total / n).item(), "micro": parts[0][1], "n_micro": len(parts),
                "retries": 0}

    def guarded() -> dict:
        res = guard.step((x, y), lambda b: loss_of(*b), opt)
        return {"loss": res.loss, "micro": res.micro_batch, "n_micro": res.n_micro,
                "retries": res.retries}

    step = guarded if guard is not None else hand_written

    def attempt() -> dict:
        """One step; ``ok`` False where it ran out of memory (the plain loop
        would stop there; memguard's gave up)."""
        try:
            return dict(step(), ok=True)
        except RuntimeError as exc:
            if not (isinstance(exc, torch.cuda.OutOfMemoryError) or
                    type(exc).__name__ in ("GuardOOMError", "OptimizerOOMError")):
                raise
            why = f"{type(exc).__name__}: {str(exc)[:200]}"
        opt.zero_grad(set_to_none=True)      # outside the except block: its frames are gone
        torch.cuda.empty_cache()
        return {"ok": False, "error": why}

    def run(steps: int) -> dict:
        """``steps`` steps, each timed to the end of the next (the device
        synchronised before the first and after the last); stops at the
        first that fails."""
        out: list[dict] = []
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(steps):
            rec = attempt()
            if i == steps - 1 or not rec["ok"]:
                torch.cuda.synchronize()    # the last step's update is in its time
            now = time.perf_counter()
            out.append(dict(rec, step=done["steps"], seconds=now - t))
            done["steps"] += 1
            t = now
            if not rec["ok"]:
                break
        return {"steps": out}

    def info() -> dict:
        st = torch.cuda.memory_stats(dev)
        free, total = torch.cuda.mem_get_info(dev)
        return {"device_name": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                "model": kind, "params": sum(p.numel() for p in model.parameters()),
                "param_bytes": sum(p.nbytes for p in model.parameters()),
                "setup_reserved_bytes": setup_reserved,
                "reserved_peak_bytes": torch.cuda.max_memory_reserved(dev),
                "allocated_peak_bytes": torch.cuda.max_memory_allocated(dev),
                "num_ooms": st.get("num_ooms", 0), "num_alloc_retries":
                    st.get("num_alloc_retries", 0), "device_free_bytes": free,
                "device_total_bytes": total}

    return {"run": run, "info": info}


# ------------------------------------------------------------- benchmarks
@pytest.fixture(scope="module")
def gpu(figures: Figures) -> None:
    require_cuda(figures, SECTION, TITLE, NOT_MEASURED)


def parse_settings(base: dict, text: str | None) -> dict:
    """``base`` with ``key=value,...`` set (sizes as ``12GiB`` or bytes).

    Raises:
        ValueError: a key that is not a setting, or a bad value.
    """
    out = dict(base)
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in base:
            raise ValueError(f"--bench-gpu-pressure: no setting {key!r} (settings: "
                             f"{', '.join(sorted(base))})")
        if isinstance(base[key], float):
            out[key] = float(value)
        elif key in ("free", "slack", "take_leave"):
            from memguard.telemetry.budget import parse_budget

            out[key] = int(parse_budget(value.strip(), total=1 << 50))
        else:
            out[key] = int(value)
    return out


@pytest.fixture(scope="module")
def settings(quick: bool, request: pytest.FixtureRequest) -> dict:
    return parse_settings(QUICK if quick else FULL,
                          request.config.getoption("--bench-gpu-pressure"))


@pytest.fixture(scope="module")
def holder(gpu: None):
    with Worker(__file__, ["holder", "cuda"]) as w:
        yield w


@pytest.fixture(scope="module")
def state() -> dict:
    """What the scenarios share: the calibration and the pressure level."""
    return {}


def _out_dir() -> str:
    path = os.path.join(os.environ.get("OUT", "out"), "gpu-pressure")
    os.makedirs(path, exist_ok=True)
    return path


def _trainer(settings: dict, mode: str, n_micro: int = 1, scenario: str = "",
             wait: bool = True) -> Worker:
    cfg = dict(settings, n_micro=n_micro)
    if mode == "memguard":
        cfg["telemetry"] = os.path.join(_out_dir(), f"{scenario}.jsonl")
        if os.path.exists(cfg["telemetry"]):
            os.remove(cfg["telemetry"])
    return Worker(__file__, ["trainer", mode, json.dumps(cfg)], wait=wait)


def _level(state: dict, settings: dict, holder: Worker) -> int:
    """The free memory under pressure (see the module docs): calibrated
    from the plain loop's peak at the whole batch, once."""
    if "level" in state:
        return state["level"]
    if settings["free"]:
        state["level"] = settings["free"]
        return state["level"]
    if "calibration" not in state:
        holder.call("release")
        with _trainer(settings, "plain") as w:
            w.call("run", steps=2)
            state["calibration"] = w.call("info")
    cal = state["calibration"]
    fixed = 3 * cal["param_bytes"]          # gradients and AdamW's two moments
    acts = max(0, cal["reserved_peak_bytes"] - cal["setup_reserved_bytes"] - fixed)
    state["level"] = int(fixed + settings["room_share"] * acts + settings["slack"])
    return state["level"]


def _under_pressure(settings: dict, state: dict, holder: Worker, mode: str, steps: int,
                    n_micro: int = 1, scenario: str = "pressure",
                    event: tuple[int, int | None] | None = None) -> dict:
    """One run in a fresh process, the device's free memory at the level
    once its model is there; ``event``: after that many steps the holder
    holds so that that much is free (``None``: gives everything back)."""
    level = _level(state, settings, holder)
    holder.call("release")
    with _trainer(settings, mode, n_micro, scenario) as w:
        held = holder.call("hold", free=level)
        first = event[0] if event else steps
        recs = w.call("run", steps=first)["steps"]
        after = None
        if event and recs and recs[-1]["ok"]:
            after = holder.call("release") if event[1] is None else \
                holder.call("hold", free=event[1])
            recs += w.call("run", steps=steps - first)["steps"]
        info = w.call("info")
    holder.call("release")
    return {"scenario": scenario, "mode": mode, "n_micro": n_micro, "steps": recs,
            "planned": steps, "level": level, "free_at_start": held["free"],
            "event_after": event[0] if event else None,
            "free_after_event": after and after["free"], "info": info, "settings": settings}


def _record(benchmark, figures: Figures, rec: dict) -> dict:
    figures.record(SECTION, benchmark.fullname, rec)
    benchmark.extra_info.update(scenario=rec["scenario"], mode=rec.get("mode"))
    return rec


def test_no_pressure(benchmark, figures: Figures, settings: dict, holder: Worker,
                     state: dict) -> None:
    """The plain loop and memguard alternated, nothing held."""
    figures.section(SECTION, TITLE, summarize)
    holder.call("release")
    s = settings
    plain = _trainer(s, "plain", wait=False)         # the two start side by side
    guarded = _trainer(s, "memguard", scenario="no-pressure", wait=False)
    try:
        for w in (plain, guarded):
            w.wait_ready()
            w.call("run", steps=s["warmup"])

        def burst(w: Worker) -> float:
            return sum(x["seconds"] for x in w.call("run", steps=s["burst"])["steps"])

        benchmark.group = "gpu pressure: runs"
        own, base = pedantic_paired(benchmark, lambda: burst(guarded), lambda: burst(plain),
                                    rounds=s["rounds"])
        state["calibration"] = plain.call("info")
        info = guarded.call("info")
    finally:
        plain.close()
        guarded.close()
    _record(benchmark, figures, {"scenario": "no_pressure", "memguard_burst_s": own,
                                 "plain_burst_s": base, "settings": s,
                                 "info": state["calibration"], "memguard_info": info})


@pytest.mark.parametrize("mode", ["plain", "split", "memguard"])
def test_under_pressure(benchmark, figures: Figures, settings: dict, holder: Worker,
                        state: dict, mode: str) -> None:
    """The batch does not fit the free memory: the plain loop, hand-written
    accumulation at even splits, memguard."""
    figures.section(SECTION, TITLE, summarize)
    s = settings
    benchmark.group = "gpu pressure: runs"
    out: dict = {}
    if mode != "split":
        steps = s["steps"]
        benchmark.pedantic(lambda: out.update(r=_under_pressure(s, state, holder, mode, steps)),
                           rounds=1, iterations=1)
        rec = _record(benchmark, figures, out["r"])
        if mode == "memguard" and not _completed(rec):
            pytest.fail(f"memguard's run under pressure failed: {rec['steps'][-1]}")
        return

    def splits() -> list[dict]:
        runs, fits = [], 0
        for k in range(2, min(s["batch"], s["max_split"]) + 1):
            r = _under_pressure(s, state, holder, "split", s["split_steps"], n_micro=k)
            runs.append({"n_micro": k, "micro": even_split(s["batch"], k)[0][1],
                         "steps": r["steps"], "fits": _completed(r)})
            fits += runs[-1]["fits"]
            if fits > s["extra_splits"]:
                break
        return runs

    benchmark.pedantic(lambda: out.update(runs=splits()), rounds=1, iterations=1)
    _record(benchmark, figures, {"scenario": "pressure", "mode": "split", "splits": out["runs"],
                                 "level": state["level"], "settings": s})


@pytest.mark.parametrize("scenario", ["freed", "taken"])
def test_mid_run(benchmark, figures: Figures, settings: dict, holder: Worker, state: dict,
                 scenario: str) -> None:
    """memguard under pressure, then the holder gives everything back
    (``freed``) or takes what is free (``taken``)."""
    figures.section(SECTION, TITLE, summarize)
    s = settings
    event = (s["event_after"], None if scenario == "freed" else s["take_leave"])
    out: dict = {}
    benchmark.group = "gpu pressure: runs"
    benchmark.pedantic(lambda: out.update(r=_under_pressure(
        s, state, holder, "memguard", s["event_after"] + s["after_event"], scenario=scenario,
        event=event)), rounds=1, iterations=1)
    rec = _record(benchmark, figures, out["r"])
    if not _completed(rec):
        pytest.fail(f"memguard's run ({scenario}) failed: {rec['steps'][-1]}")


# ------------------------------------------------------------------ summary
def _completed(rec: dict) -> bool:
    """Whether a run finished every step it was given."""
    steps = rec["steps"]
    return len(steps) == rec.get("planned", len(steps)) and all(x["ok"] for x in steps)


def _throughput(steps: list[dict], batch: int) -> float | None:
    """Samples a second over ``steps`` (``None`` for none, or a failed one)."""
    if not steps or not all(x["ok"] for x in steps):
        return None
    return batch * len(steps) / sum(x["seconds"] for x in steps)


def _steps_line(steps: list[dict]) -> str:
    return " ".join(f"{x['seconds'] * 1e3:.0f}ms@{x['micro']}x{x['n_micro']}" if x["ok"]
                    else "OOM" for x in steps)


def _never(value: int | None, target: int, measured: bool) -> str:
    """A step count's verdict, ``None`` meaning never: OVER when it was
    looked for, '-' when there was nothing to look at."""
    if value is None:
        return "OVER" if measured else "-"
    return verdict(value, target)


def summarize(records: list[dict]) -> tuple[list[str], dict, dict]:
    """The scenarios' figures and verdicts (see the module docs)."""
    lines: list[str] = []
    data: dict = {"measured": True, "targets": TARGETS, "verdict": {}}
    per_test: dict[str, dict] = {}
    v = data["verdict"]
    by = {(r["scenario"], r.get("mode")): r for r in records}
    s = records[0]["settings"]
    batch = s["batch"]
    info = next((r["info"] for r in records if "info" in r), None)
    if info:
        lines.append(f"{info['device_name']}, torch {info['torch']}, {info['model']} "
                     f"(hidden {s['hidden']}, {s['layers']} layers, patch {s['patch']}), "
                     f"{info['params'] / 1e6:.1f} M params, batch {batch} x {s['image']} px, "
                     f"bf16 autocast, AdamW")
    level = next((r["level"] for r in records if "level" in r), None)
    if level is not None:
        lines.append(f"under pressure: {level / GiB:.2f} GiB free once the model is on the "
                     f"device; ms@micro-batch x count per step")
    _no_pressure(by.get(("no_pressure", None)), lines, data, per_test)
    plain = by.get(("pressure", "plain"))
    if plain:
        oom = next((x["step"] for x in plain["steps"] if not x["ok"]), None)
        v["pressure_binds"] = "PASS" if oom is not None else "FAIL"
        lines.append(f"plain loop     {_steps_line(plain['steps'])}: " + (
            f"out of memory at step {oom}, as expected  PASS" if oom is not None else
            "every step fit: the pressure did not bind, the figures below mean nothing  FAIL"))
    ref = _reference(by.get(("pressure", "split")), batch, lines, data)
    mg = by.get(("pressure", "memguard"))
    if mg:
        tp = _throughput(mg["steps"][s["settle"]:], batch)
        r = ratio(tp, ref)
        data["pressure"] = {"throughput": tp, "ratio": r, "completed": _completed(mg)}
        v["throughput"] = verdict(r, TARGETS["throughput"], higher_is_better=True)
        per_test[mg["nodeid"]] = {"throughput_vs_reference": r}
        lines.append(f"memguard       {_steps_line(mg['steps'])}")
        lines.append(f"  settled throughput (from step {s['settle']}) {fmt(r, '.3f')}x the best "
                     f"hand-written accumulation that fits (target >= "
                     f"{TARGETS['throughput']})  {v['throughput']}")
    _mid_run(by.get(("freed", "memguard")), by.get(("taken", "memguard")), ref, batch, lines,
             data, per_test)
    runs = [r for r in (mg, by.get(("freed", "memguard")), by.get(("taken", "memguard"))) if r]
    if runs:
        done = all(_completed(r) for r in runs)
        v["completed"] = "PASS" if done else "FAIL"
        lines.append(f"memguard's runs finished every step  {v['completed']}")
    return lines, data, per_test


def _no_pressure(rec: dict | None, lines: list[str], data: dict, per_test: dict) -> None:
    if not rec:
        return
    ratios, med = paired_median(rec["memguard_burst_s"], rec["plain_burst_s"])
    burst = rec["settings"]["burst"]
    plain_ms = median(rec["plain_burst_s"])
    mg_ms = median(rec["memguard_burst_s"])
    data["no_pressure"] = {"ratio": med, "paired_ratios": ratios,
                           "plain_step_s": plain_ms and plain_ms / burst,
                           "memguard_step_s": mg_ms and mg_ms / burst}
    data["verdict"]["no_pressure"] = verdict(med, TARGETS["no_pressure"])
    per_test[rec["nodeid"]] = {"ratio": med}
    lines.append(f"no pressure    plain {fmt(plain_ms and plain_ms / burst * 1e3, '.1f')} ms, "
                 f"memguard {fmt(mg_ms and mg_ms / burst * 1e3, '.1f')} ms a step; memguard / "
                 f"plain {fmt(med, '.3f')} (median of {len(ratios)} paired runs of {burst} "
                 f"steps, {fmt(min(ratios, default=None), '.3f')}-"
                 f"{fmt(max(ratios, default=None), '.3f')}; target <= "
                 f"{TARGETS['no_pressure']})  {data['verdict']['no_pressure']}")


def _reference(rec: dict | None, batch: int, lines: list[str], data: dict) -> float | None:
    """The best throughput of the hand-written splits that fit (from their
    second step on)."""
    if not rec:
        return None
    best = None
    for run in rec["splits"]:
        tp = _throughput(run["steps"][1:], batch) if run["fits"] else None
        lines.append(f"hand-written   {run['micro']} x {run['n_micro']}: "
                     f"{_steps_line(run['steps'])}" +
                     (f" ({tp:.1f} samples/s)" if tp else " (does not fit)"))
        if tp and (best is None or tp > best[0]):
            best = (tp, run["n_micro"])
    data["reference"] = {"throughput": best and best[0], "n_micro": best and best[1]}
    if best is None:
        lines.append("hand-written   no split fits: no reference")
    return best and best[0]


def _mid_run(freed: dict | None, taken: dict | None, ref: float | None, batch: int,
             lines: list[str], data: dict, per_test: dict) -> None:
    v = data["verdict"]
    if freed:
        k = freed["event_after"]
        post = freed["steps"][k:]
        grown = next((i + 1 for i, x in enumerate(post) if x["ok"] and x["n_micro"] == 1), None)
        data["freed"] = {"steps_to_whole": grown}
        v["steps_to_whole"] = _never(grown, TARGETS["steps_to_whole"], bool(post))
        per_test[freed["nodeid"]] = {"steps_to_whole": grown}
        lines.append(f"freed          {_steps_line(freed['steps'][:k])} | all given back: "
                     f"{_steps_line(post)}")
        lines.append("  " + (f"the whole batch {grown} step(s) after the rise" if grown else
                             "never the whole batch after the rise") +
                     f" (target <= {TARGETS['steps_to_whole']})  {v['steps_to_whole']}")
    if taken:
        k = taken["event_after"]
        post = taken["steps"][k:]
        tp = _throughput(post[1:], batch)
        r = ratio(tp, ref)
        data["taken"] = {"throughput": tp, "ratio": r, "completed": _completed(taken)}
        v["take_throughput"] = verdict(r, TARGETS["take_throughput"], higher_is_better=True)
        if not _completed(taken):
            v["take_throughput"] = "FAIL"
        per_test[taken["nodeid"]] = {"throughput_vs_reference": r}
        left = taken.get("free_after_event")
        lines.append(f"taken          {_steps_line(taken['steps'][:k])} | "
                     f"{fmt(left and left / MiB, ',.0f')} MiB left free: {_steps_line(post)}")
        lines.append(f"  throughput after the take {fmt(r, '.3f')}x the reference (target >= "
                     f"{TARGETS['take_throughput']})  {v['take_throughput']}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        role, *rest = sys.argv[2:]
        if role == "holder":
            raise SystemExit(serve(lambda: holder_worker(rest[0])))
        raise SystemExit(serve(lambda: trainer_worker(rest[0], **json.loads(rest[1]))))
    raise SystemExit(pytest.main([__file__, "--benchmark-only", *sys.argv[1:]]))
