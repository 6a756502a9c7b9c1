"""Multi-host runs: the few host-side agreements an SPMD training loop needs between processes.

Under ``jax.distributed`` every process runs the same Python program and the
same jitted programs with the same shapes. Device data moves by XLA's
collectives; what this module moves is the host-side data the processes must
agree on before they can issue identical programs: each host's slice of a
step's prompts (token ids, uids), the rewards its verifiers computed, process
0's choice of checkpoint, and whether any process was asked to stop. Every
function here is a collective when ``jax.process_count() > 1`` (all processes
must call it, in the same order) and a plain no-op copy in a single process,
so single-process code paths run unchanged.

They also agree that the job has failed. A process that fails (an exception,
the step watchdog) publishes its report in the coordination service's
key-value store (``end_job``) before it exits; a thread on every process
(``watch_failures``) reads that store each second and ends its own process
when another one failed, since a thread cannot interrupt a collective its main
thread is blocked in. A process killed outright publishes nothing: JAX's
coordination service notices its missing heartbeats (``initialize_options``)
and ends the others itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypedDict

import numpy as np


def process_count() -> int:
    """The number of processes of the job (1 without ``jax.distributed``)."""
    import jax

    return jax.process_count()


def is_primary() -> bool:
    """Whether this is process 0, the one that writes the run directory's records."""
    import jax

    return jax.process_index() == 0


def _allgather(x: np.ndarray) -> np.ndarray:
    """[P, *x.shape]: every process's ``x`` (same shape and dtype everywhere), by process."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def broadcast_int(value: int) -> int:
    """Process 0's ``value`` on every process.

    Used where one process decides for all (the checkpoint to resume from:
    only process 0 verifies checksums and sets bad checkpoints aside, and the
    others must not list the directory while it moves them).
    """
    if process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.asarray(value, np.int32)))


def max_int(value: int) -> int:
    """The largest of the processes' ``value`` on every process (e.g. a stop signal's number).

    A SIGTERM reaches the hosts of a pod at slightly different times; a process
    that stopped alone would leave the others waiting in its next collective.
    """
    if process_count() == 1:
        return int(value)
    return int(_allgather(np.asarray([value], np.int32)).max())


def preemption_notice(step: int) -> bool:
    """True on every process when JAX's preemption service says to stop at ``step``.

    ``reached_preemption_sync_point`` answers True on all hosts at the same step
    once a notifier has fired. Open-source TSL registers one notifier only, on
    SIGTERM, and the trainer's own SIGTERM handler (``interrupt``) replaces it:
    in practice a preemption or maintenance stop arrives as that SIGTERM and
    ``agreed_stop`` stops every host. This answers True only under a runtime that
    registers another notifier; without the service (one process, CPU) it is
    always False.
    """
    from jax._src import distributed as jax_distributed

    if getattr(jax_distributed.global_state, "preemption_sync_manager", None) is None:
        return False
    from jax.experimental import multihost_utils

    return bool(multihost_utils.reached_preemption_sync_point(step))


# what process 0 broadcasts when its ``on_primary`` function raised
_PRIMARY_FAILED = -(2**31)


def on_primary(fn: Callable[[], int]) -> int:
    """Runs ``fn`` on process 0 only; every process returns its result.

    For what one process decides for all (claiming and locking the run
    directory, choosing the checkpoint to resume from). It is also a barrier:
    no process goes on before process 0 has finished ``fn``.

    Args:
      fn: returns an int in [-2**31 + 1, 2**31).

    Raises:
      Whatever ``fn`` raised, on process 0; ``ProcessError`` on the others,
      which must not wait for a process that has given up.
    """
    if process_count() == 1:
        return fn()
    if not is_primary():
        value = broadcast_int(0)
        if value == _PRIMARY_FAILED:
            raise ProcessError("process 0 stopped with an error (its log says which)")
        return value
    try:
        value = fn()
    except BaseException:
        broadcast_int(_PRIMARY_FAILED)
        raise
    return broadcast_int(value)


class ProcessError(ValueError):
    """Another process of a multi-host run failed; this one stops too."""


def allgather_ragged(arrays: Sequence[np.ndarray], dtype: np.dtype | type) -> list[np.ndarray]:
    """Every process's list of 1-D arrays, concatenated in process order.

    The lists may differ in length from process to process and the arrays in
    size. Three small collectives: counts, sizes, padded data.

    Args:
      arrays: this process's arrays [n_i] (any n_i, possibly none).
      dtype: their dtype, the same on every process; 32 bits or less (jax
        without x64 would narrow wider ones).

    Returns:
      The arrays of process 0, then process 1's, ... (exact copies, ``dtype``).
    """
    dtype = np.dtype(dtype)
    if dtype.itemsize > 4:
        raise ValueError(f"allgather_ragged: {dtype} is wider than 32 bits")
    arrays = [np.asarray(a, dtype).reshape(-1) for a in arrays]
    if process_count() == 1:
        return [a.copy() for a in arrays]
    counts = _allgather(np.asarray([len(arrays)], np.int32))[:, 0]
    n = max(int(counts.max()), 1)
    sizes = np.zeros(n, np.int32)
    sizes[: len(arrays)] = [len(a) for a in arrays]
    all_sizes = _allgather(sizes)  # [P, n]
    width = max(int(all_sizes.max()), 1)
    data = np.zeros((n, width), dtype)
    for i, a in enumerate(arrays):
        data[i, : len(a)] = a
    all_data = _allgather(data)  # [P, n, width]
    return [
        all_data[p, i, : all_sizes[p, i]].copy()
        for p in range(len(counts))
        for i in range(int(counts[p]))
    ]


def allgather_strings(strings: Sequence[str]) -> list[str]:
    """Every process's strings (e.g. prompt uids), concatenated in process order."""
    if process_count() == 1:
        return list(strings)
    raw = [np.frombuffer(s.encode("utf-8"), np.uint8) for s in strings]
    return [bytes(a).decode("utf-8") for a in allgather_ragged(raw, np.uint8)]


# --------------------------------------------------------------------------- stops

_STOP = "magic_jax/stop"
_stop_at: tuple[int, int] | None = None  # (signal, check) once the job's stop is known


def agreed_stop(check: int, local: int) -> int:
    """The signal to stop with at this process's ``check``-th stop check (0: go on).

    In one process, ``local`` (the pending signal) itself. In a multi-host job the
    first process with a pending signal publishes ``signal:check+1`` (creating
    the key only if absent), and every process stops once its own count reaches
    that check: a process can be at most one check ahead of another (each check
    sits between collectives), so the one that published has not yet left the
    collective before it, and no process waits for one that stopped.
    """
    global _stop_at
    client = _client()
    if client is None:
        return local
    if _stop_at is None:
        if local:
            with contextlib.suppress(Exception):  # another process published first
                client.key_value_set(_STOP, f"{local}:{check + 1}")
        try:
            value = client.key_value_try_get(_STOP)
        except Exception:  # not published
            value = None
        if value:
            sig, at = value.split(":")
            _stop_at = (int(sig), int(at))
    return _stop_at[0] if _stop_at is not None and check >= _stop_at[1] else 0


# --------------------------------------------------------------------------- failures

# Seconds without a heartbeat after which JAX's coordination service declares a process
# dead and ends every other one (a process killed with SIGKILL, a lost host).
HEARTBEAT_ENV = "MAGIC_JAX_HEARTBEAT_S"
HEARTBEAT_S = 60
# Exit status of a process ended because another process of its job failed.
PEER_FAILED_EXIT = 3
POLL_S = 1.0  # how often each process reads the failures published
ACK_S = 5.0  # how long a failing process 0 (the service's host) waits for the others to read
END_S = 60.0  # the most a failing process spends on its report before it exits anyway
REPORT_CHARS = 64_000  # the tail of a report kept in the store (a traceback's end matters)
_FAILED = "magic_jax/failed/"
_SEEN = "magic_jax/seen/"

_ending = False  # this process is ending after its own failure (the watcher stands aside)
_watcher: threading.Thread | None = None
_stop_watch = threading.Event()
# called with (the failed process, its report) before the watcher ends this process
_on_peer_failure: list[Callable[[int, str], None]] = []


class InitializeOptions(TypedDict):
    heartbeat_timeout_seconds: int


def initialize_options() -> InitializeOptions:
    """``jax.distributed.initialize``'s timeouts for a run that must not hang.

    ``heartbeat_timeout_seconds`` bounds how long the other processes outlive one
    killed outright (``$MAGIC_JAX_HEARTBEAT_S``, default 60 s; JAX's own default is
    100 s). Processes that fail in Python end the others within ``POLL_S``.
    """
    return {"heartbeat_timeout_seconds": int(os.environ.get(HEARTBEAT_ENV) or HEARTBEAT_S)}


def _client() -> Any:
    """JAX's coordination-service client of a multi-process job, else None (jax not
    imported, not distributed, or a single process)."""
    jd = sys.modules.get("jax._src.distributed")
    state = getattr(jd, "global_state", None)
    if state is None or state.client is None or state.num_processes < 2:
        return None
    return state.client


def running() -> bool:
    """Whether this process is one of several under ``jax.distributed`` (imports no JAX)."""
    return _client() is not None


def process_index() -> int:
    """This process's index in its job (0 without ``jax.distributed``; imports no JAX)."""
    jd = sys.modules.get("jax._src.distributed")
    return int(getattr(getattr(jd, "global_state", None), "process_id", 0) or 0)


def failed_processes() -> dict[int, tuple[str, str]]:
    """The processes that published a failure: (report file name or "", report) each
    ({} in one process)."""
    client = _client()
    if client is None:
        return {}
    out = {}
    for key, value in client.key_value_dir_get(_FAILED):
        name, _, report = value.partition("\n")
        out[int(key.rsplit("/", 1)[1])] = (name, report)
    return out


def stderr_line(text: str) -> None:
    """Writes ``text`` to stderr at once (os.write: safe from any thread, never raises)."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode("utf-8", "replace"))


def write_report(path: Any, text: str) -> bool:
    """Writes a failure report (local or ``gs://``); False, with a line on stderr, if it
    could not be written (the report is on stderr and in the store as well)."""
    from magic_jax import storage

    try:
        p = storage.path(path)
        if not storage.is_gcs(p):
            p.parent.mkdir(parents=True, exist_ok=True)
        storage.write_text(p, text)
        return True
    except Exception as e:  # a report must never raise over the failure it reports
        stderr_line(f"[failure] could not write {path}: {e}\n")
        return False


def report_name(kind: str) -> str:
    """``<kind>-process<k>-<UTC time>.txt``: a report's file name under the run's ``logs/``."""
    return f"{kind}-process{process_index()}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.txt"


def _exit_later(code: int) -> None:
    """Exits with ``code`` in ``END_S`` seconds whatever this process is doing then (a
    report written to a bucket that does not answer must not hang a failing process)."""
    timer = threading.Timer(END_S, os._exit, (code,))
    timer.daemon = True
    timer.start()


def _exit(code: int) -> NoReturn:
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    os._exit(code)


def end_job(
    report: str,
    code: int,
    *,
    log_file: Any | Callable[[], Any] = None,
    after_peer: int | None = PEER_FAILED_EXIT,
) -> NoReturn:
    """Ends this process after its own failure, and with it every process of the job.

    In a multi-process job the report is published first (every other process
    ends within ``POLL_S``), then written to ``log_file``; process 0, whose
    process hosts the coordination service, waits up to ``ACK_S`` for the others
    to have read it. The process then exits at once, without JAX's shutdown
    barrier (which would wait for processes blocked in a collective). In one
    process it writes ``log_file`` and exits.

    Args:
      report: what happened (a traceback, the watchdog's stacks).
      code: this process's exit status (nonzero).
      log_file: where the report goes too (under the run's ``logs/``), or None, or
        a function that returns it (asked under the ``END_S`` bound).
      after_peer: the exit status instead of ``code`` when another process had
        failed first (this failure is then likely its consequence: a broken
        collective); None keeps ``code``.
    """
    global _ending
    _ending = True
    _exit_later(code)
    if callable(log_file):
        try:
            log_file = log_file()
        except Exception as e:
            stderr_line(f"[failure] no run directory for the report: {e}\n")
            log_file = None
    client, me = _client(), process_index()
    earlier: dict[int, tuple[str, str]] = {}
    if client is not None:
        # the report's file name first: process 0 writes the report there too
        name = "" if log_file is None else str(log_file).rstrip("/").rsplit("/", 1)[-1]
        try:
            earlier = {p: r for p, r in failed_processes().items() if p != me}
            value = f"{name}\n{report[-REPORT_CHARS:]}"
            client.key_value_set(_FAILED + str(me), value, allow_overwrite=True)
        except Exception as e:
            stderr_line(f"[failure] could not publish this failure: {e}\n")
    if log_file is not None:
        write_report(log_file, report)
    if earlier:
        code = code if after_peer is None else after_peer
        stderr_line(
            f"[failure] process {min(earlier)} had failed before this one (its log says why); "
            f"exit {code}\n"
        )
    if client is not None and me == 0:
        _wait_for_others(client)
    _exit(code)


def _wait_for_others(client: Any) -> None:
    """Keeps process 0 (and the service) up until every other process read the failure."""
    n = int(sys.modules["jax._src.distributed"].global_state.num_processes)
    deadline = time.monotonic() + ACK_S
    while time.monotonic() < deadline:
        try:
            seen = {k.rsplit("/", 1)[1] for k, _ in client.key_value_dir_get(_SEEN)}
            seen |= {str(p) for p in failed_processes()}
        except Exception:
            return
        if all(str(p) in seen for p in range(1, n)):
            return
        time.sleep(POLL_S / 4)


def watch_failures(log_dir: Callable[[], Any] | None = None, *, poll_s: float = POLL_S) -> bool:
    """Starts this process's failure watcher (once); returns whether it runs.

    A daemon thread reads the published failures every ``poll_s`` seconds. When
    another process failed, it prints that process's report to stderr (so every
    host's log holds it), process 0 writes it under ``log_dir()`` as well (the file
    the failing process named) when that gives a directory, and it ends this
    process with ``PEER_FAILED_EXIT`` (``os._exit``: the main thread may be
    blocked in a collective). It stops before JAX's own shutdown at a normal
    exit. Does nothing in one process.

    Args:
      log_dir: returns the run's ``logs/`` directory, or None while there is none.
      poll_s: seconds between reads.
    """
    global _watcher
    client = _client()
    if client is None:
        return False
    if _watcher is not None:
        return True
    import atexit

    _stop_watch.clear()
    _watcher = threading.Thread(
        target=_watch, args=(client, log_dir, poll_s), name="failure-watch", daemon=True
    )
    _watcher.start()
    atexit.register(_stop_watch.set)  # runs before JAX's shutdown (registered earlier)
    return True


def _watch(client: Any, log_dir: Callable[[], Any] | None, poll_s: float) -> None:
    me = process_index()
    n = int(sys.modules["jax._src.distributed"].global_state.num_processes)
    while not _stop_watch.wait(poll_s):
        try:
            failed = {p: r for p, r in failed_processes().items() if p != me}
        except Exception:  # the service unreachable: its heartbeats decide, not this thread
            continue
        if not failed or _ending or _stop_watch.is_set():
            continue
        _exit_later(PEER_FAILED_EXIT)
        first = min(failed)
        stderr_line(
            f"[failure] process {first} of {n} failed; ending process {me} "
            f"(exit {PEER_FAILED_EXIT}). Its report:\n{failed[first][1].rstrip()}\n"
        )
        where = None
        if me == 0 and log_dir is not None:
            with contextlib.suppress(Exception):
                where = log_dir()
        if where is not None:  # the failing host's own write may not have reached it
            for name, report in failed.values():
                if name:
                    write_report(f"{str(where).rstrip('/')}/{name}", report)
        with contextlib.suppress(Exception):
            client.key_value_set(_SEEN + str(me), "1", allow_overwrite=True)
        for fn in list(_on_peer_failure):
            with contextlib.suppress(Exception):
                fn(first, failed[first][1])
        _exit(PEER_FAILED_EXIT)


def on_peer_failure(fn: Callable[[int, str], None], *, remove: bool = False) -> None:
    """Registers (or removes) ``fn(process, report)``, called before the failure watcher
    ends this process because ``process`` failed (the step watchdog writes this host's
    stacks there: where each host was matters when one hung)."""
    if remove:
        with contextlib.suppress(ValueError):
            _on_peer_failure.remove(fn)
    else:
        _on_peer_failure.append(fn)
