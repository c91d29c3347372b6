"""The /proc and cgroup parsers through memguard._C.parse, and the C sampler
on the fixture trees: exact values from real layouts, a ValueError naming
the kind and the problem for malformed files, and properties: any bytes
parse or raise ValueError, and generated well-formed files parse back to the
values written into them.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memguard import _C

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "proc"
BAD = FIXTURES / "bad"
KINDS = ("status", "meminfo", "vmstat", "psi", "stat", "cgroup", "limit", "cgstat", "cgevents",
         "rollup", "pids")
KiB = 1024
U64 = 2**64 - 1
PAGE = os.sysconf("SC_PAGE_SIZE")


def parse_file(rel: str, kind: str, version: int = 2) -> dict:
    return _C.parse(kind, (FIXTURES / rel).read_bytes(), version)


def assert_same(got: dict, expected: dict) -> None:
    """Same keys; equal values, floats (decimal text in the files) to 1e-12."""
    assert set(got) == set(expected)
    for key, value in expected.items():
        if isinstance(value, float):
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
        else:
            assert got[key] == value, key


def _text(rel: str) -> str:
    return (FIXTURES / rel).read_text()


# ---- exact values from the fixture files --------------------------------

EXACT = [
    ("v1_hybrid/proc/self/status", "status", 2,
     {"rss_bytes": 102400 * KiB, "hwm_bytes": 204800 * KiB, "swap_bytes": 2048 * KiB}),
    ("v2/proc/self/status", "status", 2,
     {"rss_bytes": 204800 * KiB, "hwm_bytes": 307200 * KiB, "swap_bytes": 0}),
    ("v2_nolimit/proc/self/status", "status", 2,
     {"rss_bytes": 51200 * KiB, "hwm_bytes": 51200 * KiB, "swap_bytes": None}),
    ("v2/proc/meminfo", "meminfo", 2,
     {"total_bytes": 32768000 * KiB, "available_bytes": 16384000 * KiB,
      "swap_total_bytes": 8388604 * KiB, "swap_free_bytes": 8000000 * KiB}),
    ("v2_nolimit/proc/meminfo", "meminfo", 2,
     {"total_bytes": 32768000 * KiB, "available_bytes": 2000000 * KiB,
      "swap_total_bytes": 0, "swap_free_bytes": 0}),
    ("no_psi/proc/meminfo", "meminfo", 2,
     {"total_bytes": 16384000 * KiB, "available_bytes": None,
      "swap_total_bytes": 2097148 * KiB, "swap_free_bytes": 2097148 * KiB}),
    ("v1_hybrid/proc/vmstat", "vmstat", 2, {"pswpin": 1111, "pswpout": 2222, "pgmajfault": 3333}),
    ("v2/proc/vmstat", "vmstat", 2, {"pswpin": 5000, "pswpout": 6000, "pgmajfault": 7000}),
    ("v1_hybrid/proc/pressure/memory", "psi", 2,
     {"some_avg10": 1.5, "some_avg60": 0.75, "some_total_us": 123456,
      "full_avg10": 0.5, "full_avg60": 0.25, "full_total_us": 65432}),
    ("v2/proc/pressure/memory", "psi", 2,
     {"some_avg10": 12.34, "some_avg60": 5.67, "some_total_us": 98765432,
      "full_avg10": 3.21, "full_avg60": 1.11, "full_total_us": 12345678}),
    ("v2/cgroup/user.slice/app.scope/memory.pressure", "psi", 2,
     {"some_avg10": 4.0, "some_avg60": 2.0, "some_total_us": 444444,
      "full_avg10": 2.5, "full_avg60": 1.25, "full_total_us": 222222}),
    ("v1_hybrid/proc/self/stat", "stat", 2, {"minor_faults": 123456, "major_faults": 789}),
    ("v2/proc/self/stat", "stat", 2, {"minor_faults": 222222, "major_faults": 22}),
    ("nscgroup/proc/self/stat", "stat", 2, {"minor_faults": 424242, "major_faults": 4242}),
    ("v1_hybrid/proc/self/cgroup", "cgroup", 2, {"v1_memory": "/training/job42", "v2": "/"}),
    ("v2/proc/self/cgroup", "cgroup", 2, {"v1_memory": None, "v2": "/user.slice/app.scope"}),
    ("nscgroup/proc/self/cgroup", "cgroup", 2,
     {"v1_memory": None, "v2": "/system.slice/docker-4f2a9c.scope"}),
    ("v2/cgroup/user.slice/app.scope/memory.current", "limit", 2, {"limit_bytes": 4026531840}),
    ("v2/cgroup/user.slice/app.scope/memory.max", "limit", 2, {"limit_bytes": None}),
    ("v2/cgroup/user.slice/app.scope/memory.high", "limit", 2, {"limit_bytes": 4160749568}),
    ("v2/cgroup/user.slice/memory.max", "limit", 2, {"limit_bytes": 4294967296}),
    ("v1_hybrid/cgroup/memory/training/job42/memory.limit_in_bytes", "limit", 1,
     {"limit_bytes": 8589934592}),
    ("v1_hybrid/cgroup/memory/memory.limit_in_bytes", "limit", 1,
     {"limit_bytes": 9223372036854771712}),
    ("v2/cgroup/user.slice/app.scope/memory.stat", "cgstat", 2,
     {"inactive_file": 134217728, "hierarchical_limit": None}),
    ("v1_hybrid/cgroup/memory/training/job42/memory.stat", "cgstat", 1,
     {"inactive_file": 536870912, "hierarchical_limit": 8589934592}),
    ("v1_parent_limit/cgroup/memory/batch/job7/memory.stat", "cgstat", 1,
     {"inactive_file": 0, "hierarchical_limit": 6442450944}),
    ("v2/cgroup/user.slice/app.scope/memory.events", "cgevents", 2, {"oom": 1, "oom_kill": 1}),
    ("v1_hybrid/cgroup/memory/training/job42/memory.oom_control", "cgevents", 1,
     {"oom": 2, "oom_kill": 2}),
    ("tree/proc/4242/smaps_rollup", "rollup", 2, {"private_bytes": (1024 + 51200 + 2048) * KiB}),
    ("tree/proc/4244/smaps_rollup", "rollup", 2, {"private_bytes": 10240 * KiB}),
    ("tree/proc/self/task/100/children", "pids", 2, {"pids": [4242, 4243, 4250]}),
    ("tree/proc/self/task/101/children", "pids", 2, {"pids": []}),
    ("v1_parent_limit/cgroup/memory/batch/job7/memory.oom_control", "cgevents", 1,
     {"oom": None, "oom_kill": None}),
]


@pytest.mark.parametrize("rel,kind,version,expected", EXACT, ids=[e[0] for e in EXACT])
def test_fixture_values(rel, kind, version, expected):
    assert_same(parse_file(rel, kind, version), expected)


def test_psi_without_full_line_has_no_full_keys():
    got = _C.parse("psi", b"some avg10=0.10 avg60=0.20 avg300=0.30 total=5\n")
    assert_same(got, {"some_avg10": 0.1, "some_avg60": 0.2, "some_total_us": 5})


def test_unknown_kind_is_a_valueerror():
    with pytest.raises(ValueError, match="unknown parser kind 'smaps'"):
        _C.parse("smaps", b"")


# ---- malformed files -----------------------------------------------------

# What the error must say about each file in bad/ (after "<kind>: ").
# statm.* files have no Python parser kind; the C tests cover them.
BAD_WHY = {
    "cgevents.bad_oom_kill": "oom_kill malformed",
    "cgevents.no_oom": "oom missing",
    "cgevents.truncated_in_oom": "oom missing or malformed",
    "cgevents.v1.bad_oom_kill": "oom_kill malformed",
    "cgevents.v1.no_under_oom": "under_oom missing",
    "cgroup.empty": "neither a v2 line nor a v1 memory line",
    "cgroup.empty_path": "path empty",
    "cgroup.garbage_line": "line without hierarchy:controllers:path",
    "cgroup.no_memory_line": "neither a v2 line nor a v1 memory line",
    "cgroup.relative_path": "relative",
    "cgroup.relative_v1_path": "relative",
    "cgroup.truncated_path": "cut short",
    "cgstat.bad_inactive_file": "inactive_file malformed",
    "cgstat.no_inactive_file": "no field memguard uses",
    "cgstat.truncated_in_inactive_file": "inactive_file malformed",
    "cgstat.v1.bad_hierarchical_limit": "hierarchical_memory_limit malformed",
    "cgstat.v1.no_fields": "no field memguard uses",
    "limit.empty": 'not a number or "max"',
    "limit.garbage": "trailing text",
    "limit.maximum": "trailing text",
    "limit.negative": "not a number",
    "limit.overflow": "not a number",
    "limit.truncated": "cut short",
    "limit.two_numbers": "trailing text",
    "meminfo.bad_memavailable": "MemAvailable malformed",
    "meminfo.letters_in_number": "MemTotal missing or malformed",
    "meminfo.no_memtotal": "MemTotal missing",
    "meminfo.truncated_in_swapfree": "SwapFree malformed",
    "meminfo.zero_memtotal": "MemTotal is zero",
    "pids.letters": "malformed or cut off",
    "pids.negative": "malformed or cut off",
    "pids.too_large": "out of range",
    "pids.truncated_mid_pid": "malformed or cut off",
    "pids.zero": "out of range",
    "psi.bad_decimal": 'malformed "some" line',
    "psi.bad_full": 'malformed "full" line',
    "psi.empty": 'no "some" line',
    "psi.missing_equals": 'malformed "some" line',
    "psi.no_some": 'no "some" line',
    "psi.no_total": 'malformed "some" line',
    "psi.truncated_mid_total": "cut short",
    "rollup.letters_in_number": "Private_Dirty missing or malformed",
    "rollup.no_private_clean": "Private_Clean missing",
    "rollup.no_private_dirty": "Private_Dirty missing",
    "rollup.overflow": "overflows",
    "rollup.truncated_in_swappss": "SwapPss missing or malformed",
    "stat.letters_in_minflt": "malformed fault count",
    "stat.no_paren": 'no ")"',
    "stat.short": "fewer than 12 fields",
    "stat.truncated_in_majflt": "malformed fault count",
    "status.bad_unit": "VmRSS missing or malformed",
    "status.empty": "VmRSS missing",
    "status.no_vmhwm": "VmHWM missing",
    "status.no_vmrss": "VmRSS missing",
    "status.overflow": "VmRSS missing or malformed",
    "status.truncated_mid_number": "VmRSS missing or malformed",
    "status.vmswap_letters": "VmSwap malformed",
    "vmstat.no_pgmajfault": "pgmajfault missing",
    "vmstat.no_pswpin": "pswpin missing",
    "vmstat.overflow": "pswpout missing or malformed",
    "vmstat.truncated_mid_number": "pgmajfault missing or malformed",
}


def _kind_version(name: str):
    parts = name.split(".")
    return parts[0], 1 if parts[1] == "v1" else 2


def test_every_bad_file_has_an_expected_message():
    names = {p.name for p in BAD.iterdir() if not p.name.startswith("statm.")}
    assert names == set(BAD_WHY)


@pytest.mark.parametrize("name", sorted(BAD_WHY))
def test_bad_file_raises_valueerror_naming_kind_and_problem(name):
    kind, version = _kind_version(name)
    with pytest.raises(ValueError) as exc:
        _C.parse(kind, (BAD / name).read_bytes(), version)
    message = str(exc.value)
    assert message.startswith(f"{kind}: ")
    assert BAD_WHY[name] in message


# Files cut at every length: a prefix parses to values of the whole file
# (or leaves them out), or raises; a cut number never reads as a smaller one.
PREFIX_FILES = [
    ("v2/proc/self/status", "status", 2),
    ("v2/proc/meminfo", "meminfo", 2),
    ("v2/proc/pressure/memory", "psi", 2),
    ("v2/proc/self/stat", "stat", 2),
    ("v1_hybrid/proc/self/cgroup", "cgroup", 2),
    ("v2/cgroup/user.slice/app.scope/memory.high", "limit", 2),
    ("v2/cgroup/user.slice/app.scope/memory.events", "cgevents", 2),
    ("v1_hybrid/cgroup/memory/training/job42/memory.oom_control", "cgevents", 1),
    ("tree/proc/4242/smaps_rollup", "rollup", 2),
    ("tree/proc/self/task/100/children", "pids", 2),
]


@pytest.mark.parametrize("rel,kind,version", PREFIX_FILES, ids=[p[0] for p in PREFIX_FILES])
def test_every_prefix_parses_honestly_or_raises(rel, kind, version):
    data = (FIXTURES / rel).read_bytes()
    full = _C.parse(kind, data, version)
    for n in range(len(data)):
        try:
            part = _C.parse(kind, data[:n], version)
        except ValueError as exc:
            assert str(exc).startswith(f"{kind}: ")
            continue
        for key, value in part.items():
            want = full.get(key)
            if isinstance(value, list):   # pids: the first of them, each whole
                want = want[:len(value)]
            assert value is None or value == want, (n, key, value, want)


# ---- properties ------------------------------------------------------------

PROCISH = string.digits + " \n\t:.=()/,-kBmaxsomefulltavgVmRSHWMTotalin_" + "\x00\xff"


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(KINDS), version=st.sampled_from((1, 2)),
       data=st.one_of(st.binary(max_size=1024),
                      st.text(alphabet=PROCISH, max_size=512).map(
                          lambda t: t.encode("latin-1"))))
def test_any_bytes_parse_or_raise_valueerror(kind, version, data):
    try:
        got = _C.parse(kind, data, version)
    except ValueError as exc:
        assert str(exc).startswith(f"{kind}: ")
    else:
        assert isinstance(got, dict) and got


u64 = st.integers(0, U64)
kb = st.integers(0, U64 // KiB)
centi = st.integers(0, 10000)  # PSI averages: percent with two decimals


def _replace_line(text: str, key: str, line: str | None) -> str:
    """Replace the line starting with key (a whole word) by line, or drop it."""
    pat = re.compile(rf"^{re.escape(key)}[: ].*\n", re.MULTILINE)
    assert pat.search(text), key
    return pat.sub("" if line is None else line + "\n", text, count=1)


@given(rss=kb, hwm=kb, swap=st.one_of(st.none(), kb))
def test_generated_status_roundtrips(rss, hwm, swap):
    text = _text("v2/proc/self/status")
    text = _replace_line(text, "VmRSS", f"VmRSS:\t{rss:8d} kB")
    text = _replace_line(text, "VmHWM", f"VmHWM:\t{hwm:8d} kB")
    text = _replace_line(text, "VmSwap", None if swap is None else f"VmSwap:\t{swap:8d} kB")
    got = _C.parse("status", text.encode())
    assert got == {"rss_bytes": rss * KiB, "hwm_bytes": hwm * KiB,
                   "swap_bytes": None if swap is None else swap * KiB}


@given(total=st.integers(1, U64 // KiB), avail=st.one_of(st.none(), kb),
       swap=st.one_of(st.none(), st.tuples(kb, kb)), drop_one_swap_line=st.booleans())
def test_generated_meminfo_roundtrips(total, avail, swap, drop_one_swap_line):
    text = _text("v2/proc/meminfo")
    text = _replace_line(text, "MemTotal", f"MemTotal:       {total:8d} kB")
    text = _replace_line(text, "MemAvailable",
                         None if avail is None else f"MemAvailable:   {avail:8d} kB")
    if swap is None:
        text = _replace_line(text, "SwapTotal", None)
        text = _replace_line(text, "SwapFree", None)
    else:
        text = _replace_line(text, "SwapTotal", f"SwapTotal:      {swap[0]:8d} kB")
        text = _replace_line(text, "SwapFree",
                             None if drop_one_swap_line else f"SwapFree:       {swap[1]:8d} kB")
    got = _C.parse("meminfo", text.encode())
    have_swap = swap is not None and not drop_one_swap_line  # both lines, or no swap figures
    assert got == {
        "total_bytes": total * KiB,
        "available_bytes": None if avail is None else avail * KiB,
        "swap_total_bytes": swap[0] * KiB if have_swap else None,
        "swap_free_bytes": swap[1] * KiB if have_swap else None,
    }


@given(pswpin=u64, pswpout=u64, pgmajfault=u64)
def test_generated_vmstat_roundtrips(pswpin, pswpout, pgmajfault):
    text = _text("v2/proc/vmstat")
    text = _replace_line(text, "pswpin", f"pswpin {pswpin}")
    text = _replace_line(text, "pswpout", f"pswpout {pswpout}")
    text = _replace_line(text, "pgmajfault", f"pgmajfault {pgmajfault}")
    assert _C.parse("vmstat", text.encode()) == {
        "pswpin": pswpin, "pswpout": pswpout, "pgmajfault": pgmajfault}


def _avg(c: int) -> str:
    return f"{c // 100}.{c % 100:02d}"


@given(some=st.tuples(centi, centi, centi, u64),
       full=st.one_of(st.none(), st.tuples(centi, centi, centi, u64)))
def test_generated_psi_roundtrips(some, full):
    text = (f"some avg10={_avg(some[0])} avg60={_avg(some[1])} avg300={_avg(some[2])} "
            f"total={some[3]}\n")
    expected: dict[str, object] = {"some_avg10": some[0] / 100, "some_avg60": some[1] / 100,
                                   "some_total_us": some[3]}
    if full is not None:
        text += (f"full avg10={_avg(full[0])} avg60={_avg(full[1])} avg300={_avg(full[2])} "
                 f"total={full[3]}\n")
        expected.update(full_avg10=full[0] / 100, full_avg60=full[1] / 100,
                        full_total_us=full[3])
    assert_same(_C.parse("psi", text.encode()), expected)


COMM = string.ascii_letters + string.digits + " ()-_./:[]"


@given(pid=st.integers(1, 2**22), comm=st.text(alphabet=COMM, max_size=15), minflt=u64,
       majflt=u64)
def test_generated_stat_roundtrips(pid, comm, minflt, majflt):
    rest = _text("v2/proc/self/stat").rsplit(")", 1)[1].split()
    rest[7], rest[9] = str(minflt), str(majflt)  # after ')': state ppid ... minflt cminflt majflt
    text = f"{pid} ({comm}) {' '.join(rest)}\n"
    assert _C.parse("stat", text.encode()) == {"minor_faults": minflt, "major_faults": majflt}


segment = st.text(alphabet=string.ascii_letters + string.digits + "._@-", min_size=1,
                  max_size=20)
cgpath = st.lists(segment, max_size=6).map(lambda s: "/" + "/".join(s))


@given(v2=st.one_of(st.none(), cgpath), v1=st.one_of(st.none(), cgpath),
       others=st.lists(st.sampled_from(["cpu", "cpuacct", "pids", "blkio", "name=systemd"]),
                       unique=True), hierarchy=st.integers(1, 15))
def test_generated_cgroup_roundtrips(v2, v1, others, hierarchy):
    if v1 is None and v2 is None:
        v2 = "/"
    lines = ["12:rdma:/", "7:devices:/some/where"]
    if v1 is not None:
        lines.append(f"{hierarchy}:{','.join(sorted(others + ['memory']))}:{v1}")
    if v2 is not None:
        lines.append(f"0::{v2}")
    got = _C.parse("cgroup", ("\n".join(lines) + "\n").encode())
    assert got == {"v1_memory": v1, "v2": v2}


@given(value=st.one_of(st.just("max"), u64), blanks=st.sampled_from(["", " ", "\t"]))
def test_generated_limit_roundtrips(value, blanks):
    got = _C.parse("limit", f"{blanks}{value}{blanks}\n".encode())
    assert got == {"limit_bytes": None if value == "max" else value}


@given(inactive=u64, limit=st.integers(1, U64))
def test_generated_cgstat_roundtrips(inactive, limit):
    v2 = _replace_line(_text("v2/cgroup/user.slice/app.scope/memory.stat"), "inactive_file",
                       f"inactive_file {inactive}")
    assert _C.parse("cgstat", v2.encode(), 2) == {"inactive_file": inactive,
                                                   "hierarchical_limit": None}
    v1 = _text("v1_hybrid/cgroup/memory/training/job42/memory.stat")
    v1 = _replace_line(v1, "total_inactive_file", f"total_inactive_file {inactive}")
    v1 = _replace_line(v1, "hierarchical_memory_limit", f"hierarchical_memory_limit {limit}")
    assert _C.parse("cgstat", v1.encode(), 1) == {"inactive_file": inactive,
                                                   "hierarchical_limit": limit}


@given(values=st.tuples(u64, u64, u64, u64, u64, u64), v1_oom_kill=st.one_of(st.none(), u64))
def test_generated_cgevents_roundtrip(values, v1_oom_kill):
    low, high, mx, oom, oom_kill, group = values
    v2 = (f"low {low}\nhigh {high}\nmax {mx}\noom {oom}\noom_kill {oom_kill}\n"
          f"oom_group_kill {group}\n")
    assert _C.parse("cgevents", v2.encode(), 2) == {"oom": oom, "oom_kill": oom_kill}
    v1 = f"oom_kill_disable 0\nunder_oom {low % 2}\n"
    if v1_oom_kill is not None:
        v1 += f"oom_kill {v1_oom_kill}\n"
    assert _C.parse("cgevents", v1.encode(), 1) == {
        "oom": v1_oom_kill, "oom_kill": v1_oom_kill}


# ---- the sampler on each fixture tree ----------------------------------------

THRESHOLDS = {
    "budget_elevated": 0.80, "budget_high": 0.90, "budget_critical": 0.97,
    "headroom_elevated": 0.15, "headroom_high": 0.08, "headroom_critical": 0.03,
    "psi_elevated": 0.05, "psi_high": 0.15, "psi_critical": 0.40,
    "swap_in_elevated": 256, "swap_in_high": 2560, "swap_in_critical": 25600,
    "major_faults_elevated": 500, "major_faults_high": 5000, "major_faults_critical": 50000,
    "calm_samples": 10,
}

MEM_A = {"mem_total_bytes": 32768000 * KiB, "mem_available_bytes": 16384000 * KiB,
         "swap_total_bytes": 8388604 * KiB, "swap_free_bytes": 8000000 * KiB}
VM_A = {"swap_in_pages": 1111, "swap_out_pages": 2222, "system_major_faults": 3333}
NO_CG_PSI = {"cgroup_psi_some_avg10": None, "cgroup_psi_full_avg10": None,
             "cgroup_psi_some_total_us": None, "cgroup_psi_full_total_us": None}
ZERO_PSI = {"psi_some_avg10": 0.0, "psi_some_avg60": 0.0, "psi_some_total_us": 0,
            "psi_full_avg10": 0.0, "psi_full_avg60": 0.0, "psi_full_total_us": 0}


def _process(pages: int, hwm_kb: int, swap_kb: int | None, minflt: int, majflt: int) -> dict:
    rss = pages * PAGE
    return {"rss_bytes": rss, "rss_peak_bytes": max(rss, hwm_kb * KiB),
            "swap_bytes": None if swap_kb is None else swap_kb * KiB,
            "footprint_bytes": rss + (swap_kb or 0) * KiB,
            "minor_faults": minflt, "major_faults": majflt}


SCENARIOS = {
    "v1_hybrid": {
        **_process(25600, 204800, 2048, 123456, 789), **MEM_A, **VM_A,
        "psi_some_avg10": 1.5, "psi_some_avg60": 0.75, "psi_some_total_us": 123456,
        "psi_full_avg10": 0.5, "psi_full_avg60": 0.25, "psi_full_total_us": 65432,
        "cgroup_version": 1, "cgroup_usage_bytes": 3221225472,
        "cgroup_limit_bytes": 8589934592, "cgroup_high_bytes": None,
        "cgroup_working_set_bytes": 2684354560, "cgroup_oom_events": 2,
        "cgroup_oom_kill_events": 2, **NO_CG_PSI,
        "headroom_fraction": 0.5, "raw_level": 0, "level": 0, "reasons": (),
    },
    "v1_parent_limit": {
        **_process(20480, 102400, 0, 1000, 10), **MEM_A, **VM_A, **ZERO_PSI,
        "cgroup_version": 1, "cgroup_usage_bytes": 1073741824,
        "cgroup_limit_bytes": 6442450944, "cgroup_high_bytes": None,
        "cgroup_working_set_bytes": 1073741824, "cgroup_oom_events": None,
        "cgroup_oom_kill_events": None, **NO_CG_PSI,
        "headroom_fraction": 0.5, "raw_level": 0, "level": 0, "reasons": (),
    },
    "v2": {
        **_process(51200, 307200, 0, 222222, 22), **MEM_A,
        "swap_in_pages": 5000, "swap_out_pages": 6000, "system_major_faults": 7000,
        "psi_some_avg10": 12.34, "psi_some_avg60": 5.67, "psi_some_total_us": 98765432,
        "psi_full_avg10": 3.21, "psi_full_avg60": 1.11, "psi_full_total_us": 12345678,
        # memory.max is "max" in app.scope; the parent's 4 GiB applies
        "cgroup_version": 2, "cgroup_usage_bytes": 4026531840,
        "cgroup_limit_bytes": 4294967296, "cgroup_high_bytes": 4160749568,
        "cgroup_working_set_bytes": 3892314112, "cgroup_oom_events": 1,
        "cgroup_oom_kill_events": 1,
        "cgroup_psi_some_avg10": 4.0, "cgroup_psi_full_avg10": 2.5,
        "cgroup_psi_some_total_us": 444444, "cgroup_psi_full_total_us": 222222,
        "headroom_fraction": 0.09375, "raw_level": 1, "level": 1, "reasons": ("headroom",),
    },
    "v2_nolimit": {
        **_process(12800, 51200, None, 5000, 0),
        "mem_total_bytes": 32768000 * KiB, "mem_available_bytes": 2000000 * KiB,
        "swap_total_bytes": 0, "swap_free_bytes": 0,
        "swap_in_pages": 0, "swap_out_pages": 0, "system_major_faults": 42,
        "psi_some_avg10": 0.1, "psi_some_avg60": 0.05, "psi_some_total_us": 4242,
        "psi_full_avg10": 0.0, "psi_full_avg60": 0.0, "psi_full_total_us": 1000,
        "cgroup_version": 2, "cgroup_usage_bytes": 268435456,
        "cgroup_limit_bytes": None, "cgroup_high_bytes": None,
        "cgroup_working_set_bytes": 201326592, "cgroup_oom_events": 0,
        "cgroup_oom_kill_events": 0,
        "cgroup_psi_some_avg10": 0.0, "cgroup_psi_full_avg10": 0.0,
        "cgroup_psi_some_total_us": 10, "cgroup_psi_full_total_us": 5,
        "headroom_fraction": 0.06103515625, "raw_level": 2, "level": 2, "reasons": ("headroom",),
    },
    "no_psi": {
        **_process(7680, 40960, 0, 777, 7),
        "mem_total_bytes": 16384000 * KiB, "mem_available_bytes": None,
        "swap_total_bytes": 2097148 * KiB, "swap_free_bytes": 2097148 * KiB, **VM_A,
        "psi_some_avg10": None, "psi_some_avg60": None, "psi_some_total_us": None,
        "psi_full_avg10": None, "psi_full_avg60": None, "psi_full_total_us": None,
        "cgroup_version": 2, "cgroup_usage_bytes": 536870912,
        "cgroup_limit_bytes": 1073741824, "cgroup_high_bytes": None,
        "cgroup_working_set_bytes": 536870912, "cgroup_oom_events": 0,
        "cgroup_oom_kill_events": 0, **NO_CG_PSI,
        "headroom_fraction": 0.5, "raw_level": 0, "level": 0, "reasons": (),
    },
    "nscgroup": {
        **_process(38400, 153600, 512, 424242, 4242), **MEM_A, **VM_A, **ZERO_PSI,
        # /system.slice/docker-4f2a9c.scope is not under the mount: its root is used
        "cgroup_version": 2, "cgroup_usage_bytes": 805306368,
        "cgroup_limit_bytes": 2147483648, "cgroup_high_bytes": None,
        "cgroup_working_set_bytes": 536870912, "cgroup_oom_events": 0,
        "cgroup_oom_kill_events": 0,
        "cgroup_psi_some_avg10": 0.5, "cgroup_psi_full_avg10": 0.25,
        "cgroup_psi_some_total_us": 7777, "cgroup_psi_full_total_us": 3333,
        "headroom_fraction": 0.5, "raw_level": 0, "level": 0, "reasons": (),
    },
}

# v1_hybrid with a process tree: two children read, a third listed but gone,
# and a rank of the same job (LOCAL_RANK=1, 4250) with a worker (4251) of its own
_TREE_KIDS = (1024 + 51200 + 2048 + 10240) * KiB
_TREE_RANK = (1024 + 102400 + 2048 + 10240) * KiB
SCENARIOS["tree"] = {**SCENARIOS["v1_hybrid"], "children": 2, "children_bytes": _TREE_KIDS,
                     "footprint_bytes": 25600 * PAGE + 2048 * KiB + _TREE_KIDS}

# Not known on a first sample (no previous one), and no budget was given.
FIRST_SAMPLE = {
    "seq": 1, "interval_s": None, "minor_faults_per_s": None, "major_faults_per_s": None,
    "swap_in_pages_per_s": None, "swap_out_pages_per_s": None, "psi_some_stall": None,
    "psi_full_stall": None, "cgroup_psi_some_stall": None, "cgroup_psi_full_stall": None,
    "budget_bytes": None, "budget_used_fraction": None, "budget_source": None,
    "user_budget_bytes": None,
    # the fixture trees list no tasks (but "tree", below)
    "children": None, "children_bytes": None,
    # nothing pushed CUDA counters to this sampler
    **{f: None for f in _C.sample_fields() if f.startswith("cuda_")},
    # Linux has no compressor counters and no kernel level of its own (macOS's)
    "compressed_bytes": None, "compressions": None, "compressions_per_s": None,
    "os_pressure_level": None,
}


def _sampler(scenario: str, **kw) -> _C.Sampler:
    # the arena's counters are this process's: a cache an earlier test left
    # (larger than the fixture's footprint) would read as negative use
    _C.arena_trim(0)
    root = FIXTURES / scenario
    return _C.Sampler(interval_ms=100, proc_root=str(root / "proc"),
                      cgroup_root=str(root / "cgroup"), pressure=THRESHOLDS, **kw)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_sample_now_on_fixture_tree(scenario, monkeypatch):
    for name in ("LOCAL_RANK", "RANK"):        # this process is no rank
        monkeypatch.delenv(name, raising=False)
    got = _sampler(scenario).sample_now()
    assert set(got) == set(_C.sample_fields())
    assert got["sample_cost_us"] >= 0
    del got["t"], got["sample_cost_us"]
    # the arena's counters are this process's, not the fixture tree's
    got = {k: v for k, v in got.items() if not k.startswith("arena_")}
    assert_same(got, {**FIRST_SAMPLE, **SCENARIOS[scenario]})


@pytest.mark.parametrize("mine", ["0", "1"])
def test_the_tree_leaves_out_other_ranks_of_the_job(monkeypatch, mine):
    """4250's environment names LOCAL_RANK=1: seen from rank 0 it is another
    rank of the job (Lightning's launcher started it), left out with its
    worker; seen from rank 1, whose environment names 1 too, both are its own
    workers."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("LOCAL_RANK", mine)
    got = _sampler("tree").sample_now()
    assert (got["children"], got["children_bytes"]) == \
        ((2, _TREE_KIDS) if mine == "0" else (4, _TREE_KIDS + _TREE_RANK))


def test_a_running_sampler_notes_a_rank_named_after_its_start(monkeypatch, restore_options):
    """Lightning's launcher names rank 0's LOCAL_RANK after the process
    started (and memguard with it): the callback thread notes the
    environment whenever it wakes (here at every sample), so the sampler
    thread, which never reads it, judges by the new value from then on."""
    from memguard.telemetry import Sampler

    from .conftest import wait_for

    _C.option_set("slow_interval_ms", "5")     # the tree is re-read at every sample
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    s = Sampler(interval_ms=10, proc_root=FIXTURES / "tree" / "proc",
                cgroup_root=FIXTURES / "tree" / "cgroup")
    s.on_sample(lambda _: None)
    with s:
        assert wait_for(lambda: s.latest() is not None and s.latest().children == 2)
        monkeypatch.setenv("LOCAL_RANK", "1")  # 4250 and its worker are this rank's own
        assert wait_for(lambda: s.latest().children == 4)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_second_sample_has_rates_of_unchanged_files(scenario):
    s = _sampler(scenario)
    first, second = s.sample_now(), s.sample_now()
    assert second["seq"] == 2
    assert second["interval_s"] > 0
    assert second["minor_faults_per_s"] == 0.0 and second["major_faults_per_s"] == 0.0
    has_psi = first["psi_some_total_us"] is not None
    assert second["psi_some_stall"] == (0.0 if has_psi else None)
    has_cg_psi = first["cgroup_psi_some_total_us"] is not None
    assert second["cgroup_psi_some_stall"] == (0.0 if has_cg_psi else None)
    for key in SCENARIOS[scenario]:
        if not key.endswith("_per_s"):
            assert second[key] == first[key], key


def test_budget_on_fixture_tree():
    foot = 38400 * PAGE + 512 * KiB      # resident and swapped out
    got = _sampler("nscgroup", budget_bytes=foot * 2).sample_now()
    assert got["budget_bytes"] == foot * 2 and got["budget_source"] == "user"
    # the arena's cached bytes (left by an earlier test in this process) are
    # memory the process can give back at once: not counted as used
    cached = got.get("arena_cached_bytes") or 0
    assert got["budget_used_fraction"] == pytest.approx((foot - cached) / (foot * 2))
    assert got["level"] == 0
    got = _sampler("nscgroup", budget_bytes=(foot - cached) // 2).sample_now()
    assert got["level"] == 3 and got["reasons"] == ("budget",)


def test_live_budget_on_fixture_tree():
    """A live sampler judges against the cgroup's room (its limit less what
    others use) or the host's, whichever is less; a budget caps it; the same
    figure comes from live_budget() for a recorded sample."""
    got = _sampler("tree", live=True).sample_now()
    resident = 25600 * PAGE + _TREE_KIDS
    cgroup = 8589934592 - (2684354560 - resident) - int(0.08 * 8589934592)
    host = resident + 16384000 * KiB - int(0.08 * 32768000 * KiB)
    assert got["budget_bytes"] == min(cgroup, host)
    assert got["budget_source"] == ("cgroup" if cgroup < host else "host")
    assert got["user_budget_bytes"] is None
    assert _C.live_budget(got, 0, 0.08) == (got["budget_bytes"], got["budget_source"])
    with pytest.raises(ValueError, match="reserve must be a fraction in .0, 1., not 1.5"):
        _C.live_budget(got, 0, 1.5)
    capped = _sampler("tree", live=True, budget_bytes=2**30).sample_now()
    assert (capped["budget_bytes"], capped["budget_source"]) == (2**30, "user")
    assert capped["user_budget_bytes"] == 2**30
    assert _C.live_budget({}, 0, 0) is None


# ---- cgroup PSI without a limit; paths that climb out of a namespace -------


def test_cgroup_psi_is_in_every_sample_without_a_limit(tmp_path):
    root = tmp_path / "tree"
    shutil.copytree(FIXTURES / "v2_nolimit", root)
    meminfo = root / "proc" / "meminfo"  # plenty of headroom: level OK, no urgent refreshes
    meminfo.write_text(_replace_line(meminfo.read_text(), "MemAvailable",
                                     "MemAvailable:   16384000 kB"))
    s = _C.Sampler(interval_ms=100, proc_root=str(root / "proc"),
                   cgroup_root=str(root / "cgroup"), pressure=THRESHOLDS)
    samples = [s.sample_now() for _ in range(3)]
    assert [x["level"] for x in samples] == [0, 0, 0]
    assert [x["cgroup_psi_some_total_us"] for x in samples] == [10, 10, 10]
    assert samples[-1]["cgroup_psi_some_stall"] == 0.0


def test_cgroup_path_never_leaves_the_mount(tmp_path):
    shutil.copytree(FIXTURES / "nscgroup" / "proc", tmp_path / "proc")
    # outside a cgroup namespace's root, /proc/self/cgroup shows paths with ".."
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/../..\n")
    mount = tmp_path / "host" / "mnt"
    shutil.copytree(FIXTURES / "nscgroup" / "cgroup", mount)
    (tmp_path / "host" / "memory.current").write_text("999999\n")  # not a cgroup of ours
    got = _C.Sampler(interval_ms=100, proc_root=str(tmp_path / "proc"),
                     cgroup_root=str(mount), pressure=THRESHOLDS).sample_now()
    assert got["cgroup_usage_bytes"] == 805306368  # the mount root, the nearest visible cgroup
