"""One ablation run: its ``magic-jax train`` command line, the run in a fresh process, its
records collected (gzip-compressed) with a ``run.json`` into ``<results>/runs/<arm>/seed<k>/``.

``magic_jax.experiments.ablations`` (the runner and its command line) re-exports these.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from magic_jax.experiments import progress
from magic_jax.experiments.arms import ABLATIONS, WORLDS, Arm
from magic_jax.experiments.prereg import head_state
from magic_jax.experiments.results import raw_dir, rerun_command, summary_dir, train_config

# --------------------------------------------------------------------------- one run


def overrides_for(
    arm: Arm, seed: int, budget: int | None = None, world: str = "default"
) -> list[str]:
    """Every ``--set`` of one run except ``output_dir``."""
    w = WORLDS[world]
    steps = w.stage_steps if budget is None else budget
    evals = w.eval_overrides if budget is None else (f"eval.every={steps}", "eval.num_samples=1")
    export = "export_hf=true" if w.statistics else "export_hf=false"
    ckpt = w.run_overrides if budget is None else (export, f"checkpoint_every={steps}")
    return [*evals, *ckpt, *arm.step_overrides(steps), *arm.overrides, f"seed={seed}"]


def train_command(
    arm: Arm,
    seed: int,
    output_dir: str | os.PathLike,
    budget: int | None = None,
    *,
    config: str | os.PathLike | None = None,
    world: str = "default",
) -> list[str]:
    """The ``magic-jax train`` command line of one run (a list of arguments).

    ``config`` defaults to the world's config as typed in a checkout
    (``configs/default.yaml``: the file the package ships, ``train_config()``).
    """
    cmd = ["magic-jax", "train", str(config or WORLDS[world].config)]
    for o in [*overrides_for(arm, seed, budget, world), f"output_dir={output_dir}"]:
        cmd += ["--set", o]
    return cmd


RECORD_FILES = ("metrics.jsonl", "eval.jsonl", "config.yaml", "world.json")
PACKED = ("metrics.jsonl", "eval.jsonl")  # stored gzip-compressed (``<name>.gz``)
WORLD_SAMPLES = 4  # samples per held-out problem for a finished run's world statistics


def measure_world(raw: Path, num_samples: int = WORLD_SAMPLES) -> dict:
    """``world_statistics`` of a finished carry-world run's final model (its Hugging Face
    export) on the run's held-out problems; written to ``<raw>/world.json``."""
    import yaml

    from magic_jax.jobs.carry_world import model_statistics
    from magic_jax.jobs.worlds import read_rows_file

    cfg = yaml.safe_load((raw / "config.yaml").read_text())
    rows = [r for f in cfg["eval"]["data"] for r in read_rows_file(Path(f))]
    stats = model_statistics(raw / "hf_final", rows, num_samples=num_samples, seed=cfg["seed"])
    (raw / "world.json").write_text(json.dumps(stats, indent=1) + "\n")
    return stats


def _collect(raw: Path, dest: Path, record: dict) -> None:
    """Copies a finished run's records to ``dest`` (through a temporary directory, then renamed)."""
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in RECORD_FILES:
        if (raw / name).exists():
            if name in PACKED:
                pack(raw / name, tmp / (name + ".gz"))
            else:
                shutil.copy2(raw / name, tmp / name)
    (tmp / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def pack(src: Path, dest: Path) -> None:
    """``src`` gzip-compressed into ``dest``, byte-for-byte the same for the same input (no
    name or time in the gzip header), so re-collecting a run changes nothing in git."""
    import gzip

    dest.write_bytes(gzip.compress(src.read_bytes(), compresslevel=9, mtime=0))


def pack_records(results: Path) -> int:
    """Compresses the plain ``metrics.jsonl`` / ``eval.jsonl`` of every collected run under
    ``<results>/runs`` (records copied in from an older checkout); returns how many."""
    done = 0
    for name in PACKED:
        for plain in sorted((results / "runs").glob(f"*/seed*/{name}")):
            pack(plain, plain.with_name(name + ".gz"))
            plain.unlink()
            done += 1
    return done


def recorded_seconds(run_dir: Path, *, evals: bool = True) -> float:
    """Seconds of training steps (rollout, update, other) and, with ``evals``, of
    evaluations that a run's records (plain or compressed) account for."""
    from magic_jax.jobs.report import read_record_text

    files: list[tuple[str, tuple[str, ...]]] = [
        ("metrics.jsonl", ("t_rollout_s", "t_update_s", "t_other_s"))
    ]
    if evals:
        files.append(("eval.jsonl", ("t_eval_s",)))
    total = 0.0
    for name, keys in files:
        text = read_record_text(run_dir / name)
        for line in text.splitlines() if text is not None else []:
            if line.strip():
                row = json.loads(line)
                total += sum(float(row.get(k, 0.0)) for k in keys)
    return total


def run_one(
    ablation: str,
    arm: Arm,
    seed: int,
    results: Path,
    *,
    budget: int | None = None,
    world: str | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Trains one (arm, seed) in a fresh ``magic-jax train`` process; returns its summary dir.

    ``world`` defaults to the ablation's.

    Raises:
      RuntimeError: the run failed (its log is ``<results>/raw/<arm>/seed<k>.log``; the
        raw directory is kept, so a second call resumes it).
    """
    world = world or ABLATIONS[ablation].world
    raw = raw_dir(results, arm, seed)
    raw.parent.mkdir(parents=True, exist_ok=True)
    cmd = train_command(arm, seed, raw, budget, config=train_config(world), world=world)
    cmd[0:1] = [sys.executable, "-m", "magic_jax.jobs.cli"]
    logfile = raw.with_name(raw.name + ".log")
    name = f"{ablation}/{arm.key} seed {seed}"
    log(f"[ablations] {name}: training in {raw} (log {logfile})")
    origin = head_state()  # the code this run starts with
    t0 = time.perf_counter()
    returncode = progress.watch(cmd, raw, logfile, name, log)
    wall = time.perf_counter() - t0
    if returncode != 0:
        tail = logfile.read_text(errors="replace").splitlines()[-5:]
        raise RuntimeError(
            f"{name}: magic-jax train exited {returncode} (log {logfile}):\n" + "\n".join(tail)
        )
    if WORLDS[world].statistics:
        measure_world(raw, num_samples=WORLD_SAMPLES if budget is None else 1)
        wall = time.perf_counter() - t0
    record = {
        "ablation": ablation,
        "arm": arm.key,
        "label": arm.label,
        "seed": seed,
        "world": world,
        "overrides": overrides_for(arm, seed, budget, world),
        "command": shlex.join(train_command(arm, seed, "<dir>", budget, world=world)),
        "rerun": rerun_command(ablation, arm, seed),
        # this call's wall time (a resumed or already finished run: only the rest), and the
        # run's own step and evaluation time from its records
        "wall_s": round(wall, 1),
        "steps_and_evals_s": round(recorded_seconds(raw), 1),
        "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "step_budget": budget,
        # the commit it ran at and whether tracked files differed from it (None: no git)
        "commit": origin["commit"],
        "dirty": origin["dirty"],
    }
    dest = summary_dir(results, arm, seed)
    _collect(raw, dest, record)
    log(f"[ablations] {ablation}/{arm.key} seed {seed}: done in {wall:.0f}s -> {dest}")
    return dest
