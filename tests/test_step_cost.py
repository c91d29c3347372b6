"""What a guarded step costs beyond the plain step, counted rather than
timed: its reads of the device (each ``.item()``, ``float(t)`` or
``bool(t)`` of a tensor is an ``aten._local_scalar_dense``: on a GPU, a wait
for the device), and its reads of the CUDA allocator's counters (each
``memory_stats()`` builds the allocator's whole dictionary, each
``mem_get_info()`` is a driver call). The CPU runs the same steps, so the
reads are counted here; the counters through the callables a governor and
a peak meter read them by, and on a GPU through torch itself."""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import memguard
from memguard.memory.cuda import Governor, Replay
from memguard.train.peaks import PeakMeter

F = torch.nn.functional
GIB = 1 << 30
#: what reads a tensor's value to the host: .item(), float(t), bool(t); and
#: torch.equal, whose bool on a GPU is one such read
READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default)


pytestmark = pytest.mark.usefixtures("one_thread")


class Reads(TorchDispatchMode):
    """Logs, in order, each read of a tensor's value to the host ("read")
    and each write to a parameter ("update")."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.ptrs = {p.data_ptr() for p in params}
        self.log: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.log.append("read")
        elif func._schema.is_mutable and any(
                isinstance(t, torch.Tensor) and t.data_ptr() in self.ptrs
                for t in tree_leaves((args, kwargs))):
            self.log.append("update")
        return func(*args, **(kwargs or {}))

    @property
    def reads(self) -> int:
        return self.log.count("read")


class Buffers(torch.nn.Module):
    """Three buffers a step may not change (a guard watches them)."""

    def __init__(self) -> None:
        super().__init__()
        for name in "abc":
            self.register_buffer(name, torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def setup(scaled: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3),
                                Buffers())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    return model, opt, scaler


X, Y = torch.randn(8, 6), torch.randn(8, 3)


def plain_reads(scaled: bool, clip: float | None) -> int:
    """Reads of the plain loop's second step, which reads its loss once."""
    model, opt, scaler = setup(scaled)

    def step() -> None:
        opt.zero_grad()
        loss = F.mse_loss(model(X), Y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        loss.item()

    step()
    with Reads(list(model.parameters())) as r:
        step()
    return r.reads


@pytest.mark.parametrize("kind", ["plain", "clip", "scaler", "split", "restore"])
def test_a_guarded_step_reads_the_device_as_often_as_the_plain_step(kind):
    """A guarded step reads the device no more often than the plain loop's
    step that reads its loss once (the guard's read is that one: the step's
    result carries the loss): its loss is read once, after the last
    backward, for the result and the finiteness check alike, and no read
    waits for the optimizer's update (none comes after it writes a
    parameter). With a scaler, ``scaler.step``'s own read is the plain
    step's too. A split step that watches ``restore`` buffers reads once
    more, whether any of them changed (not once per buffer)."""
    scaled, clip = kind == "scaler", (1.0 if kind == "clip" else None)
    split = kind in ("split", "restore")
    model, opt, scaler = setup(scaled)
    with memguard.Guard(budget=None, micro_batch=4 if split else "auto") as guard:
        def loss_fn(b: Any) -> torch.Tensor:
            return F.mse_loss(model(b[0]), b[1])

        kw = {"scaler": scaler, "clip_grad_norm": clip,
              "restore": model if kind == "restore" else ()}
        guard.step((X, Y), loss_fn, opt, **kw)
        with Reads(list(model.parameters())) as r:
            res = guard.step((X, Y), loss_fn, opt, **kw)
    assert res.n_micro == (2 if split else 1)
    plain = plain_reads(scaled, clip) + (kind == "restore")
    assert r.reads <= plain, f"{r.reads} reads of the device in a guarded step, {plain} in " \
                             f"the plain one: {r.log}"
    assert "update" in r.log
    assert "read" not in r.log[r.log.index("update"):], \
        f"a read waits for the optimizer's update: {r.log}"


class Counted(Replay):
    """A replayed trace that counts its readings."""

    def __init__(self, records: list[dict]) -> None:
        super().__init__(records)
        self.stats_reads = self.info_reads = 0

    def memory_stats(self, device: int) -> dict:
        self.stats_reads += 1
        return super().memory_stats(device)

    def mem_get_info(self, device: int) -> tuple[int, int]:
        self.info_reads += 1
        return super().mem_get_info(device)


def _record(allocated_gib: float, free_gib: float) -> dict:
    return {"memory_stats": {"allocated_bytes.all.current": int(allocated_gib * GIB),
                             "allocated_bytes.all.peak": int(allocated_gib * GIB),
                             "reserved_bytes.all.current": int(allocated_gib * GIB) + (1 << 20),
                             "reserved_bytes.all.peak": int(allocated_gib * GIB) + (1 << 20)},
            "mem_get_info": [int(free_gib * GIB), 80 * GIB]}


@pytest.mark.parametrize("budget", ["auto", "50%", None])
def test_a_push_reads_each_counter_once(budget):
    """A governor's push reads ``memory_stats()`` once and ``mem_get_info()``
    once, the live "auto" budget included (it follows the same reading),
    and keeps the counters it pushed."""
    r = Counted([_record(4, 60), _record(6, 30)])
    g = Governor(0, budget=budget, memory_stats=r.memory_stats, mem_get_info=r.mem_get_info)
    g.install()
    for i in range(2):
        r.stats_reads = r.info_reads = 0
        g.push()
        assert (r.stats_reads, r.info_reads) == (1, 1), f"push {i}, budget {budget}"
        assert g.last["allocated_bytes"] == r.records[i]["memory_stats"][
            "allocated_bytes.all.current"]
        assert g.last["free_bytes"] == r.records[i]["mem_get_info"][0]
        r.advance()
    if budget == "auto":    # the budget followed the second reading: 90 % of 6 GiB held + 30 free
        assert g.budget_bytes == 6 * GIB + (1 << 20) + 30 * GIB   # held + free


def test_guarded_steps_read_a_governors_counters_once_per_boundary():
    """A real Guard (CPU steps) with a governor replaying a trace: each
    step's boundary reads each counter once."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    r = Counted([_record(4, 60)])
    g = Governor(0, budget="auto", memory_stats=r.memory_stats, mem_get_info=r.mem_get_info)
    with memguard.Guard(budget=None, allocator=False, cuda=g) as guard:
        r.stats_reads = r.info_reads = 0
        for _ in range(3):
            guard.step(torch.randn(4, 8), lambda b: model(b).square().mean(), opt)
    assert (r.stats_reads, r.info_reads) == (3, 3)
    assert guard.signals.cuda_pushed is None   # replayed counters are not the device's


def test_the_peak_meter_reads_a_cuda_device_once_per_reading():
    """On a CUDA device the peak meter starts from the governor's push (no
    reading of its own), reads once where it reads (not once per counter),
    takes a reading handed over, and stops from the reading after the
    update; the peak is the step's where it raised the mark."""
    seen: list[int] = []
    readings = iter([(5 * GIB, 9 * GIB), (3 * GIB, 9 * GIB)])

    def stats(index: int) -> dict:
        seen.append(index)
        now, peak = next(readings)
        return {"allocated_bytes.current": now, "allocated_bytes.peak": peak}

    m = PeakMeter(cuda_stats=stats)
    pushed = {"device": 1, "allocated_bytes": 2 * GIB, "allocated_peak_bytes": 7 * GIB}
    assert m.start_cuda(torch.device("cuda", 1), pushed) == 2 * GIB
    assert seen == [] and m.source == "cuda"
    assert m.measures(torch.device("cuda", 1)) and not m.measures(torch.device("cuda", 0))
    assert not m.measures(torch.device("cpu"))
    given = {"allocated_bytes.current": 4 * GIB, "allocated_bytes.peak": 8 * GIB}
    assert m.now(given) == (4 * GIB, 8 * GIB) and seen == []
    assert m.now() == (5 * GIB, 9 * GIB) and seen == [1]
    assert m.now(settled=True) == (3 * GIB, 9 * GIB) and seen == [1, 1]
    assert m.stop() == 9 * GIB and m.exact and seen == [1, 1]
    # another device's push is not this one's: one reading of its own
    readings = iter([(GIB, 7 * GIB), (GIB, 7 * GIB)])
    assert m.start_cuda(torch.device("cuda", 0), pushed) == GIB and seen == [1, 1, 0]
    assert m.stop() == GIB and not m.exact and seen == [1, 1, 0, 0]   # the mark not raised


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_guarded_cuda_step_reads_torchs_counters_once_per_boundary(monkeypatch):
    """On a GPU, a guarded step reads ``memory_stats()`` three times (the
    boundary's push, the room before the update, the reading after it) and
    ``mem_get_info()`` twice (the push, the room), whatever reads them."""
    calls = {"stats": 0, "info": 0}
    memory_stats, mem_get_info = torch._C._cuda_memoryStats, torch.cuda.mem_get_info

    def counted_stats(device: Any) -> Any:
        calls["stats"] += 1
        return memory_stats(device)

    def counted_info(device: Any = None) -> Any:
        calls["info"] += 1
        return mem_get_info(device)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 8, device="cuda")
    with memguard.Guard(budget=None, cuda_budget="auto") as guard:
        def loss_fn(b: Any) -> torch.Tensor:
            return F.mse_loss(model(b[0]), b[1])

        guard.step((x, y), loss_fn, opt)          # the optimizer's state is created
        monkeypatch.setattr(torch._C, "_cuda_memoryStats", counted_stats)
        monkeypatch.setattr(torch.cuda, "mem_get_info", counted_info)
        monkeypatch.setattr(torch.cuda.memory, "mem_get_info", counted_info)
        for _ in range(3):
            guard.step((x, y), loss_fn, opt)
    assert calls["stats"] <= 3 * 3 and calls["info"] <= 3 * 2, calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_guarded_cuda_step_synchronises_as_often_as_the_plain_step():
    """On a GPU, torch's own count: a guarded step makes no more
    synchronising calls (``torch.cuda.set_sync_debug_mode``) than the plain
    loop's step that reads its loss once."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 8, device="cuda")

    def plain() -> None:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        loss.item()

    def syncs(step: Any) -> int:
        step()                                    # state created, kernels loaded
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in got)

    with memguard.Guard(budget=None, cuda_budget="auto") as guard:
        guarded = syncs(lambda: guard.step((x, y), lambda b: F.mse_loss(model(b[0]), b[1]), opt))
    assert guarded <= syncs(plain)
