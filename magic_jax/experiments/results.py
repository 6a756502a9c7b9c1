"""Where the ablations' runs live: the results directory, each run's raw and summary
directories, the command that rebuilds one, and the finished runs of an ablation.

``magic_jax.experiments.ablations`` writes there; the verdicts and the report read it.
"""

from __future__ import annotations

import os
import shlex
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


CHECKOUT = Path(__file__).resolve().parents[2]  # the checkout this package is imported from


def default_results() -> Path:
    """``notebooks/results`` of the checkout this package is imported from, wherever the
    notebook or command runs (never the working directory's).

    Raises:
      SystemExit: no such folder (an installed package, not a checkout): one line naming
        where it looked and how to name another.
    """
    where = CHECKOUT / "notebooks" / "results"
    if not where.is_dir():
        raise SystemExit(
            f"no results folder at {where} (the checkout of the imported magic_jax); "
            f"set {RESULTS_ENV}=DIR or pass --results DIR"
        )
    return where


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
    """One shell command that (re)builds this arm's seed under ``notebooks/results`` (with a
    step budget or ``$MAGIC_JAX_NOTEBOOK_RESULTS``: the same, so the same folder)."""
    budget, results = step_budget(), os.environ.get(RESULTS_ENV, "").strip()
    env = "" if budget is None else f"{STEPS_ENV}={budget} "
    env += f"{RESULTS_ENV}={shlex.quote(results)} " if results else ""
    return (
        f"{env}python -m magic_jax.experiments.ablations run --ablation {ablation} "
        f"--arm {arm.key} --seeds {seed}"
    )


def runs_folder_name() -> str:
    """Where the runs a command skips are, as a reader types it: ``notebooks/results/runs``,
    or ``notebooks/results/budget-N/runs`` with a step budget (``$MAGIC_JAX_NOTEBOOK_RESULTS``
    named instead when set)."""
    env = os.environ.get(RESULTS_ENV, "").strip()
    budget = step_budget()
    base = env or ("notebooks/results" if budget is None else f"notebooks/results/budget-{budget}")
    return f"{base}/runs"


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
