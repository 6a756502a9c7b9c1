"""A stop while the two processes of a ``rollout.hosts`` job wait for each other: SIGTERM
to the trainer's process while it waits for the rollout process, or to the rollout
process while it waits for the trainer's, ends it in seconds with exit status 143."""

import os
import signal
import subprocess
import time

import pytest
from remote_overlap_test import _cmd, _port
from remote_overlap_test import env as env  # a fixture, used by name
from trainer_test import files as files  # a fixture, used by name


def _alone(files, env, i, waiting, out):
    """Process ``i`` of a ``rollout.hosts`` job started without the other, SIGTERMed once
    it says ``waiting``; returns (its exit status, seconds from the signal, its log)."""
    port = _port()
    e = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             MAGIC_JAX_COORDINATOR=f"localhost:{port}", MAGIC_JAX_NUM_PROCESSES="2",
             MAGIC_JAX_PROCESS_ID=str(i))  # fmt: skip
    log = files / f"{out}.log"
    cmd = _cmd(files / out, "rollout.hosts=1", "rollout.max_staleness=1")
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=e, cwd=files, stdout=f, stderr=f)
    try:
        deadline = time.monotonic() + 180
        while waiting not in log.read_text():
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(0.5)  # in the wait itself
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=30)
        return code, time.monotonic() - t0, log.read_text()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.heavy
def test_sigterm_to_the_trainer_waiting_for_the_rollout_process_exits_143(files, env):
    code, secs, text = _alone(files, env, 1, "waiting for the rollout process", "st_trainer")
    assert code == 143 and secs < 10, (code, secs, text[-3000:])
    print(f"[st_trainer] exit {code} {secs:.1f} s after the SIGTERM")


@pytest.mark.heavy
def test_sigterm_to_the_rollout_process_waiting_for_the_trainer_exits_143(files, env):
    code, secs, text = _alone(files, env, 0, "waiting for the trainer's process", "st_rollout")
    assert code == 143 and secs < 10, (code, secs, text[-3000:])
    assert not os.path.exists(files / "st_rollout")  # it wrote nothing there
    print(f"[st_rollout] exit {code} {secs:.1f} s after the SIGTERM")
