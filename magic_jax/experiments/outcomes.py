"""Every finished run's outcomes as one table a researcher can filter: ``outcomes.csv``.

One row per run under ``<results>/runs/<arm>/seed<k>/``, rewritten with the figures
(``python -m magic_jax.experiments.ablations figures``: ``notebooks/figures/outcomes.csv``,
and the derived arms' in ``<results>/derived/outcomes.csv``)::

    import pandas as pd
    df = pd.read_csv("notebooks/figures/outcomes.csv")
    df[df.arm.str.startswith("carry-clip")].groupby("arm").final_accuracy.describe()
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from magic_jax.experiments.verdicts import final_accuracy, late_entropy
from magic_jax.jobs.report import Run

# (column, what it holds): the CSV's header, in order
COLUMNS: tuple[tuple[str, str], ...] = (
    ("ablation", "the claim the run belongs to (derived arms: their base's)"),
    ("arm", "the arm's key (its folder)"),
    ("derived_from", "a derived arm's base arm; empty for a committed arm"),
    ("world", "default, carry or lockout"),
    ("seed", "the run's seed"),
    ("commit", "the commit it ran at"),
    ("dirty", "whether tracked files differed from that commit"),
    ("steps", "training steps recorded"),
    ("final_accuracy", "held-out avg@n at the last evaluation"),
    ("peak_accuracy", "the highest held-out avg@n of any evaluation"),
    ("late_entropy", "token entropy (nats), mean over the last third of the steps"),
    ("alpha_on_share", "share of steps whose entropy coefficient alpha was above 0"),
    ("wall_s", "the runner's wall time for the run (s)"),
)


def _evals(run: Run) -> list[float]:
    return [float(e["accuracy"]) for e in run.evals if isinstance(e.get("accuracy"), int | float)]


def peak_accuracy(run: Run) -> float:
    """The highest held-out avg@n of any evaluation (nan without one)."""
    return max(_evals(run), default=math.nan)


def alpha_on_share(run: Run) -> float:
    """Share of steps whose entropy coefficient alpha was above 0 (nan without steps)."""
    v = [float(m.get("alpha", 0.0)) for m in run.metrics]
    return sum(a > 0 for a in v) / len(v) if v else math.nan


def run_outcomes(run: Run) -> dict[str, Any]:
    """One run's row: ``COLUMNS`` from its ``run.json`` and records."""
    p = Path(run.path) / "run.json"
    rec = json.loads(p.read_text()) if p.exists() else {}
    return {
        "ablation": rec.get("ablation", ""),
        "arm": rec.get("arm", run.name),
        "derived_from": rec.get("derived_from", ""),
        "world": rec.get("world", ""),
        "seed": rec.get("seed", ""),
        "commit": rec.get("commit") or "",
        "dirty": rec.get("dirty", ""),
        "steps": len(run.metrics),
        "final_accuracy": final_accuracy(run) if _evals(run) else math.nan,
        "peak_accuracy": peak_accuracy(run),
        "late_entropy": late_entropy(run) if run.metrics else math.nan,
        "alpha_on_share": alpha_on_share(run),
        "wall_s": rec.get("wall_s", math.nan),
    }


def finished_runs(results: str | os.PathLike) -> list[Run]:
    """Every finished run (a ``run.json``) under ``<results>/runs``, by arm and seed (for
    the derived arms', ``results`` is ``<results>/derived``)."""
    from magic_jax.jobs.report import load_run

    found = list(Path(results).glob("runs/*/seed*/run.json"))

    def order(p: Path) -> tuple[str, int]:
        seed = p.parent.name.removeprefix("seed")
        return p.parent.parent.name, int(seed) if seed.isdigit() else -1

    return [load_run(p.parent) for p in sorted(found, key=order)]


def write_csv(runs: Sequence[Run], path: str | os.PathLike) -> Path:
    """Writes ``runs``' rows (``COLUMNS``) to ``path``; floats to 6 significant digits."""
    path = Path(path)
    with path.open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow([c for c, _ in COLUMNS])
        for run in runs:
            row = run_outcomes(run)
            w.writerow([f"{v:.6g}" if isinstance(v, float) else v for v in row.values()])
    return path
