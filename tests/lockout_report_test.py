"""The lock-out world's figures and tables (magic_jax.experiments.lockout_report) and the
ablation figures' per-seed lines, on fabricated runs."""

import json
import math
from pathlib import Path

import pytest

from magic_jax.experiments import ablation_report as ar
from magic_jax.experiments import lockout_report as lr
from magic_jax.jobs.report import Run, colors

STEPS = 300  # two stages of 150, evaluated every 25 steps
EVAL_STEPS = range(0, STEPS + 1, 25)


def _probe(step: int, per_step: float) -> dict:
    """A lock-out probe row whose expected full checks per step is ``per_step`` throughout."""
    final = step == STEPS
    ks = [1, 2, 4, 8, 16, 32, 64] if final else [1, 2, 4]
    return {
        "problems": 120,
        "p_mean": per_step / 60,
        "log10_p_mean": -1.0 - step / 100,
        "expected_per_step": per_step,
        "sampled": {
            "full_check": 0.1,
            "check_rate_chain": 0.5,
            "check_rate_plain": 0.4 - step / 1000,
            "entropy_by_class": {"choice": 0.7 / (1 + step), "digit": 0.01, "format": 0.01,
                                 "after_answer": math.nan},
            "entropy_by_position": [0.5, 0.1, 0.3, 0.01][: 3 + final],
            "pass_at_k_chain": {str(k): min(1.0, 0.05 * k) for k in ks},
            "pass_at_k_plain": {str(k): 0.9 for k in ks},
            "examples": [
                {"half": "plain", "text": "4\n1+8=9\n</think>\n\\boxed{7994}", "reward": 1.0},
                {"half": "chain", "text": f"8+7=15\n</think>\n\\boxed{{{step}}}", "reward": 0.0},
            ],
        },
    }  # fmt: skip


def _run(
    tmp_path: Path, arm: str, seed: int, per_step: float = 0.02, probe: bool = True, target=None
) -> Run:
    """A finished 300-step run of ``arm``: alpha and entropy every step, an evaluation every
    25 steps with (``probe``) the lock-out probe's figures."""
    d = tmp_path / arm / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"arm": arm, "seed": seed}))
    metrics = [
        {"step": s, "stage": int(s >= 150), "entropy": 0.1 / (1 + s), "alpha": 0.001 * s + seed,
         "reward": 0.5 + 0.001 * s + 0.01 * seed}
        for s in range(STEPS)
    ]  # fmt: skip
    evals = [
        {"step": s, "accuracy": 0.5, "by_source": {"heldout-chain": 0.1, "heldout-plain": 0.9},
         **({"probe": _probe(s, per_step)} if probe else {})}
        for s in EVAL_STEPS
    ]  # fmt: skip
    entropy = {"mode": "adaptive", "target": target} if target else {"mode": "fixed"}
    config = {"stages": [{"steps": 150}, {"steps": 150}], "entropy": entropy}
    return Run(f"{arm} (seed {seed})", d, metrics, evals, config)


@pytest.fixture
def runs(tmp_path):
    """Two arms of two seeds (the adaptive one with a target), and an arm without runs."""
    return {
        "adaptive": [_run(tmp_path, "adaptive", s, target=0.09) for s in (0, 1)],
        "none": [_run(tmp_path, "none", s, per_step=0.005) for s in (0, 1)],
        "pending": [],
    }


def test_a_seed_is_locked_out_below_one_expected_full_check_in_stage_2(tmp_path):
    cells, locked = lr.lockout_row(_run(tmp_path, "a", 0, per_step=0.005))
    assert locked is True and cells[:2] == ["0.75", "yes"]
    cells, locked = lr.lockout_row(_run(tmp_path, "b", 0, per_step=0.02))
    assert locked is False and cells[:2] == ["3", "no"]
    # log10 P at step 150 and at the end, accuracies, chain pass@64, full checks
    assert cells[2:] == ["-2.50", "-4.00", "0.500", "0.100", "1.000 (k=64)", "0.100"]


def test_the_table_counts_locked_out_seeds_per_arm(runs, tmp_path):
    runs["old"] = [_run(tmp_path, "old", 0, probe=False)]
    text = lr.lockout_table(runs)
    assert "| none | 1 | 0.75 | yes |" in text and "| adaptive | 0 | 3 | no |" in text
    assert "| old | 0 | - | - | - | - | 0.500 | 0.100 | - | - |" in text
    assert "- adaptive: 0 of 2 measured seeds locked out (below 0.5: 0, 1: 0, 2: 0)" in text
    assert "- none: 2 of 2 measured seeds locked out (below 0.5: " in text
    assert "- pending: no runs" in text
    assert "- old: 0 of 0 measured seeds locked out (1 without the probe)" in text


def test_every_function_tolerates_runs_without_the_probe_and_arms_without_runs(tmp_path):
    bare = Run("bare", tmp_path / "nowhere", [], [], {})
    old = _run(tmp_path, "old", 0, probe=False)
    runs = {"old": [old, bare], "empty": []}
    for fn in (lr.probe_figure, lr.entropy_class_figure, lr.phase_figure, lr.pass_at_k_figure):
        fig = fn(runs)
        # nothing probed: only the stage and reference lines (and the bare runs' alpha paths)
        drawn = [ln for ax in fig.axes for ln in ax.lines if len(ln.get_xdata()) > 2]
        assert len(drawn) == (1 if fn is lr.phase_figure else 0)
    assert "| bare | - | - | - |" in lr.lockout_table({"bare": [bare]})
    text = lr.examples_text(runs)
    assert "== old\n(no sample texts recorded)" in text and "== empty\n(no runs)" in text
    assert lr.expected_left(old) == ([], []) and lr.total_steps(bare) == 0


def test_probe_figure_draws_one_line_per_seed_and_series(runs):
    fig = lr.probe_figure(runs)
    assert len(fig.axes) == 4
    # 4 seeds; + the stage change (all panels) and the line at 1 (expected full checks);
    # chains and no-carry problems: 8
    assert [len(ax.lines) for ax in fig.axes] == [5, 6, 5, 9]
    left = fig.axes[1].lines[0]  # adaptive seed 0: 0.02 x steps left, step 300 dropped
    assert list(left.get_xdata()) == list(range(0, STEPS, 25))
    assert left.get_ydata()[6] == pytest.approx(0.02 * 150)
    assert fig.axes[1].get_yscale() == "log"


def test_entropy_phase_and_pass_at_k_figures(runs):
    fig = lr.entropy_class_figure(runs)
    assert len(fig.axes) == 6
    assert [len(ax.lines) for ax in fig.axes] == [5, 5, 5, 2, 2, 2]
    assert [ax.get_title() for ax in fig.axes[3:]] == [
        f"entropy by response position, step {s}" for s in (0, 150, 300)
    ]
    assert list(fig.axes[5].lines[0].get_ydata()) == pytest.approx([0.5, 0.1, 0.3, 0.01])

    fig = lr.phase_figure(runs)
    (ax,) = fig.axes
    # 4 paths, a start and an end marker each, the adaptive arm's target
    assert len(ax.lines) == 4 + 8 + 1
    target = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
    assert [list(ln.get_xdata()) for ln in target] == [[0.09, 0.09]]
    # each path a moving mean over 10 steps: at step 0, steps 0-4
    assert ax.lines[0].get_xdata()[0] == pytest.approx(sum(0.1 / (1 + s) for s in range(5)) / 5)
    assert len(ax.lines[0].get_xdata()) == STEPS

    fig = lr.pass_at_k_figure(runs)
    assert len(fig.axes) == 2 and all(len(ax.lines) == 4 + 2 for ax in fig.axes)
    mean = fig.axes[0].lines[2]  # the first arm's 2 seeds, then its mean
    assert list(mean.get_xdata()) == [1, 2, 4, 8, 16, 32, 64]
    assert fig.axes[0].get_xscale() == "log"


def test_examples_alternate_halves_over_the_first_seeds(runs):
    text = lr.examples_text(runs, per_arm=3)
    block = text.split("== none\n")[1].split("\n\n")[0].splitlines()
    assert block == [
        "seed 0, step 300, chain, reward 0.00: 8+7=15 | </think> | \\boxed{300}",
        "seed 0, step 300, plain, reward 1.00: 4 | 1+8=9 | </think> | \\boxed{7994}",
        "seed 1, step 300, chain, reward 0.00: 8+7=15 | </think> | \\boxed{300}",
    ]


def test_plot_arms_draws_each_seed_thin_under_the_thick_mean(runs, tmp_path):
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    one = {"adaptive": runs["adaptive"], "single": runs["none"][:1], "pending": []}
    one["adaptive"].append(_run(tmp_path, "adaptive", 2))
    ar.plot_arms(ax, one, {}, "reward")
    by_color = {}
    for ln in ax.lines:
        by_color.setdefault(ln.get_color(), []).append(ln)
    first, second = colors(2)
    assert len(by_color[first]) == 1 + 3 and len(by_color[second]) == 1
    mean, *seeds = by_color[first]
    assert mean.get_linewidth() > seeds[0].get_linewidth() and mean.get_zorder() > 2
    assert all(s.get_alpha() < 1 for s in seeds)
    # reward 0.5 + 0.001 step + 0.01 seed: the seed mean at step 10 over seeds 0-2
    assert mean.get_ydata()[10] == pytest.approx(0.51 + 0.01)
    assert mean.get_label() == "adaptive (n=3)"


@pytest.mark.parametrize(
    "draw",
    [lr.probe_figure, lr.entropy_class_figure, lr.phase_figure, lr.pass_at_k_figure, None],
    ids=["probe", "entropy_class", "phase", "pass_at_k", "ablation"],
)
def test_each_figures_legend_lies_off_every_panel(runs, draw):
    """One legend for the figure, under the panels: it covers no panel's lines, ticks or labels
    (in a panel it sat on the curves it names)."""
    fig = ar.arms_figure(runs, {}, "t") if draw is None else draw(runs)
    fig.draw_without_rendering()
    assert [ax.get_legend() for ax in fig.axes] == [None] * len(fig.axes)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["adaptive (n=2)", "none (n=2)"]
    box = legend.get_window_extent()
    for ax in fig.axes:
        assert not box.overlaps(ax.get_tightbbox()), ax.get_title()


def test_decision_figure_draws_p_with_the_lock_out_and_learnable_lines(runs, tmp_path):
    for r in runs["adaptive"]:
        for m in r.metrics:
            m["entropy_selected"] = 0.6
    fig = lr.decision_figure(runs, locked_out=1e-4, learnable=0.02)
    assert len(fig.axes) == 4
    # P: 4 seeds + 2 threshold lines + the stage change; chain accuracy: 4 + 1; the decision
    # entropy only where recorded: 2 + 1; alpha: 4 + 1
    assert [len(ax.lines) for ax in fig.axes] == [7, 5, 3, 5]
    p = fig.axes[0]
    assert p.get_yscale() == "log"
    assert [ln.get_label() for ln in p.lines[4:6]] == ["locked out: 0.0001", "learnable: 0.02"]
    assert [ln.get_ydata()[0] for ln in p.lines[4:6]] == [1e-4, 0.02]
    none0 = p.lines[2]  # none seed 0: per_step 0.005 / 60 at every evaluation
    assert list(none0.get_xdata()) == list(EVAL_STEPS)
    assert none0.get_ydata()[3] == pytest.approx(0.005 / 60)
    assert list(fig.axes[1].lines[0].get_ydata()) == [0.1] * len(EVAL_STEPS)
    bare = Run("bare", tmp_path / "nowhere", [], [], {})
    drawn = lr.decision_figure({"bare": [bare]})
    assert [len(ax.lines) for ax in drawn.axes] == [2, 0, 0, 0]
