"""The platform layer: what this build is for, and a clear message instead
of a compiler error where the C core has no layer."""
from __future__ import annotations

import runpy

import pytest

from memguard import _C
from memguard.cli import doctor
from tests.conftest import ROOT

SETUP = runpy.run_path(str(ROOT / "setup.py"), run_name="setup")


def test_this_build_is_the_linux_layer():
    assert _C.PLATFORM == "linux"
    assert "platform layer linux" in doctor.platform_row()[2]


@pytest.mark.parametrize("system, forced, named", [
    ("darwin", None, "this platform ('darwin')"),
    ("win32", None, "this platform ('win32')"),
    ("linux", "posix", "MEMGUARD_PLATFORM='posix'"),
])
def test_no_layer_is_a_clear_message_before_any_compiler(system, forced, named):
    with pytest.raises(SystemExit) as info:
        SETUP["platform_layer"](system, forced)
    message = str(info.value)
    assert message.startswith(f"memguard: cannot build for {named}")
    assert "platform layer for Linux only" in message


def test_linux_builds_the_linux_layer():
    assert SETUP["platform_layer"]("linux", None) == "linux"
    assert SETUP["platform_layer"]("linux", "linux") == "linux"
