"""Compare the side-by-side figures of two benchmark runs.

pytest-benchmark's ``--benchmark-compare`` compares timings; the figures
memguard's targets are about (ratios against plain glibc, against a plain
loop, against an unconstrained run, the sampler's CPU use) live under
``"memguard"`` in each run's JSON. This prints them for two runs, and their
change.

    python benchmarks/compare_ratios.py OLD NEW

OLD and NEW are JSON files (``out/bench.json``) or the numbers of runs saved
by ``make bench`` under ``.benchmarks/`` (``0001``; the last one if omitted:
``compare_ratios.py 0003`` compares run 3 with the newest).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The figures compared: keys whose value is a ratio or a share of a core.
KEYS = ("ratio", "ratio_to", "_over_", "_pct")


def resolve(ref: str, storage: str) -> str:
    """A JSON path for a file name or a saved run's number."""
    if os.path.isfile(ref):
        return ref
    hits = sorted(glob.glob(os.path.join(storage, "*", f"{ref}_*.json")))
    if not hits:
        raise SystemExit(f"no benchmark run {ref!r}: neither a file nor a run saved "
                         f"under {storage}")
    return hits[-1]


def newest(storage: str) -> str:
    runs = sorted(glob.glob(os.path.join(storage, "*", "[0-9][0-9][0-9][0-9]_*.json")),
                  key=os.path.basename)
    if not runs:
        raise SystemExit(f"no saved benchmark runs under {storage}: run `make bench` first")
    return runs[-1]


def flatten(d: object, prefix: str = "") -> dict[str, float]:
    """Numeric figures of a nested dict as ``a.b.c`` keys, ratios and shares only."""
    out: dict[str, float] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            if k == "targets":
                continue
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        leaf = prefix.rsplit(".", 1)[-1]
        if any(key in leaf for key in KEYS):
            out[prefix] = float(d)
    return out


def load(path: str) -> dict[str, float]:
    with open(path) as f:
        data = json.load(f)
    if "memguard" not in data:
        raise SystemExit(f"{path} has no memguard figures (not written by memguard's "
                         "benchmark suite)")
    return flatten({k: v for k, v in data["memguard"].items() if isinstance(v, dict)})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new", nargs="?", help="default: the newest saved run")
    ap.add_argument("--storage", default=os.path.join(ROOT, ".benchmarks"),
                    help="where make bench saves runs (=.benchmarks)")
    a = ap.parse_args(argv)
    old_path = resolve(a.old, a.storage)
    new_path = resolve(a.new, a.storage) if a.new else newest(a.storage)
    old, new = load(old_path), load(new_path)
    print(f"old: {old_path}\nnew: {new_path}\n")
    width = max((len(k) for k in old.keys() | new.keys()), default=10)
    print(f"{'figure':<{width}}  {'old':>9}  {'new':>9}  {'new/old':>8}")
    for k in sorted(old.keys() | new.keys()):
        o, n = old.get(k), new.get(k)
        change = f"{n / o:8.3f}" if o and n is not None else f"{'-':>8}"
        fo = f"{o:9.3f}" if o is not None else f"{'-':>9}"
        fn = f"{n:9.3f}" if n is not None else f"{'-':>9}"
        print(f"{k:<{width}}  {fo}  {fn}  {change}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
