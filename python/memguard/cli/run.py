"""``memguard run [--budget B] -- CMD ...``: start CMD with memguard's
allocator preloaded for the whole process and every process it starts.

Tensor-sized allocations go to memguard's arena (with the budget, if one is
given); small ones to jemalloc when it is installed (preloaded after the
shim), else to glibc with heap trimming off. The budget bounds the whole
tree: the processes CMD forks (DataLoader workers) and those it starts by
exec (subprocess, multiprocessing's spawn) share it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig

from memguard import _C
from memguard.telemetry.budget import parse_budget

SHIM = "libmemguard_preload.so"
JEMALLOC = "libjemalloc.so.2"


def shim_path() -> str:
    """Path of the preload shim built with this package.

    Raises:
        FileNotFoundError: the package was installed without it.
    """
    if _C.PLATFORM != "linux":
        raise FileNotFoundError(
            f"memguard run preloads {SHIM}, which only the linux platform layer builds "
            f"(LD_PRELOAD and ELF symbol interposition); this build's layer is {_C.PLATFORM}")
    here = os.path.dirname(os.path.abspath(_C.__file__))   # the package's root
    path = os.path.join(here, SHIM)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{SHIM} is missing beside {_C.__file__}: reinstall memguard")
    return path


def jemalloc_candidates() -> list[str]:
    """Paths of libjemalloc.so.2 from the ldconfig cache and the usual lib dirs.

    Args:
        None.

    Returns:
        Existing paths, ldconfig's first, without duplicates (by real path).
    """
    found: list[str] = []
    ldconfig = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None)
    if ldconfig:
        try:
            out = subprocess.run([ldconfig, "-p"], check=False, capture_output=True, text=True,
                                 timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        for line in out.splitlines():
            name, _, path = line.strip().partition(" => ")
            if name.split(" ")[0] == JEMALLOC and path:
                found.append(path.strip())
    multiarch = sysconfig.get_config_var("MULTIARCH")
    dirs = [f"/usr/lib/{multiarch}", f"/lib/{multiarch}"] if multiarch else []
    dirs += ["/usr/local/lib", "/usr/lib64", "/lib64", "/usr/lib", "/lib"]
    found += [os.path.join(d, JEMALLOC) for d in dirs]
    seen: set[str] = set()
    result = []
    for path in found:
        real = os.path.realpath(path)
        if os.path.exists(path) and real not in seen:
            seen.add(real)
            result.append(path)
    return result


def find_jemalloc() -> str | None:
    """The libjemalloc.so.2 that ``memguard run`` preloads, or None."""
    paths = jemalloc_candidates()
    return paths[0] if paths else None


def preload_env(budget: str | int | None = None, jemalloc: bool = True,
                env: dict | None = None) -> dict:
    """The environment that runs a command under memguard's allocator.

    Args:
        budget: checked here (ValueError names a bad one), passed as
            MEMGUARD_BUDGET; None: no budget.
        jemalloc: preload jemalloc for small allocations where installed.
        env: the environment to start from (default: this process's).
    """
    out = dict(os.environ if env is None else env)
    libs = [shim_path()]
    je = find_jemalloc() if jemalloc else None
    if je:
        libs.append(je)
    if out.get("LD_PRELOAD"):
        libs.append(out["LD_PRELOAD"])
    out["LD_PRELOAD"] = ":".join(libs)
    if budget is not None:
        parse_budget(budget)  # fail here, not silently inside the shim
        out["MEMGUARD_BUDGET"] = str(budget)
    return out


def tree_segment() -> str:
    """Open the segment in which the processes of a run share its budget.

    A memfd this process holds open and passes on to the command it execs;
    the shim in every process of the run, forked or started by exec, reaches
    it through ``/proc/PID/fd/FD`` (so it need not be inherited) and joins.

    Returns:
        The value of MEMGUARD_TREE: "PID:FD:INODE".

    Raises:
        OSError: no memfd here (not Linux, or a sandbox forbids it).
    """
    fd = os.memfd_create("memguard-tree", 0)
    os.set_inheritable(fd, True)
    return f"{os.getpid()}:{fd}:{os.fstat(fd).st_ino}"


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``memguard run`` to the command's parser."""
    p = sub.add_parser("run", help="run a command with memguard's allocator preloaded",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", default=None, help='"12GiB", "75%%", "auto" or bytes')
    p.add_argument("--no-jemalloc", action="store_true",
                   help="small allocations to glibc even where jemalloc is installed")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    p.set_defaults(fn=_command, parser=p)


def _command(args: argparse.Namespace) -> int:
    """Exec the command under the shim (never returns on success)."""
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        args.parser.error("no command given: memguard run [--budget B] -- CMD ...")
    try:
        env = preload_env(args.budget, jemalloc=not args.no_jemalloc)
    except (ValueError, FileNotFoundError) as exc:
        print(f"memguard run: {exc}", file=sys.stderr)
        return 2
    if args.budget is not None:
        try:
            env["MEMGUARD_TREE"] = tree_segment()
        except OSError as exc:
            print(f"memguard run: the budget cannot be shared with processes the command "
                  f"starts by exec ({exc.strerror}): each of those gets the whole budget, "
                  f"shared with its own forks", file=sys.stderr)
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as exc:
        print(f"memguard run: cannot run {cmd[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached
