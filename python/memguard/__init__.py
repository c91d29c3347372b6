"""memguard: keep a PyTorch training run inside the memory it can have.

::

    import memguard

    guard = memguard.Guard(budget="auto")     # what the process can have, live
    with guard:
        for batch in loader:
            guard.step(batch, loss_fn, optimizer)

The package follows the data path: :mod:`memguard.telemetry` (samples, the
sampler, the pressure level, exporters), :mod:`memguard.memory` (the CPU
arena, CUDA, gc hooks, the live budget), :mod:`memguard.train` (the guard,
its step transaction and the helpers it splits batches with),
:mod:`memguard.integrations` (Lightning, pytest) and :mod:`memguard.cli`.
The names below are the public API, grouped by concern.
"""
import importlib

from memguard import _options, telemetry
from memguard._common import VERSION
from memguard._options import MemguardConfigWarning, configure, option, options
from memguard.memory import cuda, mps
from memguard.memory.arena import install, installed, stats, trim, uninstall
from memguard.memory.oom import is_oom
from memguard.telemetry import Event, Level, PressureEvent, Sample, Sampler, parse_budget, sample

__version__ = VERSION

# Training needs torch; these load on first use so that `import memguard`
# works (telemetry, doctor, `memguard run`) where torch is not installed.
_LAZY = {
    "Guard": "memguard.train.guard",
    "Output": "memguard.train.guard",
    "StepResult": "memguard.train.guard",
    "GuardOOMError": "memguard.train.step",
    "NonFiniteLossError": "memguard.train.transaction",
    "OptimizerOOMError": "memguard.train.transaction",
    "PostStepError": "memguard.train.transaction",
    "BudgetOverrunWarning": "memguard.train.overruns",
    "WorkersWarning": "memguard.train.workers",
    "ForecastWarning": "memguard.train.drift",
    "StrandedCollective": "memguard.train.collectives",
    "UnsupportedEngine": "memguard.train.engines",
    "Accumulator": "memguard.train.accumulation",
    "accumulate": "memguard.train.accumulation",
    "BatchSizeResult": "memguard.train.finder",
    "find_batch_size": "memguard.train.finder",
}


#: modules reached as attributes or imported (``from memguard.lightning import
#: MemGuardCallback``), loaded on first use (they need torch, Lightning)
_MODULES = {"checkpoint": "memguard.checkpoint",
            "lightning": "memguard.lightning"}


def __getattr__(name: str):
    if name in _MODULES:                 # memguard.checkpoint.wrap(...), memguard.lightning...
        value = importlib.import_module(_MODULES[name])
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'memguard' has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = [  # noqa: RUF022 - grouped by concern, as the docs are
    # telemetry
    "Event", "Level", "PressureEvent", "Sample", "Sampler", "parse_budget", "sample",
    "telemetry",
    # memory
    "cuda", "install", "installed", "is_oom", "mps", "stats", "trim", "uninstall",
    # training
    "Accumulator", "BatchSizeResult", "BudgetOverrunWarning", "Guard", "GuardOOMError", "NonFiniteLossError",
    "OptimizerOOMError", "Output", "PostStepError", "StepResult", "accumulate", "checkpoint",
    "find_batch_size", "ForecastWarning", "StrandedCollective", "UnsupportedEngine",
    "WorkersWarning",
    # integrations
    "lightning",
    # options
    "MemguardConfigWarning", "configure", "option", "options",
]

_options.warn_about_environment()
