"""Helpers every memguard module may use. This module imports nothing of
memguard's own, so importing it never creates a cycle."""
from __future__ import annotations

import math
import os
import sys
from typing import Any

VERSION = "0.1.0"

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def size(n: float | None) -> str:
    """Bytes as people read them: ``512 B``, ``23.5 GiB``; ``?`` for None."""
    if n is None:
        return "?"
    v = float(n)
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            break
        v /= 1024
    return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"


def unwritable(exc: OSError, path: str) -> str:
    """Why ``path`` could not be opened for writing, in words: a missing
    directory is named (memguard never creates one unasked)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"the directory {parent!r} does not exist"
    return exc.strerror or str(exc)


def finite(v: Any) -> float | None:
    """``v`` as a float if it is a finite real number (not a bool), else
    None: missing fields, JSON nulls, strings, NaN and infinities."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def is_auto(value: Any) -> bool:
    """Whether a budget is written ``"auto"`` (any case, any padding)."""
    return isinstance(value, str) and value.strip().lower() == "auto"


def each(*parts: Any) -> None:
    """Call every one of ``parts`` (callables taking nothing), in order,
    even when some raise: teardown that stops at its first error leaves the
    rest installed. The first error is raised once all have run, with the
    later ones added as notes."""
    first: BaseException | None = None
    for part in parts:
        try:
            part()
        except BaseException as e:  # noqa: BLE001 - raised below, after the rest
            if first is None:
                first = e
            else:
                first.add_note(f"memguard: teardown also raised {type(e).__name__}: {e}")
    if first is not None:
        raise first


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller of this
    function name the first frame outside memguard (the user's line)."""
    f, level = sys._getframe(1), 1
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE):
        f, level = f.f_back, level + 1
    return level
