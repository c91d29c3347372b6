"""The platform layer: what this build is for, which layer each platform
gets, and a clear message instead of a compiler error where there is none."""
from __future__ import annotations

import os
import sys

import pytest

from memguard import _C
from memguard.cli import doctor
from tests.csources import SETUP

#: the layer `make test` built this run's extension with: this system's, or
#: MEMGUARD_PLATFORM's (the posix run of the portable tests)
EXPECTED = os.environ.get("MEMGUARD_PLATFORM") or SETUP["platform_layer"](sys.platform, None)


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
    for layer, own in (("linux", {"linux", "posix"}), ("posix", {"posix"}),
                       ("darwin", {"darwin", "posix"})):
        files = SETUP["layer_sources"](layer)
        assert files[:len(core)] == core
        assert {f.split("/")[2] for f in files[len(core):]} == own
    # the others take posix's plain-POSIX parts, never its getrusage sources
    for layer in ("linux", "darwin"):
        assert "csrc/platform/posix/sources.c" not in SETUP["layer_sources"](layer)
    assert "csrc/platform/posix/thread.c" in SETUP["layer_sources"]("linux")
    assert "csrc/platform/darwin/thread.c" in SETUP["layer_sources"]("darwin")


def test_what_needs_the_linux_layer_says_so_elsewhere():
    """The in-process allocator and `memguard run` are the Linux layer's;
    on another layer each says so, naming the layer, and a guard with a
    budget it cannot enforce warns and still runs."""
    import warnings

    import torch

    import memguard
    from memguard.cli import run as mrun

    if _C.PLATFORM == "linux":
        assert mrun.shim_path().endswith("libmemguard_preload.so")
        return
    with pytest.raises(FileNotFoundError, match=f"only the linux platform layer builds.*"
                                                f"this build's layer is {_C.PLATFORM}"):
        mrun.shim_path()
    with pytest.raises(RuntimeError, match=f"needs the linux platform layer.*this build's "
                                           f"layer is {_C.PLATFORM}"):
        memguard.install()
    assert not memguard.installed()
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with memguard.Guard(budget="1GiB") as guard:
            res = guard.step(torch.randn(8, 4), lambda b: model(b).sum(), opt)
    assert res.micro_batch == 8 and guard.allocator_error is not None
    assert any(f"the {_C.PLATFORM} platform layer cannot see what this process holds, so the "
               "budget of 1.0 GiB is not enforced" in str(w.message) for w in seen)
    s = memguard.sample()
    assert s.rss_bytes is None and s.footprint_bytes is None and s.psi_some_avg10 is None
    assert s.minor_faults is not None and s.mem_total_bytes is not None   # getrusage, sysconf


def test_the_build_variable_is_not_reported_as_an_unknown_option(monkeypatch):
    import warnings

    from memguard import _options

    monkeypatch.setenv("MEMGUARD_PLATFORM", "posix")
    monkeypatch.setenv("MEMGUARD_NO_SUCH_OPTION", "1")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _options.warn_about_environment()
    said = [str(w.message) for w in seen]
    assert any(m.startswith("MEMGUARD_NO_SUCH_OPTION is not a memguard option") for m in said)
    assert not any("MEMGUARD_PLATFORM" in m.split(";")[0] for m in said)
