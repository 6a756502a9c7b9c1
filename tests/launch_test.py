"""tpu_scripts/launch.sh against a stub `gcloud` that records its calls (a 2-worker slice)."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tpu_scripts" / "launch.sh"

# The stub: a slice exists once created ($STUB_DIR/created holds its state, READY when
# empty; $STUB_DIR/qr its queued resource's); 2 workers. Run K (the K-th start) of worker W
# exits with $STUB_EXIT_W_K, else $STUB_EXIT_W (default 0). Streaming worker 0's log:
# the first $STUB_SSH_DROPS streams drop (255); in run $STUB_PREEMPT the slice is preempted
# (the node PREEMPTED, or gone with its queued resource SUSPENDED) and ssh fails; in run
# $STUB_VANISH the command is gone without an exit status (3). A missing resource answers
# NOT_FOUND. Every call is appended to $STUB_DIR/calls, one per line.
# While worker 0's command runs, asked how its command is, worker W answers "running", or
# $STUB_EARLY_W when set (it ended early: a status, or "gone"). With $STUB_HOLD=N worker
# 0's command runs until the job is stopped (pkill on every worker: $STUB_DIR/down) or N
# such questions were answered; with $STUB_HANG_W worker W's command runs until stopped.
STUB = r"""#!/usr/bin/env bash
printf '%q ' gcloud "$@" >> "$STUB_DIR/calls"; echo >> "$STUB_DIR/calls"
cd "$STUB_DIR" || exit 1
args="$*"
worker=""; command=""
for a in "$@"; do
  case $a in --worker=*) worker=${a#--worker=} ;; esac
done
while [ $# -gt 0 ]; do [ "$1" = --command ] && command=$2; shift; done
missing() { echo "ERROR: (gcloud) NOT_FOUND: Resource was not found" >&2; exit 1; }
run=$(cat runs 2>/dev/null | wc -l)
case $args in
  *"tpu-vm describe"*"value(state)"*)
    [ -e created ] || missing; [ -s created ] && cat created || echo READY ;;
  *"tpu-vm describe"*"networkEndpoints"*) echo "10.0.0.1;10.0.0.2" ;;
  *"tpu-vm create"*) touch created ;;
  *"queued-resources create"*) touch created; echo ACTIVE > qr ;;
  *"queued-resources describe"*"state.state"*) [ -e qr ] && cat qr || missing ;;
  *"queued-resources describe"*) [ -e qr ] && echo qr || missing ;;
  *" delete "*) rm -f created qr ;;
  *"tpu-vm ssh"*)
    case $command in
      *nohup*) echo >> runs ;;
      *"echo running"*)
        echo >> polls
        v="STUB_EARLY_$worker"; h="STUB_HANG_$worker"; x="STUB_EXIT_$worker"
        if [ -n "${!v:-}" ]; then echo "${!v}"
        elif [ -n "${!h:-}" ] && [ ! -e down ]; then echo running
        elif [ -e down ]; then echo "${!x:-0}"
        else echo running; fi ;;
      *pkill*) touch down ;;
      *"tail -n "*" -f"*)
        echo >> streams
        if [ -n "${STUB_HOLD:-}" ]; then
          for _ in $(seq 200); do
            [ -e down ] || [ "$(cat polls 2>/dev/null | wc -l)" -ge "$STUB_HOLD" ] && break
            sleep 0.1
          done
        fi
        if [ "$(wc -l < streams)" -le "${STUB_SSH_DROPS:-0}" ]; then exit 255; fi
        if [ "$run" = "${STUB_PREEMPT:-}" ]; then
          if [ -e qr ]; then rm -f created; echo SUSPENDED > qr; else echo PREEMPTED > created; fi
          echo "ssh: connection closed" >&2; exit 255
        fi
        [ "$run" = "${STUB_VANISH:-}" ] && exit 3
        echo "step 0 from worker $worker (run $run)" ;;
      "cat "*".log") echo "log of worker $worker" ;;
      "cat "*".exit")
        h="STUB_HANG_$worker"; [ -n "${!h:-}" ] && [ ! -e down ] && exit 0
        v="STUB_EXIT_${worker}_$run"; d="STUB_EXIT_$worker"; echo "${!v:-${!d:-0}}" ;;
    esac ;;
esac
exit 0
"""


@pytest.fixture
def stub(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(STUB)
    (bin_dir / "gcloud").chmod(0o755)
    state = tmp_path / "state"
    state.mkdir()
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", STUB_DIR=str(state))
    env.update(LAUNCH_POLL_S="0", TMPDIR=str(tmp_path))
    env.pop("DRY_RUN", None)
    return env, state


def _launch(env, *args):
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60
    )


def _calls(state):
    path = state / "calls"
    return [shlex.split(line) for line in path.read_text().splitlines()] if path.exists() else []


def _verbs(calls, polls=False):
    """Each call as 'create' / 'scp' / 'setup' / 'start' / 'stream' / 'collect' / 'stop' /
    ...; the questions to the workers while the command runs ('poll', as many as time
    allows) only with ``polls``."""
    out = []
    for c in calls:
        cmd = c[c.index("--command") + 1] if "--command" in c else ""
        if "ssh" in c:
            if "echo running" in cmd and not polls:
                continue
            out.append(
                "setup"
                if "pip install" in cmd
                else "start"
                if "nohup" in cmd
                else "stream"
                if "tail" in cmd
                else "poll"
                if "echo running" in cmd
                else "stop"
                if "pkill" in cmd
                else "collect"
            )
        else:
            out.append(c[4] if c[3] == "tpu-vm" else "qr-" + c[4])
    return out


GS = ["--set", "output_dir=gs://b/r"]
# One attempt on a fresh slice, and the two collected workers (log, exit status each).
UP = ["describe", "create", "describe", "describe", "scp", "setup", "start", "stream"]
COLLECT = ["collect"] * 4
DELETE = ["qr-describe", "delete"]  # is there a queued resource? no: delete the node


def test_create_setup_run_collect_delete(stub, tmp_path):
    env, state = stub
    logs = tmp_path / "logs"
    out = _launch(env, "--name", "pod", "--zone", "z1", "--accelerator", "v5e-8",
                  "--delete-on-exit", "--logs", str(logs), "--",
                  "magic-jax", "train", "my config.yaml", *GS)  # fmt: skip
    assert out.returncode == 0, out.stderr
    calls = _calls(state)
    verbs = _verbs(calls)
    assert verbs == UP + COLLECT + DELETE
    create = calls[1]
    assert create[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"] and "pod" in create
    assert "--accelerator-type=v5e-8" in create and "--version=v2-alpha-tpuv5-lite" in create
    assert create[5:8] == ["pod", "--zone", "z1"]
    # setup and start go to every worker; the command keeps its quoting
    assert "--worker=all" in calls[5] and "--worker=all" in calls[6]
    start = calls[6][calls[6].index("--command") + 1]
    assert "magic-jax train my\\ config.yaml --set output_dir=gs://b/r" in start
    assert "--worker=0" in calls[7]  # worker 0's log is streamed
    assert "step 0 from worker 0" in out.stdout
    assert (logs / "worker-0.log").read_text() == "log of worker 0\n"
    assert (logs / "worker-1.log").read_text() == "log of worker 1\n"
    assert not (state / "created").exists()
    assert "preempted" not in out.stderr and "resumed" not in out.stderr


def test_reuse_keeps_the_slice_and_returns_worker_0s_status(stub, tmp_path):
    env, state = stub
    (state / "created").touch()
    env = dict(env, STUB_EXIT_0="3", STUB_EXIT_1="4")
    out = _launch(env, "--no-setup", "--logs", str(tmp_path / "l"), "--", "python", "-V")
    assert out.returncode == 3
    verbs = _verbs(_calls(state))
    assert "create" not in verbs and "delete" not in verbs and "setup" not in verbs
    assert "reusing magic-jax (READY)" in out.stderr and "worker 1 exited with 4" in out.stderr


def test_a_preempted_slice_is_deleted_before_it_is_created(stub, tmp_path):
    env, state = stub
    (state / "created").write_text("PREEMPTED\n")
    out = _launch(env, "--logs", str(tmp_path / "l"), "--", "true")
    assert out.returncode == 0, out.stderr
    assert _verbs(_calls(state))[:4] == ["describe", "qr-describe", "delete", "create"]
    assert "magic-jax is PREEMPTED; deleting it" in out.stderr


def test_worker_0_stopping_with_143_recreates_the_slice_and_resumes(stub, tmp_path):
    env, state = stub
    logs = tmp_path / "logs"
    env = dict(env, STUB_EXIT_0_1="143", STUB_EXIT_1_1="143")
    out = _launch(env, "--spot", "--retry", "1", "--delete-on-exit", "--logs", str(logs), "--",
                  "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 0, out.stderr
    calls = _calls(state)
    # run, preempted: delete, create again, setup, rerun (resume), finish, delete
    assert _verbs(calls) == UP + COLLECT + DELETE + UP + COLLECT + DELETE
    creates = [c for c in calls if c[4] == "create"]
    assert len(creates) == 2 and all("--spot" in c for c in creates)
    starts = [c[-1] for c in calls if "nohup" in c[-1]]
    assert len(starts) == 2 and starts[0] == starts[1]  # the same command, same run id
    assert (
        "launch.sh: preempted (worker 0 stopped with 143; attempt 1 of 2); recreating the slice"
        in out.stderr
    )
    assert out.stderr.strip().splitlines()[-2:] == [
        "launch.sh: resumed run finished",
        "[launch] deleting magic-jax",
    ]  # fmt: skip
    assert (logs / "worker-0.log").exists() and (logs / "worker-0.attempt-2.log").exists()
    assert not (state / "created").exists()


def test_a_preempted_node_is_noticed_when_ssh_fails(stub, tmp_path):
    env, state = stub
    env = dict(env, STUB_PREEMPT="1")
    out = _launch(env, "--spot", "--retry", "1", "--delete-on-exit", "--logs", str(tmp_path / "l"),
                  "--", "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 0, out.stderr
    verbs = _verbs(_calls(state))
    # the stream fails, the node is PREEMPTED: no collection, deleted and created again
    assert verbs == [*UP, "describe", *DELETE, *UP, *COLLECT, *DELETE]
    assert "preempted (magic-jax is PREEMPTED; attempt 1 of 2); recreating the slice" in out.stderr
    assert "launch.sh: resumed run finished" in out.stderr


def test_a_suspended_queued_resource_is_requested_again(stub, tmp_path):
    env, state = stub
    config = tmp_path / "run.yaml"
    config.write_text('model: m\noutput_dir: "gs://b/cfg"  # shared\ndata:\n  output_dir: x\n')
    env = dict(env, STUB_PREEMPT="1")
    out = _launch(env, "--queued", "--spot", "--name", "n", "--retry", "2", "--logs",
                  str(tmp_path / "l"), "--", "magic-jax", "train", str(config))  # fmt: skip
    assert out.returncode == 0, out.stderr
    verbs = _verbs(_calls(state))
    up = ["describe", "qr-create", "qr-describe", "describe", "describe", "scp", "setup", "start",
          "stream"]  # fmt: skip
    assert verbs == [*up, "qr-describe", "qr-delete", *up, *COLLECT]
    assert "preempted (queued resource n-qr is SUSPENDED; attempt 1 of 3)" in out.stderr
    assert "launch.sh: resumed run finished" in out.stderr
    assert (state / "created").exists()  # no --delete-on-exit: the new slice stays


def test_retries_used_up_exit_with_143(stub, tmp_path):
    env, state = stub
    env = dict(env, STUB_EXIT_0="143")
    out = _launch(env, "--retry", "1", "--delete-on-exit", "--logs", str(tmp_path / "l"), "--",
                  "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 143
    verbs = _verbs(_calls(state))
    assert verbs == UP + COLLECT + DELETE + UP + COLLECT + DELETE
    assert (
        "launch.sh: preempted (worker 0 stopped with 143; attempt 2 of 2); no retries left "
        "(--retry 1), exiting with 143"
    ) in out.stderr
    assert "resumed" not in out.stderr


def test_other_failures_are_not_retried(stub, tmp_path):
    env, state = stub
    env = dict(env, STUB_EXIT_0_1="7")
    out = _launch(env, "--retry", "2", "--delete-on-exit", "--logs", str(tmp_path / "l"), "--",
                  "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 7
    assert _verbs(_calls(state)) == UP + COLLECT + DELETE
    assert "preempted" not in out.stderr and "worker 0 exited with 7" in out.stderr


def test_another_worker_failing_while_worker_0_runs_stops_the_job(stub, tmp_path):
    env, state = stub
    logs = tmp_path / "logs"
    # worker 1 ends with 9 mid-run; worker 0 runs until stopped (then exits 143, which
    # must not count as a preemption: no retry)
    env = dict(env, STUB_HOLD="50", STUB_EARLY_1="9", STUB_EXIT_1="9", STUB_EXIT_0="143")
    out = _launch(env, "--retry", "2", "--delete-on-exit", "--logs", str(logs), "--",
                  "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 9, out.stderr
    calls = _calls(state)
    verbs = _verbs(calls)
    assert verbs == [*UP, "stop", *COLLECT, *DELETE]  # stopped, collected, no retry
    assert 1 <= _verbs(calls, polls=True).count("poll") < 50  # it noticed at once
    stop = next(c for c in calls if "pkill" in c[-1])
    assert "--worker=all" in stop and "pkill -TERM" in stop[-1] and "pkill -KILL" in stop[-1]
    assert (
        "launch.sh: worker 1 ended with 9 while worker 0's command still ran: the job failed"
        in out.stderr
    )
    assert out.stderr.strip().splitlines()[-2:] == [
        f"launch.sh: worker 1 failed (exit 9) while worker 0 still ran; the command was "
        f"stopped on every worker (logs: {logs})",
        "[launch] deleting magic-jax",
    ]  # fmt: skip
    assert "worker 1 exited with 9" in out.stderr and "worker 0 exited with 143" in out.stderr
    assert (logs / "worker-0.log").exists() and (logs / "worker-1.log").exists()
    assert "preempted" not in out.stderr


def test_another_worker_gone_without_a_status_fails_the_job(stub, tmp_path):
    env, state = stub
    env = dict(env, STUB_HOLD="50", STUB_EARLY_1="gone", STUB_EXIT_0="143")
    out = _launch(env, "--logs", str(tmp_path / "l"), "--", "magic-jax", "train", *GS)
    assert out.returncode == 1, out.stderr
    assert _verbs(_calls(state)) == [*UP, "stop", *COLLECT]
    assert (
        "worker 1 ended with no exit status (its command is gone) while worker 0's command "
        "still ran" in out.stderr
    )


def test_a_stop_on_another_worker_is_left_to_worker_0(stub, tmp_path):
    env, state = stub
    # worker 1 stopped with 143 first (a SIGTERM the processes agree on): worker 0 follows
    env = dict(env, STUB_HOLD="3", STUB_EARLY_1="143", STUB_EXIT_1="143", STUB_EXIT_0="143")
    out = _launch(env, "--logs", str(tmp_path / "l"), "--", "magic-jax", "train", *GS)
    assert out.returncode == 143, out.stderr
    verbs = _verbs(_calls(state), polls=True)
    assert "stop" not in verbs and verbs.count("poll") >= 3
    assert "preempted (worker 0 stopped with 143; attempt 1 of 1)" in out.stderr


def test_a_worker_still_running_after_worker_0_ended_is_stopped(stub, tmp_path):
    env, state = stub
    env = dict(env, STUB_HANG_1="1", STUB_EXIT_1="137", LAUNCH_GRACE_S="1")
    out = _launch(env, "--logs", str(tmp_path / "l"), "--", "magic-jax", "train", *GS)
    assert out.returncode == 1, out.stderr
    verbs = _verbs(_calls(state))
    assert verbs[: len(UP)] == UP and verbs.count("stop") == 1
    assert "worker 1's command still ran 1s after worker 0's ended: stopping it" in out.stderr
    assert "worker 1 exited with 137" in out.stderr
    assert "launch.sh: worker(s) 1 still ran 1s after worker 0 ended; stopped" in out.stderr


def test_an_ssh_drop_on_a_live_slice_reconnects(stub, tmp_path):
    env, state = stub
    out = _launch(dict(env, STUB_SSH_DROPS="1"), "--logs", str(tmp_path / "l"), "--", "true")
    assert out.returncode == 0, out.stderr
    calls = _calls(state)
    assert _verbs(calls) == [*UP, "describe", "stream", *COLLECT]
    streams = [c[-1] for c in calls if "tail" in c[-1]]
    assert "tail -n +1 -f" in streams[0] and "tail -n 0 -f" in streams[1]  # no repeated lines
    assert "ssh to worker 0 failed (255; magic-jax is READY); reconnecting" in out.stderr


@pytest.mark.parametrize(
    "knobs, message",
    [
        ({"STUB_SSH_DROPS": "9", "LAUNCH_SSH_TRIES": "2"},
         "launch.sh: lost worker 0 of magic-jax: ssh failed 2 times (magic-jax is READY)"),
        ({"STUB_VANISH": "1"},
         "launch.sh: worker 0's command ended without an exit status (magic-jax is READY)"),
    ],
)  # fmt: skip
def test_a_lost_worker_on_a_live_slice_fails_without_retry(stub, tmp_path, knobs, message):
    env, state = stub
    out = _launch(dict(env, **knobs), "--retry", "1", "--logs", str(tmp_path / "l"), "--",
                  "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == message
    assert _verbs(_calls(state)).count("create") == 1


def test_queued_spot_resource_and_delete(stub, tmp_path):
    env, state = stub
    out = _launch(env, "--queued", "--spot", "--name", "n", "--logs", str(tmp_path / "l"), "--",
                  "true")  # fmt: skip
    assert out.returncode == 0, out.stderr
    calls = _calls(state)
    create = next(c for c in calls if c[3:5] == ["queued-resources", "create"])
    assert create[5] == "n-qr" and "--node-id=n" in create and "--spot" in create
    assert "--runtime-version=v2-alpha-tpuv5" in create
    assert any(c[3:5] == ["queued-resources", "describe"] for c in calls)
    (state / "calls").unlink()
    out = _launch(env, "--name", "n", "--delete")
    assert out.returncode == 0, out.stderr
    last = _calls(state)[-1]
    assert last[3:6] == ["queued-resources", "delete", "n-qr"] and "--force" in last


def test_dry_run_prints_every_command_with_the_defaults(stub):
    env, state = stub
    out = _launch(env, "--dry-run", "--", "magic-jax", "demo")
    assert out.returncode == 0, out.stderr
    assert not _calls(state)  # nothing ran
    lines = out.stdout.splitlines()
    create = next(line for line in lines if " create " in line)
    assert "magic-jax --zone us-east5-a" in create and "--accelerator-type=v5p-64" in create
    assert "--version=v2-alpha-tpuv5" in create
    assert any("scp" in line for line in lines) and any("pip\\ install" in line for line in lines)
    assert any("magic-jax\\ demo" in line and "--worker=all" in line for line in lines)


def test_dry_run_with_retry_and_delete_on_exit(stub):
    env, state = stub
    out = _launch(env, "--dry-run", "--retry", "2", "--delete-on-exit", "--", "magic-jax",
                  "train", "configs/skywork-or1-7b.yaml", "--set=output_dir=gs://b/r")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert not _calls(state)
    lines = out.stdout.splitlines()
    assert sum(" create " in line for line in lines) == 1  # a dry run is never preempted
    assert "tpu-vm delete magic-jax" in lines[-1]
    assert any("--set=output_dir=gs://b/r" in line and "nohup" in line for line in lines)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--zonee", "z", "--", "x"], "unknown option --zonee"),
        (["--name", "p"], "no command after --"),
        (["--zone"], "--zone needs a value"),
        (["--accelerator", "tpu-9", "--", "x"], "no default runtime version"),
        (["--retry", "two", "--", "x"], "--retry must be a number of retries, got two"),
        (["--delete-on-exit", "--", "magic-jax", "train", "configs/skywork-or1-7b.yaml"],
         "--delete-on-exit needs output_dir on gs:// (the slice's disks are deleted with it); "
         "the command's output_dir is runs/skywork-or1-7b"),
        (["--retry", "1", "--", "magic-jax", "train", "--set", "output_dir=gs://b/r",
          "--set", "output_dir='runs/x'"],
         "--retry needs output_dir on gs:// (a recreated slice starts with empty disks); "
         "the command's output_dir is runs/x"),
        (["--delete-on-exit", "--dry-run", "--", "python", "-V"],
         "the command has none (pass --set output_dir=gs://BUCKET/RUN)"),
    ],
)  # fmt: skip
def test_errors_are_one_line(stub, args, message):
    out = _launch(stub[0], *args)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"launch.sh: {out.stderr.split(': ', 1)[1].strip()}"]
    assert message in out.stderr
    assert not _calls(stub[1]) and not out.stdout  # refused before any gcloud call


def test_missing_gcloud(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # no gcloud (and nothing else) on PATH
    out = subprocess.run(
        ["/bin/bash", str(SCRIPT), "--", "x"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "launch.sh: gcloud not found on PATH (install the Google Cloud CLI)"
    )
