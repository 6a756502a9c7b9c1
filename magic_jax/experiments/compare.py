"""Any arms side by side: the ablations' seed-mean panels, the outcome table and exact tests.

``python -m magic_jax.experiments.ablations compare carry-clip-0.1 clip-0.4`` draws the
arms named (committed ones from ``<results>/runs/``, arms made with ``run --from`` from
``<results>/derived/runs/``) as the notebooks draw a claim's, and tests each against the
first: Welch's t with its 95% interval and the exact Mann-Whitney U that handles ties
(``corrected.rank_p``), Holm-adjusted over every (arm, measure) of the comparison, and
the paired signed-rank p where both arms ran the same seeds. A comparison asked after
seeing the runs is exploratory: the output says so; a claim is tested by registering it
first (``notebooks/prereg/``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from magic_jax.experiments.ablation_report import arms_figure
from magic_jax.experiments.claims_table import format_table
from magic_jax.experiments.corrected import holm, paired_p, rank_p
from magic_jax.experiments.derived import DERIVED, find_arm
from magic_jax.experiments.outcomes import alpha_on_share, peak_accuracy
from magic_jax.experiments.results import results_dir
from magic_jax.experiments.verdicts import final_accuracy, late_entropy, mean_of, run_seed, welch
from magic_jax.jobs.report import Run

# (name, measure): what the table and the tests compare, per seed
MEASURES: tuple[tuple[str, Callable[[Run], float]], ...] = (
    ("final accuracy", final_accuracy),
    ("peak accuracy", peak_accuracy),
    ("late entropy", late_entropy),
    ("alpha on share", alpha_on_share),
)


def load(arms: Sequence[str], results: str | os.PathLike | None = None) -> dict[str, list[Run]]:
    """``{arm: [each finished seed's Run]}``, in the order given.

    Raises:
      ValueError: an arm named twice, or with no finished run (the line names where it
        looked).
    """
    from magic_jax.jobs.report import load_run

    where = results_dir(results)
    if len(set(arms)) != len(arms):
        raise ValueError(f"compare: an arm named twice in {' '.join(arms)}")
    out = {}
    for arm in arms:
        dirs = [where / "runs" / arm, where / DERIVED / "runs" / arm]
        found = [p.parent for d in dirs for p in d.glob("seed*/run.json")]
        if not found:
            looked = " and ".join(str(d) for d in dirs)
            raise ValueError(f"compare: no finished run of {arm} in {looked}")
        runs = [load_run(d) for d in found]
        out[arm] = sorted(runs, key=lambda r: run_seed(r) or 0)
    return out


def label(arm: str, results: str | os.PathLike | None = None) -> str:
    """A committed arm's label, or a derived arm's base and changes (its ``arm.json``)."""
    try:
        return f"{arm}: {find_arm(arm)[1].label}"
    except KeyError:
        spec = results_dir(results) / DERIVED / "runs" / arm / "arm.json"
        if not spec.exists():
            return arm
        d = json.loads(spec.read_text())
        return f"{arm}: {d['from']} with {', '.join(d['set'])}"


def _cell(v: Sequence[float]) -> str:
    v = [x for x in v if not math.isnan(x)]
    if not v:
        return "-"
    if len(v) == 1:
        return f"{v[0]:.3f}"
    m = mean_of(v)
    return f"{m:.3f} +- {math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)):.3f}"


def outcome_table(runs: Mapping[str, Sequence[Run]]) -> str:
    """Per arm: seeds, then each measure's seed mean +- sample std."""
    rows = [
        [arm, str(len(rs)), *(_cell([f(r) for r in rs]) for _, f in MEASURES)]
        for arm, rs in runs.items()
    ]
    return format_table(["arm", "seeds", *(m for m, _ in MEASURES)], rows)


def effect_rows(runs: Mapping[str, Sequence[Run]]) -> list[list[str]]:
    """Each arm after the first against the first, per measure: the difference of seed means
    with Welch's 95% interval and p, the exact Mann-Whitney p and its Holm adjustment over
    the whole comparison, and the paired signed-rank p when both ran the same seeds."""
    (_, ref), *others = runs.items()
    found = []
    for arm, rs in others:
        paired = sorted(run_seed(r) or 0 for r in rs) == sorted(run_seed(r) or 0 for r in ref)
        for name, f in MEASURES:
            a, b = [f(r) for r in ref], [f(r) for r in rs]
            if any(math.isnan(x) for x in a + b):
                continue
            _, low, high, p = welch(a, b)
            # one value everywhere (alpha never on in either arm): nothing to test, and no
            # place in the Holm family
            mw = rank_p(a, b) if len(set(a + b)) > 1 else math.nan
            pp = math.nan
            if paired:
                by = {run_seed(r): f(r) for r in rs}
                pp = paired_p(a, [by[run_seed(r)] for r in ref])
            found.append((arm, name, mean_of(b) - mean_of(a), low, high, p, mw, pp))
    adjusted = holm([row[6] for row in found])

    def g(x: float) -> str:
        return "-" if math.isnan(x) else f"{x:.3g}"

    return [
        [arm, name, f"{d:+.3f}", f"[{g(lo)}, {g(hi)}]", g(p), g(mw), g(h), g(pp)]
        for (arm, name, d, lo, hi, p, mw, pp), h in zip(found, adjusted)
    ]


def run_steps(run: Run) -> int:
    """How many steps a run trained (its last recorded step + 1; 0 without records)."""
    return max((int(m["step"]) for m in run.metrics if "step" in m), default=-1) + 1


def length_warning(runs: Mapping[str, Sequence[Run]]) -> str | None:
    """A warning when the runs differ in length (a smoke run against a full one): their
    outcomes are then read at different points of training, not beside each other."""
    steps = {arm: sorted({run_steps(r) for r in rs}) for arm, rs in runs.items()}
    if len({n for v in steps.values() for n in v}) <= 1:
        return None
    listed = "; ".join(f"{a} {', '.join(map(str, v))}" for a, v in steps.items())
    return (
        f"Warning: the runs differ in length (steps per run: {listed}); their outcomes are "
        "read at different points of training, so a difference is not the options' effect."
    )


def compare(
    arms: Sequence[str],
    results: str | os.PathLike | None = None,
    out: str | os.PathLike | None = None,
) -> tuple[Path, str]:
    """Draws ``arms`` (``compare.png``) and writes the outcome table and the tests
    (``compare.md``) to ``out`` (default ``<results>/compare/<arms joined by _vs_>``);
    returns (the figure's path, the text).

    Raises:
      ValueError: fewer than two arms, or an arm without finished runs.
    """
    if len(arms) < 2:
        raise ValueError("compare: name two arms or more (the first is the reference)")
    runs = load(arms, results)
    dest = Path(out) if out else results_dir(results) / "compare" / "_vs_".join(arms)
    dest.mkdir(parents=True, exist_ok=True)
    labels = {a: label(a, results) for a in arms}
    fig = arms_figure(runs, labels, " vs ".join(arms))
    fig.savefig(dest / "compare.png")
    head = ["arm", "measure", "diff vs " + arms[0], "Welch 95% CI", "Welch p"]
    head += ["Mann-Whitney p (exact)", "Holm (MW)", "paired p (signed-rank)"]
    warning = length_warning(runs)
    text = "\n\n".join(
        [
            "\n".join(f"- {labels[a]}" for a in arms),
            *([warning] if warning else []),
            outcome_table(runs),
            format_table(head, effect_rows(runs)),
            "Exploratory: these arms were not pre-registered as a claim, and Holm counts only "
            "this comparison's tests.",
        ]
    )
    (dest / "compare.md").write_text(text + "\n")
    return dest / "compare.png", text


def sweep_figure(base: str, key: str, points: Mapping[str, Sequence[Run]]) -> Any:
    """One panel per measure: each value of ``key`` (the arms ``points``, in order, the base
    arm first as its own value) with every seed as a dot and the seed mean as a line."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * len(MEASURES), 3.4), dpi=90)
    names = list(points)
    for ax, (measure, f) in zip(fig.subplots(1, len(MEASURES)), MEASURES):
        means = []
        for i, arm in enumerate(names):
            v = [f(r) for r in points[arm]]
            ax.plot([i] * len(v), v, "o", color="0.45", markersize=3, alpha=0.6)
            means.append(mean_of(v))
        ax.plot(range(len(names)), means, "-o", color="C0", linewidth=2)
        ax.set_xticks(range(len(names)), [n.removeprefix(base + "-") or n for n in names])
        ax.set_title(measure, fontsize=10)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{key} from {base}: each seed (dots) and the seed mean (line)", fontsize=11)
    fig.tight_layout()
    return fig
