"""How far "paired seeds" stay paired, and the noise of one arm against itself.

Seed k of every arm starts from the same model and draws the same first prompts, but the
runs are not bit-for-bit reproducible and every sampled token depends on all before it:
two runs of the same config drift apart once one logged value differs. ``TWINS`` are the
pairs of arms whose training configs are the same (over the steps given): the step where
they diverge, and the difference of an outcome between them, is the run-to-run noise of
one arm against itself. ``identical_arms`` finds arms whose rollouts never differed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from magic_jax.experiments.corrected import load_runs
from magic_jax.experiments.verdicts import OUTCOMES, mean_of, run_seed, sample_var, welch
from magic_jax.jobs.report import Run

# The logged values that show the sampled rollouts themselves differ.
ROLLOUT_KEYS = ("reward", "response_length_mean", "truncated_fraction")
# Logged values that are wall-clock measurements, never compared.
TIMING_PREFIXES = ("t_", "rollout_tokens_per_s")


@dataclasses.dataclass(frozen=True)
class Twin:
    """Two arms with the same training config (``until``: up to that step, None: the whole
    run), compared in ``outcome`` (measured where they are still the same config)."""

    a: str
    b: str
    outcome: str
    until: int | None
    why: str


TWINS: tuple[Twin, ...] = (
    Twin(
        "carry-none",
        "carry-temp-1.0",
        "final accuracy",
        None,
        "the same training config (carry-temp-1.0 also evaluates at 0.6)",
    ),
    Twin(
        "carry-kl-0.1-stage1",
        "carry-kl-0.1",
        "stage-1 accuracy",
        150,
        "the same config through stage 1 (beta 0.1); stage 2 differs by design",
    ),
)


def identical_arms(runs: Mapping[str, Sequence[Run]]) -> list[tuple[str, str, list[int]]]:
    """Pairs of arms whose rollouts are step-for-step identical in some seed (the same
    entropy, reward and mean response length at every step): ``(arm a, arm b, [seeds])``.
    Such an arm tested nothing in those seeds: its setting never changed the policy (a loss
    may still differ, e.g. where a clip that never binds moves the reported loss)."""
    keys = ("entropy", "reward", "response_length_mean")
    sig = {
        arm: {run_seed(r): [tuple(m.get(k) for k in keys) for m in r.metrics] for r in rs}
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


def first_difference(a: Any, b: Any, keys: Sequence[str] | None = None) -> int | None:
    """The first step where two runs' logged ``keys`` differ (None: never, over the steps
    both have). ``keys`` None compares every logged number but the timings."""
    for ma, mb in zip(a.metrics, b.metrics):
        ks = keys or [
            k
            for k in ma
            if k in mb and not k.startswith(TIMING_PREFIXES) and isinstance(ma[k], int | float)
        ]
        if any(ma.get(k) != mb.get(k) for k in ks):
            return int(ma["step"])
    return None


@dataclasses.dataclass(frozen=True)
class TwinResult:
    """Per seed: (seed, first step any logged number differs, first step the rollouts
    differ, outcome of a, outcome of b); and b - a over seeds."""

    twin: Twin
    seeds: list[tuple[int | None, int | None, int | None, float, float]]  # seed None: no run.json
    diff: float
    low: float
    high: float
    p: float
    sd_diff: float


def measure_twin(twin: Twin, seeds: Sequence[int], results: str | Path | None = None) -> TwinResult:
    """Divergence steps and the outcome difference (b - a; Welch's interval and p, and the
    standard deviation of the seed-by-seed differences) of one twin pair."""
    runs = load_runs([twin.a, twin.b], seeds, results)
    by_b = {run_seed(r): r for r in runs[twin.b]}
    fn = OUTCOMES[twin.outcome]
    rows = []
    for ra in runs[twin.a]:
        s = run_seed(ra)
        rb = by_b.get(s)
        if rb is None:
            continue
        rows.append(
            (s, first_difference(ra, rb), first_difference(ra, rb, ROLLOUT_KEYS), fn(ra), fn(rb))
        )
    va, vb = [r[3] for r in rows], [r[4] for r in rows]
    _, low, high, p = welch(va, vb)
    d = [y - x for x, y in zip(va, vb)]
    return TwinResult(twin, rows, mean_of(vb) - mean_of(va), low, high, p, math.sqrt(sample_var(d)))


def _step(s: int | None) -> str:
    return "never" if s is None else str(s)


def twin_table(results: str | Path | None = None, seeds: Sequence[int] = range(5)) -> str:
    """Markdown: per twin pair and seed, where the runs diverge and the outcome of each;
    then the difference over seeds (the noise of one arm against itself)."""
    lines = []
    for t in TWINS:
        res = measure_twin(t, list(seeds), results)
        lines += [
            f"**{t.a} vs {t.b}** ({t.why}), {t.outcome}:",
            "",
            "| seed | first step any logged number differs | first step the rollouts differ "
            f"| {t.a} | {t.b} | difference |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {s} | {_step(d0)} | {_step(d1)} | {x:.3f} | {y:.3f} | {y - x:+.3f} |"
            for s, d0, d1, x, y in res.seeds
        ]
        p = "nan" if math.isnan(res.p) else f"{res.p:.2g}"
        lines += [
            "",
            f"{t.b} - {t.a}: {res.diff:+.3f} (95% CI [{res.low:+.3f}, {res.high:+.3f}], "
            f"Welch p = {p}; seed-by-seed differences: sd {res.sd_diff:.3f}, "
            f"largest {max((abs(r[4] - r[3]) for r in res.seeds), default=math.nan):.3f})",
            "",
        ]
    return "\n".join(lines)
