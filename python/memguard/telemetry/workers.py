"""The process's DataLoader workers (its child processes) in a sample: how
many, what they hold alone, and what fewer of them would give back.

The sampler measures the whole tree below the process (``Sample.children``
and ``Sample.children_bytes``, their private and swapped-out bytes), but
for other ranks of the same distributed job started below it (Lightning's
``strategy="ddp"``: rank 0 starts the others) and theirs, and counts it in
``footprint_bytes``; these helpers keep the process's own part
and the workers' apart for the report, ``memguard watch`` and loggers.
"""
from __future__ import annotations

from memguard._common import MiB, size
from memguard.telemetry.samples import Sample


def workers_metrics(s: Sample) -> dict[str, float]:
    """The workers as logged metrics: ``memguard/workers`` (their number)
    and ``memguard/workers_mib`` (what they hold alone, in MiB); empty where
    the sample has no figure for them (not Linux, or unreadable)."""
    if s.children is None:
        return {}
    out = {"memguard/workers": float(s.children)}
    if s.children_bytes is not None:
        out["memguard/workers_mib"] = s.children_bytes / MiB
    return out


def own_bytes(s: Sample) -> int | None:
    """The process's own footprint: ``footprint_bytes`` less its workers'."""
    if s.footprint_bytes is None:
        return None
    return s.footprint_bytes - (s.children_bytes or 0)


def give_back(workers: int, workers_bytes: int) -> list[tuple[int, int]]:
    """``(num_workers, bytes given back)`` for each lower worker count, the
    workers taken as holding an equal share each: for 4 workers of 150 MiB,
    ``[(2, 300 MiB), (0, 600 MiB)]`` (halving, then none)."""
    if workers <= 0 or workers_bytes <= 0:
        return []
    each = workers_bytes // workers
    counts = sorted({workers // 2, 0} - {workers}, reverse=True)
    return [(n, (workers - n) * each) for n in counts]


def describe(workers: int, workers_bytes: int) -> str:
    """The workers and what fewer would give back, in one phrase: ``4
    DataLoader workers (child processes) hold 600 MiB; num_workers=2 would
    give back about 300 MiB, num_workers=0 about 600 MiB``."""
    fewer = give_back(workers, workers_bytes)
    said = ", ".join(f"num_workers={n}{' would give back' if i == 0 else ''} about {size(b)}"
                     for i, (n, b) in enumerate(fewer))
    noun = "worker" if workers == 1 else "workers"
    return (f"{workers} DataLoader {noun} (child processes) hold {size(workers_bytes)}"
            + (f"; {said}" if said else ""))
