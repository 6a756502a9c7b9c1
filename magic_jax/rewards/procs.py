"""Process-tree helpers read from /proc: children, descendants, and killing by uid."""

from __future__ import annotations

import os
import signal


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


def kill_uid(uid: int) -> int:
    """SIGKILLs every process whose real uid is ``uid``; returns how many were signalled."""
    if uid == 0 or uid == os.getuid():
        raise ValueError(f"refusing to kill every process of uid {uid}")
    killed = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                line = next(ln for ln in f if ln.startswith("Uid:"))
            if int(line.split()[1]) == uid:
                os.kill(int(name), signal.SIGKILL)
                killed += 1
        except (OSError, StopIteration, ValueError, IndexError):
            continue
    return killed


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
