"""`memguard run`: the preload shim for a whole process and its workers,
with jemalloc where installed and with glibc alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from memguard.cli import run as mrun

pytest.importorskip("torch")

JEMALLOC = mrun.find_jemalloc()
MODES = ["glibc", pytest.param("jemalloc", marks=pytest.mark.skipif(
    JEMALLOC is None, reason="libjemalloc.so.2 not found (Debian: apt-get install libjemalloc2)"))]


def memguard_run(code: str, *opts: str, mode: str = "glibc", timeout: float = 180):
    args = [sys.executable, "-m", "memguard", "run", *opts]
    if mode == "glibc":
        args.append("--no-jemalloc")
    args += ["--", sys.executable, "-c", textwrap.dedent(code)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMGUARD_")}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env,
                          check=False)


TRAIN = """
    import json, torch, memguard
    class DS(torch.utils.data.Dataset):
        def __len__(self): return 96
        def __getitem__(self, i): return torch.randn(3, 32, 32), i % 10
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3072, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 10))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    steps = 0
    for x, y in torch.utils.data.DataLoader(DS(), batch_size=16, num_workers=2):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad(); loss.backward(); opt.step(); steps += 1
    s = memguard.stats()
    import ctypes
    je = ctypes.c_int.in_dll(ctypes.CDLL(None), "mg_preload_jemalloc").value
    print(json.dumps({"steps": steps, "preloaded": memguard.memory.arena.preloaded(),
                      "installed": memguard.installed(), "jemalloc": je,
                      "allocs": s["num_allocs"], "hits": s["num_cache_hits"],
                      "budget": s["budget_bytes"]}))
"""


@pytest.mark.parametrize("mode", MODES)
def test_training_with_workers_under_the_shim(mode):
    out = memguard_run(TRAIN, "--budget", "4GiB", mode=mode)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["steps"] == 6 and r["preloaded"] and r["installed"]
    assert r["jemalloc"] == (mode == "jemalloc")
    assert r["allocs"] > 50 and r["hits"] > r["allocs"] // 2  # the loop reuses memory
    assert r["budget"] == 4 * 2**30


@pytest.mark.parametrize("mode", MODES)
def test_budget_holds_under_the_shim(mode):
    code = """
        import json, torch, memguard
        keep = torch.empty(300 * 2**20, dtype=torch.uint8)
        try:
            torch.empty(300 * 2**20, dtype=torch.uint8)
            failed = False
        except RuntimeError as e:
            failed = memguard.is_oom(e)
        s = memguard.stats()
        small = torch.ones(2**20)  # the process goes on
        print(json.dumps({"failed": failed, "reserved": s["reserved_bytes.current"],
                          "ooms": s["num_ooms"], "small": float(small.sum())}))
    """
    out = memguard_run(code, "--budget", "512MiB", mode=mode)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["failed"] and r["ooms"] >= 1
    assert r["reserved"] <= 512 * 2**20
    assert r["small"] == 2**20


@pytest.mark.parametrize("mode", MODES)
def test_budget_holds_for_the_process_tree(mode):
    """`--budget` bounds the run's tree, not each process: a forked child
    (as a DataLoader worker is) counts what it reserves beyond what it
    inherited, so with 300 MiB held by the parent, the child's 300 MiB do
    not fit a 512 MiB budget, its 150 MiB do; once it is gone, they count
    no more."""
    code = """
        import json, os, torch, memguard
        keep = torch.ones(300 * 2**20, dtype=torch.uint8)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)      # as a DataLoader worker does: OpenMP is not fork-safe
            out = {}
            try:
                torch.empty(300 * 2**20, dtype=torch.uint8)
                out["big"] = "fit"
            except RuntimeError as e:
                out["big"] = "oom" if memguard.is_oom(e) else repr(e)
            mine = torch.ones(150 * 2**20, dtype=torch.uint8)
            out["small"] = float(mine[:10].sum())
            out["tree"] = memguard.stats()["tree_reserved_bytes"]
            os.write(w, json.dumps(out).encode())
            os._exit(0)
        os.close(w)
        child = json.loads(os.read(r, 4096))
        os.waitpid(pid, 0)
        again = torch.ones(150 * 2**20, dtype=torch.uint8)    # the child's share is free again
        s = memguard.stats()
        print(json.dumps({"child": child, "budget": s["budget_bytes"],
                          "tree": s["tree_reserved_bytes"], "again": float(again[:10].sum())}))
    """
    out = memguard_run(code, "--budget", "512MiB", mode=mode)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["child"]["big"] == "oom" and r["child"]["small"] == 10.0
    assert 450 * 2**20 <= r["child"]["tree"] <= 512 * 2**20      # both processes' counted
    assert r["budget"] == 512 * 2**20 and r["again"] == 10.0
    assert 450 * 2**20 <= r["tree"] <= 512 * 2**20


MALLOC_FAMILY = r"""
    import ctypes, json
    libc = ctypes.CDLL(None, use_errno=True)
    for name, res, args in [("malloc", ctypes.c_void_p, [ctypes.c_size_t]),
                            ("calloc", ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_size_t]),
                            ("realloc", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t]),
                            ("free", None, [ctypes.c_void_p]),
                            ("aligned_alloc", ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_size_t]),
                            ("memalign", ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_size_t]),
                            ("valloc", ctypes.c_void_p, [ctypes.c_size_t]),
                            ("pvalloc", ctypes.c_void_p, [ctypes.c_size_t]),
                            ("malloc_usable_size", ctypes.c_size_t, [ctypes.c_void_p]),
                            ("posix_memalign", ctypes.c_int,
                             [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t])]:
        f = getattr(libc, name); f.restype = res; f.argtypes = args
    import memguard._C as C
    problems = []
    def check(cond, what):
        if not cond:
            problems.append(what)
    for n in [1, 100, 4096, 60000, 70000, 1 << 20, 50 << 20]:
        # 16-byte alignment from 16 bytes up (jemalloc gives 8 below that, as C allows)
        p = libc.malloc(n); check(p and p % (16 if n >= 16 else 8) == 0, f"malloc {n}")
        check(libc.malloc_usable_size(p) >= n, f"usable {n}")
        ctypes.memset(p, 0xAB, n)
        q = libc.realloc(p, 2 * n + 1); check(q is not None, f"realloc {n}")
        check(ctypes.string_at(q, n) == b"\xab" * n, f"realloc keeps {n}")
        libc.free(q)
    # a big block comes back dirty from the cache: calloc must zero it
    p = libc.malloc(8 << 20); ctypes.memset(p, 0xFF, 8 << 20); libc.free(p)
    c = libc.calloc(1, 8 << 20); check(ctypes.string_at(c, 8 << 20).count(0) == 8 << 20, "calloc zero")
    libc.free(c)
    for align in [16, 64, 4096, 1 << 16, 1 << 21]:
        for n in [24, 100000]:
            out = ctypes.c_void_p()
            rc = libc.posix_memalign(ctypes.byref(out), align, n)
            check(rc == 0 and out.value % align == 0, f"posix_memalign {align} {n}")
            libc.free(out)
            a = libc.aligned_alloc(align, n); check(a % align == 0, f"aligned_alloc {align}")
            libc.free(a)
            m = libc.memalign(align, n); check(m % align == 0, f"memalign {align}"); libc.free(m)
    v = libc.valloc(10); check(v % 4096 == 0, "valloc"); libc.free(v)
    v = libc.pvalloc(10); check(v % 4096 == 0 and libc.malloc_usable_size(v) >= 4096, "pvalloc")
    libc.free(v)
    out = ctypes.c_void_p()
    check(libc.posix_memalign(ctypes.byref(out), 24, 8) == 22, "posix_memalign EINVAL")
    # errno: untouched by a success, ENOMEM on failure (over the budget)
    ctypes.set_errno(1234)
    p = libc.malloc(1 << 20); check(ctypes.get_errno() == 1234, "errno kept"); libc.free(p)
    C.arena_set_budget(64 << 20)
    p = libc.malloc(256 << 20)
    check(p is None and ctypes.get_errno() == 12, "ENOMEM over budget")
    C.arena_set_budget(0)
    check(libc.realloc(None, 10) is not None, "realloc(NULL)")
    print(json.dumps(problems))
"""


@pytest.mark.parametrize("mode", MODES)
def test_the_malloc_family_under_the_shim(mode):
    out = memguard_run(MALLOC_FAMILY, mode=mode)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_run_reports_bad_input():
    out = subprocess.run([sys.executable, "-m", "memguard", "run", "--budget", "lots", "--",
                          "true"], capture_output=True, text=True, check=False)
    assert out.returncode == 2 and "'lots'" in out.stderr
    out = subprocess.run([sys.executable, "-m", "memguard", "run", "--"], capture_output=True,
                         text=True, check=False)
    assert out.returncode == 2 and "no command" in out.stderr
    out = subprocess.run([sys.executable, "-m", "memguard", "run", "--",
                          "no-such-program-xyz"], capture_output=True, text=True, check=False)
    assert out.returncode == 127 and "cannot run" in out.stderr


def test_preload_env_keeps_existing_preloads():
    env = mrun.preload_env(budget="1GiB", env={"LD_PRELOAD": "/x/other.so"})
    libs = env["LD_PRELOAD"].split(":")
    assert libs[0].endswith("libmemguard_preload.so") and libs[-1] == "/x/other.so"
    assert env["MEMGUARD_BUDGET"] == "1GiB"


# The tree budget's three ways round, each with real processes under
# `memguard run --budget`: forked children that reuse what their parent had
# cached, more children than the tree once had slots for, and children
# started by exec (subprocess, multiprocessing's spawn). Plain Python
# buffers: a bytearray reaches the shim's malloc as a tensor reaches its
# posix_memalign, without torch's seconds of import in every process.
TREE_MODE = "jemalloc" if JEMALLOC else "glibc"  # as `memguard run` does by default


def test_tree_budget_charges_a_forked_childs_reuse_of_inherited_memory():
    """A DataLoader-style worker does not reuse its parent's cached block,
    nor a block it inherited live and freed, uncharged (writing either
    would make its own copy of the pages): with 448 MiB held by the parent,
    256 MiB more do not fit a 512 MiB budget in the child, 192 MiB neither,
    48 MiB do. (Sizes a page short of the arena's size classes.)"""
    code = """
        import json, os, memguard
        def mib(n):
            return n * 2**20 - 4096
        keep = bytearray(mib(192))
        spare = bytearray(mib(256))
        del spare                           # cached by the parent
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            held, out = [], {}
            def attempt(name, n):
                try:
                    held.append(bytearray(mib(n)))
                    out[name] = "fit"
                except MemoryError:
                    out[name] = "oom"
            attempt("cached", 256)          # the size of the parent's cached block
            del keep                        # inherited live, freed here
            attempt("freed", 192)
            attempt("small", 48)            # what is left of the budget
            out["tree"] = memguard.stats()["tree_reserved_bytes"]
            os.write(w, json.dumps(out).encode())
            os._exit(0)
        os.close(w)
        child = json.loads(os.read(r, 4096))
        os.waitpid(pid, 0)
        print(json.dumps(child))
    """
    out = memguard_run(code, "--budget", "512MiB", mode=TREE_MODE)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MemguardConfigWarning" not in out.stderr   # MEMGUARD_TREE is memguard run's own
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert (r["cached"], r["freed"], r["small"]) == ("oom", "oom", "fit"), r
    assert (448 + 48) * 2**20 <= r["tree"] <= 512 * 2**20, r


def test_tree_budget_holds_for_seventy_forked_children():
    """70 children holding 10 MiB each do not fit 512 MiB: every child is
    charged, the 64th and later ones too, whichever allocates first (here
    the youngest, one after another)."""
    code = """
        import json, os, memguard
        n = 70
        hold_r, hold_w = os.pipe()
        res_r, res_w = os.pipe()
        starts = []
        for _ in range(n):
            start_r, start_w = os.pipe()
            if os.fork() == 0:
                os.close(hold_w)
                os.read(start_r, 1)
                before = memguard.stats()["reserved_bytes.current"]
                try:
                    held = bytearray(10 * 2**20)
                    said = "fit"
                except MemoryError:
                    said = "oom"
                took = memguard.stats()["reserved_bytes.current"] - before
                os.write(res_w, f"{said} {took}".encode().ljust(64))
                os.read(hold_r, 1)          # hold it until every child has tried
                os._exit(0)
            os.close(start_r)
            starts.append(start_w)
        said = []
        for start in reversed(starts):
            os.write(start, b"g")
            said.append(os.read(res_r, 64).decode().split())
        s = memguard.stats()
        os.close(hold_w)
        while True:
            try:
                os.wait()
            except ChildProcessError:
                break
        fits = [int(took) for what, took in said if what == "fit"]
        print(json.dumps({"fit": len(fits), "oom": sum(what == "oom" for what, _ in said),
                          "held": s["reserved_bytes.current"] + sum(fits),
                          "tree": s["tree_reserved_bytes"]}))
    """
    out = memguard_run(code, "--budget", "512MiB", mode=TREE_MODE)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["fit"] + r["oom"] == 70, r
    assert r["held"] <= 512 * 2**20, r                              # the budget held
    assert r["fit"] >= 30 and r["held"] <= r["tree"] <= 512 * 2**20, r  # none left out


EXEC_CHILD = """
import sys
try:
    b = bytearray(300 << 20)
    print("fit", flush=True)
except MemoryError:
    print("oom", flush=True)
sys.stdin.read()
"""


def test_tree_budget_holds_for_execd_children():
    """Three Python processes started by exec (subprocess) each want 300 MiB:
    under one 512 MiB budget one of them gets it, and the two refused say so
    as they exit."""
    code = f"""
        import json, subprocess, sys
        procs = [subprocess.Popen([sys.executable, "-c", {EXEC_CHILD!r}], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(3)]
        said = [p.stdout.readline().strip() for p in procs]
        errs = [p.communicate("")[1] for p in procs]
        print(json.dumps({{"said": said, "errs": errs}}))
    """
    out = memguard_run(code, "--budget", "512MiB", mode=TREE_MODE)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(r["said"]) == ["fit", "oom", "oom"], r
    refused = [e for e, s in zip(r["errs"], r["said"]) if s == "oom"]
    assert all("memguard: the budget of 512.0 MiB" in e and "refused 1 allocation" in e
               for e in refused), r


def test_a_segment_out_of_reach_is_said_and_the_budget_still_holds():
    """A process whose MEMGUARD_TREE cannot be reached (the run's first
    process gone) says so, and keeps the budget for itself and its forks."""
    env = mrun.preload_env("512MiB", jemalloc=False,
                           env={k: v for k, v in os.environ.items()
                                if not k.startswith("MEMGUARD_")})
    env["MEMGUARD_TREE"] = f"{2**22 + 1}:3:12345"     # above any pid_max: no such process
    out = subprocess.run([sys.executable, "-c", EXEC_CHILD + "b = bytearray(300 << 20)\n"],
                         input="", env=env, capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 1 and out.stdout == "fit\n", out.stderr[-3000:]
    assert "MemoryError" in out.stderr                # the second 300 MiB: over the budget
    assert (f"cannot join the budget of the run's other processes (MEMGUARD_TREE={2**22 + 1}"
            f":3:12345: the run's first process is gone") in out.stderr
    out = subprocess.run([sys.executable, "-c", "pass"], env=dict(env, MEMGUARD_TREE="x"),
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and "(MEMGUARD_TREE=x: not PID:FD:INODE)" in out.stderr
