"""memguard's options: one table in the C core, read from ``MEMGUARD_<NAME>``
environment variables on first use and changed with :func:`configure`.

A bad environment value keeps the default and is reported as a
:class:`MemguardConfigWarning` (a run should not die over a typo in its
environment); a bad value passed to :func:`configure` raises ``ValueError``,
since it is a mistake in code.
"""
from __future__ import annotations

import os
import warnings

from memguard import _C


class MemguardConfigWarning(UserWarning):
    """A ``MEMGUARD_*`` environment variable was not understood (public as
    ``memguard.MemguardConfigWarning``: filter it with
    ``warnings.filterwarnings("error", category=memguard.MemguardConfigWarning)``)."""


def _as_text(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def configure(**values: object) -> None:
    """Set options for samplers created afterwards, all or none.

    Args:
        **values: option names (see :func:`options`) and their values, e.g.
            ``configure(interval_ms=10, psi_high=0.2)``.

    Raises:
        ValueError: an unknown option name, a value out of its range, or
            thresholds of one signal out of order (they must rise from
            elevated to critical; headroom's fall). Nothing is changed then.
    """
    known = _C.option_names()
    unknown = [name for name in values if name not in known]
    if unknown:
        raise ValueError(f"unknown memguard option {unknown[0]!r}; known: {', '.join(known)}")
    before = {name: _C.option_get(name) for name in values}
    try:
        for name, value in values.items():
            _C.option_set(name, _as_text(value))
        why = _C.option_check()
        if why is not None:
            raise ValueError(f"configure({_call(values)}): {why}")
    except BaseException:
        for name, text in before.items():
            _C.option_set(name, text)
        raise


def _call(values: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


def option(name: str) -> float | str:
    """Current value of one option (numbers as ``float``).

    Raises:
        ValueError: unknown option name.
    """
    try:
        text = _C.option_get(name)
    except KeyError:
        raise ValueError(f"unknown memguard option {name!r}") from None
    try:
        return float(text)
    except ValueError:
        return text


def options() -> dict[str, float | str]:
    """All options and their current values."""
    return {name: option(name) for name in _C.option_names()}


#: read when memguard is built (setup.py), not at run time
BUILD_VARIABLES = frozenset({"MEMGUARD_PLATFORM"})
#: set by `memguard run` for the preload shim (the run's budget segment), not options
RUN_VARIABLES = frozenset({"MEMGUARD_TREE"})


def warn_about_environment() -> None:
    """Report bad or unknown ``MEMGUARD_*`` variables once, as warnings."""
    for message in _C.option_warnings():
        warnings.warn(message, MemguardConfigWarning, stacklevel=3)
    known = {"MEMGUARD_" + n.upper() for n in _C.option_names()}
    for key in os.environ:
        if key.startswith("MEMGUARD_") and key not in known | BUILD_VARIABLES | RUN_VARIABLES:
            shown = key.encode(errors="surrogateescape").decode(errors="backslashreplace")
            warnings.warn(
                f"{shown} is not a memguard option; known: {', '.join(sorted(known))}",
                MemguardConfigWarning,
                stacklevel=3,
            )
