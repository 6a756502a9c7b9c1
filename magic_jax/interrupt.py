"""A stop asked of the running job, seen where the work can stop: between decode chunks
and between optimizer steps, not only between training steps.

``rundir.StopSignals`` (SIGINT, SIGTERM) calls ``request``; the rollout driver and
the updater call ``check`` at each chunk / mini-batch, which raises ``Interrupted``
once a stop was asked. Nothing is lost by stopping there: a step's finished groups
are already on disk (``rollout.partial``) and the last checkpoint is whole, so the
trainer catches ``Interrupted``, waits for the writes in flight and exits with the
signal's status; the resumed run redoes only what was not finished.

A module-level flag (one per process), as a signal handler needs: setting it is
a plain store, safe in a handler, and reading it costs a load. In a multi-host
job every process must stop at the same check, or the others would wait in
the next collective for one that left: the first process asked publishes
"stop at check i + 1" in the coordination service and every process stops
there (``distributed.agreed_stop``; the processes run the same checks in the
same order, as they run the same programs).

The crash tests' hook lives here too, where every floor can reach it:
``kill_point`` SIGKILLs the process at a named point of a training step
(``MAGIC_JAX_KILL_AT``); the rollout names its point without being told the step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

STOP_AT_ENV = "MAGIC_JAX_STOP_AT"
# Test hook: ``MAGIC_JAX_KILL_AT=point:step`` makes the process SIGKILL itself when the
# named point of that training step is reached (``kill_point``), so a test can crash a
# run at a known place.
KILL_AT_ENV = "MAGIC_JAX_KILL_AT"

_requested = 0
_step = -1  # the training step running (``at``), for the test hook
_checks = 0  # checks so far: the same sequence on every process of a multi-host job
_deferred = 0  # inside ``deferred()``: checks count and agree, but do not raise
_seen: dict[tuple[str, int], int] = {}


class Interrupted(Exception):
    """A stop was asked (``signum``) while ``where`` was running."""

    def __init__(self, signum: int, where: str):
        super().__init__(f"stop asked (signal {signum}) during {where}")
        self.signum = signum
        self.where = where


def request(signum: int) -> None:
    """Asks the job to stop at its next check (from a signal handler or any thread)."""
    global _requested
    _requested = int(signum) or 1


def requested() -> int:
    """The signal number of the pending stop, or 0."""
    return _requested


def clear() -> None:
    global _requested
    _requested = 0


def at(step: int) -> None:
    """Says which training step runs now (for ``MAGIC_JAX_STOP_AT``)."""
    global _step
    _step = int(step)


def current_step() -> int:
    """The training step ``at`` last named (-1 before the first)."""
    return _step


def kill_point(name: str, step: int | None = None) -> None:
    """SIGKILLs this process if ``MAGIC_JAX_KILL_AT`` is ``name:step`` (a test hook).

    ``step`` defaults to the training step ``at`` set (none outside training), so the
    work a step runs (its rollout's samples) can name its point without knowing it.
    """
    want = os.environ.get(KILL_AT_ENV)
    if want and want == f"{name}:{_step if step is None else step}":
        os.kill(os.getpid(), signal.SIGKILL)


def check(where: str) -> None:
    """Raises ``Interrupted`` when a stop is pending.

    A test hook: with ``MAGIC_JAX_STOP_AT=where:step:n`` the process sends itself a
    SIGTERM at the n-th check of ``where`` (``rollout``: a decode chunk; ``update``: an
    optimizer step) during training step ``step``, and prints when, so a test can time
    the exit from that moment.

    Raises:
      Interrupted: a stop was asked; ``where`` names the work it stopped.
    """
    want = os.environ.get(STOP_AT_ENV)
    if want:
        key = (where, _step)
        _seen[key] = _seen.get(key, 0) + 1
        if want == f"{where}:{_step}:{_seen[key]}":
            sys.stderr.write(f"[test] SIGTERM at {time.time():.3f} ({want})\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGTERM)
            # The handler runs in the main thread, which may be inside a compiled update
            # (overlap mode: this check is the rollout thread's); wait for it, so the stop
            # lands at this check whatever the load, as a signal from outside would once
            # the handler ran.
            deadline = time.monotonic() + 30.0
            while not _requested and time.monotonic() < deadline:
                time.sleep(0.01)
    global _checks
    _checks += 1
    from magic_jax import distributed

    stop = distributed.agreed_stop(_checks, _requested)
    if stop and not _deferred:
        raise Interrupted(stop, where)


@contextlib.contextmanager
def deferred():
    """Work that a stop must not cut short (nothing would keep it): inside, ``check``
    never raises; the stop stays pending for the loop's next safe point."""
    global _deferred
    _deferred += 1
    try:
        yield
    finally:
        _deferred -= 1
