"""Runs untrusted programs: namespaces or a fallback, limits, deadline, cleanup of processes."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from magic_jax.rewards.procs import children, descendants, kill_uid

logger = logging.getLogger(__name__)

_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")
# Imported once in the harness before it drops privileges: forked children get
# them for free, and they work even when the sandbox uid cannot read the
# Python installation.
DEFAULT_PRELOAD = (
    "array",
    "bisect",
    "collections",
    "copy",
    "dataclasses",
    "decimal",
    "fractions",
    "functools",
    "heapq",
    "io",
    "itertools",
    "json",
    "math",
    "operator",
    "random",
    "re",
    "statistics",
    "string",
    "threading",
    "typing",
)
_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Limits and isolation for running generated programs.

    Attributes:
      isolation: ``"auto"`` uses pid/mount/ipc(/net) namespaces via ``unshare``
        when they work (as root, or with a user namespace otherwise) and falls
        back to ``"process"`` with a logged warning; ``"namespace"`` fails
        instead of falling back; ``"process"`` uses rlimits, a process group,
        a subreaper and (as root) a dedicated uid.
      test_timeout_s: wall-clock limit of one test (one program run).
      cpu_s: CPU-time limit (RLIMIT_CPU) of one test.
      max_wall_s: wall-clock limit of a whole sandbox run, enforced from outside.
      memory_mb: address-space limit (RLIMIT_AS) of every sandbox process.
      max_processes: RLIMIT_NPROC for the sandbox uid.
      max_open_files: RLIMIT_NOFILE.
      max_file_mb: RLIMIT_FSIZE: the largest file (and stdout) a program may write.
      max_output_bytes: stdout of one test above this fails the test.
      tmpfs_mb: size of the private ``/tmp`` (a tmpfs holding the working
        directory) inside the mount namespace; the host's world-writable
        directories are hidden from the program.
      uid / gid: unprivileged ids programs run as when the launcher is root.
      landlock: restrict file access to the Python installation (read) and the
        working directory (read-write), deny TCP and outside signals, where
        the kernel has Landlock.
      isolate_network: give the sandbox an empty network namespace.
      python: interpreter for the harness; ``None`` picks ``sys.executable`` or,
        when the sandbox uid cannot use it, a system ``python3``.
      preload: modules imported before privileges are dropped.
      stop_on_failure: stop at the first failing test (the reward is 0 anyway).
      tmp_root: where working directories are created (default: the system's).
    """

    isolation: Literal["auto", "namespace", "process"] = "auto"
    test_timeout_s: float = 5.0
    cpu_s: int = 5
    max_wall_s: float = 60.0
    memory_mb: int = 1024
    max_processes: int = 32
    max_open_files: int = 256
    max_file_mb: int = 32
    max_output_bytes: int = 8 << 20
    tmpfs_mb: int = 64
    uid: int = 65534
    gid: int = 65534
    landlock: bool = True
    isolate_network: bool = True
    python: str | None = None
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    stop_on_failure: bool = True
    tmp_root: str | None = None

    def __post_init__(self) -> None:
        if self.isolation not in ("auto", "namespace", "process"):
            raise ValueError(
                f"isolation must be 'auto', 'namespace' or 'process', got {self.isolation!r}"
            )
        for name in ("test_timeout_s", "max_wall_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("cpu_s", "memory_mb", "max_processes", "max_open_files", "max_file_mb"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_open_files < 16:
            raise ValueError(f"max_open_files must be >= 16, got {self.max_open_files}")
        if self.max_output_bytes < 1:
            raise ValueError(f"max_output_bytes must be >= 1, got {self.max_output_bytes}")
        if not isinstance(self.tmpfs_mb, int) or self.tmpfs_mb < 1:
            raise ValueError(f"tmpfs_mb must be an int >= 1, got {self.tmpfs_mb!r}")
        for name in ("uid", "gid"):
            if not 0 < getattr(self, name) < 2**32 - 1:
                raise ValueError(f"{name} must be a non-root id, got {getattr(self, name)}")
        if self.max_wall_s < self.test_timeout_s:
            raise ValueError(
                f"max_wall_s ({self.max_wall_s}) must be >= test_timeout_s ({self.test_timeout_s})"
            )


@dataclasses.dataclass(frozen=True)
class _Plan:
    prefix: tuple[str, ...]  # unshare command, empty in process mode
    python: str
    drop_uid: bool
    namespaces: bool


@dataclasses.dataclass
class SandboxRun:
    """What came back from one sandbox run.

    Attributes:
      records: JSON records the harness streamed, in order.
      timed_out: the outside deadline (``max_wall_s``) was hit.
      aborted: the ``on_record`` callback stopped the run early.
      returncode: exit status of the launcher process.
      stderr: the tail of the harness's stderr, for diagnostics.
    """

    records: list[dict[str, Any]]
    timed_out: bool = False
    aborted: bool = False
    returncode: int | None = None
    stderr: str = ""


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


_warned: set[str] = set()


def _python_usable(python: str, uid: int, gid: int) -> bool:
    # `fractions` is not imported at startup, so this also checks that the
    # standard library stays readable after the uid drop.
    try:
        proc = subprocess.run(
            [python, "-I", "-c", "import fractions, json"],
            user=uid,
            group=gid,
            extra_groups=[],
            capture_output=True,
            timeout=30,
            env=_ENV,
            cwd="/",
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0


@functools.cache
def _plan(config_key: tuple[Any, ...]) -> _Plan:
    isolation, python, uid, gid, isolate_network = config_key
    root = os.geteuid() == 0
    python = python or sys.executable
    if root and python is not None and not _python_usable(python, uid, gid):
        fallback = shutil.which("python3", path=_ENV["PATH"])
        if fallback and _python_usable(fallback, uid, gid):
            _warn_once(
                # No uid in the text: every worker has its own, and the pool
                # logs each distinct message once.
                f"the sandbox uid cannot run {python} (its directory is not readable); "
                f"sandboxed programs run with {fallback}"
            )
            python = fallback
        else:
            _warn_once(
                f"the sandbox uid cannot read the Python installation at {python}; sandboxed "
                "programs can import only the preloaded modules"
            )
    unshare = shutil.which("unshare")
    if isolation != "process":
        if unshare is None:
            reason = "the unshare command is not installed"
        else:
            flags = ["--pid", "--fork", "--kill-child", "--mount-proc", "--ipc"]
            if isolate_network:
                flags.append("--net")
            if not root:
                flags = ["--user", "--map-root-user", *flags]
            probe = subprocess.run(
                [unshare, *flags, python, "-I", "-c", "import os; print(os.getpid())"],
                capture_output=True,
                text=True,
                timeout=30,
                env=_ENV,
                cwd="/",
            )
            if probe.returncode == 0 and probe.stdout.strip() == "1":
                return _Plan((unshare, *flags), python, root, True)
            reason = f"unshare {' '.join(flags)} failed: {probe.stderr.strip()[-300:]}"
        if isolation == "namespace":
            raise RuntimeError(f"sandbox isolation='namespace' is unavailable: {reason}")
        _warn_once(
            f"sandbox namespaces unavailable ({reason}); falling back to rlimits, a process "
            "group and a subreaper" + (" with a dedicated uid" if root else "")
        )
    elif not root:
        _warn_once("sandbox isolation='process' without root: programs run as the current user")
    return _Plan((), python, root, False)


@functools.cache
def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is unavailable."""
    import ctypes

    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
        syscall.restype = ctypes.c_long
        # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
        return max(0, syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))
    except (OSError, AttributeError):
        return 0


def isolation_plan(config: SandboxConfig) -> dict[str, Any]:
    """Describes how programs will be isolated with ``config`` on this machine.

    Returns:
      ``namespaces`` (pid/mount/ipc/net namespaces in use), ``drop_uid`` (runs
      as ``config.uid``), ``landlock`` (ABI version in use, 0 for none),
      ``python`` (the sandbox interpreter) and ``command`` (the launcher).
    """
    plan = _plan(_plan_key(config))
    abi = landlock_abi() if config.landlock else 0
    if config.landlock and not abi:
        _warn_once(
            "Landlock is unavailable: sandboxed programs can read world-readable files "
            "outside their directory"
        )
    return {
        "namespaces": plan.namespaces,
        "drop_uid": plan.drop_uid,
        "landlock": abi,
        "python": plan.python,
        "command": list(plan.prefix),
    }


def _plan_key(config: SandboxConfig) -> tuple[Any, ...]:
    return (config.isolation, config.python, config.uid, config.gid, config.isolate_network)


def _nproc_limit(config: SandboxConfig, plan: _Plan) -> int:
    if plan.drop_uid:
        return config.max_processes
    # RLIMIT_NPROC counts every process of the real uid: leave room for the
    # user's own processes or the sandbox could not even start.
    try:
        me = os.getuid()
        count = sum(
            1 for p in os.listdir("/proc") if p.isdigit() and os.stat(f"/proc/{p}").st_uid == me
        )
    except OSError:
        count = 4096
    return count + config.max_processes


def _rmtree(path: str) -> None:
    def retry(func: Callable[..., Any], p: str, _exc: Any) -> None:
        # The program may have removed its own permissions from what it made.
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)


def run_sandboxed(
    job: Mapping[str, Any],
    config: SandboxConfig,
    *,
    on_record: Callable[[dict[str, Any]], bool] | None = None,
) -> SandboxRun:
    """Runs the harness on ``job`` in a fresh sandbox and streams its records.

    Args:
      job: harness job: ``style``, ``code``, ``tests`` and style-specific
        fields (``fn_name``, ``test_code``, ``entry_point``). It must not hold
        expected outputs: the program could read them.
      config: limits and isolation.
      on_record: called with each record as it arrives; returning False stops
        the run at once (e.g. on the first failing test).

    Returns:
      The records and how the run ended. Every process of the run is dead and
      its working directory removed when this returns.
    """
    plan = _plan(_plan_key(config))
    workdir = tempfile.mkdtemp(prefix="mj-sandbox-", dir=config.tmp_root)
    uid = config.uid if plan.drop_uid else None
    payload = dict(job)
    payload.update(
        workdir=workdir,
        uid=uid,
        gid=config.gid if plan.drop_uid else None,
        private_tmp_mb=config.tmpfs_mb if plan.namespaces else 0,
        landlock=config.landlock,
        kill_all=plan.drop_uid,
        preload=list(config.preload),
        stop_on_failure=config.stop_on_failure,
        limits={
            "test_wall_s": config.test_timeout_s,
            "total_wall_s": config.max_wall_s,
            "cpu_s": config.cpu_s,
            "memory": config.memory_mb << 20,
            "nproc": _nproc_limit(config, plan),
            "nofile": config.max_open_files,
            "fsize": config.max_file_mb << 20,
            "max_output": config.max_output_bytes,
        },
    )
    job_path = os.path.join(workdir, "job.json")
    try:
        fd = os.open(job_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f)
        if uid is not None and not plan.namespaces:
            os.chown(workdir, uid, config.gid)
        os.chmod(workdir, 0o700)
        return _launch(plan, config, job_path, workdir, uid, on_record)
    finally:
        _rmtree(workdir)


def _set_pdeathsig() -> None:
    import ctypes

    # PR_SET_PDEATHSIG: if the verifier worker is killed, the launcher dies too.
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)


def _launch(
    plan: _Plan,
    config: SandboxConfig,
    job_path: str,
    workdir: str,
    uid: int | None,
    on_record: Callable[[dict[str, Any]], bool] | None,
) -> SandboxRun:
    argv = [*plan.prefix, plan.python, "-I", _HARNESS, job_path]
    env = dict(_ENV, HOME=workdir, TMPDIR=workdir)
    # preexec_fn is unsafe with threads; pool workers are single-threaded.
    single = threading.active_count() == 1
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd="/",
        start_new_session=True,
        preexec_fn=_set_pdeathsig if single else None,
    )
    assert proc.stdout is not None and proc.stderr is not None, "both are opened as PIPEs"
    run = SandboxRun(records=[])
    deadline = time.monotonic() + config.max_wall_s + 2.0  # + harness start-up
    # JSON escapes a control character in 6 bytes.
    line_cap = 6 * config.max_output_bytes + (1 << 16)
    buf, err = bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    try:
        while sel.get_map() and not run.aborted:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                run.timed_out = True
                break
            for key, _ in sel.select(remaining):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                if key.data == "err":
                    err = (err + data)[-8192:]
                    continue
                buf += data
                *lines, rest = buf.split(b"\n")
                buf = bytearray(rest)
                if len(buf) > line_cap:
                    run.records.append({"event": "overflow", "detail": "record too long"})
                    if on_record is not None:
                        on_record(run.records[-1])
                    run.aborted = True
                    break
                for line in lines:
                    try:
                        record = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        record = {
                            "event": "garbled",
                            "detail": line[:200].decode("utf-8", "replace"),
                        }
                    if not isinstance(record, dict):
                        record = {"event": "garbled", "detail": repr(record)[:200]}
                    run.records.append(record)
                    if record.get("event") == "ready":
                        _check_ready(record)
                    if on_record is not None and on_record(record) is False:
                        run.aborted = True
                        break
                if run.aborted:
                    break
    finally:
        sel.close()
        _stop(proc, plan)
        proc.stdout.close()
        proc.stderr.close()
        if uid is not None and not plan.namespaces:
            kill_uid(uid)
    run.returncode = proc.returncode
    run.stderr = err.decode("utf-8", "replace")
    return run


def _check_ready(record: dict[str, Any]) -> None:
    for key in ("landlock_error", "rlimit_errors"):
        if key in record:
            _warn_once(f"sandbox confinement incomplete: {key}: {record[key]}")


def _stop(proc: subprocess.Popen[bytes], plan: _Plan) -> None:
    """Kills everything the run started and waits until it is gone."""
    if proc.poll() is None:
        if plan.namespaces:
            # SIGKILL to the namespace's init takes every process of the
            # namespace with it; unshare then reaps it and exits, so when
            # wait() returns nothing of the run is left, not even a zombie.
            for child in children(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5.0)
        else:
            # Processes that left the group with setsid are still descendants.
            for pid in descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
