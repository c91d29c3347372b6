"""The CUDA governor's logic without a GPU: recorded-format memory_stats
traces replayed through the real sampler and pressure model, and through a
real Guard whose steps run on the CPU."""
from __future__ import annotations

import pathlib
import warnings

import pytest
import torch

import memguard
from memguard.memory import cuda
from memguard.memory.cuda import Governor, Replay, load_trace
from memguard.telemetry import Level, Sampler

TRACES = pathlib.Path(__file__).parent / "fixtures" / "cuda"
GIB = 1 << 30


def governor(name: str, sampler: Sampler | None = None, **kw) -> tuple[Governor, Replay]:
    r = Replay(load_trace(TRACES / f"{name}.jsonl"))
    g = Governor(0, sampler=sampler, memory_stats=r.memory_stats,
                 mem_get_info=r.mem_get_info, **kw)
    return g.install(), r


def test_counters_come_from_memory_stats_keys():
    g, r = governor("thrash")
    c = g.counters()
    ms = r.records[0]["memory_stats"]
    assert c["allocated_bytes"] == ms["allocated_bytes.all.current"] == 12 * GIB
    assert c["reserved_bytes"] == ms["reserved_bytes.all.current"]
    assert c["allocated_peak_bytes"] == ms["allocated_bytes.all.peak"] == 60 * GIB
    assert c["reserved_peak_bytes"] == ms["reserved_bytes.all.peak"]
    assert c["alloc_retries"] == 0 and c["ooms"] == 0
    assert (c["free_bytes"], c["total_bytes"]) == tuple(r.records[0]["mem_get_info"])
    assert c["budget_bytes"] == 0 and c["device"] == 0


def test_rising_retries_are_high_once_each():
    """num_alloc_retries rises at records 5 and 6 of the trace: those pushes
    judge HIGH (thrashing), every other one OK; the samples taken after a
    push carry the counters and say why."""
    s = Sampler(interval_ms=1000)
    g, r = governor("thrash", s)
    levels, samples = [], []
    while True:
        levels.append(g.push())
        samples.append(s.sample_now())
        if not r.advance():
            break
    assert levels == [Level.OK] * 5 + [Level.HIGH] * 2 + [Level.OK] * 3
    for i, smp in enumerate(samples):
        ms = r.records[i]["memory_stats"]
        assert smp.cuda_allocated_bytes == ms["allocated_bytes.all.current"]
        assert smp.cuda_reserved_bytes == ms["reserved_bytes.all.current"]
        assert smp.cuda_alloc_retries == ms["num_alloc_retries"]
        assert smp.cuda_total_bytes == r.records[i]["mem_get_info"][1]
        assert smp.cuda_device == 0
        assert smp.cuda_new_retries == (3 if i in (5, 6) else 0)
        assert ("cuda_retries" in smp.reasons) == (i in (5, 6))
        if i in (5, 6):
            assert smp.raw_level >= Level.HIGH
    # a second sample without a push carries the rise no more
    assert s.sample_now().cuda_new_retries == 0


def test_a_new_governor_starts_from_its_own_baseline():
    """Retries counted before a governor existed are not thrashing it saw:
    a governor without a sampler judges its first push against nothing but
    itself, whatever another governor pushed before (found on a GPU, where
    an earlier test's retries made a later governor's first push HIGH)."""
    def rec(retries: int) -> dict:
        return {"memory_stats": {"allocated_bytes.all.current": GIB,
                                 "reserved_bytes.all.current": 2 * GIB,
                                 "num_alloc_retries": retries},
                "mem_get_info": [70 * GIB, 80 * GIB]}

    first = Replay([rec(0)])
    a = Governor(0, memory_stats=first.memory_stats, mem_get_info=first.mem_get_info)
    assert a.push() is Level.OK
    later = Replay([rec(40), rec(40), rec(43)])     # 40 retries happened meanwhile
    b = Governor(0, memory_stats=later.memory_stats, mem_get_info=later.mem_get_info)
    levels = [b.push()]
    while later.advance():
        levels.append(b.push())
    assert levels == [Level.OK, Level.OK, Level.HIGH]  # only its own rise counts


def test_budget_thresholds_against_allocated():
    """Allocated bytes against a 10 GiB CUDA budget: 50 % OK, 85 %
    ELEVATED, 92 % HIGH, 98 % CRITICAL (the budget thresholds), back to OK."""
    s = Sampler(interval_ms=1000)
    g, r = governor("climb", s, budget="10GiB")
    assert g.budget_bytes == 10 * GIB
    levels = []
    while True:
        levels.append(g.push())
        if not r.advance():
            break
    assert levels == [Level.OK, Level.ELEVATED, Level.HIGH, Level.CRITICAL, Level.OK]
    smp = s.sample_now()
    assert smp.cuda_budget_bytes == 10 * GIB
    assert smp.cuda_budget_used_fraction == pytest.approx(0.5, abs=1e-3)


def test_budget_as_a_share_of_the_device():
    g, _ = governor("climb", budget="25%")
    assert g.budget_bytes == 20 * GIB   # of the trace's 80 GiB device
    with pytest.raises(ValueError, match="'12 parsecs'"):
        Governor(0, budget="12 parsecs")


def test_fragmentation_advice_once(monkeypatch):
    for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(v, raising=False)
    events = []
    g, r = governor("fragmented", on_event=lambda name, data: events.append((name, data)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g.push()                    # peaks: 10 GiB reserved for 9 allocated: fine
    assert events == []
    r.advance()
    with pytest.warns(RuntimeWarning, match="expandable_segments"):
        g.push()                    # 18 for 9
    r.advance()
    g.push()                        # once only
    assert [e[0] for e in events] == ["cuda_advice"]
    advice = events[0][1]["advice"]
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in advice
    assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in advice


def test_no_advice_when_expandable_segments_is_on(monkeypatch):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    events = []
    g, r = governor("fragmented", on_event=lambda name, data: events.append(name))
    r.advance()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no warning
        g.push()
    assert events == ["cuda_advice"]     # the event still records the figures


def test_oom_observer_records():
    events = []
    g, _ = governor("thrash", on_event=lambda name, data: events.append((name, data)))
    cuda._on_native_oom(0, 3 * GIB, 70 * GIB, 1 * GIB)   # what PyTorch's observer calls
    g.uninstall()
    cuda._on_native_oom(0, 1, 2, 3)                     # no longer reported to it
    assert g.ooms_observed == [{"device": 0, "alloc_bytes": 3 * GIB,
                                "device_allocated_bytes": 70 * GIB,
                                "device_free_bytes": 1 * GIB}]
    assert events == [("cuda_oom", g.ooms_observed[0])]


def test_parse_device():
    assert cuda.parse_device("cuda") is None
    assert cuda.parse_device("cuda:3") == 3
    assert cuda.parse_device(2) == 2
    assert cuda.parse_device(torch.device("cuda", 1)) == 1
    for bad in ("cpu", "cuda:x", -1, True, "gpu"):
        with pytest.raises(ValueError, match=repr(bad) if not isinstance(bad, str) else bad):
            cuda.parse_device(bad)


def test_flat_native_stats():
    ms = load_trace(TRACES / "fragmented.jsonl")[1]["memory_stats"]
    f = cuda.flat_native_stats(ms)
    assert f["allocated_bytes.current"] == 5 * GIB
    assert f["reserved_bytes.current"] == 18 * GIB
    assert f["cached_bytes"] == 13 * GIB
    assert f["reserved_bytes.peak"] == 18 * GIB
    assert f["num_alloc_retries"] == 0


def test_guard_shrinks_on_thrashing():
    """A real Guard on a CPU model, governed by a replayed trace: the step
    after the retries rose runs at half the size, the rest hold (growth
    waits for calm steps); the gradients are the same either way."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = Sampler(interval_ms=1000)
    g, r = governor("thrash", s)
    guard = memguard.Guard(budget=None, allocator=False, sampler=s, cuda=g, grow_after=100)
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    sizes = []
    with guard:
        for _ in range(8):
            res = guard.step((x, y), lambda b: torch.nn.functional.mse_loss(model(b[0]), b[1]),
                             opt)
            sizes.append(res.micro_batch)
            r.advance()
    # boundaries push records 0..7; records 5 and 6 show new retries
    assert sizes == [16] * 5 + [8, 4, 4]
    assert guard.cuda_governor is None   # given governors are left to their owner
    assert g.level == Level.OK


def test_guard_bad_cuda_arguments():
    with pytest.raises(ValueError, match="'yes'"):
        memguard.Guard(cuda="yes")
    with pytest.raises(ValueError, match="'lots'"):
        memguard.Guard(cuda_budget="lots")


def test_guard_without_cuda_starts_no_governor():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memguard.Guard(budget=None, allocator=False, cuda_budget="50%") as guard:
        guard.step(torch.randn(4, 4), lambda b: model(b).sum(), opt)
        assert guard.cuda_governor is None or torch.cuda.is_available()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_governor_on_a_real_device():
    g = Governor("cuda", budget="50%").install()
    try:
        x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        c = g.counters()
        assert c["allocated_bytes"] >= 256 << 20
        assert c["total_bytes"] > 0 and g.budget_bytes == c["total_bytes"] // 2
        assert g.push() in (Level.OK, Level.ELEVATED)
        del x
    finally:
        g.uninstall()


def test_auto_budget_follows_the_devices_free_memory():
    """cuda_budget="auto" is live: what this process holds on the
    device plus what is free there, re-read at each push. Another process
    takes 30 GiB of the 80 GiB device, then gives 20 back: the budget falls,
    then rises; a move under a 32nd is not applied."""
    def rec(reserved_gib: float, free_gib: float) -> dict:
        return {"memory_stats": {"allocated_bytes.all.current": int(reserved_gib * GIB) // 2,
                                 "reserved_bytes.all.current": int(reserved_gib * GIB)},
                "mem_get_info": [int(free_gib * GIB), 80 * GIB]}

    r = Replay([rec(10, 68), rec(10, 38), rec(10, 38.5), rec(10, 58)])
    s = Sampler(interval_ms=1000)
    g = Governor(0, budget="auto", sampler=s, memory_stats=r.memory_stats,
                 mem_get_info=r.mem_get_info).install()
    seen = []
    while True:
        g.push()
        seen.append(g.budget_bytes)
        if not r.advance():
            break
    assert seen[0] == 78 * GIB      # no reserve: the planner keeps the one margin
    assert seen[1] == seen[2] == 48 * GIB     # 48.5 GiB is within a 32nd
    assert seen[3] == 68 * GIB
    assert s.sample_now().cuda_budget_bytes == seen[3]
    # the fixed kinds stay fixed
    f = Governor(0, budget="50%", memory_stats=r.memory_stats, mem_get_info=r.mem_get_info)
    assert f.install().budget_bytes == 40 * GIB
