"""The lock-out world's figures and tables: what its probe measured at every evaluation.

Each function takes ``runs`` (``{arm key: [report.Run]}``, as ``results.load_arm_runs``
returns) and reads the ``probe`` entry of the runs' evaluation rows
(``magic_jax.rollout.probes.lockout_probe``): the exact probability of the full check on the
held-out chain problems, the expected full checks per training step and, under ``sampled``,
figures of the evaluation's own samples. An arm without runs, or a run without these fields
(one from before the probe, or a smoke run), draws nothing and fills its cells with ``-``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure

from magic_jax.experiments.claims_table import format_table
from magic_jax.experiments.verdicts import final_chain_accuracy, mean_of, run_seed
from magic_jax.jobs.report import Run, colors, legend_below

# A token class of ``carry.TOKEN_CLASSES`` per panel (``after_answer`` is empty: ``}`` ends
# decoding in this world).
CLASSES = ("choice", "digit", "format")
# The step ``lockout_table`` reads its stage-1-end figures at where a run records no stage change.
STAGE_2_START = 150

Series = tuple[Sequence[float], Sequence[float]]  # (x, y) of one line


def _at(row: Mapping[str, Any], *path: str) -> Any:
    """The value at ``path`` in nested dicts (None where a key is missing)."""
    v: Any = row
    for part in path:
        v = v.get(part) if isinstance(v, Mapping) else None
    return v


def _number(v: Any) -> float:
    """``v`` as a float (nan unless it is a number)."""
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else math.nan


def _eval_series(run: Run, get: Callable[[Mapping[str, Any]], Any]) -> Series:
    """(steps, values) of ``get(evaluation)`` over a run's evaluations, numbers only."""
    pts = [(e["step"], _number(get(e))) for e in run.evals]
    return [s for s, v in pts if not math.isnan(v)], [v for _, v in pts if not math.isnan(v)]


def probe_series(run: Run, *path: str) -> Series:
    """(steps, values) of ``probe/<path...>`` over a run's evaluations; rows without it are
    skipped."""
    return _eval_series(run, lambda e: _at(e, "probe", *path))


def total_steps(run: Run) -> int:
    """The run's steps: the sum of its config's stage steps, else its last metrics step + 1."""
    stages = run.config.get("stages") or []
    steps = [s.get("steps") for s in stages if isinstance(s, Mapping)]
    counts = [s for s in steps if isinstance(s, int)]
    if steps and len(counts) == len(steps):
        return sum(counts)
    last = [r["step"] for r in run.metrics] or [r["step"] for r in run.evals] or [-1]
    return max(last) + 1


def stage_2_start(run: Run) -> int:
    """The first step of the run's second stage (``STAGE_2_START`` where none is recorded)."""
    starts = run.stage_starts()
    return starts[0][0] if starts else STAGE_2_START


def expected_left(run: Run) -> Series:
    """(steps, expected full checks over the steps left): ``expected_per_step`` x steps left
    at each evaluation; evaluations with no step left or a count of 0 are skipped."""
    n = total_steps(run)
    series = zip(*probe_series(run, "expected_per_step"))
    pts = [(s, v * (n - s)) for s, v in series if v * (n - s) > 0]
    return [p[0] for p in pts], [p[1] for p in pts]


def _arms(runs: Mapping[str, Sequence[Run]]) -> list[tuple[str, Sequence[Run], Any]]:
    """(arm, its runs, its colour) of the arms with runs, coloured as ``ablation_figure``."""
    arms = [k for k in runs if runs[k]]
    return [(a, runs[a], c) for a, c in zip(arms, colors(len(arms)))]


def _seed_lines(
    ax: Any,
    runs: Mapping[str, Sequence[Run]],
    get: Callable[[Run], Series],
    *,
    style: str = "-",
    suffix: str = "",
) -> int:
    """One line per seed of ``get(run)``, coloured by arm (the arm's first drawn seed
    labelled); returns the lines drawn."""
    drawn = 0
    for arm, rs, color in _arms(runs):
        first = True
        for r in rs:
            x, y = get(r)
            if not x:
                continue
            label = f"{arm} (n={len(rs)}){suffix}" if first else None
            ax.plot(x, y, style, color=color, linewidth=1.0, alpha=0.7, label=label)
            drawn, first = drawn + 1, False
    return drawn


def _stage_lines(axes: Sequence[Any], runs: Mapping[str, Sequence[Run]]) -> None:
    """A dotted vertical line on each of ``axes`` at every step where a run's stage changes."""
    starts = {s for rs in runs.values() for r in rs for s, _ in r.stage_starts()}
    for ax in axes:
        for s in sorted(starts):
            ax.axvline(s, color="0.5", linestyle=":", linewidth=0.9)


def _finish(fig: Figure, axes: Sequence[Any], title: str) -> Figure:
    """Grids, the title, and under the panels (off every line) the legend of the first axes
    that has labelled lines; returns ``fig``."""
    for ax in axes:
        ax.grid(alpha=0.3)
    for ax in axes:
        if legend_below(fig, ax, fontsize=7, outside=True):
            break
    fig.suptitle(title, fontsize=11)
    return fig


def probe_figure(runs: Mapping[str, Sequence[Run]]) -> Figure:
    """2 x 2 panels against steps, one line per seed coloured by arm: the probe's mean log10
    probability of the full check; the full checks expected over the steps left (log scale,
    below the line at 1 the strategy is locked out); the share of the evaluation's chain
    samples that check every column; the share of columns checked on chains (solid) and on
    no-carry problems (dashed). Dotted: stage change. Returns the figure."""
    fig = Figure(figsize=(11.5, 7.0), dpi=90, layout="constrained")
    axes = list(fig.subplots(2, 2).flat)
    _seed_lines(axes[0], runs, lambda r: probe_series(r, "log10_p_mean"))
    axes[0].set_title("log10 P(full check), mean over held-out chains", fontsize=10)
    _seed_lines(axes[1], runs, expected_left)
    axes[1].set_yscale("log")
    axes[1].axhline(1.0, color="k", linestyle="--", linewidth=0.9, label="1: locked out below")
    axes[1].set_title("expected full checks over the steps left", fontsize=10)
    _seed_lines(axes[2], runs, lambda r: probe_series(r, "sampled", "full_check"))
    axes[2].set_title("sampled chains checking every column", fontsize=10)
    _seed_lines(axes[3], runs, lambda r: probe_series(r, "sampled", "check_rate_chain"))
    _seed_lines(
        axes[3],
        runs,
        lambda r: probe_series(r, "sampled", "check_rate_plain"),
        style="--",
        suffix=", no carry",
    )
    axes[3].set_title("columns checked: chains (solid), no carry (dashed)", fontsize=10)
    for ax in axes:
        ax.set_xlabel("step")
    _stage_lines(axes, runs)
    return _finish(fig, axes, "Lock-out probe: one line per seed; dotted: stage change")


def _metric_series(run: Run, key: str) -> Series:
    pts = [(m["step"], _number(m.get(key))) for m in run.metrics]
    return [s for s, v in pts if not math.isnan(v)], [v for _, v in pts if not math.isnan(v)]


def decision_figure(
    runs: Mapping[str, Sequence[Run]], locked_out: float = 5e-5, learnable: float = 1e-2
) -> Figure:
    """The decision world's runs, 2 x 2 panels against steps, one line per seed coloured by
    arm: P(full check) (the decision probe's mean over the held-out chains, log scale) with
    the lock-out line (``locked_out``: at or below it, about no full check in a stage of 64
    chain samples a step) and the learnable line (``learnable``); held-out chain accuracy;
    the decision tokens' entropy in the rollouts (``entropy_selected``, where the bonus is on
    them); alpha. Dotted: stage change. Returns the figure."""
    fig = Figure(figsize=(11.5, 7.0), dpi=90, layout="constrained")
    axes = list(fig.subplots(2, 2).flat)
    _seed_lines(axes[0], runs, lambda r: probe_series(r, "p_mean"))
    axes[0].set_yscale("log")
    for y, style, text in ((locked_out, "--", "locked out"), (learnable, "-.", "learnable")):
        axes[0].axhline(y, color="k", linestyle=style, linewidth=0.9, label=f"{text}: {y:g}")
    axes[0].set_title("P(full check), mean over held-out chains", fontsize=10)
    chain = lambda r: _eval_series(r, lambda e: _at(e, "by_source", "heldout-chain"))
    _seed_lines(axes[1], runs, chain)
    axes[1].set_title("held-out chain accuracy", fontsize=10)
    _seed_lines(axes[2], runs, lambda r: _metric_series(r, "entropy_selected"))
    axes[2].set_title("decision-token entropy (nats, rollouts)", fontsize=10)
    _seed_lines(axes[3], runs, lambda r: _metric_series(r, "alpha"))
    axes[3].set_title("alpha", fontsize=10)
    for ax in axes:
        ax.set_xlabel("step")
    _stage_lines(axes, runs)
    return _finish(fig, axes, "Decision world: one line per seed; dotted: stage change")


def _position_mean(rs: Sequence[Run], step: int) -> list[float]:
    """The seed mean of the entropy at each response position at ``step`` (over the seeds
    that reach that position; [] where no seed recorded it)."""
    per = []
    for r in rs:
        row = next((e for e in r.evals if e["step"] == step), {})
        v = _at(row, "probe", "sampled", "entropy_by_position")
        if isinstance(v, list) and v:
            per.append([_number(x) for x in v])
    width = max((len(p) for p in per), default=0)
    cols = [[p[i] for p in per if i < len(p) and not math.isnan(p[i])] for i in range(width)]
    return [mean_of(c) for c in cols]


def _default_steps(runs: Mapping[str, Sequence[Run]]) -> list[int]:
    """The first evaluation, the first of stage 2 and the last, over every run."""
    steps = sorted({e["step"] for rs in runs.values() for r in rs for e in r.evals})
    if not steps:
        return []
    starts = [stage_2_start(r) for rs in runs.values() for r in rs]
    middle = [s for s in steps if s >= min(starts)][:1]
    return sorted({steps[0], *middle, steps[-1]})


def entropy_class_figure(
    runs: Mapping[str, Sequence[Run]], steps: Sequence[int] | None = None
) -> Figure:
    """Top row: the mean token entropy of each class (``CLASSES``) of the evaluation's samples
    against steps, one line per seed coloured by arm (log scale). Bottom row: the entropy at
    each response position, the arm's seed mean, at ``steps`` (default: the first
    evaluation, the first of stage 2 and the last; up to three), on one y scale. Returns the
    figure."""
    steps = list(steps if steps is not None else _default_steps(runs))[:3]
    fig = Figure(figsize=(13.5, 7.0), dpi=90, layout="constrained")
    grid = fig.subplots(2, 3)
    top, bottom = list(grid[0]), list(grid[1])
    for ax, c in zip(top, CLASSES):

        def of_class(r: Run, c: str = c) -> Series:
            return probe_series(r, "sampled", "entropy_by_class", c)

        _seed_lines(ax, runs, of_class)
        ax.set_yscale("log")
        ax.set_title(f"entropy of {c} tokens (nats)", fontsize=10)
        ax.set_xlabel("step")
    _stage_lines(top, runs)
    for ax, step in zip(bottom, steps):
        if ax is not bottom[0]:
            ax.sharey(bottom[0])
        for arm, rs, color in _arms(runs):
            mean = _position_mean(rs, step)
            if mean:
                ax.plot(range(len(mean)), mean, color=color, linewidth=1.4, label=arm)
        ax.set_yscale("log")
        ax.set_title(f"entropy by response position, step {step}", fontsize=10)
        ax.set_xlabel("response position (token)")
    for ax in bottom[len(steps) :]:
        ax.set_visible(False)
    title = "Entropy by token class (one line per seed) and by position (seed mean)"
    return _finish(fig, [*top, *bottom[: len(steps)]], title)


def _path(run: Run, smooth: int = 1) -> Series:
    """(entropy, alpha) of the run's steps that record both, in step order; with ``smooth``
    > 1, each the mean over a window of that many steps (shorter at the ends)."""
    pts = [(_number(m.get("entropy")), _number(m.get("alpha"))) for m in run.metrics]
    pts = [(e, a) for e, a in pts if not (math.isnan(e) or math.isnan(a))]
    n, out = max(smooth, 1), []
    for i in range(len(pts)):
        w = pts[max(i - n // 2, 0) : i - n // 2 + n]
        out.append((mean_of([e for e, _ in w]), mean_of([a for _, a in w])))
    return [o[0] for o in out], [o[1] for o in out]


def phase_figure(runs: Mapping[str, Sequence[Run]], smooth: int = 10) -> Figure:
    """Alpha (the entropy coefficient) against rollout entropy (log scale), one path per
    seed coloured by arm, each the moving mean over ``smooth`` steps (1: every step as
    recorded; rollout entropy is noisy from step to step), with a circle at its first step and
    a square at its last; a dashed vertical line at each adaptive arm's entropy target.
    Returns the figure."""
    fig = Figure(figsize=(7.5, 5.2), dpi=90, layout="constrained")
    ax = fig.subplots()
    _seed_lines(ax, runs, lambda r: _path(r, smooth))
    for _, rs, color in _arms(runs):
        for r in rs:
            x, y = _path(r, smooth)
            if x:
                ax.plot(x[:1], y[:1], "o", color=color, markersize=5)
                ax.plot(x[-1:], y[-1:], "s", color=color, markersize=5)
        ent = rs[0].config.get("entropy") or {}
        if ent.get("mode", "adaptive") == "adaptive" and isinstance(ent.get("target"), int | float):
            ax.axvline(float(ent["target"]), color=color, linestyle="--", linewidth=0.9)
    ax.set_xscale("log")
    ax.set_xlabel("rollout token entropy (nats)")
    ax.set_ylabel("entropy coefficient alpha")
    over = f", each a mean over {smooth} steps" if smooth > 1 else ""
    title = (
        f"Alpha against entropy: one path per seed{over}\n"
        "(circle: first step, square: last; dashed: target)"
    )
    return _finish(fig, [ax], title)


def _last_pass(run: Run, half: str) -> dict[int, float]:
    """``{k: pass@k}`` on the ``half`` ("chain" or "plain") problems at the run's last
    evaluation that records it ({} if none)."""
    for e in reversed(run.evals):
        v = _at(e, "probe", "sampled", f"pass_at_k_{half}")
        if isinstance(v, Mapping) and v:
            out = {int(k): _number(p) for k, p in v.items() if str(k).isdigit()}
            return {k: p for k, p in sorted(out.items()) if not math.isnan(p)}
    return {}


def pass_at_k_figure(runs: Mapping[str, Sequence[Run]]) -> Figure:
    """pass@k against k (log2 scale) at each run's last evaluation, on the chain problems
    (left) and the no-carry ones (right): one thin line per seed, the arm's seed mean thick
    (over the k every seed has). Returns the figure."""
    fig = Figure(figsize=(11.5, 4.6), dpi=90, layout="constrained")
    axes = list(fig.subplots(1, 2))
    for ax, half in zip(axes, ("chain", "plain")):
        for arm, rs, color in _arms(runs):
            per = [_last_pass(r, half) for r in rs]
            per = [p for p in per if p]
            for p in per:
                ax.plot(list(p), list(p.values()), color=color, linewidth=0.7, alpha=0.4)
            ks = sorted(set.intersection(*(set(p) for p in per))) if per else []
            if ks:
                mean = [mean_of([p[k] for p in per]) for k in ks]
                label = f"{arm} (n={len(per)})"
                ax.plot(ks, mean, "o-", color=color, linewidth=2.0, markersize=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("k (samples per problem)")
        ax.set_title(f"pass@k at the last evaluation, {half} problems", fontsize=10)
    return _finish(fig, axes, "pass@k: thin lines each seed, thick the seed mean")


def _eval_at(run: Run, step: int) -> Mapping[str, Any]:
    """The run's evaluation row at ``step`` ({} if none)."""
    return next((e for e in run.evals if e["step"] == step), {})


def _cell(v: float, fmt: str = ".3f") -> str:
    return "-" if math.isnan(v) else format(v, fmt)


def lockout_row(run: Run, steps_left: int = 150) -> tuple[list[str], bool | None]:
    """One run's cells of ``lockout_table`` and whether it is locked out (None: not
    measured): the full checks expected over ``steps_left`` steps at the evaluation at the
    first step of stage 2 (``expected_per_step`` x ``steps_left``; locked out below 1)."""
    start = _eval_at(run, stage_2_start(run))
    expected = steps_left * _number(_at(start, "probe", "expected_per_step"))
    locked = None if math.isnan(expected) else expected < 1.0
    last = run.evals[-1] if run.evals else {}
    chain = _last_pass(run, "chain")
    k = max(chain, default=0)
    cells = [
        _cell(expected, ".3g"),
        {None: "-", True: "yes", False: "no"}[locked],
        _cell(_number(_at(start, "probe", "log10_p_mean")), ".2f"),
        _cell(_number(_at(last, "probe", "log10_p_mean")), ".2f"),
        _cell(_number(last.get("accuracy"))),
        _cell(final_chain_accuracy(run) if run.evals else math.nan),
        f"{chain[k]:.3f} (k={k})" if chain else "-",
        _cell(_number(_at(last, "probe", "sampled", "full_check"))),
    ]
    return cells, locked


# The locked-out call's threshold (1 expected full check over stage 2) and the others its
# sensitivity is shown at.
LOCKOUT_THRESHOLDS = (0.5, 1.0, 2.0)


def lockout_table(runs: Mapping[str, Sequence[Run]], steps_left: int = 150) -> str:
    """A Markdown table, one row per (arm, seed): the full checks expected in stage 2
    (``steps_left`` x the expected per step at the evaluation at stage 2's first step),
    whether that is below 1 (locked out), the probe's log10 P(full check) there and at the
    end, final held-out accuracy and chain accuracy, chain pass@k at the largest k recorded,
    and the final share of chain samples checking every column; then a line per arm with
    its locked-out seeds, and how many fall below each of ``LOCKOUT_THRESHOLDS``. Returns
    the text."""
    header = [
        "arm",
        "seed",
        f"expected full checks, {steps_left} steps",
        "locked out",
        "log10 P, stage 2 start",
        "log10 P, end",
        "final accuracy",
        "final chain accuracy",
        "chain pass@k",
        "final full checks",
    ]
    rows, counts = [], []
    for arm, rs in runs.items():
        locked, expected = [], []
        for r in rs:
            cells, lo = lockout_row(r, steps_left)
            seed = run_seed(r)
            rows.append([arm, "-" if seed is None else str(seed), *cells])
            if lo is not None:
                locked.append(lo)
                start = _eval_at(r, stage_2_start(r))
                expected.append(steps_left * _number(_at(start, "probe", "expected_per_step")))
        line = f"- {arm}: {sum(locked)} of {len(locked)} measured seeds locked out"
        if expected:  # how the call depends on its threshold of 1
            line += (
                " (below "
                + ", ".join(f"{t:g}: {sum(e < t for e in expected)}" for t in LOCKOUT_THRESHOLDS)
                + ")"
            )
        if len(rs) > len(locked):
            line += f" ({len(rs) - len(locked)} without the probe)"
        counts.append(line if rs else f"- {arm}: no runs")
    return format_table(header, rows) + "\n\n" + "\n".join(counts)


def _examples(run: Run) -> tuple[int | None, list[Mapping[str, Any]]]:
    """The step of the run's last evaluation that kept sample texts and its examples, chain
    and no-carry alternating (None, [] without any)."""
    row = next((e for e in reversed(run.evals) if _at(e, "probe", "sampled", "examples")), None)
    if row is None:
        return None, []
    exs = [x for x in _at(row, "probe", "sampled", "examples") if isinstance(x, Mapping)]
    halves = [
        [x for x in exs if x.get("half") == "chain"],
        [x for x in exs if x.get("half") != "chain"],
    ]
    mixed = [x for pair in itertools.zip_longest(*halves) for x in pair if x is not None]
    return row["step"], mixed


def examples_text(runs: Mapping[str, Sequence[Run]], per_arm: int = 4) -> str:
    """Up to ``per_arm`` sample texts per arm from its runs' last evaluations that kept
    examples: a chain and a no-carry one from each of the first seeds, then the rest; one
    line each (the response's lines joined by `` | ``) after its seed, step, half and
    reward. Returns the text (an arm without runs or texts says so)."""
    out = []
    for arm, rs in runs.items():
        out.append(f"== {arm}")
        picks = [(r, *_examples(r)) for r in rs]
        order = [(r, step, x) for r, step, xs in picks for x in xs[:2]]
        order += [(r, step, x) for r, step, xs in picks for x in xs[2:]]
        for r, step, ex in order[:per_arm]:
            seed = run_seed(r)
            reward = _cell(_number(ex.get("reward")), ".2f")
            text = " | ".join(str(ex.get("text", "")).splitlines())
            where = f"seed {'-' if seed is None else seed}, step {step}"
            out.append(f"{where}, {ex.get('half', '?')}, reward {reward}: {text}")
        if not order:
            out.append("(no runs)" if not rs else "(no sample texts recorded)")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
