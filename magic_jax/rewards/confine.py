"""Sandbox confinement: private /tmp, rlimits, uid drop, Landlock, and killing leftovers."""

# Runs inside the sandbox, imported by harness.py before any untrusted code:
# standard library only.

import contextlib
import ctypes
import os
import resource
import signal
import stat
import sys
import time

_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 1, 2, 4
_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446
_LL_FILE_RIGHTS = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14) | (1 << 15)
_LL_READ = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read file, read dir
_LL_DEV = (1 << 1) | (1 << 2) | (1 << 14) | (1 << 15)  # write, read, truncate, ioctl


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(path, options, flags=0):
    libc = _libc()
    flags |= _MS_NOSUID | _MS_NODEV
    if libc.mount(b"tmpfs", path.encode(), b"tmpfs", flags, options.encode()) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mounting a tmpfs on {path}: {os.strerror(errno)}")


def private_tmp(size_mb, uid, gid):
    """Inside a mount namespace: fresh /tmp holding the working directory, and
    /var/tmp, /run/lock and /dev/shm made unwritable. Returns the working directory.

    World-writable directories would otherwise be writable by the sandbox uid
    wherever Landlock is missing.
    """
    _mount_tmpfs("/tmp", f"size={size_mb}m,mode=0755")
    workdir = "/tmp/work"
    os.mkdir(workdir, 0o700)
    if uid is not None:
        os.chown(workdir, uid, gid)
    for path in ("/var/tmp", "/run/lock", "/dev/shm"):
        if os.path.isdir(path) and not os.path.islink(path):
            _mount_tmpfs(path, "size=4k,mode=0755", _MS_RDONLY)
    return workdir


def _landlock(workdir, extra_read):
    """Read-only access to the Python installation and system dirs, read-write to workdir."""
    libc = _libc()
    sc = libc.syscall
    sc.restype = ctypes.c_long
    abi = sc(_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return 0
    fs = (1 << 13) - 1
    fs |= (1 << 13) if abi >= 2 else 0
    fs |= (1 << 14) if abi >= 3 else 0
    fs |= (1 << 15) if abi >= 5 else 0
    net = 3 if abi >= 4 else 0  # TCP bind and connect: no rule grants them
    scoped = 3 if abi >= 6 else 0  # signals and abstract unix sockets stay inside

    class Attr(ctypes.Structure):
        _fields_ = (("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64))

    class Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = (("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32))

    size = 8 if abi < 4 else 16 if abi < 6 else 24
    attr = Attr(fs, net, scoped)
    rfd = sc(_LL_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if rfd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")

    def allow(path, access, required=False):
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            if required:
                raise
            return
        try:
            acc = access & fs
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                acc &= _LL_FILE_RIGHTS
            rule = Beneath(acc, fd)
            if sc(_LL_ADD_RULE, ctypes.c_int(rfd), ctypes.c_int(1), ctypes.byref(rule), 0) != 0:
                raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
        finally:
            os.close(fd)

    read = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    read.update(p for p in sys.path if p and os.path.isdir(p))
    read.add(os.path.dirname(os.path.realpath(sys.executable)))
    read.update(("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/proc"))
    read.update(extra_read)
    for path in sorted(read):
        allow(path, _LL_READ)
    for dev in ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"):
        allow(dev, _LL_DEV)
    allow(workdir, fs, required=True)
    if sc(_LL_RESTRICT, ctypes.c_int(rfd), ctypes.c_uint32(0)) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    os.close(rfd)
    return abi


def confine(job):
    """Confines this process; children inherit every limit.

    Returns facts for the log, with ``workdir`` where the program must run.
    """
    info = {}
    for name in job.get("preload", ()):
        with contextlib.suppress(Exception):
            __import__(name)
    workdir = job["workdir"]
    uid, gid = job.get("uid"), job.get("gid")
    if job.get("private_tmp_mb"):
        workdir = private_tmp(job["private_tmp_mb"], uid, gid)
    os.chdir(workdir)
    os.environ.update(HOME=workdir, TMPDIR=workdir)
    lim = job["limits"]
    for res, value in (
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NOFILE, lim["nofile"]),
        (resource.RLIMIT_FSIZE, lim["fsize"]),
        (resource.RLIMIT_AS, lim["memory"]),
        (resource.RLIMIT_NPROC, lim["nproc"]),
    ):
        try:
            resource.setrlimit(res, (value, value))
        except (ValueError, OSError) as e:
            info.setdefault("rlimit_errors", []).append(f"{res}: {e}")
    if uid is not None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    libc = _libc()
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    info["landlock"] = 0
    if job.get("landlock"):
        try:
            info["landlock"] = _landlock(workdir, job.get("extra_read", ()))
        except OSError as e:
            info["landlock_error"] = str(e)
    if os.getpid() != 1:
        # Orphans of the program reparent here instead of escaping to init.
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    info.update(uid=os.getuid(), pid=os.getpid(), workdir=workdir)
    return info


def _descendants(root):
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                parent[int(name)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier and p not in found}
        found |= frontier
    return found


def kill_others(kill_all):
    """Kills every process the program left behind and reaps them."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        if kill_all:
            # Pid 1 of a pid namespace, or the only user of a dedicated uid:
            # kill(-1) reaches exactly the sandbox's processes.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(-1, signal.SIGKILL)
        else:
            for pid in _descendants(os.getpid()):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return
        time.sleep(0.002)
