"""Memory budgets as people write them: ``"auto"``, ``"12GiB"``, ``"512MB"``,
``"75%"`` or a number of bytes."""
from __future__ import annotations

from memguard import _C
from memguard._common import is_auto
from memguard.telemetry.samples import sample

BUDGET_MAX = 1 << 62     # MG_BUDGET_MAX: beyond any machine; sums of budgets cannot wrap


def _system_limits() -> tuple:
    """(total, usable) bytes for this process right now."""
    return auto_inputs(sample().to_dict())


def auto_inputs(s: dict) -> tuple:
    """(total, usable) bytes from one sample (as a dict): what ``"auto"`` and
    percentages are taken of.

    total is physical memory, or the cgroup limit when lower; usable is what
    is free plus what this process already holds (MemAvailable + RSS, and the
    cgroup's headroom + RSS when a limit is set).
    """
    total = s["mem_total_bytes"] or 0
    rss = s["rss_bytes"] or 0
    usable = (s["mem_available_bytes"] or 0) + rss if s["mem_available_bytes"] else 0
    limit = s["cgroup_limit_bytes"]
    if limit:
        total = min(total, limit) if total else limit
        used = s["cgroup_working_set_bytes"] or s["cgroup_usage_bytes"] or 0
        cg_usable = max(limit - used, 0) + rss
        usable = min(usable, cg_usable) if usable else cg_usable
    return total, usable


def parse_budget(value: str | int, total: int | None = None) -> int:
    """Turn a budget into bytes.

    Args:
        value: ``"auto"`` (90 % of what the process can use now: free memory
            plus its own RSS, within any cgroup limit), a size such as
            ``"12GiB"``, ``"1.5G"`` or ``"512MB"`` (K/M/G/T and KiB/MiB/... are
            powers of 1024; KB/MB/GB/TB powers of 1000), a percentage such as
            ``"75%"`` of ``total``, or a positive integer of bytes.
        total: the reference for percentages and ``"auto"``; by default the
            machine's memory, or the cgroup limit when that is lower. When
            given, ``"auto"`` is 90 % of it.

    Returns:
        The budget in bytes (positive).

    Raises:
        ValueError: the value is not a budget; the message names it.
    """
    if isinstance(value, bool):
        raise ValueError(f"budget {value!r} is not valid: a budget is not a boolean")  # noqa: TRY004 - one error type for every bad budget
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"budget {value!r} is not valid: it must be positive")
        if value > BUDGET_MAX:
            raise ValueError(f"budget {value!r} is larger than memguard can hold (at most "
                             f"4 EiB, 2**62 bytes); pass None for no budget")
        return value
    if not isinstance(value, str):
        raise ValueError(  # noqa: TRY004 - one error type for every bad budget
            f"budget {value!r} is not valid: use \"auto\", a size such as \"12GiB\", "
            f"a percentage such as \"75%\", or a positive integer of bytes"
        )
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total <= 0):
        raise ValueError(f"total {total!r} is not a positive number of bytes")
    available = 0
    if total is None:
        # only "auto" and percentages depend on the machine: a size does not
        # need a system sample
        if is_auto(value) or value.strip().endswith("%"):
            total, available = _system_limits()
            if not total:
                raise ValueError(
                    f"budget {value!r} is taken of this machine's memory, and memguard could "
                    f"not read it (MemTotal in {_C.option_get('proc_root')}/meminfo, or a "
                    f"cgroup limit); give the budget as a size such as \"12GiB\"")
        else:
            total = 0
    return _C.parse_budget(value, total, available)
