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
binding = sorted(glob("csrc/python/*.c"))

setup(
    ext_modules=[
        Extension(
            "memguard._C",
            sources=core + binding,
            include_dirs=["include", "csrc/core", "csrc/python"],
            extra_compile_args=CFLAGS,
            libraries=["pthread", "m"],
        )
    ],
)
