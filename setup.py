"""Build memguard._C and libmemguard_preload.so from csrc/: C11, warnings as
errors, no torch headers."""
from __future__ import annotations

import os
import sys
from glob import glob

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
from setuptools.command.build_ext import build_ext

#: The platform layers of the C core: the files under csrc/platform/ each
#: builds. posix is the fallback (getrusage, sysconf, pipes, no in-process
#: allocator) and holds what is plain POSIX for the others to share: Linux
#: takes its thread CPU clocks, macOS its notifiers and its stubs.
LAYERS = {
    "linux": ["linux/*.c", "posix/thread.c"],
    "posix": ["posix/*.c"],
    "darwin": ["darwin/*.c", "posix/notify.c", "posix/install.c", "posix/swapin.c"],
}
#: sys.platform -> layer: Linux and macOS have their own, other Unixes the fallback
SYSTEMS = {"linux": "linux", "darwin": "darwin", "freebsd": "posix", "openbsd": "posix",
           "netbsd": "posix", "sunos": "posix"}


def platform_layer(system: str, forced: str | None) -> str:
    """The layer to build for ``system`` (``sys.platform``), or
    ``MEMGUARD_PLATFORM`` when set.

    Raises:
        SystemExit: no layer for this platform (or the one forced), with what
            there is, before any compiler runs.
    """
    if forced:
        if forced in LAYERS:
            return forced
        raise SystemExit(f"memguard: MEMGUARD_PLATFORM={forced!r} is not a platform layer; "
                         f"the C core has {', '.join(sorted(LAYERS))}. Unset it to build the "
                         f"layer of this platform.")
    layer = next((v for k, v in SYSTEMS.items() if system.startswith(k)), None)
    if layer:
        return layer
    raise SystemExit(
        f"memguard: cannot build for this platform ({system!r}): the C core needs a POSIX "
        f"system (threads, poll, mmap) and has layers for Linux, macOS and other Unixes "
        f"({', '.join(sorted(LAYERS))}). On Windows, use WSL2, where the Linux layer builds.")


def layer_sources(layer: str) -> list[str]:
    """The C core of ``layer``: csrc/core/ and the layer's platform files
    (no shims, no Python binding), relative to this file's folder."""
    def here(pattern: str) -> list[str]:
        return sorted(os.path.relpath(f, HERE) for f in glob(os.path.join(HERE, pattern)))

    files = here("csrc/core/*.c")
    for pattern in LAYERS[layer]:
        files += here(f"csrc/platform/{pattern}")
    return files


LAYER = platform_layer(sys.platform, os.environ.get("MEMGUARD_PLATFORM") or None)

CFLAGS = [
    "-std=c11",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-fvisibility=hidden",
    "-D_GNU_SOURCE",
    "-DMG_BUILDING",
    # CPython's own headers trip these; our code is checked by the C tests too.
    "-Wno-missing-field-initializers",
    # mg_cuda_alloc throws C++ exceptions through PyTorch: keep every
    # frame unwindable
    "-fexceptions",
    f'-DMG_PLATFORM="{LAYER}"',
    # Apple's headers hide sysctlbyname and friends from strict ISO C
    *(["-D_DARWIN_C_SOURCE"] if LAYER == "darwin" else []),
]

core = layer_sources(LAYER)
shim = sorted(f for f in glob("csrc/shim/*.c") if not f.endswith("preload.c"))
binding = sorted(glob("csrc/python/*.c"))

# The LD_PRELOAD shim: the malloc family, the arena and what the budget needs.
# Built hidden by default (no MG_BUILDING): it exports the malloc family,
# the arena's entry points and its markers only.
PRELOAD = ["csrc/shim/preload.c", "csrc/core/arena.c", "csrc/core/options.c",
           "csrc/core/budget.c", "csrc/core/procfs.c", "csrc/core/util.c"]
PRELOAD_CFLAGS = [f for f in CFLAGS if f != "-DMG_BUILDING"]


class build_ext_with_preload(build_ext):
    """build_ext, then libmemguard_preload.so beside the extension."""

    def run(self):
        super().run()
        if LAYER != "linux":     # LD_PRELOAD and ELF symbol interposition are Linux's
            return
        out_dir = os.path.dirname(self.get_ext_fullpath("memguard._C"))
        target = os.path.join(out_dir, "libmemguard_preload.so")
        deps = PRELOAD + glob("csrc/*/*.h") + glob("include/memguard/*.h")
        if (not self.force and os.path.exists(target)
                and all(os.path.getmtime(d) <= os.path.getmtime(target) for d in deps)):
            return
        objects = self.compiler.compile(
            PRELOAD, output_dir=os.path.join(self.build_temp, "preload"),
            include_dirs=["include", "csrc/core", "csrc/shim"],
            extra_postargs=PRELOAD_CFLAGS + ["-fPIC"])
        os.makedirs(out_dir, exist_ok=True)
        self.compiler.link_shared_object(objects, target, libraries=["dl", "pthread", "m"])


if __name__ == "__main__":       # pip and setuptools run this file as __main__
    setup(
        cmdclass={"build_ext": build_ext_with_preload},
        ext_modules=[
            Extension(
                "memguard._C",
                sources=core + shim + binding,
                include_dirs=["include", "csrc/core", "csrc/shim", "csrc/python",
                              f"csrc/platform/{LAYER}"],
                extra_compile_args=CFLAGS,
                libraries=["pthread", "m", "dl"],
            )
        ],
    )
