"""A target x delta sweep of the adaptive entropy controller, short enough for a laptop.

Every grid point is an ordinary ``magic-jax train`` run of a world's config
(``configs/lockout.yaml`` by default) with ``entropy.mode=adaptive`` and the point's
``entropy.target`` and ``entropy.delta``, each stage shortened to ``steps_per_stage`` steps,
held-out avg@1 before the first step, after the first stage and after the last, and without
the lock-out probe (``eval.probe=null``: its last evaluation alone samples 64 per problem).
``magic_jax.experiments.ablations.run_one`` runs each point, so a point killed half-way
resumes from its checkpoint and a finished one is skipped. Runs go to
``<results>/sweeps/<world>/steps<N>/``: raw run directories under ``raw/``, each finished
run's records under ``runs/<key>/seed<k>/``. The results directory is ``results`` if given,
else ``$MAGIC_JAX_NOTEBOOK_RESULTS``, else ``notebooks/results`` of this checkout
(``notebooks/results/budget-N`` with a step budget); sweeps are not committed
(``/notebooks/results/sweeps/`` is git-ignored). ``MAGIC_JAX_NOTEBOOK_STEPS`` replaces
``steps_per_stage`` (one step per stage: a smoke run)::

    python -m magic_jax.experiments.sweep --targets 0.06 0.09 --deltas 0.003 0.03

How long the default takes (2 targets x 2 deltas, ``STEPS_PER_STAGE`` = 30 steps per
stage, the lock-out world) is extrapolated from one point, not timed whole. The point,
``python -m magic_jax.experiments.sweep --targets 0.09 --deltas 0.01 --steps 20 --results
/tmp/sweep-time``, timed once on 2 CPU cores shared with two other training runs (load
average 7-10), took 59 s of wall time: 35 s for its 40 steps (0.48 s per step at T 23 and
0.69 s at T 52 once compiled, 0.07 s of other work per step, 9 s compiling the first step of
each stage), 8 s for its 3 evaluations (5 s of them the first, compiling) and 17 s to start
the process and load the model. Ten more steps per stage add about 12 s: 72 s per point at
30 steps per stage, about 5 minutes for the four points (less on idle cores).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from magic_jax.experiments import ablations
from magic_jax.experiments.arms import WORLDS, Arm
from magic_jax.experiments.progress import confirm
from magic_jax.experiments.results import is_done, results_dir, step_budget, summary_dir
from magic_jax.experiments.verdicts import final_accuracy, final_chain_accuracy, late_entropy
from magic_jax.jobs.report import Run, legend_below, load_run

# The default grid: targets below and near the lock-out base's held-out token entropy (0.099
# nats, build.json), a delta ten times smaller and three times larger than the shipped 0.01.
TARGETS = (0.06, 0.09)
DELTAS = (0.003, 0.03)
# Steps per stage of a sweep run (the lock-out world ships 150 + 150).
STEPS_PER_STAGE = 30
# What every sweep run sets beside its target and delta: the adaptive controller, and no
# lock-out probe at the evaluations (their avg@1 accuracy, by source, is kept).
POINT_OVERRIDES = ("entropy.mode=adaptive", "eval.probe=null")
# The ``ablation`` name in each run's ``run.json``.
SWEEP = "sweep"


def point_key(target: float, delta: float) -> str:
    """A grid point's key, which names its run directories: ``sweep-t0.09-d0.01``."""
    return f"sweep-t{target:g}-d{delta:g}"


def grid(targets: Sequence[float], deltas: Sequence[float]) -> list[Arm]:
    """One ``Arm`` per (target, delta), target-major.

    Returns:
      Arms keyed ``sweep-t<target>-d<delta>`` whose overrides set the adaptive controller,
      the target and the delta, and turn the lock-out probe off.

    Raises:
      ValueError: no target or no delta, a negative one, or two values that give the same key.
    """
    if not targets or not deltas:
        raise ValueError(f"sweep grid: needs targets and deltas, got {targets!r} x {deltas!r}")
    for name, values in (("target", targets), ("delta", deltas)):
        bad = [v for v in values if not float(v) >= 0]
        if bad:
            raise ValueError(f"sweep grid: every {name} must be >= 0, got {bad}")
    arms = [
        Arm(
            point_key(t, d),
            f"target {t:g}, delta {d:g}",
            (*POINT_OVERRIDES, f"entropy.target={float(t)!r}", f"entropy.delta={float(d)!r}"),
        )
        for t in targets
        for d in deltas
    ]
    keys = [a.key for a in arms]
    twins = sorted({k for k in keys if keys.count(k) > 1})
    if twins:
        raise ValueError(f"sweep grid: repeated points {twins} ({targets} x {deltas})")
    return arms


def sweep_dir(results: str | os.PathLike | None, world: str, steps: int) -> Path:
    """Where a sweep of ``steps`` steps per stage in ``world`` keeps its runs."""
    return results_dir(results) / "sweeps" / world / f"steps{steps}"


def sweep_command(arm: Arm, seed: int, world: str, steps: int) -> str:
    """One shell command that (re)builds one point of a sweep under ``notebooks/results``."""
    ent = dict(o.split("=", 1) for o in arm.overrides)
    return shlex.join(
        [
            *("python", "-m", "magic_jax.experiments.sweep"),
            *("--targets", ent["entropy.target"], "--deltas", ent["entropy.delta"]),
            *("--steps", str(steps), "--seed", str(seed), "--world", world),
        ]
    )


def _point_record(dest: Path, rerun: str) -> None:
    """Replaces the ``rerun`` of a finished point's ``run.json`` with the sweep's command."""
    path = dest / "run.json"
    record = json.loads(path.read_text())
    record["rerun"] = rerun
    tmp = path.with_name("run.json.partial")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)


def run_sweep(
    targets: Sequence[float] = TARGETS,
    deltas: Sequence[float] = DELTAS,
    *,
    world: str = "lockout",
    steps_per_stage: int = STEPS_PER_STAGE,
    seed: int | Sequence[int] = 0,
    results: str | os.PathLike | None = None,
    log: Callable[[str], None] = print,
    yes: bool = False,
) -> dict[str, list[Run]]:
    """Trains every grid point not done yet, then reads every point's runs.

    Args:
      targets / deltas: the grid (``grid``).
      world: a key of ``experiments.arms.WORLDS``.
      steps_per_stage: steps of each stage; ``MAGIC_JAX_NOTEBOOK_STEPS`` replaces it.
      seed: one seed or several (each point runs each).
      results: the results directory (see the module's docstring); the sweep's runs go to
        ``sweep_dir(results, world, steps)``.
      log: progress lines.
      yes: start more than a few runs without asking (``progress.confirm``).

    Returns:
      ``{point key: [report.Run of each seed]}`` in grid order, each run named by its
      point's label.

    Raises:
      KeyError: an unknown world.
      ValueError: a bad grid or a non-positive ``steps_per_stage``.
      RuntimeError: a run failed (``ablations.run_one``; a second call resumes it).
    """
    if world not in WORLDS:
        raise KeyError(f"sweep: no world {world!r} (known: {', '.join(WORLDS)})")
    steps = step_budget() or steps_per_stage
    if not isinstance(steps, int) or steps <= 0:
        raise ValueError(f"sweep: steps_per_stage must be a positive int, got {steps!r}")
    seeds = [seed] if isinstance(seed, int) else list(seed)
    arms = grid(targets, deltas)
    where = sweep_dir(results, world, steps)
    todo = [(a, s) for a in arms for s in seeds if not is_done(where, a, s)]
    if todo:
        # about 20 s to start and 1.1 s per step on 2 cores (the module's docstring)
        minutes = len(todo) * (20 + 2.2 * steps) / 60
        total = len(arms) * len(seeds)
        log(f"[sweep] {len(todo)} of {total} run(s) to do in {where}, about {minutes:.0f} min")
        confirm(len(todo), minutes, where, yes=yes)
    for arm, s in todo:
        dest = ablations.run_one(SWEEP, arm, s, where, budget=steps, world=world, log=log)
        _point_record(dest, sweep_command(arm, s, world, steps))
    return {a.key: [load_run(summary_dir(where, a, s), name=a.label) for s in seeds] for a in arms}


# --------------------------------------------------------------------------- table and figure


def _measure(fn: Callable[[Run], float], run: Run) -> float:
    """``fn(run)``, or nan where the run lacks what it reads."""
    try:
        return float(fn(run))
    except (IndexError, KeyError, ZeroDivisionError, TypeError, ValueError):
        return math.nan


def mean_alpha(run: Run) -> float:
    """The entropy coefficient alpha_k averaged over every step."""
    v = [float(m["alpha"]) for m in run.metrics]
    return sum(v) / len(v)


def alpha_on_share(run: Run) -> float:
    """Share of steps whose alpha_k is above 0 (the bonus on)."""
    v = [float(m["alpha"]) > 0 for m in run.metrics]
    return sum(v) / len(v)


def _mean(values: Sequence[float]) -> float:
    ok = [v for v in values if not math.isnan(v)]
    return sum(ok) / len(ok) if ok else math.nan


def _point(key: str, runs: Sequence[Run]) -> tuple[float, float]:
    """(target, delta) of a point, from its runs' configs."""
    for run in runs:
        ent = run.config.get("entropy") or {}
        if "target" in ent and "delta" in ent:
            return float(ent["target"]), float(ent["delta"])
    raise ValueError(f"sweep point {key!r}: no run has entropy.target and entropy.delta")


def _has_chain(runs: dict[str, list[Run]]) -> bool:
    for rs in runs.values():
        for run in rs:
            evals = [e for e in run.evals if isinstance(e.get("accuracy"), int | float)]
            if evals and any(k.endswith("-chain") for k in evals[-1].get("by_source") or {}):
                return True
    return False


def sweep_table(runs: dict[str, list[Run]]) -> str:
    """The sweep's markdown table: one row per point (means over its runs), by target, delta.

    Returns:
      Columns target, delta, runs, steps, final held-out accuracy, final accuracy on the
      carry chains (where the evaluations have a ``-chain`` source), late entropy (mean over
      the last third of the steps), mean alpha, and the share of steps with alpha > 0.
    """
    chain = _has_chain(runs)
    head = ["target", "delta", "runs", "steps", "final accuracy"]
    head += ["final chain accuracy"] if chain else []
    head += ["late entropy", "mean alpha", "alpha > 0"]
    rows = []
    for key, rs in runs.items():
        if not rs:
            continue
        target, delta = _point(key, rs)

        def m(fn: Callable[[Run], float], rs: Sequence[Run] = rs) -> float:
            return _mean([_measure(fn, r) for r in rs])

        steps = max(len(r.metrics) for r in rs)
        cells = [f"{target:g}", f"{delta:g}", str(len(rs)), str(steps), _f(m(final_accuracy))]
        cells += [_f(m(final_chain_accuracy))] if chain else []
        cells += [_f(m(late_entropy), 4), _f(m(mean_alpha), 4), _pct(m(alpha_on_share))]
        rows.append(((target, delta), cells))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for _, cells in sorted(rows, key=lambda r: r[0])]
    return "\n".join(lines) + "\n"


def _f(x: float, digits: int = 3) -> str:
    return "" if math.isnan(x) else f"{x:.{digits}f}"


def _pct(x: float) -> str:
    return "" if math.isnan(x) else f"{100 * x:.0f}%"


def _colors(n: int) -> list[Any]:
    """One colour per point (tab10, then tab20), without pyplot."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _curves(ax: Any, runs: dict[str, list[Run]], key: str, colors: Sequence[Any]) -> None:
    for rs, color in zip(runs.values(), colors):
        for i, run in enumerate(rs):
            x, y = run.series(key)
            ax.plot(x, y, color=color, linewidth=1.3, label=run.name if i == 0 else None)
    starts = {step for rs in runs.values() for run in rs for step, _ in run.stage_starts()}
    for step in sorted(starts):  # where a stage begins (T 23 -> 52 in the lock-out world)
        ax.axvline(step, color="0.6", linestyle=":", linewidth=1.0)
    ax.set_xlabel("training step (dotted: a new stage)")
    ax.grid(alpha=0.3)


def _heat_map(fig: Any, ax: Any, runs: dict[str, list[Run]]) -> None:
    """Final held-out accuracy (mean over a point's runs) over targets (rows) x deltas."""
    import numpy as np

    points = {k: _point(k, rs) for k, rs in runs.items() if rs}
    targets = sorted({t for t, _ in points.values()})
    deltas = sorted({d for _, d in points.values()})
    acc = np.full((len(targets), len(deltas)), np.nan)
    for key, (t, d) in points.items():
        acc[targets.index(t), deltas.index(d)] = _mean(
            [_measure(final_accuracy, r) for r in runs[key]]
        )
    im = ax.imshow(acc, origin="lower", cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    for (i, j), v in np.ndenumerate(acc):
        text = "no run" if np.isnan(v) else f"{v:.3f}"
        # an empty cell is not drawn (the axes' white): its label in grey, not white on white
        color = "0.4" if np.isnan(v) else "black" if v > 0.6 else "white"
        ax.text(j, i, text, ha="center", va="center", color=color, fontsize=9)
    ax.set_xticks(range(len(deltas)), [f"{d:g}" for d in deltas])
    ax.set_yticks(range(len(targets)), [f"{t:g}" for t in targets])
    ax.set_xlabel("delta (per step)")
    ax.set_ylabel("target (nats)")
    ax.set_title("final held-out accuracy", fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.05)


def sweep_figure(runs: dict[str, list[Run]]) -> Any:
    """Entropy and alpha against steps, one colour per point (dashed: each target), and a
    heat map of final held-out accuracy over (target, delta).

    Returns:
      A ``matplotlib.figure.Figure`` of three panels (made without pyplot).
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15.0, 4.2), layout="constrained")
    ent, alpha, heat = fig.subplots(1, 3)
    colors = _colors(len(runs))
    _curves(ent, runs, "entropy", colors)
    for target in sorted({_point(k, rs)[0] for k, rs in runs.items() if rs}):
        ent.axhline(target, color="0.35", linestyle="--", linewidth=1.0)
        ent.annotate(
            f"target {target:g}",
            (1.0, target),
            xycoords=("axes fraction", "data"),
            xytext=(-4, 2),
            textcoords="offset points",
            ha="right",
            fontsize=7,
            color="0.35",
        )
    ent.set_ylabel("token entropy (nats)")
    ent.set_title("rollout entropy (dashed: targets)", fontsize=10)
    _curves(alpha, runs, "alpha", colors)
    alpha.set_ylabel("alpha")
    alpha.set_title("entropy coefficient alpha_k", fontsize=10)
    if any(rs for rs in runs.values()):
        legend_below(fig, alpha, fontsize=7, outside=True)  # under the panels, off the curves
        _heat_map(fig, heat, runs)
    return fig


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m magic_jax.experiments.sweep``: runs a sweep, prints its table.

    Returns:
      The exit status (2: a bad argument or a failed run).
    """
    p = argparse.ArgumentParser(
        prog="python -m magic_jax.experiments.sweep", description=__doc__.split("\n")[0]
    )
    p.add_argument("--targets", type=float, nargs="+", default=list(TARGETS))
    p.add_argument("--deltas", type=float, nargs="+", default=list(DELTAS))
    p.add_argument("--steps", type=int, default=STEPS_PER_STAGE, help="steps per stage")
    p.add_argument("--seed", type=int, nargs="+", default=[0])
    p.add_argument("--world", default="lockout", choices=sorted(WORLDS))
    p.add_argument("--results", help="results directory (default notebooks/results)")
    p.add_argument("--yes", action="store_true", help="train more than a few runs unasked")
    args = p.parse_args(argv)
    try:
        runs = run_sweep(
            args.targets,
            args.deltas,
            world=args.world,
            steps_per_stage=args.steps,
            seed=args.seed,
            results=args.results,
            yes=args.yes,
        )
    except (KeyError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(sweep_table(runs), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
