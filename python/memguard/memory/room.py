"""The room a run has now: the live budget, and memguard's arena following it.

A budget given once at start-up goes stale: a laptop's other programs grow,
a container's limit is lowered, DataLoader workers start. :class:`Room`
re-derives, at every step boundary, what the process can have *now*:

* the user's budget, if one was given;
* in a memory cgroup with a limit, the limit (``memory.high`` where lower)
  less what others in the cgroup use;
* on the host, the process tree's resident bytes plus ``MemAvailable``;

each less a reserve: the pressure model's HIGH headroom (8 % of the limit,
of memory, by default), room for page cache and the code of the libraries,
so that living within the budget never reads as HIGH by itself;

the least of them. What the budget bounds is the *footprint*: the process's
resident and swapped-out bytes plus what its children (DataLoader workers)
hold alone, so memory the kernel swapped out still counts.

Where memguard's arena serves tensors, its budget follows: the live budget
less what the process holds outside the arena, capped by a tensor budget if
one was given. When that falls below what the arena reserves, the cache is
released down to it at once (which also frees the swap its pages held).
The cache yields otherwise too: cached blocks that no step reused for
``decay_steps`` boundaries go back to the kernel, and reserved bytes are
kept within 1.25x the recent steps' peak plus 64 MiB.

Pages the kernel swapped out while the run did not fit (a limit lowered
under it) stay in swap until touched, and many never are: once the run fits
again, :meth:`Room.recover_swap` faults them back in, so the process leaves
swap instead of paying a major fault on each later touch.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

from memguard import _C
from memguard._common import MiB, size
from memguard._options import option
from memguard.memory import arena
from memguard.telemetry import Level

#: reserved bytes kept within this many times the recent peak, plus SLACK
WORKING_SET_FACTOR = 1.25
WORKING_SET_SLACK = 64 * MiB
#: the smallest arena budget the room sets (a smaller one could not hold a
#: model's parameters anyway, and 0 would mean "no budget")
MIN_ARENA_BUDGET = 16 * MiB
#: swap worth bringing back: at least this, and 1 % of the footprint
SWAP_MIN = 16 * MiB
#: ... once the footprint (swap included) is within this share of the budget
SWAP_FIT = 0.9
#: the most of the wall time bringing swap back may take
SWAP_SHARE = 0.05


@dataclasses.dataclass(frozen=True)
class RoomState:
    """The room at one step boundary.

    Attributes:
        budget_bytes: the live budget of the process (0: none).
        source: what bound it: ``"user"``, ``"cgroup"``, ``"host"`` or
            ``"none"``.
        footprint_bytes: resident plus swapped-out bytes of the process and
            what its children hold alone.
        swap_bytes: the process's swapped-out bytes.
        outside_bytes: the footprint less what memguard's arena reserves:
            what tensors cannot have.
        arena_budget_bytes: the arena's budget set from it (0: none).
        reserved_bytes: what the arena reserved once the boundary had
            released what it would (0 without the arena).
    """
    budget_bytes: int
    source: str
    footprint_bytes: int
    swap_bytes: int
    outside_bytes: int
    arena_budget_bytes: int
    reserved_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def live_budget(sample: Any, budget: int | None = None) -> tuple[int, str] | None:
    """What the process can have now, from one sample (a
    :class:`memguard.Sample` or the C layer's dict): the least of ``budget``,
    the cgroup's room and the host's (see the module docstring), and what
    bound it. ``None`` when neither a budget nor a reading says."""
    # to_dict, not dataclasses.asdict: asdict deep-copies each of the
    # sample's fields, a quarter of a millisecond at every step boundary
    d = sample if isinstance(sample, dict) else {
        k: v for k, v in sample.to_dict().items()
        if k not in ("level", "raw_level", "reasons")}
    return _C.live_budget(d, int(budget or 0), float(option("headroom_high")))


class Room:
    """The live budget, and the arena's budget and cache following it.

    Args:
        budget: the budget asked for in bytes, or ``None`` for the live
            figure alone (``"auto"``).
        tensor_budget: a cap on the arena's budget, for tensors alone
            (``None``: none).
        live: follow the live budget (=True); ``False``: no budget at all
            but ``tensor_budget`` (the arena's budget is then left alone
            without one).
        decay_steps: cached blocks not reused at this many step boundaries
            are released (=3).
        peak_window: steps whose peak bounds the cache (=4).
    """

    def __init__(self, budget: int | None = None, tensor_budget: int | None = None, *,
                 live: bool = True, decay_steps: int = 3, peak_window: int = 4) -> None:
        self.budget = budget
        self.live = live
        self.tensor_budget = tensor_budget
        self.decay_steps = decay_steps
        self._peaks: collections.deque[int] = collections.deque(maxlen=peak_window)
        # the most the process held outside the arena during each recent step
        self._outside: collections.deque[int] = collections.deque(maxlen=peak_window)
        self.last: RoomState | None = None
        #: bytes the cache gave back at boundaries, by decay and by the
        #: working-set bound, in all
        self.released_bytes = 0
        #: bytes brought back from swap, in all
        self.swapped_in_bytes = 0
        self._swap_at = -float("inf")   # when swap was last brought back (monotonic s)
        self._swap_cost = 0.0           # and how long it took
        #: whether the arena's budget and cache are this room's to set
        self.manages_arena = False
        self._arena_budget_before: int | None = None   # restored by uninstall_arena
        self._installed_arena = False

    def install_arena(self, sample: Any) -> str | None:
        """Route tensors to memguard's arena with the budget the room leaves
        them (an arena budget set before stays as a cap), and manage it from
        now on. Returns why the arena could not be installed (``None``: it
        serves tensors).

        Raises:
            ValueError: the budget is below what the process holds already
                outside the arena.
        """
        before = int(_C.arena_stats()["budget_bytes"])
        self._arena_budget_before = before
        if arena.installed() and before and self.tensor_budget is None and self.live:
            self.tensor_budget = before
        state = self.measure(sample)
        if self.budget and state.budget_bytes <= state.outside_bytes:
            raise ValueError(
                f"budget {size(state.budget_bytes)} is below what this process already holds "
                f"outside memguard's allocator ({size(state.outside_bytes)}): raise the budget "
                f"(it covers the whole process)")
        self.manages_arena = True
        self.last = state
        try:
            was = arena.installed()
            arena.install(budget=state.arena_budget_bytes or None)
            self._installed_arena = not was
            arena.set_soft(True)   # refused only inside steps (memguard.train.overruns)
        except RuntimeError as exc:   # not ELF, no libc10 imports: run without it
            return str(exc)
        return None

    def uninstall_arena(self) -> None:
        """Undo :meth:`install_arena`: the arena gives tensors back to the
        system allocator if it was installed here, with the budget it had."""
        self.manages_arena = False
        arena.set_soft(False)
        if self._installed_arena:
            arena.uninstall()
            self._installed_arena = False
        if self._arena_budget_before is not None:
            _C.arena_set_budget(self._arena_budget_before)
            self._arena_budget_before = None

    def measure(self, sample: Any) -> RoomState:
        """The room in ``sample`` (a :class:`memguard.Sample`), without
        acting on it. What the process holds outside the arena moves within a
        step (interpreter objects, code paged in): the most it held during
        the recent steps counts (see :meth:`record_step`), and before any
        step, 10 % more than it holds now."""
        live = live_budget(sample, self.budget) if sample is not None and self.live else None
        budget, source = live if live is not None else (int(self.budget or 0), "none")
        foot = _get(sample, "footprint_bytes") or _get(sample, "rss_bytes") or 0
        # the arena's blocks are the arena's, installed or not (blocks and
        # cache outlive an uninstall)
        outside = max(0, foot - _C.arena_stats()["reserved_bytes.current"])
        outside = max(outside, *self._outside) if self._outside else int(outside * 1.1)
        arena = 0
        if budget:
            arena = max(budget - outside, MIN_ARENA_BUDGET)
        if self.tensor_budget:
            arena = min(arena, self.tensor_budget) if arena else self.tensor_budget
        return RoomState(budget_bytes=budget, source=source, footprint_bytes=foot,
                         swap_bytes=_get(sample, "swap_bytes") or 0, outside_bytes=outside,
                         arena_budget_bytes=arena)

    def follow(self, sample: Any, manage_arena: bool) -> RoomState:
        """Measure the room and, when the arena is memguard's to manage, set
        its budget (which releases cache above it at once)."""
        state = self.measure(sample)
        self.last = state
        if manage_arena and arena.installed() and (self.live or self.tensor_budget):
            before = _C.arena_stats()["trimmed_bytes"]
            _C.arena_set_budget(state.arena_budget_bytes)
            self.released_bytes += _C.arena_stats()["trimmed_bytes"] - before
        return state

    def boundary(self, sample: Any, manage_arena: bool) -> RoomState:
        """A step boundary: :meth:`follow`, then age the arena's cache by one
        boundary and bound it by the recent working set."""
        state = self.follow(sample, manage_arena)
        if manage_arena and arena.installed():
            before = _C.arena_stats()["trimmed_bytes"]
            _C.arena_decay(self.decay_steps)
            self._bound_cache()
            st = _C.arena_stats()
            self.released_bytes += st["trimmed_bytes"] - before
            state = dataclasses.replace(state, reserved_bytes=st["reserved_bytes.current"])
            self.last = state
        return state

    def recover_swap(self, level: int) -> int:
        """Fault the process's swapped-out pages back in when there are at
        least 16 MiB and 1 % of the footprint of them, the footprint (swap
        included) fits within 90 % of the budget, pressure is below HIGH,
        and the last time took at most 5 % of the time since. Returns the
        bytes the mappings brought back held in swap (0: nothing done)."""
        st = self.last
        if st is None or not st.budget_bytes or level >= Level.HIGH:
            return 0
        if st.swap_bytes < max(SWAP_MIN, st.footprint_bytes // 100) or \
                st.footprint_bytes > SWAP_FIT * st.budget_bytes:
            return 0
        now = time.monotonic()
        if now - self._swap_at < self._swap_cost / SWAP_SHARE:
            return 0
        try:
            got = _C.swap_in()
        except OSError:   # no smaps here (a sandbox without /proc)
            got = 0
        self._swap_at, self._swap_cost = now, time.monotonic() - now
        self.swapped_in_bytes += got
        return got

    def record_peak(self, peak_bytes: int) -> None:
        """A step's peak of the arena's allocated bytes."""
        if peak_bytes > 0:
            self._peaks.append(int(peak_bytes))

    def record_step(self, outside_peak_bytes: int) -> None:
        """The most the process held outside the arena during a step (its
        footprint less the arena's reserved bytes, over the step's samples)."""
        if outside_peak_bytes > 0:
            self._outside.append(int(outside_peak_bytes))

    def cache_keep(self) -> int | None:
        """The most the arena may keep cached now, by the working-set bound
        (``None`` before any step's peak is known)."""
        if not self._peaks:
            return None
        st = _C.arena_stats()
        bound = int(WORKING_SET_FACTOR * max(self._peaks)) + WORKING_SET_SLACK
        not_cached = st["reserved_bytes.current"] - st["cached_bytes"]
        return max(0, bound - not_cached)

    def _bound_cache(self) -> None:
        keep = self.cache_keep()
        if keep is not None and _C.arena_stats()["cached_bytes"] > keep:
            _C.arena_trim(keep)


def _get(sample: Any, name: str) -> Any:
    if sample is None:
        return None
    return sample.get(name) if isinstance(sample, dict) else getattr(sample, name, None)
