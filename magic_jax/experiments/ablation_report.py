"""The ablations' figures and verdicts: seed means with their spread, effect sizes, one table.

Every quantity is read from the committed run summaries
(``magic_jax.experiments.ablations``), never from a notebook's own state, so
``python -m magic_jax.experiments.ablations figures`` redraws exactly what the
notebooks show.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from magic_jax.experiments import ablations
from magic_jax.jobs.report import Run, colors

# A run's one-number outcomes (seed by seed), by name: (description, function).


def _evals(run: Run) -> list[dict[str, Any]]:
    return [e for e in run.evals if isinstance(e.get("accuracy"), int | float)]


def final_accuracy(run: Run) -> float:
    """Held-out avg@n at the last evaluation."""
    return float(_evals(run)[-1]["accuracy"])


def mean_accuracy(run: Run) -> float:
    """Held-out avg@n averaged over every evaluation after step 0 (area under the curve)."""
    ev = [e["accuracy"] for e in _evals(run) if e["step"] > 0]
    return float(sum(ev) / len(ev)) if ev else math.nan


def _stage_rows(run: Run, stage: int | None) -> list[dict[str, Any]]:
    return [m for m in run.metrics if stage is None or m.get("stage") == stage]


def mean_entropy(run: Run) -> float:
    """Token entropy of the rollouts, averaged over all steps (lower: faster collapse)."""
    v = [m["entropy"] for m in run.metrics]
    return float(sum(v) / len(v))


def late_entropy(run: Run) -> float:
    """Token entropy averaged over the last third of the steps."""
    v = [m["entropy"] for m in run.metrics]
    tail = v[-max(1, len(v) // 3) :]
    return float(sum(tail) / len(tail))


def late_target_gap(run: Run) -> float:
    """Mean |entropy - target| over the last third of the steps (target from the config)."""
    target = float((run.config.get("entropy") or {}).get("target", 0.0))
    v = [abs(m["entropy"] - target) for m in run.metrics]
    tail = v[-max(1, len(v) // 3) :]
    return float(sum(tail) / len(tail))


def stage1_truncated(run: Run) -> float:
    """Fraction of rollouts truncated, averaged over the first stage's steps."""
    v = [m["truncated_fraction"] for m in _stage_rows(run, 0)]
    return float(sum(v) / len(v))


def stage1_mean_accuracy(run: Run) -> float:
    """Held-out avg@n averaged over the evaluations after step 0 inside the first stage."""
    last = max((m["step"] for m in _stage_rows(run, 0)), default=0) + 1
    ev = [e["accuracy"] for e in _evals(run) if 0 < e["step"] <= last]
    return float(sum(ev) / len(ev)) if ev else math.nan


def stage1_reward(run: Run) -> float:
    """Training accuracy at the first stage's T: rollout reward averaged over its steps
    (a truncated response scores 0)."""
    v = [m["reward"] for m in _stage_rows(run, 0)]
    return float(sum(v) / len(v))


def stage1_accuracy_not_truncated(run: Run) -> float:
    """Accuracy of the responses that fit the first stage's T, averaged over its steps."""
    v = [m["accuracy_not_truncated"] for m in _stage_rows(run, 0)
         if isinstance(m.get("accuracy_not_truncated"), int | float)
         and not math.isnan(m["accuracy_not_truncated"])]  # fmt: skip
    return float(sum(v) / len(v)) if v else math.nan


def stage1_accuracy(run: Run) -> float:
    """Held-out avg@n at the last evaluation inside the first stage."""
    last = max((m["step"] for m in _stage_rows(run, 0)), default=0) + 1
    ev = [e for e in _evals(run) if e["step"] <= last]
    return float(ev[-1]["accuracy"])


def rollout_tokens(run: Run) -> float:
    """Response tokens sampled over the whole run (millions): sum of mean length x samples."""
    g = None
    for st in run.config.get("stages") or []:
        g = st.get("group_size", g)
    g = g or 1
    tot = 0.0
    for m in run.metrics:
        n = (m.get("prompts", 0) + m.get("extra_rollouts", 0) / g) * g
        tot += m["response_length_mean"] * n
    return tot / 1e6


def stage2_ref_kl(run: Run) -> float:
    """KL to the reference policy averaged over the second stage's steps."""
    v = [m.get("ref_kl", 0.0) for m in _stage_rows(run, 1)]
    return float(sum(v) / len(v)) if v else math.nan


def stage2_ref_kl_drift(run: Run) -> float:
    """Second-stage KL to the reference: last 5 steps minus first 5 (< 0: pulled back)."""
    v = [m.get("ref_kl", 0.0) for m in _stage_rows(run, 1)]
    if len(v) < 2:
        return math.nan
    k = min(5, len(v) // 2)
    return float(sum(v[-k:]) / k - sum(v[:k]) / k)


def max_grad_norm(run: Run) -> float:
    """Largest gradient norm of the run (instability shows here first)."""
    return float(max(m.get("grad_norm", 0.0) for m in run.metrics))


def _world(run: Run) -> dict[str, Any]:
    """The run's ``world.json`` (carry world: the final model's statistics), or {}."""
    import json

    p = Path(run.path) / "world.json"
    return json.loads(p.read_text()) if p.exists() else {}


def final_check_rate(run: Run) -> float:
    """Carry world: share of the columns in a carry that the final model checks (the better
    strategy: an answer is right exactly when all of them are), held-out problems at T 64."""
    return float(_world(run).get("check_rate_needed", math.nan))


def final_check_rate_other(run: Run) -> float:
    """Carry world: share of the columns without a carry that the final model checks
    (checking them costs length and buys nothing: diversity among correct answers)."""
    return float(_world(run).get("check_rate_other", math.nan))


def alpha_off_bounds(run: Run) -> float:
    """Share of steps whose entropy coefficient is strictly inside its bounds (0, max_coef]."""
    cap = (run.config.get("entropy") or {}).get("max_coef")
    v = [m.get("alpha", 0.0) for m in run.metrics]
    inside = [a > 0 and (cap is None or a < float(cap) - 1e-12) for a in v]
    return float(sum(inside) / len(inside)) if inside else math.nan


OUTCOMES: dict[str, Callable[[Run], float]] = {
    "final accuracy": final_accuracy,
    "mean accuracy": mean_accuracy,
    "mean entropy": mean_entropy,
    "late entropy": late_entropy,
    "late |entropy - target|": late_target_gap,
    "stage-1 truncated fraction": stage1_truncated,
    "stage-1 accuracy": stage1_accuracy,
    "stage-1 mean accuracy": stage1_mean_accuracy,
    "stage-1 rollout reward": stage1_reward,
    "stage-1 non-truncated accuracy": stage1_accuracy_not_truncated,
    "rollout tokens (M)": rollout_tokens,
    "stage-2 KL to reference": stage2_ref_kl,
    "stage-2 KL drift": stage2_ref_kl_drift,
    "max grad norm": max_grad_norm,
    "final check rate (carry columns)": final_check_rate,
    "final check rate (other columns)": final_check_rate_other,
    "alpha off its bounds": alpha_off_bounds,
}


@dataclasses.dataclass(frozen=True)
class Check:
    """One directional prediction of the report: ``arm`` minus ``reference`` in ``outcome``.

    Attributes:
      outcome: a key of ``OUTCOMES``.
      reference / arm: arm keys; ``reference`` None compares ``arm`` with 0.
      sign: the report's predicted sign of (arm - reference): -1, +1, or 0 for "the same".
      tolerance: for sign 0, the largest |difference| that counts as the same.
    """

    outcome: str
    reference: str | None
    arm: str
    sign: int
    tolerance: float = 0.0


# The report's predictions, per ablation.
CHECKS: dict[str, tuple[Check, ...]] = {
    "central": (
        Check("final accuracy", "carry-none", "carry-adaptive", +1),
        Check("final accuracy", "carry-fixed-0.005", "carry-adaptive", +1),
        Check("late entropy", "carry-none", "carry-adaptive", +1),
        Check("final check rate (carry columns)", "carry-none", "carry-adaptive", +1),
        Check("final accuracy", "carry-none", "carry-adaptive-0.07", +1),
        Check("final accuracy", "carry-fixed-0.005", "carry-adaptive-0.07", +1),
        Check("late entropy", "carry-none", "carry-adaptive-0.07", +1),
        Check("final accuracy", "carry-none", "carry-fixed-0.005", +1),
    ),
    "temperature": (
        Check("mean entropy", "baseline", "temp-0.6", -1),
        Check("final accuracy", "baseline", "temp-0.6", -1),
    ),
    "off_policy": (
        Check("mean entropy", "baseline", "nsgd4-minibatch", -1),
        Check("final accuracy", "baseline", "nsgd4-minibatch", -1),
        Check("mean entropy", "baseline", "nsgd4-reuse", -1),
        Check("final accuracy", "baseline", "nsgd4-reuse", -1),
    ),
    "entropy_control": (
        Check("late entropy", "ent-fixed-0.5", "ent-fixed-0.005", -1),
        Check("late entropy", "ent-fixed-0.5", "ent-fixed-5", +1),
        Check("late |entropy - target|", "ent-fixed-0.005", "ent-adaptive-0.2", -1),
        Check("late |entropy - target|", "ent-fixed-5", "ent-adaptive-0.2", -1),
    ),
    "adv_mask": (
        Check("stage-1 truncated fraction", "carry-none", "carry-mask-before", +1),
        Check("stage-1 rollout reward", "carry-none", "carry-mask-before", -1),
        Check("stage-1 non-truncated accuracy", "carry-none", "carry-mask-before", +1),
    ),
    "clip_higher": (
        Check("mean entropy", "clip-0.2-nsgd4", "clip-0.25-nsgd4", +1),
        Check("mean entropy", "clip-0.2-nsgd4", "nsgd4-minibatch", +1),
        Check("max grad norm", "clip-0.2-nsgd4", "nsgd4-minibatch", +1),
    ),
    "kl": (
        # with beta 0 the reference is not even built (no KL measured): the pull is read
        # from the KL arm's own KL over stage 2
        Check("stage-2 KL drift", None, "kl-1e-3", -1),
        Check("final accuracy", "baseline", "kl-1e-3", -1),
        Check("stage-2 KL to reference", "kl-1e-3", "kl-0.1", -1),
        Check("stage-2 KL drift", None, "kl-0.1", -1),
        Check("final accuracy", "baseline", "kl-0.1", -1),
    ),
    "multi_stage": (
        Check("final accuracy", "single-T64", "baseline", 0, tolerance=0.02),
        Check("rollout tokens (M)", "single-T64", "baseline", -1),
    ),
}


@dataclasses.dataclass(frozen=True)
class Effect:
    """A check's result over seeds.

    Attributes:
      check: the prediction.
      reference / arm: the outcome of each seed.
      diff: mean(arm) - mean(reference).
      se: its standard error, sqrt(s_a^2 / n_a + s_r^2 / n_r) (0 with one seed each).
      low / high: the 95% interval of ``diff`` (Welch: Student's t with the
        Welch-Satterthwaite degrees of freedom); nan when it cannot be formed.
      p: Welch's two-sided p-value of diff = 0 (nan with fewer than 2 seeds a side or no
        spread at all).
      verdict: "reproduced", "not reproduced" or "inconclusive".
    """

    check: Check
    reference: list[float]
    arm: list[float]
    diff: float
    se: float
    verdict: str
    low: float = math.nan
    high: float = math.nan
    p: float = math.nan

    def text(self, labels: Mapping[str, str] | None = None) -> str:
        lab = labels or {}
        r, a = (
            lab.get(self.check.reference, self.check.reference or "0"),
            lab.get(self.check.arm, self.check.arm),
        )
        interval = "" if math.isnan(self.low) else f", 95% CI [{self.low:+.3f}, {self.high:+.3f}]"
        p = "" if math.isnan(self.p) else f", Welch p = {_p(self.p)}"
        return (
            f"{self.check.outcome}: {a} {_mean(self.arm):.3f} vs {r} {_mean(self.reference):.3f} "
            f"(diff {self.diff:+.3f}{interval}{p}, "
            f"seeds {len(self.arm)}/{len(self.reference)}) -> {self.verdict}"
        )


def _p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-3 else "< 0.001"


def _mean(v: Sequence[float]) -> float:
    return sum(v) / len(v) if v else math.nan


def _var(v: Sequence[float]) -> float:
    if len(v) < 2:
        return 0.0
    m = _mean(v)
    return sum((x - m) ** 2 for x in v) / (len(v) - 1)


ALPHA = 0.05  # a prediction counts as reproduced only at Welch p < 0.05


def welch(reference: Sequence[float], arm: Sequence[float]) -> tuple[float, float, float, float]:
    """(se, 95% low, 95% high, two-sided p) of mean(arm) - mean(reference), Welch's t.

    nan for the interval and p with fewer than 2 values a side, or when neither side varies.
    """
    from scipy import stats

    na, nr = len(arm), len(reference)
    va, vr = _var(arm), _var(reference)
    se = math.sqrt(va / max(na, 1) + vr / max(nr, 1))
    if min(na, nr) < 2 or se == 0:
        return se, math.nan, math.nan, math.nan
    df = (va / na + vr / nr) ** 2 / ((va / na) ** 2 / (na - 1) + (vr / nr) ** 2 / (nr - 1))
    diff = _mean(arm) - _mean(reference)
    half = float(stats.t.ppf(0.975, df)) * se
    p = float(2 * stats.t.sf(abs(diff) / se, df))
    return se, diff - half, diff + half, p


def judge(check: Check, reference: Sequence[float], arm: Sequence[float]) -> Effect:
    """Compares two arms' per-seed outcomes against the predicted sign (Welch's t).

    A directional prediction is "reproduced" when the difference has the predicted sign at
    p < 0.05 (two-sided), "not reproduced" when it has the other sign at p < 0.05, and
    "inconclusive" otherwise (fewer than 2 seeds a side, or no spread at all). For sign 0
    ("the same"), it holds when the 95% interval lies within +-tolerance and fails when the
    interval lies wholly outside it.
    """
    diff = _mean(arm) - _mean(reference)
    se, low, high, p = welch(reference, arm)
    if math.isnan(p) or math.isnan(diff):
        verdict = "inconclusive"
    elif check.sign == 0:
        if -check.tolerance <= low and high <= check.tolerance:
            verdict = "reproduced"
        elif low > check.tolerance or high < -check.tolerance:
            verdict = "not reproduced"
        else:
            verdict = "inconclusive"
    elif p >= ALPHA:
        verdict = "inconclusive"
    else:
        verdict = "reproduced" if (diff > 0) == (check.sign > 0) else "not reproduced"
    return Effect(check, list(reference), list(arm), diff, se, verdict, low, high, p)


def _seed(run: Run) -> int | None:
    import json

    p = Path(run.path) / "run.json"
    return json.loads(p.read_text()).get("seed") if p.exists() else None


def identical_arms(runs: Mapping[str, Sequence[Run]]) -> list[tuple[str, str, list[int]]]:
    """Pairs of arms whose rollouts are step-for-step identical in some seed (the same
    entropy, reward and mean response length at every step): ``(arm a, arm b, [seeds])``.
    Such an arm tested nothing in those seeds: its setting never changed the policy (a loss
    may still differ, e.g. where a clip that never binds moves the reported loss)."""
    keys = ("entropy", "reward", "response_length_mean")
    sig = {
        arm: {_seed(r): [tuple(m.get(k) for k in keys) for m in r.metrics] for r in rs}
        for arm, rs in runs.items()
    }
    out = []
    arms = list(runs)
    for i, a in enumerate(arms):
        for b in arms[i + 1 :]:
            same = sorted(
                s for s in sig[a] if s is not None and s in sig[b] and sig[a][s] == sig[b][s]
            )
            if same:
                out.append((a, b, same))
    return out


def identical_text(runs: Mapping[str, Sequence[Run]], labels: Mapping[str, str]) -> list[str]:
    """One line per pair of arms identical in some seed."""
    return [
        f"{labels.get(a, a)} and {labels.get(b, b)} are identical step for step in seed"
        f"{'s' if len(s) > 1 else ''} {', '.join(map(str, s))}"
        for a, b, s in identical_arms(runs)
    ]


def effects(
    ablation: str, runs: Mapping[str, Sequence[Run]] | None = None, results: Any = None
) -> list[Effect]:
    """Every check of ``ablation`` on the finished runs."""
    runs = ablations.load_arm_runs(ablation, results) if runs is None else runs
    out = []
    for c in CHECKS[ablation]:
        fn = OUTCOMES[c.outcome]
        if c.reference is None:
            arm = [fn(r) for r in runs.get(c.arm, [])]
            out.append(judge(c, [0.0] * len(arm), arm))
            continue
        out.append(
            judge(
                c, [fn(r) for r in runs.get(c.reference, [])], [fn(r) for r in runs.get(c.arm, [])]
            )
        )
    return out


def outcome_table(
    ablation: str, runs: Mapping[str, Sequence[Run]], outcomes: Sequence[str]
) -> list[list[str]]:
    """Rows ``[arm label, seeds, outcome mean +- std ...]`` for printing."""
    ab = ablations.ABLATIONS[ablation]
    rows = []
    for arm in ab.arms:
        rs = runs.get(arm.key, [])
        row = [arm.label, str(len(rs))]
        for o in outcomes:
            v = [OUTCOMES[o](r) for r in rs]
            row.append(f"{_mean(v):.3f} +- {math.sqrt(_var(v)):.3f}" if v else "-")
        rows.append(row)
    return rows


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


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


def _band(
    runs: Sequence[Run], key: str, evals: bool
) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps, mean, min and max over runs of ``key`` (steps every run has)."""
    per = [dict(zip(*r.series(key, evals=evals))) for r in runs]
    steps = sorted(set.intersection(*(set(p) for p in per))) if per else []
    mean = [_mean([p[s] for p in per]) for s in steps]
    lo = [min(p[s] for p in per) for s in steps]
    hi = [max(p[s] for p in per) for s in steps]
    return steps, mean, lo, hi


def plot_arms(ax: Any, runs: Mapping[str, Sequence[Run]], labels: Mapping[str, str], key: str,
              *, evals: bool = False) -> None:  # fmt: skip
    """One colour per arm: the seed mean as a line, the seeds' min-max as a band."""
    arms = [k for k in runs if runs[k]]
    for arm, color in zip(arms, colors(len(arms))):
        steps, mean, lo, hi = _band(runs[arm], key, evals)
        if not steps:
            continue
        ax.plot(steps, mean, color=color, linewidth=1.5, marker="o" if evals else None,
                markersize=3, label=f"{labels.get(arm, arm)} (n={len(runs[arm])})")  # fmt: skip
        if len(runs[arm]) > 1:
            ax.fill_between(steps, lo, hi, color=color, alpha=0.18, linewidth=0)
        if key == "entropy":
            ent = runs[arm][0].config.get("entropy") or {}
            if ent.get("mode", "adaptive") == "adaptive" and "target" in ent:
                ax.axhline(float(ent["target"]), color=color, linestyle="--", linewidth=0.9)


def ablation_figure(ablation: str, runs: Mapping[str, Sequence[Run]] | None = None,
                    results: Any = None) -> Any:  # fmt: skip
    """A 2 x 3 matplotlib figure (Agg) of one ablation: every arm's seed mean and spread."""
    from matplotlib.figure import Figure

    runs = ablations.load_arm_runs(ablation, results) if runs is None else runs
    ab = ablations.ABLATIONS[ablation]
    labels = {a.key: a.label for a in ab.arms}
    fig = Figure(figsize=(13.5, 6.6), dpi=90)
    axes = fig.subplots(2, 3)
    for ax, (key, title, evals) in zip(axes.flat, PANELS):
        plot_arms(ax, runs, labels, key, evals=evals)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key == "entropy":
            ax.set_yscale("log")
    stage_steps = sorted({
        m["step"] for rs in runs.values() for r in rs[:1]
        for prev, m in zip(r.metrics, r.metrics[1:]) if m.get("stage") != prev.get("stage")
    })  # fmt: skip
    for ax in axes.flat:
        for s in stage_steps:
            ax.axvline(s, color="0.5", linestyle=":", linewidth=0.9)
    axes.flat[0].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{ab.title}: seed mean (line) and min-max (band); dotted: stage change",
                 fontsize=11)  # fmt: skip
    fig.tight_layout()
    return fig


def world_table(ablation: str, runs: Mapping[str, Sequence[Run]],
                base: Mapping[str, Any] | None = None) -> str:  # fmt: skip
    """Carry world: the final models' strategy shares and accuracy per carry count (seed mean
    +- std of each run's ``world.json``), with the base model's figures (``base``: its
    ``build.json`` statistics) as the first row."""
    ab = ablations.ABLATIONS[ablation]
    cols = [("check_rate_needed", "checks carry columns"), ("check_rate_other", "checks others"),
            ("accuracy", "accuracy"), ("entropy_correct", "entropy, correct"),
            ("entropy_wrong", "entropy, wrong"), ("length", "length")]  # fmt: skip
    carries = [str(c) for c in range(6)]
    header = ["model", "seeds", *(c[1] for c in cols), *(f"acc, {c} carries" for c in carries)]

    def cell(v: Sequence[float], digits: int = 3) -> str:
        v = [x for x in v if not math.isnan(x)]
        if not v:
            return "-"
        return f"{_mean(v):.{digits}f}" + (
            f" +- {math.sqrt(_var(v)):.{digits}f}" if len(v) > 1 else ""
        )

    def row(name: str, stats: Sequence[Mapping[str, Any]]) -> list[str]:
        out = [name, str(len(stats))]
        out += [cell([float(s.get(k, math.nan)) for s in stats], 1 if k == "length" else 3)
                for k, _ in cols]  # fmt: skip
        out += [cell([float((s.get("by_carries") or {}).get(c, {}).get("accuracy", math.nan))
                      for s in stats], 2) for c in carries]  # fmt: skip
        return out

    rows = [row("base (step 0)", [base])] if base else []
    for arm in ab.arms:
        stats = [w for w in (_world(r) for r in runs.get(arm.key, [])) if w]
        if stats:
            rows.append(row(f"{arm.label}, final", stats))
    return format_table(header, rows)


def sft_comparison(
    arm: str,
    runs: Mapping[str, Sequence[Run]],
    sft: Mapping[int, Mapping[str, Any]],
    label: str | None = None,
) -> str:
    """Carry world: each seed's run of ``arm`` against supervised training continued from the
    base for the same seconds of training steps (``ablations.ensure_sft``), and the Welch
    comparison of their final held-out accuracies."""
    by_seed = {_seed(r): r for r in runs.get(arm, [])}
    rows, rl, sup = [], [], []
    for seed, res in sorted(sft.items()):
        r = by_seed.get(seed)
        if r is None:
            continue
        rl.append(final_accuracy(r))
        sup.append(float(res["after"]["accuracy"]))
        before = res["before"]["accuracy"]
        rows.append([str(seed), f"{res['seconds']:.0f}", str(res["steps"]),
                     f"{before:.3f}", f"{sup[-1]:.3f}", f"{rl[-1]:.3f}"])  # fmt: skip
    table = format_table(["seed", "seconds of steps", "SFT steps", "held-out before",
                          "after SFT", f"after {label or arm}"], rows)  # fmt: skip
    eff = judge(Check("final accuracy", "sft", arm, +1), sup, rl)
    return table + "\n\n" + eff.text({"sft": "SFT continuation", arm: label or arm})


def verdict(effs: Sequence[Effect]) -> str:
    """One word for an ablation: every check reproduced, any failed, or otherwise inconclusive."""
    vs = {e.verdict for e in effs}
    if vs == {"reproduced"}:
        return "reproduced"
    if "not reproduced" in vs:
        return "not reproduced" if "reproduced" not in vs else "partly reproduced"
    return "partly reproduced (rest inconclusive)" if "reproduced" in vs else "inconclusive"


# Where a claim stays inconclusive or fails: what the world it ran in lacks for it (from
# the runs' own numbers; shown in the table's last column).
LIMITS: dict[str, str] = {
    "central": (
        "A collapse that locks the better strategy out: every arm ends checking 99% of the "
        "columns a right answer needs (short problems keep checked solutions in the samples "
        "at T = 32), and entropy a bonus can hold up: alpha climbs to 0.13-0.24 without "
        "lifting late entropy, so it never tracks the target."
    ),
    "temperature": (
        "Later learning to lose: the demo world is solved by step 10 (held-out 93%), 30 steps "
        "in all. Evaluation at temperature 1 only (the report also evaluates at 0.6). At 0.6 "
        "whole groups agree and are dropped (no refill), so that arm skips optimizer steps."
    ),
    "off_policy": (
        "Seeds: the off-policy arms' final accuracy spreads over 30 points across 3 seeds, so a "
        "12-13 point drop has p 0.07-0.1; 5 or more seeds."
    ),
    "entropy_control": (
        "Uncertainty worth keeping: after the one-token style choice the demo policy's only "
        "entropy is in which digit to write, so the arm that holds the target (delta 0.2) holds "
        "it in wrong digits (held-out 4.4%); fixed 5's seeds spread too widely for p < 0.05."
    ),
    "clip_higher": (
        "Ratios near the clip: the largest ratios of a run reach 4.6-26, the upper clip binds on "
        "about 0.1% of tokens, and the arms' rollouts are identical step for step in some seeds."
    ),
    "kl": (
        "A KL term of the loss's size: beta x KL is about 1e-4 against a surrogate loss of "
        "0.005-0.1, so beta 1e-3 cannot pull; beta 0.1 lowers the KL (p = 0.12, 2 seeds) without "
        "changing accuracy; 2 seeds."
    ),
}


def summary_rows(results: Any = None) -> list[list[str]]:
    """The README table: ablation, claim, world, arms, seeds, effects, verdict, limits."""
    rows = []
    for key, ab in ablations.ABLATIONS.items():
        runs = ablations.load_arm_runs(key, results)
        effs = effects(key, runs, results)
        labels = {a.key: a.label for a in ab.arms}
        seeds = "/".join(str(len(runs[a.key])) for a in ab.arms)
        same = identical_text(runs, labels)
        rows.append([
            key, ab.claim, ab.world, "; ".join(a.label for a in ab.arms), seeds,
            "<br>".join([*(e.text(labels) for e in effs), *same]), verdict(effs),
            LIMITS.get(key, "") if verdict(effs) != "reproduced" else "",
        ])  # fmt: skip
    return rows


def summary_table(results: Any = None) -> str:
    """The Markdown table of ``summary_rows`` (``notebooks/README.md`` holds it verbatim)."""
    header = ["ablation", "report's claim", "world", "arms", "seeds per arm",
              "effects (mean diff, 95% interval, Welch p)", "verdict (p < 0.05)",
              "what this world lacks for it"]  # fmt: skip
    return format_table(header, summary_rows(results))


def write_figures(
    results: str | os.PathLike, out: str | os.PathLike, names: Sequence[str] | None = None
) -> Path:
    """``<ablation>.png`` per ablation with finished runs and ``summary.md``; returns ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for key in names or ablations.ABLATIONS:
        runs = ablations.load_arm_runs(key, results)
        if not any(runs.values()):
            continue
        fig = ablation_figure(key, runs)
        fig.savefig(out / f"{key}.png")
    (out / "summary.md").write_text(summary_table(results) + "\n")
    return out


def describe(ablation: str, runs: Mapping[str, Sequence[Run]] | None = None,
             results: Any = None) -> str:  # fmt: skip
    """What a notebook prints: each arm's outcomes (seed mean +- std), each check of the
    report's claim with its effect size and verdict, and the command that re-runs each arm."""
    runs = ablations.load_arm_runs(ablation, results) if runs is None else runs
    ab = ablations.ABLATIONS[ablation]
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
        f"verdict: {verdict(effs)}",
        "",
        "re-run an arm (skips seeds already in notebooks/results/runs):",
        *(f"  {ablations.rerun_command(ablation, a, s)}" for a in ab.arms for s in ab.seeds[:1]),
    ]
    return "\n".join(lines)
