"""A short run of each libFuzzer target over the C parsers (tests/fuzz/):
10 s from the committed seeds, under AddressSanitizer, UBSan and
LeakSanitizer, must end without a crash, a leak or a sanitizer report.
``make fuzz`` runs them for 10 minutes each. Skipped without clang."""
from __future__ import annotations

import pytest

from tests.conftest import ROOT
from tests.fuzz import run as fuzz

pytestmark = pytest.mark.skipif(fuzz.clang() is None, reason="no clang: the fuzz targets need "
                                "libFuzzer (Debian: apt-get install clang)")


@pytest.mark.parametrize("target", fuzz.TARGETS)
def test_fuzz_target_finds_nothing_in_10_seconds(target):
    try:
        fuzz.build(target)
    except RuntimeError as exc:
        if "fuzzer" in str(exc) and "cannot find" in str(exc):
            pytest.skip(f"this clang has no libFuzzer runtime: {exc}")
        raise
    r = fuzz.run(target, 10)
    assert not r.crashed, r.output[-6000:]
    assert r.runs > 1000 and r.coverage > 50, r.output[-2000:]


def test_every_target_has_seeds():
    for target in fuzz.TARGETS:
        assert len(list((ROOT / "tests" / "fuzz" / "corpus" / target).iterdir())) >= 20, target
