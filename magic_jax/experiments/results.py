"""Where the ablations' runs live: the results directory, each run's raw and summary
directories, the command that rebuilds one, and the finished runs of an ablation.

``magic_jax.experiments.ablations`` writes there; the verdicts and the report read it.
"""

from __future__ import annotations

import os
from pathlib import Path

from magic_jax.experiments.arms import ABLATIONS, WORLDS, Arm

STEPS_ENV = "MAGIC_JAX_NOTEBOOK_STEPS"
RESULTS_ENV = "MAGIC_JAX_NOTEBOOK_RESULTS"


def step_budget() -> int | None:
    """``MAGIC_JAX_NOTEBOOK_STEPS`` as steps per stage (smoke runs), or None."""
    text = os.environ.get(STEPS_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) <= 0:
        raise ValueError(f"{STEPS_ENV}={text!r}: expected a positive number of steps per stage")
    return int(text)


def default_results() -> Path:
    """``notebooks/results`` of this checkout: found from the working directory upwards."""
    here = Path.cwd().resolve()
    for d in (here, *here.parents):
        if d.name == "notebooks" and (d / "results").is_dir():
            return d / "results"
        if (d / "notebooks" / "results").is_dir():
            return d / "notebooks" / "results"
    return here / "notebooks" / "results"


def results_dir(results: str | os.PathLike | None = None) -> Path:
    """Where runs go: ``results``, else ``$MAGIC_JAX_NOTEBOOK_RESULTS``, else
    ``notebooks/results`` (``notebooks/results/budget-N`` with a step budget)."""
    if results is not None:
        return Path(results).resolve()
    env = os.environ.get(RESULTS_ENV, "").strip()
    if env:
        return Path(env).resolve()
    budget = step_budget()
    base = default_results()
    return base if budget is None else base / f"budget-{budget}"


def train_config(world: str = "default") -> Path:
    """A world's config file as shipped in the package (``configs/<name>.yaml`` in a checkout)."""
    return Path(__file__).resolve().parents[1] / WORLDS[world].package_config


def raw_dir(results: Path, arm: Arm, seed: int) -> Path:
    return results / "raw" / arm.key / f"seed{seed}"


def summary_dir(results: Path, arm: Arm, seed: int) -> Path:
    return results / "runs" / arm.key / f"seed{seed}"


def rerun_command(ablation: str, arm: Arm, seed: int) -> str:
    """One shell command that (re)builds this arm's seed under ``notebooks/results``."""
    return (
        f"python -m magic_jax.experiments.ablations run --ablation {ablation} "
        f"--arm {arm.key} --seeds {seed}"
    )


def is_done(results: Path, arm: Arm, seed: int) -> bool:
    return (summary_dir(results, arm, seed) / "run.json").exists()


def load_arm_runs(ablation: str, results: str | os.PathLike | None = None) -> dict[str, list]:
    """``{arm key: [report.Run of each finished seed]}`` of one ablation (arms in order)."""
    from magic_jax.jobs.report import load_run

    where = results_dir(results)
    ab = ABLATIONS[ablation]
    out = {}
    for arm in ab.arms:
        runs = []
        for seed in ab.seeds:
            d = summary_dir(where, arm, seed)
            if (d / "run.json").exists():
                runs.append(load_run(d, name=f"{arm.label} (seed {seed})"))
        out[arm.key] = runs
    return out
