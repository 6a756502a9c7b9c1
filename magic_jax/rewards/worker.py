"""Verifier worker process: receives items over a socket, verifies them in its main thread."""

# Started by VerifierPool as `python -m magic_jax.rewards.worker <fd> <parent pid>`:
# a fresh interpreter (spawn semantics) that never re-runs the trainer's
# __main__, so it does not import JAX.

from __future__ import annotations

import ctypes
import logging
import os
import resource
import signal
import sys
from multiprocessing.connection import Connection

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _reap_orphans() -> None:
    # As a subreaper this process inherits whatever a sandbox run orphaned.
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


class _Notes(logging.Handler):
    """Collects the verifiers' warnings; they go to the pool with the next message.

    Every worker (and every replacement of a recycled one) probes the same
    machine and would print the same isolation warnings again; the pool logs
    each message once per process, and only once it matters (see
    ``VerifierPool``).
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def drain(self) -> list[str]:
        out, self.messages = self.messages, []
        return out


def serve(conn: Connection) -> None:
    """Runs the worker protocol on ``conn`` until told to stop or the pool goes away."""
    notes = _Notes()
    rewards_log = logging.getLogger("magic_jax.rewards")
    rewards_log.addHandler(notes)
    rewards_log.propagate = False
    kind, math_config, sandbox_config, memory_mb, setup = conn.recv()
    if kind != "init":
        raise RuntimeError(f"expected an init message, got {kind!r}")
    if memory_mb:
        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from magic_jax.rewards.dispatch import compute_reward
    from magic_jax.rewards.math_reward import math_reward
    from magic_jax.rewards.registry import install
    from magic_jax.rewards.sandbox import isolation_plan

    # The rewards registered in the pool's process, imported by reference (registry.py).
    install(setup)

    # Warm up before reporting ready: the first Math-Verify call loads the
    # LaTeX grammar, and the sandbox probes its isolation once per uid.
    math_reward("\\boxed{1}", "1", config=math_config)
    isolation_plan(sandbox_config)
    conn.send(("ready", os.getpid(), notes.drain()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        _, ticket, item = msg
        result = compute_reward(item, math_config=math_config, sandbox_config=sandbox_config)
        _reap_orphans()
        try:
            conn.send(("result", ticket, result, notes.drain()))
        except (BrokenPipeError, OSError):
            return


def main(argv: list[str]) -> None:
    """Entry point: ``argv`` is ``[prog, socket fd, parent pid, slot]``."""
    fd, parent = int(argv[1]), int(argv[2])  # argv[3], the slot, names the process in ps
    libc = ctypes.CDLL(None)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    if os.getppid() != parent:  # the pool died before the death signal was armed
        return
    # The pool stops workers itself; a terminal's Ctrl-C must not kill them mid-item.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    serve(Connection(fd))


if __name__ == "__main__":
    main(sys.argv)
