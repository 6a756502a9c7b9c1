"""The run directory's lock for the life of a run: an flock locally, a renewed lease
object on Cloud Storage; ``run_directory`` claims the directory and locks it.

On Cloud Storage no two processes may write as holders at once, whatever their
wall clocks say. Every write of the lease object is conditional on the
generation last seen; a waiter counts a lease as ended only when the object's
generation has not changed for a whole lease on the waiter's own monotonic
clock, started when it first read that generation; the holder stops writing
earlier than that: a lease less a margin after it sent its last renewal that
succeeded, on its own monotonic clock. ``check_fence`` is that stop: the run's
writes call it first, and it raises ``LockLost`` (exit status 75) once the
lease may have ended or another process owns the object (``GcsRunLock`` says
how, and what a fence cannot cover).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from magic_jax import storage
from magic_jax.run import fence
from magic_jax.run.fence import check_fence as check_fence  # re-exported: the writers' fence
from magic_jax.run.rundir import LOCK, RunDirError, claim_run_dir, now, stderr_line

if TYPE_CHECKING:
    from google.cloud.storage import Blob  # read as Any: google-cloud-storage ships no types

    from magic_jax.run.rundir import JSON


class RunLock:
    """An exclusive lock on a run directory for the life of this process.

    The lock is an ``flock`` on ``DIR/.lock``, whose text names the holder
    (pid, host, start time). The kernel drops an ``flock`` when its process
    ends however it ends, so a killed run never leaves a lock that blocks the
    next one.

    Example:
      with RunLock(out):
          ...  # only this process runs in ``out``

    Raises (on enter):
      RunDirError: another live process holds the lock; the message names it.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path) / LOCK
        self._fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"{self.path}: cannot create the run lock: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise RunDirError(
                f"{self.path.parent}: another run is using this directory ({holder})"
            ) from None
        except OSError as e:
            os.close(fd)
            raise RunDirError(f"{self.path}: cannot lock the run directory: {e.strerror}") from None
        text = f"pid {os.getpid()} on {socket.gethostname()} since {now()}\n".encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, text, 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            # The lock file stays: removing it would let a waiting process lock a file
            # another one is about to create anew.
            os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


LEASE_ENV = "MAGIC_JAX_LOCK_LEASE_S"


LEASE_S = 120.0

# A holder stops writing this fraction of a lease before the earliest moment another
# process could take its lease: room for a write already past the fence to land, and for
# the two machines' monotonic clocks to run at slightly different rates.
MARGIN = 0.25

# Exit status of a process that lost its run lock (another process took the run over, or
# its lease could not be renewed in time): EX_TEMPFAIL, "try again later".
LOST_LOCK_EXIT = 75


class LockLost(RunDirError):
    """This process no longer holds its run lock (taken over, or its lease may have ended):
    it must write nothing more into the run directory; commands exit with status 75."""


class GcsRunLock:
    """The run lock of a ``gs://`` run directory: a lease held in the object ``DIR/.lock``.

    The object holds the owner (a random token, pid, host, start time) and the
    lease length. It is created only if absent (``ifGenerationMatch=0``); a
    thread renews it every third of the lease, each write conditional on the
    generation this holder wrote last, so after a takeover every write of the
    old holder fails.

    Expiry is judged without comparing wall clocks. A waiter reads the object
    and notes the generation and the time it read it on its own monotonic
    clock; that read returned after the generation was written, so after the
    writer had sent it. If the generation is the same a lease later (by the
    waiter's clock; the longer of its own lease and the one the object
    states), the holder has not renewed for at least a lease, and the waiter
    takes over with a write conditional on that generation (of two
    waiters, one wins). A new generation while it waits means the holder is
    alive: the new run is refused (within a third of the lease). A skewed wall
    clock changes none of this.

    The holder, for its part, stops writing ``1 - MARGIN`` of a lease after it
    sent its last renewal that succeeded (its own monotonic clock), which is
    before any waiter can have watched that generation for a lease:
    ``check_fence`` raises ``LockLost`` from then on, and the renewal thread
    (whose requests time out by then) ends the process with status 75. It
    does the same at once when a renewal finds another owner in the object.
    A renewal that reached the server but whose reply was lost comes back 412
    on the retry; an object that still names this owner is then this holder's
    own write, not a takeover.

    What it cannot stop: a write that passed the fence and is still in flight
    (or a process paused between the fence and its write for longer than the
    margin) may land after a takeover. ``check_fence(..., server=True)`` right
    before a commit-point write narrows that to the write itself.

    A resume after ``kill -9`` waits one lease (``MAGIC_JAX_LOCK_LEASE_S``,
    default 120 s); a run that ends normally or on a signal deletes the object.

    Args:
      path: the run directory (``gs://...``).
      lease_s: the lease length (default ``$MAGIC_JAX_LOCK_LEASE_S`` or 120).
      exit_on_loss: end the process (status 75) when the lock is lost; tests
        that hold a lock in their own process pass False (``check_fence`` raises).

    Raises (on enter):
      RunDirError: another live run holds the lock; the message names it.
    """

    def __init__(
        self, path: storage.StoragePath, *, lease_s: float | None = None, exit_on_loss: bool = True
    ):
        self.uri = str(path).rstrip("/") + "/" + LOCK
        self.lease_s = float(lease_s or os.environ.get(LEASE_ENV) or LEASE_S)
        self.exit_on_loss = exit_on_loss
        self._owner = f"{os.getpid()}-{os.urandom(6).hex()}"
        self._generation: int | None = None
        self._since = now()
        # monotonic send time of the last write known to hold (the lease runs from it),
        # and of the first write sent since then whose outcome is not known
        self._renewed_at = -math.inf
        self._unconfirmed_since: float | None = None
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def _dir(self) -> str:
        return self.uri.rsplit("/", 1)[0]

    def _deadline(self) -> float:
        """Monotonic time after which this holder writes nothing more."""
        return self._renewed_at + self.lease_s * (1 - MARGIN)

    def _blob(self) -> Blob:
        bucket, key = storage.split(self.uri)
        return storage.client().bucket(bucket).blob(key)

    def _body(self) -> bytes:
        return json.dumps(
            {
                "owner": self._owner,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": self._since,
                "lease_s": self.lease_s,
                # for people (and older versions); expiry is never judged by a wall clock here
                "expires": time.time() + self.lease_s,
            }
        ).encode()

    def _read(self, timeout: float | None = None) -> tuple[int | None, JSON]:
        """(generation, holder) of the lock object; (None, {}) when there is none."""
        blob = self._blob()
        kw = {} if timeout is None else {"timeout": timeout, "retry": None}
        try:
            data = blob.download_as_bytes(**kw)
        except Exception as e:
            if getattr(e, "code", None) == 404:
                return None, {}
            raise
        try:
            holder = json.loads(data)
        except ValueError:
            holder = {}
        return blob.generation, holder if isinstance(holder, dict) else {}

    def _write(self, if_generation: int, timeout: float | None = None) -> bool:
        """Writes this owner's lease if the object's generation is ``if_generation`` (0:
        absent); False when another process changed it first.

        ``timeout`` bounds the one request (no retries: the renewal thread retries);
        without it the client's retries apply.
        """
        import google.api_core.exceptions as gex

        sent = time.monotonic()
        if self._unconfirmed_since is None:
            self._unconfirmed_since = sent
        blob = self._blob()
        kw = {} if timeout is None else {"timeout": timeout, "retry": None}
        try:
            blob.upload_from_string(self._body(), if_generation_match=if_generation, **kw)
        except gex.PreconditionFailed:
            # A write of ours whose reply was lost may have landed: its retry sees 412 on
            # an object that names this owner. Its lease runs from the earliest send.
            gen, holder = self._read(timeout)
            if gen is None or holder.get("owner") != self._owner:
                return False
            self._generation = gen
            self._renewed_at = self._unconfirmed_since
            self._unconfirmed_since = None
            return True
        # this request succeeded on the generation we last wrote: no earlier send landed
        self._generation = blob.generation
        self._renewed_at = sent
        self._unconfirmed_since = None
        return True

    def acquire(self) -> None:
        seen: tuple[int, float] | None = None  # generation, monotonic time first read
        while True:
            gen, holder = self._read()
            read_at = time.monotonic()  # after the reply: after the holder sent that write
            if gen is None:
                if self._write(0):
                    break
                continue
            if seen is not None and gen != seen[0]:
                raise RunDirError(
                    f"{self._dir}: another run is using this directory "
                    f"({_holder(holder)}; it renewed its lease while this one waited)"
                )
            lease = max(self.lease_s, _number(holder.get("lease_s")))
            if seen is None:
                seen = (gen, read_at)
                stderr_line(
                    f"[lock] {self.uri} is held ({_holder(holder)}); waiting up to "
                    f"{lease:.0f} s to see whether its owner is alive\n"
                )
            elif read_at - seen[1] >= lease:
                if self._write(gen):
                    break
                seen = None  # another waiter won the race: watch the new owner
                continue
            time.sleep(min(max(0.05, lease / 12), max(0.05, seen[1] + lease - read_at)))
        self._thread = threading.Thread(target=self._renew, name="run-lock-lease", daemon=True)
        self._thread.start()
        fence.hold(self)

    def check(self, what: str, *, server: bool = False) -> None:
        """``check_fence`` for this lock."""
        import google.api_core.exceptions as gex

        while self._lost is None and server and (left := self._deadline() - time.monotonic()) > 0:
            try:  # the bucket unanswering: ask again until the lease may have ended
                gen, holder = self._read(timeout=max(0.1, min(left, self.lease_s / 3)))
            except (OSError, gex.ServerError, gex.TooManyRequests):  # requests' errors are OSErrors
                time.sleep(max(0.0, min(self._deadline() - time.monotonic(), self.lease_s / 12)))
                continue
            if gen is None or holder.get("owner") != self._owner:  # naming us: ours
                self._lost = "another process took over this run"
            break
        if self._lost is None and time.monotonic() >= self._deadline():
            self._lost = self._unrenewed()
        if self._lost is not None:
            raise LockLost(
                f"{self._dir}: not writing {what}: this process no longer holds the run lock "
                f"({self._lost}); stopping (exit status {LOST_LOCK_EXIT})"
            )

    def left(self) -> float:
        """Seconds before this holder's fence closes (0 once lost)."""
        if self._lost is not None:
            return 0.0
        return max(0.0, self._deadline() - time.monotonic())

    def _unrenewed(self) -> str:
        return f"could not renew the lease within {self.lease_s * (1 - MARGIN):g} s"

    def _lose(self, reason: str) -> None:
        self._lost = reason
        if not self._stop.is_set():
            stderr_line(f"[lock] {self.uri}: {reason}; stopping now without writing more\n")
            if self.exit_on_loss:
                os._exit(LOST_LOCK_EXIT)

    def _renew(self) -> None:
        retry_s = max(0.05, self.lease_s / 12)
        due = self._renewed_at + self.lease_s / 3
        while self._lost is None:
            if self._stop.wait(max(0.0, min(due, self._deadline()) - time.monotonic())):
                return
            left = self._deadline() - time.monotonic()
            if left <= 0:
                self._lose(self._unrenewed())
                return
            assert self._generation is not None, "a lease is renewed once it is held"
            try:
                ok = self._write(self._generation, timeout=max(0.5, min(left, self.lease_s / 3)))
            except Exception as e:
                stderr_line(f"[lock] {self.uri}: could not renew the lease ({type(e).__name__})\n")
                due = time.monotonic() + retry_s
                continue
            if not ok:
                self._lose("another process took over this run")
                return
            due = self._renewed_at + self.lease_s / 3

    def release(self) -> None:
        fence.release(self)
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self._lost is not None:
            return  # another process owns the object now
        with contextlib.suppress(Exception):  # gone or taken over: nothing of ours to delete
            self._blob().delete(if_generation_match=self._generation)

    def __enter__(self) -> GcsRunLock:
        self.acquire()
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


def lease_left() -> float | None:
    """Seconds before this process's fence closes: None without a lease held here (a
    local ``flock`` lock ends only with its process), 0 once the lease is lost. The
    rollout process of a ``rollout.hosts`` job fences its writes by it (``remote``)."""
    held = fence.held()
    return held.left() if isinstance(held, GcsRunLock) else None


def _holder(h: Mapping[str, object]) -> str:
    return f"pid {h.get('pid', '?')} on {h.get('host', '?')} since {h.get('since', '?')}"


def _number(x: Any) -> float:
    try:
        return max(0.0, float(x))
    except (TypeError, ValueError):
        return 0.0


@contextlib.contextmanager
def run_directory(
    path: str | os.PathLike, *, primary: bool = True, what: str = "output_dir"
) -> Iterator[Path]:
    """Claims ``path`` as a run directory and holds its lock for the ``with`` block.

    Args:
      path: the run directory.
      primary: False in the other processes of a multi-host run: they use the
        directory the primary process claimed and locked.
      what: how error messages name it.
    """
    if not primary:
        with storage.writing_into(storage.path(path)) as p:
            yield p
        return
    p = claim_run_dir(path, what=what)
    with GcsRunLock(p) if storage.is_gcs(p) else RunLock(p), storage.writing_into(p):
        yield p
