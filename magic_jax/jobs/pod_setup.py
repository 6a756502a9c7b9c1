"""What the supervisor does on the workers before it watches: this checkout's commit
installed on every worker (``git archive``, to the stage once per commit or by scp to
every worker, then ``tpu_scripts/worker_setup.sh``), the command started on every worker,
detached, under ``tpu_scripts/worker_run.sh``, or an earlier launch's command still
running there attached to.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from magic_jax.jobs import pod_errors, pod_state, pod_workers
from magic_jax.jobs.pod_up import Stop
from magic_jax.jobs.pod_watch import bring_down


def attempt_files(r: pod_state.Run) -> None:
    """Attempt K's files on every worker (``$L.sh``, ``.log``, ``.pid``, ``.boot``,
    ``.exit``) and its heartbeats (with a stage)."""
    r.log = f"$HOME/magic-jax/logs/{r.run_id}-{r.attempt}"
    r.beats = f"{r.stage}/beats/{r.a.name}-{r.run_id}-{r.attempt}" if r.stage else ""


def error_line(text: str) -> str:
    """The line of gcloud's error output that says what went wrong, with the fix."""
    return pod_errors.classify(text).say()


def upload(r: pod_state.Run, archive: str) -> str:
    """The archive to the stage (once per commit) or to every worker: ``""``, or why not;
    with a stage, also the workers' command that fetches it."""
    if r.stage:
        url = f"{r.stage}/archives/{r.commit}.tar.gz"
        fetch = f"gcloud storage cp {url} magic-jax-{r.commit}.tar.gz >/dev/null &&"
        if r.a.dry:
            r.ssh.show(["gcloud", "storage", "ls", url])
            r.ssh.show(["gcloud", "storage", "cp", archive, url])
            return fetch
        ls = subprocess.run(
            ["gcloud", "storage", "ls", url],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if ls.returncode != 0:
            cp = subprocess.run(
                ["gcloud", "storage", "cp", archive, url],
                stderr=subprocess.PIPE,
                text=True,
            )
            if cp.returncode != 0:
                r.setup_err = (
                    f"uploading commit {r.commit} to {url} failed: {error_line(cp.stderr)}"
                )
                return "\0"
        return fetch
    scp = [
        *pod_workers.TPU,
        "scp",
        archive,
        f"{r.a.name}:magic-jax-{r.commit}.tar.gz",
        *r.ssh.where,
        *r.ssh.via,
        "--worker=all",
    ]
    if r.ssh.run(scp) != 0:
        r.setup_err = f"copying commit {r.commit} to {r.a.name} failed"
        return "\0"
    return ""


def setup(r: pod_state.Run) -> bool:
    """Copies this commit to every worker and runs worker_setup.sh there (its lines pass
    through to stderr). On failure ``r.setup_err`` says which worker and why."""
    r.setup_err = f"setting up {r.a.name} failed"
    knobs = "".join(
        f"{k}={pod_workers.bash_quote([os.environ[k]])[0]} "
        for k in ("LAUNCH_PYTHON", "LAUNCH_INSTALL")
        if os.environ.get(k)
    )
    fd, archive = tempfile.mkstemp(prefix="launch-")
    os.close(fd)
    try:
        git = ["git", "-C", str(r.repo), "archive", "--format=tar.gz", "-o", archive, "HEAD"]
        if subprocess.run(git).returncode != 0:
            return False
        fetch = upload(r, archive)
    finally:
        os.unlink(archive)
    if fetch == "\0":
        return False
    d, c = r.dir, r.commit
    command = (
        f"mkdir -p {d} && {{ [ -e {d}/.installed ] || {{ {fetch} tar -xzf "
        f"magic-jax-{c}.tar.gz     -C {d}; }}; }} && cd {d} && "
        f"{knobs}bash tpu_scripts/worker_setup.sh {c}"
    )
    if r.a.dry:
        r.ssh.on("all", command)
        return True
    out, status = on_all_teed(r, command)
    return said_ready(r, out, status)


def on_all_teed(r: pod_state.Run, command: str) -> tuple[str, int]:
    """Runs ``command`` on every worker in one ssh, its lines passed through to stderr:
    what they said, and gcloud's exit status."""
    proc = r.ssh.spawn(
        r.ssh.ssh("all", command),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    out = pod_workers.tee(proc, sys.stderr)
    return out, pod_workers.status(proc)


def said_ready(r: pod_state.Run, out: str, rc: int) -> bool:
    """Whether every worker said it is ready; else ``r.setup_err`` says why not."""
    failed = re.findall(r"worker ([^ :]+): set-up failed: (.*)", out)
    failed.sort(key=lambda x: int(x[0]) if x[0].isdigit() else 0)
    ready = len(re.findall(r"worker [^ :]+: ready", out))
    if failed:
        (w, why), n = failed[0], len(failed)
        more = f" (and on {n - 1} more worker(s))" if n > 1 else ""
        r.setup_err = f"set-up failed on worker {w}: {why}{more}"
        return False
    if rc != 0 or ready < r.workers:
        missing = [str(w) for w in range(r.workers) if not re.search(f"worker {w}: ready", out)]
        lines = [x for x in out.splitlines() if x.strip()]
        last = lines[-1] if lines else f"gcloud exited with {rc}"
        r.setup_err = (
            f"set-up failed on worker(s) {' '.join(missing) or '?'} ({ready} of "
            f"{r.workers} ready): {last}"
        )
        return False
    return True


def running_job(r: pod_state.Run) -> bool:
    """An earlier launch's command still running on this slice, its supervisor gone: with
    --attach, or for the same command, this launch supervises it to its end instead of
    starting another (worker 0 names it in ~/magic-jax/logs/current: run id, attempt,
    commit, stage, --retry)."""
    if r.a.dry or r.created:
        return False
    command = (
        "read -r id n c s r < magic-jax/logs/current && L=$HOME/magic-jax/logs/$id-$n "
        "&& echo $id $n $c $s ${r:--} $(bash magic-jax/$c/tpu_scripts/worker_run.sh "
        "--status $L) && cat $L.sh"
    )
    rc, info = r.ssh.ask(0, command)
    if rc != 0:
        return False
    first, _, body = info.partition("\n")
    body = body.rstrip("\n")
    words = first.split()
    id_, n, c, st, retry, s = [*(words + [""] * 8)[:5], (words + [""] * 8)[6]]
    if s != "running" or not n.isdigit():
        return False
    if not r.a.attach and body != r.body:
        return False
    r.run_id, r.attempt, r.run_dir = id_, int(n), f"magic-jax/{c}"
    if st != "-":
        r.stage = st
    if not r.a.retry_given and retry.isdigit():
        r.retry, r.attempts = int(retry), int(retry) + 1
    if not r.a.command:
        r.body = body  # --attach alone: a rerun runs the same command
    if not r.a.logs:
        r.logs = str(r.repo / "runs" / "launch" / f"{r.a.name}-{r.run_id}")
    attempt_files(r)
    r.say(
        f"attaching to the command running on {r.a.name} since {r.run_id} (attempt {n} of "
        f"{r.attempts}, commit {c}); its logs go to {r.logs}"
    )
    return True


def start(r: pod_state.Run) -> bool:
    """Every worker runs the command detached under worker_run.sh; only where this commit
    is set up and no earlier launch's command still runs (the TPU would be in use)."""
    r.run_dir = r.dir
    d, log = r.dir, r.log
    command = (
        f"mkdir -p magic-jax/logs && cd {d} && [ -e .installed ] || "
        f'{{ echo "magic-jax {r.commit} is not set up in ~/{d}" >&2; exit 1; }}\n'
        "bash tpu_scripts/worker_run.sh --busy >&2 && exit 5\n"
        f"cat > {log}.sh <<'LAUNCH_SH'\n{r.body}\nLAUNCH_SH\n"
        f"echo '{r.run_id} {r.attempt} {r.commit} {r.stage or '-'} {r.retry}' > "
        "$HOME/magic-jax/logs/current\n"
        f"nohup bash tpu_scripts/worker_run.sh {log} {r.beats} {r.beat_s} > {log}.log 2>&1 "
        f"< /dev/null & echo $! > {log}.pid"
    )
    if r.a.dry:
        r.ssh.on("all", command)
        return True
    out, status = on_all_teed(r, command)
    if status == 0 or r.slice_lost():
        return True
    r.running = False
    if "the TPU is in use" in out:
        raise Stop(
            1,
            f"an earlier launch's command still runs on {r.a.name}, so the TPU is in "
            f"use: wait for it, supervise it (--attach {r.a.name}), or stop it (--delete "
            "stops it with the slice)",
        )
    bring_down(r, quiet=True)  # where it did start
    raise Stop(1, f"starting the command on {r.a.name} failed")


def body(command: list[str], envs: list[str]) -> str:
    """Each worker's ``$L.sh``: the command in its venv, with --env's exports."""
    exports = ""
    if envs:
        keys = [kv.partition("=")[0] for kv in envs]
        values = pod_workers.bash_quote([kv.partition("=")[2] for kv in envs])
        exports = "export" + "".join(f" {k}={v}" for k, v in zip(keys, values, strict=True))
        exports += " && "
    cmd = "".join(f"{w} " for w in pod_workers.bash_quote(command))
    return f"source .venv/bin/activate && {exports}exec {cmd}"


def commit_of(repo: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def dirty(repo: Path) -> bool:
    out = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    )
    return bool(out.stdout.strip())
