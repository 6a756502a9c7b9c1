"""What the ablation runner tells its user: how many runs and about how long before it
starts more than a few (asking first), and each run's step, entropy, accuracy and time left
while it trains (at a terminal one line per run, rewritten in place)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

YES_ENV = "MAGIC_JAX_NOTEBOOK_YES"
FEW = 4  # runs started without asking (the target x delta sweep's default grid)
# minutes per run on 2 CPU cores, by world (the notebooks' own figures); a smoke run's
# one step per stage is mostly compilation and, in the carry world, the final statistics
MINUTES = {"default": 1.5, "carry": 3.5, "lockout": 4.0, "decision": 3.0}
SMOKE_MINUTES = 1.5
PERIOD_S = 30.0  # seconds between a run's progress lines
LIVE_PERIOD_S = 2.0  # at a terminal: seconds between rewrites of the run's one line
CLEAR = "\r\x1b[K"  # back to the line's start and erase it (ANSI), as progress bars do


def estimate_minutes(worlds: Sequence[str], budget: int | None = None) -> float:
    """About how many minutes the runs of ``worlds`` (one entry per run) take on 2 cores."""
    if budget is not None:
        return SMOKE_MINUTES * len(worlds)
    return sum(MINUTES.get(w, 4.0) for w in worlds)


def confirm(n: int, minutes: float, where: Path, *, yes: bool = False) -> None:
    """Returns when ``n`` runs may start: a few, ``yes``, ``$MAGIC_JAX_NOTEBOOK_YES=1``, or a
    terminal user's answer.

    Raises:
      SystemExit: more than a few runs and nobody said yes (one line saying how to go on).
    """
    if n <= FEW or yes or os.environ.get(YES_ENV, "").strip() == "1":
        return
    line = f"{n} runs to train in {where}, about {minutes:.0f} min on 2 CPU cores"
    if sys.stdin is not None and sys.stdin.isatty():
        answer = input(f"[ablations] {line}; go on? [y/N] ").strip().lower()
        if answer in ("y", "yes"):
            return
        raise SystemExit("[ablations] stopped; nothing trained")
    raise SystemExit(
        f"[ablations] {line}: not started. Go on with --yes (a notebook or script: {YES_ENV}=1)"
    )


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            out.append(json.loads(line))
    return out


def _total_steps(raw: Path) -> int | None:
    try:
        import yaml

        cfg = yaml.safe_load((raw / "config.yaml").read_text())
        return sum(int(s["steps"]) for s in cfg["stages"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def progress_line(raw: Path, elapsed: float) -> str | None:
    """The run in ``raw``'s last step, its entropy, the latest held-out accuracy and the
    time left at the pace so far; None before its first step."""
    metrics = _records(raw / "metrics.jsonl")
    if not metrics:
        return None
    last, total = metrics[-1], _total_steps(raw)
    step = int(last.get("step", len(metrics) - 1)) + 1
    parts = [f"step {step}/{total or '?'}"]
    if last.get("entropy") is not None:
        parts.append(f"entropy {float(last['entropy']):.3f}")
    evals = _records(raw / "eval.jsonl")
    if evals and evals[-1].get("accuracy") is not None:
        parts.append(f"accuracy {float(evals[-1]['accuracy']):.3f} (step {evals[-1]['step']})")
    if total and step >= total:
        parts.append("steps done, finishing (the last evaluation and checkpoint)")
    elif total:
        parts.append(f"about {elapsed / step * (total - step) / 60:.1f} min left")
    return ", ".join(parts)


def watch(
    cmd: Sequence[str],
    raw: Path,
    logfile: Path,
    name: str,
    log: Callable[[str], None] = print,
    period_s: float | None = None,
    *,
    live: bool | None = None,
) -> int:
    """Runs ``cmd`` with its output appended to ``logfile`` and shows the run's progress
    (``progress_line`` of the run in ``raw``). Returns its exit status.

    Args:
      live: one line, rewritten in place every ``LIVE_PERIOD_S`` seconds and erased when the
        run ends; default: when ``log`` is ``print`` and stdout is a terminal. Otherwise (a
        notebook, a log file) ``log`` gets a new line every ``period_s`` (``PERIOD_S``) seconds.
    """
    if live is None:
        live = log is print and sys.stdout.isatty()
    if period_s is None:
        period_s = LIVE_PERIOD_S if live else PERIOD_S
    t0, shown = time.perf_counter(), False
    with open(logfile, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            while True:
                try:
                    return proc.wait(timeout=period_s)
                except subprocess.TimeoutExpired:
                    line = progress_line(raw, time.perf_counter() - t0)
                    text = f"[ablations] {name}: {line or 'starting (compiling)'}"
                    if live:
                        sys.stdout.write(CLEAR + text)
                        sys.stdout.flush()
                        shown = True
                    else:
                        log(text)
                except BaseException:
                    proc.terminate()  # an interrupted notebook leaves no training behind
                    proc.wait()
                    raise
        finally:
            if shown:  # the runner's next line (done, or the failure) takes its place
                sys.stdout.write(CLEAR)
                sys.stdout.flush()
