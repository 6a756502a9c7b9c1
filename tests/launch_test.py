"""tpu_scripts/launch.sh against a fake of Cloud TPU's REST API that the real client
talks to (tests/launch_api.py over tests/fake_tpu_api.py: nodes, queued resources, their
operations and errors as the API returns them) and a stub `gcloud` for ssh, scp and
storage: one that records its calls (a 2-worker slice), and a faithful one whose workers
are directories where ssh and scp really run.

The faithful workers stand for the stock TPU images: their `python3` is Python 3.10 (a
real 3.10 where this machine has one), the only Python on their PATH but for a real
python3.11 (this test's version), which uv finds for `uv venv --python 3.11`; on a real
worker uv would download a managed CPython, which these workers may not do
(UV_PYTHON_DOWNLOADS=never). Their `python3 -m pip install --user uv==PIN` links this
environment's uv (the test extra's, the same pin) into ~/.local/bin instead of fetching
it; `uv pip install` then fetches the install over HTTP from a package index on
127.0.0.1, as from PyPI. The stub answers `gcloud storage` from a directory (the stage, heartbeats),
and runs `simulate-maintenance-event` (every process of a worker killed, a new boot id,
the node REPAIRING for a while). Minutes of backoff (ssh reconnects, creates without
capacity) are simulated: LAUNCH_CLOCK makes launch.sh's waits advance a clock in a file,
which the stub reads."""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tpu_scripts" / "launch.sh"
SETUP_SCRIPT = ROOT / "tpu_scripts" / "worker_setup.sh"

# The stub and the API fake (tests/launch_api.py) share $STUB_DIR: a slice exists once
# created ($STUB_DIR/created holds its state, READY when
# empty; $STUB_DIR/qr its queued resource's); $STUB_WORKERS workers (2). A preempted or
# missing node answers no ssh (255), nor does any worker once the command started while
# the clock ($LAUNCH_CLOCK, advanced by launch.sh's waits) is under $STUB_SSH_DOWN_UNTIL.
# Create K (counting from 1) finds no capacity when K is in $STUB_NO_CAPACITY ("2 3", or
# "all"), or fails with $STUB_CREATE_ERROR ("STATUS: message"), or as $STUB_CREATE_ERRORS
# names for each create (internal, rate, quota, exists, no_capacity, ok), as the API.
# Run K (the K-th start) of worker W exits with $STUB_EXIT_W_K, else $STUB_EXIT_W
# (default 0). Streaming worker 0's log: the first $STUB_SSH_DROPS streams drop (255); in
# run $STUB_PREEMPT the slice is preempted (the node PREEMPTED, or gone with its queued
# resource SUSPENDED) and ssh fails; in run $STUB_VANISH the command is gone without an
# exit status (3). A missing resource answers NOT_FOUND. Every call (the API's as "api
# VERB NAME") is appended to $STUB_DIR/calls (its words ended by \x1f, the call by \x1e).
# While worker 0's command runs, asked how its command is, worker W answers "running", or
# $STUB_EARLY_W when set (it ended early: a status, or "gone"). With $STUB_HOLD=N worker
# 0's command runs until the job is stopped (pkill on every worker: $STUB_DIR/down) or N
# such questions were answered; with $STUB_HANG_W worker W's command runs until stopped.
# Set-up answers "ready" from every worker but $STUB_SETUP_LOST, whose ssh fails.
# With $STUB_FAITHFUL set, scp and ssh are real instead (see `faithful` below): each worker
# is a directory $STUB_DIR/worker-W, made anew from $STUB_TEMPLATE by each create (a new
# slice has empty disks), where `ssh --command C` runs C with bash, HOME there.
STUB = r"""#!/usr/bin/env bash
hook=""; [ "${1:-}" != __hook ] || hook=$2  # the API fake's: VMs stopped, new disks
calls=calls; [ -z "${STUB_ON_WORKER:-}" ] || calls=worker-calls
[ -z "$hook" ] || calls=hooks
{  # one record at a time, and its time with it: launch.sh asks many workers at once
  flock 9
  printf '%s\x1f' gcloud "$@" >> "$STUB_DIR/$calls"; printf '\x1e' >> "$STUB_DIR/$calls"
  [ -n "${STUB_ON_WORKER:-}$hook" ] || date +%s%3N >> "$STUB_DIR/times"
} 9>> "$STUB_DIR/.lock"
here=$PWD
cd "$STUB_DIR" || exit 1
args="$*" argv=("$@")
worker=""; command=""
for a in "$@"; do
  case $a in --worker=*) worker=${a#--worker=} ;; esac
done
while [ $# -gt 0 ]; do [ "$1" = --command ] && command=$2; shift; done
n=${STUB_WORKERS:-2}
reauth() {  # gcloud's words once its credentials expired
  echo "ERROR: (gcloud.compute.tpus.tpu-vm.describe) There was a problem refreshing your" \
    "current auth tokens: Reauthentication failed. cannot prompt during non-interactive" \
    "execution." >&2
  printf 'Please run:\n\n  $ gcloud auth login\n\nto obtain new credentials.\n' >&2
  exit 1
}
# Maintenance as Cloud TPU reports it: from poll $STUB_MAINT_AT the node is READY with
# health UNHEALTHY_MAINTENANCE for $STUB_MAINT_MS ms, every host away (no heartbeat, no
# ssh); then READY and HEALTHY, every host restarted (its command gone, a new boot id).
in_maint() { [ -e maint-until ] && [ "$(date +%s%3N)" -lt "$(cat maint-until)" ]; }
after_maint() { [ -e maint-until ] && ! in_maint; }
workers() {
  case $worker in all) seq 0 $((n - 1)) ;; *-*) seq "${worker%-*}" "${worker#*-}" ;;
    *) echo "${worker//,/ }" | tr ' ' '\n' ;; esac
}
# A worker's VM stops: every process whose HOME is its directory is killed.
kill_worker() {
  local h=$STUB_DIR/worker-$1 p
  for p in /proc/[0-9]*; do
    grep -qzx "HOME=$h" "$p/environ" 2>/dev/null && kill -KILL "${p#/proc/}" 2>/dev/null
  done
}
# the VMs of a deleted (or recreated) slice stop, and a new slice has new disks
stop_vms() {
  local w
  for w in worker-*; do [ -d "$w" ] && kill_worker "${w#worker-}"; done
  return 0
}
# How worker W's command is while worker 0's runs: "running", or $STUB_EARLY_W when set
# (it ended early: a status, or "gone"); once the job is stopped ($STUB_DIR/down), its
# $STUB_EXIT_W; with $STUB_HANG_W it runs until stopped.
worker_status() {
  local v="STUB_EARLY_$1" h="STUB_HANG_$1" x="STUB_EXIT_$1"
  if [ -n "${!v:-}" ]; then echo "${!v}"
  elif [ -n "${!h:-}" ] && [ ! -e down ]; then echo running
  elif [ -e down ]; then echo "${!x:-0}"
  else echo running; fi
}
# gs://B/P is the file gcs/B/P; another path is the caller's
gs() {
  case $1 in
    gs://*) echo "$STUB_DIR/gcs/${1#gs://}" ;; /*|-) echo "$1" ;; *) echo "$here/$1" ;;
  esac
}
new_disks() {
  local w
  stop_vms; rm -rf worker-*
  for w in $(seq 0 $((n - 1))); do
    cp -a "$STUB_TEMPLATE" "worker-$w" && mkdir -p "worker-$w/metadata"
    echo "boot-$w-$RANDOM" > "worker-$w/boot_id"
    echo "$w" > "worker-$w/metadata/agent-worker-number"
    printf "ACCELERATOR_TYPE: 'v5litepod-16'\nWORKER_ID: '%s'\nZONE: 'us-east5-a'\n" "$w" \
      > "worker-$w/metadata/tpu-env"
  done
  [ -z "${STUB_NO_PYTHON_ON:-}" ] || rm -f "worker-$STUB_NO_PYTHON_ON"/bin/python3.*
}
on_worker() {
  local h=$STUB_DIR/worker-$1
  cd "$h" && env -i HOME="$h" USER=tpu PATH="$h/bin:$STUB_SYSBIN:${0%/*}" LANG=C.UTF-8 \
    UV_PYTHON_DOWNLOADS=never LAUNCH_METADATA_URL="file://$h/metadata" \
    LAUNCH_BOOT_ID="$h/boot_id" STUB_DIR="$STUB_DIR" STUB_ON_WORKER="$1" \
    "$BASH" -c "$command" \
    3>&- 4>&- 5>&- 6>&- 7>&- 8>&- 9>&-  # only stdin, stdout and stderr cross ssh
}
# The recording stub's workers write no heartbeat: each read of the stage's heartbeats
# (the API fake's, tests/launch_api.py) writes them first, under $3 (gs://...), as they
# would be: "N SEQ STATUS BOOT", SEQ this status cycle's number, a silent worker's stuck.
beats() {
  local d k w s seq
  d=$(gs "${argv[2]}"); mkdir -p "$d"
  k=$(cat polls 2>/dev/null | wc -l)
  # worker $STUB_SILENT's VM stops answering at poll $STUB_SILENT_AT
  if [ -n "${STUB_SILENT:-}" ] && [ "$k" -ge "${STUB_SILENT_AT:-0}" ] && [ ! -e silent-at ]; then
    echo "$k" > "silent-$STUB_SILENT"; date +%s%3N > silent-at
  fi
  for w in $(seq 0 $((n - 1))); do
    s=$(worker_status "$w"); seq=$k
    [[ $s != [0-9]* ]] || { s=exit-$s; seq=end; }  # a command's last heartbeat
    [ ! -e "silent-$w" ] || seq=$(cat "silent-$w")
    [ ! -e maint-seq ] || seq=$(cat maint-seq)
    echo "$w $seq $s boot-$w" > "$d/worker-$w"
  done
}
run=$(cat runs 2>/dev/null | wc -l)
if [ -n "$hook" ]; then "$hook"; exit 0; fi
case $args in
  "storage ls "*) [ -e "$(gs "${argv[2]}")" ] && echo "${argv[2]}" && exit 0
    echo "ERROR: (gcloud.storage.ls) One or more URLs matched no objects." >&2; exit 1 ;;
  "storage cp "*)
    src=$(gs "${argv[2]}") dst=$(gs "${argv[3]}"); mkdir -p "${dst%/*}"
    if [ "$src" = - ]; then cat > "$dst.part" && mv "$dst.part" "$dst"; exit; fi
    if [ ! -e "$src" ]; then
      echo "ERROR: (gcloud.storage.cp) The following URLs matched no objects or files:" \
        "${argv[2]}" >&2
      exit 1
    fi
    cp "$src" "$dst"; exit ;;
  *"simulate-maintenance-event"*)  # every process gone, new boot ids, REPAIRING for a while
    for a in "${argv[@]}"; do case $a in --workers=*) worker=${a#--workers=} ;; esac; done
    for w in $(workers); do kill_worker "$w"; echo "boot-$w-$RANDOM" > "worker-$w/boot_id"; done
    echo REPAIRING > created; echo "${STUB_REPAIR_POLLS:-3}" > repair; exit 0 ;;
esac
case $args in *"compute tpus"*) [ ! -e auth-expired ] || reauth ;; esac
# With $STUB_LOST_AT_EXIT (faithful), once every worker's command of run 1 has ended (its
# exit status written, its log kept in the stage), the slice is preempted as it is asked
# for the first exit status: the node PREEMPTED, no worker answers ssh any more.
if [ -n "${STUB_LOST_AT_EXIT:-}" ] && [ "$run" = 1 ] && [ ! -e lost-at-exit ]; then
  case $command in *".exit 2>/dev/null || echo none"*)
    for _ in $(seq 300); do
      [ "$(ls worker-*/magic-jax/logs/*-1.exit 2>/dev/null | wc -l)" -ge "$n" ] && break
      sleep 0.1
    done
    touch lost-at-exit; echo PREEMPTED > created ;;
  esac
fi
case $args in
  *"tpu-vm ssh"*|*"tpu-vm scp"*)
    if in_maint; then
      case $command in *"tail -n"*) ;; *) touch asked-in-maint ;; esac
      echo "ssh: connect to host 10.0.0.1 port 22: Connection timed out" >&2; exit 255
    fi
    clock=$(cat clock 2>/dev/null || echo 0)
    if [ ! -e created ] || [ -s created ] ||
       { [ -e runs ] && [ "$clock" -lt "${STUB_SSH_DOWN_UNTIL:-0}" ]; }; then
      echo "ssh: connect to host 10.0.0.1 port 22: Connection timed out" >&2; exit 255
    fi ;;
esac
if [ -n "${STUB_FAITHFUL:-}" ]; then
  case $args in
    *"tpu-vm scp"*)
      for w in $(workers); do cp "${argv[4]}" "worker-$w/${argv[5]#*:}" || exit 1; done
      exit 0 ;;
    *"tpu-vm ssh"*)
      case $command in *nohup*) echo >> runs ;; esac
      pids=() rc=0
      for w in $(workers); do on_worker "$w" & pids+=($!); done
      for p in "${pids[@]}"; do wait "$p" || rc=$?; done
      exit "$rc" ;;
  esac
fi
case $args in
  *"tpu-vm ssh"*)
    case $command in
      *worker_setup.sh*)
        for w in $(workers); do
          [ "$w" = "${STUB_SETUP_LOST:-}" ] || echo "worker $w: ready (python /h/bin/python 3.11)"
        done
        if [ -n "${STUB_SETUP_LOST:-}" ]; then
          echo "ERROR: (gcloud.compute.tpus.tpu-vm.ssh) [/usr/bin/ssh] exited with return code" \
            "[255]." >&2
          exit 255
        fi ;;
      *nohup*) echo >> runs; [ ! -e maint-until ] || mv maint-until maint-done
        rm -f maint-seq ;;
      *"worker_run.sh --status"*)
        if after_maint; then for w in $(workers); do echo "$w gone restarted"; done; exit 0; fi
        for w in $(workers); do
          [ -e "silent-$w" ] || echo "$w $(worker_status "$w") same"
        done
        # a VM that stopped answering: gcloud tries it 10 times, 5 s apart, each try
        # waiting for the TCP connect to time out (127 s on Linux): this hangs
        for w in $(workers); do [ ! -e "silent-$w" ] || exec sleep 1000; done ;;
      *pkill*) touch down ;;
      *"tail -n "*" -f"*)
        echo >> streams
        if after_maint; then exit 3; fi
        if [ -n "${STUB_HOLD:-}" ]; then
          for _ in $(seq 600); do
            [ -e down ] || [ "$(cat polls 2>/dev/null | wc -l)" -ge "$STUB_HOLD" ] && break
            ! in_maint || { echo "ssh: connection closed" >&2; exit 255; }  # host away
            [ ! -e maint-done ] || break  # the rerun after maintenance
            sleep 0.1
          done
        fi
        if [ "$(wc -l < streams)" -le "${STUB_SSH_DROPS:-0}" ]; then exit 255; fi
        if [ "$run" = "${STUB_PREEMPT:-}" ]; then
          if [ -e qr ] && [ -n "${STUB_SUSPENDING:-}" ]; then
            rm -f created; echo SUSPENDING > qr; echo "$STUB_SUSPENDING" > suspending
          elif [ -e qr ]; then rm -f created; echo SUSPENDED > qr
          else echo PREEMPTED > created; fi
          echo "ssh: connection closed" >&2; exit 255
        fi
        if [ "$run" = "${STUB_VANISH:-}" ]; then
          # with $STUB_VANISH_UNHEALTHY=N, maintenance restarted the hosts: the node says
          # UNHEALTHY_MAINTENANCE for N more questions
          if [ -n "${STUB_VANISH_UNHEALTHY:-}" ]; then
            echo "$STUB_VANISH_UNHEALTHY" > unhealthy; date +%s%3N > maint-until
          fi
          exit 3
        fi
        echo "step 0 from worker $worker (run $run)" ;;
      "cat "*".log")  # a VM gone: gcloud's 10 tries, each a TCP connect timing out
        [ ! -e "silent-$worker" ] || exec sleep 1000
        echo "log of worker $worker" ;;
      "cat "*".exit 2>/dev/null || echo none")
        [ ! -e "silent-$worker" ] || exit 255
        if after_maint; then echo none; exit 0; fi
        h="STUB_HANG_$worker"; [ -n "${!h:-}" ] && [ ! -e down ] && echo none && exit 0
        v="STUB_EXIT_${worker}_$run"; d="STUB_EXIT_$worker"; echo "${!v:-${!d:-0}}" ;;
    esac ;;
esac
exit 0
"""


# launch.sh's supervisor: the Python it runs from its checkout
POD_MODULES = [
    "magic_jax/__init__.py",
    "magic_jax/extras.py",
    "magic_jax/jobs/__init__.py",
    *(f"magic_jax/jobs/{m}.py" for m in ("pod_decide", "pod_errors", "restarts")),
    *(f"magic_jax/jobs/{m}.py" for m in ("pod_up", "tpu_api")),  # the API's requests
    # ... and the supervisor itself
    *(f"magic_jax/jobs/{m}.py" for m in ("launch", "pod_state", "pod_workers", "pod_watch")),
    *(f"magic_jax/jobs/{m}.py" for m in ("pod_collect", "pod_setup", "pod_run")),
    "magic_jax/jobs/pod_stage.py",  # ... and the stage's heartbeats and logs
    "magic_jax/jobs/pod_lease.py",  # ... and the supervisor's lease
    "magic_jax/storage.py",
]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A small git repository holding this checkout's launch.sh, worker_setup.sh,
    worker_run.sh and constraints.txt: the scripts under test, whose commit (git archive
    HEAD) is what reaches the workers, a few kB instead of the whole checkout."""
    repo = tmp_path_factory.mktemp("repo")
    (repo / "tpu_scripts").mkdir()
    (repo / "magic_jax" / "jobs").mkdir(parents=True)
    for name in (
        "tpu_scripts/launch.sh",
        "tpu_scripts/worker_setup.sh",
        "tpu_scripts/worker_run.sh",
        "constraints.txt",
        *POD_MODULES,
    ):
        shutil.copy(ROOT / name, repo / name)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "launch scripts"]):
        subprocess.run([*git, *args], check=True)
    return repo


@pytest.fixture
def stub(tmp_path, repo):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(STUB)
    (bin_dir / "gcloud").chmod(0o755)
    state = tmp_path / "state"
    state.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LAUNCH_", "STUB_"))}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", STUB_DIR=str(state))
    # waits between retries advance a clock in a file instead of sleeping
    env.update(LAUNCH_POLL_S="0", TMPDIR=str(tmp_path), LAUNCH_CLOCK=str(state / "clock"))
    # Cloud TPU's API: the fake of tests/launch_api.py, in the process of launch.sh's
    # requests (its state in STUB_DIR); a stuck delete's operation waited for 0.5 s
    api = bin_dir / "api-python"
    api.write_text(
        f'#!/bin/sh\nexec {sys.executable} {Path(__file__).parent / "launch_api.py"} "$@"\n'
    )
    api.chmod(0o755)
    env.update(LAUNCH_API_PYTHON=str(api), CLOUDSDK_CORE_PROJECT="p", LAUNCH_API_POLL_S="0.01")
    env.update(LAUNCH_DELETE_WAIT_S="0.5")
    env.pop("DRY_RUN", None)
    env.pop("MAGIC_JAX_TPU_API_ENDPOINT", None)
    return env, state, repo / "tpu_scripts" / "launch.sh"


def _launch(script, env, *args):
    out = subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=60
    )
    assert "launch.sh: line " not in out.stderr, out.stderr  # no error of bash's own
    return out


def _calls(state):
    path = state / "calls"
    calls = path.read_text().split("\x1e")[:-1] if path.exists() else []
    return [call.split("\x1f")[:-1] for call in calls]


def _verbs(calls, polls=False):
    """Each call as 'create' / 'scp' / 'setup' / 'start' / 'stream' / 'collect' / 'stop' /
    'upload' / ...; the status cycles while the command runs ('poll': the node's state,
    'beat': the heartbeats, 'probe': every worker asked at once, as many as time allows)
    only with ``polls``."""
    out = []
    api = {"get-node": "describe", "poll-node": "poll", "create-node": "create",
           "delete-node": "delete", "get-qr": "qr-describe", "create-qr": "qr-create",
           "delete-qr": "qr-delete", "denied": "denied", "read-beats": "beat",
           "read-logs": "kept-logs"}  # fmt: skip
    for c in calls:
        cmd = c[c.index("--command") + 1] if "--command" in c else ""
        if c[0] == "api":
            verb = api[c[1]]
            if polls or verb not in ("poll", "beat", "kept-logs"):
                out.append(verb)
            continue
        if c[1] == "storage":
            verb = {"ls": "staged?", "cp": "upload"}[c[2]]
        elif "ssh" in c:
            verb = (
                "setup"
                if "worker_setup.sh" in cmd
                else "start"
                if "nohup" in cmd
                else "running?"
                if "logs/current" in cmd
                else "stream"
                if "tail" in cmd
                else ("probe" if "--worker=all" in c else "poll")
                if "--status" in cmd
                else "stop"
                if "pkill" in cmd
                else "collect"
            )
        elif c[3] == "tpu-vm" and c[4] == "describe" and c[-1] == "--format=value(state,health)":
            verb = "poll"
        else:
            verb = c[4] if c[3] == "tpu-vm" else "qr-" + c[4]
        if polls or verb not in ("poll", "beat", "probe"):
            out.append(verb)
    return out


def _posts(state):
    """What reached Cloud TPU's API by POST (the creates): each one's path and JSON body."""
    path = state / "posts"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _launch_lines(stderr):
    """launch.sh's own messages (its errors and notes), not the progress lines."""
    return [line for line in stderr.splitlines() if line.startswith("launch.sh: ")]


GS = ["--set", "output_dir=gs://b/r"]
# One attempt on a fresh slice, and the two collected workers (log, exit status each).
UP = ["describe", "create", "describe", "describe", "scp", "setup", "start", "stream"]
# ... with output_dir on gs://: the archive goes up to the stage once per commit
UP_GS = ["describe", "create", "describe", "describe", "staged?", "upload", "setup", "start",
         "stream"]  # fmt: skip
AGAIN = [*UP_GS[:5], *UP_GS[6:]]  # a later attempt: the archive is staged already
COLLECT = ["collect"] * 4
DELETE = ["qr-describe", "delete"]  # is there a queued resource? no: delete the node


def test_create_setup_run_collect_delete(stub, tmp_path):
    env, state, script = stub
    logs = tmp_path / "logs"
    out = _launch(script, env, "--name", "pod", "--zone", "z1", "--accelerator", "v5e-8",
                  "--delete-on-exit", "--logs", str(logs), "--",
                  "magic-jax", "train", "my config.yaml", *GS)  # fmt: skip
    assert out.returncode == 0, out.stderr
    calls = _calls(state)
    verbs = _verbs(calls)
    assert verbs == UP_GS + COLLECT + DELETE
    assert calls[1] == ["api", "create-node", "pod"]
    (create,) = _posts(state)
    assert create["path"].startswith("/v2/projects/p/locations/z1/nodes?nodeId=pod&")
    node = create["body"]
    assert node["acceleratorType"] == "v5e-8" and node["runtimeVersion"] == "v2-alpha-tpuv5-lite"
    # setup and start go to every worker; the command keeps its quoting
    assert calls[5][1:3] == ["storage", "cp"]
    assert calls[5][4].startswith("gs://b/magic-jax-launch/archives/")  # the output_dir's bucket
    assert "--worker=all" in calls[6] and "--worker=all" in calls[7]
    setup = calls[6][calls[6].index("--command") + 1]
    assert "bash tpu_scripts/worker_setup.sh" in setup and "LAUNCH_INSTALL" not in setup
    assert f"gcloud storage cp {calls[5][4]} " in setup  # each worker fetches it
    start = calls[7][calls[7].index("--command") + 1]
    assert "exec magic-jax train my\\ config.yaml --set output_dir=gs://b/r" in start
    assert "export" not in start  # no --env
    assert "--worker=0" in calls[8]  # worker 0's log is streamed
    assert "step 0 from worker 0" in out.stdout
    assert "[launch] pod: 2 worker(s), runtime version v2-alpha-tpuv5" in out.stderr
    assert "worker 1: ready (python /h/bin/python 3.11)" in out.stderr
    assert (logs / "worker-0.log").read_text() == "log of worker 0\n"
    assert (logs / "worker-1.log").read_text() == "log of worker 1\n"
    assert not (state / "created").exists()
    assert "preempted" not in out.stderr and "resumed" not in out.stderr


def test_reuse_keeps_the_slice_and_returns_worker_0s_status(stub, tmp_path):
    env, state, script = stub
    (state / "created").touch()
    env = dict(env, STUB_EXIT_0="3", STUB_EXIT_1="4")
    out = _launch(script, env, "--no-setup", "--logs", str(tmp_path / "l"), "--", "python", "-V")
    assert out.returncode == 3
    verbs = _verbs(_calls(state))
    assert "create" not in verbs and "delete" not in verbs and "setup" not in verbs
    assert "reusing magic-jax (READY)" in out.stderr and "worker 1 exited with 4" in out.stderr


def test_a_preempted_slice_is_deleted_before_it_is_created(stub, tmp_path):
    env, state, script = stub
    (state / "created").write_text("PREEMPTED\n")
    out = _launch(script, env, "--logs", str(tmp_path / "l"), "--", "true")
    assert out.returncode == 0, out.stderr
    assert _verbs(_calls(state))[:4] == ["describe", "qr-describe", "delete", "create"]
    assert "magic-jax is PREEMPTED; deleting it" in out.stderr


def test_worker_0_stopping_with_143_recreates_the_slice_and_resumes(stub, tmp_path):
    env, state, script = stub
    logs = tmp_path / "logs"
    env = dict(env, STUB_EXIT_0_1="143", STUB_EXIT_1_1="143")
    out = _launch(script, env, "--spot", "--retry", "1", "--delete-on-exit", "--logs", str(logs),
                  "--", "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 0, out.stderr
    calls = _calls(state)
    # run, preempted: delete, create again, setup, rerun (resume), finish, delete
    assert _verbs(calls) == UP_GS + COLLECT + DELETE + AGAIN + COLLECT + DELETE
    creates = _posts(state)
    assert len(creates) == 2 and all(c["body"]["schedulingConfig"]["spot"] for c in creates)
    starts = [c[-1] for c in calls if "nohup" in c[-1]]
    assert len(starts) == 2 and "-1.sh" in starts[0]  # the same command and run, attempt 2
    again = re.sub(r"'(run-\S+) 1 ", r"'\1 2 ", starts[0])  # its run id, attempt 2
    assert starts[1] == again.replace("-1.", "-2.").replace("-1 ", "-2 ")
    assert (
        "launch.sh: preempted (worker 0 stopped with 143; attempt 1 of 2); recreating the slice"
        in out.stderr
    )
    assert out.stderr.strip().splitlines()[-2:] == [
        "launch.sh: resumed run finished",
        "[launch] deleting magic-jax",
    ]  # fmt: skip
    # every worker's log, at the preemption and at the end
    for w in (0, 1):
        assert (logs / f"worker-{w}.log").exists() and (logs / f"worker-{w}.attempt-2.log").exists()
    assert not (state / "created").exists()


def test_a_preempted_node_is_noticed_when_ssh_fails(stub, tmp_path):
    env, state, script = stub
    logs = tmp_path / "l"
    env = dict(env, STUB_PREEMPT="1")
    out = _launch(script, env, "--spot", "--retry", "1", "--delete-on-exit", "--logs", str(logs),
                  "--", "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 0, out.stderr
    verbs = _verbs(_calls(state))
    # the stream fails, the node is PREEMPTED: worker 0's log is asked for once (a lost
    # slice answers no ssh, so the other workers are not tried), deleted and created again
    assert verbs == [*UP_GS, "describe", "collect", *DELETE, *AGAIN, *COLLECT, *DELETE]
    assert "[launch] logs of 0 of 2 worker(s) in " in out.stderr
    assert "preempted (magic-jax is PREEMPTED; attempt 1 of 2); recreating the slice" in out.stderr
    assert "launch.sh: resumed run finished" in out.stderr
    assert sorted(p.name for p in logs.iterdir()) == [
        "worker-0.attempt-2.log",
        "worker-1.attempt-2.log",
    ]


def test_a_suspended_queued_resource_is_requested_again(stub, tmp_path):
    env, state, script = stub
    config = tmp_path / "run.yaml"
    config.write_text('model: m\noutput_dir: "gs://b/cfg"  # shared\ndata:\n  output_dir: x\n')
    env = dict(env, STUB_PREEMPT="1")
    out = _launch(script, env, "--queued", "--spot", "--name", "n", "--retry", "2", "--logs",
                  str(tmp_path / "l"), "--", "magic-jax", "train", str(config))  # fmt: skip
    assert out.returncode == 0, out.stderr
    verbs = _verbs(_calls(state))
    # is there a request? no: request it; ACTIVE? (yes); the node READY, its workers
    up = ["qr-describe", "qr-create", "qr-describe", "describe", "describe", "staged?"]
    again = [*up, "setup", "start", "stream"]
    # (SUSPENDING? no: deleted)
    assert verbs == [*up, "upload", *again[6:], "qr-describe", "collect", "qr-describe",
                     "qr-delete", *again, *COLLECT]  # fmt: skip
    assert "preempted (queued resource n-qr is SUSPENDED; attempt 1 of 3)" in out.stderr
    assert "launch.sh: resumed run finished" in out.stderr
    assert (state / "created").exists()  # no --delete-on-exit: the new slice stays


def test_retries_used_up_exit_with_143(stub, tmp_path):
    env, state, script = stub
    env = dict(env, STUB_EXIT_0="143")
    out = _launch(script, env, "--retry", "1", "--delete-on-exit", "--logs", str(tmp_path / "l"),
                  "--", "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 143
    verbs = _verbs(_calls(state))
    assert verbs == UP_GS + COLLECT + DELETE + AGAIN + COLLECT + DELETE
    assert (
        "launch.sh: preempted (worker 0 stopped with 143; attempt 2 of 2); no retries left "
        "(--retry 1), exiting with 143"
    ) in out.stderr
    assert "resumed" not in out.stderr


def test_other_failures_are_not_retried(stub, tmp_path):
    env, state, script = stub
    env = dict(env, STUB_EXIT_0_1="7")
    out = _launch(script, env, "--retry", "2", "--delete-on-exit", "--logs", str(tmp_path / "l"),
                  "--", "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 7
    assert _verbs(_calls(state)) == UP_GS + COLLECT + DELETE
    assert "preempted" not in out.stderr and "worker 0 exited with 7" in out.stderr


def test_another_worker_failing_while_worker_0_runs_stops_the_job(stub, tmp_path):
    env, state, script = stub
    logs = tmp_path / "logs"
    # worker 1 ends with 9 mid-run; worker 0 runs until stopped (then exits 143, which
    # must not count as a preemption: no retry)
    env = dict(env, STUB_HOLD="50", STUB_EARLY_1="9", STUB_EXIT_1="9", STUB_EXIT_0="143")
    out = _launch(script, env, "--retry", "2", "--delete-on-exit", "--logs", str(logs), "--",
                  "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 9, out.stderr
    calls = _calls(state)
    verbs = _verbs(calls)
    assert verbs == [*UP_GS, "stop", *COLLECT, *DELETE]  # stopped, collected, no retry
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
    env, state, script = stub
    env = dict(env, STUB_HOLD="50", STUB_EARLY_1="gone", STUB_EXIT_0="143")
    out = _launch(script, env, "--logs", str(tmp_path / "l"), "--", "magic-jax", "train", *GS)
    assert out.returncode == 1, out.stderr
    assert _verbs(_calls(state)) == [*UP_GS, "stop", *COLLECT]
    assert (
        "worker 1 ended with no exit status (its command is gone) while worker 0's command "
        "still ran" in out.stderr
    )


def test_a_stop_on_another_worker_is_left_to_worker_0(stub, tmp_path):
    env, state, script = stub
    # worker 1 stopped with 143 first (a SIGTERM the processes agree on): worker 0 follows
    env = dict(env, STUB_HOLD="3", STUB_EARLY_1="143", STUB_EXIT_1="143", STUB_EXIT_0="143")
    out = _launch(script, env, "--logs", str(tmp_path / "l"), "--", "magic-jax", "train", *GS)
    assert out.returncode == 143, out.stderr
    verbs = _verbs(_calls(state), polls=True)
    assert "stop" not in verbs and verbs.count("poll") >= 3
    assert "preempted (worker 0 stopped with 143; attempt 1 of 1)" in out.stderr


def test_a_worker_still_running_after_worker_0_ended_is_stopped(stub, tmp_path):
    env, state, script = stub
    env = dict(env, STUB_HANG_1="1", STUB_EXIT_1="137", LAUNCH_GRACE_S="1")
    out = _launch(script, env, "--logs", str(tmp_path / "l"), "--", "magic-jax", "train", *GS)
    assert out.returncode == 1, out.stderr
    verbs = _verbs(_calls(state))
    assert verbs[: len(UP_GS)] == UP_GS and verbs.count("stop") == 1
    assert "worker 1's command still ran 1s after worker 0's ended: stopping it" in out.stderr
    assert "worker 1 exited with 137" in out.stderr
    assert "launch.sh: worker(s) 1 still ran 1s after worker 0 ended; stopped" in out.stderr


def test_an_ssh_drop_on_a_live_slice_reconnects(stub, tmp_path):
    env, state, script = stub
    out = _launch(
        script, dict(env, STUB_SSH_DROPS="1"), "--logs", str(tmp_path / "l"), "--", "true"
    )
    assert out.returncode == 0, out.stderr
    calls = _calls(state)
    assert _verbs(calls) == [*UP, "describe", "stream", *COLLECT]
    streams = [c[-1] for c in calls if "tail" in c[-1]]
    assert "tail -n +1 -f" in streams[0] and "tail -n 0 -f" in streams[1]  # no repeated lines
    assert "ssh to worker 0 failed (255; magic-jax is READY); reconnecting in 30s" in out.stderr


def test_a_worker_that_never_reports_its_set_up_fails_it(stub, tmp_path):
    env, state, script = stub
    out = _launch(script, dict(env, STUB_SETUP_LOST="1"), "--", "magic-jax", "train")
    assert out.returncode == 1
    assert _launch_lines(out.stderr) == [
        "launch.sh: set-up failed on worker(s) 1 (1 of 2 ready): ERROR: "
        "(gcloud.compute.tpus.tpu-vm.ssh) [/usr/bin/ssh] exited with return code [255]."
    ]
    assert "start" not in _verbs(_calls(state))


def test_ssh_down_for_15_minutes_on_a_live_slice_never_deletes_it(stub, tmp_path):
    """Every ssh fails for 15 minutes after the command started; launch.sh waits 30 s,
    then twice as long each time up to 5 minutes, reporting each failure, and never gives
    up while the slice is READY. The minutes are simulated: LAUNCH_CLOCK makes launch.sh's
    waits advance a clock in a file, which the stub reads to know when ssh is back; the
    production intervals are used unchanged."""
    env, state, script = stub
    env = dict(env, STUB_SSH_DOWN_UNTIL="900")
    out = _launch(script, env, "--retry", "3", "--delete-on-exit", "--logs", str(tmp_path / "l"),
                  "--", "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 0, out.stderr
    verbs = _verbs(_calls(state))
    # waits 30 60 120 240 300 300: back at 1050 s; one describe (still READY?) per failure
    assert verbs == [*UP_GS, *["describe", "stream"] * 6, *COLLECT, *DELETE]
    failures = [line for line in out.stderr.splitlines() if "ssh to worker 0 failed" in line]
    assert len(failures) == 6
    assert [line.split("reconnecting in ")[1].split()[0] for line in failures] == [
        "30s", "1m00s", "2m00s", "4m00s", "5m00s", "5m00s"]  # fmt: skip
    assert "(failure 6; unreachable for 12m30s; the command goes on)" in failures[-1]
    assert int((state / "clock").read_text()) == 1050
    assert "delete" not in verbs[: -len(COLLECT) - len(DELETE)] and verbs.count("create") == 1
    assert not _launch_lines(out.stderr)  # no error, no preemption


def test_no_capacity_on_recreate_is_retried_then_the_run_resumes(stub, tmp_path):
    env, state, script = stub
    # preempted (143) in run 1; creates 2 and 3 find no capacity, create 4 works
    env = dict(env, STUB_EXIT_0_1="143", STUB_NO_CAPACITY="2 3")
    out = _launch(script, env, "--spot", "--retry", "1", "--delete-on-exit", "--logs",
                  str(tmp_path / "l"), "--", "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 0, out.stderr
    verbs = _verbs(_calls(state))
    # each failed create: is a node left behind? (no)
    assert verbs == [*UP_GS, *COLLECT, *DELETE, "describe", "create", "describe", "create",
                     "describe", *AGAIN[1:], *COLLECT, *DELETE]  # fmt: skip
    why = ('There is no more capacity in the zone "us-east5-a"; you can try in another zone '
           "where Cloud TPU Nodes are offered (see https://cloud.google.com/tpu/docs/regions) "
           "[EID: 0x1bc8f9d790be9142]")  # fmt: skip
    assert (
        f"[launch] no capacity for v5p-64 in us-east5-a (try 1 of 12): {why}; trying again in 1m00s"
        in out.stderr
    )
    assert "(try 2 of 12)" in out.stderr and "trying again in 2m00s" in out.stderr
    assert int((state / "clock").read_text()) == 180
    assert "launch.sh: resumed run finished" in out.stderr


def test_no_capacity_gives_up_after_the_tries_in_one_line(stub, tmp_path):
    env, state, script = stub
    env = dict(env, STUB_NO_CAPACITY="all", LAUNCH_CREATE_TRIES="5")
    out = _launch(script, env, "--create-tries", "3", "--create-backoff-max", "90",
                  "--delete-on-exit", "--", "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 1
    assert _verbs(_calls(state)) == ["describe", *["create", "describe"] * 3]  # nothing left
    assert _launch_lines(out.stderr) == [
        "launch.sh: no capacity for v5p-64 in us-east5-a after 3 tries (--create-tries 3): "
        'There is no more capacity in the zone "us-east5-a"; you can try in another zone where '
        "Cloud TPU Nodes are offered (see https://cloud.google.com/tpu/docs/regions) "
        "[EID: 0x1bc8f9d790be9142]"
    ]
    assert int((state / "clock").read_text()) == 60 + 90  # the second wait is capped
    assert "deleting" not in out.stderr


def test_another_create_error_fails_at_once(stub, tmp_path):
    env, state, script = stub
    error = ("INVALID_ARGUMENT: Invalid value for field 'node.acceleratorType': 'v5p-7'. "
             "Invalid accelerator type.")  # fmt: skip
    out = _launch(script, dict(env, STUB_CREATE_ERROR=error), "--", "magic-jax", "train", *GS)
    assert out.returncode == 1
    assert _verbs(_calls(state)) == ["describe", "create", "describe"]
    assert _launch_lines(out.stderr) == [
        f"launch.sh: creating magic-jax failed: {error.removeprefix('INVALID_ARGUMENT: ')}"
    ]


def test_env_and_compile_cache_reach_the_command_quoted(stub, tmp_path):
    env, state, script = stub
    out = _launch(script, env, "--env", "A=1", "--env", "MSG=it's $HOME \"x\"", "--env", "EMPTY=",
                  "--compile-cache", "gs://b/jax cache", "--logs", str(tmp_path / "l"), "--",
                  "magic-jax", "train")  # fmt: skip
    assert out.returncode == 0, out.stderr
    start = next(c[-1] for c in _calls(state) if "nohup" in c[-1])
    script = start.split("<<'LAUNCH_SH'\n")[1].split("\nLAUNCH_SH\n")[0]
    assert script.splitlines()[0] == (
        "source .venv/bin/activate && export A=1 MSG=it\\'s\\ \\$HOME\\ \\\"x\\\" EMPTY='' "
        "MAGIC_JAX_COMPILATION_CACHE=gs://b/jax\\ cache && exec magic-jax train "
    )


def test_a_lost_worker_on_a_live_slice_fails_without_retry(stub, tmp_path):
    env, state, script = stub
    out = _launch(script, dict(env, STUB_VANISH="1"), "--retry", "1", "--logs", str(tmp_path / "l"),
                  "--", "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "launch.sh: worker 0's command ended without an exit status, its host not restarted "
        "(magic-jax is READY): killed?"
    )
    assert _verbs(_calls(state)).count("create") == 1


def test_maintenance_outlasting_an_hour_on_a_new_slice_is_waited_for(stub, tmp_path):
    """Worker 0's command gone, its host restarted, the node READY with health
    UNHEALTHY_MAINTENANCE for 8 polls of 10 min: on the slice this launch created, the
    wait is maintenance's, unbounded (not the new slice's hour), then the rerun on it."""
    env, state, script = stub
    env = dict(env, STUB_VANISH="1", STUB_VANISH_UNHEALTHY="8", LAUNCH_POLL_S="600")
    out = _launch(script, env, "--retry", "1", "--delete-on-exit", "--logs",
                  str(tmp_path / "l"), "--", "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 0, out.stderr
    verbs = _verbs(_calls(state))
    assert verbs.count("create") == 1 and verbs.count("delete") == 1 and verbs[-1] == "delete"
    assert int((state / "clock").read_text()) > 3600  # simulated: past the hour
    assert "magic-jax: READY (UNHEALTHY_MAINTENANCE)" in out.stderr
    assert "rerunning it on magic-jax once READY (attempt 1 of 2)" in out.stderr


def test_a_quota_error_stops_at_once_with_gclouds_message(stub, tmp_path):
    """Quota is RESOURCE_EXHAUSTED too (HTTP 429, shown by gcloud as a network error), but
    no retry can fix it: one line with gcloud's message, no backoff, nothing left."""
    env, state, script = stub
    out = _launch(script, dict(env, STUB_QUOTA="1"), "--spot", "--delete-on-exit", "--",
                  "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 1
    assert _launch_lines(out.stderr) == [
        "launch.sh: creating magic-jax failed: out of quota, which no retry can fix: Quota limit "
        "'TPUV5pPreemptiblePodPerProjectPerZoneForTPUAPI' has been exceeded. Limit: 0 in zone "
        "us-east5-a."
    ]
    assert _verbs(_calls(state)) == ["describe", "create", "describe"]
    assert not (state / "clock").exists()  # no wait


def test_a_queued_request_outlives_the_supervisor_and_is_attached_to(stub, tmp_path):
    """A queued resource waits 40 polls for capacity. The supervisor is killed (SIGKILL:
    no trap runs) at poll 20 and launched again: it attaches to the waiting request
    instead of deleting it (its place in the queue is kept), waits out the other 20 polls
    with no time limit, and the run starts and finishes."""
    env, state, script = stub
    env = dict(env, STUB_QR_WAIT="40")
    args = ["bash", str(script), "--queued", "--spot", "--retry", "1", "--logs",
            str(tmp_path / "l"), "--", "magic-jax", "train", *GS]  # fmt: skip
    first = subprocess.Popen(args, env=dict(env, STUB_QR_HANG_AT="20"), start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 30
    while not (state / "qr-hang").exists():
        assert time.monotonic() < deadline and first.poll() is None, first.communicate()
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.communicate()
    assert (state / "qr").read_text() == "WAITING_FOR_RESOURCES\n"

    out = _launch(script, env, *args[2:])
    assert out.returncode == 0, out.stderr
    verbs = _verbs(_calls(state))
    assert verbs.count("qr-create") == 1 and "qr-delete" not in verbs and "delete" not in verbs
    assert (
        "[launch] attaching to queued resource magic-jax-qr (WAITING_FOR_RESOURCES)" in out.stderr
    )
    assert len((state / "qr-polls").read_text().splitlines()) == 40
    assert "worker 0's log follows" in out.stderr and not _launch_lines(out.stderr)


def test_a_failed_queued_request_is_requested_again(stub, tmp_path):
    env, state, script = stub
    (state / "qr").write_text("FAILED\n")  # an earlier launch's request, failed since
    out = _launch(script, env, "--queued", "--logs", str(tmp_path / "l"), "--", "true")
    assert out.returncode == 0, out.stderr
    # is there a request? FAILED: why (its failedData)? SUSPENDING? delete, request again
    verbs = _verbs(_calls(state))
    assert verbs[:5] == ["qr-describe", "qr-describe", "qr-describe", "qr-delete", "qr-create"]
    assert "queued resource magic-jax-qr FAILED: There is no more capacity" in out.stderr
    assert "queued resource magic-jax-qr is FAILED; deleting it to request it again" in out.stderr


@pytest.mark.parametrize("hosts", [2, 64])
def test_a_vm_that_stops_answering_is_lost_within_a_minute_at_any_host_count(stub, tmp_path, hosts):
    """The last worker's VM stops answering mid-run: its heartbeat stops, and gcloud's
    ssh to it hangs (its own 10 tries, 5 s apart, each waiting for the TCP connect to time
    out). Time is scaled by 1/10 (status cycle 1 s, silence 2 s, probe 1.5 s): it must be
    declared lost within 6 s (60 s unscaled), and each status cycle makes the same two
    gcloud calls (the node's state, every heartbeat), 2 hosts or 64."""
    env, state, script = stub
    silent = hosts - 1
    env = dict(env, STUB_WORKERS=str(hosts), STUB_HOLD="100000", STUB_SILENT=str(silent),
               STUB_SILENT_AT="2", LAUNCH_POLL_S="1", LAUNCH_LOST_S="2",
               LAUNCH_PROBE_S="1.5")  # fmt: skip
    out = _launch(script, env, "--spot", "--logs", str(tmp_path / "l"), "--",
                  "magic-jax", "train", *GS)  # fmt: skip
    assert out.returncode == 143, out.stderr
    assert _launch_lines(out.stderr)[-1].startswith(
        f"launch.sh: a host lost (worker {silent} stopped answering (no heartbeat for "
    )
    calls = _calls(state)
    times = [int(t) for t in (state / "times").read_text().split()]
    verbs = _verbs(calls, polls=True)
    reacted = times[verbs.index("collect")]  # the logs salvaged: the verdict is in
    went_silent = int((state / "silent-at").read_text())
    assert reacted - went_silent <= 6000, (reacted - went_silent, out.stderr)
    cycles = verbs[verbs.index("stream") + 1 : verbs.index("collect")]
    assert cycles.count("poll") == cycles.count("beat") >= 2
    assert cycles.count("probe") == 1 and len(cycles) == 2 * cycles.count("poll") + 1
    print(f"{hosts} hosts: lost after {reacted - went_silent} ms; {len(cycles)} calls in "
          f"{cycles.count('poll')} cycles")  # fmt: skip


def test_heartbeats_that_cannot_be_read_are_said_so_and_the_run_goes_on(stub, tmp_path):
    """The bucket's heartbeats unreadable (a role lost on it, the storage client's 403):
    the silent workers are asked, answer, and the line says why their heartbeats are not
    seen, with the fix, once."""
    env, state, script = stub
    env = dict(env, STUB_HOLD="4", STUB_BEATS_DENIED="1", LAUNCH_LOST_S="0.05")
    out = _launch(script, env, "--logs", str(tmp_path / "l"), "--", "magic-jax", "train", *GS)
    assert out.returncode == 0, out.stderr
    assert (
        "[launch] worker(s) 0 1 answer, but their heartbeats in gs://b/magic-jax-launch/beats/"
        in out.stderr
    )
    said = [x for x in out.stderr.splitlines() if "cannot be read" in x]
    assert len(said) == 1, said  # once, not at every question
    assert said[0].endswith(
        "cannot be read: 403 run@p.iam.gserviceaccount"
        ".com does not have storage.objects.list access to the Google Cloud Storage bucket."
        " Permission 'storage.objects.list' denied on resource (or it may not exist). (the"
        " permission storage.objects.list is missing: grant the caller roles/storage.objectUser)"
    )
    assert _verbs(_calls(state)).count("create") == 1


def _lease_of(state, host, pid, age_s):
    """The stage's lease of magic-jax as a supervisor on ``host`` wrote it ``age_s`` ago."""
    path = state / "gcs/b/magic-jax-launch/supervisors/us-east5-a/magic-jax"
    path.parent.mkdir(parents=True, exist_ok=True)
    d = {"host": host, "pid": pid, "renewed": time.time() - age_s, "stale_s": 60}
    path.write_text(json.dumps(d) + "\n")
    return path


def test_a_supervisor_on_another_machine_keeps_the_slice_until_its_lease_is_stale(stub, tmp_path):
    """A lease renewed 5 s ago by a supervisor on another machine: the launch stops
    before anything, in one line naming it. Unrenewed for an hour (its machine down): the
    launch takes it over, runs, and drops it at its end."""
    env, state, script = stub
    lease = _lease_of(state, "other-machine", 4242, age_s=5)
    args = ["--delete-on-exit", "--logs", str(tmp_path / "l"), "--", "magic-jax", "train", *GS]
    out = _launch(script, env, *args)
    assert out.returncode == 1, out.stderr
    (line,) = _launch_lines(out.stderr)
    # (5 s, and the launch's own start)
    said = (r"launch\.sh: a supervisor of magic-jax runs on other-machine pid 4242 \(its lease"
            r" gs://b/magic-jax-launch/supervisors/us-east5-a/magic-jax renewed ([5-9]|1[0-9])s"
            r" ago\)")  # fmt: skip
    assert re.match(said, line), line
    assert "--attach magic-jax takes the run over" in line
    assert _verbs(_calls(state)) == []  # nothing asked of Cloud TPU, nothing deleted
    _lease_of(state, "other-machine", 4242, age_s=3600)
    out = _launch(script, env, *args)
    assert out.returncode == 0, out.stderr
    assert _verbs(_calls(state))[:2] == ["describe", "create"] and not lease.exists()


def test_a_supervisor_whose_lease_was_taken_over_stops_and_leaves_the_slice(stub, tmp_path):
    """Mid-run the lease names another machine's supervisor (this one's went stale and
    was taken over): this supervisor stops, saying who took over, and even with
    --delete-on-exit leaves the command and the slice to it."""
    env, state, script = stub
    env = dict(env, STUB_HOLD="100000", LAUNCH_POLL_S="0.5")
    lease = state / "gcs/b/magic-jax-launch/supervisors/us-east5-a/magic-jax"
    proc = subprocess.Popen(["bash", str(script), "--delete-on-exit", "--logs",
                             str(tmp_path / "l"), "--", "magic-jax", "train", *GS],
                            env=env, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        for _ in range(300):
            if lease.exists() and json.loads(lease.read_text())["pid"] == proc.pid:
                break
            time.sleep(0.1)
        renewed = json.loads(lease.read_text())["renewed"]
        for _ in range(50):  # renewed by the API's process, every second
            if json.loads(lease.read_text())["renewed"] > renewed:
                break
            time.sleep(0.1)
        assert json.loads(lease.read_text())["renewed"] > renewed
        _lease_of(state, "other-machine", 4343, age_s=0)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert _launch_lines(err)[-1] == (
        "launch.sh: the supervision of magic-jax was taken over by other-machine pid 4343 (this"
        " one's lease went stale): this supervisor stops, leaving the run and the slice to it"
    )
    verbs = _verbs(_calls(state))
    assert "delete" not in verbs and "stop" not in verbs and verbs.count("create") == 1
    assert json.loads(lease.read_text())["pid"] == 4343  # not dropped: not its own


def test_a_worker_whose_command_ended_early_is_not_taken_for_a_lost_one(stub, tmp_path):
    """Worker 1's command ends with 0 while worker 0's runs on: its last heartbeat stays
    as it is, which is no silence (scaled 1/10 as above)."""
    env, state, script = stub
    env = dict(env, STUB_HOLD="8", STUB_EARLY_1="0", LAUNCH_POLL_S="0.5", LAUNCH_LOST_S="1",
               LAUNCH_PROBE_S="0.5")  # fmt: skip
    out = _launch(script, env, "--logs", str(tmp_path / "l"), "--", "magic-jax", "train", *GS)
    assert out.returncode == 0, out.stderr
    assert "heartbeats are" not in out.stderr and "lost" not in out.stderr
    verbs = _verbs(_calls(state), polls=True)
    assert verbs.count("poll") >= 4 and "probe" not in verbs


def test_credentials_networks_and_capacity_reach_gcloud(stub, tmp_path):
    env, state, script = stub
    out = _launch(script, env, "--reserved", "--service-account", "run@p.iam.gserviceaccount.com",
                  "--network", "vpc", "--subnetwork", "tpus", "--internal-ip", "--logs",
                  str(tmp_path / "l"), "--", "true")  # fmt: skip
    assert out.returncode == 0, out.stderr
    calls = _calls(state)
    (create,) = _posts(state)
    assert create["body"]["schedulingConfig"] == {"reserved": True}
    assert create["body"]["serviceAccount"] == {"email": "run@p.iam.gserviceaccount.com"}
    assert create["body"]["networkConfig"] == {"network": "vpc", "subnetwork": "tpus"}  # no IPs
    assert all("--internal-ip" in c for c in calls if "ssh" in c or "scp" in c)

    (state / "posts").unlink()
    out = _launch(
        script,
        env,
        "--queued",
        "--name",
        "n",
        "--reservation",
        "r1",
        "--valid-until-duration",
        "6h",
        "--logs",
        str(tmp_path / "l"),
        "--",
        "true",
    )
    assert out.returncode == 0, out.stderr
    (create,) = _posts(state)
    assert "/queuedResources?queuedResourceId=n-qr&" in create["path"]
    assert create["body"]["reservationName"] == "projects/p/locations/us-east5-a/reservations/r1"
    assert create["body"]["queueingPolicy"] == {"validUntilDuration": "21600s"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--best-effort"], "--best-effort needs --queued"),
        (["--queued", "--spot", "--reserved"], "--spot, --reserved and --best-effort exclude each"),
        (["--stage", "/tmp/x"], "--stage must be a gs:// URL, got /tmp/x"),
    ],
)
def test_capacity_options_are_checked(stub, args, message):
    env, state, script = stub
    out = _launch(script, env, *args, "--", "true")
    assert out.returncode == 2 and message in out.stderr and not _calls(state)


def test_queued_spot_resource_and_delete(stub, tmp_path):
    env, state, script = stub
    out = _launch(script, env, "--queued", "--spot", "--name", "n", "--logs", str(tmp_path / "l"),
                  "--", "true")  # fmt: skip
    assert out.returncode == 0, out.stderr
    calls = _calls(state)
    (create,) = _posts(state)
    assert "queuedResourceId=n-qr" in create["path"] and "spot" in create["body"]
    (spec,) = create["body"]["tpu"]["nodeSpec"]
    assert spec["nodeId"] == "n" and spec["node"]["runtimeVersion"] == "v2-alpha-tpuv5"
    assert "schedulingConfig" not in spec["node"]  # Spot is the request's tier
    assert ["api", "get-qr", "n-qr"] in calls
    (state / "calls").unlink()
    out = _launch(script, env, "--name", "n", "--delete")
    assert out.returncode == 0, out.stderr
    assert _calls(state)[-1] == ["api", "delete-qr", "n-qr"]  # with its node (force)


def test_dry_run_prints_every_command_with_the_defaults(stub):
    env, state, script = stub
    out = _launch(script, env, "--dry-run", "--", "magic-jax", "demo")
    assert out.returncode == 0, out.stderr
    assert not _calls(state)  # nothing ran
    lines = out.stdout.splitlines()
    create = next(line for line in lines if " create " in line)
    assert create.startswith("tpu-api create magic-jax accelerator=v5p-64")
    assert "runtime-version=v2-alpha-tpuv5" in create
    assert any("scp" in line for line in lines)
    assert any("worker_setup.sh" in line and "--worker=all" in line for line in lines)
    assert any("magic-jax demo" in line and "nohup" in line and "--worker=all" in line
               for line in lines)  # fmt: skip
    assert any("tail\\ -n\\ +1\\ -f" in line and "--worker=0" in line for line in lines)


def test_dry_run_with_retry_and_delete_on_exit(stub):
    env, state, script = stub
    out = _launch(script, env, "--dry-run", "--retry", "2", "--delete-on-exit", "--", "magic-jax",
                  "train", "configs/skywork-or1-7b.yaml", "--set=output_dir=gs://b/r")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert not _calls(state)
    lines = out.stdout.splitlines()
    assert sum(" create " in line for line in lines) == 1  # a dry run is never preempted
    assert lines[-1].startswith("tpu-api delete magic-jax")
    assert any("--set=output_dir=gs://b/r" in line and "nohup" in line for line in lines)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--zonee", "z", "--", "x"], "unknown option --zonee"),
        (["--name", "p"], "no command after --"),
        (["--zone"], "--zone needs a value"),
        (["--accelerator", "tpu-9", "--", "x"], "no default runtime version"),
        (["--retry", "two", "--", "x"], "--retry must be a number of retries, got two"),
        (["--queued", "--valid-until-duration", "6x", "--", "x"],
         "--valid-until-duration must be a duration such as 6h or 90m, got 6x"),
        (["--env", "1A=x", "--", "x"],
         "--env needs KEY=VALUE with KEY a variable name (letters, digits, _), got 1A=x"),
        (["--env", "MSG", "--", "x"], "--env needs KEY=VALUE"),
        (["--env", "", "--", "x"], "--env needs a value"),
        (["--compile-cache"], "--compile-cache needs a value"),
        (["--create-tries", "0", "--", "x"],
         "--create-tries must be a number of tries (1 or more), got 0"),
        (["--create-backoff-max", "5m", "--", "x"],
         "--create-backoff-max must be a number of seconds, got 5m"),
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
    out = _launch(SCRIPT, stub[0], *args)  # the checkout's configs/
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


def test_help_is_the_header():
    out = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert out.stdout.startswith("The whole life of a run on a Cloud TPU slice")
    assert "--env KEY=VALUE" in out.stdout and "--create-tries N" in out.stdout
    assert out.stdout.rstrip().endswith("on gs://: the slice's disks go with it.")


def test_the_workers_uv_is_the_pinned_one():
    pin = re.search(r"^UV_VERSION=(\S+)", SETUP_SCRIPT.read_text(), re.M).group(1)
    constraints = (ROOT / "constraints.txt").read_text()
    assert f"\nuv=={pin}\n" in constraints
    assert f'"uv=={pin}"' in (ROOT / "setup.py").read_text()


# --------------------------------------------------------------------------- faithful stub
# Workers as on a stock TPU image (tpu-ubuntu2204-base, v2-alpha-tpuv5-lite, ...): their
# `python3` is Python 3.10, which magic-jax and jax 0.10 refuse, and nothing else is set
# up. Each is a directory $STUB_DIR/worker-W (its HOME) where `gcloud ... ssh` runs the
# command with bash and `scp` copies; its PATH is its own bin/ and a bin/ of links to the
# system tools (sysbin/), so no Python of this machine leaks in. In bin/:
# - python3: the image's 3.10. It runs a real Python 3.10 where this machine has one (so
#   uv inspects and rejects a real 3.10), else it only answers version queries. Its
#   `-m pip install --user uv==V` puts this environment's uv (the test extra's, pinned as
#   worker_setup.sh pins it) into ~/.local/bin as pip would, and fails like pip for any
#   other version: no network is used.
# - python3.X (this Python's version): a real interpreter, the one uv finds for
#   `uv venv --python 3.X` (LAUNCH_PYTHON). A real worker has none and uv downloads a
#   managed CPython instead; these workers cannot download (UV_PYTHON_DOWNLOADS=never).
# `uv pip install` installs a small wheel made here, offline, through LAUNCH_INSTALL
# (jax[tpu] cannot be installed offline); the venv, its Python and the install are real.
FAKE_PYTHON3 = r"""#!/usr/bin/env bash
if [ "${1:-}" = -m ] && [ "${2:-}" = pip ] && [ "${3:-}" = install ]; then
  for a in "$@"; do case $a in uv==*) want=${a#uv==} ;; esac; done
  if [ "${want:-}" = "@UV_VERSION@" ]; then
    mkdir -p "$HOME/.local/bin" && ln -sf "@UV@" "$HOME/.local/bin/uv"
    echo "Successfully installed uv-@UV_VERSION@"; exit 0
  fi
  echo "ERROR: Could not find a version that satisfies the requirement uv==${want:-}" \
    "(from versions: none)" >&2
  echo "ERROR: No matching distribution found for uv==${want:-}" >&2
  exit 1
fi
case "$*" in --version|-V) echo "Python 3.10.12"; exit 0 ;; esac
if [ -n "@PYTHON310@" ]; then exec "@PYTHON310@" "$@"; fi
echo "python3 (the image's 3.10, a stand-in): cannot run $*" >&2
exit 1
"""
TOOLS = ["bash", "sh", "env", "tar", "gzip", "mkdir", "cat", "rm", "cp", "mv", "ln", "ls", "sed",
         "grep", "tail", "head", "sleep", "nohup", "pkill", "pgrep", "seq", "date", "hostname",
         "curl", "tr", "wc", "dirname", "basename", "touch", "chmod", "mktemp", "sort", "cut",
         "tee", "readlink", "uname", "id", "ps", "timeout", "flock"]  # fmt: skip


def _python310() -> str:
    """A real Python 3.10 on this machine, or ''."""
    candidates = [*Path.home().glob(".pyenv/versions/3.10*/bin/python3.10")]
    candidates += [Path("/usr/bin/python3.10"), Path("/usr/local/bin/python3.10")]
    for path in candidates:
        try:
            out = subprocess.run([str(path), "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30)  # fmt: skip
        except OSError:
            continue
        if out.returncode == 0 and out.stdout.strip() == "(3, 10)":
            return str(path)
    return ""


def _wheel(path: Path) -> Path:
    """A one-module wheel (launchprobe) that `uv pip install` installs offline."""
    import base64
    import hashlib
    import zipfile

    files = {
        "launchprobe/__init__.py": b"WHERE = 'installed by uv pip install'\n",
        "launchprobe-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: launchprobe\n"
        b"Version: 0.1\n",
        "launchprobe-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: launch_test\n"
        b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("launchprobe-0.1.dist-info/RECORD,,")
    wheel = path / "launchprobe-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("launchprobe-0.1.dist-info/RECORD", "\n".join(record) + "\n")
    return wheel


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """The stock image (bin/, sysbin/) and the wheel, made once."""
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(uv).exists():
        pytest.skip("no uv in this environment (pip install -e '.[test]')")
    uv_version = subprocess.run([uv, "--version"], capture_output=True, text=True).stdout.split()[1]
    pin = re.search(r"^UV_VERSION=(\S+)", SETUP_SCRIPT.read_text(), re.M).group(1)
    if uv_version != pin:
        pytest.skip(f"this environment's uv is {uv_version}, worker_setup.sh pins {pin}")
    root = tmp_path_factory.mktemp("image")
    sysbin = root / "sysbin"
    sysbin.mkdir()
    for tool in TOOLS:
        if found := shutil.which(tool):
            (sysbin / tool).symlink_to(found)
    template = root / "home"
    (template / "bin").mkdir(parents=True)
    fake = FAKE_PYTHON3.replace("@UV_VERSION@", uv_version).replace("@UV@", uv)
    (template / "bin" / "python3").write_text(fake.replace("@PYTHON310@", _python310()))
    (template / "bin" / "python3").chmod(0o755)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    real = Path(sys._base_executable).resolve()  # the interpreter under any venv
    (template / "bin" / f"python{version}").symlink_to(real)
    return dict(sysbin=sysbin, template=template, version=version, wheel=_wheel(root))


@pytest.fixture(scope="module")
def index(image, tmp_path_factory):
    """A package index (PEP 503, over HTTP on 127.0.0.1) holding the wheel: the workers'
    `uv pip install` fetches from it as it would from PyPI."""
    import functools
    import hashlib
    import http.server
    import threading

    root = tmp_path_factory.mktemp("index")
    wheel = image["wheel"]
    (root / "files").mkdir()
    shutil.copy(wheel, root / "files" / wheel.name)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (root / "simple" / "launchprobe").mkdir(parents=True)
    (root / "simple" / "launchprobe" / "index.html").write_text(
        f'<a href="../../files/{wheel.name}#sha256={digest}">{wheel.name}</a>\n'
    )

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
    server.shutdown()


@pytest.fixture
def faithful(stub, image, index):
    env, state, script = stub
    install = f"-c constraints.txt --index-url {index} --no-deps launchprobe"
    env = dict(env, STUB_FAITHFUL="1", STUB_TEMPLATE=str(image["template"]),
               STUB_SYSBIN=str(image["sysbin"]), LAUNCH_PYTHON=image["version"],
               LAUNCH_INSTALL=install)  # fmt: skip
    return env, state, script


def _leftovers(root: Path, tries: int = 20) -> list[str]:
    """The processes still running whose command line names ``root`` (asked ``tries``
    times, 0.1 s apart, until there are none)."""
    for _ in range(tries):
        ps = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True)
        left = [line for line in ps.stdout.splitlines() if str(root) in line]
        if not left:
            return []
        time.sleep(0.1)
    return left


# The command: each worker prints its Python from inside the venv and what --env set;
# with $BUCKET (a stand-in for the run's gs:// output_dir, which outlives the slice) it
# stops with 143 the first time, as a run does on a preemption notice, and finishes the
# second.
PROBE = """
import os, sys, launchprobe
who = os.path.basename(os.environ["HOME"])
print(who, "python", sys.version.split()[0], sys.prefix, launchprobe.WHERE, flush=True)
print(who, "MSG=" + os.environ.get("MSG", "-"), "CACHE=" + os.environ.get(
    "MAGIC_JAX_COMPILATION_CACHE", "-"), flush=True)
bucket = os.environ.get("BUCKET")
if bucket and not os.path.exists(os.path.join(bucket, who)):
    open(os.path.join(bucket, who), "w").close()
    print(who, "preempted: stopping with 143", flush=True)
    sys.exit(143)
print(who, "finished", flush=True)
"""
MSG = 'it\'s $HOME "quoted"; `not run`'


def test_stock_image_workers_get_a_new_python_venv_and_run(faithful, tmp_path):
    """(i) python3 is 3.10 on every worker: uv comes through the image's pip, makes a
    3.11+ venv, installs into it, and the command runs in it; (vi) --env and
    --compile-cache reach the command on every worker, quoted; a second launch on the
    same slice skips the set-up (once per commit)."""
    env, state, script = faithful
    env = dict(env, STUB_WORKERS="4")
    logs = tmp_path / "logs"
    args = ["--env", f"MSG={MSG}", "--compile-cache", "gs://b/jax cache", "--logs", str(logs),
            "--", "python", "-c", PROBE]  # fmt: skip
    out = _launch(script, env, *args)
    assert out.returncode == 0, out.stderr
    version = image_version = env["LAUNCH_PYTHON"]
    for w in range(4):
        home = state / f"worker-{w}"
        venv = home / "magic-jax" / next(p.name for p in (home / "magic-jax").iterdir()
                                         if p.is_dir() and p.name != "logs") / ".venv"  # fmt: skip
        assert (home / ".local" / "bin" / "uv").is_symlink()  # installed by "pip"
        line = f"worker {w}: python {sys.version.split()[0]} ("
        assert line in out.stderr and f") in {venv.parent}/.venv" in out.stderr
        assert f"worker {w}: host " in out.stderr and "v5litepod-16" in out.stderr
        log = (logs / f"worker-{w}.log").read_text()
        assert (
            f"worker-{w} python {sys.version.split()[0]} {venv} installed by uv pip install" in log
        )
        assert f"worker-{w} MSG={MSG} CACHE=gs://b/jax cache" in log
        assert f"worker-{w} finished" in log
    assert image_version >= "3.11" and version == image_version
    assert "worker 0's log follows" in out.stderr and "worker-0 finished" in out.stdout
    assert not _launch_lines(out.stderr)

    again = _launch(script, env, *args)  # the slice is reused: set up already
    assert again.returncode == 0, again.stderr
    assert "reusing magic-jax (READY)" in again.stderr
    assert again.stderr.count("already installed, skipping set-up") == 4
    assert not _leftovers(tmp_path)


def test_set_up_failing_on_one_worker_is_one_line_and_starts_nothing(faithful, tmp_path):
    """(ii) worker 2 of 4 has no Python 3.11 and cannot download one: one line names it
    and uv's error; no command starts anywhere, nothing is left running, the slice is
    deleted (--delete-on-exit)."""
    env, state, script = faithful
    env = dict(env, STUB_WORKERS="4", STUB_NO_PYTHON_ON="2")
    out = _launch(script, env, "--delete-on-exit", "--logs", str(tmp_path / "l"), "--",
                  "python", "-c", PROBE, *GS)  # fmt: skip
    assert out.returncode == 1
    lines = _launch_lines(out.stderr)
    assert len(lines) == 1 and lines[0].startswith("launch.sh: set-up failed on worker 2: error: ")
    assert "more worker" not in lines[0]
    assert out.stderr.strip().splitlines()[-1] == "[launch] deleting magic-jax"
    verbs = _verbs(_calls(state))
    assert "start" not in verbs and "stream" not in verbs and verbs[-2:] == DELETE
    assert sum(f"worker {w}: ready" in out.stderr for w in range(4)) == 3
    assert not list(state.glob("worker-*/magic-jax/logs"))  # nothing was ever started
    assert not _leftovers(tmp_path)


def _launch_preempted(script, env, tmp_path):
    """A launch with one retry and --delete-on-exit of the probe command whose workers are
    preempted; returns its process and the --logs directory."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    logs = tmp_path / "logs"
    out = _launch(script, env, "--retry", "1", "--delete-on-exit", "--env", f"BUCKET={bucket}",
                  "--logs", str(logs), "--", "python", "-c", PROBE, *GS)  # fmt: skip
    return out, logs


def test_every_workers_log_is_collected_at_a_preemption_and_at_the_end(faithful, tmp_path):
    """(v) the command stops with 143 on every worker (a preemption notice): every log is
    collected, the slice is deleted and created again (new disks: set up again), the
    command resumes and finishes, and every log is collected again."""
    env, state, script = faithful
    env = dict(env, STUB_WORKERS="3")
    out, logs = _launch_preempted(script, env, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "preempted (worker 0 stopped with 143; attempt 1 of 2)" in out.stderr
    assert _launch_lines(out.stderr)[-1] == "launch.sh: resumed run finished"
    for w in range(3):
        first = (logs / f"worker-{w}.log").read_text()
        second = (logs / f"worker-{w}.attempt-2.log").read_text()
        assert f"worker-{w} preempted: stopping with 143" in first and "finished" not in first
        assert f"worker-{w} finished" in second and "preempted" not in second
    assert out.stderr.count("worker 1: ready") == 2  # set up on both slices
    assert _verbs(_calls(state)).count("create") == 2
    # each worker's log went up to the stage too, the preempted slice's included
    kept = state / "gcs/b/magic-jax-launch/logs"
    for w in range(3):
        (first,) = kept.glob(f"magic-jax-run-*-1/worker-{w}.log")
        assert "preempted: stopping with 143" in first.read_text()
        assert "finished" in next(kept.glob(f"magic-jax-run-*-2/worker-{w}.log")).read_text()
    assert not (state / "created").exists()
    assert not _leftovers(tmp_path)


def test_a_preempted_slices_every_log_comes_from_the_stage(faithful, tmp_path):
    """Every worker's command stops with 143 (a preemption notice), then the slice is
    preempted: no worker answers ssh any more. Each worker kept its log in the stage at
    its command's end, so every log of the lost slice is under --logs, read from the
    stage; the command resumes on a new slice, finishes, and its logs come by ssh."""
    env, state, script = faithful
    env = dict(env, STUB_WORKERS="3", STUB_LOST_AT_EXIT="1")
    out, logs = _launch_preempted(script, env, tmp_path)
    assert out.returncode == 0, out.stderr
    assert (state / "lost-at-exit").exists()
    assert "[launch] logs of 3 of 3 worker(s) in " in out.stderr, out.stderr
    assert "magic-jax is PREEMPTED" in out.stderr
    for w in range(3):
        first = (logs / f"worker-{w}.log").read_text()
        assert f"worker-{w} preempted: stopping with 143" in first and "finished" not in first
        assert f"worker-{w} finished" in (logs / f"worker-{w}.attempt-2.log").read_text()
    verbs = _verbs(_calls(state), polls=True)
    assert verbs.count("kept-logs") == 1 and verbs.count("create") == 2  # (run 2's came by ssh)
    assert not _leftovers(tmp_path)


def _interrupt_a_running_command(script, env, state, *args):
    """Starts a command that runs until stopped; SIGINT to launch.sh (Ctrl-C) once every
    worker's log shows it running. Returns launch.sh's exit status and stderr."""
    code = "import time\nprint('looping', flush=True)\nwhile True: time.sleep(0.1)\n"

    # as at a terminal: SIGINT at its default, even when these tests run in the background
    # (a shell starts background jobs with SIGINT ignored, and bash cannot trap a signal
    # ignored on entry)
    def as_at_a_terminal():
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(["bash", str(script), *args, "--", "python", "-c", code, *GS],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=as_at_a_terminal)  # fmt: skip
    deadline = time.monotonic() + 120  # a loaded machine: set-up and start take a while
    while True:
        logs = list(state.glob("worker-*/magic-jax/logs/*.log"))
        if len(logs) == 2 and all("looping" in p.read_text() for p in logs):
            break
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise AssertionError(f"the command never ran on both workers: {proc.communicate()}")
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    return proc.returncode, stderr


def test_ctrl_c_with_delete_on_exit_stops_collects_and_deletes(faithful, tmp_path):
    """Ctrl-C while the command runs, with --delete-on-exit: SIGTERM to the command on
    every worker (it exits 143), every log collected, the slice deleted, exit 130."""
    env, state, script = faithful
    logs = tmp_path / "logs"
    code, stderr = _interrupt_a_running_command(script, env, state, "--delete-on-exit",
                                                "--logs", str(logs))  # fmt: skip
    assert code == 130, stderr
    assert "launch.sh: interrupted: stopping the command on every worker" in stderr
    assert "[launch] logs of 2 of 2 worker(s)" in stderr
    assert stderr.strip().splitlines()[-1] == "[launch] deleting magic-jax"
    for w in range(2):
        assert "looping" in (logs / f"worker-{w}.log").read_text()
        (status,) = state.glob(f"worker-{w}/magic-jax/logs/*.exit")
        assert status.read_text() == "143\n"
    assert not (state / "created").exists()
    assert not _leftovers(tmp_path)


def test_ctrl_c_without_delete_on_exit_leaves_the_command_running(faithful, tmp_path):
    """Without --delete-on-exit, Ctrl-C leaves the slice and the detached command running
    (exit 130); another launch on the slice is refused (the TPU is in use), in one line;
    a SIGTERM to every process of a worker (a shutdown) still leaves the command's exit
    status; --delete stops both."""
    env, state, script = faithful
    code, stderr = _interrupt_a_running_command(script, env, state, "--logs", str(tmp_path))
    assert code == 130, stderr
    assert _launch_lines(stderr) == [
        "launch.sh: interrupted: the command goes on running on magic-jax, detached "
        "(tpu_scripts/launch.sh --name magic-jax --zone us-east5-a --delete stops it with the "
        "slice)"
    ]
    assert (state / "created").exists() and not list(state.glob("worker-*/magic-jax/logs/*.exit"))
    assert len(_leftovers(state, tries=1)) >= 2  # each worker's command
    again = _launch(script, env, "--no-setup", "--", "true")  # the TPU is still in use
    assert again.returncode == 1
    assert _launch_lines(again.stderr) == [
        "launch.sh: an earlier launch's command still runs on magic-jax, so the TPU is in use: "
        "wait for it, supervise it (--attach magic-jax), or stop it (--delete stops it with the "
        "slice)"
    ]
    # a host shutting down signals every process of the session, the wrapper too: the
    # command stops (143) and its status is still recorded
    home = state / "worker-1"
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if f"HOME={home}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGTERM)
        except (OSError, ProcessLookupError):
            pass
    deadline = time.monotonic() + 30
    while not list(state.glob("worker-1/magic-jax/logs/*.exit")):
        assert time.monotonic() < deadline, "no exit status after a SIGTERM to the whole session"
        time.sleep(0.1)
    (status,) = state.glob("worker-1/magic-jax/logs/*.exit")
    assert status.read_text() == "143\n"
    assert _launch(script, env, "--delete").returncode == 0
    assert not (state / "created").exists() and not _leftovers(tmp_path)


# Runs until stopped the first time on each worker (its disk keeps a mark), finishes the
# second: a run that resumes.
RESUMES = """
import os, time
who = os.path.basename(os.environ["HOME"])
mark = os.path.join(os.environ["HOME"], "started")
if not os.path.exists(mark):
    open(mark, "w").close()
    print(who, "running", flush=True)
    while True:
        time.sleep(0.1)
print(who, "resumed and finished", flush=True)
"""


def _run_resumable(script, env, state, logs):
    """launch.sh --retry 1 running RESUMES, returned once both workers' commands run."""
    proc = subprocess.Popen(["bash", str(script), "--retry", "1", "--logs", str(logs), "--",
                             "python", "-c", RESUMES, *GS], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while True:
        worker_logs = list(state.glob("worker-*/magic-jax/logs/*-1.log"))
        if len(worker_logs) == 2 and all("running" in p.read_text() for p in worker_logs):
            return proc
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)


# gcloud's command for a maintenance event on worker 0 (answered by the fake)
MAINTENANCE = ["gcloud", "alpha", "compute", "tpus", "tpu-vm", "simulate-maintenance-event",
               "magic-jax", "--zone=us-east5-a", "--workers=0"]  # fmt: skip


def test_a_maintenance_event_mid_run_reruns_on_the_same_slice(faithful, tmp_path):
    """gcloud's simulate-maintenance-event on worker 0 mid-run: its host restarts (every
    process killed, no SIGTERM, no exit status; a new boot id) and the node goes READY ->
    REPAIRING -> READY. With --retry the supervisor tells this from a killed command by
    the boot id, stops the other workers' command, and reruns it on the same slice (no
    new slice: the disks are kept), where it resumes and finishes."""
    env, state, script = faithful
    env = dict(env, STUB_REPAIR_POLLS="4")
    logs = tmp_path / "logs"
    proc = _run_resumable(script, env, state, logs)
    boot = (state / "worker-0" / "boot_id").read_text()
    event = subprocess.run(MAINTENANCE, env=env, capture_output=True, text=True)
    assert event.returncode == 0 and (state / "worker-0" / "boot_id").read_text() != boot
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "magic-jax is REPAIRING" in err  # seen by a status cycle or after an ssh failure
    assert _launch_lines(err) == [
        "launch.sh: maintenance restarted the host of worker(s) 0 under the command (its boot id "
        "changed); rerunning it on magic-jax once READY (attempt 1 of 2)",
        "launch.sh: resumed run finished",
    ]
    verbs = _verbs(_calls(state))
    assert verbs.count("create") == 1 and "delete" not in verbs  # the same slice
    for w in range(2):
        assert (
            f"worker-{w} resumed and finished" in (logs / f"worker-{w}.attempt-2.log").read_text()
        )
    # worker 1's command was stopped (SIGTERM: it recorded 143); worker 0's left nothing
    (stopped,) = (state / "worker-1/magic-jax/logs").glob("*-1.exit")
    assert stopped.read_text() == "143\n"
    assert not list((state / "worker-0/magic-jax/logs").glob("*-1.exit"))
    beats = list((state / "gcs/b/magic-jax-launch/beats").glob("*-2/worker-*"))
    ends = sorted(b.read_text().split()[:3] for b in beats)
    assert ends == [["0", "end", "exit-0"], ["1", "end", "exit-0"]]
    assert not _leftovers(tmp_path)


@pytest.mark.slow
def test_a_two_process_eval_under_launch_writes_once_and_equals_one_process(faithful, tmp_path):
    """`magic-jax eval --mesh fsdp=-1` on 2 workers x 4 CPU devices under launch.sh (the
    process id from each worker's metadata, as JAX's Cloud TPU detection reads it): the
    hosts score together, worker 0 alone writes --out, and the results equal one process
    over 8 devices."""
    from helpers import save_sums_model, sums_rows

    env, state, script = faithful
    save_sums_model(tmp_path / "model", seed=0)
    data = tmp_path / "sums.jsonl"
    # 5 problems in chunks of 2: the last chunk's one problem leaves process 0 no share
    data.write_text("".join(json.dumps(r) + "\n" for r in sums_rows(5, seed=0)))
    opts = ["--n", "2", "--max-response-length", "4", "--chunk", "2", "--workers", "1",
            "--mesh", "fsdp=-1", "--set", "rollout.max_concurrent_decodes=8",
            "--set", "rollout.decode_steps=4"]  # fmt: skip
    # -P: the worker's copy of the small repo holds only launch.sh's own modules of
    # magic_jax, which must not shadow this checkout's package from the working directory
    job = [sys.executable, "-P", "-m", "magic_jax.jobs.cli", "eval", str(tmp_path / "model"),
           str(data)]  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    knobs = ["JAX_PLATFORMS=cpu", "JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo",
             f"MAGIC_JAX_COMPILATION_CACHE={tmp_path / 'jax-cache'}"]  # fmt: skip
    both = [*knobs, "XLA_FLAGS=--xla_force_host_platform_device_count=4",
            f"MAGIC_JAX_COORDINATOR=127.0.0.1:{port}", "MAGIC_JAX_NUM_PROCESSES=2"]  # fmt: skip
    command = ('MAGIC_JAX_PROCESS_ID=$(cat "$HOME/metadata/agent-worker-number") exec '
               + shlex.join([*job, "--out", "eval-out", *opts]))  # fmt: skip
    envs = [a for kv in both for a in ("--env", kv)]
    out = subprocess.run(["bash", str(script), *envs, "--logs", str(tmp_path / "logs"), "--",
                          "bash", "-c", command], env=env, capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (written,) = state.glob("worker-0/magic-jax/*/eval-out")
    assert not list(state.glob("worker-1/magic-jax/*/eval-out"))  # process 1 wrote nothing
    for w in range(2):
        assert f"process {w} of 2" in (tmp_path / "logs" / f"worker-{w}.log").read_text()

    one = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    one.update(kv.split("=", 1) for kv in knobs)
    ref = subprocess.run([*job, "--out", str(tmp_path / "one"), *opts], env=one,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    got = [json.loads(line) for line in (written / "sums.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (tmp_path / "one/sums.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in got) == list(range(5))  # each problem written once
    assert got == want
    assert (written / "summary.json").read_text() == (tmp_path / "one/summary.json").read_text()


@pytest.mark.slow
@pytest.mark.serial  # a signal or heartbeat timed against the clock
def test_a_maintenance_event_in_real_time_is_rerun_within_a_minute_scaled(faithful, tmp_path):
    """The maintenance event above with real waits at 1/10 scale (status cycle 1 s,
    silence 2 s, probe 1.5 s, heartbeat 1 s, ssh backoff from 3 s): the status cycles
    see the node REPAIRING, then the restarted host, and the rerun starts within 10 s
    (100 s unscaled) of the event; printed (docs/tpu.md's table)."""
    env, state, script = faithful
    env = {k: v for k, v in env.items() if k != "LAUNCH_CLOCK"}
    env.update(STUB_REPAIR_POLLS="4", LAUNCH_POLL_S="1", LAUNCH_LOST_S="2", LAUNCH_PROBE_S="1.5",
               LAUNCH_HEARTBEAT_S="1", LAUNCH_SSH_BACKOFF_S="3")  # fmt: skip
    proc = _run_resumable(script, env, state, tmp_path / "l")
    deadline = time.monotonic() + 120
    t0 = time.monotonic()
    subprocess.run(MAINTENANCE, env=env, check=True)
    while not list(state.glob("worker-*/magic-jax/logs/*-2.log")):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    rerun = time.monotonic() - t0
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "magic-jax is REPAIRING (UNHEALTHY_MAINTENANCE): waiting for it" in err
    print(f"maintenance: the rerun started {rerun:.2f} s after the event (1/10 scale)")
    assert rerun < 10
