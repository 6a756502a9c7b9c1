"""``tpu_scripts/launch.sh``'s supervisor, run by it as ``python -m magic_jax.jobs.launch
[options] -- COMMAND...``: its options checked (each refusal one line, ``launch.sh: ...``,
exit 2), then the launch (``jobs/pod_run.py``), ``--delete``, or a dry run. The options
and what they do are launch.sh's header (its ``--help``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from magic_jax.jobs import pod_run, pod_setup, pod_state
from magic_jax.jobs.pod_up import Stop

REPO = Path(__file__).resolve().parents[2]
# options that take a value, and where it goes
VALUED = {
    "--name",
    "--zone",
    "--project",
    "--accelerator",
    "--version",
    "--reservation",
    "--valid-until-duration",
    "--service-account",
    "--network",
    "--subnetwork",
    "--stage",
    "--retry",
    "--create-tries",
    "--create-backoff-max",
    "--env",
    "--compile-cache",
    "--logs",
    "--attach",
    "--timeout",
}
FLAGS = {
    "--spot",
    "--reserved",
    "--best-effort",
    "--internal-ip",
    "--queued",
    "--no-setup",
    "--delete-on-exit",
    "--delete",
    "--dry-run",
}
VERSIONS = (
    ("v4-", "tpu-ubuntu2204-base"),
    ("v5litepod-", "v2-alpha-tpuv5-lite"),
    ("v5e-", "v2-alpha-tpuv5-lite"),
    ("v5p-", "v2-alpha-tpuv5"),
    ("v6e-", "v2-alpha-tpuv6e"),
)


class Usage(Exception):
    """A refused command line: exit 2 with its one line."""


def take(a: pod_state.Args, opt: str, value: str) -> None:
    """One option with its value."""
    if opt in ("--name", "--zone", "--project", "--accelerator", "--version", "--logs"):
        setattr(a, {"--accelerator": "accelerator"}.get(opt, opt[2:]), value)
    elif opt in ("--reservation", "--valid-until-duration"):
        a.capacity.append(f"{opt}={value}")
        if opt == "--valid-until-duration":
            a.valid = value
    elif opt == "--service-account":
        a.vm.append(f"--service-account={value}")
    elif opt in ("--network", "--subnetwork"):
        a.vm.append(f"{opt}={value}")
    elif opt == "--stage":
        a.stage = value.removesuffix("/")
    elif opt == "--retry":
        a.raw["retry"], a.retry_given = value, True
    elif opt == "--create-tries":
        a.raw["create-tries"] = value
    elif opt == "--create-backoff-max":
        a.raw["create-backoff-max"] = value
    elif opt == "--env":
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", value):
            raise Usage(
                f"--env needs KEY=VALUE with KEY a variable name (letters, digits, _), got {value}"
            )
        a.envs.append(value)
    elif opt == "--compile-cache":
        a.envs.append(f"MAGIC_JAX_COMPILATION_CACHE={value}")
    elif opt == "--attach":
        a.name, a.attach = value, True
    elif opt == "--timeout":
        a.timeout = value


# the options without a value that set a field: option -> (field, value)
SWITCHES = {
    "--internal-ip": ("internal_ip", True),
    "--queued": ("queued", True),
    "--no-setup": ("setup", False),
    "--delete-on-exit": ("delete_on_exit", True),
    "--delete": ("delete_only", True),
    "--dry-run": ("dry", True),
}


def flag(a: pod_state.Args, opt: str) -> None:
    """An option without a value: a capacity kind, or a switch."""
    if opt in ("--spot", "--reserved", "--best-effort"):
        a.capacity.append(opt)
    elif opt in SWITCHES:
        setattr(a, *SWITCHES[opt])


def parse(argv: list[str]) -> pod_state.Args:
    """The command line as options, checked in launch.sh's order."""
    a = pod_state.Args(dry=os.environ.get("DRY_RUN", "0") == "1")
    a.raw["retry"] = "0"
    a.raw["create-tries"] = os.environ.get("LAUNCH_CREATE_TRIES") or "12"
    a.raw["create-backoff-max"] = os.environ.get("LAUNCH_CREATE_BACKOFF_MAX_S") or "1800"
    i = 0
    while i < len(argv):
        opt = argv[i]
        if opt == "--":
            i += 1
            break
        if opt in VALUED:
            if i + 1 >= len(argv) or not argv[i + 1]:
                raise Usage(f"{opt} needs a value")
            take(a, opt, argv[i + 1])
            i += 2
        elif opt in FLAGS:
            flag(a, opt)
            i += 1
        else:
            raise Usage(f"unknown option {opt} (see --help)")
    a.command = argv[i:]
    check(a)
    return a


def duration_s(text: str) -> int | None:
    """gcloud's durations: 6h, 90m, 1d, 3600s, 1h30m (None: not one)."""
    total, rest = 0, text
    while m := re.match(r"^([0-9]+)([smhd])(.*)$", rest, re.S):
        total += int(m[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m[2]]
        rest = m[3]
    return None if rest else total


def check(a: pod_state.Args) -> None:
    """launch.sh's checks of its options, one line each."""
    if not (a.delete_only or a.attach or a.command):
        raise Usage(
            "no command after -- (or --delete to tear down, --attach NAME to supervise "
            "a running one)"
        )
    if not re.fullmatch(r"[0-9]*", a.timeout):
        raise Usage(f"--timeout must be a number of seconds, got {a.timeout}")
    queued_only = [c.partition("=")[0] for c in a.capacity if c != "--spot" and c != "--reserved"]
    if not a.queued and queued_only:
        raise Usage(f"{queued_only[0]} needs --queued")
    if sum(c in ("--spot", "--reserved", "--best-effort") for c in a.capacity) > 1:
        raise Usage("--spot, --reserved and --best-effort exclude each other: choose one")
    retry = a.raw["retry"]
    if not re.fullmatch(r"[0-9]+", retry):
        raise Usage(f"--retry must be a number of retries, got {retry}")
    a.retry = int(retry)
    valid_s = duration_s(a.valid)
    if valid_s is None:
        raise Usage(f"--valid-until-duration must be a duration such as 6h or 90m, got {a.valid}")
    a.valid_s = valid_s
    tries, most = a.raw["create-tries"], a.raw["create-backoff-max"]
    if not re.fullmatch(r"[1-9][0-9]*", tries):
        raise Usage(f"--create-tries must be a number of tries (1 or more), got {tries}")
    if not re.fullmatch(r"[0-9]+", most):
        raise Usage(f"--create-backoff-max must be a number of seconds, got {most}")
    a.create_tries, a.create_max_s = int(tries), int(most)
    if not a.version:
        a.version = next((v for p, v in VERSIONS if a.accelerator.startswith(p)), "")
        if not a.version:
            raise Usage(
                f"no default runtime version for accelerator {a.accelerator}: pass --version"
            )


def output_dir(command: list[str], repo: Path) -> str:
    """The command's output_dir: its last ``--set output_dir=V`` (or ``output_dir=V``),
    else the top-level ``output_dir:`` of a YAML config it names that is in this checkout
    (or here)."""
    v, cfg = "", None
    for w in command:
        if w.startswith(("--set=output_dir=", "output_dir=")):
            v = w.removeprefix("--set=").removeprefix("output_dir=")
        elif w.endswith((".yaml", ".yml")):
            if (repo / w).is_file():
                cfg = repo / w
            elif Path(w).is_file():
                cfg = Path(w)
    if not v and cfg is not None:
        found = re.findall(r"^output_dir:[ \t\r\f\v]*(.*)$", cfg.read_text(), re.M)
        v = found[-1] if found else ""
        v = re.sub(r"\s#.*$", "", v) if re.search(r"\s#", v) else v
    v = v.rstrip()
    v = v[1:] if v[:1] in ("'", '"') else v
    return v[:-1] if v[-1:] in ("'", '"') else v


def need_gs(a: pod_state.Args, repo: Path) -> None:
    """A slice that may be deleted (or replaced) under the run needs its output_dir on
    gs://; a stage defaults to the output_dir's bucket."""
    out = "" if a.delete_only else output_dir(a.command, repo)
    if not a.delete_only and a.command and (a.delete_on_exit or a.retry > 0):
        opt, why = "--delete-on-exit", "the slice's disks are deleted with it"
        if not a.delete_on_exit:
            opt, why = "--retry", "a recreated slice starts with empty disks"
        if not out:
            raise Usage(
                f"{opt} needs output_dir on gs:// ({why}); the command has none "
                "(pass --set output_dir=gs://BUCKET/RUN)"
            )
        if not re.match(r"^gs://.", out):
            raise Usage(
                f"{opt} needs output_dir on gs:// ({why}); the command's output_dir is {out}"
            )
    if not a.stage and re.match(r"^gs://.", out):
        a.stage = f"gs://{out.removeprefix('gs://').split('/')[0]}/magic-jax-launch"
    if a.stage and not re.match(r"^gs://.", a.stage):
        raise Usage(f"--stage must be a gs:// URL, got {a.stage}")
    if not a.dry and not shutil.which("gcloud"):
        raise Usage("gcloud not found on PATH (install the Google Cloud CLI)")


def project_of(a: pod_state.Args) -> str:
    """--project, else CLOUDSDK_CORE_PROJECT, else gcloud's configured project."""
    p = a.project or os.environ.get("CLOUDSDK_CORE_PROJECT", "")
    if not p and not a.dry:
        with_gcloud = subprocess.run(
            ["gcloud", "config", "get-value", "project"], capture_output=True, text=True
        )
        p = with_gcloud.stdout.strip() if with_gcloud.returncode == 0 else ""
    if not p and not a.dry:
        raise Usage("no project: pass --project P (or: gcloud config set project P)")
    return p


def prepare(r: pod_state.Run) -> None:
    """The commit to install, the run's id, its logs and each worker's command."""
    a = r.a
    try:
        r.commit = pod_setup.commit_of(r.repo)
    except (OSError, subprocess.CalledProcessError) as e:
        raise Stop(1, f"{r.repo} is not a git checkout: launch.sh installs its commit") from e
    if pod_setup.dirty(r.repo):
        r.say(f"warning: uncommitted changes are not installed (commit {r.commit} is)")
    r.dir = r.run_dir = f"magic-jax/{r.commit}"
    r.run_id = "run-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    r.logs = a.logs or str(r.repo / "runs" / "launch" / f"{a.name}-{r.run_id}")
    r.body = pod_setup.body(a.command, a.envs)


def main(argv: list[str]) -> int:
    """Runs launch.sh's command line; its exit status."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a lost terminal stops nothing
    os.environ["CLOUDSDK_CORE_DISABLE_PROMPTS"] = "1"  # never a prompt: gcloud's error instead
    try:
        a = parse(argv)
        need_gs(a, REPO)
        project = project_of(a)
    except Usage as e:
        pod_state.Run.note(str(e))
        return 2
    r = pod_state.Run(a, REPO, project)
    if a.delete_only:
        try:
            return pod_run.delete(r)
        except Stop as e:
            if e.line:
                r.note(e.line)
            return e.code
    s = pod_run.Supervisor(r)
    code = 1
    try:
        prepare(r)
        code = s.supervise()
    except Stop as e:
        if e.line:
            r.note(e.line)
        code = e.code
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:  # (before the supervisor's own handlers)
        code = 130
    finally:
        s.on_exit()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
