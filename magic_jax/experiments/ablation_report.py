"""The ablations' figures and tables: seed means with each seed, effect sizes, one table.

The outcomes, the report's predictions and Welch's t are in
``magic_jax.experiments.verdicts`` (re-exported here).

Every quantity is read from the committed run summaries
(``magic_jax.experiments.ablations``), never from a notebook's own state, so
``python -m magic_jax.experiments.ablations figures`` redraws exactly what the
notebooks show.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from magic_jax.experiments import prereg
from magic_jax.experiments.arms import ABLATIONS
from magic_jax.experiments.claims_table import (  # noqa: F401 (re-exported)
    format_table,
    summary_table,
    write_tables,
)
from magic_jax.experiments.corrected import claim_rows, correct, label, primary_verdict
from magic_jax.experiments.outcomes import finished_runs, write_csv
from magic_jax.experiments.pairing import (  # noqa: F401 (re-exported: the notebooks' API)
    identical_arms,
    identical_text,
)
from magic_jax.experiments.results import load_arm_runs, rerun_command, runs_folder_name
from magic_jax.experiments.verdicts import (  # noqa: F401 (re-exported: the notebooks' API)
    ALPHA,
    CHECKS,
    OUTCOMES,
    Check,
    Effect,
    effects,
    final_accuracy,
    judge,
    mean_of,
    run_seed,
    sample_var,
    verdict,
    welch,
    world_record,
)
from magic_jax.jobs.report import Run, colors, legend_below, seed_mean


def outcome_table(
    ablation: str, runs: Mapping[str, Sequence[Run]], outcomes: Sequence[str]
) -> list[list[str]]:
    """Rows ``[arm label, seeds, outcome mean +- std ...]`` for printing."""
    ab = ABLATIONS[ablation]
    rows = []
    for arm in ab.arms:
        rs = runs.get(arm.key, [])
        row = [arm.label, str(len(rs))]
        for o in outcomes:
            v = [OUTCOMES[o](r) for r in rs]
            row.append(f"{mean_of(v):.3f} +- {math.sqrt(sample_var(v)):.3f}" if v else "-")
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- figures

# (metric key, title, from evaluations?)
PANELS: tuple[tuple[str, str, bool], ...] = (
    ("entropy", "token entropy (nats); dashed: target", False),
    ("alpha", "entropy coefficient alpha", False),
    ("accuracy", "held-out avg@n", True),
    ("response_length_mean", "mean response length (tokens)", False),
    ("truncated_fraction", "truncated fraction", False),
    ("reward", "rollout reward", False),
)


# The panel that replaces alpha's when the runs evaluated at temperature 0.6 too.
AT_06 = ("by_temperature/0.6/accuracy", "held-out avg@n, sampled at 0.6", True)


def _series(run: Run, key: str, evals: bool) -> dict[int, float]:
    """{step: value} of ``key``; a key with ``/`` is a path into nested rows."""
    if "/" not in key:
        return dict(zip(*run.series(key, evals=evals)))
    out = {}
    for row in run.evals if evals else run.metrics:
        v: Any = row
        for part in key.split("/"):
            v = v.get(part) if isinstance(v, dict) else None
        if isinstance(v, int | float):
            out[row["step"]] = float(v)
    return out


def _seed_series(
    runs: Sequence[Run], key: str, evals: bool
) -> tuple[list[dict[int, float]], list[int], list[float]]:
    """Each run's ``{step: value}`` of ``key``, and the steps every run has with the seed
    mean at each of them: ``(per run, steps, mean)``."""
    per = [_series(r, key, evals) for r in runs]
    return (per, *seed_mean(per))


def plot_arms(
    ax: Any,
    runs: Mapping[str, Sequence[Run]],
    labels: Mapping[str, str],
    key: str,
    *,
    evals: bool = False,
) -> None:
    """One colour per arm: the seed mean as a thick line on top, and with several seeds each
    seed as a thin translucent line (the mean is drawn first, so ``ax.lines`` starts with each
    arm's mean; an arm draws 1 + seeds lines, 1 with one seed); an adaptive arm's entropy
    target as a dashed line."""
    arms = [k for k in runs if runs[k]]
    for arm, color in zip(arms, colors(len(arms))):
        per, steps, mean = _seed_series(runs[arm], key, evals)
        if not steps:
            continue
        ax.plot(
            steps,
            mean,
            color=color,
            linewidth=2.0,
            marker="o" if evals else None,
            markersize=3,
            zorder=3,
            label=f"{labels.get(arm, arm)} (n={len(runs[arm])})",
        )
        for seed in per if len(per) > 1 else []:
            xs = sorted(seed)
            ax.plot(xs, [seed[s] for s in xs], color=color, linewidth=0.7, alpha=0.35, zorder=2)
        if key == "entropy":
            ent = runs[arm][0].config.get("entropy") or {}
            if ent.get("mode", "adaptive") == "adaptive" and "target" in ent:
                ax.axhline(float(ent["target"]), color=color, linestyle="--", linewidth=0.9)


def _stage_changes(runs: Mapping[str, Sequence[Run]]) -> list[int]:
    """The steps where a new stage starts, read from each arm's first run."""
    steps = set()
    for r in (rs[0] for rs in runs.values() if rs):
        pairs = zip(r.metrics, r.metrics[1:])
        steps |= {m["step"] for prev, m in pairs if m.get("stage") != prev.get("stage")}
    return sorted(steps)


def ablation_figure(
    ablation: str, runs: Mapping[str, Sequence[Run]] | None = None, results: Any = None
) -> Any:
    """A 2 x 3 matplotlib figure (Agg) of one ablation: every arm's seed mean and each seed."""
    runs = load_arm_runs(ablation, results) if runs is None else runs
    ab = ABLATIONS[ablation]
    return arms_figure(runs, {a.key: a.label for a in ab.arms}, ab.title)


def arms_figure(runs: Mapping[str, Sequence[Run]], labels: Mapping[str, str], title: str) -> Any:
    """The ablations' 2 x 3 panels (Agg) for any arms: ``runs`` by arm key, in order."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13.5, 6.6), dpi=90)
    axes = fig.subplots(2, 3)
    panels = PANELS
    if any(_series(r, AT_06[0], True) for rs in runs.values() for r in rs):
        panels = tuple(AT_06 if p[0] == "alpha" else p for p in PANELS)
    for ax, (key, name, evals) in zip(axes.flat, panels):
        plot_arms(ax, runs, labels, key, evals=evals)
        if key == "entropy" and not any(ln.get_linestyle() == "--" for ln in ax.get_lines()):
            name = name.split(";")[0]  # no adaptive arm: no target line to name
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key == "entropy":
            ax.set_yscale("log")
    for ax in axes.flat:
        for s in _stage_changes(runs):
            ax.axvline(s, color="0.5", linestyle=":", linewidth=0.9)
    # one legend under the panels, off every curve (in a panel it sat on the held entropy)
    rows = legend_below(fig, axes.flat[0])
    fig.suptitle(
        f"{title}: seed mean (thick line) and each seed (thin lines); dotted: stage change",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.035 * rows, 1, 1))
    return fig


def _carry_accuracy(stats: Mapping[str, Any], carries: str) -> float:
    """A model's held-out accuracy on the problems with ``carries`` carries (nan if none)."""
    return float((stats.get("by_carries") or {}).get(carries, {}).get("accuracy", math.nan))


def world_table(
    ablation: str, runs: Mapping[str, Sequence[Run]], base: Mapping[str, Any] | None = None
) -> str:
    """Carry world: the final models' strategy shares and accuracy per carry count (seed mean
    +- std of each run's ``world.json``), with the base model's figures (``base``: its
    ``build.json`` statistics) as the first row."""
    ab = ABLATIONS[ablation]
    cols = [
        ("check_rate_needed", "checks carry columns"),
        ("check_rate_other", "checks others"),
        ("accuracy", "accuracy"),
        ("entropy_correct", "entropy, correct"),
        ("entropy_wrong", "entropy, wrong"),
        ("length", "length"),
    ]
    carries = [str(c) for c in range(6)]
    header = ["model", "seeds", *(c[1] for c in cols), *(f"acc, {c} carries" for c in carries)]

    def cell(v: Sequence[float], digits: int = 3) -> str:
        v = [x for x in v if not math.isnan(x)]
        if not v:
            return "-"
        return f"{mean_of(v):.{digits}f}" + (
            f" +- {math.sqrt(sample_var(v)):.{digits}f}" if len(v) > 1 else ""
        )

    def row(name: str, stats: Sequence[Mapping[str, Any]]) -> list[str]:
        out = [name, str(len(stats))]
        out += [
            cell([float(s.get(k, math.nan)) for s in stats], 1 if k == "length" else 3)
            for k, _ in cols
        ]
        out += [cell([_carry_accuracy(s, c) for s in stats], 2) for c in carries]
        return out

    rows = [row("base (step 0)", [base])] if base else []
    for arm in ab.arms:
        stats = [w for w in (world_record(r) for r in runs.get(arm.key, [])) if w]
        if stats:
            rows.append(row(f"{arm.label}, final", stats))
    return format_table(header, rows)


def class_entropy_table(ablation: str, runs: Mapping[str, Sequence[Run]]) -> str:
    """Carry world: where each final model's entropy sits, by token class (``world.json``'s
    ``entropy_by_class``: choice, digit, format, after the answer), one row per seed, with
    the carry columns it checks and its truncated share; runs measured before the classes
    existed are left out."""
    classes = ("choice", "digit", "format", "after_answer")
    header = [
        "arm",
        "seed",
        *(f"entropy, {c}" for c in classes),
        "checks carry columns",
        "truncated",
        "accuracy",
    ]
    rows = []
    for arm in ABLATIONS[ablation].arms:
        for r in runs.get(arm.key, []):
            w = world_record(r)
            by = w.get("entropy_by_class")
            if not by:
                continue
            rows.append(
                [
                    arm.label,
                    str(run_seed(r)),
                    *(f"{by[c]:.3f}" for c in classes),
                    f"{w['check_rate_needed']:.3f}",
                    f"{w['truncated']:.3f}",
                    f"{w['accuracy']:.3f}",
                ]
            )
    return format_table(header, rows) if rows else "(no run has entropy by token class)"


def sft_comparison(
    arm: str,
    runs: Mapping[str, Sequence[Run]],
    sft: Mapping[int, Mapping[str, Any]],
    label: str | None = None,
) -> str:
    """Carry world: each seed's run of ``arm`` against supervised training continued from the
    base for the same seconds of training steps (``ablations.ensure_sft``), and the Welch
    comparison of their final held-out accuracies."""
    by_seed = {run_seed(r): r for r in runs.get(arm, [])}
    rows, rl, sup = [], [], []
    for seed, res in sorted(sft.items()):
        r = by_seed.get(seed)
        if r is None:
            continue
        rl.append(final_accuracy(r))
        sup.append(float(res["after"]["accuracy"]))
        before = res["before"]["accuracy"]
        rows.append(
            [
                str(seed),
                f"{res['seconds']:.0f}",
                str(res["steps"]),
                f"{before:.3f}",
                f"{sup[-1]:.3f}",
                f"{rl[-1]:.3f}",
            ]
        )
    table = format_table(
        [
            "seed",
            "seconds of steps",
            "SFT steps",
            "held-out before",
            "after SFT",
            f"after {label or arm}",
        ],
        rows,
    )
    eff = judge(Check("final accuracy", "sft", arm, +1), sup, rl)
    return table + "\n\n" + eff.text({"sft": "SFT continuation", arm: label or arm})


# Where a claim stays inconclusive or fails: what the world it ran in lacks for it (from
# the runs' own numbers; shown in the table's last column).
LIMITS: dict[str, str] = {
    "central": (
        "A collapse that locks the better strategy out: the arms without a strong bonus end "
        "checking 99% of the columns a right answer needs (short problems keep checked "
        "solutions in the samples at T = 32); and entropy a bonus can hold up without "
        "breaking the policy: the controller that holds it at its target (alpha 0.2-0.85) "
        "puts it into the per-column choices and slows learning (3 of 5 seeds end at 49-53%)."
    ),
    "off_policy": (
        "Off-policy steps small enough to sharpen the policy: at this world's learning rate "
        "(3e-4) four optimizer steps per batch destabilise it instead (by reuse it breaks, "
        "0.6% held-out; by mini-batches 58%), so entropy rises rather than collapses; the "
        "report's runs used 1e-6 on a 7B model."
    ),
    "clip_higher": (
        "Tokens a clip holds back while they explore: even with both clips scaled to "
        "eps_low 0.05 the upper one binds on 0.16-0.33% of tokens (the per-column choice is "
        "one token, the rest nearly deterministic), and a wider one lets the choices that won "
        "sharpen faster: lower entropy, and at 2 x the highest accuracy (70.9 vs 54.2%)."
    ),
    "multi_stage": (
        "A first stage that leaves the better strategy room: T = 32 truncates the checked "
        "solutions of long problems, so the two-stage runs learn only in stage 2 (25.7% at "
        "step 150 against 91.1%) and end within [-12.5, +6.3] points of the single stage, "
        "wider than the 2-point tolerance."
    ),
    "kl": (
        "A pull to see: beta 0.1 (a third to half of this world's policy loss) holds the KL to "
        "the base at about 0.1 nats per token through stage 2 instead of pulling it toward 0; "
        "it slows learning (-8.8 points against the same runs without it in stage 2, "
        "p < 0.001), but against no KL at all the no-KL seeds spread too widely (p = 0.11)."
    ),
}


def write_figures(
    results: str | os.PathLike, out: str | os.PathLike, names: Sequence[str] | None = None
) -> Path:
    """``<ablation>.png`` per ablation with finished runs, the claims' tables
    (``claims_table.write_tables``: ``summary.md``, ``effects.md``, ``runs.md``,
    ``self_noise.md``) and every run's outcomes (``outcomes.csv``; the derived arms' in
    ``<results>/derived/outcomes.csv``); returns ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for key in names or ABLATIONS:
        runs = load_arm_runs(key, results)
        if not any(runs.values()):
            continue
        fig = ablation_figure(key, runs)
        fig.savefig(out / f"{key}.png")
    write_tables(os.fspath(results), out)
    write_csv(finished_runs(results), out / "outcomes.csv")
    if mine := finished_runs(Path(results) / "derived"):  # arms made with run --from
        write_csv(mine, Path(results) / "derived" / "outcomes.csv")
    return out


def _verdict_lines(
    ablation: str, runs: Mapping[str, Sequence[Run]], effs: Sequence[Effect]
) -> list[str]:
    """The claim's verdict from its pre-registration (Holm within the claim), by measure;
    without one, the raw verdict of ``effs``."""
    pre = prereg.for_ablation(ablation)
    if pre is None:
        return [f"verdict: {verdict(effs)} (raw p < 0.05; no pre-registration)"]
    rows = correct({pre.name: claim_rows(pre, runs)})[pre.name]
    v = primary_verdict(rows)
    lines = [
        f"verdict: {v} (primary endpoint, Holm within the claim; {pre.status}: "
        f"notebooks/prereg/{pre.path.name})",
        f"by measure: {label(rows)}",
    ]
    if ablation in LIMITS and v != "reproduced":
        lines.append(f"what this world lacks for it: {LIMITS[ablation]}")
    return lines


def describe(
    ablation: str, runs: Mapping[str, Sequence[Run]] | None = None, results: Any = None
) -> str:
    """What a notebook prints: each arm's outcomes (seed mean +- std), each check of the
    report's claim with its effect size and verdict, and the command that re-runs each arm."""
    runs = load_arm_runs(ablation, results) if runs is None else runs
    ab = ABLATIONS[ablation]
    labels = {a.key: a.label for a in ab.arms}
    names = list(
        dict.fromkeys(["final accuracy", "mean entropy", *(c.outcome for c in CHECKS[ablation])])
    )
    effs = effects(ablation, runs)
    lines = [
        f"{ab.title}. Report: {ab.claim}",
        "",
        format_table(["arm", "seeds", *names], outcome_table(ablation, runs, names)),
        "",
        *(f"- {e.text(labels)}" for e in effs),
        *(f"- {t}" for t in identical_text(runs, labels)),
        "",
        *_verdict_lines(ablation, runs, effs),
        "",
        f"re-run an arm (skips seeds already in {runs_folder_name()}):",
        *(f"  {rerun_command(ablation, a, s)}" for a in ab.arms for s in ab.seeds[:1]),
    ]
    return "\n".join(lines)


def seed_status(ablation: str, runs: Mapping[str, Sequence[Run]]) -> list[str]:
    """One line per check of ``ablation``: its arms' seeds so far, and whether it is pending
    (fewer than 2 seeds a side), provisional (seeds missing) or complete."""
    ab = ABLATIONS[ablation]
    labels, full, lines = {a.key: a.label for a in ab.arms}, len(ab.seeds), []
    for c in CHECKS[ablation]:
        n_arm = len(runs.get(c.arm, []))
        # a check without a reference compares its arm with 0: the arm's seeds alone count
        n_ref = n_arm if c.reference is None else len(runs.get(c.reference, []))
        if min(n_ref, n_arm) < 2:
            state = "pending (not enough seeds)"
        elif min(n_ref, n_arm) < full:
            state = "provisional (seeds missing)"
        else:
            state = "complete"
        ref = "0" if c.reference is None else f"{labels[c.reference]} ({n_ref}/{full} seeds)"
        lines.append(f"{c.outcome}: {labels[c.arm]} ({n_arm}/{full} seeds) vs {ref}: {state}")
    return lines


def per_staleness(run: Run, key: str) -> dict[int, float]:
    """``{staleness: mean over the steps}`` of a per-staleness record ``key`` of a run."""
    acc: dict[int, list[float]] = {}
    for m in run.metrics:
        for s, v in (m.get(key) or {}).items():
            if v is not None:
                acc.setdefault(int(s), []).append(float(v))
    return {s: sum(v) / len(v) for s, v in sorted(acc.items())}
