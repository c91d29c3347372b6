"""Signals held while a step commits or rolls back.

A Python signal handler (Ctrl-C's ``KeyboardInterrupt``, a ``SIGTERM``
handler that calls ``sys.exit``, a scheduler's ``SIGUSR1``) runs in the main
thread between two bytecodes, wherever the script happens to be. Landing
inside ``optimizer.step()``, it would leave some parameters updated and
others not; landing between the update and the guard's count of it, a
committed step that the guard does not count. :class:`held` closes those
windows: inside it, every signal that has a Python handler is recorded
instead of handled, and the handlers run, in arrival order, as the block
ends (after the commit, or after the roll back). A signal that arrives a
second time while held is handled at once: a user who presses Ctrl-C twice
gets out even of a commit that hangs. A handler installed during the block
that chains to the one it found (the block's) reaches the original one.

Signals are only held in the main thread (the only one Python runs signal
handlers in: a step on another thread is never interrupted by one). Signals
whose action is the kernel's (``SIG_DFL`` of ``SIGTERM`` or ``SIGKILL``)
end the process and are not held: there is no state left to keep. The
``_signal`` functions are used directly: ``signal``'s wrappers turn every
number into an enum, ten times the cost, and this runs at every step.
"""
from __future__ import annotations

import _signal
import signal
import sys
import threading
from types import TracebackType

#: every signal a handler can be set for (SIGKILL and SIGSTOP cannot have one)
_SIGNALS = tuple(sorted(int(s) for s in signal.valid_signals()
                        if s not in (signal.SIGKILL, signal.SIGSTOP)))


class held:
    """A block during which signals with Python handlers wait (see the
    module docs). Re-entrant: an inner block hands what it held to the
    outer one, which delivers it when it ends."""

    def __init__(self) -> None:
        self._saved: dict[int, object] = {}     # the handlers swapped out, while held
        self._handlers: dict[int, object] = {}  # the same, once put back
        self._pending: list[int] = []
        self._over = False                      # the block ended
        self._hold = self._record               # one bound method, compared by identity

    def __enter__(self) -> held:
        if threading.current_thread() is not threading.main_thread():
            return self
        try:
            for s in _SIGNALS:
                h = _signal.getsignal(s)
                if callable(h):
                    self._saved[s] = h
                    _signal.signal(s, self._hold)
        except BaseException:              # a signal before every handler was swapped
            self._put_back()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._put_back()
        self._deliver()

    def _record(self, signum: int, frame: object) -> None:
        if self._over:                     # a handler set meanwhile kept ours to chain to
            self._forward(signum, frame)
            return
        if signum in self._pending:        # the second one: the user insists
            self._put_back()
            self._deliver()
            self._forward(signum, frame)   # (an outer block, holding too, sees it twice)
            return
        self._pending.append(signum)

    def _put_back(self) -> None:
        saved, self._saved = self._saved, {}
        for s, h in saved.items():
            if _signal.getsignal(s) is self._hold:
                _signal.signal(s, h)
        self._handlers.update(saved)
        self._over = True
        self._hold = None    # the bound method held self: no cycle left for gc each step

    def _forward(self, signum: int, frame: object) -> None:
        h = self._handlers.get(signum)
        if callable(h):
            h(signum, frame)

    def _deliver(self) -> None:
        """Run the held signals' handlers, each once, in arrival order; the
        first exception one raises comes out of the block after the others
        ran."""
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for s in pending:
            try:
                self._forward(s, sys._getframe(1))
            except BaseException as exc:   # noqa: BLE001 - each handler runs, the first error wins
                error = error or exc
        if error is not None:
            raise error
