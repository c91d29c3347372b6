"""``memguard doctor``: what this machine offers memguard, and what memguard does with it.

Every line is read from the machine at the time of the call: one sample from
the C sampler (memory, swap, PSI, cgroup), a few kernel settings, a search
for jemalloc, and a torch probe run in a subprocess with a timeout so that a
slow or broken torch cannot hang the report. The CUDA allocator row reads
PyTorch's allocator settings from the environment and, given a run's
telemetry (``--telemetry RUN.jsonl``), its reserved and allocated CUDA bytes;
the same file, read once, gives the run's last growth forecast and batch
headroom where it has them. Standard library only, plus ``memguard._C``.
"""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping

from memguard import _C
from memguard._common import finite, size
from memguard.cli import drift_view
from memguard.cli.run import JEMALLOC, jemalloc_candidates
from memguard.memory.cuda_advice import expandable_segments_advice
from memguard.telemetry.budget import auto_inputs
from memguard.telemetry.events import Event
from memguard.telemetry.exporters import bounded_lines

#: One report row: item, what was found, what memguard can or cannot do with it.
Row = tuple[str, str, str]

THP_DIR = "/sys/kernel/mm/transparent_hugepage"
TORCH_TIMEOUT_S = 30.0
#: Back-to-back samples timed for the sampler row.
HOT_SAMPLES = 20

#: Events of a telemetry file the doctor gives a row each, the last one of each.
DRIFT_EVENTS = (Event.FORECAST.value, Event.HEADROOM.value)

#: Sample fields of the CUDA caching allocator in a telemetry file.
CUDA_FIELDS = ("cuda_allocated_bytes", "cuda_reserved_bytes", "cuda_reserved_peak_bytes",
               "cuda_alloc_retries")

_OVERCOMMIT = {
    "0": "heuristic: obvious overcommits refused, the rest granted",
    "1": "always: every allocation granted",
    "2": "strict: commitments beyond CommitLimit refused",
}

_DEFRAG = {
    "always": "faults stall to compact memory for huge pages",
    "defer": "compaction deferred to kcompactd, faults do not stall",
    "defer+madvise": "madvised regions stall for compaction, others defer it",
    "madvise": "only madvised regions stall for compaction",
    "never": "no compaction for huge pages",
}

# Runs in a child interpreter: importing torch may take seconds, initialise
# CUDA, or crash, none of which may reach the doctor itself.
_TORCH_PROBE = r"""
import json, time
t0 = time.perf_counter()
import torch
out = {"version": torch.__version__, "import_s": time.perf_counter() - t0,
       "cuda_build": torch.version.cuda, "hip_build": getattr(torch.version, "hip", None),
       "devices": []}
try:
    out["cuda_available"] = bool(torch.cuda.is_available())
    if out["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out["devices"].append({"name": p.name, "total_bytes": p.total_memory})
except Exception as e:
    out["cuda_error"] = f"{type(e).__name__}: {e}"
print("MEMGUARD_TORCH " + json.dumps(out), flush=True)
"""


def read_text(path: str) -> tuple[str | None, str | None]:
    """Read a small text file.

    Args:
        path: the file.

    Returns:
        ``(text, None)``, or ``(None, why)`` where ``why`` is ``"absent"`` for a
        missing file and ``"unreadable (<errno text>)"`` otherwise.
    """
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(), None
    except FileNotFoundError:
        return None, "absent"
    except OSError as e:
        return None, f"unreadable ({e.strerror or os.strerror(e.errno or 0)})"


def bracketed(text: str) -> str | None:
    """The selected word of a sysfs choice list such as ``always [madvise] never``.

    Args:
        text: the file's contents.

    Returns:
        The word between brackets, or None when there is none.
    """
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def _pct_option(name: str) -> str:
    """A fractional option (e.g. ``headroom_high``) as a percentage.

    Args:
        name: option name.

    Returns:
        Text such as ``8``.
    """
    return f"{float(_C.option_get(name)) * 100:g}"


def _levels(prefix: str, pct: bool = True) -> str:
    """The three thresholds of one pressure signal, elevated/high/critical.

    Args:
        prefix: option prefix, e.g. ``psi``.
        pct: show fractions as percentages.

    Returns:
        Text such as ``5/15/40 %``.
    """
    names = [f"{prefix}_{lvl}" for lvl in ("elevated", "high", "critical")]
    if pct:
        return "/".join(_pct_option(n) for n in names) + " %"
    return "/".join(f"{float(_C.option_get(n)):g}" for n in names)


def _proc(rel: str) -> str:
    """Path under the procfs root the sampler uses (option ``proc_root``).

    Args:
        rel: path below the root, e.g. ``meminfo``.

    Returns:
        The full path.
    """
    return os.path.join(_C.option_get("proc_root"), rel)


def take_sample() -> tuple[dict | None, dict, str | None]:
    """One sample from a fresh sampler, then its cost when cold and hot.

    Args:
        None.

    Returns:
        ``(first_sample, costs, error)``: the first sample (every source
        read), ``costs`` in microseconds (``first``, ``cold`` after one
        interval, ``hot`` median of back-to-back samples), and an error text
        when the sampler could not be created or sampled.
    """
    try:
        s = _C.Sampler()
        first = s.sample_now()
        time.sleep(float(_C.option_get("interval_ms")) / 1000)
        cold = s.sample_now()["sample_cost_us"]
        hot = statistics.median(s.sample_now()["sample_cost_us"] for _ in range(HOT_SAMPLES))
    except (OSError, RuntimeError, ValueError) as e:
        return None, {}, f"{type(e).__name__}: {e}"
    return first, {"first": first["sample_cost_us"], "cold": cold, "hot": hot}, None


def memory_row(sample: dict | None, err: str | None) -> Row:
    """MemTotal and MemAvailable, and the 'auto' budget they give.

    Args:
        sample: a sampler sample, or None.
        err: why there is no sample.

    Returns:
        The report row.
    """
    total = sample and sample.get("mem_total_bytes")
    if not total:
        _, why = read_text(_proc("meminfo"))
        return ("memory", f"{_proc('meminfo')} {why}" if why else err or "MemTotal missing",
                "no system headroom signal; give the budget in bytes")
    avail = sample.get("mem_available_bytes")
    found = f"total {size(total)} ({total // 1024} kB)"
    if avail is None:
        found += ", MemAvailable missing"
        return ("memory", found, "no MemAvailable: headroom comes from the cgroup limit only")
    found += f", available {size(avail)} ({100 * avail / total:.1f} %)"
    auto = _C.parse_budget("auto", *auto_inputs(sample))
    return ("memory", found,
            (f'budget="auto" is {size(auto)} now (90 % of available memory plus this '
             f"process's RSS, within any cgroup limit; a guard re-reads it every step); "
             f"headroom pressure at {_levels('headroom')} available"))


def swap_row(sample: dict | None, err: str | None) -> Row:
    """SwapTotal and what it means for running out.

    Args:
        sample: a sampler sample, or None.
        err: why there is no sample.

    Returns:
        The report row.
    """
    total = sample.get("swap_total_bytes") if sample else None
    if total is None:
        _, why = read_text(_proc("meminfo"))
        return ("swap", f"{_proc('meminfo')} {why}" if why else err or "SwapTotal missing",
                "swap-in rate unknown; pressure from the other signals")
    if total == 0:
        return ("swap", "none (SwapTotal 0 kB)",
                ("nothing to swap to: running out ends with the OOM killer; "
                 "the swap-in signal stays idle"))
    free = sample.get("swap_free_bytes") or 0
    return ("swap", f"{size(total)}, {size(free)} free",
            f"swap-in pages/s feeds pressure at {_levels('swap_in', pct=False)} pages/s")


def psi_row(sample: dict | None) -> Row:
    """System memory PSI: present, readable, and its current averages.

    Args:
        sample: a sampler sample, or None.

    Returns:
        The report row.
    """
    path = _proc("pressure/memory")
    fallback = "pressure comes from headroom and faults only"
    text, why = read_text(path)
    if text is None and why == "absent":
        return ("PSI", f"{path} absent", fallback)
    if text is None:
        hint = ""
        try:
            os.close(os.open(path, os.O_RDONLY))
        except OSError as e:
            if e.errno == errno.EOPNOTSUPP:
                hint = " (psi=1 on the kernel command line turns it on)"
        return ("PSI", f"{path} {why}", fallback + hint)
    if not sample or sample.get("psi_some_avg10") is None:
        return ("PSI", f"{path} readable but not parsed", fallback)
    found = f"present: some avg10 {sample['psi_some_avg10']:.2f} %"
    if sample.get("psi_full_avg10") is not None:
        found += f", full avg10 {sample['psi_full_avg10']:.2f} %"
    return ("PSI", found,
            f"stall share of each interval feeds pressure at {_levels('psi')}")


def _self_cgroup_memory_path() -> str | None:
    """This process's memory cgroup path from /proc/self/cgroup.

    Args:
        None.

    Returns:
        The v1 memory path when there is one, else the v2 path, else None.
    """
    text, _ = read_text(_proc("self/cgroup"))
    v1 = v2 = None
    for line in (text or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v1 if v1 is not None else v2


def cgroup_layout(root: str) -> str:
    """How cgroups are mounted under ``root``.

    Args:
        root: the cgroup mount point (option ``cgroup_root``).

    Returns:
        ``"unified"`` (v2 only), ``"hybrid"`` (v1 controllers plus cgroup2 at
        ``root/unified``), ``"legacy"`` (v1 only) or ``"none"``.
    """
    if os.path.exists(os.path.join(root, "cgroup.controllers")):
        return "unified"
    if os.path.isdir(os.path.join(root, "unified")):
        return "hybrid"
    if os.path.isdir(os.path.join(root, "memory")):
        return "legacy"
    return "none"


def cgroup_row(sample: dict | None) -> Row:
    """The memory cgroup the sampler found: version, layout, usage, limit.

    Args:
        sample: a sampler sample, or None.

    Returns:
        The report row.
    """
    root = _C.option_get("cgroup_root")
    layout = cgroup_layout(root)
    layout_text = {
        "unified": f"unified layout (cgroup2 at {root})",
        "hybrid": f"hybrid layout (v1 controllers, cgroup2 also at {root}/unified)",
        "legacy": f"legacy layout (v1 at {root})",
        "none": f"no cgroup mount at {root}",
    }[layout]
    version = sample.get("cgroup_version") if sample else None
    if version is None:
        return ("cgroup", f"none usable; {layout_text}",
                "no memory cgroup found: headroom comes from MemAvailable only")
    where = _self_cgroup_memory_path()
    found = f"v{version} memory controller"
    if where is not None:
        found += f", this process in {where}"
    found += f"; {layout_text}; usage {size(sample.get('cgroup_usage_bytes'))}"
    limit = sample.get("cgroup_limit_bytes")
    found += f", limit {size(limit)}" if limit else ", no limit"
    if sample.get("cgroup_high_bytes"):
        found += f", memory.high {size(sample['cgroup_high_bytes'])}"
    if limit:
        can = "headroom under the limit (less inactive file pages) feeds pressure"
    else:
        can = "no limit: usage is recorded, headroom comes from MemAvailable"
    if version == 1:
        can += "; cgroup PSI needs v2"
    elif sample.get("cgroup_psi_some_avg10") is not None:
        can += "; the cgroup's memory.pressure feeds PSI"
    return ("cgroup", found, can)


def thp_row() -> Row:
    """Transparent huge pages mode and defrag policy.

    Args:
        None.

    Returns:
        The report row.
    """
    text, why = read_text(os.path.join(THP_DIR, "enabled"))
    if text is None:
        return ("THP", f"{THP_DIR}/enabled {why}", "memguard leaves the setting alone")
    mode = bracketed(text) or text.strip()
    dtext, dwhy = read_text(os.path.join(THP_DIR, "defrag"))
    defrag = (bracketed(dtext) or dtext.strip()) if dtext is not None else None
    found = mode + (f" (defrag: {defrag})" if defrag else f" (defrag {dwhy})")
    can = {
        "always": "any large anonymous region may get 2 MiB pages, so RSS can run ahead "
                  "of the bytes in use",
        "madvise": "huge pages only for regions that ask with madvise(MADV_HUGEPAGE)",
        "never": "no transparent huge pages",
    }.get(mode, "unrecognised mode")
    if defrag in _DEFRAG:
        can += f"; {_DEFRAG[defrag]}"
    return ("THP", found, can + "; memguard reads RSS as the kernel counts it and leaves "
                                "the setting alone")


def overcommit_row() -> Row:
    """vm.overcommit_memory and what it means for allocation failures.

    Args:
        None.

    Returns:
        The report row.
    """
    text, why = read_text(_proc("sys/vm/overcommit_memory"))
    if text is None:
        return ("overcommit", f"{_proc('sys/vm/overcommit_memory')} {why}", "unknown policy")
    value = text.strip()
    found = f"{value} ({_OVERCOMMIT.get(value, 'unknown value')})"
    if value == "2":
        mem, _ = read_text(_proc("meminfo"))
        fields = {
            ln.split(":")[0]: ln.split(":")[1].strip() for ln in (mem or "").splitlines()
            if ":" in ln
        }
        can = (f"allocations fail past CommitLimit {fields.get('CommitLimit', '?')} "
               f"(committed {fields.get('Committed_AS', '?')}); torch reports that as an "
               f"out-of-memory RuntimeError")
    else:
        can = ("allocations rarely fail; memory runs out at page-fault time and the OOM "
               "killer acts, so memguard's budget and pressure levels are the early warning")
    return ("overcommit", found, can)


def preload_check(lib: str) -> tuple[bool, str]:
    """Whether ``LD_PRELOAD=<lib> /bin/true`` runs cleanly.

    ld.so reports a library it cannot preload on stderr and still runs the
    program, so a clean run means exit status 0 and nothing on stderr.

    Args:
        lib: library path or name.

    Returns:
        ``(ok, why)`` with ``why`` the first stderr line or exit status on failure.
    """
    env = dict(os.environ, LD_PRELOAD=lib)
    try:
        r = subprocess.run(["/bin/true"], env=env, check=False, capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e)
    err = r.stderr.strip()
    if r.returncode == 0 and not err:
        return True, ""
    return False, err.splitlines()[0] if err else f"exit status {r.returncode}"


def dlopen_check(lib: str) -> tuple[bool, str]:
    """Whether ``lib`` can be loaded with dlopen, tried in a child interpreter.

    Args:
        lib: library path.

    Returns:
        ``(ok, why)`` with the loader's message on failure.
    """
    code = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"
    try:
        r = subprocess.run([sys.executable, "-c", code, lib], check=False,
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e)
    if r.returncode == 0:
        return True, ""
    last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
    return False, last.split(": ")[-1]


def jemalloc_row() -> Row:
    """Whether jemalloc is installed and can be preloaded.

    Args:
        None.

    Returns:
        The report row.
    """
    paths = jemalloc_candidates()  # from memguard.cli.run, which preloads the first
    if not paths:
        return ("jemalloc", f"{JEMALLOC} not found (ldconfig cache and usual lib dirs)",
                ("no jemalloc to preload for small allocations "
                 "(Debian/Ubuntu package: libjemalloc2)"))
    lib = paths[0]
    ok, why = preload_check(lib)
    dl_ok, dl_why = dlopen_check(lib)
    found = f"{lib}: " + ("preloadable" if ok else f"not preloadable ({why})")
    found += "; dlopen " + ("works" if dl_ok else f"fails ({dl_why})")
    if ok:
        can = "can be preloaded (LD_PRELOAD) to serve small allocations"
        if not dl_ok:
            can += "; this build loads only by LD_PRELOAD, not by dlopen (like Debian's)"
    else:
        can = "cannot be preloaded here"
    return ("jemalloc", found, can)


def torch_row(probe: bool = True, timeout: float = TORCH_TIMEOUT_S) -> Row:
    """torch's version, whether it imports, and its CUDA devices.

    The version comes from the package metadata without importing torch; the
    import and the CUDA query run in a subprocess bounded by ``timeout``.

    Args:
        probe: run the import probe (False: metadata only).
        timeout: seconds the probe may take.

    Returns:
        The report row.
    """
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ("torch", "not installed",
                "the sampler and the doctor work without torch; the training helpers need it")
    if not probe:
        return ("torch", f"{version} installed (import not tried)", "not probed")
    try:
        r = subprocess.run([sys.executable, "-c", _TORCH_PROBE], check=False,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return ("torch", f"{version} installed; import did not finish in {timeout:g} s",
                "probe gave up (--torch-timeout); CUDA state unknown")
    except OSError as e:
        return ("torch", f"{version} installed; probe failed ({e})", "unknown")
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("MEMGUARD_TORCH ")), None)
    if r.returncode != 0 or line is None:
        tail = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        return ("torch", f"{version} installed; import fails: {tail}",
                "torch is unusable here until it imports")
    info = json.loads(line.split(" ", 1)[1])
    found = f"{info['version']}, imports in {info['import_s']:.1f} s"
    build = info.get("cuda_build") and f"CUDA {info['cuda_build']}"
    build = build or (info.get("hip_build") and f"ROCm {info['hip_build']}") or "CPU-only build"
    found += f"; {build}"
    if "cuda_error" in info:
        found += f"; torch.cuda failed: {info['cuda_error']}"
        return ("torch", found, "host memory only")
    devices = info.get("devices") or []
    found += f"; torch.cuda.is_available() {info.get('cuda_available')}"
    if devices:
        found += "; " + ", ".join(f"{d['name']} ({size(d['total_bytes'])})" for d in devices)
        can = (f"{len(devices)} CUDA device(s): Guard pushes each step's CUDA counters "
               f"into telemetry; memguard.cuda.govern() budgets the allocator")
    else:
        can = "no CUDA device: only host memory to budget"
    return ("torch", found, can)


def _int_field(rec: dict, key: str) -> int | None:
    """An integer field of a telemetry record.

    Args:
        rec: the record.
        key: field name.

    Returns:
        The value, or None when absent, null or not an integer.
    """
    v = rec.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def telemetry_figures(path: str) -> tuple[dict | None, str | None]:
    """CUDA allocator figures, and the last forecast and headroom, from a JSONL telemetry file.

    Sample lines (with ``seq``) that carry ``cuda_allocated_bytes`` and
    ``cuda_reserved_bytes`` count; of the events, the last of each of
    :data:`DRIFT_EVENTS` is kept; other event lines, lines without those fields and
    lines that are not JSON objects are skipped. The file is streamed, each
    line read only up to :data:`~memguard.telemetry.exporters.MAX_LINE_BYTES`
    (:func:`~memguard.telemetry.exporters.bounded_lines`), so memory stays
    bounded whatever the file's size.

    Args:
        path: the telemetry file.

    Returns:
        ``(figures, None)`` with ``figures`` the worst sample's ``allocated``,
        ``reserved`` and ``seq``, the largest ``reserved_peak`` seen, the last
        ``retries`` value seen (each None when absent), ``samples`` (samples
        with CUDA figures, 0 when none) and ``unread`` (lines longer than the
        cap, skipped unread) with ``unread_why`` (the first, by number and why),
        and each of :data:`DRIFT_EVENTS` by name (its last event, or None);
        or ``(None, why)`` when the file cannot be read.
    """
    drift: dict[str, dict] = {}
    worst: dict | None = None
    peak: int | None = None
    retries: int | None = None
    n = unread = 0
    unread_why: str | None = None
    try:
        with open(path, "rb") as f:
            for number, line, why in bounded_lines(f):
                if why is not None:
                    unread += 1
                    unread_why = unread_why or f"line {number}: {why}"
                    continue
                try:
                    rec = json.loads(line.decode("utf-8", errors="replace"))
                except ValueError:
                    continue
                if isinstance(rec, dict) and rec.get("event") in DRIFT_EVENTS:
                    drift[rec["event"]] = rec
                if not isinstance(rec, dict) or "event" in rec or "seq" not in rec:
                    continue
                r = _int_field(rec, "cuda_alloc_retries")
                retries = r if r is not None else retries
                p = _int_field(rec, "cuda_reserved_peak_bytes")
                peak = p if peak is None or (p is not None and p > peak) else peak
                alloc = _int_field(rec, "cuda_allocated_bytes")
                res = _int_field(rec, "cuda_reserved_bytes")
                if alloc is None or res is None:
                    continue
                n += 1
                if worst is None or res > worst["reserved"]:
                    worst = {"allocated": alloc, "reserved": res, "seq": rec["seq"]}
    except FileNotFoundError:
        return None, "absent"
    except OSError as e:
        return None, f"unreadable ({e.strerror or os.strerror(e.errno or 0)})"
    figures = worst or {"allocated": None, "reserved": None, "seq": None}
    figures.update(reserved_peak=peak, retries=retries, samples=n, unread=unread,
                   unread_why=unread_why, **{name: drift.get(name) for name in DRIFT_EVENTS})
    return figures, None


def cuda_allocator_row(telemetry: str | None = None, env: Mapping[str, str] | None = None,
                       read: tuple[dict | None, str | None] | None = None) -> Row:
    """PyTorch's CUDA caching allocator: fragmentation in a run, and expandable_segments.

    Args:
        telemetry: a JSONL telemetry file of a run, or None.
        env: the environment to read the allocator settings from (default os.environ).
        read: what :func:`telemetry_figures` gave of ``telemetry``, or None to read it.

    Returns:
        The report row.
    """
    if telemetry is None:
        found, advice = expandable_segments_advice(None, None, env)
        return ("cuda allocator", found, advice)
    figures, why = read or telemetry_figures(telemetry)
    if figures is None:
        found, advice = expandable_segments_advice(None, None, env)
        return ("cuda allocator", f"telemetry {telemetry} {why}; {found}", advice)
    found, advice = expandable_segments_advice(figures["allocated"], figures["reserved"], env)
    if figures["samples"] == 0:
        found = f"no samples with CUDA figures in {telemetry}; {found}"
    else:
        found = (f"at the largest reserved of {figures['samples']} samples in {telemetry} "
                 f"(seq {figures['seq']}): {found}")
    if figures["reserved_peak"] is not None:
        found += f"; reserved peak {size(figures['reserved_peak'])}"
    if figures["retries"]:
        found += (f"; {figures['retries']} allocation retries (the caching allocator freed "
                  f"its cache and retried: thrashing)")
    if figures["unread"]:
        found += f"; {figures['unread']} line(s) not read ({figures['unread_why']})"
    return ("cuda allocator", found, advice)


def drift_rows(telemetry: str, figures: dict | None) -> list[Row]:
    """The run's last growth forecast and batch headroom, where it has them, with what to do.

    Args:
        telemetry: the telemetry file, named in the advice.
        figures: what :func:`telemetry_figures` found in it, or None.

    Returns:
        A row for each of the two events the file has: none, one or two.
    """
    rows: list[Row] = []
    forecast, headroom = (figures or {}).get("forecast"), (figures or {}).get("headroom")
    if forecast is not None:
        grows = drift_view.growing_text(forecast) or "nothing the census could name"
        rows.append(("growth forecast", drift_view.forecast_text(forecast),
                     f"what grows: {grows}; see memguard report {telemetry}"))
    if headroom is not None:
        largest = finite(headroom.get("largest_batch"))
        batch = "a larger batch" if largest is None else f"a batch of {int(largest):,}"
        rows.append(("batch headroom", drift_view.headroom_text(headroom),
                     f"{batch} fits by the peak model: try it, or memguard.find_batch_size"))
    return rows


def sampler_row(costs: dict, err: str | None) -> Row:
    """What one sample costs on this machine.

    Args:
        costs: from take_sample.
        err: why there is no sample.

    Returns:
        The report row.
    """
    if err:
        return ("sampler", f"failed: {err}", "no telemetry on this machine")
    interval = float(_C.option_get("interval_ms"))
    slow = float(_C.option_get("slow_interval_ms"))
    found = (f"one sample costs {costs['first']:.0f} us with every source, "
             f"{costs['cold']:.0f} us after one {interval:g} ms interval, "
             f"{costs['hot']:.1f} us back to back (median of {HOT_SAMPLES})")
    can = (f"samples every {interval:g} ms off the GIL; slow sources (status, meminfo, vmstat, "
           f"cgroup limit/stat/events) are re-read every {slow:g} ms, sooner under pressure")
    return ("sampler", found, can)


def platform_row() -> Row:
    """Kernel, CPUs and Python, with memguard's version.

    Args:
        None.

    Returns:
        The report row.
    """
    try:
        mg_version = importlib.metadata.version("memguard")
    except importlib.metadata.PackageNotFoundError:
        mg_version = "(not installed as a package)"
    found = (f"{platform.system()} {platform.release()} {platform.machine()}, "
             f"{os.cpu_count()} CPUs, Python {platform.python_version()}")
    loaded = (f"memguard {mg_version}, C core loaded (platform layer {_C.PLATFORM}, "
              f"sample format v{_C.SAMPLE_VERSION})")
    return ("platform", found, loaded)


#: what a platform layer can see, by the sample field that carries it
SEEN_BY = (("RSS", "rss_bytes"), ("peak RSS", "rss_peak_bytes"),
           ("footprint", "footprint_bytes"), ("process swap", "swap_bytes"),
           ("page faults", "minor_faults"), ("memory total", "mem_total_bytes"),
           ("available memory", "mem_available_bytes"), ("swap totals", "swap_total_bytes"),
           ("paging counters", "swap_in_pages"), ("PSI", "psi_some_total_us"),
           ("memory cgroup", "cgroup_version"), ("compressor", "compressed_bytes"),
           ("the kernel's pressure level", "os_pressure_level"))


def layer_row(sample: dict | None) -> Row:
    """What this build's platform layer sees (read off a live sample) and
    what memguard can do with it.

    Args:
        sample: a first sample (``take_sample``), or None.

    Returns:
        The report row.
    """
    sample = sample or {}
    seen = [name for name, field in SEEN_BY if sample.get(field) is not None]
    unseen = [name for name, field in SEEN_BY if sample.get(field) is None]
    found = (f"{_C.PLATFORM}: sees {', '.join(seen) or 'nothing'}"
             + (f"; cannot see {', '.join(unseen)}" if unseen else ""))
    can = []
    if _C.PLATFORM == "linux":
        can.append("memguard.install() and memguard run can route tensor memory to the arena")
    else:
        can.append("no in-process allocator on this layer (memguard.install needs the linux "
                   "layer): steps split and recover from torch's out-of-memory errors")
    if sample.get("footprint_bytes") is None:
        can.append("a budget cannot be enforced without the footprint")
    return ("layer", found, "; ".join(can))


def report(torch_probe: bool = True, torch_timeout: float = TORCH_TIMEOUT_S,
           telemetry: str | None = None) -> list[Row]:
    """Examine this machine.

    Args:
        torch_probe: import torch in a subprocess to query CUDA (False: version only).
        torch_timeout: seconds that probe may take.
        telemetry: a run's JSONL telemetry file for the CUDA allocator row
            (and its growth forecast and batch headroom, where it has them), or None.

    Returns:
        Rows of (item, what was found, what memguard can or cannot do with it).
    """
    read = telemetry_figures(telemetry) if telemetry is not None else None
    sample, costs, err = take_sample()
    linux = [psi_row(sample), cgroup_row(sample), thp_row(), overcommit_row(),
             jemalloc_row()] if _C.PLATFORM == "linux" else []   # what only Linux has
    return [
        platform_row(),
        layer_row(sample),
        memory_row(sample, err),
        swap_row(sample, err),
        *linux,
        torch_row(torch_probe, torch_timeout),
        cuda_allocator_row(telemetry, read=read),
        *(drift_rows(telemetry, read[0]) if read is not None else ()),
        sampler_row(costs, err),
    ]


def format_report(rows: list[Row], width: int = 100) -> str:
    """Two columns: the item, then what was found with memguard's part below it.

    Args:
        rows: from report().
        width: line width to wrap at.

    Returns:
        The text, ending in a newline.
    """
    left = max(len(item) for item, _, _ in rows) + 2
    lines = ["memguard doctor", ""]
    for item, found, can in rows:
        body = textwrap.wrap(found, width - left - 2) or [""]
        body += textwrap.wrap(can, width - left - 4, initial_indent="> ",
                              subsequent_indent="  ")
        lines.append("  " + item.ljust(left) + body[0])
        lines += [" " * (left + 2) + b for b in body[1:]]
    return "\n".join(lines) + "\n"


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``memguard doctor`` to the command's parser."""
    ap = sub.add_parser("doctor", help="what this machine offers and what memguard can do here",
                        description="What this machine offers memguard.")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--no-torch", action="store_true",
                    help="do not import torch (version from package metadata only)")
    ap.add_argument("--torch-timeout", type=float, default=TORCH_TIMEOUT_S, metavar="S",
                    help="seconds the torch probe may take (default %(default)g)")
    ap.add_argument("--telemetry", default=None, metavar="RUN.jsonl",
                    help="a run's JSONL telemetry: its CUDA reserved/allocated bytes tell "
                         "whether to turn on expandable_segments; its growth forecast and "
                         "batch headroom, where it has them, get a row each")
    ap.set_defaults(fn=_command)


def _command(args: argparse.Namespace) -> int:
    """Print the report (0)."""
    rows = report(torch_probe=not args.no_torch, torch_timeout=args.torch_timeout,
                  telemetry=args.telemetry)
    if args.json:
        print(json.dumps([{"item": i, "found": f, "memguard": c} for i, f, c in rows],
                         indent=1))
    else:
        sys.stdout.write(format_report(rows))
    return 0
