"""The ``memguard`` command: ``doctor``, ``sample``, ``watch``, ``run``, ``demo``, ``report``."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from memguard.telemetry import Sample, Sampler, open_exporter, sample


def _mib(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:,.0f}"


def format_line(s: Sample) -> str:
    """One human line per sample: memory, headroom, PSI, faults, level."""
    head = "-" if s.headroom_fraction is None else f"{s.headroom_fraction:.0%}"
    psi = "-" if s.psi_some_stall is None else f"{s.psi_some_stall:.1%}"
    used = "" if s.budget_used_fraction is None else f" budget {s.budget_used_fraction:.0%}"
    flt = "-" if s.major_faults_per_s is None else f"{s.major_faults_per_s:,.0f}"
    return (
        f"rss {_mib(s.rss_bytes)} MiB (peak {_mib(s.rss_peak_bytes)}) "
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


def _cmd_watch(args: argparse.Namespace) -> int:
    sampler = Sampler(interval_ms=args.interval, budget=args.budget)
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


def _cmd_report(args: argparse.Namespace) -> int:
    from memguard.report import report

    out = args.output or os.path.splitext(args.telemetry)[0] + ".png"
    summary = report(args.telemetry, out)
    print(f"report of {summary.steps} steps and {summary.samples} samples written to {out}")
    return 0


# Subcommands that parse their own options; their parsers below only list them.
_PASSTHROUGH = ("doctor", "run", "demo")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``memguard`` command."""
    p = argparse.ArgumentParser(prog="memguard", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("doctor", help="what this machine offers and what memguard can do here")
    d.add_argument("doctor_args", nargs=argparse.REMAINDER, help="--json, --no-torch, --telemetry RUN.jsonl")

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

    r = sub.add_parser("run", help="run a command with memguard's allocator preloaded")
    r.add_argument("run_args", nargs=argparse.REMAINDER, help="[--budget B] -- CMD ...")

    m = sub.add_parser("demo", help="training under a memory limit, without memguard and with it")
    m.add_argument("demo_args", nargs=argparse.REMAINDER, help="options of the demo (see --help)")

    rp = sub.add_parser("report", help="draw a run's telemetry (.jsonl) as a .png or .html report")
    rp.add_argument("telemetry", help="a JSONL telemetry file (Guard(telemetry=...), demo, watch)")
    rp.add_argument("-o", "--output", default=None,
                    help="report.png or report.html (default: the telemetry file's name, .png)")
    rp.set_defaults(fn=_cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``memguard`` and ``python -m memguard``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in _PASSTHROUGH:
        import importlib

        return int(importlib.import_module(f"memguard.{argv[0]}").main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except ValueError as exc:
        print(f"memguard: {exc}", file=sys.stderr)
        return 2
