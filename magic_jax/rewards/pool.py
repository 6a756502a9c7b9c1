"""VerifierPool: worker processes, outside deadlines, recycling, async submit/collect."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from magic_jax.rewards.dispatch import as_item, quick_reward, resolve_ability, route
from magic_jax.rewards.pool_config import RewardsConfig
from magic_jax.rewards.procs import kill_uid, remove_orphan_dirs
from magic_jax.rewards.registry import worker_setup
from magic_jax.rewards.types import RewardItem, RewardResult, RewardStatus

logger = logging.getLogger(__name__)
# Worker warnings already logged by this process (across pools and recycled workers).
_logged_notes: set[str] = set()
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class _Worker:
    slot: int
    proc: subprocess.Popen[bytes]
    conn: Connection
    spawned: float
    ready: bool = False
    ticket: int | None = None
    deadline: float = 0.0
    started: float = 0.0
    items: int = 0


_TMP_PREFIX = "mj-verifier-pool-"


class VerifierPool:
    """A pool of verifier processes with an asynchronous submit/collect API.

    Items are queued by ``submit`` and verified while the caller goes on (for
    example while the sampler is still decoding); ``collect`` blocks until the
    requested results are in. Each item has a wall-clock deadline counted from
    when a worker takes it; a worker that overruns is killed and replaced, and
    the item gets ``TIMEOUT``. Workers are fresh interpreters (never forked
    from the caller, which may hold JAX state), so Math-Verify runs in their
    main thread.

    Use as a context manager; leaving it stops every worker and sandbox::

        with VerifierPool(RewardsConfig(num_workers=8)) as pool:
            tickets = pool.submit_many(items)
            ...  # decode the next batch
            results = pool.collect(tickets)
    """

    def __init__(self, config: RewardsConfig | None = None) -> None:
        self.config = config or RewardsConfig()
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[int, RewardItem, float]] = collections.deque()
        self._results: dict[int, RewardResult] = {}
        self._pending: dict[int, None] = {}  # submitted, not collected; keeps order
        self._next_ticket = 0
        self._workers: list[_Worker | None] = [None] * self.config.workers
        self._closing = False
        self._closed = False
        self._drain = True
        self._broken: str | None = None
        self._start_failures = 0
        # Isolation warnings of the workers' start-up wait for the first code item:
        # a math-only run never runs a sandbox, so they would not matter there.
        self._held_notes: list[str] = []
        self._code_seen = False
        self._stats: collections.Counter[str] = collections.Counter()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._procs: set[subprocess.Popen[bytes]] = set()
        # Sandbox working directories live here, one folder per worker, so
        # that those of a killed worker can be removed.
        # The name holds this process's pid: a later pool removes the folder if this
        # process was killed (SIGKILL) before it could.
        root = self.config.sandbox.tmp_root
        remove_orphan_dirs(root, _TMP_PREFIX)
        self._tmp = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=root)
        os.chmod(self._tmp, 0o711)  # sandbox uids must reach their own directories
        self._finalizer = weakref.finalize(self, _kill_all, self._procs, self._tmp)
        self._thread = threading.Thread(target=self._run, name="verifier-pool", daemon=True)
        self._thread.start()

    # -- public API ---------------------------------------------------------

    def submit(self, item: RewardItem | Mapping[str, Any]) -> int:
        """Queues one item; returns its ticket."""
        return self.submit_many([item])[0]

    def submit_many(self, items: Iterable[RewardItem | Mapping[str, Any]]) -> list[int]:
        """Queues items; returns their tickets in order."""
        parsed = [route(as_item(it), self.config.abilities) for it in items]
        # Items whose verdict is certain without a verifier are decided here: no worker
        # round trip, no CPU taken from the decode.
        verdicts = [quick_reward(it) for it in parsed]
        with self._cond:
            if self._closing:
                raise RuntimeError("VerifierPool is closed")
            if self._broken:
                raise RuntimeError(f"VerifierPool is broken: {self._broken}")
            tickets = []
            for item, verdict in zip(parsed, verdicts):
                ticket = self._next_ticket
                self._next_ticket += 1
                self._pending[ticket] = None
                tickets.append(ticket)
                if verdict is not None:
                    self._finish(ticket, verdict)
                else:
                    self._queue.append((ticket, item, self._deadline_of(item)))
        self._wake()
        return tickets

    def poll(self, ticket: int) -> RewardResult | None:
        """The result of ``ticket`` if it is ready (and then removes it), else None."""
        with self._cond:
            self._check_ticket(ticket)
            if ticket not in self._results:
                return None
            self._pending.pop(ticket)
            return self._results.pop(ticket)

    def collect(
        self, tickets: Sequence[int] | None = None, *, timeout: float | None = None
    ) -> list[RewardResult]:
        """Waits for results and returns them in ticket order.

        Args:
          tickets: which results; ``None`` means every submitted item not yet
            collected.
          timeout: seconds to wait; ``None`` waits as long as needed (every
            item has a deadline, so this ends).

        Raises:
          TimeoutError: not all results arrived in time (they stay collectable).
          KeyError: an unknown or already collected ticket.
        """
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            wanted = list(self._pending) if tickets is None else list(tickets)
            for t in wanted:
                self._check_ticket(t)
            while not all(t in self._results for t in wanted):
                remaining = None if end is None else end - time.monotonic()
                if remaining is not None and remaining <= 0:
                    missing = sum(t not in self._results for t in wanted)
                    raise TimeoutError(f"{missing} of {len(wanted)} results not ready")
                self._cond.wait(remaining)
            for t in wanted:
                self._pending.pop(t)
            return [self._results.pop(t) for t in wanted]

    def map(
        self, items: Iterable[RewardItem | Mapping[str, Any]], *, timeout: float | None = None
    ) -> list[RewardResult]:
        """Verifies items and returns their results in order."""
        return self.collect(self.submit_many(items), timeout=timeout)

    def stats(self) -> dict[str, int]:
        """Counters: results per status, workers started/recycled/killed at deadline/died."""
        with self._cond:
            return dict(self._stats)

    def close(self, *, cancel_pending: bool = False) -> None:
        """Stops the pool and every worker and sandbox process.

        Args:
          cancel_pending: give queued items ``ERROR`` instead of running them
            (running items are always finished or timed out first).
        """
        with self._cond:
            if self._closed:
                return
            self._closing = True
            self._drain = not cancel_pending
            if cancel_pending:
                while self._queue:
                    ticket, _, _ = self._queue.popleft()
                    self._finish(ticket, RewardResult.of(RewardStatus.ERROR, "pool closed"))
        self._wake()
        self._thread.join()
        with self._cond:
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(cancel_pending=exc_type is not None)

    # -- internals ------------------------------------------------------------

    def _deadline_of(self, item: RewardItem) -> float:
        if item.deadline_s is not None:
            return item.deadline_s
        return self.config.deadline_for(resolve_ability(item))

    def _check_ticket(self, ticket: int) -> None:
        if ticket not in self._pending:
            raise KeyError(f"unknown or already collected ticket {ticket}")

    def _wake(self) -> None:
        # Full pipe: a wake-up is already pending; closed: the pool is closing.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _finish(self, ticket: int, result: RewardResult) -> None:
        # Caller holds the lock.
        self._results[ticket] = result
        self._stats[result.status.value] += 1
        self._cond.notify_all()

    def _spawn(self, slot: int) -> None:
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "magic_jax.rewards.worker"]
        proc = subprocess.Popen(
            [*cmd, str(child_sock.fileno()), str(os.getpid()), str(slot)],
            pass_fds=(child_sock.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        child_sock.close()
        conn = Connection(parent_sock.detach())
        sandbox = dataclasses.replace(self.config.sandbox_for(slot), tmp_root=self._slot_dir(slot))
        memory_mb = self.config.worker_memory_mb
        conn.send(("init", self.config.math, sandbox, memory_mb, worker_setup()))
        self._procs.add(proc)
        self._workers[slot] = _Worker(slot, proc, conn, spawned=time.monotonic())
        self._stats["workers_started"] += 1

    def _retire(self, w: _Worker, *, kill: bool) -> None:
        if kill:
            w.proc.kill()
        else:
            try:
                w.conn.send(None)
            except OSError:
                w.proc.kill()
        try:
            w.proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
        w.conn.close()
        self._procs.discard(w.proc)
        self._workers[w.slot] = None

    def _replace(self, w: _Worker, *, kill: bool, failed_start: bool = False) -> None:
        # Caller holds the lock. The replacement starts warming up at once.
        self._retire(w, kill=kill)
        if kill:
            # Without namespaces a killed worker's sandbox can outlive it;
            # its processes all run as this slot's uid.
            self._cleanup_uids([w.slot])
            shutil.rmtree(self._slot_dir(w.slot), ignore_errors=True)
        if failed_start:
            self._start_failures += 1
            if self._start_failures >= 3:
                # Probably a broken environment (e.g. the worker cannot import
                # Math-Verify): fail loudly instead of respawning forever.
                self._broken = "verifier workers keep failing to start"
                self._fail_all(self._broken)
                raise RuntimeError(self._broken)
        if not self._closing:
            self._spawn(w.slot)

    def _slot_dir(self, slot: int) -> str:
        path = os.path.join(self._tmp, f"worker-{slot}")
        os.makedirs(path, exist_ok=True)
        os.chmod(path, 0o711)
        return path

    def _run(self) -> None:
        try:
            for slot in range(len(self._workers)):
                self._spawn(slot)
            self._loop()
        except BaseException as e:  # the pool must never hang its callers
            logger.exception("verifier pool dispatcher failed")
            with self._cond:
                self._broken = f"dispatcher failed: {e!r}"
                self._fail_all(self._broken)
        finally:
            for w in self._workers:
                if w is not None:
                    self._retire(w, kill=w.ticket is not None or not w.ready)
            self._cleanup_uids()
            shutil.rmtree(self._tmp, ignore_errors=True)

    def _fail_all(self, reason: str) -> None:
        while self._queue:
            ticket, _, _ = self._queue.popleft()
            self._finish(ticket, RewardResult.of(RewardStatus.ERROR, reason))
        for w in self._workers:
            if w is not None and w.ticket is not None:
                self._finish(w.ticket, RewardResult.of(RewardStatus.ERROR, reason))
                w.ticket = None

    def _cleanup_uids(self, slots: Iterable[int] | None = None) -> None:
        if os.geteuid() != 0 or self.config.sandbox_uid_base is None:
            return
        for slot in range(len(self._workers)) if slots is None else slots:
            if kill_uid(self.config.sandbox_for(slot).uid):
                logger.info("killed leftover processes of sandbox uid of worker %d", slot)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._dispatch()
                busy = [w for w in self._workers if w is not None and w.ticket is not None]
                if self._closing and not busy and (not self._drain or not self._queue):
                    return
            now = time.monotonic()
            limits = [w.deadline for w in busy]
            limits += [
                w.spawned + self.config.start_timeout_s
                for w in self._workers
                if w is not None and not w.ready
            ]
            timeout = max(0.0, min(limits) - now) if limits else None
            conns = [w.conn for w in self._workers if w is not None]
            for ready in wait([*conns, self._wake_r], timeout):
                if ready == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                w = next(w for w in self._workers if w is not None and w.conn is ready)
                self._receive(w)
            self._enforce_deadlines()

    def _dispatch(self) -> None:
        # Caller holds the lock.
        for slot, w in enumerate(self._workers):
            if w is None:
                if not self._closing or self._queue:
                    self._spawn(slot)
                continue
            if not w.ready or w.ticket is not None or not self._queue:
                continue
            ticket, item, deadline = self._queue.popleft()
            if not self._code_seen and resolve_ability(item) == "code":
                self._code_seen = True
                self._log_notes(self._held_notes)
            try:
                w.conn.send(("item", ticket, item))
            except OSError:
                self._queue.appendleft((ticket, item, deadline))
                self._on_death(w)
                continue
            w.ticket, w.started = ticket, time.monotonic()
            w.deadline = w.started + deadline

    def _receive(self, w: _Worker) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            with self._cond:
                self._on_death(w)
            return
        with self._cond:
            if msg[0] == "ready":
                w.ready = True
                self._start_failures = 0
                if self._code_seen:
                    self._log_notes(msg[2])
                else:
                    self._held_notes += [m for m in msg[2] if m not in self._held_notes]
            elif msg[0] == "result" and w.ticket is not None and msg[1] == w.ticket:
                self._log_notes(msg[3])
                self._finish(w.ticket, msg[2])
                w.ticket = None
                w.items += 1
                if w.items >= self.config.max_items_per_worker:
                    self._stats["workers_recycled"] += 1
                    self._replace(w, kill=False)

    @staticmethod
    def _log_notes(messages: Iterable[str]) -> None:
        for m in messages:
            if m not in _logged_notes:
                _logged_notes.add(m)
                logger.warning("verifier: %s", m)

    def _on_death(self, w: _Worker) -> None:
        # Caller holds the lock.
        code = w.proc.poll()
        if w.ticket is not None:
            self._finish(
                w.ticket, RewardResult.of(RewardStatus.ERROR, f"verifier worker died (exit {code})")
            )
            w.ticket = None
        self._stats["workers_died"] += 1
        logger.warning("verifier worker %d died (exit code %s)", w.slot, code)
        self._replace(w, kill=True, failed_start=not w.ready)

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        with self._cond:
            for w in list(self._workers):
                if w is None:
                    continue
                if w.ticket is not None and now >= w.deadline:
                    elapsed = now - w.started
                    logger.warning(
                        "reward item %d passed its %.1fs deadline; killing worker %d",
                        w.ticket,
                        w.deadline - w.started,
                        w.slot,
                    )
                    self._finish(
                        w.ticket,
                        RewardResult.of(
                            RewardStatus.TIMEOUT, "killed at the pool deadline", elapsed_s=elapsed
                        ),
                    )
                    w.ticket = None
                    self._stats["killed_at_deadline"] += 1
                    self._replace(w, kill=True)
                elif not w.ready and now >= w.spawned + self.config.start_timeout_s:
                    logger.warning("verifier worker %d did not start in time", w.slot)
                    self._replace(w, kill=True, failed_start=True)


def _kill_all(procs: set[subprocess.Popen[bytes]], tmp: str) -> None:
    # Last resort when a pool is garbage-collected or the interpreter exits unclosed.
    for proc in list(procs):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    shutil.rmtree(tmp, ignore_errors=True)
