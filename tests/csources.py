"""setup.py's platform layers for the tests: the C core's sources by layer,
as setup.py builds them, for the C tests and the fuzz targets (which
compile the core themselves), the C compiler they build with, and
setup.py's names for the platform tests."""
from __future__ import annotations

import os
import pathlib
import runpy
import shlex
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


#: setup.py's names (its setup() runs only as __main__)
SETUP = runpy.run_path(str(ROOT / "setup.py"), run_name="setup")
#: the layer a C test builds with, by the prefix of its name (test_posix_*.c);
#: every other test builds with the Linux layer
LAYERS = tuple(SETUP["LAYERS"])
#: the macOS layer's pure part, which compiles anywhere (its Mach calls do not)
DARWIN_PURE = ROOT / "csrc" / "platform" / "darwin" / "vmstat.c"


#: the layers whose C compiles on this system: Linux's needs Linux; the
#: fallback and macOS's pure part build anywhere POSIX
BUILDABLE = ("linux", "posix", "darwin") if sys.platform.startswith("linux") \
    else ("posix", "darwin")


#: the C compiler of the C tests and of the fuzz targets' replay: $CC, else
#: cc, gcc or clang on PATH; None where there is none
CC: str | None = os.environ.get("CC") or next(
    (c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
CC_CMD = shlex.split(CC) if CC else []  # $CC may carry flags ("gcc -m64")
if CC_CMD and not shutil.which(CC_CMD[0]):
    CC, CC_CMD = None, []


def layer_sources(layer: str) -> list[pathlib.Path]:
    """The C core of ``layer``; "darwin" is the posix layer plus darwin's pure
    part, the one that can be built here."""
    if layer == "darwin":
        return [*layer_sources("posix"), DARWIN_PURE]
    return [ROOT / f for f in SETUP["layer_sources"](layer)]


def layer_of(name: str) -> str:
    """The layer a C test named ``name`` (test_posix_sources) builds with."""
    parts = name.split("_")
    return parts[1] if len(parts) > 2 and parts[1] in LAYERS else "linux"
