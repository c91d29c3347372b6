"""``memguard sample`` and ``memguard watch``: telemetry in the terminal."""
from __future__ import annotations

import argparse
import json
import time

from memguard._common import MiB
from memguard._options import option
from memguard.telemetry import Sample, Sampler, open_exporter, sample


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``memguard sample`` and ``memguard watch`` to the command's parser."""
    s = sub.add_parser("sample", help="print one telemetry sample")
    s.add_argument("--json", action="store_true", help="all fields, as JSON")
    s.set_defaults(fn=_cmd_sample)

    w = sub.add_parser("watch", help="print live telemetry until interrupted")
    w.add_argument("--interval", type=float, default=100, help="sampling period in ms (=100)")
    w.add_argument("--budget", default=None, help='budget: "auto", "12GiB", "75%%", bytes')
    w.add_argument("--export", default=None, help="also write samples to a .jsonl or .csv file")
    w.add_argument("--duration", type=float, default=0, help="stop after this many seconds")
    w.add_argument("--print-every", type=float, default=1.0, help="seconds between lines (=1)")
    w.set_defaults(fn=_cmd_watch)


def _mib(v: int | None) -> str:
    """A compact MiB column: ``1,234`` (``-`` when unknown)."""
    return "-" if v is None else f"{v / MiB:,.0f}"


def _workers(s: Sample) -> str:
    """The DataLoader workers (child processes) and what they hold alone:
    `` workers 4 (600 MiB)``; empty without any."""
    if not s.children:
        return ""
    return f" workers {s.children} ({_mib(s.children_bytes)} MiB)"


def format_line(s: Sample) -> str:
    """One human line per sample: memory (the process's resident bytes, its
    DataLoader workers' apart), headroom, PSI, faults, level."""
    head = "-" if s.headroom_fraction is None else f"{s.headroom_fraction:.0%}"
    psi = "-" if s.psi_some_stall is None else f"{s.psi_some_stall:.1%}"
    used = "" if s.budget_used_fraction is None else f" budget {s.budget_used_fraction:.0%}"
    flt = "-" if s.major_faults_per_s is None else f"{s.major_faults_per_s:,.0f}"
    return (
        f"rss {_mib(s.rss_bytes)} MiB (peak {_mib(s.rss_peak_bytes)}){_workers(s)} "
        f"avail {_mib(s.mem_available_bytes)} MiB headroom {head}{used} "
        f"psi {psi} majflt/s {flt} level {s.level.name}"
        + (f" ({', '.join(s.reasons)})" if s.reasons else "")
    )


def _cmd_sample(args: argparse.Namespace) -> int:
    s = sample()
    if args.json:
        print(json.dumps(s.to_dict(), indent=2))
    else:
        print(format_line(s))
    return 0


def check_sources(s: Sample) -> None:
    """Refuse to watch nothing: a sample with neither the process's memory
    nor the machine's means no source could be read (the roots are wrong).

    Raises:
        ValueError: naming the roots read.
    """
    if s.rss_bytes is None and s.mem_total_bytes is None:
        raise ValueError(f"no memory figures could be read under proc_root "
                         f"{option('proc_root')!r} (MEMGUARD_PROC_ROOT): nothing to watch")


def _cmd_watch(args: argparse.Namespace) -> int:
    sampler = Sampler(interval_ms=args.interval, budget=args.budget)
    check_sources(sampler.sample_now())
    if args.export:
        exporter = open_exporter(args.export)
        sampler.on_sample(exporter)
    last = [0.0]

    def show(s: Sample) -> None:
        if s.t - last[0] >= args.print_every:
            last[0] = s.t
            print(format_line(s), flush=True)

    sampler.on_sample(show)
    sampler.on_pressure(lambda ev: print(f"pressure {ev.old.name} -> {ev.new.name}", flush=True))
    sampler.start()
    try:
        end = time.monotonic() + args.duration if args.duration else None
        while end is None or time.monotonic() < end:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        sampler.stop()
        if args.export:
            exporter.close()
    return 0
