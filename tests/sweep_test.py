"""The target x delta sweep of the adaptive entropy controller: its grid, step budget,
resumability, table and figure (runs fabricated; nothing trains)."""

import json
import math
from pathlib import Path

import pytest
import yaml

from magic_jax.experiments import ablations, sweep
from magic_jax.jobs.report import load_run
from magic_jax.run.config import load_config


def test_grid_keys_and_overrides_load_as_the_point(tmp_path):
    arms = sweep.grid([0.06, 0.09], [0.003, 0.03])
    assert [a.key for a in arms] == [
        "sweep-t0.06-d0.003",
        "sweep-t0.06-d0.03",
        "sweep-t0.09-d0.003",
        "sweep-t0.09-d0.03",
    ]
    arm = arms[1]
    cfg = load_config(
        ablations.train_config("lockout"),
        [*ablations.overrides_for(arm, 3, budget=5, world="lockout"), f"output_dir={tmp_path}"],
    )
    assert cfg.entropy.mode == "adaptive"
    assert (cfg.entropy.target, cfg.entropy.delta) == (0.06, 0.03)
    assert cfg.eval.probe is None and cfg.eval.num_samples == 1 and cfg.eval.every == 5
    assert cfg.total_steps == 10 and cfg.seed == 3 and cfg.export_hf is False
    carry = load_config(
        ablations.train_config("carry"),
        [*ablations.overrides_for(arm, 0, budget=5, world="carry"), f"output_dir={tmp_path}"],
    )
    assert (carry.entropy.target, carry.entropy.delta) == (0.06, 0.03)


@pytest.mark.parametrize(
    "targets,deltas,match",
    [
        ([], [0.01], "needs targets and deltas"),
        ([0.1], [-0.01], r"every delta must be >= 0, got \[-0.01\]"),
        ([0.1, 0.10], [0.01], r"repeated points \['sweep-t0.1-d0.01'\]"),
    ],
)
def test_a_bad_grid_is_refused(targets, deltas, match):
    with pytest.raises(ValueError, match=match):
        sweep.grid(targets, deltas)


def _fake_run(d: Path, target: float, delta: float, acc: float, steps: int = 6) -> None:
    """A finished run's records: entropy falling from 0.12, alpha on in the second half."""
    d.mkdir(parents=True, exist_ok=True)
    rows = [
        {"step": s, "stage": 0 if s < steps // 2 else 1, "entropy": 0.12 - 0.01 * s,
         "alpha": 0.0 if s < steps // 2 else delta * s}
        for s in range(steps)
    ]  # fmt: skip
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evs = [
        {"step": s, "accuracy": acc * s / steps, "num_samples": 1,
         "by_source": {"heldout-chain": acc * s / steps / 2, "heldout-plain": 0.9}}
        for s in (0, steps // 2, steps)
    ]  # fmt: skip
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evs))
    cfg = {"entropy": {"mode": "adaptive", "target": target, "delta": delta}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "run.json").write_text(json.dumps({"rerun": "ablations"}))


@pytest.fixture
def runner(monkeypatch):
    """Replaces the training with a fabricated run; returns the calls made."""
    calls = []

    def run_one(ablation, arm, seed, results, *, budget=None, world=None, log=print):
        calls.append((arm.key, seed, budget, world, results))
        ent = dict(o.split("=", 1) for o in arm.overrides)
        dest = ablations.summary_dir(results, arm, seed)
        _fake_run(dest, float(ent["entropy.target"]), float(ent["entropy.delta"]), 0.5)
        return dest

    monkeypatch.setattr(ablations, "run_one", run_one)
    monkeypatch.delenv(ablations.STEPS_ENV, raising=False)
    monkeypatch.delenv(ablations.RESULTS_ENV, raising=False)
    return calls


def test_done_points_are_not_rerun(runner, tmp_path):
    where = sweep.sweep_dir(tmp_path, "lockout", 7)
    assert where == tmp_path.resolve() / "sweeps" / "lockout" / "steps7"
    done = sweep.grid([0.06], [0.03])[0]
    _fake_run(ablations.summary_dir(where, done, 0), 0.06, 0.03, 0.8)
    runs = sweep.run_sweep([0.06, 0.09], [0.003, 0.03], steps_per_stage=7, results=tmp_path)
    assert [c[0] for c in runner] == [
        "sweep-t0.06-d0.003",
        "sweep-t0.09-d0.003",
        "sweep-t0.09-d0.03",
    ]
    assert {c[1:4] for c in runner} == {(0, 7, "lockout")} and runner[0][4] == where
    assert list(runs) == [a.key for a in sweep.grid([0.06, 0.09], [0.003, 0.03])]
    assert runs["sweep-t0.06-d0.03"][0].name == "target 0.06, delta 0.03"
    last = ablations.summary_dir(where, sweep.grid([0.09], [0.03])[0], 0)
    assert json.loads((last / "run.json").read_text())["rerun"] == (
        "python -m magic_jax.experiments.sweep --targets 0.09 --deltas 0.03 --steps 7 "
        "--seed 0 --world lockout"
    )
    runner.clear()
    again = sweep.run_sweep([0.06, 0.09], [0.003, 0.03], steps_per_stage=7, results=tmp_path)
    assert runner == [] and list(again) == list(runs)
    sweep.run_sweep([0.06], [0.03], steps_per_stage=7, seed=[0, 1], results=tmp_path)
    assert [c[:2] for c in runner] == [("sweep-t0.06-d0.03", 1)]


def test_the_step_budget_replaces_steps_per_stage(runner, tmp_path, monkeypatch):
    monkeypatch.setenv(ablations.STEPS_ENV, "1")
    sweep.run_sweep([0.09], [0.01], world="carry", steps_per_stage=30, results=tmp_path)
    assert runner[0][2:4] == (1, "carry")
    assert runner[0][4] == tmp_path.resolve() / "sweeps" / "carry" / "steps1"
    monkeypatch.delenv(ablations.STEPS_ENV)
    with pytest.raises(ValueError, match="steps_per_stage must be a positive int, got 0"):
        sweep.run_sweep([0.09], [0.01], steps_per_stage=0, results=tmp_path)
    with pytest.raises(KeyError, match="no world 'moon'"):
        sweep.run_sweep([0.09], [0.01], world="moon", results=tmp_path)


def _runs(tmp_path, chain=True):
    out = {}
    for i, (t, d) in enumerate([(0.09, 0.003), (0.06, 0.03), (0.06, 0.003)]):
        p = tmp_path / f"p{i}"
        _fake_run(p, t, d, 0.3 + 0.1 * i)
        run = load_run(p, name=f"target {t:g}, delta {d:g}")
        if not chain:
            for e in run.evals:
                e.pop("by_source")
        out[sweep.point_key(t, d)] = [run]
    return out


def test_table_rows_by_target_and_delta(tmp_path):
    table = sweep.sweep_table(_runs(tmp_path))
    lines = table.splitlines()
    assert lines[0] == (
        "| target | delta | runs | steps | final accuracy | final chain accuracy | "
        "late entropy | mean alpha | alpha > 0 |"
    )
    # (0.06, 0.003): final accuracy 0.5, chains 0.25; late entropy: steps 4, 5 -> 0.075;
    # alpha 0.003 x (3 + 4 + 5) / 6 = 0.006; alpha on at 3 of 6 steps
    assert lines[2] == "| 0.06 | 0.003 | 1 | 6 | 0.500 | 0.250 | 0.0750 | 0.0060 | 50% |"
    assert [ln.split(" | ")[:2] for ln in lines[2:]] == [
        ["| 0.06", "0.003"],
        ["| 0.06", "0.03"],
        ["| 0.09", "0.003"],
    ]
    plain = sweep.sweep_table(_runs(tmp_path / "plain", chain=False))
    assert "chain" not in plain and "| 0.06 | 0.003 | 1 | 6 | 0.500 | 0.0750 |" in plain


def test_figure_curves_targets_and_heat_map(tmp_path):
    from matplotlib.figure import Figure

    runs = _runs(tmp_path)
    fig = sweep.sweep_figure(runs)
    assert isinstance(fig, Figure)
    ent, alpha, heat = fig.axes[:3]
    assert [ln.get_linestyle() for ln in alpha.lines] == ["-", "-", "-", ":"]  # 3 points, a stage
    assert list(alpha.lines[3].get_xdata()) == [3, 3]
    dashed = [ln for ln in ent.lines if ln.get_linestyle() == "--"]
    assert sorted(ln.get_ydata()[0] for ln in dashed) == [0.06, 0.09]
    grid = heat.images[0].get_array()
    # rows: targets 0.06, 0.09; columns: deltas 0.003, 0.03; (0.09, 0.03) has no run
    assert grid[0].tolist() == pytest.approx([0.5, 0.4])
    assert grid[1, 0] == pytest.approx(0.3) and math.isnan(float(grid.data[1, 1]))
    (empty,) = [t for t in heat.texts if t.get_text() == "no run"]
    assert empty.get_color() == "0.4"  # readable on the empty (white) cell
    fig.savefig(tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    # one legend, the points', under the panels: it covers no panel (nor the colour bar)
    (legend,) = fig.legends
    assert len(legend.get_texts()) == 3 and all(ax.get_legend() is None for ax in fig.axes)
    box = legend.get_window_extent()
    assert not any(box.overlaps(ax.get_tightbbox()) for ax in fig.axes)
