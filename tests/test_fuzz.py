"""The fuzz targets over the C parsers (tests/fuzz/): where clang has
libFuzzer, a short run of each, 5 s from the committed seeds under
AddressSanitizer, UBSan and LeakSanitizer, must end without a crash, a leak
or a sanitizer report (``make fuzz`` runs them for 10 minutes each); where it
has not, every seed goes once through each target's entry point built with
the C compiler at hand under the same sanitizers, without a report. The seed
corpus is checked everywhere."""
from __future__ import annotations

import concurrent.futures

import pytest

from tests.fuzz import run as fuzz

#: each target's run: its seeds and then tens of thousands of inputs on two
#: shared cores (the slowest target, options, about 40 000 in 5 s); what a
#: 10 s run covers more is a few edges, which ``make fuzz`` is for
SECONDS = 5


@pytest.fixture(scope="module")
def fuzzed() -> dict[str, fuzz.Result]:
    """Each target fuzzed for :data:`SECONDS`, all at the same time (each in
    its own process): 5 s of the suite's time, not 15."""
    why = fuzz.no_libfuzzer()
    if why:
        pytest.skip(f"{why}; the seeds are replayed without libFuzzer instead")
    fuzz.build(fuzz.TARGETS[0])   # and the core's objects, which the others then link
    with concurrent.futures.ThreadPoolExecutor(len(fuzz.TARGETS)) as pool:
        return dict(zip(fuzz.TARGETS, pool.map(lambda t: fuzz.run(t, SECONDS), fuzz.TARGETS)))


@pytest.mark.parametrize("target", fuzz.TARGETS)
def test_fuzz_target_finds_nothing_in_5_seconds(fuzzed, target):
    r = fuzzed[target]
    assert not r.crashed, r.output[-6000:]
    assert r.runs > 1000 and r.coverage > 50, r.output[-2000:]


@pytest.mark.parametrize("target", fuzz.TARGETS)
def test_seeds_replay_without_a_report(target):
    """Without libFuzzer: each seed once through the target under ASan + UBSan
    (and LSan where it works), all of them in one process."""
    if fuzz.no_libfuzzer() is None:
        pytest.skip("libFuzzer runs every seed before it fuzzes (test_fuzz_target_*)")
    why = fuzz.no_replay()
    if why:
        pytest.skip(why)
    r = fuzz.replay(target)
    assert r.clean, r.output[-6000:]
    assert r.inputs == len(fuzz.seeds(target)), r.output[-2000:]


@pytest.mark.parametrize("target", fuzz.TARGETS)
def test_every_target_has_seeds(target):
    assert len(fuzz.seeds(target)) >= 20, f"{target} has under 20 seeds in tests/fuzz/corpus/"
