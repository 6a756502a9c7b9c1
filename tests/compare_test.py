"""A researcher's own question: a new arm from the command line, its comparison with a
committed arm (panels, outcome table, exact tests), a sweep over one option, and every
run's outcomes as a CSV."""

import csv
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from magic_jax.experiments import ablations, compare, corrected, derived, outcomes
from magic_jax.experiments.verdicts import final_accuracy, late_entropy, welch

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "notebooks" / "results"


def _copy_arm(src_arm, dest, name=None, seeds=range(5)):
    """The committed runs of ``src_arm`` as ``dest``'s runs of ``name`` (a stand-in for
    runs trained here), ``run.json`` renamed."""
    for k in seeds:
        to = dest / "runs" / (name or src_arm) / f"seed{k}"
        shutil.copytree(COMMITTED / "runs" / src_arm / f"seed{k}", to)
        if name:
            rec = json.loads((to / "run.json").read_text())
            rec.update(arm=name, derived_from=src_arm)
            (to / "run.json").write_text(json.dumps(rec))


def test_compare_two_arms_draws_and_tests_them(tmp_path):
    _copy_arm("carry-clip-0.1", tmp_path)
    _copy_arm("carry-clip-0.07", tmp_path / "derived", name="wider")
    spec = {"from": "carry-clip-0.1", "set": ["loss.eps_high=0.2"]}
    (tmp_path / "derived/runs/wider/arm.json").write_text(json.dumps(spec))
    out = tmp_path / "cmp"
    assert ablations.main(["compare", "carry-clip-0.1", "wider", "--results", str(tmp_path),
                           "--out", str(out)]) == 0  # fmt: skip
    assert (out / "compare.png").stat().st_size > 10_000
    text = (out / "compare.md").read_text()
    assert "wider: carry-clip-0.1 with loss.eps_high=0.2" in text and "Exploratory" in text
    runs = compare.load(["carry-clip-0.1", "wider"], tmp_path)
    a = [final_accuracy(r) for r in runs["carry-clip-0.1"]]
    b = [final_accuracy(r) for r in runs["wider"]]
    assert len(a) == len(b) == 5
    # the table's numbers are the measures' own: mean +- std, Welch, exact Mann-Whitney
    assert f"{np.mean(b):.3f} +- {np.std(b, ddof=1):.3f}" in text
    rows = {(r[0], r[1]): r for r in compare.effect_rows(runs)}
    row = rows[("wider", "final accuracy")]
    assert row[2] == f"{np.mean(b) - np.mean(a):+.3f}"
    assert row[4] == f"{welch(a, b)[3]:.3g}" and row[5] == f"{corrected.rank_p(a, b):.3g}"
    ent = rows[("wider", "late entropy")]
    ea = [late_entropy(r) for r in runs["carry-clip-0.1"]]
    eb = [late_entropy(r) for r in runs["wider"]]
    assert ent[5] == f"{corrected.rank_p(ea, eb):.3g}"
    assert float(row[6]) >= float(row[5]) and not math.isnan(float(row[7]))  # Holm, paired


def test_compare_names_what_it_cannot_find(tmp_path, capsys):
    _copy_arm("carry-clip-0.1", tmp_path, seeds=[0])
    assert ablations.main(["compare", "carry-clip-0.1", "nope", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        f"no finished run of nope in {tmp_path}/runs/nope and {tmp_path}/derived/runs/nope" in err
    )
    assert ablations.main(["compare", "carry-clip-0.1", "--results", str(tmp_path)]) == 2
    assert "two arms or more" in capsys.readouterr().err


def test_compare_warns_when_the_runs_differ_in_length(tmp_path):
    import gzip

    _copy_arm("carry-clip-0.1", tmp_path, seeds=[0, 1])
    _copy_arm("carry-clip-0.07", tmp_path / "derived", name="short", seeds=[0])
    (tmp_path / "derived/runs/short/arm.json").write_text(
        json.dumps({"from": "carry-clip-0.1", "set": ["loss.eps_high=0.07"]})
    )
    text = compare.compare(["carry-clip-0.1", "short"], tmp_path)[1]
    assert "differ in length" not in text  # equal lengths: no warning
    packed = tmp_path / "derived/runs/short/seed0/metrics.jsonl.gz"
    rows = gzip.decompress(packed.read_bytes()).decode().splitlines(keepends=True)
    packed.write_bytes(gzip.compress("".join(rows[:2]).encode()))  # a smoke run's two steps
    text = compare.compare(["carry-clip-0.1", "short"], tmp_path)[1]
    assert "Warning: the runs differ in length (steps per run: carry-clip-0.1 300; short 2)" in text
    out = tmp_path / "compare" / "carry-clip-0.1_vs_short" / "compare.md"
    assert "differ in length" in out.read_text()


def test_a_sweep_trains_a_derived_arm_per_value_and_compares(tmp_path, monkeypatch):
    monkeypatch.delenv(ablations.STEPS_ENV, raising=False)
    _copy_arm("carry-clip-0.1", tmp_path, seeds=[0, 1])
    trained = []

    def run_one(ab, arm, seed, where, *, budget, world, log):
        trained.append((arm.key, arm.overrides[-1], seed))
        src = {"0.2": "carry-clip-0.07", "0.3": "carry-clip-0.05"}[arm.overrides[-1][-3:]]
        dest = ablations.summary_dir(where, arm, seed)
        shutil.copytree(COMMITTED / "runs" / src / f"seed{seed}", dest)
        return dest

    monkeypatch.setattr(ablations, "run_one", run_one)
    argv = ["sweep", "--from", "carry-clip-0.1", "--set", "loss.eps_high=0.2,0.3"]
    argv += ["--seeds", "0-1", "--results", str(tmp_path), "--yes"]
    assert ablations.main(argv) == 0
    names = ["carry-clip-0.1-eps_high-0.2", "carry-clip-0.1-eps_high-0.3"]
    want = [(n, f"loss.eps_high={n[-3:]}", k) for n in names for k in (0, 1)]
    assert trained == want
    where = tmp_path / "compare" / "_vs_".join(["carry-clip-0.1", *names])
    assert (where / "sweep.png").exists() and (where / "compare.png").exists()
    assert "carry-clip-0.1-eps_high-0.3" in (where / "compare.md").read_text()
    assert ablations.main(argv) == 0 and len(trained) == 4  # done runs are not trained again
    assert ablations.main([*argv[:4], "loss.eps_high=0.2", *argv[5:]]) == 2  # nothing swept


def test_outcomes_csv_has_a_row_per_run_from_its_records(tmp_path):
    _copy_arm("carry-adaptive-0.08", tmp_path, seeds=[0, 1])
    _copy_arm("carry-clip-0.1", tmp_path, name="mine", seeds=[3])
    runs = outcomes.finished_runs(tmp_path)
    path = outcomes.write_csv(runs, tmp_path / "outcomes.csv")
    rows = list(csv.DictReader(path.open()))
    assert [(r["arm"], r["seed"]) for r in rows] == [
        ("carry-adaptive-0.08", "0"), ("carry-adaptive-0.08", "1"), ("mine", "3")]  # fmt: skip
    assert list(rows[0]) == [c for c, _ in outcomes.COLUMNS]
    first = runs[0]
    rec = json.loads((first.path / "run.json").read_text())
    assert (
        rows[0]["commit"] == (rec.get("commit") or "") and float(rows[0]["wall_s"]) == rec["wall_s"]
    )
    assert float(rows[0]["final_accuracy"]) == pytest.approx(final_accuracy(first), rel=1e-5)
    alphas = [m.get("alpha", 0) for m in first.metrics]
    assert float(rows[0]["alpha_on_share"]) == pytest.approx(np.mean([a > 0 for a in alphas]))
    assert 0 < float(rows[0]["alpha_on_share"]) <= 1  # the adaptive arm's bonus was on
    assert rows[2]["derived_from"] == "carry-clip-0.1"


@pytest.mark.heavy  # 10-16 s on 2 cores
def test_the_committed_outcomes_csv_is_the_committed_runs(tmp_path):
    from magic_jax.experiments.ablation_report import write_csv

    got = write_csv(outcomes.finished_runs(COMMITTED), tmp_path / "o.csv").read_text()
    assert got == (ROOT / "notebooks" / "figures" / "outcomes.csv").read_text()


@pytest.mark.slow  # 69 s on 2 cores (one carry-world run of one step a stage, then compare)
def test_a_new_arm_trained_on_the_smoke_budget_then_compared(tmp_path):
    """As typed: ``ablations run --from ... --set ...`` trains the new arm (one step a
    stage), then ``compare`` draws it against the committed arm's copied runs."""
    _copy_arm("carry-clip-0.1", tmp_path, seeds=[0])
    env = {ablations.STEPS_ENV: "1", "MPLBACKEND": "Agg"}
    cmd = [sys.executable, "-m", "magic_jax.experiments.ablations"]
    new = ["run", "--from", "carry-clip-0.1", "--name", "clip-0.4", "--set", "loss.eps_high=0.4"]
    env_all = {**__import__("os").environ, **env}
    proc = subprocess.run([*cmd, *new, "--seeds", "0", "--results", str(tmp_path)],
                          env=env_all, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = tmp_path / "derived/runs/clip-0.4/seed0"
    cfg = (run / "config.yaml").read_text()
    assert "eps_high: 0.4" in cfg
    assert json.loads((run / "run.json").read_text())["rerun"] == derived.command(
        "carry-clip-0.1", "clip-0.4", ["loss.eps_high=0.4"], 0
    )
    proc = subprocess.run([*cmd, "compare", "carry-clip-0.1", "clip-0.4", "--results",
                           str(tmp_path)], env=env_all, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    where = tmp_path / "compare" / "carry-clip-0.1_vs_clip-0.4"
    assert (where / "compare.png").exists() and "clip-0.4" in (where / "compare.md").read_text()
