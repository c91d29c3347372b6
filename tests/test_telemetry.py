"""The live sampler against /proc, its callbacks, exporters and lifecycle."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import threading
import time

import pytest

import memguard
from memguard import _C
from memguard.telemetry import (
    FIELD_NAMES,
    CsvExporter,
    JsonlExporter,
    Level,
    Sample,
    Sampler,
    read_jsonl,
)

from .conftest import check_pace, wait_for


def proc_kib(path: str, key: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def near(a: float, b: float, rel: float = 0.05) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def test_sample_fields_match_the_c_layer():
    assert set(FIELD_NAMES) == set(_C.sample_fields())


def test_rss_and_available_match_proc():
    block = bytearray(256 * 2**20)  # make RSS large and known
    block[:: 4096] = b"x" * len(block[:: 4096])
    s = Sampler()
    got = s.sample_now()
    rss = proc_kib("/proc/self/status", "VmRSS")
    avail = proc_kib("/proc/meminfo", "MemAvailable")
    assert near(got.rss_bytes, rss), (got.rss_bytes, rss)
    assert got.rss_bytes >= 256 * 2**20
    assert near(got.mem_available_bytes, avail), (got.mem_available_bytes, avail)
    assert got.mem_total_bytes == proc_kib("/proc/meminfo", "MemTotal")
    assert got.rss_peak_bytes >= got.rss_bytes
    assert got.swap_bytes == proc_kib("/proc/self/status", "VmSwap")
    del block


def test_growth_shows_in_rss():
    s = Sampler()
    before = s.sample_now().rss_bytes
    block = bytearray(128 * 2**20)
    block[:: 4096] = b"y" * len(block[:: 4096])
    after = s.sample_now().rss_bytes
    assert near(after - before, 128 * 2**20, 0.1), (before, after)
    del block


def test_faults_bracketed_by_proc_stat():
    def stat_faults():
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[7]), int(fields[9])

    before = stat_faults()
    got = memguard.sample()
    after = stat_faults()
    assert before[0] <= got.minor_faults <= after[0]
    assert before[1] <= got.major_faults <= after[1]


@pytest.mark.skipif(not os.path.exists("/proc/pressure/memory"), reason="no PSI here")
def test_psi_parsed_from_the_real_file():
    def totals():
        with open("/proc/pressure/memory") as f:
            lines = dict(line.split(" ", 1) for line in f.read().splitlines())
        return {k: int(v.rsplit("total=", 1)[1]) for k, v in lines.items()}

    before = totals()
    got = memguard.sample()
    after = totals()
    assert before["some"] <= got.psi_some_total_us <= after["some"]
    assert before["full"] <= got.psi_full_total_us <= after["full"]
    assert 0 <= got.psi_some_avg10 <= 100


def test_cgroup_matches_this_machines_layout():
    got = memguard.sample()
    with open("/proc/self/cgroup") as f:
        lines = f.read().splitlines()
    has_v1_memory = any(line.split(":")[1] and "memory" in line.split(":")[1].split(",")
                        for line in lines)
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        assert got.cgroup_version in (2, None)
    elif has_v1_memory:
        assert got.cgroup_version == 1
        path = next(ln for ln in lines if "memory" in ln.split(":")[1].split(",")).split(":", 2)[2]
        d = "/sys/fs/cgroup/memory" + path
        if os.path.isdir(d):
            with open(d + "/memory.usage_in_bytes") as f:
                usage = int(f.read())
            assert near(got.cgroup_usage_bytes, usage, 0.2)


def test_rates_need_a_previous_sample():
    s = Sampler()
    first = s.sample_now()
    second = s.sample_now()
    assert first.interval_s is None and first.psi_some_stall is None
    assert first.minor_faults_per_s is None
    assert second.interval_s > 0 and second.minor_faults_per_s is not None
    if second.psi_some_total_us is not None:
        assert 0.0 <= second.psi_some_stall <= 1.0


def test_thread_samples_at_its_interval():
    """The thread samples on its own until stopped, never ahead of its
    interval (however late a loaded machine runs it)."""
    s = Sampler(interval_ms=20)
    t0 = time.monotonic()
    with s:
        assert wait_for(lambda: len(s.history()) >= 15)
    elapsed = time.monotonic() - t0
    hist = s.history()
    assert [h.seq for h in hist] == list(range(1, len(hist) + 1))
    check_pace(hist, 0.02, elapsed)
    assert s.latest().seq == hist[-1].seq
    assert [h.seq for h in s.history(3)] == [h.seq for h in hist[-3:]]
    assert s.cpu_seconds > 0


def test_ring_keeps_the_newest():
    with Sampler(interval_ms=5, ring_size=8) as s:
        assert wait_for(lambda: s.latest() is not None and s.latest().seq >= 12)
    hist = s.history()
    assert len(hist) == 8
    assert hist[-1].seq == s.latest().seq and hist[0].seq == hist[-1].seq - 7


def test_callbacks_run_on_a_python_thread_and_see_every_sample():
    seen, threads = [], set()

    def cb(sample):
        seen.append(sample.seq)
        threads.add(threading.current_thread().name)

    with Sampler(interval_ms=5) as s:
        s.on_sample(cb)
        assert wait_for(lambda: len(seen) >= 20)
    assert threads == {"memguard-telemetry"}
    assert seen == list(range(seen[0], seen[0] + len(seen)))  # no gaps
    assert seen[-1] == s.latest().seq  # stop() delivered the last ones
    assert s.dropped == 0


def _sample_with_a_raising_callback() -> tuple[list[int], object]:
    """Sample at 10 ms with a callback that always raises until it was
    called 10 times: the samples it was called with, and the callback."""
    calls = []

    def bad(sample):
        calls.append(sample.seq)
        raise RuntimeError("boom")

    with Sampler(interval_ms=10) as s:
        s.on_sample(bad)
        assert wait_for(lambda: len(calls) >= 10)
    return calls, bad


def test_failing_callback_goes_to_unraisablehook_and_sampling_goes_on(monkeypatch):
    hooked = []
    monkeypatch.setattr(sys, "unraisablehook", hooked.append)
    calls, bad = _sample_with_a_raising_callback()
    assert len(hooked) == len(calls)
    assert isinstance(hooked[0].exc_value, RuntimeError)
    assert "memguard telemetry callback" in hooked[0].err_msg
    assert hooked[0].object is bad


def test_a_raising_unraisablehook_does_not_stop_sampling(monkeypatch, capfd):
    def hook(args):
        raise ValueError("the hook itself failed")

    monkeypatch.setattr(sys, "unraisablehook", hook)
    calls, _ = _sample_with_a_raising_callback()
    assert calls == list(range(calls[0], calls[0] + len(calls)))
    err = capfd.readouterr().err
    assert "Exception ignored in sys.unraisablehook" in err
    assert "ValueError: the hook itself failed" in err


def test_pressure_events_follow_the_budget():
    events = []
    s = Sampler(interval_ms=10, pressure={"calm_samples": 3})
    rss = s.sample_now().rss_bytes
    s = Sampler(interval_ms=10, budget=int(rss / 0.95), pressure={"calm_samples": 3})
    s.on_pressure(events.append)
    with s:
        assert wait_for(lambda: events)
        s.set_budget(rss * 100)
        assert wait_for(lambda: len(events) >= 2)
    assert events[0].old == Level.OK and events[0].new >= Level.HIGH
    assert "budget" in events[0].sample.reasons
    assert events[1].new == Level.OK
    assert events[1].sample.budget_used_fraction < 0.05


def test_level_change_wakes_a_waiter_with_the_gil_released():
    """What wakes the wait is a Python thread's doing, 20 ticks of its own
    after the wait began: the wait ends only if that thread ran meanwhile."""
    rss = Sampler().sample_now().rss_bytes
    c = _C.Sampler(interval_ms=10, budget_bytes=rss * 100)
    ticks = []
    waiting_at = [None]                        # the tick count when the wait began
    stop = threading.Event()

    def spin():
        lowered = False
        while not stop.is_set():
            ticks.append(1)
            if not lowered and waiting_at[0] is not None and len(ticks) >= waiting_at[0] + 20:
                c.set_budget(int(rss / 0.99))  # below RSS: the level must rise
                lowered = True
            time.sleep(0.001)

    t = threading.Thread(target=spin)
    t.start()
    c.start()
    try:
        assert wait_for(lambda: c.latest() is not None)
        c.wait(0)                              # what the first samples signalled
        n0 = len(ticks)
        waiting_at[0] = n0
        woke = c.wait(10.0)
        n1 = len(ticks)
        assert woke & _C.WAKE_LEVEL
        assert c.latest()["level"] >= Level.HIGH
        assert n1 - n0 >= 20  # the other Python thread ran while we waited
    finally:
        c.stop()
        stop.set()
        t.join()


def test_wait_times_out_and_wakes_on_request():
    c = _C.Sampler(interval_ms=100)
    t0 = time.monotonic()
    assert c.wait(0.05) == 0
    assert time.monotonic() - t0 >= 0.04
    threading.Timer(0.05, c.wake).start()
    assert c.wait(5.0) & _C.WAKE_USER


def test_start_stop_restart_many_times():
    s = Sampler(interval_ms=5)
    for _ in range(50):
        s.start()
        s.start()  # idempotent
        assert s.running
        s.stop()
        s.stop()
        assert not s.running
    s.sample_now()  # usable after stop
    with s, pytest.raises(RuntimeError, match="running"):
        s.sample_now()


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="interval_ms 2"):
        Sampler(interval_ms=2)
    with pytest.raises(ValueError, match="'lots'"):
        Sampler(budget="lots")
    with pytest.raises(ValueError, match="unknown pressure threshold 'psi_hihg'"):
        Sampler(pressure={"psi_hihg": 0.1})
    with pytest.raises(ValueError, match="must rise"):
        Sampler(pressure={"psi_elevated": 0.5, "psi_high": 0.1})
    with pytest.raises(ValueError, match=".jsonl or .csv"):
        Sampler(export="run.txt").start()


def test_jsonl_export_roundtrip(tmp_path):
    path = tmp_path / "run.jsonl"
    with Sampler(interval_ms=10, export=path) as s:
        assert wait_for(lambda: len(s.history()) >= 3)
    meta, samples, events = read_jsonl(path)
    assert meta["schema"] == "memguard.telemetry" and meta["schema_version"] == 4
    assert meta["fields"] == list(FIELD_NAMES)
    assert [x.seq for x in samples] == [x.seq for x in s.history()]
    assert samples[-1] == s.history()[-1]  # every field survives the trip
    assert events == []


def test_jsonl_events_and_foreign_files(tmp_path):
    path = tmp_path / "e.jsonl"
    with JsonlExporter(path, meta={"run": "x"}) as ex:
        ex(memguard.sample())
        ex.event("gc", seconds=0.01)
    meta, samples, events = read_jsonl(path)
    assert meta["run"] == "x" and len(samples) == 1
    assert events[0]["event"] == "gc" and events[0]["seconds"] == 0.01
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"type": "meta", "schema": "something"}) + "\n")
    with pytest.raises(ValueError, match="not a memguard telemetry file"):
        read_jsonl(other)
    newer = tmp_path / "newer.jsonl"
    newer.write_text(json.dumps({"type": "meta", "schema": "memguard.telemetry",
                                 "schema_version": 99}) + "\n")
    with pytest.raises(ValueError, match="schema version 99"):
        read_jsonl(newer)


def test_csv_export(tmp_path):
    path = tmp_path / "run.csv"
    s = Sampler()
    a, b = s.sample_now(), s.sample_now()
    with CsvExporter(path) as ex:
        ex(a)
        ex(b)
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["schema_version", *FIELD_NAMES]
    assert rows[0]["schema_version"] == "4"
    assert int(rows[1]["rss_bytes"]) == b.rss_bytes
    assert rows[0]["interval_s"] == ""  # None is an empty cell, not 0
    assert rows[1]["level"] == b.level.name


def test_sample_roundtrips_through_dict():
    s = memguard.sample()
    assert Sample.from_dict(s.to_dict()) == s
    assert Sample.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_fork_while_sampling(tmp_path):
    """The child of a fork has no sampler thread; it can start its own, whose
    readings are the child's; the parent's sampler keeps running."""
    parent = Sampler(interval_ms=5)
    parent.start()
    time.sleep(0.05)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            os.close(r)
            assert not parent.running
            parent.stop()  # harmless in the child
            mine = Sampler(interval_ms=5)
            base = mine.sample_now().rss_bytes
            block = bytearray(96 * 2**20)
            block[:: 4096] = b"c" * len(block[:: 4096])
            grown = mine.sample_now().rss_bytes
            with mine:
                assert wait_for(lambda: len(mine.history()) >= 3)
            parent.start()  # the inherited one restarts too
            time.sleep(0.03)
            parent.stop()
            os.write(w, json.dumps({"base": base, "grown": grown,
                                    "n": len(mine.history())}).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    seq_at_fork = parent.latest().seq
    _, status = os.waitpid(pid, 0)
    child = json.loads(os.read(r, 4096) or b"{}")
    os.close(r)
    wait_for(lambda: parent.latest().seq > seq_at_fork + 5)
    parent.stop()
    assert os.waitstatus_to_exitcode(status) == 0
    assert child["grown"] - child["base"] >= 90 * 2**20
    assert child["n"] >= 3
    assert parent.latest().seq > seq_at_fork + 5
    assert parent.latest().rss_bytes < child["grown"] + 2**30


def test_fork_child_of_dataloader_style_workers():
    """multiprocessing workers forked while the sampler runs exit cleanly."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    with Sampler(interval_ms=5) as s:
        with ctx.Pool(2) as pool:
            out = pool.map(_child_sample_rss, range(4))
        wait_for(lambda: s.latest().seq > 5)
    assert all(v > 0 for v in out)
    assert s.latest().seq > 5


def _child_sample_rss(_: int) -> int:
    return memguard.sample().rss_bytes


# ---- regressions: each of these failed before its fix --------------------------


def test_history_of_absurd_length_is_bounded():
    s = Sampler(ring_size=16)
    for _ in range(20):
        s.sample_now()
    assert [x.seq for x in s.history(2**61)] == list(range(5, 21))
    assert s._c.since(0, 0) == ([], 0)


def test_start_stop_races_neither_hang_nor_duplicate():
    seen = []
    s = Sampler(interval_ms=5)
    s.on_sample(lambda x: seen.append(x.seq))
    done = threading.Event()

    def flip():
        for _ in range(100):
            s.start()
            time.sleep(0.001)
            s.stop()
        done.set()

    threads = [threading.Thread(target=flip, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    assert done.wait(60), "stop() hung"
    for t in threads:
        t.join(60)
    s.stop()
    assert len(seen) == len(set(seen)), "a sample was delivered twice"
    assert seen == sorted(seen)


def test_pressure_events_are_not_missed_while_the_callback_thread_waits():
    """With only on_pressure registered, a whole excursion that happens while
    the callback thread cannot run is still reported, step by step."""
    rss = Sampler().sample_now().rss_bytes
    events = []
    s = Sampler(interval_ms=5, budget=rss * 100, pressure={"calm_samples": 1})
    s.on_pressure(events.append)

    def spin_until(level: Level) -> bool:
        """Whether the sampler's thread published ``level`` within 30 s,
        this thread keeping the GIL meanwhile."""
        deadline = time.monotonic() + 30
        while (s._c.latest() or {}).get("level") != level:
            if time.monotonic() > deadline:
                return False
        return True

    old = sys.getswitchinterval()
    with s:
        time.sleep(0.05)
        sys.setswitchinterval(10.0)  # this thread keeps the GIL while it spins
        try:
            s.set_budget(int(rss / 1.5))   # critical even if RSS shrinks meanwhile
            critical = spin_until(Level.CRITICAL)
            s.set_budget(rss * 100)
            calm = spin_until(Level.OK)
        finally:
            sys.setswitchinterval(old)
        assert critical and calm
        wait_for(lambda: events and events[-1].new == Level.OK)   # delivered late
    levels = [(e.old, e.new) for e in events]
    assert (Level.OK, Level.CRITICAL) in levels
    assert levels[-1][1] == Level.OK


def test_a_callback_registered_while_the_thread_is_behind_hears_what_follows():
    """The callback thread, held up by a slow callback, falls behind the
    sampler: a pressure callback registered meanwhile still hears the level
    change that follows its registration. (The thread used to keep the
    callbacks it started with until it caught up with the sampler, which on
    a loaded machine may be never.)"""
    rss = Sampler().sample_now().rss_bytes
    s = Sampler(interval_ms=5, budget=rss * 100)
    held, release = threading.Event(), threading.Event()

    def slow(sample):
        held.set()
        release.wait(30)

    highs = []
    s.on_sample(slow)
    with s:
        try:
            assert held.wait(30)                 # the callback thread is behind from here
            s.on_pressure(lambda ev: highs.append(ev) if ev.new >= Level.HIGH else None)
            s.set_budget(int(rss / 1.5))
            assert wait_for(lambda: s.latest().level >= Level.HIGH)
        finally:
            release.set()
        assert wait_for(lambda: highs, timeout=10)


def test_fork_child_does_not_inherit_the_exporter(tmp_path):
    path = tmp_path / "parent.jsonl"
    parent = Sampler(interval_ms=5, export=path)
    parent.start()
    time.sleep(0.05)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal_alarm = __import__("signal")
            signal_alarm.alarm(20)  # a deadlock ends the child instead of the suite
            parent.start()
            time.sleep(0.05)
            parent.stop()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    parent.stop()
    assert os.waitstatus_to_exitcode(status) == 0
    _, samples, _ = read_jsonl(path)
    seqs = [x.seq for x in samples]
    assert seqs == sorted(seqs) and len(seqs) == len(set(seqs))  # only the parent wrote


def test_version_1_files_still_read(tmp_path):
    """Files written before the arena fields existed read with those as None."""
    from .conftest import FIXTURES

    meta, samples, _ = read_jsonl(FIXTURES / "traces" / "demo_validation_leak.jsonl")
    assert meta["schema_version"] == 1 and samples
    assert samples[0].arena_reserved_bytes is None


# -- the process tree ------------------------------------------------------------
MiB = 2**20


def _children_with(n: int, mib: int) -> list:
    """n forked children, each writing mib MiB of its own and waiting on a
    pipe; returns (pid, write end) pairs."""
    kids = []
    for _ in range(n):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(w)
            own = bytearray(mib << 20)
            for i in range(0, len(own), 4096):
                own[i] = 1
            os.write(2, b"")           # touched: ready
            os.read(r, 1)
            os._exit(0)
        os.close(r)
        kids.append((pid, w))
    return kids


def _sample_once_children_hold(nbytes: int) -> memguard.Sample:
    """A sample taken once the children hold ``nbytes`` (or after 20 s)."""
    deadline = time.monotonic() + 20
    while True:
        s = memguard.Sampler().sample_now()
        if s.children_bytes >= nbytes or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def _release(kids: list[tuple[int, int]]) -> None:
    """Let the children of :func:`_children_with` exit, and reap them."""
    for pid, w in kids:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)


def test_the_footprint_counts_forked_children_once() -> None:
    """Each child's own pages are counted; what it shares with this process
    (every page of the parent it did not write) is not counted again."""
    base = memguard.Sampler().sample_now()
    assert base.children == 0 and base.children_bytes == 0
    shared = bytearray(96 << 20)                 # the parent's, shared with the children
    for i in range(0, len(shared), 4096):
        shared[i] = 1
    kids = _children_with(2, 48)
    try:
        s = _sample_once_children_hold(96 * MiB)
        assert s.children == 2
        # their 2 x 48 MiB and a little of their own, not the parent's 96 MiB twice more
        assert 96 * MiB <= s.children_bytes < (96 + 2 * 40) * MiB
        assert s.footprint_bytes == s.rss_bytes + (s.swap_bytes or 0) + s.children_bytes
    finally:
        _release(kids)
    assert memguard.Sampler().sample_now().children == 0


# a process holding MiB of its own (after forking a worker that holds as
# much, when asked), saying "r" once touched, until its stdin closes
_HOLD = """import os, sys
if {fork}:
    os.fork()
own = bytearray({mib} << 20)
for i in range(0, len(own), 4096):
    own[i] = 1
os.write(1, b"r")
sys.stdin.read()
"""


def _python_holding(mib: int, env: dict, fork: bool = False) -> subprocess.Popen:
    """A python started with ``env`` added to this process's environment,
    once it (and the worker it forks) hold ``mib`` MiB each."""
    p = subprocess.Popen([sys.executable, "-c", _HOLD.format(mib=mib, fork=fork)],
                         env={**os.environ, **env}, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    assert p.stdout.read(2 if fork else 1) == (b"rr" if fork else b"r")
    return p


def test_other_ranks_of_the_job_are_not_children(monkeypatch) -> None:
    """Rank 0 of a job whose launcher (Lightning's) started rank 1 as its
    child with LOCAL_RANK=1: rank 1 and its own worker are left out; a
    forked worker (this process's environment as at exec) and a spawned one
    (LOCAL_RANK=0, this process's own) are counted."""
    monkeypatch.setenv("LOCAL_RANK", "0")       # as the launcher sets it in rank 0
    monkeypatch.delenv("RANK", raising=False)
    kids = _children_with(1, 48)                # first: it would hold the pipes below
    procs = []
    try:
        procs.append(_python_holding(48, {"LOCAL_RANK": "1"}, fork=True))   # rank 1
        procs.append(_python_holding(48, {"LOCAL_RANK": "0"}))   # a spawned worker
        s = _sample_once_children_hold(96 * MiB)   # the forked worker has touched its own
        assert s.children == 2, "rank 1 (or its worker) was counted, or a worker was not"
        # the two workers' 48 MiB each and a little of their own, not rank 1's 2 x 48 MiB
        assert 96 * MiB <= s.children_bytes < (96 + 2 * 40) * MiB
        assert s.footprint_bytes == s.rss_bytes + (s.swap_bytes or 0) + s.children_bytes
    finally:
        _release(kids)
        for p in procs:
            p.stdin.close()
            p.wait(timeout=30)


def test_dataloader_workers_are_in_the_footprint() -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, Dataset

    class Heavy(Dataset):
        """Each worker builds 32 MiB of its own when it starts."""

        buf = None

        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int):
            return torch.zeros(4)

    def start(_worker: int) -> None:
        Heavy.buf = torch.ones(32 << 20, dtype=torch.uint8)

    loader = DataLoader(Heavy(), batch_size=4, num_workers=2, persistent_workers=True,
                        worker_init_fn=start)
    it = iter(loader)
    next(it)
    next(it)
    s = memguard.Sampler().sample_now()
    assert s.children >= 2
    assert s.children_bytes >= 64 * MiB
    assert s.footprint_bytes >= s.rss_bytes + 64 * MiB
    del it, loader
