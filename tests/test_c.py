"""The C unit tests: each tests/c/test_*.c is built with the C core and run,
plain (-O2), under AddressSanitizer + UndefinedBehaviorSanitizer, and under
ThreadSanitizer, from build/ctest/<flavour>/, and the plain build once more
under valgrind memcheck. A binary passes when it exits 0; its output is shown
when it does not.
"""
from __future__ import annotations

import concurrent.futures
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from tests.csources import BUILDABLE, CC, CC_CMD, layer_of, layer_sources

ROOT = pathlib.Path(__file__).resolve().parent.parent
CTESTS = sorted((ROOT / "tests" / "c").glob("test_*.c"))
FIXTURES = ROOT / "tests" / "fixtures" / "proc"
BUILD = ROOT / "build" / "ctest"

COMMON = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-D_GNU_SOURCE",
          "-Iinclude", "-Icsrc/core", "-Icsrc/platform/darwin"]
FLAVOURS = {
    "plain": ["-O2"],
    # float-cast-overflow is not part of GCC's -fsanitize=undefined, and a
    # double too large for uint64_t is the classic way budget arithmetic breaks.
    "asan": ["-O1", "-g", "-fsanitize=address,undefined,float-cast-overflow",
             "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"],
    # data races between the sampler thread and its readers, stop and fork handlers
    "tsan": ["-O1", "-g", "-fsanitize=thread"],
}
LIBS = ["-lpthread", "-lm"]

pytestmark = pytest.mark.skipif(
    CC is None, reason=f"no C compiler: CC={os.environ.get('CC')!r} not found"
    if os.environ.get("CC") else "no C compiler (cc, gcc or clang) on PATH")


def _stale(target: pathlib.Path, inputs: list[pathlib.Path]) -> bool:
    if not target.exists():
        return True
    t = target.stat().st_mtime
    return any(p.stat().st_mtime > t for p in inputs)


def _compile(cmd: list[str], target: pathlib.Path) -> None:
    """Run one compiler command writing a temporary file, then move it into
    place, so a concurrent run never sees a half-written object."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    proc = subprocess.run([*cmd, "-o", str(tmp)], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    os.replace(tmp, target)


def _parallel(jobs: list[tuple]) -> None:
    if not jobs:
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for f in [pool.submit(_compile, cmd, target) for cmd, target in jobs]:
            f.result()


def _build(flavour: str) -> dict[str, pathlib.Path]:
    """Compile the core once per flavour, then each test against its objects;
    only what is older than its sources is rebuilt."""
    out = BUILD / flavour
    out.mkdir(parents=True, exist_ok=True)
    flags = [*CC_CMD, *COMMON, *FLAVOURS[flavour]]
    headers = [*(ROOT / "include" / "memguard").glob("*.h"), *(ROOT / "csrc" / "core").glob("*.h"),
               *(ROOT / "csrc" / "platform").glob("*/*.h")]
    # another compiler or other flags: nothing built before counts
    stamp = out / "command"
    if not stamp.exists() or stamp.read_text() != " ".join(flags):
        for old in out.iterdir():
            old.unlink()
        stamp.write_text(" ".join(flags))
    headers.append(stamp)
    objs: dict[pathlib.Path, pathlib.Path] = {}
    jobs = []
    for src in {s for layer in BUILDABLE for s in layer_sources(layer)}:
        obj = out / f"{src.parent.name}_{src.stem}.o"
        objs[src] = obj
        if _stale(obj, [src, *headers]):
            jobs.append(([*flags, "-c", str(src)], obj))
    _parallel(jobs)
    harness = ROOT / "tests" / "c" / "mgtest.h"
    bins, jobs = {}, []
    for src in (t for t in CTESTS if layer_of(t.stem) in BUILDABLE):
        exe = out / src.stem
        bins[src.stem] = exe
        linked = [objs[s] for s in layer_sources(layer_of(src.stem))]
        if _stale(exe, [src, harness, *headers, *linked]):
            jobs.append(([*flags, str(src), *map(str, linked), *LIBS], exe))
    _parallel(jobs)
    return bins


_PROBE = "#include <stdlib.h>\nvoid *volatile p;\nint main(void) { p = malloc(33); p = 0; return 0; }\n"


def _sanitizer_probe() -> bool | None:
    """None when this compiler cannot build with the sanitizers (no libasan),
    else whether LeakSanitizer works here. It does not under ptrace (a
    debugger, some sandboxes) or where /proc/self/maps is hidden; there the
    suite still runs ASan and UBSan, without leak checking. In the
    development containers of this project it works."""
    BUILD.mkdir(parents=True, exist_ok=True)
    src, probe = BUILD / "lsan_probe.c", BUILD / "lsan_probe"
    src.write_text(_PROBE)
    try:
        _compile([*CC_CMD, *FLAVOURS["asan"], str(src)], probe)
    except RuntimeError:
        return None
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1")
    proc = subprocess.run([str(probe)], capture_output=True, text=True, env=env, timeout=30,
                          check=False)
    return "detected memory leaks" in proc.stderr


def _can_build(flags: list[str]) -> bool:
    """Whether this compiler links a trivial program with these flags."""
    BUILD.mkdir(parents=True, exist_ok=True)
    src, exe = BUILD / "flags_probe.c", BUILD / "flags_probe"
    src.write_text("int main(void) { return 0; }\n")
    try:
        _compile([*CC_CMD, *flags, str(src)], exe)
    except RuntimeError:
        return False
    return subprocess.run([str(exe)], check=False, capture_output=True).returncode == 0


_built: dict[str, dict[str, pathlib.Path]] = {}
_env: dict[str, dict[str, str]] = {}
_skip: dict[str, str] = {}


@pytest.fixture(params=sorted(FLAVOURS))
def flavour(request) -> str:
    name = request.param
    if name in _skip:
        pytest.skip(_skip[name])
    if name not in _env:
        # MEMGUARD_* variables would change the option defaults the tests spell out
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEMGUARD_")}
        env["MGTEST_FIXTURES"] = str(FIXTURES)
        if name == "asan":
            leaks = _sanitizer_probe()
            if leaks is None:
                _skip[name] = f"{CC} cannot build with -fsanitize=address,undefined here"
                pytest.skip(_skip[name])
            env["ASAN_OPTIONS"] = f"detect_leaks={int(leaks)}:halt_on_error=1:abort_on_error=0"
            env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
        if name == "tsan":
            if not _can_build(FLAVOURS["tsan"]):
                _skip[name] = f"{CC} cannot build with -fsanitize=thread here"
                pytest.skip(_skip[name])
            env["TSAN_OPTIONS"] = "halt_on_error=1:exitcode=66:die_after_fork=0"
            env["MGTEST_SKIP_FORK"] = "1"
        _env[name] = env
    if name not in _built:
        _built[name] = _build(name)
    return name


@pytest.mark.parametrize("test", [p.stem for p in CTESTS])
def test_c(flavour: str, test: str) -> None:
    if layer_of(test) not in BUILDABLE:
        pytest.skip(f"the {layer_of(test)} layer does not build on {sys.platform}")
    exe = _built[flavour][test]
    proc = subprocess.run([str(exe), str(FIXTURES)], cwd=ROOT, env=_env[flavour],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, (
        f"{test} [{flavour}] exited with {proc.returncode}\n{proc.stdout}\n{proc.stderr}")


VALGRIND = shutil.which("valgrind")


@pytest.mark.skipif(VALGRIND is None, reason="valgrind is not installed")
@pytest.mark.parametrize("test", [p.stem for p in CTESTS])
def test_c_valgrind(test: str) -> None:
    """The plain binaries again under memcheck: invalid reads and writes,
    uninitialised values, and definite leaks fail the test."""
    if layer_of(test) not in BUILDABLE:
        pytest.skip(f"the {layer_of(test)} layer does not build on {sys.platform}")
    if "plain" not in _built:
        _env.setdefault("plain", {k: v for k, v in os.environ.items()
                                  if not k.startswith("MEMGUARD_")} | {
                                      "MGTEST_FIXTURES": str(FIXTURES)})
        _built["plain"] = _build("plain")
    exe = _built["plain"][test]
    proc = subprocess.run(
        # fair scheduling: valgrind runs one thread at a time, and without it
        # a sleeping main thread waits seconds behind busy workers
        [VALGRIND, "-q", "--fair-sched=yes", "--error-exitcode=99", "--leak-check=full",
         "--errors-for-leak-kinds=definite", str(exe), str(FIXTURES)],
        cwd=ROOT, env=_env["plain"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, (
        f"{test} [valgrind] exited with {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
