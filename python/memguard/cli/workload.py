"""A real training workload under a real memory limit: a ViT with LoRA
adapters (peft, where it is installed), random init, on random images,
trained by a plain loop or through ``memguard.Guard``. ``memguard demo``, the
pressure benchmark (``benchmarks/bench_pressure.py``) and the tests that put
a run under a limit use it.

The worker (``python -m memguard.cli.workload --mode plain|memguard ...``)
prints one JSON line per step: its time, micro-batch, major faults, swap,
RSS and memguard's figures; with ``--telemetry`` it also writes its samples
(and the guard's decisions) to a JSONL file. The driver (:func:`run`)
starts it, inside a memory cgroup (:mod:`memguard.memory.limits`) when given a
limit, changes the limit after given steps, and returns the steps; a worker
the kernel kills is a result too.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import time
from typing import Any

from memguard._common import MiB
from memguard.telemetry.events import Event

#: where this memguard is imported from: the worker imports the same one
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Model:
    """The ViT: images of ``img`` px in ``patch`` px patches, ``depth``
    blocks of width ``dim``; LoRA of rank 8 on every linear of the blocks."""
    img: int = 224
    patch: int = 16
    dim: int = 384
    depth: int = 12
    heads: int = 6
    batch: int = 32

    def args(self) -> list[str]:
        return [f"--{k}={v}" for k, v in dataclasses.asdict(self).items()]


#: ViT-S/16 at 224 px, batch 32: the story's model (its plain loop peaks at
#: about 4.4 GB under glibc, memguard's at about 3 GB)
VIT_S16 = Model()


@dataclasses.dataclass
class Result:
    """What one run did: its steps (the worker's records), the limits it
    ran under (``(after_step, bytes)``), whether the kernel killed it, and
    its exit status."""
    mode: str
    steps: list[dict]
    schedule: list[tuple[int, int]]
    killed: bool = False
    returncode: int | None = None
    stopped_by_time: bool = False
    stderr: str = ""

    def after(self, step: int) -> list[dict]:
        """The steps after step ``step`` (-1: all)."""
        return [s for s in self.steps if s["step"] > step]


def run(mode: str, limit: int | None, schedule: list[tuple[int, int]] = (), *, steps: int,
        model: Model = VIT_S16, max_seconds: float | None = None, threads: int = 2,
        timeout_s: float = 900, telemetry: str | None = None, budget: str = "auto",
        on_step: Any = None, workers: int = 0, worker_bytes: int = 0,
        worker_args: list[str] = ()) -> Result:
    """Train ``steps`` steps of ``model`` in ``mode`` (``"plain"`` or
    ``"memguard"``, with ``Guard(budget=budget)``), inside a new memory
    cgroup with ``limit`` bytes (``None``: none); the limit becomes ``b``
    once step ``k`` is done, for each ``(k, b)`` of ``schedule``. A plain
    run that swaps may take minutes a step: ``max_seconds`` stops it after
    the first step past that time. ``telemetry``: samples (and memguard's
    decisions) go to this ``.jsonl``. ``on_step(record)`` is called with each
    step's record as it arrives. ``workers``: DataLoader workers that each
    hold ``worker_bytes`` of their own (:func:`_batches`). ``worker_args`` go
    on the worker's command line (:func:`run_validation` passes its task there).

    Raises:
        memguard.memory.limits.LimitUnavailable: no memory cgroup can be made here.
    """
    from memguard.memory.limits import MemoryLimit

    cmd = [sys.executable, "-u", "-m", "memguard.cli.workload", f"--mode={mode}",
           f"--steps={steps}", f"--threads={threads}", f"--budget={budget}", *model.args(),
           *worker_args]
    if telemetry:
        cmd.append(f"--telemetry={os.path.abspath(telemetry)}")
    cmd += _workers_args(workers, worker_bytes)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT, env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    env.pop("LD_PRELOAD", None)
    result = Result(mode=mode, steps=[], schedule=[(-1, limit or 0), *schedule])
    todo = sorted(schedule)
    with MemoryLimit(limit) if limit else contextlib.nullcontext() as cg:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        if cg is not None:
            cg.add(proc.pid)    # before it has imported anything much
        t0 = time.monotonic()
        try:
            for line in proc.stdout:
                rec = json.loads(line)
                result.steps.append(rec)
                if on_step is not None:
                    on_step(rec)
                while cg is not None and todo and todo[0][0] <= rec["step"]:
                    cg.set(todo.pop(0)[1])
                if max_seconds is not None and time.monotonic() - t0 > max_seconds \
                        and len(result.steps) < steps:
                    result.stopped_by_time = True
                    proc.kill()
                    break
                if time.monotonic() - t0 > timeout_s:
                    proc.kill()
                    raise TimeoutError(f"{mode} run took more than {timeout_s} s")
        finally:
            if proc.poll() is None and result.stopped_by_time is False:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
            proc.wait()
            result.stderr = proc.stderr.read()[-4000:]
            proc.stdout.close()
            proc.stderr.close()
    result.returncode = proc.returncode
    result.killed = proc.returncode == -signal.SIGKILL and not result.stopped_by_time
    return result


def run_validation(mode: str, limit: int | None, schedule: list[tuple[int, int]] = (), *,
                   batches: int, model: Model = VIT_S16, **kw: Any) -> Result:
    """A validation loop of ``batches`` batches of ``model.batch`` images
    in ``mode``, as :func:`run` trains (the same limits, ``schedule`` after
    batch ``k``, and keywords). ``"plain"``: ``model(batch)`` under
    ``torch.no_grad()``; ``"memguard"``: ``guard.infer(batch, model)``
    inside ``guard.evaluate()``. Each record's ``step`` is the batch's
    index, ``micro`` the size the inference ran at."""
    return run(mode, limit, schedule, steps=batches, model=model,
               worker_args=["--task=validate"], **kw)


def boundary_bound(steps: list[dict], factor: float = 1.25,
                   slack: int = 64 * MiB) -> tuple[float | None, int]:
    """The worst step boundary of a memguard run, as the arena's reserved
    bytes there over ``factor`` x the recent peak + ``slack`` (at most 1
    where the bound holds), and how many boundaries passed it. A boundary's
    recent peak is the largest of the four steps before it."""
    worst, bad = None, 0
    for i, s in enumerate(steps):
        peaks = [p["peak_bytes"] for p in steps[max(0, i - 4):i] if p.get("peak_bytes")]
        if not peaks or not s.get("boundary_reserved_bytes"):
            continue
        x = s["boundary_reserved_bytes"] / (factor * max(peaks) + slack)
        worst = x if worst is None else max(worst, x)
        bad += x > 1
    return worst, bad


def _workers_args(workers: int, worker_bytes: int) -> list[str]:
    """The worker's flags for its DataLoader workers (none without any)."""
    return [f"--workers={workers}", f"--worker-bytes={worker_bytes}"] if workers else []


# ---------------------------------------------------------------- the worker
def _build(m: Model, threads: int):
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(m.dim, 3 * m.dim)
            self.proj = nn.Linear(m.dim, m.dim)

        def forward(self, x):
            b, n, d = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, m.heads, d // m.heads).permute(2, 0, 3, 1, 4)
            a = (q @ k.transpose(-2, -1) * (d // m.heads) ** -0.5).softmax(-1)
            return self.proj((a @ v).transpose(1, 2).reshape(b, n, d))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(m.dim), nn.LayerNorm(m.dim)
            self.attn = Attention()
            self.fc1, self.fc2 = nn.Linear(m.dim, 4 * m.dim), nn.Linear(4 * m.dim, m.dim)

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))

    class ViT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patch = nn.Conv2d(3, m.dim, m.patch, stride=m.patch)
            self.cls = nn.Parameter(torch.zeros(1, 1, m.dim))
            self.pos = nn.Parameter(torch.randn(1, (m.img // m.patch) ** 2 + 1, m.dim) * .02)
            self.blocks = nn.ModuleList(Block() for _ in range(m.depth))
            self.norm, self.head = nn.LayerNorm(m.dim), nn.Linear(m.dim, 1)

        def forward(self, x):
            x = self.patch(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1) + self.pos
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x)[:, 0]).squeeze(-1)

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = ViT()
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:   # without peft, the whole ViT trains
        pass
    else:
        model = get_peft_model(model, LoraConfig(
            r=8, lora_alpha=16, target_modules=r"blocks\.\d+\.(attn\.(qkv|proj)|fc1|fc2)",
            modules_to_save=["head"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m.batch, 3, m.img, m.img, generator=g)
    y = torch.randn(m.batch, generator=g)
    return model, opt, x, y


def _add_workers_flags(p: argparse.ArgumentParser) -> None:
    """The worker's flags for its DataLoader workers."""
    p.add_argument("--workers", type=int, default=0,
                   help="DataLoader workers (0: the batch is the same tensors each step)")
    p.add_argument("--worker-bytes", type=int, default=0,
                   help="bytes each DataLoader worker holds of its own")


def _hold(worker_bytes: int, _worker_id: int) -> None:
    """In a DataLoader worker: ``worker_bytes`` written, so they are its own
    (a dataset's copy of what it loads, as each worker has)."""
    global _held
    _held = bytearray(b"\1") * worker_bytes


def _batches(x: Any, y: Any, workers: int, worker_bytes: int, steps: int) -> Any:
    """The batches, one a step: ``(x, y)`` itself without workers; with
    them, a DataLoader of ``workers`` persistent workers, each holding
    ``worker_bytes``, that hands out the indices of each batch, gathered
    from ``x`` and ``y`` here (so the workers add only what they hold, not
    batches in flight through shared memory)."""
    import itertools

    if not workers:
        return itertools.repeat((x, y))
    import functools

    import torch

    loader = torch.utils.data.DataLoader(
        range(len(x) * steps), batch_size=len(x), num_workers=workers, persistent_workers=True,
        worker_init_fn=functools.partial(_hold, worker_bytes))
    return ((x[i % len(x)], y[i % len(x)]) for i in loader)


def _workers_record(guard: Any, workers: int, advised: bool) -> dict[str, Any]:
    """A step's figures of the DataLoader workers: their number and bytes
    (the guard's newest sample, or one taken), and memguard's advice on them
    at the first step that has it (``advised``: an earlier one had)."""
    if not workers:
        return {}
    import memguard

    s = guard.sampler.latest() if guard is not None and guard.sampler is not None else None
    s = s or memguard.sample()
    rec = {"children": s.children, "children_bytes": s.children_bytes}
    advice = guard.boundary.workers if guard is not None else None
    if advice is not None and advice.given and not advised:
        rec["advice"] = advice.message
    return rec


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _validate(a: argparse.Namespace, m: Model) -> int:
    """The worker's validation loop (``--task=validate``): the same batch
    ``a.steps`` times, its predictions kept as plain values (numpy), one
    JSON line per batch."""
    import torch

    import memguard

    model, _, x, _ = _build(m, a.threads)
    model.eval()
    guard = None
    if a.mode == "memguard":
        guard = memguard.Guard(budget=a.budget, telemetry=a.telemetry).install()
    preds = []
    with guard.evaluate() if guard is not None else contextlib.nullcontext():
        for i in range(a.steps):
            t0 = time.perf_counter()
            flt0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            rec: dict[str, Any] = {"step": i}
            if guard is None:
                with torch.no_grad():
                    out = model(x)
                rec["micro"] = m.batch
            else:
                out = guard.infer(x, model)
                rec.update(_inference_record(guard))
            preds.append(out.numpy())
            rec.update(seconds=time.perf_counter() - t0, predictions=sum(map(len, preds)),
                       major_faults=resource.getrusage(resource.RUSAGE_SELF).ru_majflt - flt0,
                       rss_bytes=_status_kib("VmRSS") * 1024,
                       swap_bytes=_status_kib("VmSwap") * 1024,
                       peak_rss_bytes=_status_kib("VmHWM") * 1024)
            print(json.dumps(rec), flush=True)
    if guard is not None:
        guard.uninstall()
    return 0


def _inference_record(guard: Any) -> dict[str, Any]:
    """What the guard's inference plan did in the last ``infer``: the size
    it settled on, its last decision and why, its changes so far, and the
    room it planned in."""
    from memguard import _C

    st, room = guard.inference.state(), guard.room.last
    return {"micro": guard.inference.micro, "action": st["action"], "reason": st["reason"],
            "changes": guard.inference.changes, "ooms_recovered": guard.ooms_recovered,
            "planner_budget_bytes": st["budget_bytes"], "budget_bytes": room.budget_bytes,
            "reserved_bytes": _C.arena_stats()["reserved_bytes.current"]}


def worker(argv: list[str] | None = None) -> int:
    """The worker's main: train (or validate: ``--task=validate``), one
    JSON line per step (batch) on stdout."""
    p = argparse.ArgumentParser(prog="python -m memguard.cli.workload")
    p.add_argument("--mode", choices=("plain", "memguard"), required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", default="auto", help="memguard mode: the guard's budget")
    p.add_argument("--telemetry", default=None)
    _add_workers_flags(p)
    p.add_argument("--task", choices=("train", "validate"), default="train")
    for f in dataclasses.fields(Model):
        p.add_argument(f"--{f.name}", type=int, default=f.default)
    a = p.parse_args(argv)
    m = Model(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Model)})
    if a.task == "validate":
        return _validate(a, m)
    import torch
    from torch import nn

    model, opt, x, y = _build(m, a.threads)

    def loss_fn(batch):
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    import memguard
    from memguard import _C

    guard = sampler = exporter = None
    if a.mode == "memguard":
        guard = memguard.Guard(budget=a.budget, telemetry=a.telemetry).install()
    elif a.telemetry:
        # the plain run's memory, for the demo's side-by-side report
        exporter = memguard.telemetry.open_exporter(a.telemetry)
        sampler = memguard.Sampler()
        sampler.on_sample(exporter)
        sampler.start()
    batches = _batches(x, y, a.workers, a.worker_bytes, a.steps)
    advised = False
    for i in range(a.steps):
        batch = next(batches)
        t0 = time.perf_counter()
        flt0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        rec: dict[str, Any] = {"step": i}
        if guard is None:
            loss = loss_fn(batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec.update(micro=m.batch, loss=loss.item())
        else:
            res = guard.step(batch, loss_fn, opt)
            room = guard.room.last
            st = _C.arena_stats()
            rec.update(micro=res.micro_batch, n_micro=res.n_micro, retries=res.retries,
                       tried=res.tried, arena_ooms=st["num_ooms"], loss=res.loss, peak_bytes=res.peak_bytes, reason=guard.plan()["reason"],
                       budget_bytes=room.budget_bytes, source=room.source,
                       arena_budget_bytes=room.arena_budget_bytes,
                       boundary_reserved_bytes=room.reserved_bytes,
                       reserved_bytes=st["reserved_bytes.current"])
        rec.update(seconds=time.perf_counter() - t0,
                   major_faults=resource.getrusage(resource.RUSAGE_SELF).ru_majflt - flt0,
                   rss_bytes=_status_kib("VmRSS") * 1024, swap_bytes=_status_kib("VmSwap") * 1024)
        rec.update(_workers_record(guard, a.workers, advised))
        advised = advised or "advice" in rec
        if exporter is not None:
            exporter.event(Event.STEP, step=i, micro_batch=m.batch, n_micro=1)
        print(json.dumps(rec), flush=True)
    getattr(batches, "close", lambda: None)()   # the DataLoader's workers, shut down
    del torch
    if guard is not None:
        guard.uninstall()
    if sampler is not None:
        sampler.stop()
        exporter.close()
    return 0


def _end(status: int) -> None:
    """End the worker once its steps are out: the driver reads nothing
    after its last line, and Python's finalization with torch imported
    takes about a second of CPU, a second each run would wait for."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    _end(worker())
