"""parse_budget: what users type, and clear errors for everything else."""
from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import memguard
from memguard import _C

GiB = 2**30

UNITS = {
    "": 1, "B": 1, "b": 1,
    "K": 2**10, "KiB": 2**10, "kib": 2**10, "KB": 10**3, "kb": 10**3,
    "M": 2**20, "MiB": 2**20, "MB": 10**6, "mb": 10**6,
    "G": 2**30, "GiB": 2**30, "GB": 10**9, "gib": 2**30,
    "T": 2**40, "TiB": 2**40, "TB": 10**12,
}


@pytest.mark.parametrize(
    "text,expected",
    [
        ("12GiB", 12 * GiB),
        ("512MB", 512 * 10**6),
        ("512MiB", 512 * 2**20),
        ("1.5G", int(1.5 * GiB)),
        (" 12 GiB ", 12 * GiB),
        ("4096", 4096),
        ("75%", 750),
        ("12.5%", 125),
        ("100%", 1000),
        ("auto", 900),
        ("AUTO", 900),
    ],
)
def test_accepts_what_users_write(text, expected):
    assert memguard.parse_budget(text, total=1000 if "%" in text or "auto" in text.lower()
                                 else 10**15) == expected


def test_integers_are_bytes():
    assert memguard.parse_budget(123456789) == 123456789


def test_auto_and_percent_use_this_machine():
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    auto = memguard.parse_budget("auto")
    assert 0 < auto <= 0.9 * total + 1
    half = memguard.parse_budget("50%")
    assert abs(half - total / 2) <= total * 0.001


@pytest.mark.parametrize(
    "bad",
    ["", "abc", "-5", "0", "0GiB", "12XB", "150%", "0%", "-10%", "12 GiB extra", "1.5",
     "GiB", "1e9", "%", "auto2", "0x100", "1,000", "nan", "inf%"],
)
def test_bad_text_raises_valueerror_naming_it(bad):
    with pytest.raises(ValueError) as exc:
        memguard.parse_budget(bad, total=10**12)
    assert repr(bad) in str(exc.value)


@pytest.mark.parametrize("bad", [0, -1, True, False, 1.5, None, [1], b"12GiB"])
def test_bad_types_raise_valueerror_naming_them(bad):
    with pytest.raises(ValueError) as exc:
        memguard.parse_budget(bad)
    assert repr(bad) in str(exc.value)


def test_bad_total_is_reported():
    with pytest.raises(ValueError, match="total"):
        memguard.parse_budget("50%", total=0)


def test_overflow_is_a_valueerror():
    with pytest.raises(ValueError):
        memguard.parse_budget("99999999999999999999TiB", total=10**12)


@given(n=st.integers(min_value=1, max_value=2**23), unit=st.sampled_from(sorted(UNITS)))
@example(n=2**22, unit="T")           # 4 EiB: the largest budget
@example(n=2**22 + 1, unit="T")       # one TiB more: refused
def test_sizes_roundtrip(n, unit):
    """A size is its bytes, as a size and as a budget; a budget above 4 EiB
    (2**62 bytes) is refused, never wrapped."""
    assert _C.parse_size(f"{n}{unit}") == n * UNITS[unit]
    if n * UNITS[unit] <= 2**62:
        assert memguard.parse_budget(f"{n} {unit}", total=10) == n * UNITS[unit]
    else:
        with pytest.raises(ValueError, match="larger than memguard can hold"):
            memguard.parse_budget(f"{n} {unit}", total=10)


@given(pct=st.floats(min_value=0.01, max_value=100.0), total=st.integers(10**6, 10**13))
def test_percent_is_a_share_of_total(pct, total):
    text = f"{pct:.2f}%"
    got = memguard.parse_budget(text, total=total)
    assert abs(got - total * float(text[:-1]) / 100) <= 1 + total * 1e-12


@given(st.text(max_size=24))
def test_any_text_parses_or_raises_valueerror(text):
    try:
        v = memguard.parse_budget(text, total=10**12)
    except ValueError as exc:
        assert repr(text) in str(exc)
    else:
        assert v > 0
