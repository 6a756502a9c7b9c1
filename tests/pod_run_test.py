"""jobs/pod_run.py and jobs/launch.py without a slice: Ctrl-C and SIGTERM (the first
says what becomes of the command, a second exits at once), a lease taken over or asked
to stop by --delete, SIGHUP ignored by every gcloud call, a line to a terminal gone that
raises nothing, this machine's supervisor entry, and the option checks' one-line
refusals."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from magic_jax.jobs import launch, pod_run, pod_state

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, **kw):
    a = pod_state.Args(command=["true"], version="v2", **kw)
    return pod_state.Run(a, tmp_path, "p")


@pytest.fixture
def handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_ctrl_c_leaves_a_running_command_detached_and_a_second_exits_at_once(
    tmp_path, capfd, handlers
):
    r = _run(tmp_path, name="n", zone="z")
    s = pod_run.Supervisor(r)
    s.traps()
    r.running = True
    with pytest.raises(SystemExit) as e:
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
    assert e.value.code == 130
    assert capfd.readouterr().err == (
        "launch.sh: interrupted: the command goes on running on n, detached "
        "(tpu_scripts/launch.sh --name n --zone z --delete stops it with the slice)\n"
    )
    with pytest.raises(SystemExit) as e:  # again (SIGTERM too): at once, the first's code
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    assert e.value.code == 130
    assert capfd.readouterr().err == "launch.sh: interrupted again: exiting now\n"


def test_sigterm_before_the_command_runs_exits_143_saying_nothing(tmp_path, capfd, handlers):
    s = pod_run.Supervisor(_run(tmp_path))
    s.traps()
    with pytest.raises(SystemExit) as e:
        os.kill(os.getpid(), signal.SIGTERM)
    assert e.value.code == 143 and capfd.readouterr().err == ""


def test_a_lease_taken_over_stops_the_supervisor_leaving_the_slice(tmp_path, capfd, handlers):
    r = _run(tmp_path, name="n", delete_on_exit=True)
    s = pod_run.Supervisor(r)
    s.traps()
    r.lease, s.keeper.lost = "gs://b/s/supervisors/z/n", "other-machine pid 7"
    with pytest.raises(SystemExit) as e:
        os.kill(os.getpid(), signal.SIGUSR1)
    assert e.value.code == 1 and not r.a.delete_on_exit and not r.lease
    assert capfd.readouterr().err == (
        "launch.sh: the supervision of n was taken over by other-machine pid 7 (this one's lease"
        " went stale): this supervisor stops, leaving the run and the slice to it\n"
    )


def test_a_stop_request_stops_the_supervisor_deleting_nothing(tmp_path, capfd, handlers):
    r = _run(tmp_path, name="n", delete_on_exit=True)
    s = pod_run.Supervisor(r)
    s.traps()
    r.lease, s.keeper.deleting = "gs://b/s/supervisors/z/n", "other-machine pid 7"
    with pytest.raises(SystemExit) as e:
        os.kill(os.getpid(), signal.SIGUSR1)
    assert e.value.code == 1 and not r.a.delete_on_exit and not r.lease
    assert capfd.readouterr().err == (
        "launch.sh: n is being deleted by other-machine pid 7 (launch.sh --delete): this"
        " supervisor stops\n"
    )


def test_delete_waits_for_an_unanswered_stop_request_then_deletes_anyway(
    tmp_path, capfd, monkeypatch
):
    """A supervisor elsewhere whose lease is live but which never acknowledges (cut off):
    --delete waits its lease's stale_s and 15 s, polling every second, then says so."""
    r = _run(tmp_path, name="n", zone="z", stage=str(tmp_path / "stage"))
    uri = pod_run.lease_uri(r)
    Path(uri).parent.mkdir(parents=True)
    d = {"host": "other-machine", "pid": 7, "renewed": time.time(), "stale_s": 5}
    Path(uri).write_text(json.dumps(d) + "\n")
    clock = [0.0]
    fake = SimpleNamespace(
        monotonic=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s)
    )
    monkeypatch.setattr(pod_run, "time", fake)
    pod_run.stop_elsewhere(r)
    assert clock[0] == 20 and json.loads(Path(uri).read_text())["stop_pid"] == os.getpid()
    assert capfd.readouterr().err == (
        f"[launch] asking the supervisor of n on other-machine pid 7 to stop first (its lease in "
        f"{uri})\n[launch] the supervisor of n on other-machine pid 7 did not stop within 20s "
        "(dead or cut off): deleting n anyway\n"
    )


def test_the_supervisor_and_its_gcloud_calls_ignore_a_hang_up(tmp_path):
    """launch.main ignores SIGHUP first; what it starts inherits that (here: a dry run
    whose launch.sh-like parent hangs up on it, then on a child of its)."""
    code = (
        "import signal, subprocess, sys\n"
        "from magic_jax.jobs import launch, pod_workers\n"
        "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
        "launch.main(['--zonee'])\n"  # (refused: main ignored SIGHUP all the same)
        "w = pod_workers.Workers(name='n', where=())\n"
        "p = w.spawn(['sh', '-c', 'kill -HUP $$; echo child alive'])\n"
        "p.wait()\n"
        "signal.raise_signal(signal.SIGHUP)\n"
        "print('alive')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)))  # fmt: skip
    assert out.stdout == "child alive\nalive\n", out.stderr


def test_a_line_to_a_terminal_gone_raises_nothing():
    read, write = os.pipe()
    os.close(read)  # no reader: every write fails (EPIPE)
    saved = os.dup(2)
    try:
        os.dup2(write, 2)
        pod_state.Run.say("into the void")
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(write)


def test_the_supervisor_entry_names_a_live_supervisor_only(tmp_path):
    entry = tmp_path / ".n.supervisor"
    assert pod_run.supervisor(entry) is None  # none
    entry.write_text(f"{os.getpid()}\t/l/launch.log\n")
    assert pod_run.supervisor(entry) is None  # this process's own
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                              "magic_jax.jobs.launch"])  # fmt: skip
    try:
        entry.write_text(f"{other.pid}\t/l/launch.log\n")
        assert pod_run.supervisor(entry) == (other.pid, "/l/launch.log")
    finally:
        other.kill()
        other.wait()
    assert pod_run.supervisor(entry) is None  # gone
    sleeper = subprocess.Popen(["sleep", "60"])  # alive, but no supervisor
    try:
        entry.write_text(f"{sleeper.pid}\t\n")
        assert pod_run.supervisor(entry) is None
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--zonee", "z", "--", "x"], "unknown option --zonee (see --help)"),
        (["--zone"], "--zone needs a value"),
        (["--retry", "two", "--", "x"], "--retry must be a number of retries, got two"),
        (["--spot", "--queued", "--best-effort", "--", "x"],
         "--spot, --reserved and --best-effort exclude each other: choose one"),
        (["--valid-until-duration", "1h", "--", "x"], "--valid-until-duration needs --queued"),
    ],
)  # fmt: skip
def test_options_are_refused_in_one_line(argv, line):
    with pytest.raises(launch.Usage) as e:
        launch.parse(argv)
    assert str(e.value) == line


def test_options_as_the_slices_spec(tmp_path):
    a = launch.parse(["--queued", "--spot", "--valid-until-duration", "1h30m", "--internal-ip",
                      "--network", "vpc", "--accelerator", "v6e-8", "--", "x"])  # fmt: skip
    assert (a.version, a.valid_s, a.retry, a.command) == ("v2-alpha-tpuv6e", 5400, 0, ["x"])
    spec = a.spec()
    assert spec.spot and spec.internal_ip and spec.network == "vpc" and spec.valid_until_s == 5400
    assert a.spec_words() == ["accelerator=v6e-8", "runtime-version=v2-alpha-tpuv6e", "spot=1",
                              "valid-until-s=5400", "network=vpc", "internal-ip=1"]  # fmt: skip
    (tmp_path / "c.yaml").write_text("output_dir: 'gs://b/r'  # the run\n")
    assert launch.output_dir(["train", "c.yaml"], tmp_path) == "gs://b/r"
    assert launch.output_dir(["c.yaml", "--set", "output_dir=x"], tmp_path) == "x"
