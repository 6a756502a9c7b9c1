"""The run directory's write fence: ``check_fence`` refuses a write once this process's
run lock may be lost. ``runlock.GcsRunLock`` holds the fence while it holds its lease;
the writers (``rundir.write_atomic``, the monitor, checkpoints, the export) check it."""

from __future__ import annotations

from typing import Protocol


class Lease(Protocol):
    """A lease the fence asks before each write (``runlock.GcsRunLock``)."""

    def check(self, what: str, *, server: bool = False) -> None: ...


# The lease this process holds (while held; the fence reads it).
_held: Lease | None = None


def hold(lease: Lease) -> None:
    """From now on ``check_fence`` asks ``lease``."""
    global _held
    _held = lease


def release(lease: Lease) -> None:
    """``lease`` ended: the fence lets writes through again (if it was the one held)."""
    global _held
    if _held is lease:
        _held = None


def held() -> Lease | None:
    """The lease the fence asks now (None: writes go through unasked)."""
    return _held


def check_fence(what: str, *, server: bool = False) -> None:
    """Refuses a write into the run directory when this process's lease may have ended.

    Call it right before each write: records, summary, config, a checkpoint's
    manifest, the export. Without a lease held here (a local ``flock`` lock,
    the other processes of a multi-host run, tests) it does nothing.

    Args:
      what: what is about to be written (for the message).
      server: also read the lock object (one small GET) and check that this
        holder still owns it: for the writes that make something count (a
        checkpoint's manifest, the export, the summary).

    Raises:
      LockLost: another process took the run over, or this one could not renew
        its lease in time; the message names the directory and ``what``.
    """
    lease = _held
    if lease is not None:
        lease.check(what, server=server)
