"""Build memguard._C from csrc/: C11, warnings as errors, no torch headers."""
from glob import glob

from setuptools import Extension, setup

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
]

core = sorted(glob("csrc/core/*.c"))
shim = sorted(f for f in glob("csrc/shim/*.c") if not f.endswith("preload.c"))
binding = sorted(glob("csrc/python/*.c"))

setup(
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
