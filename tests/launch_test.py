"""tpu_scripts/launch.sh against a stub `gcloud` that records its calls (a 2-worker slice)."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tpu_scripts" / "launch.sh"

# The stub: a slice exists once created; 2 workers; each worker's command exits with
# $STUB_EXIT_<worker> (default 0). Every call is appended to $STUB_DIR/calls, one per line.
STUB = r"""#!/usr/bin/env bash
printf '%q ' gcloud "$@" >> "$STUB_DIR/calls"; echo >> "$STUB_DIR/calls"
args="$*"
worker=""; command=""
for a in "$@"; do
  case $a in --worker=*) worker=${a#--worker=} ;; esac
done
while [ $# -gt 0 ]; do [ "$1" = --command ] && command=$2; shift; done
case $args in
  *"tpu-vm describe"*"value(state)"*) [ -e "$STUB_DIR/created" ] && echo READY || exit 1 ;;
  *"tpu-vm describe"*"networkEndpoints"*) echo "10.0.0.1;10.0.0.2" ;;
  *"tpu-vm create"*|*"queued-resources create"*) touch "$STUB_DIR/created" ;;
  *"queued-resources describe"*"state.state"*)
    [ -e "$STUB_DIR/created" ] && echo ACTIVE || exit 1 ;;
  *"queued-resources describe"*) [ -e "$STUB_DIR/queued" ] && echo "$STUB_DIR/queued" || exit 1 ;;
  *" delete "*) rm -f "$STUB_DIR/created" ;;
  *"tpu-vm ssh"*)
    case $command in
      *"tail -n +1 -f"*) echo "step 0 from worker $worker" ;;
      "cat "*".log") echo "log of worker $worker" ;;
      "cat "*".exit") v="STUB_EXIT_$worker"; echo "${!v:-0}" ;;
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


def _verbs(calls):
    """Each call as 'create' / 'scp' / 'setup' / 'start' / 'stream' / 'collect' / ..."""
    out = []
    for c in calls:
        cmd = c[c.index("--command") + 1] if "--command" in c else ""
        if "ssh" in c:
            out.append(
                "setup"
                if "pip install" in cmd
                else "start"
                if "nohup" in cmd
                else "stream"
                if "tail" in cmd
                else "collect"
            )
        else:
            out.append(c[4] if c[3] == "tpu-vm" else "qr-" + c[4])
    return out


def test_create_setup_run_collect_delete(stub, tmp_path):
    env, state = stub
    logs = tmp_path / "logs"
    out = _launch(env, "--name", "pod", "--zone", "z1", "--accelerator", "v5e-8",
                  "--delete-on-exit", "--logs", str(logs), "--",
                  "magic-jax", "train", "my config.yaml")  # fmt: skip
    assert out.returncode == 0, out.stderr
    calls = _calls(state)
    verbs = _verbs(calls)
    assert verbs == ["describe", "create", "describe", "describe", "scp", "setup", "start",
                     "stream", "collect", "collect", "collect", "collect", "qr-describe",
                     "delete"]  # fmt: skip
    create = calls[1]
    assert create[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"] and "pod" in create
    assert "--accelerator-type=v5e-8" in create and "--version=v2-alpha-tpuv5-lite" in create
    assert create[5:8] == ["pod", "--zone", "z1"]
    # setup and start go to every worker; the command keeps its quoting
    assert "--worker=all" in calls[5] and "--worker=all" in calls[6]
    start = calls[6][calls[6].index("--command") + 1]
    assert "magic-jax train my\\ config.yaml" in start
    assert "--worker=0" in calls[7]  # worker 0's log is streamed
    assert "step 0 from worker 0" in out.stdout
    assert (logs / "worker-0.log").read_text() == "log of worker 0\n"
    assert (logs / "worker-1.log").read_text() == "log of worker 1\n"
    assert not (state / "created").exists()


def test_reuse_keeps_the_slice_and_returns_worker_0s_status(stub, tmp_path):
    env, state = stub
    (state / "created").touch()
    env = dict(env, STUB_EXIT_0="3", STUB_EXIT_1="4")
    out = _launch(env, "--no-setup", "--logs", str(tmp_path / "l"), "--", "python", "-V")
    assert out.returncode == 3
    verbs = _verbs(_calls(state))
    assert "create" not in verbs and "delete" not in verbs and "setup" not in verbs
    assert "reusing magic-jax (READY)" in out.stderr and "worker 1 exited with 4" in out.stderr


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
    (state / "queued").touch()
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


@pytest.mark.parametrize(
    "args, message",
    [
        (["--zonee", "z", "--", "x"], "unknown option --zonee"),
        (["--name", "p"], "no command after --"),
        (["--zone"], "--zone needs a value"),
        (["--accelerator", "tpu-9", "--", "x"], "no default runtime version"),
    ],
)
def test_errors_are_one_line(stub, args, message):
    out = _launch(stub[0], *args)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"launch.sh: {out.stderr.split(': ', 1)[1].strip()}"]
    assert message in out.stderr
    assert not _calls(stub[1])


def test_missing_gcloud(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # no gcloud (and nothing else) on PATH
    out = subprocess.run(
        ["/bin/bash", str(SCRIPT), "--", "x"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "launch.sh: gcloud not found on PATH (install the Google Cloud CLI)"
    )
