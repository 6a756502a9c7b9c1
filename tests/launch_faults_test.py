"""tpu_scripts/launch.sh against what Cloud TPU really reports (the stub `gcloud` of
tests/launch_test.py): maintenance as READY + UNHEALTHY_MAINTENANCE on every host for
hours, code 13 stockouts, 429 rate limits, a stuck delete, expired credentials, a
missing role, exit statuses that restart. Hours are scaled down (1/2000: a status cycle
of 10 s is 5 ms, 2 h is 3.6 s) or simulated (LAUNCH_CLOCK)."""

import fcntl
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import termios
import threading
import time

from launch_test import (
    COLLECT,
    DELETE,
    GS,
    UP_GS,
    _calls,
    _launch,
    _launch_lines,
    _verbs,
    faithful,
    image,
    index,
    repo,
    stub,
)

__all__ = ["faithful", "image", "index", "repo", "stub"]  # the fixtures


def test_maintenance_as_reported_reruns_on_the_same_slice(stub, tmp_path):
    """Every host away for the scaled equivalent of 2 h while the node says READY with
    health UNHEALTHY_MAINTENANCE: the supervisor waits (no worker asked, nothing
    deleted), then, the node healthy again, reruns on the same slice: 1 create, 0
    deletes."""
    env, state, script = stub
    env = {k: v for k, v in env.items() if k != "LAUNCH_CLOCK"}  # real (scaled) time
    env.update(STUB_HOLD="100000", STUB_MAINT_AT="3", STUB_MAINT_MS="3600",
               LAUNCH_POLL_S="0.005", LAUNCH_LOST_S="0.01", LAUNCH_PROBE_S="1",
               LAUNCH_SSH_BACKOFF_S="1", LAUNCH_SSH_BACKOFF_MAX_S="1")  # fmt: skip
    out = subprocess.run(
        ["bash", str(script), "--retry", "1", "--delete-on-exit", "--logs", str(tmp_path / "l"),
         "--", "magic-jax", "train", *GS],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    calls = _calls(state)
    verbs = _verbs(calls)
    assert verbs.count("create") == 1 and verbs.count("delete") == 1  # the one at the end
    times = [int(t) for t in (state / "times").read_text().split()]
    rerun = [t for t, c in zip(times, calls, strict=True) if "nohup" in c[-1]][1]
    healthy = int((state / "maint-done").read_text())
    print(f"maintenance of 2 h (scaled): rerun {(rerun - healthy) / 1000:.1f} s after it ended")
    assert verbs[-1] == "delete" and verbs.count("start") == 2
    assert not (state / "asked-in-maint").exists()  # no worker asked meanwhile
    assert "magic-jax is READY (UNHEALTHY_MAINTENANCE): waiting for it" in out.stderr
    lines = _launch_lines(out.stderr)
    assert lines[0].startswith("launch.sh: maintenance restarted the host of worker(s) 0")
    assert "rerunning it on magic-jax once READY (attempt 1 of 2)" in lines[0]
    assert lines[-1] == "launch.sh: resumed run finished"


def test_code_13_and_rate_limits_are_retried_with_backoff(stub, tmp_path):
    """Creates 1 and 2 fail with code 13 and a 429 rate limit (retried after 1 and 2
    minutes); create 3 finds the name taken by a delete under way (waited for, not a
    try); create 4 works."""
    env, state, script = stub
    env = dict(env, STUB_CREATE_ERRORS="internal rate exists")
    out = _launch(script, env, "--spot", "--logs", str(tmp_path / "l"), "--", "true")
    assert out.returncode == 0, out.stderr
    assert _verbs(_calls(state)).count("create") == 4
    assert (
        "[launch] no capacity for v5p-64 in us-east5-a (try 1 of 12): An internal error has "
        "occurred.; trying again in 1m00s" in out.stderr
    )
    assert (
        "[launch] rate-limited (try 2 of 12): Quota exceeded for quota metric 'Requests' and "
        "limit 'Requests per minute' of service 'tpu.googleapis.com'" in out.stderr
    )
    assert "magic-jax exists still (an earlier delete under way): waiting for it" in out.stderr
    assert int((state / "clock").read_text()) == 60 + 120 and not _launch_lines(out.stderr)


def test_a_stuck_delete_is_waited_for_then_the_slice_created(stub, tmp_path):
    """Preempted (143); the delete times out and leaves the node DELETING: it is waited
    for (gone), then created again."""
    env, state, script = stub
    env = dict(env, STUB_EXIT_0_1="143", STUB_STUCK_DELETE="3")
    out = _launch(script, env, "--retry", "1", "--logs", str(tmp_path / "l"), "--",
                  "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "[launch] magic-jax is DELETING; waiting for it to go" in out.stderr
    assert len((state / "creates").read_text().splitlines()) == 2
    assert _launch_lines(out.stderr)[-1] == "launch.sh: resumed run finished"


def test_expired_credentials_stop_with_one_line_naming_the_fix(stub, tmp_path):
    env, _, script = stub
    env = dict(env, STUB_HOLD="50", STUB_AUTH_AT="3")
    out = _launch(script, env, "--logs", str(tmp_path / "l"), "--", "magic-jax", "train", *GS)
    assert out.returncode == 1, out.stderr
    (line,) = _launch_lines(out.stderr)
    assert line.startswith("launch.sh: asking Cloud TPU about magic-jax failed: ")
    assert "gcloud auth application-default login" in line  # the fix


def test_credentials_lapsing_in_a_queued_wait_stop_it_in_one_line(stub, tmp_path):
    """A queued request waits (10 s polls, --timeout 10 min); the credentials expire at
    poll 3: one line naming the fix, not a wait of UNKNOWN to the timeout (or forever)."""
    env, state, script = stub
    env = dict(env, STUB_QR_WAIT="1000", STUB_QR_AUTH_AT="3", LAUNCH_POLL_S="10")
    out = _launch(script, env, "--queued", "--spot", "--timeout", "600", "--", "true")
    assert out.returncode == 1, out.stderr
    (line,) = _launch_lines(out.stderr)
    assert line.startswith("launch.sh: asking Cloud TPU about magic-jax failed: ")
    assert "gcloud auth application-default login" in line  # the fix
    assert int((state / "clock").read_text()) == 20  # two polls' waits


def test_a_missing_role_stops_naming_it(stub, tmp_path):
    env, _, script = stub
    error = ("PERMISSION_DENIED: Permission 'tpu.nodes.create' denied on resource "
             "'projects/p/locations/us-east5-a/nodes/magic-jax'")  # fmt: skip
    out = _launch(script, dict(env, STUB_CREATE_ERROR=error), "--", "magic-jax", "train", *GS)
    assert out.returncode == 1
    assert _launch_lines(out.stderr) == [
        f"launch.sh: creating magic-jax failed: {error.removeprefix('PERMISSION_DENIED: ')}"
        " (the permission tpu.nodes.create is missing: grant the caller roles/tpu.admin)"
    ]


def test_an_exit_status_that_restarts_under_gke_reruns_on_the_same_slice(stub, tmp_path):
    """86 (a device fault) restarts a GKE JobSet; here it reruns on the same slice."""
    env, state, script = stub
    env = dict(env, STUB_EXIT_0_1="86")
    out = _launch(script, env, "--retry", "1", "--delete-on-exit", "--logs", str(tmp_path / "l"),
                  "--", "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 0, out.stderr
    verbs = _verbs(_calls(state))
    assert verbs[: len(UP_GS)] == UP_GS
    assert verbs.count("create") == 1 and verbs.count("delete") == 1 and verbs.count("start") == 2
    assert _launch_lines(out.stderr) == [
        "launch.sh: worker 0 exited with 86, a status that restarts; rerunning it on magic-jax "
        "(attempt 1 of 2)",
        "launch.sh: resumed run finished",
    ]
    # without retries left, its status
    env = dict(env, STUB_EXIT_0="86")
    out = _launch(script, env, "--logs", str(tmp_path / "l2"), "--", "magic-jax", "train", *GS)
    assert out.returncode == 86, out.stderr
    assert _launch_lines(out.stderr)[-1] == (
        "launch.sh: worker 0 exited with 86; attempt 1 of 1, no retries left (--retry 0)"
    )


def _at_a_terminal(script, env, *args):
    """launch.sh as started from a shell at a terminal: a pty its controlling terminal,
    stdin, stdout and stderr, SIGHUP at its default. Returns the process and the pty's
    master end (closing it is the terminal going away)."""
    master, slave = pty.openpty()

    def terminal():
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(["bash", str(script), *args], env=env, stdin=slave, stdout=slave,
                            stderr=slave, start_new_session=True, preexec_fn=terminal)  # fmt: skip
    os.close(slave)
    return proc, master


def test_a_lost_terminal_leaves_the_run_and_the_slice_going(stub, tmp_path):
    """The terminal closes while the create is in flight, with --delete-on-exit: SIGHUP to
    every process of the launch (its shell's job), every write to the terminal failing
    from then on. The create, the supervisor and the run go on, its messages in
    launch.log, and the slice is deleted only after the run's end."""
    env, state, script = stub
    env = dict(env, STUB_HOLD="10", STUB_CREATE_S="1")
    logs = tmp_path / "l"
    proc, master = _at_a_terminal(script, env, "--delete-on-exit", "--logs", str(logs), "--",
                                  "magic-jax", "train", *GS)  # fmt: skip
    try:
        _wait_for(lambda: (state / "creating").exists(), proc, deadline=30)
        os.killpg(proc.pid, signal.SIGHUP)
    finally:
        os.close(master)  # the terminal is gone: writing to it fails (EIO)
    assert proc.wait(timeout=60) == 0, (logs / "launch.log").read_text()
    assert _verbs(_calls(state)) == [*UP_GS, *COLLECT, *DELETE]  # deleted after the end
    said = (logs / "launch.log").read_text()
    assert "closing the terminal leaves this supervisor running, its messages in" in said
    assert "[launch] logs of 2 worker(s)" in said
    assert said.rstrip().endswith("[launch] deleting magic-jax")


def _read_all(master, into):
    """Reads what the terminal shows until its last writer is gone."""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: no process holds the terminal any more
            return
        if not chunk:
            return
        into.append(chunk.decode(errors="replace").replace("\r\n", "\n"))


def test_ctrl_c_at_a_terminal_stops_the_supervisor_not_its_relays(stub, tmp_path):
    """Ctrl-C at the terminal mid-run (SIGINT to every process of the launch), with
    --delete-on-exit: the relays of its output are deaf to it, so the terminal shows the
    supervisor's last words; the job is stopped, the slice deleted, exit 130."""
    env, state, script = stub
    env = dict(env, STUB_HOLD="100000")
    proc, master = _at_a_terminal(script, env, "--delete-on-exit", "--logs", str(tmp_path / "l"),
                                  "--", "magic-jax", "train", *GS)  # fmt: skip
    shown: list[str] = []
    reader = threading.Thread(target=_read_all, args=(master, shown), daemon=True)
    reader.start()
    try:
        _wait_for(lambda: (state / "streams").exists(), proc, deadline=30)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        reader.join(timeout=10)
    finally:
        os.close(master)
    text = "".join(shown)
    assert "launch.sh: interrupted: stopping the command on every worker" in text, text
    assert text.rstrip().endswith("[launch] deleting magic-jax"), text
    assert (state / "down").exists() and not (state / "created").exists()


# Runs until the file $GO exists, then finishes
UNTIL_GO = """
import os, time
print("looping", flush=True)
while not os.path.exists(os.environ["GO"]):
    time.sleep(0.1)
print("finished", flush=True)
"""


def _supervise(script, env, tmp_path, name, *args):
    out = (tmp_path / f"{name}.out").open("w")
    err = tmp_path / f"{name}.err"
    proc = subprocess.Popen(["bash", str(script), *args], env=env, stdout=out,
                            stderr=err.open("w"), text=True)  # fmt: skip
    return proc, err


def _wait_for(what, proc, deadline=120):
    end = time.monotonic() + deadline
    while not what():
        assert time.monotonic() < end and proc.poll() is None, "gave up waiting"
        time.sleep(0.1)


def test_a_killed_supervisor_is_replaced_by_the_same_command_or_attach(faithful, tmp_path):
    """kill -9 of the supervisor mid-run, then the same command: it attaches to the
    running command (no second start, no second slice); kill -9 again, then --attach NAME
    alone: with the first launch's retry budget, it sees the run to its end and collects
    every worker's log."""
    env, state, script = faithful
    go = tmp_path / "go"
    args = ["--retry", "1", "--env", f"GO={go}", "--logs", str(tmp_path / "logs"), "--",
            "python", "-c", UNTIL_GO, *GS]  # fmt: skip
    first, _ = _supervise(script, env, tmp_path, "first", *args)

    def running():
        logs = list(state.glob("worker-*/magic-jax/logs/*-1.log"))
        return len(logs) == 2 and all("looping" in p.read_text() for p in logs)

    _wait_for(running, first)
    first.kill()  # SIGKILL: no trap runs
    first.wait()
    again, err = _supervise(script, env, tmp_path, "again", *args)
    _wait_for(lambda: "attaching to the command running on magic-jax" in err.read_text(), again)
    again.kill()
    again.wait()
    last, err = _supervise(script, env, tmp_path, "last", "--attach", "magic-jax", "--logs",
                           str(tmp_path / "logs"))  # fmt: skip
    _wait_for(lambda: "attaching to the command running on magic-jax" in err.read_text(), last)
    assert "(attempt 1 of 2, commit" in err.read_text()  # the first launch's --retry 1
    go.touch()
    assert last.wait(timeout=120) == 0, err.read_text()
    verbs = _verbs(_calls(state))
    assert verbs.count("create") == 1 and verbs.count("start") == 1
    for w in range(2):
        assert "finished" in (tmp_path / "logs" / f"worker-{w}.log").read_text()
    assert not _launch_lines(err.read_text())


def test_a_second_supervisor_of_the_same_slice_is_refused_while_the_first_lives(stub, tmp_path):
    """The same command again while its supervisor still runs (its terminal closed, say):
    one line naming that supervisor, nothing asked of Cloud TPU; the first goes on to
    the end and leaves no entry behind."""
    env, state, script = stub
    env = dict(env, STUB_HOLD="100000")
    args = ["--logs", str(tmp_path / "l"), "--", "magic-jax", "train", *GS]
    first, err = _supervise(script, env, tmp_path, "first", *args)
    _wait_for(lambda: (state / "streams").exists(), first, deadline=30)

    def bring_ups():  # a launch's first question: what is the node's state?
        return sum("--format=value(state)" in c for c in _calls(state))

    asked = bring_ups()
    second = _launch(script, env, *args)
    assert second.returncode == 1
    (line,) = _launch_lines(second.stderr)
    assert line.startswith(f"launch.sh: a supervisor of magic-jax runs on this machine already "
                           f"(pid {first.pid}")  # fmt: skip
    assert f"`kill -KILL {first.pid}` (the run goes on)" in line
    assert bring_ups() == asked  # the second asked nothing
    (state / "down").touch()  # the job ends
    assert first.wait(timeout=60) == 0, err.read_text()
    assert not list(script.parents[1].glob("runs/launch/.magic-jax.supervisor"))


def test_delete_stops_the_slices_supervisor_first_which_recreates_nothing(stub, tmp_path):
    """--delete while the slice's supervisor (--retry 1) runs on this machine: it is
    stopped first, so it does not take the deletion for a preemption: 1 create."""
    env, state, script = stub
    env = dict(env, STUB_HOLD="100000")
    first, err = _supervise(script, env, tmp_path, "first", "--retry", "1", "--logs",
                            str(tmp_path / "l"), "--", "magic-jax", "train", *GS)  # fmt: skip
    _wait_for(lambda: (state / "streams").exists(), first, deadline=30)
    out = _launch(script, env, "--delete")
    assert out.returncode == 0, out.stderr
    assert f"stopping the supervisor of magic-jax on this machine (pid {first.pid})" in out.stderr
    assert first.wait(timeout=30) == 143, err.read_text()
    assert _verbs(_calls(state)).count("create") == 1 and not (state / "created").exists()
    assert "recreating" not in err.read_text()


def test_delete_from_another_machine_stops_the_supervisor_there_through_its_lease(stub, tmp_path):
    """--delete --stage from another machine (another checkout, another host name) while
    the slice's supervisor (--retry 1) runs here: a stop request in its lease, which it
    acknowledges once it stopped (its lease deleted); then the slice is deleted, once,
    and nothing recreates it."""
    env, state, script = stub
    env = dict(env, STUB_HOLD="100000")
    lease = state / "gcs/b/magic-jax-launch/supervisors/us-east5-a/magic-jax"
    first, err = _supervise(script, env, tmp_path, "first", "--retry", "1", "--logs",
                            str(tmp_path / "l"), "--", "magic-jax", "train", *GS)  # fmt: skip
    _wait_for(lambda: (state / "streams").exists() and lease.exists(), first, deadline=30)
    other = tmp_path / "other-machine"
    subprocess.run(["git", "clone", "-q", str(script.parents[1]), str(other)], check=True)
    out = _launch(other / "tpu_scripts" / "launch.sh", dict(env, MAGIC_JAX_LAUNCH_HOST="elsewhere"),
                  "--delete", "--stage", "gs://b/magic-jax-launch")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert (
        f"[launch] asking the supervisor of magic-jax on {socket.gethostname()} pid {first.pid}"
        " to stop first (its lease in gs://b/magic-jax-launch/supervisors/us-east5-a/magic-jax)"
    ) in out.stderr
    assert "on this machine" not in out.stderr and "did not stop" not in out.stderr
    assert first.wait(timeout=30) == 1, err.read_text()
    said = _launch_lines(err.read_text())[-1]
    assert re.fullmatch(r"launch\.sh: magic-jax is being deleted by elsewhere pid [0-9]+ "
                        r"\(launch\.sh --delete\): this supervisor stops", said), said  # fmt: skip
    verbs = _verbs(_calls(state))
    assert verbs.count("create") == 1 and verbs.count("delete") == 1 and verbs[-1] == "delete"
    assert not (state / "created").exists() and not lease.exists()
    assert "recreating" not in err.read_text()


def test_a_lost_host_at_64_hosts_gets_a_new_slice_requested_within_minutes(stub, tmp_path):
    """Worker 63 of 64 goes silent; every ssh to it hangs as gcloud's does on a gone VM
    (10 tries, each a TCP connect timing out: 20 min). At 1/10 scale (status cycle 1 s,
    silence 2 s, probe 1.5 s, a question to a worker at most 12 s) the new slice is
    requested within 60 s (10 min unscaled) of the verdict; printed (docs/tpu.md)."""
    env, state, script = stub
    # (the new slice finds no capacity: the launch ends there)
    env = dict(env, STUB_WORKERS="64", STUB_HOLD="100000", STUB_SILENT="63", STUB_SILENT_AT="2",
               LAUNCH_POLL_S="1", LAUNCH_LOST_S="2", LAUNCH_PROBE_S="1.5",
               LAUNCH_SSH_DEADLINE_S="12", STUB_NO_CAPACITY="2")  # fmt: skip
    out = _launch(script, env, "--retry", "1", "--create-tries", "1", "--logs",
                  str(tmp_path / "l"), "--", "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 1, out.stderr
    calls = _calls(state)
    times = [int(t) for t in (state / "times").read_text().split()]
    verbs = _verbs(calls, polls=True)
    probe = verbs.index("probe")  # the verdict: worker 63 does not answer (within 1.5 s)
    create = verbs.index("create", probe)
    gone = [c for c in calls[probe + 1 : create] if "--worker=63" in c]
    assert not gone  # the gone host is not asked for its log
    minutes = (times[create] - times[probe]) / 1000 * 10 / 60  # unscaled
    print(f"64 hosts, a host lost: the new slice requested {minutes:.1f} min after the verdict")
    assert minutes < 10
    assert "launch.sh: a host lost (worker 63 stopped answering" in out.stderr
    assert "[launch] logs of 63 of 64 worker(s)" in out.stderr


def test_a_failed_queued_request_shows_why_and_is_requested_again_after_a_wait(stub, tmp_path):
    env, state, script = stub
    env = dict(env, STUB_QR_WAIT="5", STUB_QR_FAIL_AT="2")
    out = _launch(script, env, "--queued", "--spot", "--logs", str(tmp_path / "l"), "--", "true")
    assert out.returncode == 0, out.stderr
    assert _verbs(_calls(state)).count("qr-create") == 2
    assert (
        "[launch] queued resource magic-jax-qr FAILED: There is no more capacity in the zone "
        '"us-east5-a"; you can try in another zone' in out.stderr
    )
    assert "requesting it again in 1m00s (1 of 12)" in out.stderr
    assert int((state / "clock").read_text()) == 60


def test_a_queued_request_failed_after_its_valid_until_duration_is_not_requested_again(
    stub, tmp_path
):
    """--valid-until-duration 1m: the request waits (10 s polls) and fails at poll 10,
    past its minute: one line with its failedData, no second request."""
    env, state, script = stub
    env = dict(env, STUB_QR_WAIT="100", STUB_QR_FAIL_AT="10", LAUNCH_POLL_S="10",
               STUB_QR_FAILED_CODE="4", STUB_QR_FAILED_WHY="The request's valid until time has "
               "passed.")  # fmt: skip
    out = _launch(script, env, "--queued", "--spot", "--valid-until-duration", "1m", "--", "true")
    assert out.returncode == 1, out.stderr
    assert _verbs(_calls(state)).count("qr-create") == 1
    assert _launch_lines(out.stderr) == [
        "launch.sh: queued resource magic-jax-qr FAILED after its --valid-until-duration 1m "
        "lapsed: The request's valid until time has passed.; not requested again"
    ]


def test_a_suspending_queued_resource_is_waited_for_not_force_deleted(stub, tmp_path):
    env, state, script = stub
    env = dict(env, STUB_PREEMPT="1", STUB_SUSPENDING="3")
    out = _launch(script, env, "--queued", "--spot", "--retry", "1", "--logs",
                  str(tmp_path / "l"), "--", "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert not (state / "forced").exists()  # deleted once SUSPENDED
    assert "preempted (magic-jax is GONE; attempt 1 of 2); recreating the slice" in out.stderr
    assert _verbs(_calls(state)).count("qr-create") == 2


def test_a_python_without_the_cloud_tpu_client_stops_naming_the_extra(stub, tmp_path):
    """LAUNCH_API_PYTHON without google-cloud-tpu (here: site-packages off): one line naming
    the extra to install, before any slice is asked for."""
    env, state, script = stub
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    out = _launch(script, dict(env, LAUNCH_API_PYTHON=str(bare)), "--", "true")
    assert out.returncode == 1, out.stderr
    (line,) = _launch_lines(out.stderr)
    assert line.startswith("launch.sh: Cloud TPU's API (") and "did not start" in line
    assert "pip install 'magic-jax[launch]'" in line and not _calls(state)


def test_a_python_older_than_the_package_needs_stops_in_one_line(stub, tmp_path):
    """LAUNCH_API_PYTHON too old for magic-jax: one line naming its version, exit 2, no
    traceback and nothing asked of Cloud TPU."""
    env, state, script = stub
    old = tmp_path / "old-python"
    old.write_text(
        "#!/bin/sh\n"
        'case "$2" in *version_info*) exit 1 ;; *platform*) echo 3.9.18; exit 0 ;; esac\n'
        "exit 1\n"
    )
    old.chmod(0o755)
    out = _launch(script, dict(env, LAUNCH_API_PYTHON=str(old)), "--", "true")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"launch.sh: {old} is Python 3.9.18; the supervisor needs 3.11 or newer, as magic-jax "
        "does (set LAUNCH_API_PYTHON to one, with pip install 'magic-jax[launch]')"
    ]
    assert not _calls(state)
