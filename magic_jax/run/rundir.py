"""Run directories: ownership marker, one-run lock, stop signals, resume config check, summary.

A run directory belongs to this project once it holds the marker file
``.magic-jax-run``: ``claim_run_dir`` creates a new directory with the marker
and refuses a non-empty directory without it, so a mistyped path never mixes
(or later deletes) someone else's files. ``RunLock`` lets one process at a
time run in a directory (an ``flock`` on ``.lock``, released by the kernel when
the holder dies, so a lock left by a killed run is never stale). ``StopSignals``
turns SIGINT / SIGTERM into a flag the training loop reads at its next safe
point. ``check_resume_config`` says which options of a resumed run may change.
Summaries are built from the run directory's records, never from a process's
memory, so a run split over several processes reports its whole history.

Nothing here imports JAX.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from magic_jax import interrupt, storage
from magic_jax.run.fence import check_fence

if TYPE_CHECKING:
    from types import FrameType

MARKER = ".magic-jax-run"
LOCK = ".lock"
CONFIG = "config.yaml"
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
EVALS = "eval.jsonl"

# A JSON object as a run directory stores it (a record line, a summary, a config): its
# values are of any JSON type, which no static type narrows further. Named once here
# for the run's modules.
JSON = dict[str, Any]

# A signal's handler as ``signal.signal`` takes and gives it back (the default and ignore
# handlers are ints)
SignalHandler = Callable[[int, "FrameType | None"], object] | int | None

# Exit status of a run stopped by a signal: the shell convention 128 + signal number.
STOP_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class RunDirError(ValueError):
    """A run directory (or something in it) that cannot be used; the message names it."""


# --------------------------------------------------------------------------- marker


def claim_run_dir(path: str | os.PathLike, *, what: str = "output directory") -> Path:
    """Makes ``path`` a run directory of this project, or refuses in one line.

    A missing directory is created (with its parents) and marked; an empty one
    is marked; a directory that already holds the marker is accepted as is.
    A non-empty directory without the marker is refused: it holds files this
    project did not write, and a run must never mix with or remove them.

    Args:
      path: the directory.
      what: how error messages name it (``"output_dir"``, ``"--workdir"``).

    Returns:
      The directory, absolute.

    Raises:
      RunDirError: ``path`` is a file or lies under one, cannot be created or
        written, or is a non-empty directory without the marker.
    """
    if storage.is_gcs(path):
        return _claim_gcs(path, what)
    p = Path(path).absolute()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunDirError(f"{what} {p}: exists and is not a directory") from None
    except NotADirectoryError:
        raise RunDirError(f"{what} {p}: a parent of it is a file, not a directory") from None
    except OSError as e:
        raise RunDirError(f"{what} {p}: cannot create it: {e.strerror or e}") from None
    marker = p / MARKER
    if marker.exists():
        return p
    try:
        entries = sorted(os.listdir(p))
    except OSError as e:
        raise RunDirError(f"{what} {p}: cannot list it: {e.strerror or e}") from None
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise RunDirError(
            f"{what} {p}: not empty ({shown}) and not a magic-jax run directory (no {MARKER}); "
            f"choose a new or empty directory"
        )
    try:
        write_atomic(marker, json.dumps({"created": now(), "host": socket.gethostname()}) + "\n")
    except OSError as e:
        raise RunDirError(f"{what} {p}: cannot write to it: {e.strerror or e}") from None
    return p


def _claim_gcs(path: str | os.PathLike, what: str) -> storage.StoragePath:
    """``claim_run_dir`` for a ``gs://`` prefix: the same rules, asked of the bucket."""
    storage.check(path, what=what)
    p = storage.path(path, what=what)
    if (p / MARKER).exists():
        return p
    entries = sorted(storage.listing(p))
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise RunDirError(
            f"{what} {p}: not empty ({shown}) and not a magic-jax run directory (no {MARKER}); "
            f"choose a new or empty directory"
        )
    marker = {"created": now(), "host": socket.gethostname()}
    storage.write_text(p / MARKER, json.dumps(marker) + "\n")
    return p


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def write_atomic(path: storage.StoragePath, text: str) -> None:
    """Writes ``text`` to ``path`` whole or not at all (a reader never sees half a file).

    Fenced: a process whose run lock on Cloud Storage is lost, or may be, writes
    nothing (``fence.check_fence``, which asks the lock object first: these are
    the writes that make records, configs and checkpoints count).

    Raises:
      LockLost: this process no longer holds its run lock.
    """
    check_fence(Path(str(path)).name, server=True)
    storage.write_text(path, text)


# --------------------------------------------------------------------------- signals


class StopSignals:
    """SIGINT / SIGTERM set a flag instead of ending the process, while installed.

    The flag is ``interrupt.request``'s: the rollout stops at its next decode
    chunk and the update at its next optimizer step (``interrupt.Interrupted``),
    and between steps the loop reads ``received``, writes a checkpoint and
    returns. A second signal of either kind
    while the first is pending ends the process at once (exit status 128 +
    signal), for a user who does not want to wait for the step to finish.
    Only the main thread can install handlers; elsewhere this does nothing.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, SignalHandler] = {}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        # os.write, not print: the handler may run in the middle of a print to stdout
        if self.received is not None:
            stderr_line(f"[stop] {name} again: stopping now, without a checkpoint\n")
            os._exit(STOP_EXIT_CODES.get(signal.Signals(signum), 128 + signum))
        self.received = signum
        interrupt.request(signum)
        stderr_line(
            f"[stop] {name}: stopping at the next decode chunk or optimizer step; finished "
            "groups and the last checkpoint are kept (again: at once)\n"
        )

    def __enter__(self) -> StopSignals:
        interrupt.clear()
        if threading.current_thread() is threading.main_thread():
            for s in STOP_EXIT_CODES:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *_: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
        interrupt.clear()


def stderr_line(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, text.encode())


# --------------------------------------------------------------------------- config on resume

# Options a resumed run may change: they decide how long the run goes on and what
# it reports, not what the steps already taken computed. ``stages[i].steps`` is
# checked on its own (stages already finished keep their length).
MAY_CHANGE = (
    "checkpoint_every",
    "keep_checkpoints",
    "watchdog_s",
    "profile_steps",
    "eval.every",
    "export_hf",
    "export_dtype",
    "update.layer_unroll",
    "update.mlp_kernel",
    "mesh",
    "rewards.num_workers",
    "output_dir",
    "extensions",  # what they register is named by the options that use it
)
# Options added after runs were stored: a stored config without one ran with this value.
ADDED_DEFAULTS: JSON = {
    "advantage.estimator": "grpo",
    "entropy.tokens": None,
    "rewards.abilities": {},
    "rollout.cache_bucket": 128,
    "rollout.layer_unroll": None,
    "sampling.method": None,
    "sampling.options": {},
}


def _flatten(value: object, prefix: str = "") -> dict[str, object]:
    """Dotted paths -> leaves; lists of mappings (stages) are indexed ``stages[1].steps``."""
    if isinstance(value, Mapping):
        out: dict[str, object] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out or {prefix: {}}
    if isinstance(value, list | tuple) and value and all(isinstance(v, Mapping) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: list(value) if isinstance(value, tuple) else value}


def _may_change(path: str) -> bool:
    return any(path == p or path.startswith(p + ".") for p in MAY_CHANGE)


def check_resume_config(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    done_steps: int,
    current_stage: int | None = None,
) -> list[str]:
    """The options that differ between a run's stored config and its new one, if allowed.

    Step budgets, evaluation cadence, checkpointing, export and the mesh may
    change; the stages already finished keep their step counts (their steps are
    done), and the stage in progress cannot be shortened below what it has
    done. Everything else (seed, model, data, batch shapes, the objective,
    sampling) would make the resumed run a different experiment; a stage not
    yet begun may still be reshaped.

    Args:
      old: the stored config (``config.yaml``), as plain values.
      new: the new config, as plain values.
      done_steps: steps the run has completed (the resume step).
      current_stage: the stage the run resumes in, from its checkpoint; without
        it, stages are placed by their step counts (a stage that ended early on
        a rule moves every later stage earlier, so pass it when known).

    Returns:
      ``"path: old -> new"`` for each allowed change (for the log).

    Raises:
      RunDirError: one line naming every option that may not change.
    """
    a, b = ({**ADDED_DEFAULTS, **_flatten(dict(c))} for c in (old, new))
    old_stages, new_stages = list(old.get("stages") or ()), list(new.get("stages") or ())
    starts = [sum(int(s.get("steps", 0)) for s in old_stages[:i]) for i in range(len(old_stages))]

    def begun(i: int) -> bool:
        if i >= len(old_stages):
            return False  # an added stage
        if current_stage is not None:
            return i <= current_stage
        return starts[i] < done_steps

    def finished(i: int) -> bool:
        if current_stage is not None:
            return i < current_stage
        return starts[i] + int(old_stages[i].get("steps", 0)) <= done_steps

    refused, changed = [], []
    for i, st in enumerate(old_stages):
        if i >= len(new_stages):
            if begun(i):
                refused.append(f"stages[{i}] (removed, but it has run)")
        elif finished(i):
            if new_stages[i].get("steps") != st.get("steps"):
                refused.append(f"stages[{i}].steps (the stage has finished)")
        elif begun(i) and starts[i] + int(new_stages[i].get("steps", 0)) < done_steps:
            refused.append(f"stages[{i}].steps (the stage has done {done_steps - starts[i]})")
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key):
            continue
        desc = f"{key}: {a.get(key)!r} -> {b.get(key)!r}"
        step_budget = key.startswith("stages[") and key.endswith("].steps")
        if _may_change(key) or step_budget:
            changed.append(desc)
            continue
        if key.startswith("stages[") and not begun(int(key[len("stages[") : key.index("]")])):
            changed.append(desc)  # a stage not yet begun: its plan may change
            continue
        refused.append(key)
    if refused:
        raise RunDirError(
            f"the run has done {done_steps} steps with other settings; these may not change on "
            f"resume: {', '.join(refused)} (use a new output_dir for a new experiment)"
        )
    return changed


# --------------------------------------------------------------------------- records


def read_records(path: str | os.PathLike) -> list[JSON]:
    """The JSON lines of a record file (``[]`` if absent); a torn last line is skipped."""
    p = storage.path(path)
    if not p.exists():
        return []
    rows = []
    for line in p.read_bytes().decode("utf-8", "replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
    return rows


def trim_records(out: str | os.PathLike, next_step: int) -> dict[str, int]:
    """Drops the record lines a resumed run computes again (and any torn line).

    Steps ``>= next_step`` are dropped from ``metrics.jsonl``; evaluations after
    ``next_step`` from ``eval.jsonl`` (the evaluation at ``next_step`` itself was
    written before its checkpoint and is kept, except at step 0, which a run
    that starts over evaluates again).

    Returns:
      Lines dropped per file name.
    """
    dropped = {}
    for name, keep in (
        (METRICS, lambda s: s < next_step),
        (EVALS, lambda s: s < next_step or (s == next_step and next_step > 0)),
    ):
        path = storage.path(out) / name
        if not path.exists():
            continue
        lines = path.read_bytes().decode("utf-8", "replace").splitlines()
        rows = read_records(path)
        kept = [r for r in rows if keep(r["step"])]
        if len(kept) != len(lines):
            write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
        dropped[name] = len(lines) - len(kept)
    return dropped


def build_summary(
    out: str | os.PathLike, *, total_steps: int, planned_steps: int | None = None, **fields: object
) -> JSON:
    """A run's summary from its records: every step's metrics and evaluation on disk.

    Args:
      out: the run directory.
      total_steps: the step count at which the run is finished (``finished``
        when that many steps are recorded).
      planned_steps: the config's step budget (default ``total_steps``; more
        when a stage ended early on a rule); a finished run is recognised by it.
      **fields: values of the final train state (optimizer steps, entropy coefficient ...).
    """
    metrics = read_records(storage.path(out) / METRICS)
    evals = read_records(storage.path(out) / EVALS)
    steps = metrics[-1]["step"] + 1 if metrics else 0
    return {
        "steps": steps,
        "finished": steps >= total_steps,
        "planned_steps": total_steps if planned_steps is None else planned_steps,
        **fields,
        "last": metrics[-1] if metrics else None,
        "evals": [{"step": e["step"], "accuracy": e.get("accuracy")} for e in evals],
    }


def write_summary(out: str | os.PathLike, summary: Mapping[str, object]) -> None:
    """Writes ``summary.json`` whole or not at all."""
    write_atomic(storage.path(out) / SUMMARY, json.dumps(dict(summary), indent=2) + "\n")


def finished_summary(out: str | os.PathLike, planned_steps: int) -> JSON | None:
    """The stored summary of a finished run planned for ``planned_steps``, else None
    (a run given more steps since it finished goes on)."""
    path = storage.path(out) / SUMMARY
    if not path.exists():
        return None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # rebuilt at the end of this run
    if not isinstance(summary, dict) or not summary.get("finished"):
        return None
    return summary if summary.get("planned_steps", summary.get("steps")) == planned_steps else None


def stored_config(out: str | os.PathLike) -> JSON | None:
    """The ``config.yaml`` a run directory holds (None if it has none)."""
    import yaml

    path = storage.path(out) / CONFIG
    if not path.exists():
        return None
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise RunDirError(f"{path}: unreadable stored config: {e}") from None
    if not isinstance(raw, dict):
        raise RunDirError(f"{path}: the stored config is not a mapping of options")
    return raw


def write_config(out: str | os.PathLike, raw: Mapping[str, object]) -> None:
    """Stores a run's resolved config as ``config.yaml``."""
    import yaml

    write_atomic(storage.path(out) / CONFIG, yaml.safe_dump(dict(raw), sort_keys=False))


__all__: Sequence[str] = (
    "MARKER",
    "RunDirError",
    "StopSignals",
    "build_summary",
    "check_resume_config",
    "claim_run_dir",
    "finished_summary",
    "read_records",
    "stored_config",
    "trim_records",
    "write_config",
    "write_summary",
)
