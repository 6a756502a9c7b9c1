"""The ablations' verdicts: each run's one-number outcomes, the report's predictions, and
Welch's t on the seeds of two arms (the 95% interval of the difference and its p-value).

``magic_jax.experiments.ablation_report`` draws and tabulates them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from magic_jax.experiments.checks import CHECKS as CHECKS
from magic_jax.experiments.checks import Check as Check
from magic_jax.experiments.results import load_arm_runs, train_config
from magic_jax.jobs.report import Run

# A run's one-number outcomes (seed by seed), by name: (description, function).


def _evals(run: Run) -> list[dict[str, Any]]:
    return [e for e in run.evals if isinstance(e.get("accuracy"), int | float)]


def final_accuracy(run: Run) -> float:
    """Held-out avg@n at the last evaluation."""
    return float(_evals(run)[-1]["accuracy"])


def final_accuracy_at_06(run: Run) -> float:
    """Held-out avg@n at the last evaluation, sampled at temperature 0.6
    (``eval.extra_temperatures``; nan where the run did not measure it)."""
    extra = _evals(run)[-1].get("by_temperature") or {}
    return float(extra["0.6"]["accuracy"]) if "0.6" in extra else math.nan


def late_selected_entropy(run: Run) -> float:
    """The entropy of the tokens ``entropy.tokens`` selects (``entropy_selected``), averaged
    over the last third of the steps (nan where the run did not record it)."""
    v = [m["entropy_selected"] for m in run.metrics if "entropy_selected" in m]
    return _late_mean(v) if len(v) == len(run.metrics) and v else math.nan


def final_chain_accuracy(run: Run) -> float:
    """Lock-out world: held-out avg@n on the carry-chain half at the last evaluation (the
    evaluation's ``by_source`` entry whose source ends in ``-chain``)."""
    by = _evals(run)[-1].get("by_source") or {}
    chain = [v for k, v in by.items() if k.endswith("-chain")]
    return float(chain[0]) if len(chain) == 1 else math.nan


def probe_log10_p_stage1_end(run: Run) -> float:
    """Lock-out world: the probe's mean over the held-out chains of log10 of the exact
    probability of the full check, at the evaluation that ends stage 1 (nan without one).

    That evaluation is at the first step of stage 2; a run with one stage (the
    learnability control, as long as the others' two) is read at the same step, half its
    steps (step 150, as notebooks/prereg/central-lockout.yaml states)."""
    stage2 = [m["step"] for m in run.metrics if m.get("stage") == 1]
    end = min(stage2) if stage2 else len(run.metrics) // 2
    row = next((e for e in _evals(run) if e["step"] == end), None)
    probe = (row or {}).get("probe") or {}
    return float(probe.get("log10_p_mean", math.nan))


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


def _late_mean(v: Sequence[float]) -> float:
    """Mean over the last third of ``v`` (at least one value)."""
    tail = v[-max(1, len(v) // 3) :]
    return float(sum(tail) / len(tail))


def late_entropy(run: Run) -> float:
    """Token entropy averaged over the last third of the steps."""
    return _late_mean([m["entropy"] for m in run.metrics])


def late_target_gap(run: Run, target: float | None = None) -> float:
    """Mean |entropy - target| over the last third of the steps (target: the run's config's
    unless given)."""
    if target is None:
        target = float((run.config.get("entropy") or {}).get("target", 0.0))
    return _late_mean([abs(m["entropy"] - target) for m in run.metrics])


@functools.cache
def _carry_target() -> float:
    """The entropy target of the shipped carry config (read once)."""
    import yaml

    cfg = yaml.safe_load(train_config("carry").read_text())
    return float(cfg["entropy"]["target"])


def late_carry_target_gap(run: Run) -> float:
    """``late_target_gap`` against the shipped carry config's target for every arm (a
    fixed-coefficient run's config holds whichever target its carry config had)."""
    return late_target_gap(run, _carry_target())


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
    v = [
        m["accuracy_not_truncated"]
        for m in _stage_rows(run, 0)
        if isinstance(m.get("accuracy_not_truncated"), int | float)
        and not math.isnan(m["accuracy_not_truncated"])
    ]
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
    """Second-stage KL to the reference: the median over its last fifth of steps minus the
    median over its first fifth (< 0: pulled back). Medians, because single steps spike
    (a step of 3 nats among steps of 0.1)."""
    v = [m.get("ref_kl", 0.0) for m in _stage_rows(run, 1)]
    if len(v) < 2:
        return math.nan
    k = max(1, len(v) // 5)
    return float(statistics.median(v[-k:]) - statistics.median(v[:k]))


def stage2_ref_kl_drift_first(run: Run) -> float:
    """The stage-2 KL drift as first declared (before 9170fd0): the mean of the stage's last
    5 steps minus the mean of its first 5 (kept to show what the runs gave under it)."""
    v = [m.get("ref_kl", 0.0) for m in _stage_rows(run, 1)]
    if len(v) < 2:
        return math.nan
    k = min(5, len(v) // 2)
    return float(sum(v[-k:]) / k - sum(v[:k]) / k)


def max_grad_norm(run: Run) -> float:
    """Largest gradient norm of the run (instability shows here first)."""
    return float(max(m.get("grad_norm", 0.0) for m in run.metrics))


def world_record(run: Run) -> dict[str, Any]:
    """The run's ``world.json`` (carry world: the final model's statistics), or {}."""
    p = Path(run.path) / "world.json"
    return json.loads(p.read_text()) if p.exists() else {}


def final_check_rate(run: Run) -> float:
    """Carry world: share of the columns in a carry that the final model checks (the better
    strategy: an answer is right exactly when all of them are), held-out problems at T 64."""
    return float(world_record(run).get("check_rate_needed", math.nan))


def final_check_rate_other(run: Run) -> float:
    """Carry world: share of the columns without a carry that the final model checks
    (checking them costs length and buys nothing: diversity among correct answers)."""
    return float(world_record(run).get("check_rate_other", math.nan))


def mean_alpha(run: Run) -> float:
    """The entropy coefficient alpha_k the update used, averaged over all steps."""
    v = [m.get("alpha", 0.0) for m in run.metrics]
    return float(sum(v) / len(v)) if v else math.nan


def mean_sampler_kl(run: Run) -> float:
    """``sampler_kl`` (k3, sampler to weights at each update's start), mean over updates."""
    v = [m["sampler_kl"] for m in run.metrics if m.get("sampler_kl") is not None]
    return float(sum(v) / len(v)) if v else math.nan


def alpha_off_bounds(run: Run) -> float:
    """Share of steps whose entropy coefficient is strictly inside its bounds (0, max_coef]."""
    cap = (run.config.get("entropy") or {}).get("max_coef")
    v = [m.get("alpha", 0.0) for m in run.metrics]
    inside = [a > 0 and (cap is None or a < float(cap) - 1e-12) for a in v]
    return float(sum(inside) / len(inside)) if inside else math.nan


OUTCOMES: dict[str, Callable[[Run], float]] = {
    "final accuracy": final_accuracy,
    "final accuracy (evaluated at 0.6)": final_accuracy_at_06,
    "mean accuracy": mean_accuracy,
    "final chain accuracy": final_chain_accuracy,
    "late choice-token entropy": late_selected_entropy,
    "late decision-token entropy": late_selected_entropy,
    "probe log10 p at stage-1 end": probe_log10_p_stage1_end,
    "mean entropy": mean_entropy,
    "late entropy": late_entropy,
    "late |entropy - target|": late_target_gap,
    "late |entropy - carry target|": late_carry_target_gap,
    "stage-1 truncated fraction": stage1_truncated,
    "stage-1 accuracy": stage1_accuracy,
    "stage-1 mean accuracy": stage1_mean_accuracy,
    "stage-1 rollout reward": stage1_reward,
    "stage-1 non-truncated accuracy": stage1_accuracy_not_truncated,
    "rollout tokens (M)": rollout_tokens,
    "stage-2 KL to reference": stage2_ref_kl,
    "stage-2 KL drift": stage2_ref_kl_drift,
    "stage-2 KL drift (means of 5 steps)": stage2_ref_kl_drift_first,
    "max grad norm": max_grad_norm,
    "final check rate (carry columns)": final_check_rate,
    "final check rate (other columns)": final_check_rate_other,
    "mean alpha": mean_alpha,
    "mean sampler KL": mean_sampler_kl,
    "alpha off its bounds": alpha_off_bounds,
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
        ref = self.check.reference
        r = "0" if ref is None else lab.get(ref, ref)  # no reference: the arm against 0
        a = lab.get(self.check.arm, self.check.arm)
        interval = "" if math.isnan(self.low) else f", 95% CI [{self.low:+.3f}, {self.high:+.3f}]"
        p = "" if math.isnan(self.p) else f", Welch p = {_p(self.p)}"
        return (
            f"{self.check.outcome}: {a} {mean_of(self.arm):.3f} "
            f"vs {r} {mean_of(self.reference):.3f} "
            f"(diff {self.diff:+.3f}{interval}{p}, "
            f"seeds {len(self.arm)}/{len(self.reference)}) -> {self.verdict} at raw p"
        )


def _p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-3 else "< 0.001"


def mean_of(v: Sequence[float]) -> float:
    """The mean of the seeds' values (nan for none)."""
    return sum(v) / len(v) if v else math.nan


def sample_var(v: Sequence[float]) -> float:
    """The seeds' sample variance (0 for fewer than two)."""
    if len(v) < 2:
        return 0.0
    m = mean_of(v)
    return sum((x - m) ** 2 for x in v) / (len(v) - 1)


ALPHA = 0.05  # a prediction counts as reproduced only at Welch p < 0.05


def welch(reference: Sequence[float], arm: Sequence[float]) -> tuple[float, float, float, float]:
    """(se, 95% low, 95% high, two-sided p) of mean(arm) - mean(reference), Welch's t.

    nan for the interval and p with fewer than 2 values a side, or when neither side varies.
    """
    from scipy import stats

    na, nr = len(arm), len(reference)
    va, vr = sample_var(arm), sample_var(reference)
    se = math.sqrt(va / max(na, 1) + vr / max(nr, 1))
    if min(na, nr) < 2 or se == 0:
        return se, math.nan, math.nan, math.nan
    df = (va / na + vr / nr) ** 2 / ((va / na) ** 2 / (na - 1) + (vr / nr) ** 2 / (nr - 1))
    diff = mean_of(arm) - mean_of(reference)
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
    diff = mean_of(arm) - mean_of(reference)
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


def run_seed(run: Run) -> int | None:
    """The seed a finished run records in its ``run.json`` (None without one)."""
    p = Path(run.path) / "run.json"
    return json.loads(p.read_text()).get("seed") if p.exists() else None


def effects(
    ablation: str, runs: Mapping[str, Sequence[Run]] | None = None, results: Any = None
) -> list[Effect]:
    """Every check of ``ablation`` on the finished runs."""
    runs = load_arm_runs(ablation, results) if runs is None else runs
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


def verdict(effs: Sequence[Effect]) -> str:
    """One word for an ablation: every check reproduced, any failed, or otherwise inconclusive."""
    vs = {e.verdict for e in effs}
    if vs == {"reproduced"}:
        return "reproduced"
    if "not reproduced" in vs:
        return "not reproduced" if "reproduced" not in vs else "partly reproduced"
    return "partly reproduced (rest inconclusive)" if "reproduced" in vs else "inconclusive"
