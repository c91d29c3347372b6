"""The platform layer: what this build is for, which layer each platform
gets, and a clear message instead of a compiler error where there is none."""
from __future__ import annotations

import os
import runpy

import pytest

from memguard import _C
from memguard.cli import doctor
from tests.conftest import ROOT

SETUP = runpy.run_path(str(ROOT / "setup.py"), run_name="setup")
#: the layer `make test` built this run's extension with (MEMGUARD_PLATFORM
#: for the posix run of the portable tests)
EXPECTED = os.environ.get("MEMGUARD_PLATFORM") or "linux"


def test_this_build_is_the_layer_asked_for():
    assert _C.PLATFORM == EXPECTED
    assert f"platform layer {EXPECTED}" in doctor.platform_row()[2]


@pytest.mark.parametrize("system, layer", [
    ("linux", "linux"), ("darwin", "darwin"), ("freebsd14", "posix"), ("openbsd7", "posix"),
])
def test_each_platform_gets_its_layer(system, layer):
    assert SETUP["platform_layer"](system, None) == layer
    assert SETUP["platform_layer"]("linux", layer) == layer     # MEMGUARD_PLATFORM


@pytest.mark.parametrize("system", ["win32", "cygwin", "emscripten"])
def test_no_layer_is_a_clear_message_before_any_compiler(system):
    with pytest.raises(SystemExit) as info:
        SETUP["platform_layer"](system, None)
    message = str(info.value)
    assert message.startswith(f"memguard: cannot build for this platform ({system!r})")
    assert "darwin, linux, posix" in message and "WSL2" in message


def test_an_unknown_forced_layer_names_it_and_the_layers():
    with pytest.raises(SystemExit, match=r"MEMGUARD_PLATFORM='beos' is not a platform layer; "
                                         r"the C core has darwin, linux, posix"):
        SETUP["platform_layer"]("linux", "beos")


def test_each_layer_builds_the_core_and_its_own_folder():
    core = [f for f in SETUP["layer_sources"]("linux") if f.startswith("csrc/core/")]
    assert "csrc/core/sampler.c" in core and "csrc/core/planner.c" in core
    for layer, own in (("linux", {"linux"}), ("posix", {"posix"}),
                       ("darwin", {"darwin", "posix"})):
        files = SETUP["layer_sources"](layer)
        assert files[:len(core)] == core
        assert {f.split("/")[2] for f in files[len(core):]} == own
    # darwin takes posix's notifiers and stubs, never its getrusage sources
    assert "csrc/platform/posix/sources.c" not in SETUP["layer_sources"]("darwin")
