"""The run directory's lock for the life of a run: an flock locally, a renewed lease
object on Cloud Storage; ``run_directory`` claims the directory and locks it."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from magic_jax import storage
from magic_jax.run.rundir import LOCK, RunDirError, claim_run_dir, now, stderr_line


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

    def __exit__(self, *_: Any) -> None:
        self.release()


LEASE_ENV = "MAGIC_JAX_LOCK_LEASE_S"


LEASE_S = 120.0


# Exit status of a process that lost its run lock (another process took the run over).
LOST_LOCK_EXIT = 75


class GcsRunLock:
    """The run lock of a ``gs://`` run directory: a lease held in the object ``DIR/.lock``.

    The object is created only if absent (a generation precondition), and holds
    the owner (a random id, pid, host, start time) and when its lease ends. A
    thread renews it every third of the lease, each write conditional on the
    generation it wrote last. When that condition fails, another process has
    taken the run over: this one stops at once (exit status 75) without
    writing anything more. A dead owner cannot renew, so its lease lapses.

    Acquiring a held lock watches it: a holder that renews is alive and the
    new run is refused (within a third of the lease); a lease that lapses
    unrenewed (a killed or preempted run) is taken over with a condition on
    the generation seen, so of two runs racing for it one wins. A resume after
    ``kill -9`` therefore waits at most one lease (``MAGIC_JAX_LOCK_LEASE_S``,
    default 120 s); a run stopped by a signal releases the lock at once.

    Raises (on enter):
      RunDirError: another live run holds the lock; the message names it.
    """

    def __init__(self, path: Any, *, lease_s: float | None = None):
        self.uri = str(path).rstrip("/") + "/" + LOCK
        self.lease_s = float(lease_s or os.environ.get(LEASE_ENV) or LEASE_S)
        self._owner = f"{os.getpid()}-{os.urandom(6).hex()}"
        self._generation: int | None = None
        self._since = now()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _blob(self) -> Any:
        bucket, key = storage.split(self.uri)
        return storage.client().bucket(bucket).blob(key)

    def _body(self) -> bytes:
        import time

        return json.dumps({
            "owner": self._owner,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": self._since,
            "expires": time.time() + self.lease_s,
        }).encode()  # fmt: skip

    def _read(self) -> tuple[int | None, dict[str, Any]]:
        """(generation, holder) of the lock object; (None, {}) when there is none."""
        blob = self._blob()
        try:
            data = blob.download_as_bytes()
        except Exception as e:
            if getattr(e, "code", None) == 404:
                return None, {}
            raise
        try:
            holder = json.loads(data)
        except ValueError:
            holder = {}
        return blob.generation, holder if isinstance(holder, dict) else {}

    def _write(self, if_generation: int) -> bool:
        """Writes this owner's lease if the object's generation is ``if_generation`` (0:
        absent); False when another process changed it first."""
        import google.api_core.exceptions as gex

        blob = self._blob()
        try:
            blob.upload_from_string(self._body(), if_generation_match=if_generation)
        except gex.PreconditionFailed:
            return False
        self._generation = blob.generation
        return True

    def acquire(self) -> None:
        import time

        seen: int | None = None
        deadline: float | None = None
        while True:
            gen, holder = self._read()
            if gen is None:
                if self._write(0):
                    break
                continue
            if gen != seen and seen is not None:
                raise RunDirError(
                    f"{self.uri.rsplit('/', 1)[0]}: another run is using this directory "
                    f"({_holder(holder)}; it renewed its lease while this one waited)"
                )
            expires = float(holder.get("expires") or 0)
            if time.time() >= expires:
                if self._write(gen):
                    break
                seen, deadline = None, None
                continue
            if seen is None:
                seen, deadline = gen, expires
                stderr_line(
                    f"[lock] {self.uri} is held ({_holder(holder)}); waiting up to "
                    f"{max(0.0, expires - time.time()):.0f} s to see whether its owner is alive\n"
                )
            time.sleep(min(max(0.2, self.lease_s / 12), max(0.05, deadline - time.time())))
        self._thread = threading.Thread(target=self._renew, name="run-lock-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                ok = self._write(self._generation)
            except Exception as e:
                stderr_line(f"[lock] {self.uri}: could not renew the lease ({type(e).__name__})\n")
                continue
            if not ok and not self._stop.is_set():
                stderr_line(
                    f"[lock] {self.uri}: another process took over this run; stopping now "
                    f"without writing more\n"
                )
                os._exit(LOST_LOCK_EXIT)

    def release(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        with contextlib.suppress(Exception):  # gone or taken over: nothing of ours to delete
            self._blob().delete(if_generation_match=self._generation)

    def __enter__(self) -> GcsRunLock:
        self.acquire()
        return self

    def __exit__(self, *_: Any) -> None:
        self.release()


def _holder(h: Mapping[str, Any]) -> str:
    return f"pid {h.get('pid', '?')} on {h.get('host', '?')} since {h.get('since', '?')}"


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
        yield storage.path(path)
        return
    p = claim_run_dir(path, what=what)
    with GcsRunLock(p) if storage.is_gcs(p) else RunLock(p):
        yield p
