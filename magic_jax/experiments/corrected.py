"""The claims' predictions judged as pre-registered: the declared test's p-value, Holm's
correction within each claim and across the whole table, a rank test beside Welch's t,
and labels that name the measure.

Each claim's pre-registration (``experiments.prereg``) lists its predictions; a prediction
is judged on the seeds of its two arms (``verdicts.judge``: the difference, its 95% Welch
interval). Its raw p is that of the test the file declares for the measure; the exact
Mann-Whitney U p (two-sided, 5 vs 5 seeds: the smallest possible is 2/252 = 0.0079) is
shown beside Welch's for every prediction, bimodal or not, rather than deciding which
outcomes are bimodal. A directional prediction is "reproduced" when its Holm-adjusted p
(within its claim) is below 0.05 with the predicted sign, "not reproduced" below 0.05 with
the other sign, "inconclusive" otherwise; the verdict under Holm across every prediction
of the table is shown beside it. A "same" prediction is judged by its 95% interval against
its tolerance and is not part of the Holm families (it tests no difference).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from magic_jax.experiments.prereg import Prediction, Prereg
from magic_jax.experiments.results import results_dir
from magic_jax.experiments.verdicts import ALPHA, OUTCOMES, Effect, judge

TEST_NAMES = {
    "welch": "Welch's t",
    "mann-whitney": "Mann-Whitney U, exact (ties by permutation)",
    "wilcoxon-paired": "Wilcoxon signed-rank, paired by seed",
}


def holm(ps: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given (nan stays nan and does not
    count towards the family's size)."""
    idx = sorted((i for i, p in enumerate(ps) if not math.isnan(p)), key=lambda i: ps[i])
    m = len(idx)
    out = [math.nan] * len(ps)
    running = 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * ps[i]))
        out[i] = running
    return out


def rank_p(reference: Sequence[float], arm: Sequence[float]) -> float:
    """Two-sided exact Mann-Whitney U p-value that handles ties (nan with fewer than 2
    values a side, or a value that is not finite).

    The permutation distribution of the arm's rank sum, with tied values given their
    midranks, over every way of splitting the pooled values into the two arms' sizes
    (counted, not sampled); p = 2 min(P(W <= w), P(W >= w)), capped at 1. Without ties it
    is scipy's ``method="exact"``; with ties scipy's exact p assumes none and is too large
    (8 vs 8 seeds with U = 13.5: 0.065 against the permutation's 0.0535).
    """
    from math import comb

    import numpy as np
    from scipy import stats

    if min(len(reference), len(arm)) < 2:
        return math.nan
    pooled = np.concatenate([np.asarray(arm, float), np.asarray(reference, float)])
    if not np.isfinite(pooled).all():  # a measure a run could not give: as scipy, nan
        return math.nan
    r2 = np.rint(2 * stats.rankdata(pooled)).astype(int)  # twice the midranks: integers
    n, total = len(arm), int(r2.sum())
    # ways[k, s]: subsets of k of the values seen so far whose doubled ranks sum to s
    ways = np.zeros((n + 1, total + 1))
    ways[0, 0] = 1.0
    for r in r2:
        ways[1:, r:] += ways[:-1, : total + 1 - r].copy()
    dist = ways[n] / comb(len(pooled), n)  # counts exact in float64 while below 2**53
    w = int(r2[:n].sum())
    return float(min(1.0, 2 * min(dist[: w + 1].sum(), dist[w:].sum())))


def paired_p(reference: Sequence[float], arm: Sequence[float]) -> float:
    """Two-sided Wilcoxon signed-rank p of the seed-by-seed differences (nan when the seeds
    do not pair up or every difference is 0)."""
    from scipy import stats

    d = [a - r for a, r in zip(arm, reference)]
    if len(arm) != len(reference) or len(d) < 2 or not any(d):
        return math.nan
    return float(stats.wilcoxon(d).pvalue)


@dataclasses.dataclass(frozen=True)
class Row:
    """One prediction of one claim, judged.

    Attributes:
      claim: the pre-registration's name (file stem).
      prediction: as declared.
      measure: the measure this row used (the declared one, or the first declared).
      effect: ``verdicts.judge``'s result (difference, Welch interval and p).
      test: the declared test; ``p`` its raw p-value.
      p_welch / p_rank: Welch's t and exact Mann-Whitney U, always both.
      primary: whether it is the claim's primary endpoint.
      p_claim / p_table: Holm-adjusted within the claim / across the table (nan: not in
        a family, "same" predictions).
      verdict / verdict_table: from ``p_claim`` / ``p_table``.
    """

    claim: str
    prediction: Prediction
    measure: str
    effect: Effect
    test: str
    p: float
    p_welch: float
    p_rank: float
    primary: bool
    p_claim: float = math.nan
    p_table: float = math.nan
    verdict: str = ""
    verdict_table: str = ""

    @property
    def against(self) -> bool:
        """Whether the point estimate has the sign opposite to the prediction."""
        s = self.effect.check.sign
        return s != 0 and self.effect.diff * s < 0


def adjusted_verdict(effect: Effect, p_adj: float) -> str:
    """A directional prediction's verdict from an adjusted p; "same" keeps its interval's."""
    if effect.check.sign == 0:
        return effect.verdict
    if math.isnan(p_adj) or p_adj >= ALPHA:
        return "inconclusive"
    return "reproduced" if (effect.diff > 0) == (effect.check.sign > 0) else "not reproduced"


def load_runs(
    arms: Sequence[str], seeds: Sequence[int], results: str | Path | None = None
) -> dict[str, list]:
    """``{arm: [report.Run of each finished seed, in seed order]}`` under ``<results>/runs``."""
    from magic_jax.jobs.report import load_run

    where = results_dir(results)
    out: dict[str, list] = {}
    for arm in arms:
        out[arm] = [
            load_run(d, name=f"{arm} (seed {s})")
            for s in seeds
            if ((d := where / "runs" / arm / f"seed{s}") / "run.json").exists()
        ]
    return out


def _value(measure: str, run: Any) -> float:
    return OUTCOMES[measure](run)


def claim_rows(
    pre: Prereg, runs: Mapping[str, Sequence[Any]], *, first_declared: bool = False
) -> list[Row]:
    """The claim's predictions judged on ``runs`` (raw p only), the primary endpoint first
    (added if no prediction equals it); with ``first_declared``, each measure changed after
    the runs is replaced by the one first declared."""
    key = (pre.primary.measure, pre.primary.arms, pre.primary.direction)
    preds = [p for p in pre.predictions if (p.measure, p.arms, p.direction) != key]
    rows = []
    for pr in [pre.primary, *preds]:
        measure = pre.first_declared(pr.measure) if first_declared else pr.measure
        if measure not in OUTCOMES:
            continue  # a measure this package does not compute yet (a world to be added)
        check = pr.check(measure)
        arm = [_value(measure, r) for r in runs.get(pr.arms[0], [])]
        ref = (
            [0.0] * len(arm)
            if pr.arms[1] is None
            else [_value(measure, r) for r in runs.get(pr.arms[1], [])]
        )
        eff = judge(check, ref, arm)
        test = pr.test or pre.test_for(pr.measure)
        p_rank = rank_p(ref, arm) if pr.arms[1] is not None else math.nan
        by_test = {"welch": eff.p, "mann-whitney": p_rank, "wilcoxon-paired": paired_p(ref, arm)}
        rows.append(
            Row(pre.name, pr, measure, eff, test, by_test[test], eff.p, p_rank, pr is pre.primary)
        )
    return rows


def _in_family(r: Row) -> bool:
    return r.effect.check.sign != 0 and not math.isnan(r.p)


def correct(by_claim: Mapping[str, Sequence[Row]]) -> dict[str, list[Row]]:
    """Holm within each claim and across every claim's rows; verdicts from both."""
    flat = [r for rows in by_claim.values() for r in rows if _in_family(r)]
    table = dict(zip(map(id, flat), holm([r.p for r in flat])))
    out = {}
    for claim, rows in by_claim.items():
        fam = [r for r in rows if _in_family(r)]
        within = dict(zip(map(id, fam), holm([r.p for r in fam])))
        out[claim] = [
            dataclasses.replace(
                r,
                p_claim=within.get(id(r), math.nan),
                p_table=table.get(id(r), math.nan),
                verdict=adjusted_verdict(r.effect, within.get(id(r), math.nan)),
                verdict_table=adjusted_verdict(r.effect, table.get(id(r), math.nan)),
            )
            for r in rows
        ]
    return out


def raw_verdict(r: Row) -> str:
    """The verdict at the declared test's raw p (``Row.p``), before any correction."""
    return adjusted_verdict(r.effect, r.p)


def headline(
    rows: Mapping[str, Sequence[Row]], claims: Sequence[str] | None = None
) -> tuple[int, int, int, int]:
    """``(predictions, reproduced at the declared test's raw p < 0.05, after Holm within
    each claim, after Holm across the table)`` over ``claims`` (default: every claim)."""
    rs = [r for c, x in rows.items() if claims is None or c in claims for r in x]
    return (
        len(rs),
        sum(raw_verdict(r) == "reproduced" for r in rs),
        sum(r.verdict == "reproduced" for r in rs),
        sum(r.verdict_table == "reproduced" for r in rs),
    )


def judge_all(
    pres: Mapping[str, Prereg], results: str | Path | None = None, *, first_declared: bool = False
) -> dict[str, list[Row]]:
    """Every claim's rows, corrected (claims without runs give no rows)."""
    raw = {}
    for name, pre in pres.items():
        runs = load_runs(pre.arms, pre.seeds, results)
        raw[name] = (
            claim_rows(pre, runs, first_declared=first_declared) if any(runs.values()) else []
        )
    return correct(raw)


def word(rows: Sequence[Row]) -> str:
    """One word for the verdicts of one measure's rows (Holm within the claim)."""
    verdicts = [r.verdict for r in rows]
    vs = set(verdicts)
    if vs == {"reproduced"}:
        return "reproduced"
    if "not reproduced" in vs:
        return "not reproduced" if "reproduced" not in vs else "mixed"
    if "reproduced" in vs:
        return f"reproduced in {verdicts.count('reproduced')} of {len(verdicts)}"
    against = sum(r.against for r in rows)
    if against:
        return f"inconclusive, {against} of {len(rows)} estimates against the prediction"
    return "inconclusive"


def label(rows: Sequence[Row]) -> str:
    """The claim's verdict by measure, from the Holm-adjusted p within the claim
    ("late entropy: reproduced; final accuracy: inconclusive"). A prediction's note is
    quoted after its measure only when that prediction held (reproduced under Holm within
    the claim); the notes of the others are in the pre-registration, and their verdicts in
    the word before (``word``) and in ``figures/effects.md``."""
    by: dict[str, list[Row]] = {}
    for r in rows:
        by.setdefault(r.measure, []).append(r)
    parts = []
    for measure, rs in by.items():
        text = f"{measure}: {word(rs)}"
        notes = sorted(
            {r.prediction.note for r in rs if r.prediction.note and r.verdict == "reproduced"}
        )
        if notes:
            text += f" [{'; '.join(notes)}]"
        parts.append(text)
    return "; ".join(parts)


def detectable_effect(effect: Effect, power: float = 0.8, alpha: float = ALPHA) -> float:
    """The smallest |difference| the seeds could detect with probability ``power`` in a
    two-sided Welch test at ``alpha`` (before any correction), given the spread the runs
    showed: (t_{1 - alpha/2} + t_{power}) x the standard error, on the Welch-Satterthwaite
    degrees of freedom. nan with fewer than 2 seeds a side or no spread. A rank test needs
    about 5% more under normality (its efficiency 3/pi), and with n seeds a side cannot go
    below p = 2 / C(2n, n) at all."""
    from scipy import stats

    a, r = effect.arm, effect.reference
    if min(len(a), len(r)) < 2 or not effect.se > 0:
        return math.nan
    va = _var(a) / len(a)
    vr = _var(r) / len(r)
    df = (va + vr) ** 2 / (va**2 / (len(a) - 1) + vr**2 / (len(r) - 1))
    return float((stats.t.ppf(1 - alpha / 2, df) + stats.t.ppf(power, df)) * effect.se)


def _var(x: Sequence[float]) -> float:
    m = sum(x) / len(x)
    return sum((v - m) ** 2 for v in x) / (len(x) - 1)


def primary_verdict(rows: Sequence[Row]) -> str:
    """The claim's verdict: its primary endpoint's (Holm within the claim), saying when an
    inconclusive estimate points against the prediction."""
    prim = next((r for r in rows if r.primary), None)
    if prim is None:
        return "no runs yet"
    v = prim.verdict
    if v == "inconclusive" and prim.against:
        v += " (estimate against the prediction)"
    return v
