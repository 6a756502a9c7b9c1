"""The ablation runner, its verdicts and figures, the committed summaries, and the notebooks."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from magic_jax.experiments import ablation_report as ar
from magic_jax.experiments import ablations, prereg, runner
from magic_jax.jobs.report import load_run
from magic_jax.run.config import MOVED_OPTIONS, load_config

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
COMMITTED = ROOT / "notebooks" / "results"


def _all_arms(pending=False):
    """(ablation, arm) of every arm once; arms that cannot run yet only with ``pending``."""
    seen = {}
    for ab in ablations.ABLATIONS.values():
        for arm in ab.arms:
            if pending or not arm.pending:
                seen.setdefault(arm.key, (ab.key, arm))
    return list(seen.values())


def test_a_pending_arm_is_skipped_and_refused_by_name():
    pending = [(ab, a) for ab, a in _all_arms(pending=True) if a.pending]
    for ab, arm in pending:
        assert all(a.key != arm.key for _, a, _ in ablations.plan_runs([ab]))
        with pytest.raises(ValueError, match=f"{ab}/{arm.key} cannot run yet: "):
            ablations.plan_runs([ab], arms=[arm.key])


@pytest.mark.parametrize("ablation,arm", _all_arms(), ids=lambda x: getattr(x, "key", x))
def test_every_arm_is_a_valid_run_of_its_world_of_equal_length(ablation, arm, tmp_path):
    world = ablations.WORLDS[ablations.ABLATIONS[ablation].world]
    cfg = load_config(
        ablations.train_config(world.key),
        [*ablations.overrides_for(arm, 1, world=world.key), f"output_dir={tmp_path}"],
    )
    assert cfg.total_steps == world.total_steps
    # the carry world's runs export their final model: its statistics are measured
    assert cfg.seed == 1 and cfg.export_hf is world.statistics
    small = load_config(
        ablations.train_config(world.key),
        [*ablations.overrides_for(arm, 0, budget=1, world=world.key), f"output_dir={tmp_path}"],
    )
    assert small.total_steps == 2 and small.export_hf is world.statistics


def test_each_world_runs_the_config_a_checkout_names():
    for w in ablations.WORLDS.values():
        assert (ROOT / w.config).read_text() == ablations.train_config(w.key).read_text()


def test_arms_change_what_they_claim(tmp_path):
    def cfg(key):
        ab, arm = next((ab, a) for ab, a in _all_arms() if a.key == key)
        world = ablations.ABLATIONS[ab].world
        return load_config(
            ablations.train_config(world),
            [*ablations.overrides_for(arm, 0, world=world), f"output_dir={tmp_path}"],
        )

    assert cfg("carry-none").entropy.mode == "fixed" and cfg("carry-none").entropy.init_coef == 0
    assert cfg("carry-fixed-0.005").entropy.init_coef == 0.005
    adaptive = cfg("carry-adaptive").entropy
    assert adaptive.mode == "adaptive" and adaptive.max_coef is None
    assert cfg("carry-adaptive-0.07").entropy.target == 0.07 != adaptive.target
    warm, cold = cfg("carry-temp-1.0"), cfg("carry-temp-0.6")
    assert warm.sampling.temperature == 1.0 and warm.update.num_reuse == 1
    assert cold.sampling.temperature == cold.loss.temperature == 0.6
    assert warm.eval.extra_temperatures == cold.eval.extra_temperatures == (0.6,)
    assert warm.eval.temperature == cold.eval.temperature == 1.0
    mb = cfg("carry-nsgd4-minibatch")
    assert [s.mini_batch_groups for s in mb.stages] == [4, 4] and mb.entropy.init_coef == 0
    assert cfg("carry-nsgd4-reuse").update.num_reuse == 4
    assert cfg("carry-nsgd4-reuse").entropy.init_coef == 0
    assert cfg("carry-fixed-2").entropy.mode == "fixed" == cfg("carry-fixed-0.005").entropy.mode
    assert cfg("carry-fixed-2").entropy.init_coef == 2.0
    both, first = cfg("carry-kl-0.1"), cfg("carry-kl-0.1-stage1")
    choice, quiet = cfg("carry-choice-adaptive").entropy, cfg("carry-choice-none").entropy
    assert choice.tokens == quiet.tokens == "carry:choice" and choice.target == 0.44
    assert (choice.mode, quiet.mode, quiet.init_coef) == ("adaptive", "fixed", 0.0)
    a9, a9_adaptive, a9_on = (
        cfg("carry-a9-nsgd4"),
        cfg("carry-a9-nsgd4-adaptive"),
        cfg("carry-a9-nsgd1"),
    )
    assert {c.optimizer.learning_rate for c in (a9, a9_adaptive, a9_on)} == {1e-4}
    assert (
        [s.mini_batch_groups for s in a9.stages]
        == [4, 4]
        == [s.mini_batch_groups for s in a9_adaptive.stages]
    )
    assert [s.mini_batch_groups for s in a9_on.stages] == [16, 16]
    assert (a9.entropy.init_coef, a9_adaptive.entropy.mode) == (0.0, "adaptive")
    assert [both.kl_beta(i) for i in (0, 1)] == [0.1, 0.1] and both.uses_kl
    assert [first.kl_beta(i) for i in (0, 1)] == [0.1, 0.0]
    clip, sym = cfg("carry-clip-0.07"), cfg("carry-clip-0.05")
    assert (clip.loss.eps_low, clip.loss.eps_high, sym.loss.eps_high) == (0.05, 0.07, 0.05)
    assert [s.mini_batch_groups for s in clip.stages] == [4, 4] and clip.entropy.init_coef == 0
    single, two = cfg("carry-single-T64"), cfg("carry-none")
    assert [(s.max_response_length, s.steps) for s in single.stages] == [(64, 300)]
    assert [(s.max_response_length, s.steps) for s in two.stages] == [(32, 150), (64, 150)]
    assert single.entropy.init_coef == 0 and single.entropy.mode == "fixed"


def test_plan_runs_is_seed_major_and_runs_the_shared_arm_once():
    runs = ablations.plan_runs()
    keys = [(arm.key, seed) for _, arm, seed in runs]
    assert len(keys) == len(set(keys))
    shared = [n for n, ab in ablations.ABLATIONS.items() if "carry-none" in ab.arm_keys]
    assert len(shared) >= 4 and sum(1 for k in keys if k[0] == "carry-none") == 5
    seeds = [seed for _, _, seed in runs]
    assert seeds == sorted(seeds)
    one = ablations.plan_runs(["kl"], budget=1)
    assert [(a.key, s) for _, a, s in one] == [
        ("carry-none", 0),
        ("carry-kl-0.1-stage1", 0),
        ("carry-kl-0.1", 0),
    ]
    with pytest.raises(KeyError, match="no ablation 'nope'"):
        ablations.plan_runs(["nope"])
    with pytest.raises(KeyError, match="no arm 'nope'"):
        ablations.plan_runs(["kl"], arms=["nope"])


def test_step_budget_and_results_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(ablations.STEPS_ENV, "two")
    with pytest.raises(ValueError, match="MAGIC_JAX_NOTEBOOK_STEPS='two'"):
        ablations.step_budget()
    monkeypatch.setenv(ablations.STEPS_ENV, "2")
    monkeypatch.delenv(ablations.RESULTS_ENV, raising=False)
    monkeypatch.chdir(ROOT / "notebooks")
    assert ablations.results_dir() == COMMITTED.resolve() / "budget-2"
    monkeypatch.setenv(ablations.RESULTS_ENV, str(tmp_path))
    assert ablations.results_dir() == tmp_path.resolve()


@pytest.mark.parametrize(
    "sign,ref,arm,want",
    [
        (-1, [1.0, 1.1, 0.9], [0.5, 0.6, 0.4], "reproduced"),
        (+1, [1.0, 1.1, 0.9], [0.5, 0.6, 0.4], "not reproduced"),
        (-1, [1.0, 0.2, 0.6], [0.5, 0.9, 0.1], "inconclusive"),
        (-1, [1.0], [0.5], "inconclusive"),
        (-1, [1.0, 1.0, 1.0], [0.5, 0.5, 0.5], "inconclusive"),  # no spread: no p-value
        # p = 0.07: more than 2 standard errors apart, yet not p < 0.05
        (-1, [1.0, 1.2, 0.8], [0.6, 0.8, 0.4], "inconclusive"),
        (0, [0.900, 0.902, 0.904], [0.901, 0.903, 0.902], "reproduced"),
        (0, [0.90, 0.91, 0.92], [0.90, 0.93, 0.96], "inconclusive"),  # interval too wide
        (0, [0.90, 0.91, 0.92], [0.70, 0.71, 0.72], "not reproduced"),
    ],
)
def test_judge(sign, ref, arm, want):
    e = ar.judge(ar.Check("final accuracy", "a", "b", sign, tolerance=0.02), ref, arm)
    assert e.verdict == want
    assert e.diff == pytest.approx(sum(arm) / len(arm) - sum(ref) / len(ref))


def test_welch_interval_and_p_agree_with_scipy():
    from scipy import stats

    ref, arm = [0.61, 0.55, 0.70, 0.64, 0.58], [0.71, 0.80, 0.66, 0.75]
    se, low, high, p = ar.welch(ref, arm)
    want = stats.ttest_ind(arm, ref, equal_var=False)
    assert p == pytest.approx(want.pvalue, rel=1e-9)
    ci = want.confidence_interval(0.95)
    assert (low, high) == (pytest.approx(ci.low, rel=1e-9), pytest.approx(ci.high, rel=1e-9))
    diff = sum(arm) / len(arm) - sum(ref) / len(ref)
    assert low < diff < high and se > 0


def test_identical_arms_are_found_by_their_rollouts(tmp_path):
    ab = ablations.ABLATIONS["temperature"]
    base, cold = ab.arms
    for seed in (0, 1):
        _fake_run(ablations.summary_dir(tmp_path, base, seed), base, seed, 0.4, 0.9)
        # seed 0: the same rollouts (the loss may differ); seed 1: different entropy
        ent = 0.4 if seed == 0 else 0.3
        _fake_run(ablations.summary_dir(tmp_path, cold, seed), cold, seed, ent, 0.9)
    runs = ablations.load_arm_runs("temperature", tmp_path)
    assert ar.identical_arms(runs) == [("carry-temp-1.0", "carry-temp-0.6", [0])]
    labels = {a.key: a.label for a in ab.arms}
    assert ar.identical_text(runs, labels) == [
        "temperature 1.0 and temperature 0.6 are identical step for step in seed 0"
    ]
    assert "identical step for step in seed 0" in ar.describe("temperature", runs)


def _fake_run(d: Path, arm, seed: int, entropy: float, acc: float) -> None:
    d.mkdir(parents=True)
    rows = [
        {"step": s, "stage": 0 if s < 3 else 1, "entropy": entropy / (1 + s), "alpha": 0.0,
         "reward": acc, "truncated_fraction": 0.1, "response_length_mean": 30.0,
         "prompts": 16, "grad_norm": 1.0}
        for s in range(6)
    ]  # fmt: skip
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evs = [
        {"step": s, "accuracy": acc * s / 6 + 0.3, "num_samples": 2,
         "by_temperature": {"0.6": {"accuracy": acc * s / 6 + 0.2}}}
        for s in (0, 3, 6)
    ]  # fmt: skip
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evs))
    cfg = {"entropy": {"mode": "adaptive", "target": 0.1}, "stages": [{"group_size": 8}]}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "run.json").write_text(json.dumps({"arm": arm.key, "seed": seed}))


def test_figures_table_and_verdicts_from_summaries(tmp_path):
    ab = ablations.ABLATIONS["temperature"]
    base, cold = ab.arms
    for seed in ab.seeds:
        d = 0.01 * seed
        _fake_run(ablations.summary_dir(tmp_path, base, seed), base, seed, 0.4 + d, 0.6 + d)
        _fake_run(ablations.summary_dir(tmp_path, cold, seed), cold, seed, 0.1 + d, 0.2 + d)
    runs = ablations.load_arm_runs("temperature", tmp_path)
    assert [len(v) for v in runs.values()] == [5, 5]
    effs = ar.effects("temperature", runs)
    assert [e.verdict for e in effs] == ["reproduced"] * 3
    assert effs[2].check.outcome == "final accuracy (evaluated at 0.6)"
    assert effs[2].diff == pytest.approx(0.2 - 0.6)
    text = ar.describe("temperature", runs)
    assert "verdict: reproduced" in text and "--arm carry-temp-0.6" in text
    out = ar.write_figures(tmp_path, tmp_path / "figures", ["temperature"])
    assert (out / "temperature.png").stat().st_size > 10_000
    fig = ar.ablation_figure("temperature", runs)
    assert fig.axes[1].get_title() == "held-out avg@n, sampled at 0.6"
    # the first arm: 0.2 + (0.6 + 0.01 * seed) * step / 6 at steps 0, 3, 6, seeds 0-4
    assert list(fig.axes[1].lines[0].get_ydata()) == pytest.approx([0.2, 0.51, 0.82])
    table = (out / "summary.md").read_text()
    assert "| 01-temperature | retrospective | 5/5 |" in table
    assert "| reproduced | mean entropy: reproduced; final accuracy: reproduced;" in table
    assert "| 05-clip-higher |" not in table  # no run of its arms yet: no row
    effects = (out / "effects.md").read_text()
    head = "all: 3 predictions; reproduced at the declared test's raw p < 0.05: 3;"
    assert effects.startswith(head)
    assert "| 01-temperature | final accuracy (evaluated at 0.6) |" in effects


def test_records_are_stored_compressed_and_read_back_the_same(tmp_path):
    arm = ablations.ABLATIONS["temperature"].arms[0]
    where = ablations.summary_dir(tmp_path, arm, 0)
    _fake_run(where, arm, 0, 0.4, 0.6)
    plain = load_run(where)
    seconds = ablations.recorded_seconds(where)
    assert ablations.main(["pack", "--results", str(tmp_path)]) == 0
    assert sorted(p.name for p in where.glob("*.jsonl*")) == ["eval.jsonl.gz", "metrics.jsonl.gz"]
    packed = load_run(where)
    assert (packed.metrics, packed.evals) == (plain.metrics, plain.evals) and plain.metrics
    assert ablations.recorded_seconds(where) == seconds
    # the same bytes each time (no time or name in the header): re-collecting changes nothing
    first = (where / "metrics.jsonl.gz").read_bytes()
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in plain.metrics))
    (raw / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in plain.evals))
    runner._collect(raw, where, {"arm": arm.key})
    assert (where / "metrics.jsonl.gz").read_bytes() == first
    assert not (where / "metrics.jsonl").exists() and ablations.pack_records(tmp_path) == 0


def test_a_failing_run_says_which_and_where_and_records_nothing(tmp_path):
    bad = ablations.Arm("bad", "bad", ("sampling.temperature=banana",))
    with pytest.raises(RuntimeError, match=r"x/bad seed 0: magic-jax train exited 2 \(log "):
        ablations.run_one("x", bad, 0, tmp_path, world="default")
    assert not ablations.is_done(tmp_path, bad, 0)
    assert "sampling.temperature" in (tmp_path / "raw" / "bad" / "seed0.log").read_text()


def _committed():
    runs = sorted(COMMITTED.glob("runs/*/seed*/run.json"))
    return [pytest.param(p, id=f"{p.parent.parent.name}-{p.parent.name}") for p in runs]


@pytest.mark.parametrize("record", _committed())
def test_committed_summaries_match_the_current_arms(record):
    rec = json.loads(record.read_text())
    arm = next(a for _, a in _all_arms() if a.key == rec["arm"])
    assert record.parent == ablations.summary_dir(COMMITTED, arm, rec["seed"])
    assert rec["step_budget"] is None
    world = ablations.WORLDS[ablations.ABLATIONS[rec["ablation"]].world]
    # a record keeps the keys its run was given; an option moved since is its new key
    pairs = [o.split("=", 1) for o in rec["overrides"]]
    overrides = [f"{MOVED_OPTIONS.get(k, k)}={v}" for k, v in pairs]
    assert overrides == ablations.overrides_for(arm, rec["seed"], world=world.key)
    assert rec["command"].startswith(f"magic-jax train {world.config} --set ")
    # stored compressed: a seventh of the size (ablations pack)
    assert {p.name for p in record.parent.glob("*.jsonl*")} == {"metrics.jsonl.gz", "eval.jsonl.gz"}
    run = load_run(record.parent)
    assert [m["step"] for m in run.metrics] == list(range(world.total_steps))
    assert run.evals[-1]["step"] == world.total_steps
    if world.statistics:
        stats = json.loads((record.parent / "world.json").read_text())
        assert stats["samples"] == 256 * ablations.WORLD_SAMPLES


def _in_progress(pre):
    """A claim whose runs have begun and not all finished (they are being made)."""
    done = [
        (COMMITTED / "runs" / a / f"seed{s}" / "run.json").exists()
        for a in pre.arms
        for s in pre.seeds
    ]
    return any(done) and not all(done)


@pytest.mark.slow  # about 20 s: the slow target
def test_the_notebooks_readme_holds_the_table_of_the_committed_runs(tmp_path, monkeypatch):
    readme = (ROOT / "notebooks" / "README.md").read_text()
    # a claim whose runs are in progress joins the tables once they are all done (its
    # notebook shows the partial runs; its figure is checked below)
    every = prereg.load_all
    monkeypatch.setattr(
        prereg,
        "load_all",
        lambda where=None: {k: v for k, v in every(where).items() if not _in_progress(v)},
    )
    tables = ar.write_tables(COMMITTED, tmp_path)
    assert tables["summary"].read_text().strip() in readme
    for key in ("effects", "runs", "self_noise"):  # the longer tables, committed beside it
        committed = ROOT / "notebooks" / "figures" / f"{key}.md"
        assert committed.read_text() == tables[key].read_text(), (
            f"regenerate {committed} after committing the runs: its last column names the "
            "commit that added each run.json"
        )
        assert f"](figures/{key}.md)" in readme
    for key, ab in ablations.ABLATIONS.items():
        if not any(ablations.is_done(COMMITTED, a, s) for a in ab.arms for s in ab.seeds):
            continue  # a claim whose runs have not begun has no figure yet
        assert f"](figures/{key}.png)" in readme
        assert (ROOT / "notebooks" / "figures" / f"{key}.png").exists()


def _with_notebook():
    return [p.name.split("_", 1)[1][:-3] for p in NOTEBOOKS]


def test_every_ablation_has_a_notebook_that_names_it():
    named = _with_notebook()
    # a claim pre-registered before its runs may wait for its notebook until they begin
    waiting = [
        k
        for k, ab in ablations.ABLATIONS.items()
        if k not in named
        and not any(ablations.is_done(COMMITTED, a, s) for a in ab.arms for s in ab.seeds)
    ]
    assert named == [k for k in ablations.ABLATIONS if k not in waiting]
    for p in NOTEBOOKS:
        text = p.read_text()
        assert f'ABLATION = "{p.stem.split("_", 1)[1]}"' in text
        assert "RESULTS" not in text.split("## What the committed runs show")[1][:40], p


def _trained_arms():
    """The arms the budget test trains: the first of each world with a set of options (the
    override keys) no earlier arm has; the others differ from one of these in values only,
    and every arm's config is loaded and checked by the default suite (above)."""
    keys, seen = [], set()
    for ab in ablations.ABLATIONS.values():
        for arm in ab.arms:
            overrides = ablations.overrides_for(arm, 0, budget=1, world=ab.world)
            options = (ab.world, frozenset(o.split("=")[0] for o in overrides))
            if not arm.pending and options not in seen:
                seen.add(options)
                keys.append(arm.key)
    return keys


@pytest.mark.slow
def test_notebooks_run_top_to_bottom_with_a_step_budget(tmp_path):
    """Every notebook top to bottom on a one-step budget: the arms of ``_trained_arms`` are
    trained (each set of options once); the others' first seeds are the committed runs,
    copied in, so the notebooks draw and judge real runs of every arm."""
    env = dict(os.environ, MPLBACKEND="Agg", **{ablations.STEPS_ENV: "1"})
    env[ablations.RESULTS_ENV] = str(tmp_path)
    env["MAGIC_JAX_NOTEBOOK_YES"] = "1"  # a claim's arms are more than a few runs
    trained = _trained_arms()
    for ab in ablations.ABLATIONS.values():
        for arm in ab.arms:
            src = ablations.summary_dir(COMMITTED, arm, ab.seeds[0])
            dst = ablations.summary_dir(tmp_path, arm, ab.seeds[0])
            if arm.key not in trained and src.exists() and not dst.exists():
                shutil.copytree(src, dst)
    sweeps = sorted((ROOT / "notebooks").glob("sweep_*.py"))  # a table, no verdict
    for nb in [*NOTEBOOKS, *sweeps]:
        proc = subprocess.run(
            [sys.executable, nb.name], cwd=nb.parent, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, f"{nb.name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert "verdict: " in proc.stdout or nb in sweeps, nb.name
    # each arm's first seed (0, or the claim's own: staleness_lr's are 10-14)
    done = sorted({p.parent.parent.name for p in tmp_path.glob("runs/*/seed*/run.json")})
    named = _with_notebook()
    ran = {a.key for k, ab in ablations.ABLATIONS.items() if k in named for a in ab.arms}
    assert done == sorted({a.key for _, a in _all_arms()} & ran)
    # the trained ones were trained here, on the budget (one step a stage)
    arms = {a.key: a for _, a in _all_arms()}
    for key in set(trained) & ran:
        (run_json,) = tmp_path.glob(f"runs/{key}/seed*/run.json")
        budget = arms[key].step_overrides(1)  # a one-stage arm trains the two stages' 2 steps
        assert set(budget) <= set(json.loads(run_json.read_text())["overrides"]), key


def test_sft_baseline_is_for_the_carry_world_and_compared_per_seed(tmp_path, monkeypatch):
    arm = ablations.Arm("x-arm", "x")
    other = ablations.Ablation("x", "x", "x", (arm,), world="default")
    monkeypatch.setitem(ablations.ABLATIONS, "x", other)
    with pytest.raises(ValueError, match="x: a supervised baseline needs the carry"):
        ablations.ensure_sft("x", "x-arm", results=tmp_path)
    ab = ablations.ABLATIONS["central"]
    arm = ab.arm("carry-adaptive")
    for seed in (0, 1):
        _fake_run(ablations.summary_dir(tmp_path, arm, seed), arm, seed, 0.05, 0.9)
    runs = ablations.load_arm_runs("central", tmp_path)
    assert ablations.recorded_seconds(ablations.summary_dir(tmp_path, arm, 0)) == 0.0
    sft = {
        s: {"seconds": 200.0, "steps": 900, "before": {"accuracy": 0.23},
            "after": {"accuracy": acc}}
        for s, acc in ((0, 0.24), (1, 0.22), (7, 0.5))  # seed 7 has no run: left out
    }  # fmt: skip
    text = ar.sft_comparison("carry-adaptive", runs, sft, "adaptive")
    # the fake runs end at 0.9 + 0.3 = 1.2
    assert "| 0 | 200 | 900 | 0.230 | 0.240 | 1.200 |" in text and "| 7 |" not in text
    assert "final accuracy: adaptive 1.200 vs SFT continuation 0.230" in text


def test_stage2_kl_drift_reads_medians_and_ignores_a_spike(tmp_path):
    from magic_jax.experiments.verdicts import stage2_ref_kl_drift
    from magic_jax.jobs.report import Run

    def run(stage2):
        rows = [{"step": i, "stage": 0, "ref_kl": 0.1} for i in range(10)]
        rows += [{"step": 10 + i, "stage": 1, "ref_kl": k} for i, k in enumerate(stage2)]
        return Run("r", tmp_path, rows, [], {})

    held = [0.1] * 20
    held[1] = 3.0  # one step's spike at the stage's start
    assert stage2_ref_kl_drift(run(held)) == pytest.approx(0.0)
    pulled = [0.1 - 0.005 * i for i in range(20)]  # falls towards 0 over the stage
    assert stage2_ref_kl_drift(run(pulled)) == pytest.approx(-0.08)
    assert math.isnan(stage2_ref_kl_drift(run([0.1])))


def test_class_entropy_table_reads_each_final_models_classes(tmp_path):
    ab = ablations.ABLATIONS["central_choice"]
    arm = ab.arm("carry-choice-adaptive")
    dest = ablations.summary_dir(tmp_path, arm, 0)
    _fake_run(dest, arm, 0, 0.05, 0.9)
    runs = ablations.load_arm_runs("central_choice", tmp_path)
    assert ar.class_entropy_table("central_choice", runs).startswith("(no run has")
    by = {"choice": 0.4, "digit": 0.01, "format": 0.02, "after_answer": 0.0}
    world = {"entropy_by_class": by, "check_rate_needed": 0.9, "truncated": 0.0, "accuracy": 0.7}
    (dest / "world.json").write_text(json.dumps(world))
    text = ar.class_entropy_table(
        "central_choice", ablations.load_arm_runs("central_choice", tmp_path)
    )
    assert "| 0 | 0.400 | 0.010 | 0.020 | 0.000 | 0.900 | 0.000 | 0.700 |" in text


def test_seed_status_names_a_check_against_zero():
    from magic_jax.jobs.report import Run

    runs = {"carry-kl-0.1": [Run(f"s{s}", Path("."), [], [], {}) for s in range(2)]}
    lines = ar.seed_status("kl", runs)
    drift = next(line for line in lines if line.startswith("stage-2 KL drift"))
    assert drift.endswith(" vs 0: provisional (seeds missing)"), drift
    assert len(lines) == len(ar.CHECKS["kl"])


def test_a_world_of_unequal_stages_gives_every_arm_the_same_steps():
    two = ablations.Arm("two", "x")
    one = ablations.Arm("one", "x", stages=(("T42", 42),))
    three = ablations.Arm("three", "x", stages=(("a", 8), ("b", 16), ("c", 32)))
    assert two.step_overrides((100, 200)) == ("stages.0.steps=100", "stages.1.steps=200")
    assert two.step_overrides(15) == ("stages.0.steps=15", "stages.1.steps=15")
    assert "steps: 300," in one.step_overrides((100, 200))[0]
    assert one.step_overrides((100, 200))[0].count("steps: 300,") == 1
    assert three.step_overrides((100, 200))[0].count("steps: 100,") == 3
    w = ablations.World("w", "c.yaml", "assets/c.yaml", (100, 200), (), ())
    assert w.total_steps == 300 and ablations.WORLDS["lockout"].total_steps == 300
