"""Process-tree helpers read from /proc: children, descendants, and killing by uid."""

from __future__ import annotations

import contextlib
import os
import signal
import time


def children(pid: int) -> list[int]:
    """Pids whose parent is ``pid``."""
    try:
        # Each thread lists the children it forked itself.
        found = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(p) for p in f.read().split()]
        return found
    except FileNotFoundError:
        if not os.path.exists(f"/proc/{pid}"):
            return []  # gone already
    except OSError:
        pass
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == pid:
                        found.append(int(name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def descendants(pid: int) -> list[int]:
    """Pids of every process below ``pid`` in the process tree."""
    out, frontier = [], [pid]
    while frontier:
        frontier = [c for p in frontier for c in children(p)]
        out += frontier
    return out


def uid_pids(uid: int) -> list[int]:
    """Pids of the live processes whose real uid is ``uid`` (zombies left out)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(ln.split(":", 1) for ln in f if ln[:4] in ("Stat", "Uid:"))
            if int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] not in "ZX":
                found.append(int(name))
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return found


def kill_uid(uid: int, timeout_s: float = 5.0) -> int:
    """SIGKILLs every process whose real uid is ``uid`` and waits until none is left
    (zombies aside) or ``timeout_s`` has passed; returns how many were found.

    As root, the signal is sent by a child that takes the uid and calls
    ``kill(-1, SIGKILL)``: the kernel signals all of the uid's processes at once, so
    a process forking in a loop cannot leave a child born after a scan of /proc.
    """
    if uid == 0 or uid == os.getuid():
        raise ValueError(f"refusing to kill every process of uid {uid}")
    deadline = time.monotonic() + timeout_s
    seen: set[int] = set()
    while pids := uid_pids(uid):
        seen.update(pids)
        if os.geteuid() == 0:
            _kill_all_as(uid)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            break
        time.sleep(0.005)  # SIGKILLed processes take a moment to exit
    return len(seen)


def _kill_all_as(uid: int) -> None:
    pid = os.fork()
    if pid == 0:  # only system calls here: the parent may have threads
        try:
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)  # every process of the uid but this one
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def remove_orphan_dirs(root: str | None, prefix: str) -> None:
    """Removes the folders ``{prefix}{pid}-*`` in ``root`` (default: the temporary
    directory) whose process ``pid`` is gone: a process killed with SIGKILL leaves its
    folder. A pid that is alive, or another user's, keeps its folder."""
    import re
    import shutil
    import tempfile

    root = root or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        m = re.fullmatch(re.escape(prefix) + r"(\d+)-\w+", name)
        if m is not None and not pid_alive(int(m[1])):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
