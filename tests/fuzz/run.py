"""Build and run memguard's libFuzzer targets (tests/fuzz/fuzz_*.c) over the
C parsers: /proc and cgroup files, budgets, options.

``python tests/fuzz/run.py [--seconds N] [TARGET ...]`` (``make fuzz``: 600 s
each) builds each target with clang under AddressSanitizer, UBSan and
LeakSanitizer, runs it from the committed seeds (tests/fuzz/corpus/<target>;
what it finds goes to build/fuzz/corpus/<target>) and prints, per target,
the executions per second, the coverage reached and whether it crashed. A
crash leaves its input in build/fuzz/artifacts/ and makes the exit status 1;
fix it, then add the input to the seeds.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:      # run as a script: python tests/fuzz/run.py
    sys.path.insert(0, str(ROOT))
from tests.csources import layer_sources

HERE = ROOT / "tests" / "fuzz"
BUILD = ROOT / "build" / "fuzz"
TARGETS = ("procfs", "budget", "options")
FLAGS = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-D_GNU_SOURCE", "-Iinclude",
         "-Icsrc/core", "-g", "-O1", "-fsanitize=fuzzer,address,undefined",
         "-fno-sanitize-recover=all"]


@dataclasses.dataclass
class Result:
    target: str
    returncode: int
    runs: int
    execs_per_s: int
    coverage: int          # edges covered (libFuzzer's "cov")
    features: int          # libFuzzer's "ft"
    output: str

    @property
    def crashed(self) -> bool:
        return self.returncode != 0


def clang() -> str | None:
    """The clang that builds libFuzzer targets here, or None."""
    return shutil.which("clang")


def build(target: str) -> pathlib.Path:
    """The target's binary, rebuilt when a source is newer.

    Raises:
        RuntimeError: no clang, or the build failed (its output).
    """
    cc = clang()
    if cc is None:
        raise RuntimeError("no clang on PATH (Debian: apt-get install clang)")
    exe = BUILD / f"fuzz_{target}"
    layer = "linux" if sys.platform.startswith("linux") else "posix"
    sources = [HERE / f"fuzz_{target}.c", *layer_sources(layer)]
    inputs = [*sources, *(ROOT / "csrc" / "core").glob("*.h"),
              *(ROOT / "include" / "memguard").glob("*.h")]
    if exe.exists() and all(p.stat().st_mtime <= exe.stat().st_mtime for p in inputs):
        return exe
    BUILD.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([cc, *FLAGS, *map(str, sources), "-lpthread", "-lm", "-o", str(exe)],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"building fuzz_{target} failed:\n{proc.stdout}{proc.stderr}")
    return exe


def run(target: str, seconds: int) -> Result:
    """Fuzz one target for ``seconds`` from its seeds."""
    exe = build(target)
    work = BUILD / "corpus" / target
    work.mkdir(parents=True, exist_ok=True)
    artifacts = BUILD / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    cmd = [str(exe), f"-max_total_time={seconds}", "-print_final_stats=1", "-detect_leaks=1",
           f"-artifact_prefix={artifacts}/{target}-", str(work), str(HERE / "corpus" / target)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          timeout=seconds + 120)
    out = proc.stdout + proc.stderr
    cov = re.findall(r"cov: (\d+) ft: (\d+)", out)
    stat = dict(re.findall(r"stat::(\w+):\s+(\d+)", out))
    return Result(target, proc.returncode, int(stat.get("number_of_executed_units", 0)),
                  int(stat.get("average_exec_per_sec", 0)),
                  int(cov[-1][0]) if cov else 0, int(cov[-1][1]) if cov else 0, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=600, help="per target (=600)")
    ap.add_argument("targets", nargs="*", metavar="TARGET", help=f"of {', '.join(TARGETS)}")
    a = ap.parse_args()
    unknown = set(a.targets) - set(TARGETS)
    if unknown:
        ap.error(f"no fuzz target {sorted(unknown)}: the targets are {', '.join(TARGETS)}")
    failed = 0
    print(f"{'target':<8} {'seconds':>7} {'runs':>12} {'exec/s':>9} {'cov':>6} {'ft':>6}  result")
    for target in a.targets or TARGETS:
        r = run(target, a.seconds)
        failed += r.crashed
        print(f"{target:<8} {a.seconds:>7} {r.runs:>12,} {r.execs_per_s:>9,} {r.coverage:>6} "
              f"{r.features:>6}  {'CRASH' if r.crashed else 'ok'}", flush=True)
        if r.crashed:
            print(r.output[-6000:], file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
