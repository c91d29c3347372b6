"""memguard.find_batch_size: on a step whose peak is linear in the batch
size, the size it returns is within 5 % of the true largest fitting one,
found with at most 4 steps, and keeps to the constraints."""
from __future__ import annotations

import copy

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
    for bad in (0, -1, "65536", True, 1.5):
        with pytest.raises(ValueError, match=rf"queue_size must be .*not {bad!r}"):
            memguard.find_batch_size(step, sample, queue_size=bad)
        with pytest.raises(ValueError, match=rf"divisor_of must be .*not {bad!r}"):
            memguard.find_batch_size(step, sample, divisor_of=bad)
    with pytest.raises(ValueError, match="divisor_of=4096 and queue_size=65536 were both"):
        memguard.find_batch_size(step, sample, divisor_of=4096, queue_size=65536)


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


# -- a queue that follows the batch (MoCo) --------------------------------------
QUEUE, DIM = 65536, 16


def make_moco_step(queue_size: int = QUEUE):
    """A MoCo v2-like step: a query encoder, a momentum key encoder, and the
    InfoNCE loss of each query against its key and a queue of negatives,
    whose logits (batch x queue) dominate the peak."""
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Linear(D_IN, 64), torch.nn.ReLU(),
                                  torch.nn.Linear(64, DIM))
    keys = copy.deepcopy(encoder).requires_grad_(False)
    queue = torch.nn.functional.normalize(torch.randn(queue_size, DIM), dim=1)

    def step(batch):                     # batch: [n, 2, D_IN], two views per sample
        encoder.zero_grad(set_to_none=True)
        q = torch.nn.functional.normalize(encoder(batch[:, 0]), dim=1)
        with torch.no_grad():
            k = torch.nn.functional.normalize(keys(batch[:, 1]), dim=1)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ queue.T], dim=1) / 0.2
        labels = torch.zeros(len(q), dtype=torch.long)
        torch.nn.functional.cross_entropy(logits, labels).backward()

    return step


def test_moco_queue_follows_the_batch_that_fits(arena):
    """Seed story 002: under a budget where a batch near 96 fits, queue_size=
    proposes that batch and a queue that is a multiple of it; a step at both
    requests less than the budget (less the margin), one at twice the batch
    more than the budget. divisor_of= can only answer a power of
    two of 65536, below it. (The finder judges the bytes the step requests,
    and so does this test; the arena charges its blocks, which round
    requests up by up to 25 %: a margin of 0.2 keeps a size the finder fits
    inside an arena bounded at the budget.)"""
    budget = 128 << 20                  # about 1 MiB a sample: 96-100 fit
    sample = torch.randn(64, 2, D_IN)
    res = memguard.find_batch_size(make_moco_step(), sample, budget=budget, margin=0.2,
                                   queue_size=QUEUE)
    print(f"queue_size: size {res.size}, queue {res.queue_size}, probes {res.probes}")
    assert 80 <= res.size <= 127, res.probes
    assert res.queue_size % res.size == 0 and abs(res.queue_size - QUEUE) <= res.size / 2
    step = make_moco_step(res.queue_size)         # the run as proposed
    memguard.trim()
    held = memguard.stats()      # what tensors alive in this process hold already
    # a bound only: the bytes each step requests are the measure (blocks
    # cached by earlier tests may serve a request with a larger one)
    memguard.memory.arena.set_budget(int(held["allocated_bytes.current"]) + 3 * budget)
    try:
        peaks = []
        for n in (res.size, 2 * res.size):
            memguard.memory.arena.reset_peaks()
            step(torch.randn(n, 2, D_IN))
            peaks.append(memguard.stats()["requested_bytes.peak"] - held["requested_bytes.current"])
        assert peaks[0] <= budget * 0.8 < budget < peaks[1], peaks   # fits; twice does not
    finally:
        memguard.memory.arena.set_budget(None)
    div = memguard.find_batch_size(make_moco_step(), sample, budget=budget, margin=0.2,
                                   divisor_of=QUEUE)
    assert div.size & (div.size - 1) == 0 and div.size < res.size and div.queue_size is None


# -- CUDA, on a synthetic device ---------------------------------------------------
MIB, GIB = 1 << 20, 1 << 30


class OnCuda(torch.Tensor):
    """A CPU tensor that says it is on cuda:0: the finder measures the
    synthetic device for it."""

    @property
    def device(self):
        return torch.device("cuda", 0)

    @property
    def is_cuda(self):
        return True


class FakeDevice:
    """An 8 GiB CUDA device in numbers. The context takes 500 MiB, and 40
    MiB more at the first step (kernels loaded lazily); the model holds 300
    MiB of the allocator; a step reserves 200 MiB + 30 MiB a sample more,
    in 2 MiB segments, which stay cached until the cache is emptied. A step
    that needs more than the device has runs out of memory; one within its
    last 512 MiB goes on after the allocator freed its cache and retried."""

    TOTAL, CONTEXT, LAZY, MODEL = 8 * GIB, 500 * MIB, 40 * MIB, 300 * MIB

    def __init__(self, monkeypatch):
        self.context, self.reserved, self.peak = self.CONTEXT, self.MODEL, self.MODEL
        self.steps = self.retries = self.ooms = 0
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (self.free(), self.TOTAL))
        monkeypatch.setattr(cuda, "memory_stats", lambda device=None: self.stats())
        monkeypatch.setattr(cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self.reset)

    def need(self, n: int) -> int:
        """What the allocator reserves at a step's peak."""
        return -(-(self.MODEL + 200 * MIB + 30 * MIB * n) // (2 * MIB)) * 2 * MIB

    def nvidia_smi(self, n: int) -> int:
        """The process at a step's peak, as nvidia-smi shows it."""
        return self.CONTEXT + self.LAZY + self.need(n)

    def largest(self, limit: float) -> int:
        return max(n for n in range(1, 4096) if self.nvidia_smi(n) <= limit)

    def free(self) -> int:
        return self.TOTAL - self.context - self.reserved

    def stats(self) -> dict:
        return {"reserved_bytes.all.current": self.reserved, "reserved_bytes.all.peak": self.peak,
                "allocated_bytes.all.current": self.MODEL, "num_alloc_retries": self.retries,
                "num_ooms": self.ooms}

    def empty_cache(self):
        self.reserved = self.MODEL

    def reset(self, device=None):
        raise AssertionError("the finder reset the device's peak counters")

    def step(self, batch):
        self.context = self.CONTEXT + self.LAZY
        self.steps += 1
        need, room = self.need(len(batch)), self.TOTAL - self.context
        if need > room:
            self.retries, self.ooms = self.retries + 1, self.ooms + 1
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate "
                                              f"{need - room} bytes")
        if need > room - 512 * MIB:
            self.retries += 1
        self.reserved = max(self.reserved, need)
        self.peak = max(self.peak, self.reserved)


def cuda_sample(n: int) -> torch.Tensor:
    return torch.zeros(n, 4).as_subclass(OnCuda)


@pytest.mark.parametrize("budget, budget_bytes", [
    ("auto", 8 * GIB - (256 << 20)),     # the device's free and reserved bytes and its context
    ("75%", 6 * GIB),                    # of the device's total
    ("2GiB", 2 * GIB),                   # as nvidia-smi shows the process
    ("9GiB", 9 * GIB),                   # held to the device's room
])
def test_cuda_budgets_and_peaks_are_the_process_as_nvidia_smi_shows_it(monkeypatch, budget,
                                                                      budget_bytes):
    """Budgets come from the device, peaks are its reserved bytes and context
    (the context's growth at the first step included), exact for a probe
    smaller than an earlier one, and the device's peak counters are never
    reset."""
    dev = FakeDevice(monkeypatch)
    res = memguard.find_batch_size(dev.step, cuda_sample(64), budget=budget)
    print(f"{budget}: size {res.size}, probes {res.probes}, note {res.note!r}")
    assert res.budget_bytes == budget_bytes and res.peak_source == "cuda_reserved"
    assert res.probes and all(p == dev.nvidia_smi(n) for n, p in res.probes)
    limit = min(budget_bytes, 8 * GIB - (256 << 20)) * 0.9
    assert ("CUDA device 0 has room for less than the budget" in res.note) == (budget == "9GiB")
    truth = dev.largest(limit)
    assert truth * 0.97 <= res.size <= truth and res.measured_peak_bytes <= limit
    assert len(res.probes) <= 4 and dev.retries == 0


def test_cuda_out_of_memory_and_retries_count_as_too_big(monkeypatch):
    """A probe the device cannot hold raises CUDA's out-of-memory error, and
    one that made the allocator free its cache to go on was at the device's
    edge: both are too big, and the size found fits."""
    dev = FakeDevice(monkeypatch)
    res = memguard.find_batch_size(dev.step, cuda_sample(1024), budget="auto", queue_size=1)
    assert res.queue_size == res.size                # a queue never shorter than the batch
    assert dev.ooms >= 1 and (256, None) in res.probes
    assert 0 < res.size <= dev.largest(res.budget_bytes * 0.9)
    assert res.measured_peak_bytes == dev.nvidia_smi(res.size) <= res.budget_bytes * 0.9
    dev = FakeDevice(monkeypatch)
    res = memguard.find_batch_size(dev.step, cuda_sample(1024), budget="auto", first_probe=230)
    assert dev.retries >= 1 and dev.ooms == 0 and res.probes[0] == (230, None)
    assert 0 < res.size <= dev.largest(res.budget_bytes * 0.9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_on_a_real_device(monkeypatch):
    """On a real GPU: peaks are the device's reserved bytes plus what is
    outside the allocator, a step at the size found fits its budget, the
    peak counters are not reset, and "auto" is the device less the reserve."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.GELU(),
                                torch.nn.Linear(HIDDEN, D_IN)).cuda()

    def step(batch):
        model.zero_grad(set_to_none=True)
        model(batch).pow(2).mean().backward()

    step(torch.randn(8, TOKENS, D_IN, device="cuda"))   # the context and cuBLAS up
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    budget = int(outside / 0.9) + (512 << 20)     # 460 MiB for the allocator, margin kept
    sample = torch.randn(64, TOKENS, D_IN, device="cuda")
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "reset_peak_memory_stats", None)   # never called
        res = memguard.find_batch_size(step, sample, budget=budget)
        auto = memguard.find_batch_size(step, sample, max_size=256)
    print(f"outside the allocator {outside >> 20} MiB: size {res.size}, probes {res.probes}")
    assert res.peak_source == "cuda_reserved" and res.size > 64
    assert outside < res.measured_peak_bytes <= budget * 0.9
    assert auto.budget_bytes == total - (256 << 20) and auto.size == 256
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()                # the test's own reading
    step(torch.randn(res.size, TOKENS, D_IN, device="cuda"))
    free, total = torch.cuda.mem_get_info()
    used = total - free - torch.cuda.memory_reserved() + torch.cuda.max_memory_reserved()
    assert used <= budget * 0.9 * 1.02
