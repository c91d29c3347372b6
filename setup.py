"""Build memguard._C and libmemguard_preload.so from csrc/: C11, warnings as
errors, no torch headers."""
from __future__ import annotations

import os
import sys
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

#: the platform layers the C core is built for, by sys.platform
LAYERS = {"linux": "linux"}


def platform_layer(system: str, forced: str | None) -> str:
    """The layer to build for ``system`` (``sys.platform``), or
    ``MEMGUARD_PLATFORM`` when set.

    Raises:
        SystemExit: no layer for this platform, with what would be needed,
            before any compiler runs.
    """
    layer = forced or LAYERS.get(system)
    if layer in LAYERS.values():
        return layer
    asked = f"MEMGUARD_PLATFORM={forced!r}" if forced else f"this platform ({system!r})"
    raise SystemExit(
        f"memguard: cannot build for {asked}: the C core has a platform layer for Linux "
        f"only ({', '.join(sorted(set(LAYERS.values())))}). It reads /proc and cgroups, wakes "
        f"its sampler with eventfd and rebinds ELF import slots; the portable POSIX and macOS "
        f"layers are not written yet. On Linux, unset MEMGUARD_PLATFORM.")


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
]

core = sorted(glob("csrc/core/*.c"))
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
                include_dirs=["include", "csrc/core", "csrc/shim", "csrc/python"],
                extra_compile_args=CFLAGS,
                libraries=["pthread", "m", "dl"],
            )
        ],
    )
