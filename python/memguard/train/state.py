"""A guard's resumable state: what :meth:`Guard.state_dict` writes and
:meth:`Guard.load_state_dict` reads back.

A state is read whole before any of it is applied. One this version of
memguard did not write (another version's layout, or not a mapping at all)
is skipped with a warning naming what it is; one of this version with a
missing, unknown or out-of-range field is refused with a ``ValueError``
naming the field and its value.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

#: the layout :meth:`GuardState.to_dict` writes, the only one read back
VERSION = 1
#: the largest size or count a state may hold: the C planner's sizes are uint64_t
COUNT_MAX = 2**64 - 1


@dataclasses.dataclass(frozen=True)
class GuardState:
    """What a resumed run needs to go on where a guard stopped.

    Attributes:
        micro_batch: the planned micro-batch size (0: none planned yet, a
            guard with ``micro_batch="auto"`` before its first step).
        checkpointed_blocks: how many blocks were checkpointed.
        steps: steps committed.
        ooms_recovered: out-of-memory errors recovered from.
        micro_batch_changes: planner decisions that changed the size.
        peak_bytes: the highest step peak seen, in bytes.
    """

    micro_batch: int
    checkpointed_blocks: int
    steps: int
    ooms_recovered: int
    micro_batch_changes: int
    peak_bytes: int

    @classmethod
    def of(cls, guard: Any) -> GuardState:
        """A :class:`~memguard.train.guard.Guard`'s state now."""
        ck = guard.checkpoints
        return cls(guard.micro_batch, ck.n_on if ck is not None else 0, guard.steps,
                   guard.ooms_recovered, guard.micro_batch_changes, guard.peak_bytes)

    def to_dict(self) -> dict[str, Any]:
        """The state as saved in a checkpoint, with its ``version``."""
        return {"version": VERSION, **dataclasses.asdict(self)}

    @classmethod
    def read(cls, state: Any) -> GuardState | None:
        """The state in ``state`` (a :meth:`to_dict` mapping), checked whole.

        Returns:
            The state; ``None``, with a warning naming what was found, where
            ``state`` is not a mapping or has another ``version`` (or none).

        Raises:
            ValueError: a field missing, unknown, or not an integer from 0
                to 2**64-1, naming the field and its value.
        """
        found = _foreign(state)
        if found is not None:
            warnings.warn(f"memguard: the guard state was not loaded: {found}, and this "
                          f"memguard reads version {VERSION}; the guard keeps its own state "
                          f"(a new guard starts fresh)", UserWarning, stacklevel=3)
            return None
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(map(repr, set(state) - {"version", *names}))
        if unknown:
            raise ValueError(f"memguard guard state: unknown field(s) {', '.join(unknown)}")
        return cls(**{name: _count(state, name) for name in names})


def _foreign(state: Any) -> str | None:
    """What ``state`` is where it is not a state of :data:`VERSION`, else None."""
    if not isinstance(state, Mapping):
        return f"it is a {type(state).__name__}, not a mapping"
    if "version" not in state:
        return "it has no version"
    v = state["version"]
    if isinstance(v, bool) or not isinstance(v, int) or v != VERSION:
        return f"it has version {v!r}"
    return None


def _count(state: Mapping[str, Any], name: str) -> int:
    """Field ``name`` of ``state``: an integer from 0 to :data:`COUNT_MAX`."""
    if name not in state:
        raise ValueError(f"memguard guard state: field {name!r} is missing")
    v = state[name]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= COUNT_MAX:
        raise ValueError(f"memguard guard state: {name} must be an integer from 0 to "
                         f"2**64-1, not {v!r}")
    return v
