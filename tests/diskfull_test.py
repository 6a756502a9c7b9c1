"""A full local disk, made real: a small tmpfs mounted in a private mount namespace
(``unshare``) under the run directory or the compilation cache.

A run directory that fills ends the command with one line naming the disk (exit 74),
keeps every checkpoint and record written before, and the same command resumes once
there is space, to the same result as a run that never ran out. A compilation cache
that fills costs one warning line, not one per program, and the run goes on.
"""

import errno
import os
import shutil
import subprocess
import sys
import textwrap
import types

import pytest
from resume_test import OVERRIDES, assert_same_run
from resume_test import reference as reference  # a fixture, used by name
from trainer_test import files as files  # a fixture, used by name

from magic_jax import compile_cache, storage


def _namespace_mounts() -> bool:
    """Whether this machine lets a process mount a tmpfs in a mount namespace of its own
    (root, or an unprivileged user namespace)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt && echo ok"],
        capture_output=True, text=True,
    )  # fmt: skip
    return probe.stdout.strip() == "ok"


needs_mounts = pytest.mark.skipif(
    not _namespace_mounts(), reason="needs unshare and a tmpfs mount in a user namespace"
)


def _in_namespace(script: str, cwd) -> subprocess.CompletedProcess:
    """``script`` (sh) in a private mount namespace: its mounts vanish when it ends."""
    return subprocess.run(["unshare", "-rm", "sh", "-ec", script], cwd=cwd, capture_output=True,
                          text=True, timeout=900)  # fmt: skip


@needs_mounts
def _raised(f, *args) -> BaseException:
    try:
        f(*args)
    except BaseException as e:  # what the CLI would catch
        return e
    raise AssertionError(f"{f.__name__} raised nothing")


def _append(to: str, line: str) -> None:  # as the metrics file is appended to
    with open(to, "a") as f:
        f.write(line)


def _copy(src: str, to: str) -> None:  # a file read and a file written in one frame
    with open(src) as r, open(to, "w") as w:
        w.write(r.read())


def _enospc(name: str | None) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_buffered_write_that_finds_no_space_at_close_names_its_file(tmp_path):
    # the OSError that a buffered write's close raises names no file: the open file does
    e = _raised(_append, "/dev/full", "{}\n")
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC and e.filename is None
    line, code = storage.failure_line(e)
    assert code == storage.DISK_FULL_EXIT
    assert line.startswith("no space left on the disk holding /dev/full ("), line
    assert line.endswith(" MiB free); free some and run the same command to resume"), line
    # the file the frame was writing, not the one it read
    src = tmp_path / "src.txt"
    src.write_text("x" * 100_000)
    copied = storage.describe_disk_full(_raised(_copy, str(src), "/dev/full"))
    assert copied.startswith("no space left on the disk holding /dev/full ("), copied


def test_a_full_disk_is_named_by_the_error_or_the_write_it_stopped(tmp_path, monkeypatch):
    named = storage.describe_disk_full(_raised(_enospc, str(tmp_path / "run" / "a.json")))
    assert named.startswith(f"no space left on the disk holding {tmp_path}/run/a.json ("), named
    # TensorStore (orbax's arrays) says it in text, naming the local file
    ts = ValueError(f'RESOURCE_EXHAUSTED: Error writing local file "{tmp_path}/d/0": [OS error]')
    assert f"holding {tmp_path}/d/0 (" in storage.describe_disk_full(ts)
    # wrapped by what called it (orbax's async commit), still found
    try:
        try:
            _enospc(str(tmp_path / "ckpt"))
        except OSError as inner:
            raise RuntimeError("commit failed") from inner
    except RuntimeError as outer:
        assert f"holding {tmp_path}/ckpt (" in storage.describe_disk_full(outer)

    # nothing names a path (a write in a checkpointer's thread): the run directory it
    # was written in is named when its disk is the full one, else its free space shown
    def _unnamed():
        raise OSError(errno.ENOSPC, "No space left on device")

    run = tmp_path / "run"
    with pytest.raises(OSError) as got, storage.writing_into(run):
        _unnamed()
    roomy = storage.describe_disk_full(got.value)
    assert roomy.startswith(f"no space left on a local disk (the run directory {run} has "), roomy
    full = types.SimpleNamespace(total=2**40, used=2**40 - 2**20, free=2**20)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: full)
    assert storage.describe_disk_full(got.value).startswith(
        f"no space left on the disk holding {run} (1.0 MiB free)"
    )
    # nothing names a path: the line says so rather than guess
    anywhere = storage.describe_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert anywhere.startswith("no space left on a local disk;"), anywhere
    # other faults are not a full disk
    assert storage.describe_disk_full(OSError(errno.EACCES, "Permission denied", "/x")) is None
    assert storage.failure_line(ValueError("RESOURCE_EXHAUSTED: out of memory")) is None


@needs_mounts
def test_a_full_compilation_cache_is_one_warning_and_the_run_goes_on(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    program = textwrap.dedent(f"""
        import os
        os.environ[{compile_cache.ENV!r}] = {str(mnt / "cache")!r}
        import jax, numpy as np
        from magic_jax import compile_cache
        compile_cache.enable()
        for i in range(6):  # each program holds 80 KB of constants that do not compress
            c = np.random.default_rng(i).random(20_000, dtype=np.float32)
            f = jax.jit(lambda x, c=c: x * c)
            assert float(f(1.0).sum()) == float(f(1.0).sum())
        print("done")
    """)
    (tmp_path / "compile.py").write_text(program)
    got = _in_namespace(
        f"mount -t tmpfs -o size=64k tmpfs {mnt}\n{sys.executable} compile.py", tmp_path
    )
    assert got.returncode == 0 and got.stdout.strip() == "done", got.stderr[-3000:]
    lines = got.stderr.splitlines()
    assert not [x for x in lines if "Error writing persistent compilation cache" in x], lines
    told = [x for x in lines if "cannot be written" in x]
    assert len(told) == 1, lines
    assert told[0].startswith(f"warning: the compilation cache {mnt / 'cache'} cannot be written")
    assert "No space left on device" in told[0]


@needs_mounts
@pytest.mark.slow  # three runs of the tiny config (~1.5 min on 2 cores)
def test_a_full_run_directory_stops_in_one_line_and_resumes_to_the_same_run(
    files, reference, tmp_path
):
    mnt, out = tmp_path / "disk", tmp_path / "kept"
    mnt.mkdir()
    sets = " ".join(f'--set "{o}"' for o in OVERRIDES)
    train = (
        f"{sys.executable} -m magic_jax.jobs.cli train run.yaml {sets} --set output_dir={mnt}/run"
    )
    got = _in_namespace(
        textwrap.dedent(f"""
            mount -t tmpfs -o size=400k tmpfs {mnt}
            set +e
            {train} > {tmp_path}/out1 2> {tmp_path}/err1
            echo $? > {tmp_path}/rc1
            set -e
            find {mnt}/run -type f | sort > {tmp_path}/files1
            cp -a {mnt}/run {tmp_path}/at_failure
            mount -o remount,size=16m {mnt}
            {train} > {tmp_path}/out2 2> {tmp_path}/err2
            cp -a {mnt}/run {out}
        """),
        files,
    )
    err1 = (tmp_path / "err1").read_text()
    assert got.returncode == 0, got.stderr[-3000:] + err1[-3000:]
    assert (tmp_path / "rc1").read_text().strip() == str(storage.DISK_FULL_EXIT), err1[-3000:]
    # one line says what happened (orbax's own threads may log their tracebacks around it)
    said = [x for x in err1.splitlines() if x.startswith("magic-jax train: error:")]
    assert len(said) == 1, err1[-3000:]
    last = said[0]
    assert last.startswith(f"magic-jax train: error: no space left on the disk holding {mnt}"), (
        err1[-3000:]
    )
    assert last.endswith("free some and run the same command to resume"), last
    # what was saved before the disk filled was whole: the resume used it
    from magic_jax.run.checkpoint import latest_good_checkpoint

    kept = latest_good_checkpoint(tmp_path / "at_failure")
    out2 = (tmp_path / "out2").read_text()
    if kept is not None:
        assert "[resume]" in out2, out2[-2000:]
    assert_same_run(reference, out)
