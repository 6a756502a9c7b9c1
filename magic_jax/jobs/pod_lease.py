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
    """

    host: str
    pid: int
    renewed: float
    stale_s: float

    def owner(self) -> str:
        return f"{self.host} pid {self.pid}"

    def stale(self, now: float) -> bool:
        """Whether another supervisor may take it over at ``now``."""
        if self.host == socket.gethostname() and not _alive(self.pid):
            return True
        return now - self.renewed > self.stale_s


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
        return Lease(str(d["host"]), int(d["pid"]), float(d["renewed"]), float(d["stale_s"]))
    except (ValueError, KeyError, TypeError):
        return None  # (not a lease: taken over)


def _text(pid: int, stale_s: float, now: float) -> str:
    d = {"host": socket.gethostname(), "pid": pid, "renewed": now, "stale_s": stale_s}
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
        mine = held is not None and held.host == socket.gethostname() and held.pid == pid
        if held is not None and not mine and not held.stale(t):
            return held
        if write_record(uri, _text(pid, stale_s, t), generation):
            return None
    text, _ = read_record(uri)
    return _parse(text)


def renew(uri: str, pid: int, stale_s: float, now: float | None = None) -> Lease | None:
    """Renews ``pid``'s lease; None when done, else the lease of the supervisor that took
    it over (this one then stops supervising)."""
    t = time.time() if now is None else now
    text, generation = read_record(uri)
    held = _parse(text)
    if held is not None and (held.host, held.pid) != (socket.gethostname(), pid):
        return held
    if write_record(uri, _text(pid, stale_s, t), generation):
        return None
    return _parse(read_record(uri)[0])


def drop(uri: str, pid: int) -> bool:
    """Deletes ``pid``'s lease (not another's); whether there was one of its own."""
    text, generation = read_record(uri)
    held = _parse(text)
    if held is None or (held.host, held.pid) != (socket.gethostname(), pid):
        return False
    drop_record(uri, generation)
    return True


class Keeper:
    """Renews the lease a supervisor took, every ``every_s``, whatever its supervisor is
    doing (a wait for a slice of hours included)."""

    def __init__(self) -> None:
        self.uri, self.pid, self.stale_s, self.every_s, self.due = "", 0, 0.0, 0.0, 0.0

    def keep(self, uri: str, pid: int, stale_s: float, every_s: float) -> None:
        """From now on renews ``pid``'s lease at ``uri``."""
        self.uri, self.pid, self.stale_s, self.every_s = uri, pid, stale_s, every_s
        self.due = time.monotonic() + every_s

    def tick(self) -> Lease | None:
        """Renews the lease when due; the lease of a supervisor that took it over, once
        (then nothing is kept). A renewal that fails is tried at the next tick."""
        if not self.uri or time.monotonic() < self.due:
            return None
        self.due = time.monotonic() + self.every_s
        try:
            other = renew(self.uri, self.pid, self.stale_s)
        except Exception:  # the bucket briefly away: the lease is not stale yet
            return None
        if other is not None:
            self.uri = ""
        return other

    def release(self) -> None:
        """Drops the kept lease (its supervisor ended)."""
        if self.uri:
            with contextlib.suppress(Exception):  # (it goes stale instead)
                drop(self.uri, self.pid)
            self.uri = ""
