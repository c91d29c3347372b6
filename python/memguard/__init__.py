"""memguard: keep a PyTorch training run inside its memory budget.

The C core samples memory telemetry off the GIL and turns it into a pressure
level; this package exposes it::

    import memguard

    memguard.parse_budget("12GiB")          # bytes
    s = memguard.sample()                   # one synchronous reading
    with memguard.telemetry.Sampler(interval_ms=100, budget="75%") as sampler:
        sampler.on_pressure(lambda ev: print(ev.new, ev.sample.reasons))
        ...
"""
from memguard import allocator, telemetry
from memguard._options import configure, option, options
from memguard.allocator import install, installed, is_oom, stats, trim, uninstall
from memguard.budget import parse_budget
from memguard.telemetry import Level, PressureEvent, Sample, Sampler, sample

__version__ = "0.1.0"

# These need torch; they load on first use so that `import memguard` works
# (telemetry, doctor, `memguard run`) where torch is not installed.
_LAZY = {
    "Guard": "memguard.guard",
    "GuardOOMError": "memguard.guard",
    "Output": "memguard.guard",
    "StepResult": "memguard.guard",
    "Accumulator": "memguard.accumulation",
    "accumulate": "memguard.accumulation",
    "BatchSizeResult": "memguard.finder",
    "find_batch_size": "memguard.finder",
}


def __getattr__(name: str):
    if name == "checkpoint":             # the submodule, loaded on first use
        import importlib

        return importlib.import_module("memguard.checkpoint")
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'memguard' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value

__all__ = [
    "Accumulator",
    "BatchSizeResult",
    "Guard",
    "GuardOOMError",
    "Level",
    "Output",
    "PressureEvent",
    "Sample",
    "Sampler",
    "StepResult",
    "accumulate",
    "allocator",
    "checkpoint",
    "configure",
    "find_batch_size",
    "install",
    "installed",
    "is_oom",
    "option",
    "options",
    "parse_budget",
    "sample",
    "stats",
    "telemetry",
    "trim",
    "uninstall",
]

from memguard import _options as _opts

_opts.warn_about_environment()
