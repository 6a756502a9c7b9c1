"""``magic-jax status RUN_DIR``: where a stopped run will resume, and what it will redo.

Reads the run directory (local or ``gs://``) and changes nothing: the newest
checkpoint that verifies (the step the same command resumes at) and any newer
one that does not; the groups of that step's rollout already finished
(``rollout.partial``: what the resumed run loads instead of decoding); the last
metric line; the summary's verdict (finished, stopped by a signal); the run
lock's holder; and the reports of a failed or hung host (``logs/``).
"""

from __future__ import annotations

import json
from typing import Any

from magic_jax import storage


def run_status(out_dir: str) -> dict[str, Any]:
    """What ``status`` prints, as a dict (``magic-jax status --json``).

    Raises:
      RunDirError: ``out_dir`` is not a run directory of this project.
    """
    from magic_jax.rollout.partial import ROLLOUTS
    from magic_jax.run import rundir
    from magic_jax.run.checkpoint import latest_good_checkpoint, read_trainer_state, step_dirs

    out = storage.path(out_dir, what="run directory")
    if not (out / rundir.MARKER).exists():
        raise rundir.RunDirError(f"{out}: not a magic-jax run directory (no {rundir.MARKER})")
    unusable: list[str] = []
    good = latest_good_checkpoint(out, log=unusable.append)
    resume = 0 if good is None else int(read_trainer_state(good)["next_step"])
    info: dict[str, Any] = {
        "run_dir": str(out),
        "checkpoints": [s for s, _ in step_dirs(out)],
        "resumes_at_step": resume,
        "checkpoint": None if good is None else str(good),
        "unusable": unusable,
    }
    groups: dict[str, int] = {}
    root = out / ROLLOUTS / f"step_{resume:08d}"
    if root.exists():
        for r in sorted(root.iterdir()):
            groups[r.name] = sum(1 for f in r.iterdir() if f.name.endswith(".npz"))
    info["saved_groups"] = groups
    metrics = rundir.read_records(out / "metrics.jsonl")
    info["last_metric_step"] = metrics[-1]["step"] if metrics else None
    summary = out / rundir.SUMMARY
    if summary.exists():
        s = json.loads(summary.read_text())
        info["finished"] = bool(s.get("finished"))
        info["stopped_by"] = s.get("stopped_by")
    lock = out / rundir.LOCK
    info["lock"] = lock.read_text().strip() if lock.exists() else None
    logs = out / "logs"
    info["host_reports"] = sorted(f.name for f in logs.iterdir()) if logs.exists() else []
    return info


def format_status(info: dict[str, Any]) -> str:
    lines = [f"run {info['run_dir']}"]
    if info.get("finished"):
        lines.append("finished: the same command does nothing (use a new output_dir)")
    elif info.get("stopped_by"):
        lines.append(f"stopped by {info['stopped_by']}")
    if info["checkpoint"] is None:
        lines.append("no usable checkpoint: the same command starts at step 0")
    else:
        lines.append(
            f"resumes at step {info['resumes_at_step']} from {info['checkpoint']} "
            f"(checkpoints: steps {info['checkpoints']})"
        )
    lines += [f"  not usable: {u}" for u in info["unusable"]]
    if info["saved_groups"]:
        saved = ", ".join(f"{r}: {n}" for r, n in info["saved_groups"].items())
        lines.append(
            f"step {info['resumes_at_step']}: finished groups saved ({saved}), not decoded again"
        )
    last = info["last_metric_step"]
    lines.append("no metric line yet" if last is None else f"last metric line: step {last}")
    if info["lock"]:
        lines.append(f"lock: {info['lock']}")
    if info["host_reports"]:
        lines.append(f"host reports in logs/: {', '.join(info['host_reports'])}")
    return "\n".join(lines)
