"""memguard.find_batch_size: on a step whose peak is linear in the batch
size, the size it returns is within 5 % of the true largest fitting one,
found with at most 4 steps, and keeps to the constraints."""
from __future__ import annotations

import pytest
import torch

import memguard

TOKENS, D_IN, HIDDEN = 32, 128, 512   # activations dominate: peak linear in batch size


@pytest.fixture
def arena():
    try:
        memguard.install()
    except RuntimeError as exc:
        pytest.skip(f"memguard's allocator cannot be installed here: {exc}")
    yield
    memguard.uninstall()


def make_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.GELU(),
                                torch.nn.Linear(HIDDEN, D_IN), torch.nn.GELU(),
                                torch.nn.Linear(D_IN, 1))

    def step(batch):
        model.zero_grad(set_to_none=True)
        model(batch).pow(2).mean().backward()

    return step


def peak_of(step, size: int) -> int:
    x = torch.randn(size, TOKENS, D_IN)
    memguard.memory.arena.reset_peaks()
    step(x)
    return memguard.stats()["requested_bytes.peak"]   # what the finder measures


def true_largest(step, limit: float, rule=lambda s: True, hi: int = 1 << 11) -> int:
    """Largest allowed size whose measured peak fits, by bisection over real
    steps."""
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak_of(step, mid) <= limit:
            lo = mid
        else:
            hi = mid
    while lo and not rule(lo):
        lo -= 1
    return lo


@pytest.mark.parametrize("budget_mib", [96, 200])
def test_size_within_5_percent_of_the_true_largest_with_at_most_4_probes(arena, budget_mib):
    step = make_step()
    peak_of(step, 8)                                  # one-off allocations out of the way
    budget = budget_mib << 20
    sample = torch.randn(64, TOKENS, D_IN)
    res = memguard.find_batch_size(step, sample, budget=budget, margin=0.1)
    print(f"budget {budget_mib} MiB: size {res.size}, probes {res.probes}")
    truth = true_largest(step, budget * 0.9)
    assert truth > 64, "the budget must let the finder predict past its probes"
    assert len(res.probes) <= 4
    assert abs(res.size - truth) <= 0.05 * truth
    assert res.measured_peak_bytes <= budget * 0.9
    assert res.peak_source == "arena" and res.budget_bytes == budget
    assert abs(res.predicted_peak_bytes - res.measured_peak_bytes) <= 0.05 * budget


def test_constraints_are_honoured(arena):
    step = make_step()
    sample = torch.randn(64, TOKENS, D_IN)
    res = memguard.find_batch_size(step, sample, budget="160MiB", multiple_of=8)
    assert res.size % 8 == 0 and res.size > 0
    res = memguard.find_batch_size(step, sample, budget="160MiB", divisor_of=4096)
    assert 4096 % res.size == 0 and res.size > 0
    truth = true_largest(step, (160 << 20) * 0.9, rule=lambda s: 4096 % s == 0)
    assert res.size == truth                          # a power of two: no slack to hide in
    res = memguard.find_batch_size(step, sample, budget="160MiB", max_size=100)
    assert res.size <= 100


def test_nothing_fits_gives_zero_and_bad_inputs_raise(arena):
    step = make_step()
    sample = torch.randn(64, TOKENS, D_IN)
    res = memguard.find_batch_size(step, sample, budget="1MiB")
    assert res.size == 0 and len(res.probes) <= 2
    with pytest.raises(ValueError, match="1.5"):
        memguard.find_batch_size(step, sample, margin=1.5)
    with pytest.raises(ValueError, match="'x'"):
        memguard.find_batch_size(step, sample, multiple_of="x")
    with pytest.raises(ValueError, match="12 parsecs"):
        memguard.find_batch_size(step, sample, budget="12 parsecs")
    with pytest.raises(ValueError, match="no micro-batch size satisfies"):
        memguard.find_batch_size(step, sample, multiple_of=3, divisor_of=64)


def test_an_out_of_memory_probe_counts_as_too_big(arena):
    """Under a real arena budget the large probe fails; the finder still
    returns a size that fits, without raising."""
    step = make_step()
    peak_of(step, 8)
    sample = torch.randn(256, TOKENS, D_IN)
    memguard.trim()        # blocks cached by earlier tests are no room of this one's
    reserved = memguard.stats()["reserved_bytes.current"]
    memguard.memory.arena.set_budget(reserved + (40 << 20))
    try:
        res = memguard.find_batch_size(step, sample, budget=reserved + (40 << 20), margin=0.1,
                                       first_probe=16)
    finally:
        memguard.memory.arena.set_budget(None)
    assert any(p is None for _, p in res.probes), res.probes
    assert res.size >= 16 and res.measured_peak_bytes <= (reserved + (40 << 20)) * 0.9
