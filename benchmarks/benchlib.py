"""Shared pieces of memguard's benchmark suite.

* :class:`Worker` runs one configuration in its own process (an allocator is
  chosen at process start) and answers commands over a pipe; a benchmark
  times the round trip, a few tens of microseconds on top of the work.
* :func:`serve` is the worker's side of that pipe.
* :class:`Figures` collects each benchmark's figures for the side-by-side
  tables that ``conftest.py`` prints in the terminal summary and stores in
  the pytest-benchmark JSON.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Callable, NoReturn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def median(xs) -> float | None:
    """Median of the values that are not None, or None when there are none."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is not positive."""
    if a is None or b is None or b <= 0:
        return None
    return a / b


def fmt(v: float | None, spec: str = ".2f") -> str:
    """A number formatted, or a dash when it is missing."""
    return "-" if v is None else format(v, spec)


def verdict(value: float | None, target: float, higher_is_better: bool = False) -> str:
    """PASS or OVER (UNDER where higher is better) against a target; '-' when unmeasured."""
    if value is None:
        return "-"
    if higher_is_better:
        return "PASS" if value >= target else "UNDER"
    return "PASS" if value <= target else "OVER"


def share_verdict(part: float | None, whole: float | None, share: float) -> str:
    """PASS when ``part`` is at most ``share`` of ``whole``, else OVER; '-' when
    either is missing. A whole of 0 leaves no room: only a part of 0 passes."""
    if part is None or whole is None:
        return "-"
    return "PASS" if part <= share * whole else "OVER"


# ------------------------------------------------------------------ workers
def pedantic_paired(benchmark, run: Callable[..., Any], baseline: Callable[[], Any],
                    rounds: int, setup: Callable[[], Any] | None = None,
                    teardown: Callable[..., None] | None = None) -> tuple[list, list]:
    """pytest-benchmark rounds of ``run``, each paired with a call of
    ``baseline`` just before it (even rounds, before ``setup``) or just after
    it (odd ones, after ``teardown``), so that neither always runs first.
    ``setup`` and ``teardown`` are pytest-benchmark's. Returns both lists of
    results, in round order."""
    own: list = []
    base: list = []
    k = {"round": -1}

    def paired_setup() -> Any:
        k["round"] += 1
        if k["round"] % 2 == 0:
            base.append(baseline())
        return setup() if setup is not None else None

    def paired_teardown(*args: Any, **kwargs: Any) -> None:
        if teardown is not None:
            teardown(*args, **kwargs)
        if k["round"] % 2 == 1:
            base.append(baseline())

    benchmark.pedantic(lambda *a, **kw: own.append(run(*a, **kw)), setup=paired_setup,
                       teardown=paired_teardown, rounds=rounds)
    return own, base


def paired_median(own: list[float], base: list[float]) -> tuple[list[float], float | None]:
    """The per-round ratios of ``own`` to ``base``, and their median."""
    ratios = [a / b for a, b in zip(own, base)]
    return ratios, median(ratios)


class WorkerError(RuntimeError):
    """The worker process died or answered with an error."""


class Worker:
    """A benchmark configuration in its own process.

    Starts ``python -u SCRIPT --serve ARGS...`` with ``env`` and waits for it
    to say it is ready. :meth:`call` sends one command (a JSON object) and
    returns the answer. The worker's stderr goes to a temporary file, quoted
    when it fails.

    Args:
        script: the benchmark module serving the commands.
        args: its ``--serve`` arguments.
        env: the environment (None: this one); memguard's ``python/`` is put
            first on PYTHONPATH so the worker imports this checkout.
        wait: wait here for the worker to be ready; with False, call
            :meth:`wait_ready` (workers started together start side by side).
    """

    def __init__(self, script: str, args: list[str], env: dict | None = None,
                 wait: bool = True) -> None:
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(ROOT, "python"), HERE] + [p for p in
                                                    env.get("PYTHONPATH", "").split(os.pathsep)
                                                    if p])
        env.setdefault("OMP_NUM_THREADS", "2")
        self.name = " ".join(args)
        self._err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in close())
        self._proc = subprocess.Popen(
            [sys.executable, "-u", script, "--serve", *args], env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err)
        self.ready = self._read() if wait else None

    def wait_ready(self) -> dict:
        """Wait for a worker started with ``wait=False`` to be ready."""
        if self.ready is None:
            self.ready = self._read()
        return self.ready

    def _read(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait(timeout=30)
            raise WorkerError(f"worker {self.name!r} exited with status "
                              f"{self._proc.returncode}:\n{self.stderr_tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerError(f"worker {self.name!r}: {reply['error']}\n{self.stderr_tail()}")
        return reply

    def stderr_tail(self, n: int = 4000) -> str:
        self._err.seek(0)
        return self._err.read()[-n:]

    def call(self, cmd: str, **kw: Any) -> dict:
        """Send ``cmd`` with keyword arguments; return the worker's answer."""
        self._proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self._proc.stdin.flush()
        return self._read()

    def end(self) -> None:
        """Close the worker's stdin, which ends it, without waiting for it
        to exit (:meth:`close` waits): workers ended first exit side by side."""
        try:
            self._proc.stdin.close()
        except OSError:
            pass

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._err.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(setup: Callable[[], dict[str, Callable[..., dict]]]) -> NoReturn:
    """The worker's loop: answer one JSON command per line until stdin closes,
    then end the process.

    ``setup()`` builds the configuration and returns its commands; each
    command is called with the message's other keys and returns a dict.
    Replies go to the original stdout; anything else the process prints goes
    to stderr so it cannot corrupt the replies. Once stdin closes nothing is
    read from the worker any more: it ends at once (status 0), without
    Python's finalization, which takes about a second of CPU once torch is
    imported, a second the benchmark waits for at each :meth:`Worker.close`.
    """
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(reply_fd, "w", buffering=1)
    try:
        commands = setup()
    except Exception as exc:  # reported to the parent, which raises it
        out.write(json.dumps({"error": f"setup failed: {exc!r}"}) + "\n")
        raise
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        msg = json.loads(line)
        name = msg.pop("cmd")
        try:
            reply = commands[name](**msg)
        except Exception as exc:
            out.write(json.dumps({"error": f"{name} failed: {exc!r}"}) + "\n")
            raise
        out.write(json.dumps(reply) + "\n")
    out.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------ figures
Summary = Callable[[list[dict]], "tuple[list[str], dict, dict[str, dict]]"]


class Figures:
    """Figures of every benchmark of the session, by section.

    A benchmark records its figures with :meth:`record`, under its node id;
    each section has a summary function that turns its records into
    ``(lines, data, per_test)``: the table printed in the terminal summary,
    the figures and ratios stored in the JSON under ``"memguard"``, and the
    ratios added to each benchmark's ``extra_info``.
    """

    def __init__(self) -> None:
        self.records: dict[str, list[dict]] = {}
        self.summaries: dict[str, Summary] = {}
        self.titles: dict[str, str] = {}
        self.not_measured: dict[str, str] = {}

    def section(self, name: str, title: str, summary: Summary) -> None:
        self.summaries.setdefault(name, summary)
        self.titles.setdefault(name, title)
        self.records.setdefault(name, [])

    def skip(self, name: str, title: str, reason: str) -> None:
        """A section that cannot be measured here: the summary says why."""
        self.titles.setdefault(name, title)
        self.not_measured[name] = reason

    def record(self, name: str, nodeid: str, figures: dict) -> None:
        self.records[name].append(dict(figures, nodeid=nodeid))

    def summarize(self) -> dict[str, tuple[list[str], dict, dict[str, dict]]]:
        out = {}
        for name in self.titles:
            recs = self.records.get(name, [])
            if recs:
                out[name] = self.summaries[name](recs)
            elif name in self.not_measured:
                why = self.not_measured[name]
                out[name] = ([why], {"measured": False, "reason": why}, {})
        return out


def require_cuda(figures: Figures, section: str, title: str, why: str) -> None:
    """Skip the benchmark (its section saying ``why``) where torch has no
    CUDA device, or no torch at all."""
    import pytest

    try:
        import torch
        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if not available:
        figures.skip(section, title, why)
        pytest.skip(why)
