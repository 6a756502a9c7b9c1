"""tpu_scripts/launch.sh: argument handling and the gcloud commands it would run (dry run)."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tpu_scripts" / "launch.sh"


def _run(*args):
    env = dict(os.environ, DRY_RUN="1")
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env)


def test_dry_run_targets_all_workers():
    out = _run("pod", "us-central2-b", "--project", "p1", "--", "magic-jax", "export", "a", "b")
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.strip().splitlines()
    assert line.startswith("gcloud compute tpus tpu-vm ssh pod --zone us-central2-b --project p1")
    assert "--worker=all" in line and "magic-jax\\ export\\ a\\ b" in line


def test_setup_copies_and_installs_then_runs():
    out = _run("pod", "zone-a", "--setup", "--", "magic-jax", "demo")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3
    assert "tpu-vm scp" in lines[0] and "--worker=all" in lines[0]
    assert ".[tpu]" in lines[1].replace("\\", "") and "constraints.txt" in lines[1]


def test_missing_command_is_an_error():
    out = _run("pod", "zone-a")
    assert out.returncode == 2 and "no command" in out.stderr
    assert _run("pod", "zone-a", "--bogus", "--", "x").returncode == 2
