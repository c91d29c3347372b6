"""memguard's CUDA allocator without a GPU: the functions PyTorch's
CUDAPluggableAllocator would call (mg_cuda_alloc, mg_cuda_free, loaded from
memguard._C exactly as PyTorch loads them, through ctypes) over the host
backend; the C++ exception that reports an out-of-memory error to PyTorch,
thrown through the C frames; and install's errors. On a GPU, a real training
step under the allocator."""
from __future__ import annotations

import ctypes
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import memguard
from memguard import _C

ROOT = pathlib.Path(__file__).resolve().parent.parent
MIB = 1 << 20


@pytest.fixture
def lib():
    """The allocator over host memory with a 1 GiB "device"; afterwards
    every block must have been freed, the cache goes back, and the
    allocator has no backend again (so CUDA code later in this process
    reads PyTorch's own counters)."""
    _C.cuda_init("host", capacity=1 << 30)
    so = ctypes.CDLL(_C.__file__)
    # the ABI: void *alloc(size_t, int, cudaStream_t); void free(void *, size_t, int, cudaStream_t)
    so.mg_cuda_alloc.restype = ctypes.c_void_p
    so.mg_cuda_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    so.mg_cuda_free.restype = None
    so.mg_cuda_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    yield so
    for d in range(4):
        assert _C.cuda_stats(d)["allocated_bytes.current"] == 0
        _C.cuda_set_budget(d, 0)
    _C.cuda_trim(-1)
    assert _C.cuda_host_used() == 0
    _C.cuda_detach()
    assert _C.cuda_backend() is None and memguard.cuda.allocator_name() == "native"


def test_native_stats_speak_the_allocators_names(lib):
    """memguard.cuda.stats() means the same counters under either allocator:
    every name PyTorch's counters are flattened to is one memguard's own
    allocator reports."""
    native = memguard.cuda.flat_native_stats({"num_device_alloc": 3, "num_device_free": 1})
    assert native["num_device_allocs"] == 3 and native["num_device_frees"] == 1
    assert set(native) <= set(memguard.cuda.stats())


def test_blocks_are_counted_by_size(lib):
    before = memguard.cuda.stats()
    sizes = (100, 5000, 3 * MIB + 1, 50 * MIB)
    ptrs = [lib.mg_cuda_alloc(n, 0, None) for n in sizes]
    assert all(p and p % 512 == 0 for p in ptrs)
    assert len(set(ptrs)) == len(ptrs)
    s = memguard.cuda.stats()
    assert s["requested_bytes.current"] - before["requested_bytes.current"] == sum(sizes)
    grew = s["allocated_bytes.current"] - before["allocated_bytes.current"]
    assert sum(sizes) <= grew <= sum(sizes) * 9 // 8 + 2 * MIB
    assert s["num_allocs"] - before["num_allocs"] == 4
    # the host backend holds what the allocator reserved, no more
    assert _C.cuda_host_used() == s["reserved_bytes.current"]
    ctypes.memset(ptrs[3], 0x5A, 50 * MIB)   # host memory stands in: writable
    for p, n in zip(ptrs, sizes):
        lib.mg_cuda_free(p, n, 0, None)
    assert memguard.cuda.stats()["allocated_bytes.current"] == \
        before["allocated_bytes.current"]


def test_a_training_loop_is_served_from_the_cache(lib):
    shapes = [64 * 197 * 384 * 4, 384 * 384 * 4, 1536 * 384 * 4, 4096, 64 * 1000 * 4]
    reserved = []
    before = memguard.cuda.stats()
    for _ in range(6):
        ptrs = [lib.mg_cuda_alloc(n, 0, None) for n in shapes]
        for p, n in zip(reversed(ptrs), reversed(shapes)):
            lib.mg_cuda_free(p, n, 0, None)
        reserved.append(memguard.cuda.stats()["reserved_bytes.current"])
    s = memguard.cuda.stats()
    assert reserved[1:] == reserved[:1] * 5          # it plateaus after the first step
    assert s["num_cache_hits"] - before["num_cache_hits"] >= 5 * len(shapes)
    assert s["num_device_allocs"] - before["num_device_allocs"] <= len(shapes)


def test_streams_do_not_share_cached_blocks(lib):
    s1, s2 = 0x7F00, 0x7F80                         # two cudaStream_t values
    a = lib.mg_cuda_alloc(24 * MIB, 1, s1)
    lib.mg_cuda_free(a, 24 * MIB, 1, s1)
    b = lib.mg_cuda_alloc(24 * MIB, 1, s2)
    assert b != a                                   # s1's block may still be in use by s1's work
    c = lib.mg_cuda_alloc(24 * MIB, 1, s1)
    assert c == a                                   # s1 reuses its own
    assert _C.cuda_stats(1)["streams"] == 2
    lib.mg_cuda_free(b, 24 * MIB, 1, s2)
    lib.mg_cuda_free(c, 24 * MIB, 1, s1)


def test_budget_releases_cache_then_fails_cleanly(lib):
    _C.cuda_set_budget(2, 64 * MIB)
    a = lib.mg_cuda_alloc(40 * MIB, 2, None)
    lib.mg_cuda_free(a, 40 * MIB, 2, None)          # cached
    b = lib.mg_cuda_alloc(48 * MIB, 2, None)        # needs the cached block released
    assert b
    s = _C.cuda_stats(2)
    assert s["num_alloc_retries"] == 1 and s["reserved_bytes.peak"] <= 64 * MIB
    ctypes.set_errno(0)
    assert lib.mg_cuda_alloc(20 * MIB, 2, None) is None   # over the budget: refused
    after = _C.cuda_stats(2)
    assert after["num_ooms"] == s["num_ooms"] + 1
    assert after["last_oom_bytes"] == 20 * MIB
    assert after["allocated_bytes.current"] == s["allocated_bytes.current"]
    assert after["reserved_bytes.current"] == s["reserved_bytes.current"] <= 64 * MIB
    c = lib.mg_cuda_alloc(1 * MIB, 2, None)         # one that fits still does
    assert c
    lib.mg_cuda_free(c, 1 * MIB, 2, None)
    lib.mg_cuda_free(b, 48 * MIB, 2, None)


def test_optimizer_room_is_read_from_memguards_counters(lib):
    """The room an optimizer step is judged against comes from
    memguard.cuda.stats() (torch's own counters raise under memguard's
    allocator): the driver's free memory plus the cache, within the budget."""
    from memguard.train.transaction import device_room

    _C.cuda_set_budget(3, 64 * MIB)
    a = lib.mg_cuda_alloc(8 * MIB, 3, None)
    b = lib.mg_cuda_alloc(16 * MIB, 3, None)
    lib.mg_cuda_free(a, 8 * MIB, 3, None)           # cached
    st = memguard.cuda.stats(3)
    assert st["cached_bytes"] > 0
    in_budget = 64 * MIB - st["reserved_bytes.current"] + st["cached_bytes"]
    assert device_room(1 << 40, st) == in_budget    # the budget binds
    assert device_room(MIB, st) == MIB + st["cached_bytes"]   # the device binds
    _C.cuda_set_budget(3, 0)
    assert device_room(1 << 40, memguard.cuda.stats(3)) == (1 << 40) + st["cached_bytes"]
    _C.cuda_set_budget(3, MIB)                      # lowered below what is held
    assert device_room(1 << 40, memguard.cuda.stats(3)) == 0
    lib.mg_cuda_free(b, 16 * MIB, 3, None)


def test_stats_validate_the_device(lib):
    with pytest.raises(ValueError, match="'tpu'"):
        memguard.cuda.stats("tpu")
    with pytest.raises(ValueError, match="out of range"):
        _C.cuda_stats(64)
    assert memguard.cuda.stats("cuda:3")["allocated_bytes.current"] == 0


THROW_TEST = r"""
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include "memguard/memguard-cuda.h"
extern "C" {
#include "shim.h"
}

int main() {
    if (mg_dev_init(mgi_host_backend(64u << 20)) != 0) return 10;
    if (mgi_cuda_set_oom_mode(MGI_OOM_THROW) != 0) return 11;
    void *a = mg_cuda_alloc(40u << 20, 0, nullptr);
    if (!a) return 12;
    try {
        mg_cuda_alloc(40u << 20, 0, nullptr);   // the host "device" is full
        return 13;
    } catch (const std::runtime_error &e) {
        std::printf("caught: %s\n", e.what());
        if (!std::strstr(e.what(), "CUDA out of memory")) return 14;
    }
    mg_dev_stats_t st;
    mg_dev_stats(0, &st);
    if (st.num_ooms != 1 || st.allocated_current != (40u << 20)) return 15;
    void *b = mg_cuda_alloc(1u << 20, 0, nullptr);   // nothing left locked
    if (!b) return 16;
    mg_cuda_free(b, 1u << 20, 0, nullptr);
    mg_cuda_free(a, 40u << 20, 0, nullptr);
    std::printf("ok\n");
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("gcc") is None,
                    reason="needs gcc and g++")
def test_out_of_memory_is_a_cpp_exception_through_the_c_frames(tmp_path):
    """What PyTorch sees: mg_cuda_alloc throws a std::runtime_error whose
    text is_oom() recognises, through C code built as the extension is
    (-fexceptions); nothing stays locked and the counters are exact."""
    objs = []
    for src in ("csrc/core/devcache.c", "csrc/shim/cuda.c"):
        obj = tmp_path / (pathlib.Path(src).stem + ".o")
        subprocess.run(["gcc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-D_GNU_SOURCE",
                        "-DMG_BUILDING", "-fexceptions", "-O2", "-fPIC", "-Iinclude",
                        "-Icsrc/core", "-Icsrc/shim", "-c", src, "-o", str(obj)],
                       cwd=ROOT, check=True)
        objs.append(str(obj))
    main = tmp_path / "main.cpp"
    main.write_text(THROW_TEST)
    exe = tmp_path / "throw_test"
    subprocess.run(["g++", "-O1", "-Iinclude", "-Icsrc/core", "-Icsrc/shim", str(main), *objs,
                    "-ldl", "-lpthread", "-o", str(exe)], cwd=ROOT, check=True)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    line = r.stdout.splitlines()[0]
    assert "CUDA out of memory" in line and "budget" in line
    assert memguard.is_oom(RuntimeError(line.removeprefix("caught: ")))


def test_install_errors_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(RuntimeError, match="torch.cuda.is_available"):
        memguard.cuda.install_allocator()
    with pytest.raises(RuntimeError, match="no CUDA device"):
        memguard.cuda.govern("75%")
    with pytest.raises(ValueError, match="'cuda:x'"):
        memguard.cuda.govern(device="cuda:x")
    with pytest.raises(ValueError, match="'lots'"):
        memguard.cuda.govern("lots")
    with pytest.raises(ValueError, match="'lots'"):
        memguard.cuda.install_allocator("lots")
    with pytest.raises(TypeError, match="device"):
        memguard.install(device="cuda")      # memguard.install is the CPU arena


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_training_step_under_memguards_allocator():
    """A fresh process: install before the first CUDA allocation, train,
    recover a real out-of-memory error at a budget, and refuse a late
    install in another."""
    code = textwrap.dedent("""
        import torch, memguard
        memguard.cuda.install_allocator(budget="2GiB")
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                    torch.nn.Linear(4096, 10)).cuda()
        opt = torch.optim.AdamW(model.parameters())
        guard = memguard.Guard(budget=None, allocator=False)
        x = torch.randn(512, 1024, device="cuda"); y = torch.randint(0, 10, (512,), device="cuda")
        with guard:
            for _ in range(3):
                guard.step((x, y), lambda b: torch.nn.functional.cross_entropy(model(b[0]), b[1]), opt)
        s = memguard.cuda.stats()
        assert s["num_allocs"] > 0 and s["reserved_bytes.peak"] <= 2 << 30, s
        try:
            torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
            raise SystemExit("no error above the budget")
        except RuntimeError as e:
            assert memguard.is_oom(e), e
        torch.ones(10, device="cuda").sum().item()    # the context is intact
        print("OK", s["reserved_bytes.peak"])
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300, check=False)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    late = textwrap.dedent("""
        import torch, memguard
        torch.ones(1, device="cuda")
        try:
            memguard.cuda.install_allocator()
        except RuntimeError as e:
            print("REFUSED", e)
    """)
    r = subprocess.run([sys.executable, "-c", late], capture_output=True, text=True, env=env,
                       timeout=300, check=False)
    assert "REFUSED" in r.stdout and "before the first CUDA allocation" in r.stdout, \
        r.stdout + r.stderr
