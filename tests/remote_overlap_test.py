"""Overlap across processes (``rollout.hosts: 1``): ``magic-jax train`` as typed on two
processes of 4 CPU devices each, process 0 generating and process 1 updating, each its
own JAX runtime, the weights pulled across by ``jax.experimental.transfer``.

At staleness 0 the run equals the same device split in one process of 8 devices
(``rollout.devices: 4``); at staleness 1 it repeats exactly; a SIGTERM to either process
mid-rollout ends both in seconds, and the same command resumes to the uninterrupted run.
Records are compared without their wall-clock fields."""

import contextlib
import os
import re
import socket
import subprocess
import sys
import time

import pytest
from multihost_failure_test import run_two
from resume_test import _records, _weights, assert_same_run
from trainer_test import files as files  # a fixture, used by name

from magic_jax import interrupt
from magic_jax.run import rundir

# The run: the tiny two-stage sums run, fsdp over each side's 4 devices, fp32 export.
SETS = (
    "rollout.mode=overlap",
    "mesh={data: 1, fsdp: -1, tensor: 1}",
    "export_dtype=float32",
    # a resumed step decodes its unfinished groups in a smaller batch: without compaction,
    # bit for bit (stop_resume_test.py's reason)
    "rollout.compact_batch=false",
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmd(out, *more):
    sets = [x for o in (*SETS, f"output_dir={out}", *more) for x in ("--set", o)]
    return [sys.executable, "-m", "magic_jax.jobs.cli", "train", "run.yaml", *sets]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("remote_cache")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               MAGIC_JAX_COMPILATION_CACHE=str(cache))  # fmt: skip
    env.pop("XLA_FLAGS", None)  # this session's 8 devices: each command says its own count
    return env


def _two(files, out, env, *more, stop_at=None, kill_at=None, timeout=300):
    """Both processes of ``magic-jax train ... rollout.hosts=1``; ``stop_at`` (process id,
    ``MAGIC_JAX_STOP_AT``) makes that process SIGTERM itself there, ``kill_at`` (process id,
    ``MAGIC_JAX_KILL_AT``) SIGKILL itself. Returns (exit codes, logs, seconds from that
    SIGTERM, or from the first exit, to the last exit)."""
    port = _port()

    def env_of(i):
        e = dict(env, MAGIC_JAX_COORDINATOR=f"localhost:{port}", MAGIC_JAX_NUM_PROCESSES="2",
                 MAGIC_JAX_PROCESS_ID=str(i))  # fmt: skip
        for key, at in ((interrupt.STOP_AT_ENV, stop_at), (interrupt.KILL_AT_ENV, kill_at)):
            if at is not None and at[0] == i:
                e[key] = at[1]
        return e

    logs = files / "logs" / f"{out}-{time.time_ns()}"
    logs.mkdir(parents=True)
    cmd = _cmd(files / out, "rollout.hosts=1", *more)
    codes, ended, texts = run_two(lambda i: cmd, env_of, logs, timeout, cwd=files)
    sent = re.search(r"\[test\] SIGTERM at ([\d.]+)", "".join(texts))
    start = float(sent.group(1)) if sent else min(ended)
    return codes, texts, max(ended) - start


def _ok(files, out, env, *more):
    codes, texts, _ = _two(files, out, env, *more)
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
    return texts


@pytest.fixture(scope="module")
def stale1(files, env):
    texts = _ok(files, "rm_s1", env, "rollout.max_staleness=1")
    return files / "rm_s1", texts


@pytest.mark.slow
def test_staleness_0_on_two_processes_equals_the_same_split_in_one(files, env):
    texts = _ok(files, "rm_s0", env, "rollout.max_staleness=0")
    one = _one(files, "rm_one", env, "rollout.max_staleness=0")
    got = _records(files / "rm_s0")
    # each step's rollout pulled its version: bytes recorded, the time printed per version
    raw = rundir.read_records(files / "rm_s0" / "metrics.jsonl")
    assert all(r["publish_bytes"] > 0 and r["t_publish_s"] >= 0 for r in raw)
    pulled = re.findall(r"\[rollout\] version (\d+): ([\d.]+) MiB pulled in ([\d.]+) s", texts[0])
    assert [int(v) for v, _, _ in pulled] == [0, 1, 2, 3]
    assert got == _records(one)
    w1, w2 = _weights(one), _weights(files / "rm_s0")
    assert sorted(w1) == sorted(w2) and all((w1[k] == w2[k]).all() for k in w1)


def _one(files, out, env, *more):
    """The same run in one process of 8 devices, split 4 generating / 4 updating."""
    one = subprocess.run(
        _cmd(files / out, "rollout.devices=4", *more),
        cwd=files,
        env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=8"),
        capture_output=True,
        text=True,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert "4 device(s) generate, 4 update" in one.stdout
    return files / out


@pytest.mark.slow
def test_partial_rollouts_with_reprefill_on_two_processes_equal_the_split_in_one(files, env):
    """Staleness 2, the responses in flight moved to each new version every decode chunk
    and prefilled again under it: which version samples which token follows the chunk
    counts alone, so the pulls across processes change nothing."""
    more = ("rollout.max_staleness=2", "rollout.publish_chunks=1", "rollout.decode_steps=1",
            "rollout.publish_cache=reprefill")  # fmt: skip
    _ok(files, "rm_s2r", env, *more)
    one = _one(files, "rm_s2r_one", env, *more)
    rows = rundir.read_records(files / "rm_s2r" / "metrics.jsonl")
    assert sum(r["reprefills"] for r in rows) > 0
    assert any(len(r["staleness_tokens"]) > 1 for r in rows)  # versions moved mid-rollout
    assert _records(files / "rm_s2r") == _records(one)
    w1, w2 = _weights(one), _weights(files / "rm_s2r")
    assert all((w1[k] == w2[k]).all() for k in w1)


@pytest.mark.slow
def test_staleness_1_on_two_processes_twice_is_the_same_run(files, env, stale1):
    out, _ = stale1
    _ok(files, "rm_s1_again", env, "rollout.max_staleness=1")
    assert_same_run(out, files / "rm_s1_again")
    hist = [r["staleness_tokens"] for r in rundir.read_records(out / "metrics.jsonl")]
    assert set(hist[0]) == {"0"} and all(set(h) == {"1"} for h in hist[1:]), hist


@pytest.mark.slow
@pytest.mark.parametrize("who", [0, 1], ids=["rollout_process", "trainer_process"])
def test_sigterm_mid_rollout_ends_both_then_the_same_command_resumes(files, env, stale1, who):
    """SIGTERM to the rollout process at step 1's first decode chunk, or to the trainer's
    while it waits for step 0's rollout: both exit 143 within seconds, then resume."""
    out = f"rm_stop{who}"
    at = "rollout:1:1" if who == 0 else "rollout:0:5"
    codes, texts, secs = _two(files, out, env, "rollout.max_staleness=1", stop_at=(who, at))
    assert codes == [143, 143], "\n".join(t[-3000:] for t in texts)
    assert secs is not None and secs < 30, secs
    print(f"[{out}] both processes ended {secs:.1f} s after the SIGTERM")
    assert "[stop] SIGTERM: stopped at step" in texts[1]
    _ok(files, out, env, "rollout.max_staleness=1")
    assert_same_run(stale1[0], files / out)


@pytest.mark.slow
@pytest.mark.parametrize("who", [0, 1], ids=["rollout_process", "trainer_process"])
def test_kill_9_of_either_process_ends_the_other_then_the_same_command_resumes(
    files, env, stale1, who
):
    """SIGKILL of the rollout process at step 2's first finished sample, or of the trainer's
    once step 1's update is dispatched: the other ends in one line (exit 1), and the same
    command resumes to the uninterrupted run."""
    out = f"rm_kill{who}"
    at = "rollout:2" if who == 0 else "update:1"
    codes, texts, secs = _two(files, out, env, "rollout.max_staleness=1", kill_at=(who, at))
    assert codes[who] == -9 and codes[1 - who] == 1, "\n".join(t[-3000:] for t in texts)
    said = (
        "the rollout process closed the connection"
        if who == 0
        else "closed the connection without a stop"
    )
    assert said in texts[1 - who], texts[1 - who][-3000:]
    assert secs < 30, secs
    print(f"[{out}] the other process ended {secs:.1f} s after the kill")
    _ok(files, out, env, "rollout.max_staleness=1")
    assert_same_run(stale1[0], files / out)


@pytest.mark.slow
def test_a_finished_run_or_a_refused_directory_ends_both_at_once(files, env, stale1):
    """The trainer's process tells the rollout process when it ends before its hello: the
    run had finished (both exit 0), or its directory was refused (it exits 2, the rollout
    process 1 with its message), in seconds, not at the rollout's wait limit."""
    t0 = time.monotonic()
    codes, texts, _ = _two(files, "rm_s1", env, "rollout.max_staleness=1")
    assert codes == [0, 0] and "[rollout] the run has finished" in texts[0], texts
    (files / "rm_stray").mkdir()
    (files / "rm_stray" / "notes.txt").write_text("not a run")
    codes, texts, secs = _two(files, "rm_stray", env, "rollout.max_staleness=1")
    assert codes == [2, 2], texts  # the trainer has no key to say it with: each sees it
    assert "not a magic-jax run directory" in texts[1], texts[1][-2000:]
    assert "the trainer's process refuses it" in texts[0], texts[0][-2000:]
    assert not (files / "rm_stray" / ".seam-key").exists()
    assert time.monotonic() - t0 < 120 and secs < 30


@pytest.mark.slow
def test_strangers_at_the_rollout_port_first_change_nothing(files, env, stale1):
    """Before the trainer's process starts, strangers connect to the rollout process's
    port: a pickle whose loading would create a file, garbage, and a well-formed ``stop``
    frame of the unauthenticated protocol. Each is refused and said in one line with its
    address, nothing is created, and the trainer's process then connects and the run
    equals the undisturbed one."""
    from channel_test import _heard, _old_frame, _Opens

    port, out, victim = _port(), "rm_strangers", files / "created_by_a_stranger"
    logs = files / "logs" / f"{out}-{time.time_ns()}"
    logs.mkdir(parents=True)
    cmd = _cmd(files / out, "rollout.hosts=1", "rollout.max_staleness=1")
    procs, texts = [], []

    def start(i):
        e = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=4",
                 MAGIC_JAX_COORDINATOR=f"localhost:{port}", MAGIC_JAX_NUM_PROCESSES="2",
                 MAGIC_JAX_PROCESS_ID=str(i))  # fmt: skip
        with open(logs / f"process-{i}.log", "w") as f:
            procs.append(subprocess.Popen(cmd, env=e, cwd=files, stdout=f, stderr=f))

    def said(i, text, n=1, timeout=180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and procs[i].poll() is None:
            if (logs / f"process-{i}.log").read_text().count(text) >= n:
                return
            time.sleep(0.1)
        pytest.fail((logs / f"process-{i}.log").read_text()[-3000:])

    try:
        start(0)
        said(0, "waiting for the trainer's process")
        frames = (_old_frame(_Opens(victim)), os.urandom(300), _old_frame(("stop", {"signum": 0})))
        for data in frames:
            with socket.create_connection(("localhost", port)) as s:
                with contextlib.suppress(OSError):  # refused at once: a reset
                    s.sendall(data)
                    s.shutdown(socket.SHUT_WR)
                s.settimeout(10)
                assert len(_heard(s)) <= 40  # the challenge at most
        said(0, "refused a connection from", n=3, timeout=20)
        start(1)
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        texts = [(logs / f"process-{i}.log").read_text() for i in range(len(procs))]
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
    assert not victim.exists()
    refused = [x for x in texts[0].splitlines() if "refused a connection from" in x]
    assert len(refused) == 3 and all(re.search(r"from [\d.:]+: ", x) for x in refused), refused
    assert_same_run(stale1[0], files / out)


def test_hosts_needs_the_job_variables_and_one_process_a_side(files, monkeypatch):
    from trainer_test import _config

    from magic_jax.run.config import ConfigError
    from magic_jax.run.remote import side_of

    cfg = _config(files, "x", *SETS, "rollout.hosts=1")
    for name in ("MAGIC_JAX_COORDINATOR", "MAGIC_JAX_NUM_PROCESSES", "MAGIC_JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="MAGIC_JAX_COORDINATOR"):
        side_of(cfg)
    monkeypatch.setenv("MAGIC_JAX_COORDINATOR", "10.0.0.2:8476")
    monkeypatch.setenv("MAGIC_JAX_NUM_PROCESSES", "3")
    monkeypatch.setenv("MAGIC_JAX_PROCESS_ID", "1")
    with pytest.raises(ConfigError, match="one generating and one updating process"):
        side_of(cfg)
    monkeypatch.setenv("MAGIC_JAX_NUM_PROCESSES", "2")
    assert side_of(cfg) == type(side_of(cfg))(False, "10.0.0.2", 8476)
    monkeypatch.setenv("MAGIC_JAX_PROCESS_ID", "0")
    assert side_of(cfg).generates
    with pytest.raises(ValueError, match="hosts and devices"):
        _config(files, "x", *SETS, "rollout.hosts=1", "rollout.devices=4")
    with pytest.raises(ValueError, match="need mode: overlap"):
        _config(files, "x", "rollout.hosts=1")


def test_a_message_crosses_the_channel_and_a_closed_peer_is_said():
    import numpy as np
    from channel_test import channel_pair

    ca, cb = channel_pair()
    ca.send("rollout", step=3, got=np.arange(5))
    kind, body = cb.get(5)
    assert kind == "rollout" and body["step"] == 3 and list(body["got"]) == [0, 1, 2, 3, 4]
    assert cb.get(0.05) is None
    ca.close()
    assert cb.get(5) == ("closed", {"why": "the peer closed the connection"})
    # the peer is gone: a send fails (the first may still fill the socket's buffer)
    assert not all(cb.try_send("x", pad=b"0" * 65536) for _ in range(50))
    cb.close()


def test_the_trainer_says_stop_or_its_error_when_it_closes():
    """``RemoteRollouts.close`` runs in the trainer's ``finally``: ``stop`` (with the stop's
    signal, 0: none) after a run or a stop, its error while one propagates."""
    from channel_test import channel_pair

    from magic_jax.run.remote import RemoteRollouts, Side

    def pair():
        rr = RemoteRollouts(1, None, side=Side(False, "localhost", 1), config={}, log=print)
        rr.chan, peer = channel_pair()
        return rr, peer

    rr, peer = pair()
    rr.close()
    assert peer.get(5) == ("stop", {"signum": 0})
    rr, peer = pair()
    with pytest.raises(ValueError):
        try:
            raise ValueError("boom")
        finally:
            rr.close()
    assert peer.get(5) == ("error", {"text": "ValueError: boom"})
