"""A run on a GKE TPU slice under JobSet: the ``xpk workload create`` command and the
equivalent JobSet manifest, from the arguments of a ``tpu_scripts/launch.sh`` run.

JobSet (jobset.x-k8s.io/v1alpha2) runs one Job of one pod per TPU host and recreates
all of them when one fails, up to ``failurePolicy.maxRestarts`` times; the run resumes
from its ``output_dir`` on ``gs://``. Only stops that a restart can mend restart it
(``jobs/restarts.py``: the list ``launch.sh`` restarts a pod run on too); any other
failure (a bad config, a Python error, out of memory, a run that lost its lock) fails
the JobSet at once.

``tpu_scripts/gke.sh`` calls ``main``; ``--dry-run`` prints both and runs nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from magic_jax.jobs.restarts import EXTRA_RESTART_EXIT_CODES, RESTART_EXIT_CODES

REPO = Path(__file__).resolve().parents[2]
CACHE_ENV = "MAGIC_JAX_COMPILATION_CACHE"  # compile_cache.ENV (no JAX import here)
CONTAINER = "magic-jax"
EXCLUSIVE = "alpha.jobset.sigs.k8s.io/exclusive-topology"
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # xpk's workload names (at most 40)
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# GKE node labels of each generation (cloud.google.com/kubernetes-engine/docs/concepts/
# plan-tpus): the accelerator, and the chips of one TPU VM of a multi-host slice (4 on
# every generation: ct4p-hightpu-4t, ct5p-hightpu-4t, ct5lp-hightpu-4t, ct6e-standard-4t).
# A v5e or v6e slice of at most 8 chips is one VM holding all of them (ct5lp-hightpu-1t/
# 4t/8t, ct6e-standard-1t/4t/8t); v4 and v5p VMs hold 4 chips (v5p-8: 4 chips, one VM).
GKE_ACCELERATOR = {
    "v4": "tpu-v4-podslice",
    "v5p": "tpu-v5p-slice",
    "v5e": "tpu-v5-lite-podslice",
    "v6e": "tpu-v6e-slice",
}
_SINGLE_HOST_MAX = {"v4": 4, "v5p": 4, "v5e": 8, "v6e": 8}
_CHIPS_PER_VM = 4


class GkeError(ValueError):
    """Arguments that make no run; the message names what is wrong, in one line."""


@dataclasses.dataclass(frozen=True)
class Slice:
    """One TPU slice as GKE schedules it.

    Attributes:
      accelerator: the gcloud accelerator type (``v5p-128``).
      generation: ``v4``, ``v5p``, ``v5e`` or ``v6e``.
      topology: the ``cloud.google.com/gke-tpu-topology`` label (``4x4x4``).
      chips: chips in the slice.
      hosts: TPU VMs (pods) in the slice.
      chips_per_host: the ``google.com/tpu`` each pod asks for.
    """

    accelerator: str
    generation: str
    topology: str
    chips: int
    hosts: int
    chips_per_host: int


def tpu_slice(accelerator: str) -> Slice:
    """The slice of a gcloud accelerator type: ``v5p-128`` is 64 chips, 16 hosts of 4."""
    from magic_jax.jobs.topology import PlanError, resolve_topology

    if not re.fullmatch(r"[a-z0-9]+-\d+", accelerator.strip().lower()):
        raise GkeError(
            f"--accelerator {accelerator!r}: expected a gcloud accelerator type "
            "(v5p-128, v5litepod-64, v6e-64, v4-32)"
        )
    try:
        name = resolve_topology(accelerator)
    except PlanError as e:
        raise GkeError(str(e).replace("--topology", "--accelerator", 1)) from None
    gen, shape = name.shape.split(":")
    per_host = name.chips if name.chips <= _SINGLE_HOST_MAX[gen] else _CHIPS_PER_VM
    return Slice(str(name.gcloud), gen, shape, name.chips, name.chips // per_host, per_host)


def output_dir(command: list[str]) -> str | None:
    """The command's ``output_dir``: its last ``--set output_dir=V``, else the top-level
    ``output_dir:`` of a YAML config it names (found here or in this checkout)."""
    value, config = None, None
    for i, arg in enumerate(command):
        if arg.startswith(("output_dir=", "--set=output_dir=")):
            value = arg.split("output_dir=", 1)[1]
        elif arg == "--set" and i + 1 < len(command) and command[i + 1].startswith("output_dir="):
            value = command[i + 1].split("=", 1)[1]
        elif arg.endswith((".yaml", ".yml")):
            config = next((p for p in (Path(arg), REPO / arg) if p.is_file()), config)
    if value is None and config is not None:
        import yaml

        found = (yaml.safe_load(config.read_text()) or {}).get("output_dir")
        value = None if found is None else str(found)
    return value.strip().strip("'\"") if value else None


def _bucket(uri: str) -> str:
    return uri[len("gs://") :].split("/", 1)[0]


def _checked_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not _ENV_KEY.fullmatch(key):
            raise GkeError(f"--env {pair!r}: expected KEY=VALUE")
        if key == CACHE_ENV:
            raise GkeError(f"--env {key}: set the compile cache with --compile-cache")
        env[key] = value
    return env


def check(args: argparse.Namespace) -> tuple[Slice, dict[str, str]]:
    """The slice and the pods' environment of valid arguments.

    Raises:
      GkeError: a bad name, accelerator, image, environment, restart count, a command
        without ``output_dir`` on ``gs://``, or a compile cache off the bucket.
    """
    if not args.command:
        raise GkeError("no command after -- (e.g. -- magic-jax train CONFIG --set ...)")
    if args.service_account and args.via == "xpk":
        raise GkeError(
            "--service-account is set in the JobSet manifest: submit it with --via kubectl"
        )
    for opt, name in (("--name", args.name), ("--cluster", args.cluster)):
        if not _NAME.fullmatch(name) or len(name) > 40:
            raise GkeError(
                f"{opt} {name!r}: lower-case letters, digits and '-', starting with "
                "a letter, at most 40 characters"
            )
    if not args.image:
        raise GkeError(
            "--image is required: an image with magic-jax installed "
            "(tpu_scripts/Dockerfile; --build builds and pushes it)"
        )
    if args.max_restarts < 0 or args.grace < 0:
        raise GkeError("--max-restarts and --grace must be zero or more")
    out = output_dir(args.command)
    why = "a restarted JobSet starts with empty disks: the run resumes from its output_dir"
    if not out:
        raise GkeError(
            f"the command has no output_dir; it must be on gs:// ({why}): pass "
            "--set output_dir=gs://BUCKET/RUN"
        )
    if not out.startswith("gs://") or not _bucket(out):
        raise GkeError(f"output_dir {out} is not on gs:// ({why})")
    env = _checked_env(args.env or [])
    cache = args.compile_cache or f"gs://{_bucket(out)}/magic-jax/compile-cache"
    if cache.lower() != "off":
        if not cache.startswith("gs://") or not _bucket(cache):
            raise GkeError(
                f"--compile-cache {cache}: must be on gs:// (or off): pods' disks "
                "go with them on every restart"
            )
        env[CACHE_ENV] = cache
    return tpu_slice(args.accelerator), {"PYTHONUNBUFFERED": "1", **env}


def xpk_command(args: argparse.Namespace, tpu: Slice, env: dict[str, str]) -> list[str]:
    """``xpk workload create`` (flags of xpk's own parser, src/xpk/parser/workload.py)."""
    where = [f"--{k}={v}" for k, v in (("project", args.project), ("zone", args.zone)) if v]
    extra = ",".join(map(str, EXTRA_RESTART_EXIT_CODES))
    return [
        "xpk",
        "workload",
        "create",
        f"--cluster={args.cluster}",
        f"--workload={args.name}",
        *where,
        f"--tpu-type={tpu.accelerator}",
        "--num-slices=1",
        f"--docker-image={args.image}",
        f"--command={shlex.join(args.command)}",
        f"--max-restarts={args.max_restarts}",
        f"--restart-on-exit-codes={extra}",
        f"--termination-grace-period-seconds={args.grace}",
        *(f"--env={k}={v}" for k, v in env.items()),
    ]


def _pod_spec(args: argparse.Namespace, tpu: Slice, env: dict[str, str]) -> dict[str, Any]:
    container = {
        "name": CONTAINER,
        "image": args.image,
        "command": list(args.command),
        "env": [{"name": k, "value": v} for k, v in env.items()],
        # 8471: the TPU runtime between hosts; 8431: its metrics; 8482: JAX's coordinator
        "ports": [{"containerPort": p} for p in (8471, 8431, 8482)],
        "resources": {"limits": {"google.com/tpu": tpu.chips_per_host}},
    }
    account = {"serviceAccountName": args.service_account} if args.service_account else {}
    return {
        **account,
        "restartPolicy": "Never",
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "terminationGracePeriodSeconds": args.grace,
        "nodeSelector": {
            "cloud.google.com/gke-tpu-accelerator": GKE_ACCELERATOR[tpu.generation],
            "cloud.google.com/gke-tpu-topology": tpu.topology,
        },
        "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [container],
    }


def manifest(args: argparse.Namespace, tpu: Slice, env: dict[str, str]) -> dict[str, Any]:
    """The JobSet: one replicated Job of ``tpu.hosts`` pods (an indexed Job, so GKE gives
    each pod ``TPU_WORKER_ID`` and ``TPU_WORKER_HOSTNAMES``: JAX starts from them)."""
    codes = {"containerName": CONTAINER, "operator": "NotIn", "values": _Flow(RESTART_EXIT_CODES)}
    job = {
        "parallelism": tpu.hosts,
        "completions": tpu.hosts,
        "completionMode": "Indexed",
        "backoffLimit": 0,  # one failed pod fails the Job; JobSet restarts them all
        # any other exit code fails the Job with reason PodFailurePolicy: no restart
        "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": codes}]},
        "template": {"spec": _pod_spec(args, tpu, env)},
    }
    no_restart = {
        "name": "failOnOtherExitCodes",
        "action": "FailJobSet",
        "onJobFailureReasons": ["PodFailurePolicy"],
    }
    metadata: dict[str, Any] = {"name": args.name}
    if args.queue:
        metadata["labels"] = {"kueue.x-k8s.io/queue-name": args.queue}
    # every pod of the slice on one node pool, that is one physical slice
    metadata["annotations"] = {EXCLUSIVE: "cloud.google.com/gke-nodepool"}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "failurePolicy": {"maxRestarts": args.max_restarts, "rules": [no_restart]},
            "replicatedJobs": [{"name": "slice", "replicas": 1, "template": {"spec": job}}],
        },
    }


class _Flow(list):
    """A list the manifest writes on one line (the 131 exit codes)."""


def dump(doc: dict[str, Any]) -> str:
    """The manifest as YAML."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(
        _Flow, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True)
    )
    return yaml.dump(doc, Dumper=Dumper, sort_keys=False, width=100)


def build_commands(image: str) -> list[list[str]]:
    """Builds ``image`` from this checkout's HEAD (tpu_scripts/Dockerfile) and pushes it."""
    archive = f"git -C {shlex.quote(str(REPO))} archive --format=tar HEAD"
    # TPU VMs are x86-64 (an arm64 laptop would build an image they cannot run)
    build = "docker build --platform linux/amd64 -f tpu_scripts/Dockerfile"
    build += f" -t {shlex.quote(image)} -"
    return [["bash", "-c", f"set -o pipefail; {archive} | {build}"], ["docker", "push", image]]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tpu_scripts/gke.sh",
        description="Run a command on a GKE TPU slice under JobSet, through xpk or kubectl.",
        epilog="e.g. tpu_scripts/gke.sh --cluster c --image IMAGE --accelerator v5p-128 -- "
        "magic-jax train configs/skywork-or1-7b.yaml --set output_dir=gs://B/runs/or1",
    )
    a = p.add_argument
    a("--cluster", required=True, help="the GKE cluster (xpk's --cluster)")
    a("--name", default="magic-jax", help="the workload and JobSet name [magic-jax]")
    a("--project", help="Google Cloud project (xpk's) [gcloud's]")
    a("--zone", help="zone (xpk's) [gcloud's]")
    a("--accelerator", default="v5p-64", help="gcloud accelerator type [v5p-64]")
    a("--image", help="container image with magic-jax installed (tpu_scripts/Dockerfile)")
    a("--build", action="store_true", help="build --image from HEAD and push it first")
    a("--env", action="append", metavar="KEY=VALUE", help="a variable for every pod")
    a(
        "--compile-cache",
        help="gs:// URI of JAX's compile cache, or off "
        "[gs://BUCKET/magic-jax/compile-cache, BUCKET of output_dir]",
    )
    a("--max-restarts", type=int, default=10, help="JobSet restarts after a stop [10]")
    a("--grace", type=int, default=120, help="seconds a pod has to stop after SIGTERM [120]")
    a(
        "--service-account",
        help="the pods' Kubernetes service account (Workload Identity: bound to a Google "
        "service account with roles on the bucket); --via kubectl",
    )
    a("--queue", help="Kueue LocalQueue of the manifest (xpk's clusters: multislice-queue)")
    a("--via", choices=("xpk", "kubectl"), default="xpk", help="how to submit [xpk]")
    a("--manifest", help="where the manifest is written [runs/gke/NAME.yaml]")
    a("--dry-run", action="store_true", help="print the commands and manifest; run nothing")
    a("command", nargs=argparse.REMAINDER, help="-- then the command every pod runs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    try:
        tpu, env = check(args)
        return _submit(args, tpu, env)
    except GkeError as e:
        print(f"gke.sh: {e}", file=sys.stderr)
        return 2


def _submit(args: argparse.Namespace, tpu: Slice, env: dict[str, str]) -> int:
    xpk = xpk_command(args, tpu, env)
    text = dump(manifest(args, tpu, env))
    steps = build_commands(args.image) if args.build else []
    if args.dry_run:
        for cmd in steps:
            print(shlex.join(cmd))
        print(
            f"# {tpu.accelerator}: {tpu.hosts} host(s) x {tpu.chips_per_host} chips "
            f"({tpu.topology}); xpk workload create:\n{shlex.join(xpk)}"
        )
        print(f"# JobSet manifest (kubectl apply -f):\n{text}", end="")
        return 0
    path = Path(args.manifest or REPO / "runs" / "gke" / f"{args.name}.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    submit = xpk if args.via == "xpk" else ["kubectl", "apply", "-f", str(path)]
    for tool in [*(("git", "docker") if steps else ()), submit[0]]:
        if shutil.which(tool) is None:
            raise GkeError(f"{tool} not found on PATH (the manifest is in {path})")
    for cmd in [*steps, submit]:
        print(f"[gke] {shlex.join(cmd)}", file=sys.stderr)
        rc = subprocess.run(cmd, cwd=REPO).returncode
        if rc != 0:
            raise GkeError(f"exit status {rc} from {shlex.join(cmd)[:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
