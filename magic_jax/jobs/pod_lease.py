"""The one supervisor of a slice across machines: a lease object in the stage
(``STAGE/supervisors/ZONE/NAME``, one JSON line: the owner's host and pid, when it was
last renewed, and after how long without renewal it is stale), which
``tpu_scripts/launch.sh``'s supervisor takes before it supervises, renews at each status
cycle (from a thread of its own, ``jobs/pod_run.py``) and drops at its end.

A lease held by another live supervisor is refused: the launch says who holds it. One
is stale once it went unrenewed for its ``stale_s`` (its owner killed, its machine
down), or at once when its owner is a process of this host that is gone; a stale lease
is taken over. Writes are conditional (the object's generation on Cloud Storage), so of
two machines taking it at once one wins and the other reads the winner. Staleness is
told by the clocks of both machines: they must agree within ``stale_s``.

``launch.sh --delete`` (with a stage) asks a live supervisor elsewhere to stop through
its lease: a stop request written into it (``"stop": true`` with the deleting process's
host and pid), which its renewal finds (it stops as if taken over); it acknowledges by
deleting the object once it stopped acting, and then the slice is deleted.

``$MAGIC_JAX_LAUNCH_HOST`` stands for the host name (a test hook: a launch as if on
another machine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time
from pathlib import Path

from magic_jax import storage


class LeaseError(Exception):
    """A lease that cannot be read or written (its cause: the storage client's error)."""


@dataclasses.dataclass(frozen=True)
class Lease:
    """A lease as its object says.

    Attributes:
      host: the owner's host name.
      pid: the owner's process id (its ``launch.sh``).
      renewed: when it was last written, in seconds since the epoch (the owner's clock).
      stale_s: seconds without renewal after which another may take it.
      stop_by: who asks its owner to stop (``HOST pid PID`` of a ``launch.sh --delete``),
        else empty.
    """

    host: str
    pid: int
    renewed: float
    stale_s: float
    stop_by: str = ""

    def owner(self) -> str:
        return f"{self.host} pid {self.pid}"

    def stale(self, now: float) -> bool:
        """Whether another supervisor may take it over at ``now``."""
        if self.host == host() and not _alive(self.pid):
            return True
        return now - self.renewed > self.stale_s


def host() -> str:
    """This machine's name in leases: the host name, or ``$MAGIC_JAX_LAUNCH_HOST`` (a test
    hook standing for another machine)."""
    return os.environ.get("MAGIC_JAX_LAUNCH_HOST") or socket.gethostname()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def read_record(uri: str) -> tuple[str | None, int]:
    """The object at ``uri`` (``gs://`` or a local file) and its generation (0: none)."""
    if not storage.is_gcs(uri):
        p = Path(uri)
        try:
            return p.read_text(), p.stat().st_mtime_ns
        except FileNotFoundError:
            return None, 0
    bucket, key = storage.split(uri)
    blob = storage.client().bucket(bucket).get_blob(key, timeout=15)
    if blob is None:
        return None, 0
    return blob.download_as_bytes(if_generation_match=blob.generation).decode(), blob.generation


def write_record(uri: str, text: str, generation: int) -> bool:
    """Writes ``text`` at ``uri`` if it is still at ``generation`` (0: absent); False when
    another write came first."""
    if not storage.is_gcs(uri):
        p = Path(uri)
        p.parent.mkdir(parents=True, exist_ok=True)
        if generation == 0:
            try:
                with p.open("x") as out:
                    out.write(text)
            except FileExistsError:
                return False
            return True
        if read_record(uri)[1] != generation:
            return False
        storage.write_text(p, text)
        return True
    from google.api_core import exceptions

    bucket, key = storage.split(uri)
    blob = storage.client().bucket(bucket).blob(key)
    try:
        blob.upload_from_string(text, if_generation_match=generation, timeout=15)
    except exceptions.PreconditionFailed:
        return False
    return True


def drop_record(uri: str, generation: int) -> None:
    """Deletes the object at ``uri`` if it is still at ``generation``."""
    if not storage.is_gcs(uri):
        if read_record(uri)[1] == generation:
            Path(uri).unlink(missing_ok=True)
        return
    from google.api_core import exceptions

    bucket, key = storage.split(uri)
    with contextlib.suppress(exceptions.PreconditionFailed, exceptions.NotFound):
        storage.client().bucket(bucket).blob(key).delete(if_generation_match=generation)


def _parse(text: str | None) -> Lease | None:
    if not text:
        return None
    try:
        d = json.loads(text)
        by = f"{d['stop_host']} pid {int(d['stop_pid'])}" if d.get("stop") else ""
        return Lease(str(d["host"]), int(d["pid"]), float(d["renewed"]), float(d["stale_s"]), by)
    except (ValueError, KeyError, TypeError):
        return None  # (not a lease: taken over)


def _text(pid: int, stale_s: float, now: float) -> str:
    d = {"host": host(), "pid": pid, "renewed": now, "stale_s": stale_s}
    return json.dumps(d) + "\n"


def take(uri: str, pid: int, stale_s: float, now: float | None = None) -> Lease | None:
    """Takes the lease at ``uri`` for process ``pid`` of this host, or renews it.

    Returns:
      None when it is ours now; else the lease another live supervisor holds.
    """
    for _ in range(3):  # (a write that lost a race reads the winner's)
        t = time.time() if now is None else now
        text, generation = read_record(uri)
        held = _parse(text)
        mine = held is not None and (held.host, held.pid) == (host(), pid)
        if held is not None and not mine and not held.stale(t):
            return held
        if write_record(uri, _text(pid, stale_s, t), generation):
            return None
    text, _ = read_record(uri)
    return _parse(text)


def renew(uri: str, pid: int, stale_s: float, now: float | None = None) -> Lease | None:
    """Renews ``pid``'s lease; None when done, else the lease of the supervisor that took
    it over, or ``pid``'s own with a stop request in it (either way this one then stops
    supervising; a stop request is never overwritten)."""
    t = time.time() if now is None else now
    text, generation = read_record(uri)
    held = _parse(text)
    if held is not None and ((held.host, held.pid) != (host(), pid) or held.stop_by):
        return held
    if write_record(uri, _text(pid, stale_s, t), generation):
        return None
    return _parse(read_record(uri)[0])


def drop(uri: str, pid: int) -> bool:
    """Deletes ``pid``'s lease (not another's); whether there was one of its own."""
    text, generation = read_record(uri)
    held = _parse(text)
    if held is None or (held.host, held.pid) != (host(), pid):
        return False
    drop_record(uri, generation)
    return True


def ask_stop(uri: str, pid: int, now: float | None = None) -> Lease | None:
    """Asks the live supervisor whose lease is at ``uri`` to stop (``launch.sh --delete``
    as process ``pid`` of this host): a stop request written into its lease, on its
    generation.

    Returns:
      The lease asked; None when no live supervisor holds it (none, a stale one, ``pid``).
    """
    for _ in range(5):  # (a write that lost to a renewal reads the renewed lease)
        t = time.time() if now is None else now
        text, generation = read_record(uri)
        held = _parse(text)
        if text is None or held is None or held.stale(t) or (held.host, held.pid) == (host(), pid):
            return None
        d = dict(json.loads(text), stop=True, stop_host=host(), stop_pid=pid)
        if write_record(uri, json.dumps(d) + "\n", generation):
            return held
    raise LeaseError(f"{uri} changed at each of 5 writes of a stop request")


def acknowledge(uri: str, pid: int) -> bool:
    """Deletes ``pid``'s lease that holds a stop request, on that request's generation:
    the stop acknowledged to ``launch.sh --delete``; whether there was one."""
    text, generation = read_record(uri)
    held = _parse(text)
    if held is None or not held.stop_by or (held.host, held.pid) != (host(), pid):
        return False
    drop_record(uri, generation)
    return True


class Keeper:
    """Renews the lease a supervisor took, every ``every_s``, whatever its supervisor is
    doing (a wait for a slice of hours included)."""

    def __init__(self) -> None:
        self.uri, self.pid, self.stale_s, self.every_s, self.due = "", 0, 0.0, 0.0, 0.0
        self.asked = ""  # the lease a stop request came in, until acknowledged

    def keep(self, uri: str, pid: int, stale_s: float, every_s: float) -> None:
        """From now on renews ``pid``'s lease at ``uri``."""
        self.uri, self.pid, self.stale_s, self.every_s = uri, pid, stale_s, every_s
        self.due = time.monotonic() + every_s

    def tick(self) -> Lease | None:
        """Renews the lease when due; the lease of a supervisor that took it over, or its
        own with a stop request (its ``stop_by``), once (then nothing is kept). A renewal
        that fails is tried at the next tick."""
        if not self.uri or time.monotonic() < self.due:
            return None
        self.due = time.monotonic() + self.every_s
        try:
            other = renew(self.uri, self.pid, self.stale_s)
        except Exception:  # the bucket briefly away: the lease is not stale yet
            return None
        if other is not None:
            if other.stop_by and (other.host, other.pid) == (host(), self.pid):
                self.asked = self.uri
            self.uri = ""
        return other

    def acknowledge(self) -> None:
        """Acknowledges a stop request (its supervisor stopped acting): the lease deleted."""
        if self.asked:
            with contextlib.suppress(Exception):  # (the deleting launch waits, then deletes)
                acknowledge(self.asked, self.pid)
            self.asked = ""

    def release(self) -> None:
        """Drops the kept lease (its supervisor ended)."""
        if self.uri:
            with contextlib.suppress(Exception):  # (it goes stale instead)
                drop(self.uri, self.pid)
            self.uri = ""
