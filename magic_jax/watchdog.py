"""Progress beats and the step watchdog: a process that stops making progress dumps every
thread's stack to the run directory and ends, and with it the whole job.

The work that moves a run forward calls ``beat`` (a decode chunk, an optimizer
step, a checkpoint completed): two stores, cheap enough for any loop. A
``Watchdog`` (the trainer starts one when ``watchdog_s`` is set) runs a daemon
thread that compares the time of the last beat with its limit; past it, it
writes the stacks of every thread of this process to
``<run>/logs/watchdog-process<k>-<time>.txt`` (``gs://`` included), prints one
line, publishes the failure so the other processes of a multi-host job end too
(``distributed.end_job``) and exits with status ``HUNG_EXIT``: a hung
collective cannot be interrupted from Python, only ended with its process. When
another process fails first, a running watchdog writes this process's stacks the
same way before the failure watcher ends it: where every host was is what tells a
hang apart from the hosts that waited on it.

A test hook, ``MAGIC_JAX_FAULT_AT=hang:WHAT:STEP`` (or ``raise:WHAT:STEP``), makes
the first beat of ``WHAT`` during training step ``STEP`` (``interrupt.at``) sleep
forever (or raise ``RuntimeError``), so tests can hang or fail one host mid-step.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any

from magic_jax import distributed

# Exit status of a process the watchdog ended (what ``timeout`` exits with).
HUNG_EXIT = 124
FAULT_ENV = "MAGIC_JAX_FAULT_AT"

_last = time.monotonic()  # when progress was last made (monotonic seconds)
_what = "start"  # and what it was
_fault = os.environ.get(FAULT_ENV) or None  # read once: beats must stay cheap
_active: Watchdog | None = None


def beat(what: str = "") -> None:
    """Marks progress (a decode chunk, an update micro-batch, a checkpoint completed)."""
    global _last, _what
    _last = time.monotonic()
    _what = what
    if _fault is not None:
        _fault_hook(what)


def idle_s() -> float:
    """Seconds since the last ``beat`` (or since this module was loaded)."""
    return time.monotonic() - _last


def stacks() -> str:
    """Every thread's Python stack, innermost call last, each headed by the thread's name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sorted(sys._current_frames().items()):
        head = f"Thread {names.get(ident, '?')} ({ident})"
        parts.append(f"{head}:\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)


class Watchdog:
    """Ends this process (and its job) when no ``beat`` came for ``timeout_s`` seconds.

    A context manager; one per process: one entered while another runs does
    nothing. A ``timeout_s`` of None does nothing either (``watchdog_s: null``).

    Example:
      with Watchdog(cfg.watchdog_s, cfg.output_dir):
          ...  # the loop, calling beat() as it makes progress

    Args:
      timeout_s: seconds without a beat before it fires, or None (off).
      out_dir: the run directory (local or ``gs://``): the stacks go to its
        ``logs/``; None: stderr only.
      poll_s: how often the thread looks (default a tenth of the limit, at most 5 s);
        it fires between ``timeout_s`` and ``timeout_s + poll_s`` after the last beat.
      exit_code: the status to exit with; None: write the stacks, set ``fired`` and
        stop watching without ending anything (tests).
    """

    def __init__(
        self,
        timeout_s: float | None,
        out_dir: str | os.PathLike | None = None,
        *,
        poll_s: float | None = None,
        exit_code: int | None = HUNG_EXIT,
    ):
        self.timeout_s = timeout_s
        self.out_dir = out_dir
        self.poll_s = poll_s or (min(max(timeout_s / 10, 0.05), 5.0) if timeout_s else 1.0)
        self.exit_code = exit_code
        self.fired: str | None = None  # the report's file (or "" without out_dir) once fired
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        global _active
        if self.timeout_s is None or _active is not None:
            return self
        _active = self
        distributed.watch_failures()  # the other processes' failures end this one too
        distributed.on_peer_failure(self._peer_failed)
        beat("watchdog started")
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        global _active
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=self.poll_s + 1)
        self._thread = None
        distributed.on_peer_failure(self._peer_failed, remove=True)
        _active = None

    def _run(self) -> None:
        assert self.timeout_s is not None
        while not self._stop.wait(self.poll_s):
            idle = idle_s()
            if idle >= self.timeout_s:
                self._fire(idle)
                return

    def _path(self) -> str | None:
        if self.out_dir is None:
            return None
        return f"{str(self.out_dir).rstrip('/')}/logs/{distributed.report_name('watchdog')}"

    def _peer_failed(self, process: int, report: str) -> None:
        """Another process failed (or hung): this one's stacks, for the record."""
        path = self._path()
        if path is not None:
            head = report.splitlines()[0] if report else ""
            distributed.write_report(
                path,
                f"watchdog: process {distributed.process_index()} ended because process "
                f"{process} failed ({head}); idle for {idle_s():.0f}s, the last progress was "
                f"{_what!r}. The stacks of its threads:\n\n{stacks()}",
            )

    def _fire(self, idle: float) -> None:
        k = distributed.process_index()
        report = (
            f"watchdog: process {k} made no progress for {idle:.0f}s (limit {self.timeout_s:g}s); "
            f"the last progress was {_what!r}. The stacks of its threads:\n\n{stacks()}"
        )
        path = self._path()
        end = "stopped watching" if self.exit_code is None else f"ending it (exit {self.exit_code})"
        distributed.stderr_line(
            f"[watchdog] process {k}: no progress for {idle:.0f}s (last: {_what}); every "
            f"thread's stack in {path or 'the report below'}; {end}\n"
            + ("" if path else report + "\n")
        )
        if self.exit_code is not None:
            # a host waiting on a hung one hangs too: each says so with its own status
            distributed.end_job(report, self.exit_code, log_file=path, after_peer=None)
        if path is not None:
            distributed.write_report(path, report)
        self.fired = path or ""


# --------------------------------------------------------------------------- test hook


def _fault_hook(what: str) -> None:
    """``MAGIC_JAX_FAULT_AT=hang:WHAT:STEP`` / ``raise:WHAT:STEP`` (see the module doc)."""
    from magic_jax import interrupt

    kind, _, rest = str(_fault).partition(":")
    want, _, step = rest.rpartition(":")
    if what != want or step != str(interrupt.current_step()):
        return
    distributed.stderr_line(f"[test] {kind} at {time.time():.3f} ({_fault})\n")
    if kind == "raise":
        raise RuntimeError(f"test fault {FAULT_ENV}={_fault}")
    if kind == "hang":
        while True:
            time.sleep(3600)
