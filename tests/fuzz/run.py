"""Build and run memguard's libFuzzer targets (tests/fuzz/fuzz_*.c) over the
C parsers: /proc and cgroup files, budgets, options.

``python tests/fuzz/run.py [--seconds N] [TARGET ...]`` (``make fuzz``: 600 s
each) builds each target with clang under AddressSanitizer, UBSan and
LeakSanitizer, runs it from the committed seeds (tests/fuzz/corpus/<target>;
what it finds goes to build/fuzz/corpus/<target>) and prints, per target,
the executions per second, the coverage reached and whether it crashed. A
crash leaves its input in build/fuzz/artifacts/ and makes the exit status 1;
fix it, then add the input to the seeds. $FUZZ_CLANG names the clang
(default: clang on PATH; empty: none).

``--replay`` runs no fuzzer: each target is built with the C compiler at hand
($CC, else cc) under AddressSanitizer and UBSan with a small driver
(replay.c) instead of libFuzzer, and every seed is passed through it once;
what the tests do where libFuzzer is missing.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import os
import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:      # run as a script: python tests/fuzz/run.py
    sys.path.insert(0, str(ROOT))
from tests.csources import CC, CC_CMD, layer_sources

HERE = ROOT / "tests" / "fuzz"
BUILD = ROOT / "build" / "fuzz"
TARGETS = ("procfs", "budget", "options")
COMMON = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-D_GNU_SOURCE", "-Iinclude",
          "-Icsrc/core", "-g", "-O1"]
FLAGS = [*COMMON, "-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=all"]
# GCC's -fsanitize=undefined leaves out float-cast-overflow (a double too large
# for uint64_t is how budget arithmetic breaks); clang's has it
REPLAY_FLAGS = [*COMMON, "-fsanitize=address,undefined,float-cast-overflow",
                "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]
REPLAY_ENV = {"ASAN_OPTIONS": "detect_leaks=1:halt_on_error=1:abort_on_error=0",
              "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}
# what a sanitizer writes when it finds something
REPORT = re.compile(r"ERROR: \w+Sanitizer|runtime error:|SUMMARY: \w+Sanitizer")


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


@dataclasses.dataclass
class Replay:
    target: str
    returncode: int
    inputs: int            # the files the driver passed through the target
    output: str

    @property
    def clean(self) -> bool:
        """Every input went through without a sanitizer report or an abort."""
        return self.returncode == 0 and not REPORT.search(self.output)


def clang() -> str | None:
    """The clang that builds libFuzzer targets here ($FUZZ_CLANG, else
    clang on PATH; FUZZ_CLANG= goes without), or None."""
    name = os.environ.get("FUZZ_CLANG", "clang")
    return shutil.which(name) if name else None


@functools.cache
def no_libfuzzer() -> str | None:
    """Why the libFuzzer targets cannot be built here, or None when they can."""
    cc = clang()
    if cc is None:
        return ("no clang (FUZZ_CLANG is empty)" if os.environ.get("FUZZ_CLANG") == ""
                else "no clang on PATH (Debian: apt-get install clang libclang-rt-dev)")
    why = _cannot_link([cc, *FLAGS], "#include <stddef.h>\n#include <stdint.h>\n"
                       "int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n)"
                       " { (void)d; (void)n; return 0; }\n")
    return why and f"{cc} cannot link libFuzzer (Debian: apt-get install libclang-rt-dev): {why}"


@functools.cache
def no_replay() -> str | None:
    """Why the seeds cannot be replayed here (no C compiler, or one without
    the sanitizers' runtimes), or None when they can."""
    if CC is None:
        return (f"no C compiler: CC={os.environ['CC']!r} not found" if os.environ.get("CC")
                else "no C compiler (cc, gcc or clang) on PATH")
    why = _cannot_link([*CC_CMD, *REPLAY_FLAGS], "int main(void) { return 0; }\n", run=True)
    return why and f"{CC} cannot build with -fsanitize=address,undefined here: {why}"


def _cannot_link(cmd: list[str], source: str, run: bool = False) -> str | None:
    """The compiler's complaint when ``cmd`` cannot link ``source`` (or the
    program, when ``run``, fails to start), else None."""
    BUILD.mkdir(parents=True, exist_ok=True)
    src, exe = BUILD / "probe.c", BUILD / "probe"
    src.write_text(source)
    proc = subprocess.run([*cmd, str(src), "-o", str(exe)], capture_output=True, text=True,
                          check=False)
    if proc.returncode == 0 and run:   # leaks: replay() finds out whether LSan works
        proc = subprocess.run([str(exe)], capture_output=True, text=True, check=False, timeout=30,
                              env=os.environ | {"ASAN_OPTIONS": "detect_leaks=0"})
    if proc.returncode == 0:
        return None
    return (proc.stdout + proc.stderr).strip()[-600:] or f"exit status {proc.returncode}"


def _make(cmd: list[str], inputs: list[pathlib.Path], out: pathlib.Path) -> None:
    """Run ``cmd``, which writes ``out``, unless ``out`` is newer than its
    inputs and was written by the same command.

    Raises:
        RuntimeError: the command failed (its output).
    """
    stamp = out.with_name(out.name + ".cmd")
    command = " ".join(cmd)
    if (out.exists() and stamp.exists() and stamp.read_text() == command
            and all(p.stat().st_mtime <= out.stat().st_mtime for p in inputs)):
        return
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"building {out.name} failed:\n{proc.stdout}{proc.stderr}")
    stamp.write_text(command)


def _compile(cmd: list[str], sources: list[pathlib.Path], exe: pathlib.Path) -> pathlib.Path:
    """``exe`` linked from ``sources`` and the core, all built by ``cmd``; the
    core's objects (in parallel, beside ``exe`` in core/) serve every target
    built with the same command, and only what is out of date is rebuilt.

    Raises:
        RuntimeError: the build failed (its output).
    """
    layer = "linux" if sys.platform.startswith("linux") else "posix"
    headers = [*(ROOT / "csrc" / "core").glob("*.h"), *(ROOT / "include" / "memguard").glob("*.h"),
               *(ROOT / "csrc" / "platform").glob("*/*.h")]
    core = exe.parent / "core"
    core.mkdir(parents=True, exist_ok=True)
    objs = {src: core / f"{src.parent.name}_{src.stem}.o" for src in layer_sources(layer)}
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for job in [pool.submit(_make, [*cmd, "-c", str(src), "-o", str(obj)], [src, *headers], obj)
                    for src, obj in objs.items()]:
            job.result()
    _make([*cmd, *map(str, sources), *map(str, objs.values()), "-lpthread", "-lm", "-o", str(exe)],
          [*sources, *headers, *objs.values()], exe)
    return exe


def build(target: str) -> pathlib.Path:
    """The target's libFuzzer binary, rebuilt when a source is newer.

    Raises:
        RuntimeError: libFuzzer cannot be built here (why), or the build
            failed (its output).
    """
    why = no_libfuzzer()
    if why:
        raise RuntimeError(why)
    return _compile([str(clang()), *FLAGS], [HERE / f"fuzz_{target}.c"], BUILD / f"fuzz_{target}")


def seeds(target: str) -> list[pathlib.Path]:
    """The committed seed corpus of ``target``."""
    return sorted((HERE / "corpus" / target).iterdir())


def replay(target: str) -> Replay:
    """Every seed of ``target`` once through its entry point, built with the C
    compiler at hand under ASan + UBSan (LeakSanitizer too where it works),
    in one process.

    Raises:
        RuntimeError: the sanitizers cannot be built here (why), or the
            build failed (its output).
    """
    why = no_replay()
    if why:
        raise RuntimeError(why)
    exe = _compile([*CC_CMD, *REPLAY_FLAGS], [HERE / f"fuzz_{target}.c", HERE / "replay.c"],
                   BUILD / "replay" / f"fuzz_{target}")
    cmd = [str(exe), *map(str, seeds(target))]
    env = os.environ | REPLAY_ENV
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=300)
    out = proc.stdout + proc.stderr
    if "LeakSanitizer has encountered a fatal error" in out:
        # LSan cannot run here (under ptrace, or /proc/self/maps hidden): ASan and UBSan still do
        env["ASAN_OPTIONS"] = env["ASAN_OPTIONS"].replace("detect_leaks=1", "detect_leaks=0")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False,
                              timeout=300)
        out = "(leak checking off: LSan cannot run here)\n" + proc.stdout + proc.stderr
    done = re.search(r"^replayed (\d+) inputs$", out, re.MULTILINE)
    return Replay(target, proc.returncode, int(done[1]) if done else 0, out)


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
    ap.add_argument("--replay", action="store_true",
                    help="no fuzzing: replay the seeds through the targets built with $CC "
                         "under ASan + UBSan")
    ap.add_argument("targets", nargs="*", metavar="TARGET", help=f"of {', '.join(TARGETS)}")
    a = ap.parse_args()
    unknown = set(a.targets) - set(TARGETS)
    if unknown:
        ap.error(f"no fuzz target {sorted(unknown)}: the targets are {', '.join(TARGETS)}")
    if a.replay:
        return replay_all(a.targets or TARGETS)
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


def replay_all(targets: list[str]) -> int:
    """``--replay``: 1 when a target's seeds do not all go through cleanly."""
    failed = 0
    print(f"{'target':<8} {'inputs':>7}  result")
    for target in targets:
        r = replay(target)
        failed += not r.clean
        print(f"{target:<8} {r.inputs:>7}  {'ok' if r.clean else 'FAILED'}", flush=True)
        if not r.clean:
            print(r.output[-6000:], file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
