"""memguard's in-process allocator with real torch: routing, reuse, the
budget, threads, forked DataLoader workers, and uninstall with live tensors.
The arena is process-wide; every test leaves it installed with no budget."""
from __future__ import annotations

import gc
import math
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch")

import memguard

MiB = 2**20


@pytest.fixture(autouse=True)
def arena():
    memguard.install()
    memguard.memory.arena.set_budget(None)
    gc.collect()
    yield
    gc.collect()
    memguard.install()
    memguard.memory.arena.set_budget(None)


def alloc_now() -> int:
    return memguard.stats()["allocated_bytes.current"]


@pytest.mark.parametrize("nbytes", [1, 64, 1000, 100_000, 300_000, 4 * MiB, 33 * MiB + 5])
def test_tensors_come_from_the_arena(nbytes):
    base = dict(memguard.stats())
    t = torch.empty(nbytes, dtype=torch.uint8)
    s = memguard.stats()
    grew = s["allocated_bytes.current"] - base["allocated_bytes.current"]
    assert nbytes <= grew <= max(64, nbytes * 1.25 + 4096 + 64)
    assert s["num_allocs"] == base["num_allocs"] + 1
    assert memguard.memory.arena._C.arena_stats()["reserve_bytes"] > 0
    t.fill_(7)  # the whole block is usable
    assert int(t[-1]) == 7
    del t
    assert alloc_now() == base["allocated_bytes.current"]


def test_requested_bytes_are_exact_for_large_tensors():
    base = memguard.stats()["requested_bytes.current"]
    t = torch.empty(10 * MiB + 3, dtype=torch.uint8)
    assert memguard.stats()["requested_bytes.current"] - base == 10 * MiB + 3
    del t
    assert memguard.stats()["requested_bytes.current"] == base


def test_tensors_from_before_install_are_freed_correctly():
    memguard.uninstall()
    before = [torch.randn(1000, 1000) for _ in range(3)]  # system allocator
    memguard.install()
    base = memguard.stats()
    del before
    gc.collect()
    after = memguard.stats()
    assert after["allocated_bytes.current"] == base["allocated_bytes.current"]
    assert after["num_frees"] == base["num_frees"]  # none of those were ours


def test_training_loop_reuses_memory():
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10))
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    s0 = memguard.stats()
    for _ in range(20):
        step()
    s1 = memguard.stats()
    allocs = s1["num_allocs"] - s0["num_allocs"]
    hits = s1["num_cache_hits"] - s0["num_cache_hits"]
    assert allocs > 100 and hits == allocs  # steady state: every allocation is a hit
    assert s1["reserved_bytes.current"] == s0["reserved_bytes.current"]


def test_budget_holds_and_the_process_goes_on():
    gc.collect()
    memguard.trim()
    base = memguard.stats()["reserved_bytes.current"]
    memguard.memory.arena.set_budget(base + 64 * MiB)
    keep = torch.empty(40 * MiB, dtype=torch.uint8)
    ooms = memguard.stats()["num_ooms"]
    with pytest.raises(RuntimeError) as exc:
        torch.empty(40 * MiB, dtype=torch.uint8)
    assert memguard.is_oom(exc.value)
    assert "can't allocate memory" in str(exc.value)
    s = memguard.stats()
    assert s["num_ooms"] == ooms + 1
    assert s["reserved_bytes.current"] <= base + 64 * MiB
    small = torch.empty(8 * MiB, dtype=torch.uint8)  # a fitting one still succeeds
    small.fill_(1)
    alloc = memguard.stats()["allocated_bytes.current"]
    del keep
    after_free = memguard.stats()["allocated_bytes.current"]
    assert alloc - after_free >= 40 * MiB
    again = torch.empty(40 * MiB, dtype=torch.uint8)  # fits once the cache is released
    assert memguard.stats()["reserved_bytes.current"] <= base + 64 * MiB
    del small, again


def test_budget_failure_inside_backward_is_a_clean_oom():
    model = torch.nn.Linear(2048, 2048)
    x = torch.randn(512, 2048)
    loss = model(x).square().mean()
    gc.collect()
    memguard.trim()
    memguard.memory.arena.set_budget(memguard.stats()["reserved_bytes.current"] + 2 * MiB)
    with pytest.raises(RuntimeError) as exc:
        loss.backward()
    assert memguard.is_oom(exc.value)
    memguard.memory.arena.set_budget(None)
    loss = model(x).square().mean()
    loss.backward()  # and the next step works
    assert model.weight.grad is not None


def test_backward_on_several_threads():
    torch.set_num_threads(2)
    errors = []

    def work(seed):
        try:
            g = torch.Generator().manual_seed(seed)
            m = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(),
                                    torch.nn.Linear(256, 1))
            for _ in range(20):
                x = torch.randn(32, 128, generator=g)
                m(x).sum().backward()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    base = alloc_now()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert not errors
    assert alloc_now() == base


class _Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((1024,), float(i)), torch.tensor(i * i)


def test_dataloader_workers_under_install():
    loader = torch.utils.data.DataLoader(_Squares(), batch_size=8, num_workers=2)
    total = 0
    for x, y in loader:
        assert x.shape == (8, 1024)
        total += int(y.sum())
    assert total == sum(i * i for i in range(64))


def test_uninstall_with_live_tensors():
    live = torch.randn(512, 512)
    mine = memguard.stats()["allocated_bytes.current"]
    memguard.uninstall()
    memguard.uninstall()  # idempotent
    assert not memguard.installed()
    other = torch.randn(512, 512)  # system allocator now
    assert memguard.stats()["allocated_bytes.current"] == mine
    total = float((live @ other).sum())  # both kinds work together
    assert math.isfinite(total)
    del live
    assert memguard.stats()["allocated_bytes.current"] < mine  # our block came home
    del other
    memguard.install()
    memguard.install()  # idempotent
    assert memguard.installed()


def test_install_from_another_thread():
    memguard.uninstall()
    t = threading.Thread(target=memguard.install)
    t.start()
    t.join()
    assert memguard.installed()


def test_is_oom_recognises_the_forms():
    assert memguard.is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"))
    assert memguard.is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert memguard.is_oom(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert memguard.is_oom(torch.OutOfMemoryError("x"))
    assert memguard.is_oom(MemoryError())
    assert not memguard.is_oom(RuntimeError("shape mismatch"))
    assert not memguard.is_oom(ValueError("out of memory"))


def test_install_needs_torch_first():
    code = "import memguard\ntry:\n    memguard.install()\nexcept RuntimeError as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert "import torch before memguard.install()" in out.stdout


def test_bad_budget_is_a_valueerror():
    with pytest.raises(ValueError, match="'lots'"):
        memguard.install(budget="lots")


def test_cache_limit_releases_past_it():
    memguard.trim()
    memguard.memory.arena.set_cache_limit("16MiB")
    try:
        blocks = [torch.empty(8 * MiB + i * MiB, dtype=torch.uint8) for i in range(4)]
        trims = memguard.stats()["num_trims"]
        del blocks  # about 46 MiB freed into a 16 MiB cache
        s = memguard.stats()
        assert s["cached_bytes"] <= 16 * MiB
        assert s["num_trims"] > trims
        assert s["cache_limit_bytes"] == 16 * MiB
    finally:
        memguard.memory.arena.set_cache_limit(None)
    assert memguard.stats()["cache_limit_bytes"] == 0



def test_budget_releases_only_the_cache_that_makes_room():
    """What stays cached is what the retry after an out-of-memory error reuses
    without faulting it in again."""
    gc.collect()
    memguard.trim()
    base = memguard.stats()["reserved_bytes.current"]
    memguard.memory.arena.set_budget(base + 64 * MiB)
    def block(n: int) -> torch.Tensor:        # a request that fills an n MiB block
        return torch.empty(n * MiB - 64, dtype=torch.uint8)   # (64 bytes of header)

    keep = block(24)
    for n in (8, 12, 16):                      # cached: three blocks, 36 MiB
        block(n).fill_(1)
    s0 = memguard.stats()
    assert s0["cached_bytes"] == 36 * MiB
    # 48 MiB cannot fit beside the 24 MiB in use, cache or not: nothing released
    with pytest.raises(RuntimeError) as exc:
        block(48)
    assert memguard.is_oom(exc.value)
    s1 = memguard.stats()
    assert (s1["cached_bytes"], s1["num_trims"]) == (s0["cached_bytes"], s0["num_trims"])
    # 20 MiB fits once the largest cached block (16 MiB) goes; the others stay
    t = block(20)
    s2 = memguard.stats()
    assert s2["num_trims"] == s1["num_trims"] + 1
    assert s2["trimmed_bytes"] - s1["trimmed_bytes"] == 16 * MiB
    assert s2["cached_bytes"] == 20 * MiB
    assert s2["reserved_bytes.current"] == base + 64 * MiB
    del keep, t, exc
