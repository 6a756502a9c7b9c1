"""``tpu_scripts/gke.sh`` (``magic_jax.jobs.gke``): the xpk command and the JobSet manifest of
a run on GKE, from a dry run; the submission through stub ``xpk`` and ``kubectl``; the
one-line refusals. Neither xpk nor a cluster is needed."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from magic_jax.jobs import gke

REPO = Path(__file__).resolve().parents[1]
RUN = ["magic-jax", "train", "configs/skywork-or1-7b.yaml", "--set", "output_dir=gs://b/runs/or1"]
ARGS = ["--cluster", "tpu-cluster", "--image", "us-docker.pkg.dev/p/r/magic-jax:abc"]


def dry_run(capsys, *options, command=RUN):
    """The xpk command (as argv) and the manifest a dry run prints."""
    assert gke.main([*ARGS, *options, "--dry-run", "--", *command]) == 0
    out = capsys.readouterr().out
    head, _, text = out.partition("# JobSet manifest (kubectl apply -f):\n")
    return shlex.split(head.strip().splitlines()[-1]), yaml.safe_load(text)


def flags(argv):
    return dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)


@pytest.mark.parametrize(
    "accelerator, hosts, chips, topology, label",
    [
        ("v5p-128", 16, 4, "4x4x4", "tpu-v5p-slice"),  # 128 TensorCores = 64 chips
        ("v5p-8", 1, 4, "2x2x1", "tpu-v5p-slice"),
        ("v4-32", 4, 4, "2x2x4", "tpu-v4-podslice"),
        ("v5litepod-64", 16, 4, "8x8", "tpu-v5-lite-podslice"),  # N counts chips
        ("v5litepod-8", 1, 8, "2x4", "tpu-v5-lite-podslice"),  # one 8-chip VM
        ("v5litepod-4", 1, 4, "2x2", "tpu-v5-lite-podslice"),
        ("v6e-64", 16, 4, "8x8", "tpu-v6e-slice"),
        ("v6e-256", 64, 4, "16x16", "tpu-v6e-slice"),
        ("v6e-8", 1, 8, "2x4", "tpu-v6e-slice"),
    ],
)
def test_hosts_chips_and_node_selectors(capsys, accelerator, hosts, chips, topology, label):
    xpk, doc = dry_run(capsys, "--accelerator", accelerator)
    assert flags(xpk)["tpu-type"] == accelerator and flags(xpk)["num-slices"] == "1"
    (rjob,) = doc["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert rjob["replicas"] == 1
    assert job["parallelism"] == job["completions"] == hosts
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": label,
        "cloud.google.com/gke-tpu-topology": topology,
    }
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {"google.com/tpu": chips}
    assert hosts * chips == gke.tpu_slice(accelerator).chips


def test_restart_policy_command_and_environment(capsys):
    options = ["--accelerator", "v5p-128", "--name", "or1-7b", "--max-restarts", "25",
               "--env", "MAGIC_JAX_HEARTBEAT_S=90", "--env", "A=b=c", "--grace", "300"]  # fmt: skip
    xpk, doc = dry_run(capsys, *options)
    assert xpk[:3] == ["xpk", "workload", "create"]
    f = flags(xpk)
    assert f["cluster"] == "tpu-cluster" and f["workload"] == "or1-7b"
    assert f["docker-image"] == ARGS[-1] and shlex.split(f["command"]) == RUN
    assert f["max-restarts"] == "25" and f["restart-on-exit-codes"] == "69,86,124"
    assert f["termination-grace-period-seconds"] == "300"
    envs = [a.split("=", 1)[1] for a in xpk if a.startswith("--env=")]
    cache = "MAGIC_JAX_COMPILATION_CACHE=gs://b/magic-jax/compile-cache"
    assert {"MAGIC_JAX_HEARTBEAT_S=90", "A=b=c", cache} <= set(envs)

    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
    assert doc["metadata"]["name"] == "or1-7b"
    assert doc["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}  # fmt: skip
    policy = doc["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 25
    assert policy["rules"] == [{"name": "failOnOtherExitCodes", "action": "FailJobSet",
                                "onJobFailureReasons": ["PodFailurePolicy"]}]  # fmt: skip
    job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["backoffLimit"] == 0 and job["completionMode"] == "Indexed"
    (rule,) = job["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["operator"] == "NotIn"
    restart = set(rule["onExitCodes"]["values"])
    # restarted: a stop on SIGTERM (preemption), a kill, a hang, a device fault, Cloud
    # Storage down after its retries; xpk's 42 and 127-255
    assert {143, 137, 124, 86, 69, 42} <= restart and set(range(127, 256)) <= restart
    # not restarted: a bad config, a Python error (out of memory too), a peer's failure, a
    # lost run lock, a full disk
    assert not {0, 1, 2, 3, 74, 75} & restart
    assert "serviceAccountName" not in job["template"]["spec"]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] == 300
    (container,) = pod["containers"]
    assert rule["onExitCodes"]["containerName"] == container["name"]
    assert container["command"] == RUN and container["image"] == ARGS[-1]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {"PYTHONUNBUFFERED": "1", "MAGIC_JAX_HEARTBEAT_S": "90", "A": "b=c",
                   "MAGIC_JAX_COMPILATION_CACHE": "gs://b/magic-jax/compile-cache"}  # fmt: skip
    assert dict(e.split("=", 1) for e in envs) == env  # the same pods either way


def test_output_dir_from_the_config_and_cache_options(capsys, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("output_dir: gs://other/runs/x  # a comment\nseed: 1\n")
    _, doc = dry_run(capsys, "--compile-cache", "gs://c/jax", command=["magic-jax", "train",
                                                                      str(cfg)])  # fmt: skip
    env = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in env["containers"][0]["env"]}
    assert env["MAGIC_JAX_COMPILATION_CACHE"] == "gs://c/jax"
    xpk, doc = dry_run(capsys, "--compile-cache", "off", "--queue", "multislice-queue")
    assert not any("COMPILATION_CACHE" in a for a in xpk)
    assert doc["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "multislice-queue"}


@pytest.mark.parametrize(
    "options, command, expected",
    [
        (["--accelerator", "v5e-64"], RUN, "v5litepod-64"),
        (["--accelerator", "v5p-100"], RUN, "no v5p-100 slice"),
        (["--accelerator", "4x4"], RUN, "gcloud accelerator type"),
        ([], ["magic-jax", "train", "--set", "output_dir=runs/x"], "not on gs://"),
        ([], ["magic-jax", "train"], "no output_dir"),
        ([], [], "no command"),
        (["--compile-cache", "/tmp/cache"], RUN, "--compile-cache"),
        (["--env", "NOVALUE"], RUN, "KEY=VALUE"),
        (["--env", "MAGIC_JAX_COMPILATION_CACHE=gs://x/y"], RUN, "--compile-cache"),
        (["--name", "My_Run"], RUN, "--name"),
        (["--max-restarts", "-1"], RUN, "--max-restarts"),
    ],
)
def test_bad_input_is_one_line_and_prints_nothing(capsys, options, command, expected):
    assert gke.main([*ARGS, *options, "--dry-run", "--", *command]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("gke.sh: ") and expected in err, err


def test_a_service_account_reaches_the_pods_through_kubectl(capsys):
    _, doc = dry_run(capsys, "--via", "kubectl", "--service-account", "magic-jax-ksa")
    pod = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "magic-jax-ksa"
    assert gke.main([*ARGS, "--service-account", "ksa", "--dry-run", "--", *RUN]) == 2
    assert "submit it with --via kubectl" in capsys.readouterr().err


def test_an_image_is_required(capsys):
    assert gke.main(["--cluster", "c", "--dry-run", "--", *RUN]) == 2
    assert "--image is required" in capsys.readouterr().err


def _stubs(tmp_path):
    """``xpk``, ``kubectl``, ``git`` and ``docker`` that record their arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("xpk", "kubectl", "docker"):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {tmp_path}/calls\n'
                                    f'[ "$1" != build ] || cat > /dev/null\n')  # fmt: skip
        (bin_dir / tool).chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")


def _script(args, env):
    return subprocess.run([str(REPO / "tpu_scripts" / "gke.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_the_script_submits_through_xpk_or_kubectl(tmp_path):
    env = _stubs(tmp_path)
    manifest = tmp_path / "or1.yaml"
    base = [*ARGS, "--manifest", str(manifest), "--accelerator", "v6e-64"]
    proc = _script([*base, "--build", "--", *RUN], env)
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    build = f"docker build --platform linux/amd64 -f tpu_scripts/Dockerfile -t {ARGS[-1]} -"
    assert calls[0] == build
    assert calls[1] == f"docker push {ARGS[-1]}"
    assert calls[2].startswith("xpk workload create --cluster=tpu-cluster") and len(calls) == 3
    doc = yaml.safe_load(manifest.read_text())
    assert doc["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 16
    proc = _script([*base, "--via", "kubectl", "--", *RUN], env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "calls").read_text().splitlines()[3] == f"kubectl apply -f {manifest}"


def test_a_missing_tool_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no xpk here
    manifest = tmp_path / "m.yaml"
    assert gke.main([*ARGS, "--manifest", str(manifest), "--", *RUN]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "xpk not found on PATH" in err and manifest.is_file()


def test_the_image_has_python_3_11_and_the_tpu_extra():
    text = (REPO / "tpu_scripts" / "Dockerfile").read_text()
    base = next(x.split()[1] for x in text.splitlines() if x.startswith("FROM "))
    assert base.startswith("python:3.11")
    assert 'pip install -c constraints.txt ".[tpu]"' in text
    assert sys.version_info >= (3, 11)  # what setup.py's python_requires asks too


def test_the_workers_python_is_one_the_pinned_jax_supports():
    """jax 0.10 needs Python 3.11 or later, 0.11 and later 3.12: bumping the pin in
    constraints.txt must bump the worker set-up's and the image's Python with it."""
    pin = re.search(r"^jax==(\d+)\.(\d+)", (REPO / "constraints.txt").read_text(), re.M)
    needs = (3, 11) if (int(pin[1]), int(pin[2])) < (0, 11) else (3, 12)
    setup = (REPO / "tpu_scripts" / "worker_setup.sh").read_text()
    worker = re.search(r"^PYTHON=\$\{LAUNCH_PYTHON:-(\d+)\.(\d+)\}", setup, re.M)
    image = re.search(r"^FROM python:(\d+)\.(\d+)", (REPO / "tpu_scripts" / "Dockerfile")
                      .read_text(), re.M)  # fmt: skip
    for found in (worker, image):
        assert (int(found[1]), int(found[2])) >= needs, (found[0], pin[0])


def test_the_documented_command_runs_dry(capsys):
    """docs/tpu.md's gke.sh example, as written (it is a dry run)."""
    text = (REPO / "docs" / "tpu.md").read_text()
    section = text[text.index("## Runs of weeks: GKE and JobSet") :]
    start = section.index("```bash\n") + len("```bash\n")
    block = section[start : section.index("```", start)]
    words = shlex.split(block.replace("\\\n", " "))
    assert words[0] == "tpu_scripts/gke.sh" and "--dry-run" in words
    assert gke.main(words[1:]) == 0
    out = capsys.readouterr().out
    assert "docker push" in out and "--tpu-type=v5p-128" in out and "kind: JobSet" in out


@pytest.mark.parametrize(
    "error, code",
    [
        ("INTERNAL: Core halted unexpectedly: TPU chip 3 (ICI link down)", 86),
        ("UNAVAILABLE: the TPU runtime is not answering", 86),
        ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB", 1),
    ],
)
def test_device_faults_exit_with_a_code_that_restarts(capsys, monkeypatch, error, code):
    """A TPU or ICI fault (XLA's runtime error) exits 86, which the JobSet restarts; out of
    memory will fail again on new hosts, and is a plain error (1, traceback kept)."""
    import jax

    from magic_jax.jobs import cli

    def fault(args):
        raise jax.errors.JaxRuntimeError(error)

    monkeypatch.setattr(cli, "_status", fault)  # the command's body, as the parser finds it
    if code == 1:
        with pytest.raises(jax.errors.JaxRuntimeError):
            cli.main(["status", "runs/x"])
        return
    assert cli.main(["status", "runs/x"]) == code
    assert capsys.readouterr().err.strip() == (
        f"magic-jax status: error: a device or runtime fault: {error}"
    )
