"""The ``memguard`` command: one parser, each subcommand registered by its
module (``doctor``, ``sample``, ``watch``, ``run``, ``demo``, ``report``)."""
from __future__ import annotations

import argparse
import functools
import sys

from memguard.cli import demo, doctor, report, run, watch

#: the modules whose register(sub) adds a subcommand, in --help's order
COMMANDS = (doctor, watch, run, demo, report)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``memguard`` command."""
    p = argparse.ArgumentParser(
        prog="memguard", description="Keep a PyTorch training run inside the memory it can have.")
    # no abbreviations: `demo --budget X` must not be read as --budget-only
    sub = p.add_subparsers(dest="command", required=True,
                           parser_class=functools.partial(argparse.ArgumentParser,
                                                          allow_abbrev=False))
    for module in COMMANDS:
        module.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``memguard`` and ``python -m memguard``; the exit status."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        return int(args.fn(args) or 0)
    except ValueError as exc:
        print(f"memguard: {exc}", file=sys.stderr)
        return 2
