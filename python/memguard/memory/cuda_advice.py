"""When PyTorch's CUDA caching allocator fragments, and what to set: the
``expandable_segments`` rule shared by the CUDA governor and
``memguard doctor``."""
from __future__ import annotations

import os
import shlex
from collections.abc import Mapping

from memguard._common import size

#: PyTorch's allocator settings: the older name first, then torch 2.9+'s name.
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE = "expandable_segments"
#: Fragmentation shows when reserved bytes are at least this many times the
#: allocated bytes ...
FRAGMENTATION_RATIO = 1.5
#: ... and the reserved bytes not allocated come to at least this much.
FRAGMENTATION_MIN_BYTES = 512 * 1024 * 1024

def _alloc_options(value: str | None) -> list[tuple[str, str, str]]:
    """The comma-separated ``key:value`` options of an allocator setting.

    Args:
        value: the variable's value, or None when unset.

    Returns:
        ``(key, value, text)`` per non-empty option, ``text`` the option as written
        (stripped); key and value are stripped, value empty when there is no colon.
    """
    out = []
    for part in (value or "").split(","):
        text = part.strip()
        if text:
            key, _, val = text.partition(":")
            out.append((key.strip(), val.strip(), text))
    return out


def expandable_on(value: str | None) -> bool:
    """Whether an allocator setting turns ``expandable_segments`` on.

    Args:
        value: the value of ``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF``, or None.

    Returns:
        True when its last ``expandable_segments`` option is ``True`` or ``1`` (any case).
    """
    vals = [v for k, v, _ in _alloc_options(value) if k == EXPANDABLE]
    return bool(vals) and vals[-1].lower() in ("true", "1")


def merge_alloc_conf(value: str | None) -> str:
    """An allocator setting with ``expandable_segments:True`` in it.

    The other options are kept as written and in order; an existing
    ``expandable_segments`` option (``False``, say) is replaced in place, and
    any repeats of it are dropped.

    Args:
        value: the current value of ``PYTORCH_CUDA_ALLOC_CONF`` or
            ``PYTORCH_ALLOC_CONF``, or None when unset.

    Returns:
        The value to set, e.g. ``max_split_size_mb:128,expandable_segments:True``.
    """
    parts: list[str] = []
    placed = False
    for key, _, text in _alloc_options(value):
        if key != EXPANDABLE:
            parts.append(text)
        elif not placed:
            parts.append(f"{EXPANDABLE}:True")
            placed = True
    if not placed:
        parts.append(f"{EXPANDABLE}:True")
    return ",".join(parts)


def _setting_text(env: Mapping[str, str]) -> str:
    """The allocator variables as set in ``env``.

    Args:
        env: the environment.

    Returns:
        Text such as ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128, PYTORCH_ALLOC_CONF unset``.
    """
    return ", ".join(f"{name}={env[name]}" if name in env else f"{name} unset"
                     for name in ALLOC_CONF_VARS)


def fragmented(allocated: int, reserved: int) -> bool:
    """Whether reserved CUDA bytes are far enough above allocated bytes to call fragmentation.

    Args:
        allocated: bytes in tensors (``torch.cuda.memory_allocated``).
        reserved: bytes the caching allocator holds (``torch.cuda.memory_reserved``).

    Returns:
        True when reserved is at least ``FRAGMENTATION_RATIO`` times allocated and
        at least ``FRAGMENTATION_MIN_BYTES`` above it.
    """
    return (reserved >= FRAGMENTATION_RATIO * allocated
            and reserved - allocated >= FRAGMENTATION_MIN_BYTES)


def expandable_segments_advice(allocated: int | None, reserved: int | None,
                               env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """Whether to turn on PyTorch's ``expandable_segments``, from CUDA memory figures.

    Args:
        allocated: CUDA bytes in tensors, or None when not known.
        reserved: CUDA bytes the caching allocator holds, or None when not known.
        env: the environment to read the allocator settings from (default os.environ).

    Returns:
        ``(found, advice)`` for a report row.
    """
    env = os.environ if env is None else env
    setting = _setting_text(env)
    on = [name for name in ALLOC_CONF_VARS if expandable_on(env.get(name))]
    state = (f"{EXPANDABLE} is already on ({setting})" if on
             else f"{EXPANDABLE} is not on ({setting})")
    if allocated is None or reserved is None:
        advice = (f"{state}; for reserved and allocated figures from a run: "
                  f"memguard doctor --telemetry RUN.jsonl")
        return "no CUDA figures (reserved and allocated bytes unknown)", advice
    gap = reserved - allocated
    found = f"reserved {size(reserved)}, allocated {size(allocated)}"
    if allocated > 0:
        found += f" ({reserved / allocated:.1f}x)"
    if not fragmented(allocated, reserved):
        found += f", {size(max(gap, 0))} cached beyond what tensors use"
        advice = (f"reserved/allocated figures are fine (fragmentation shows from "
                  f"{FRAGMENTATION_RATIO:g}x and {size(FRAGMENTATION_MIN_BYTES)} cached); "
                  f"{state}")
        return found, advice
    found += f": {size(gap)} held in cached segments but not allocated (fragmentation)"
    if on:
        advice = (f"{state}: nothing to set; torch.cuda.empty_cache() hands the "
                  f"cached segments back to the driver")
        return found, advice
    line = "export " + " ".join(f"{name}={shlex.quote(merge_alloc_conf(env.get(name)))}"
                                for name in ALLOC_CONF_VARS)
    advice = (f"the caching allocator keeps freed blocks in cached segments that cannot "
              f"be reused for allocations of other sizes; with {EXPANDABLE}:True segments "
              f"grow in place instead. {state}; set it before the run starts (torch before 2.9 "
              f"reads the first variable, 2.9 and later the second): {line}")
    return found, advice
