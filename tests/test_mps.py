"""The MPS governor on recorded torch.mps figures.

No Mac runs these tests: the readings are the figures real MPS out-of-memory
errors printed (PyTorch's allocator prints "MPS allocated", "other
allocations" and "max allowed", i.e. current_allocated_memory(), the rest of
driver_allocated_memory(), and the high watermark, 1.7 times
recommended_max_memory()), as users posted them in public issue threads:

- m1_16gb: a 16 GB M1 MacBook Air (an audio model):
  18.02 GB allocated, 107.10 MB other, 18.13 GB allowed;
- mac_24gb: 9.57 GiB allocated, 17.35 GiB other, 27.20 GiB allowed
  (16 GiB recommended: a 24 GB Mac);
- mac_32gb: 34.09 GB allocated, 1.37 GB other, 36.27 GB allowed;
- m2: 8.89 GB allocated, 172.98 MB other, 9.07 GB allowed (an 8 GB M2).

Between two such readings a run is replayed as a sequence, with the step
before each error scaled down from the recorded one (labelled where so).
"""
from __future__ import annotations

import functools

import pytest

from memguard.memory import mps
from memguard.memory.mps import MpsGovernor, MpsReading, reading_from_oom, replay
from memguard.telemetry.samples import Level

GIB = 1 << 30
MIB = 1 << 20
TAIL = (". Tried to allocate 4.50 MB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 "
        "to disable upper limit for memory allocations (may cause system failure).")
RECORDED = {
    "m1_16gb": "MPS backend out of memory (MPS allocated: 18.02 GB, other allocations: "
               "107.10 MB, max allowed: 18.13 GB)" + TAIL,
    "mac_24gb": "MPS backend out of memory (MPS allocated: 9.57 GiB, other allocations: "
                "17.35 GiB, max allowed: 27.20 GiB)" + TAIL,
    "mac_32gb": "MPS backend out of memory (MPS allocated: 34.09 GB, other allocations: "
                "1.37 GB, max allowed: 36.27 GB)" + TAIL,
    "m2": "MPS backend out of memory (MPS allocated: 8.89 GB, other allocations: "
          "172.98 MB, max allowed: 9.07 GB)" + TAIL,
}


def test_the_recorded_errors_read_back_as_readings():
    r = reading_from_oom(RECORDED["m1_16gb"])
    assert r.allocated_bytes == int(18.02 * GIB)
    assert r.driver_bytes == int(18.02 * GIB) + int(107.10 * MIB)
    assert r.recommended_bytes == int(18.13 * GIB / 1.7)     # 10.66 GiB: two thirds of 16
    assert reading_from_oom(RECORDED["mac_24gb"]).recommended_bytes == pytest.approx(16 * GIB,
                                                                                    rel=1e-3)
    assert reading_from_oom(RECORDED["mac_32gb"]).recommended_bytes == pytest.approx(
        21.34 * GIB, rel=1e-3)
    import memguard
    assert memguard.is_oom(RuntimeError(RECORDED["m2"]))
    with pytest.raises(ValueError, match="no MPS allocator figures in 'CUDA out of memory"):
        reading_from_oom("CUDA out of memory. Tried to allocate 2.00 MiB")


def test_at_the_error_the_level_is_critical_and_before_it_ok():
    """Without a budget the governor judges what the driver holds against
    Metal's recommended size: each recorded error is far past it (CRITICAL,
    and the cache goes back first); the same machine at a third of those
    tensors, with nothing cached, is OK and nothing is touched."""
    for message in RECORDED.values():
        at = reading_from_oom(message)
        before = MpsReading(at.allocated_bytes // 3, at.allocated_bytes // 3,
                            at.recommended_bytes)          # scaled down, not recorded
        emptied: list[int] = []
        g = MpsGovernor(read=replay([before, before, at]), set_fraction=_refuse,
                        empty_cache=functools.partial(emptied.append, 1)).install()
        assert g.budget_bytes == at.recommended_bytes and g.fraction is None
        assert g.push() is Level.OK and emptied == []
        assert g.push() is Level.CRITICAL and emptied == [1]
        assert g.last == at


def test_a_budget_is_a_fraction_of_the_recommended_size():
    r = reading_from_oom(RECORDED["mac_24gb"])              # 16 GiB recommended
    fractions: list[float] = []
    g = MpsGovernor("12GiB", read=replay([r]), set_fraction=fractions.append).install()
    assert g.budget_bytes == 12 * GIB
    assert fractions == [pytest.approx(0.75, rel=1e-3)]
    assert MpsGovernor("50%", read=replay([r]), set_fraction=fractions.append).install() \
        .budget_bytes == r.recommended_bytes // 2
    auto = MpsGovernor("auto", read=replay([r]), set_fraction=fractions.append).install()
    assert auto.budget_bytes == int(0.9 * r.recommended_bytes)
    auto.uninstall()
    assert fractions[-1] == mps.DEFAULT_WATERMARK and auto.fraction is None
    with pytest.raises(ValueError, match=r"MPS budget '40GiB' is 2\.50 times Metal's "
                                         r"recommended size"):
        MpsGovernor("40GiB", read=replay([r]), set_fraction=fractions.append).install()
    with pytest.raises(ValueError, match="'lots'"):
        MpsGovernor("lots")


def test_the_cache_goes_back_when_it_carries_the_driver_over_the_budget():
    """mac_24gb: 9.57 GiB of tensors and 17.35 GiB more held by the driver.
    Under a 20 GiB budget the driver's bytes are over it: the cache is
    emptied (to 256 MiB beside the tensors: scaled, not recorded), what it
    gave back is counted, and what is left is judged OK (49 %)."""
    r = reading_from_oom(RECORDED["mac_24gb"])
    emptied = MpsReading(r.allocated_bytes, r.allocated_bytes + 256 * MIB, r.recommended_bytes)
    calls: list[int] = []
    g = MpsGovernor("20GiB", read=replay([r, r, emptied]), set_fraction=lambda f: None,
                    empty_cache=lambda: calls.append(1)).install()
    assert g.push() is Level.OK
    assert calls == [1]
    assert g.released_bytes == r.driver_bytes - emptied.driver_bytes
    assert g.last == emptied


def test_high_pressure_empties_the_cache_too():
    """m2 at its error, under a budget of its own limit: the driver at
    99.9 % of it; the cache is emptied (the replay gives the same reading
    back: nothing came free) and the level is CRITICAL."""
    r = reading_from_oom(RECORDED["m2"])
    calls: list[int] = []
    g = MpsGovernor(int(9.07 * GIB), read=replay([r]), set_fraction=lambda f: None,
                    empty_cache=lambda: calls.append(1)).install()
    assert g.push() is Level.CRITICAL and calls == [1]
    c = g.counters(r)
    assert c["allocated_bytes"] == c["reserved_bytes"] == r.driver_bytes
    assert c["active_bytes"] == r.allocated_bytes
    assert c["total_bytes"] == r.recommended_bytes and c["budget_bytes"] == int(9.07 * GIB)
    assert c["free_bytes"] == 0                             # the driver is past Metal's size


def test_without_mps_it_says_so():
    import torch

    if torch.backends.mps.is_available():
        pytest.skip("an MPS device is here")
    with pytest.raises(RuntimeError, match=r"no MPS device here \(torch.backends.mps"):
        mps.govern("50%")


def _refuse(*_: object) -> None:
    raise AssertionError("nothing is applied or emptied here")


def test_a_guard_steers_by_the_mps_governor():
    """Given as mps=, the governor's level counts at each step boundary as a
    CUDA governor's does: m1_16gb's reading at its error (CRITICAL) after a
    calm one shrinks the next step's micro-batch (the steps themselves run
    on the CPU here)."""
    import torch

    import memguard

    at = reading_from_oom(RECORDED["m1_16gb"])
    calm = MpsReading(GIB, GIB, at.recommended_bytes)       # scaled down, not recorded
    gov = MpsGovernor(read=replay([calm, calm, calm, at]), set_fraction=_refuse,
                      empty_cache=lambda: None)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes = []
    with memguard.Guard(budget=None, allocator=False, mps=gov, grow_after=100) as guard:
        assert guard.cuda_governor is gov
        for _ in range(3):
            sizes.append(guard.step(torch.randn(64, 8), lambda b: model(b).sum(), opt).micro_batch)
    assert sizes[0] == sizes[1] == 64 and sizes[2] < 64, sizes
    assert gov.level is Level.CRITICAL
    with pytest.raises(ValueError, match="mps must be None or a memguard.mps.MpsGovernor, "
                                         "not 'yes'"):
        memguard.Guard(mps="yes")
    with pytest.raises(ValueError, match="give mps= or the CUDA options"):
        memguard.Guard(mps=gov, cuda_budget="50%")
