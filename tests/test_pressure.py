"""The pressure model: levels from each signal, hysteresis, and replays of
recorded traces through the same C code the sampler runs."""
from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memguard import _C
from memguard.telemetry import Level, Sample, Sampler, read_jsonl

from .conftest import FIXTURES, wait_for

TRACES = FIXTURES / "traces"


def replay(path, **pressure):
    model = _C.PressureModel(pressure=pressure or None)
    _, samples, _ = read_jsonl(path)
    out = []
    for s in samples:
        d = s.to_dict()
        d.pop("level"), d.pop("raw_level")
        out.append(Sample.from_dict(model.update(d)))
    return samples, out


def test_recorded_demo_trace_replays_to_the_recorded_levels():
    recorded, replayed = replay(TRACES / "demo_validation_leak.jsonl")
    assert [r.level for r in replayed] == [r.level for r in recorded]
    assert [r.raw_level for r in replayed] == [r.raw_level for r in recorded]
    assert [r.reasons for r in replayed] == [r.reasons for r in recorded]
    assert {r.level for r in recorded} >= {Level.OK, Level.HIGH, Level.CRITICAL}


@pytest.mark.parametrize(
    "calm,drop_to_high,back_to_ok",
    # CRITICAL lasts 40-44, HIGH 45-49, calm from 50. With calm=10 the ten
    # samples 45-54 are all below CRITICAL, the highest of them HIGH.
    [(1, 45, 50), (5, 49, 54), (10, 54, 64)],
)
def test_swap_storm_rises_at_once_and_falls_after_calm_samples(calm, drop_to_high, back_to_ok):
    _, out = replay(TRACES / "swap_storm.jsonl", calm_samples=calm)
    levels = [s.level for s in out]
    # up at once, at the first sample of each phase
    assert levels[:20] == [Level.OK] * 20
    assert levels[20] == Level.ELEVATED and out[20].reasons == ("headroom",)
    assert levels[30] == Level.HIGH and out[30].reasons == ("headroom", "psi", "swap")
    assert levels[40] == Level.CRITICAL and out[40].reasons == ("psi",)
    # down only after `calm` samples below the level
    assert levels[40:drop_to_high] == [Level.CRITICAL] * (drop_to_high - 40)
    assert levels[drop_to_high] == Level.HIGH
    assert levels[drop_to_high:back_to_ok] == [Level.HIGH] * (back_to_ok - drop_to_high)
    assert levels[back_to_ok:] == [Level.OK] * (len(levels) - back_to_ok)
    # the level never sits below what the sample alone says
    assert all(s.level >= s.raw_level for s in out)


def test_thresholds_are_options():
    _, strict = replay(TRACES / "swap_storm.jsonl", headroom_elevated=0.5)
    assert strict[0].level == Level.ELEVATED  # 40 % free is now too little
    _, lax = replay(TRACES / "swap_storm.jsonl", psi_critical=0.9, headroom_critical=0.0)
    assert max(s.level for s in lax) == Level.HIGH


def test_each_signal_sets_its_reason():
    m = _C.PressureModel(pressure={"calm_samples": 1})
    base = {"mem_total_bytes": 100, "mem_available_bytes": 90}
    cases = [
        ({"rss_bytes": 95, "budget_bytes": 100}, "budget", Level.HIGH),
        ({"mem_available_bytes": 2}, "headroom", Level.CRITICAL),
        ({"psi_some_stall": 0.06}, "psi", Level.ELEVATED),
        ({"cgroup_psi_some_stall": 0.2}, "psi", Level.HIGH),
        ({"swap_in_pages_per_s": 30000.0}, "swap", Level.CRITICAL),
        ({"major_faults_per_s": 6000.0}, "faults", Level.HIGH),
        ({"cgroup_usage_bytes": 99, "cgroup_limit_bytes": 100, "cgroup_version": 2},
         "headroom", Level.CRITICAL),
        ({"cgroup_usage_bytes": 99, "cgroup_working_set_bytes": 50,
          "cgroup_limit_bytes": 100, "cgroup_version": 1}, None, Level.OK),
    ]
    for extra, reason, level in cases:
        d = m.update({**base, **extra})
        assert d["raw_level"] == level, extra
        assert (reason in d["reasons"]) if reason else d["reasons"] == (), extra
    calm = m.update(base)
    assert calm["level"] == Level.OK and calm["headroom_fraction"] == 0.9


def test_absent_signals_are_not_pressure():
    d = _C.PressureModel().update({})
    assert d["raw_level"] == 0 and d["headroom_fraction"] is None
    assert d["budget_used_fraction"] is None


STALL_FOR_LEVEL = [0.0, 0.06, 0.2, 0.5]


@settings(max_examples=200, deadline=None)
@given(raw=st.lists(st.integers(0, 3), min_size=1, max_size=60), calm=st.integers(1, 6))
def test_hysteresis_matches_its_definition(raw, calm):
    """Up at once; down only after `calm` samples below the level, to the
    highest raw level among them."""
    m = _C.PressureModel(pressure={"calm_samples": calm})
    level, n_calm, calm_max = 0, 0, 0
    for r in raw:
        got = m.update({"psi_some_stall": STALL_FOR_LEVEL[r]})
        if r >= level:
            level, n_calm, calm_max = r, 0, 0
        else:
            n_calm += 1
            calm_max = max(calm_max, r)
            if n_calm >= calm:
                level, n_calm, calm_max = calm_max, 0, 0
        assert got["raw_level"] == r
        assert got["level"] == level


def _write(root, rel, text):
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def _psi(some_us, full_us):
    return (f"some avg10=0.00 avg60=0.00 avg300=0.00 total={some_us}\n"
            f"full avg10=0.00 avg60=0.00 avg300=0.00 total={full_us}\n")


def test_fixture_tree_drives_the_sampler_up_and_down(tmp_path, restore_options):
    """The whole path: files -> sources -> deltas -> model -> published level,
    with the sampler thread reading a tree the test rewrites. Each phase
    lasts until the sampler has seen it, and what is checked of each sample
    follows from what that sample read, however late a loaded machine ran
    the sampler's thread."""
    _C.arena_trim(0)        # this process's arena cache is no part of the tree
    _C.option_set("slow_interval_ms", "5")
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    cg.mkdir()
    _write(proc, "self/status", "Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nVmSwap:\t 0 kB\n")
    _write(proc, "self/statm", "1000 256 100 1 0 200 0\n")
    _write(proc, "self/stat", "7 (x) S 1 7 7 0 -1 0 100 0 0 0\n")
    _write(proc, "self/cgroup", "0::/\n")
    _write(proc, "meminfo", "MemTotal: 1000 kB\nMemAvailable: 500 kB\nSwapTotal: 0 kB\n"
                            "SwapFree: 0 kB\n")
    _write(proc, "vmstat", "pswpin 0\npswpout 0\npgmajfault 0\n")
    _write(proc, "pressure/memory", _psi(0, 0))
    s = Sampler(interval_ms=10, proc_root=proc, cgroup_root=cg, pressure={"calm_samples": 3})
    events = []
    s.on_pressure(events.append)
    total = 0

    def stall() -> bool:
        """Move the PSI totals an hour on (a stall far past wall time,
        capped at 1.0); whether 3 samples stalled yet."""
        nonlocal total
        total += 3600 * 10**6
        _write(proc, "pressure/memory", _psi(total, total // 2))
        return sum("psi" in h.reasons for h in s.history()) >= 3

    with s:
        assert wait_for(stall)
        stall_end = s.latest().seq
        # the stalls stop: down after calm_samples samples
        assert wait_for(lambda: s.latest().level == Level.OK)
        # headroom: MemAvailable falls to 2 % of MemTotal
        _write(proc, "meminfo", "MemTotal: 1000 kB\nMemAvailable: 20 kB\n")
        written = s.latest().seq       # the next one may have read the file before
        assert wait_for(lambda: s.latest().seq >= written + 2)
        low = s.latest()
    hist = s.history()
    # a sample stalls exactly when the totals moved since the one before it
    for prev, h in zip(hist, hist[1:]):
        moved = None not in (prev.psi_some_total_us, h.psi_some_total_us) and \
            h.psi_some_total_us > prev.psi_some_total_us
        assert ("psi" in h.reasons) == moved, (prev, h)
        if moved:
            assert h.raw_level == Level.CRITICAL and h.psi_some_stall == 1.0, h
    peak = [h for h in hist if h.seq <= stall_end and "psi" in h.reasons][-1]
    assert peak.rss_bytes == 256 * os.sysconf("SC_PAGE_SIZE")
    assert peak.minor_faults == 100
    assert low.level == Level.CRITICAL and low.reasons == ("headroom",)
    assert low.headroom_fraction == pytest.approx(0.02)
    seq = [(e.old, e.new) for e in events]
    assert seq[0] == (Level.OK, Level.CRITICAL)
    assert (Level.CRITICAL, Level.OK) in seq  # came down after the stall ended
    assert seq[-1][1] == Level.CRITICAL


def test_traces_are_valid_json():
    for p in TRACES.glob("*.jsonl"):
        for line in p.read_text().splitlines():
            json.loads(line)
