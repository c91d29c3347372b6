"""Real memory limits: memguard.memory.limits' cgroup and swap file, and a short
training run (memguard.cli.workload: a real ViT with LoRA, real torch) whose cgroup limit is
lowered mid-run and raised again. Needs root, a cgroup memory controller and
a file system that takes swap files; elsewhere every test here skips and
says why. What a test makes is removed when it ends, also on failure.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from memguard.cli import workload
from memguard.memory import limits

MiB = 2**20
WHY = limits.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no real memory limits here: {WHY}")

#: a ViT on 112 px images, batch 64: memguard's whole step peaks near
#: 1.6 GB of RSS, of which about 1 GB are tensors
SMALL = workload.Model(img=112, batch=64)


@pytest.fixture(scope="module")
def swap():
    try:
        with limits.SwapFile(2 << 30) as sw:
            yield sw
    except limits.LimitUnavailable as exc:
        pytest.skip(str(exc))


def _swaps() -> str:
    with open("/proc/swaps") as f:
        return f.read()


def test_swap_file_is_on_while_open_and_gone_after() -> None:
    with limits.SwapFile(64 * MiB) as sw:
        path = sw.path
        assert path in _swaps()
    assert path not in _swaps() and not os.path.exists(path)
    with pytest.raises(ValueError, match="size_bytes must be at least 40 KiB, not 1024"):
        limits.SwapFile(1024)


def test_memory_limit_holds_a_process_and_is_removed() -> None:
    with pytest.raises(ValueError, match="limit_bytes must be a positive number of bytes, not 0"):
        limits.MemoryLimit(0)
    with limits.MemoryLimit(512 * MiB) as cg:
        path = cg.path
        code = ("import sys; sys.stdin.readline(); b = bytearray(64 << 20); print(1, flush=True);"
                " sys.stdin.read()")
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            cg.add(proc.pid)
            assert proc.pid in cg.pids()
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == "1\n"
            # what it allocates once in is charged to the cgroup
            assert 64 * MiB <= cg.usage_bytes < 512 * MiB
            cg.set(256 * MiB)
            assert cg.limit_bytes == 256 * MiB
        finally:
            proc.stdin.close()
            proc.wait()
    assert not os.path.exists(path)


def test_memory_limit_is_removed_with_a_process_still_in_it() -> None:
    cg = limits.MemoryLimit(512 * MiB)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cg.add(proc.pid)
        cg.close()                      # moves it out first
        assert not os.path.exists(cg.path)
        assert proc.poll() is None      # and it lives on
    finally:
        proc.kill()
        proc.wait()


def test_a_run_follows_its_limit_down_and_back_up(swap) -> None:
    """The limit falls from 3000 to 900 MiB after step 0, under the running
    process (step 1 was under way), and rises again after step 4. memguard
    meets the drop with one decision at the next boundary, from its model of
    the step's peak and the live budget (not one halving a step); no step is
    lost; the cache follows the room; when the limit rises, the whole batch
    comes back at once."""
    r = workload.run("memguard", 3000 * MiB, [(0, 900 * MiB), (4, 3000 * MiB)], steps=8,
                     model=SMALL, timeout_s=600)
    assert r.returncode == 0, r.stderr
    steps = r.steps
    assert [s["step"] for s in steps] == list(range(8))        # every step done
    drop = steps[1:5]
    sizes = [s["micro"] for s in drop]
    # the whole batch while the room lasts: step 1 too, unless its boundary
    # already saw the new limit (it began as the limit fell)
    assert steps[0]["micro"] == 64
    assert sizes[0] == 64 or drop[0]["budget_bytes"] <= 900 * MiB, drop[0]
    # the live budget saw the cgroup's new limit, and the plan followed it
    assert all(s["source"] == "cgroup" and s["budget_bytes"] <= 900 * MiB for s in drop[1:])
    assert sizes[1] < 32, sizes          # met at the next boundary, past a mere halving
    assert len(set(sizes[2:])) == 1, sizes                      # and settled after it
    assert min(sizes) >= 8, sizes                               # not down to the minimum
    assert all(s["arena_budget_bytes"] < 900 * MiB for s in drop[1:])
    # the limit rose after step 4: the next boundary that sees it grows back
    rise = steps[5:]
    assert rise[-1]["micro"] == 64 and any(s["micro"] == 64 for s in rise[:3]), \
        [s["micro"] for s in rise]
    worst, over = workload.boundary_bound(steps)
    assert over == 0, worst


_FINDER = """
import json, sys, torch, memguard
sys.stdin.readline()                          # moved into the cgroup by now
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 8))
def step(b):
    model.zero_grad(set_to_none=True)
    model(b).pow(2).mean().backward()
r = memguard.find_batch_size(step, torch.randn(64, 256), budget="4GiB", first_probe=10**6)
print(json.dumps({"size": r.size, "measured": r.measured_peak_bytes, "note": r.note}))
"""


@pytest.mark.parametrize("swap_on", [False, True], ids=["no-swap", "swap"])
def test_find_batch_size_in_a_cgroup_smaller_than_its_budget_is_not_killed(swap_on, request):
    """A budget of 4 GiB and a first probe of a million samples, inside a
    768 MiB cgroup: the probes are bounded by what the cgroup leaves, not
    by the host's free memory, so the process is never killed by the kernel
    (without swap) nor driven into swap; the size found fits that room."""
    if swap_on:
        request.getfixturevalue("swap")
    with limits.MemoryLimit(768 * MiB, swap=swap_on) as cg:
        proc = subprocess.Popen([sys.executable, "-c", _FINDER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        cg.add(proc.pid)
        out, err = proc.communicate("go\n", timeout=600)
    assert proc.returncode == 0, f"returncode {proc.returncode}: {err[-2000:]}"
    import json
    res = json.loads(out)
    assert res["size"] > 0 and res["measured"] < 768 * MiB
    assert "has room for less than the budget" in res["note"]
