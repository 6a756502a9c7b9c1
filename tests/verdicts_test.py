"""Pre-registrations, corrected statistics, run provenance and the self-noise of twin arms."""

import datetime
import json
import math
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from magic_jax.experiments import ablations, claims_table, corrected, pairing, prereg, progress
from magic_jax.experiments.verdicts import CHECKS, OUTCOMES
from magic_jax.jobs.report import Run

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "notebooks" / "results"
PREREG = ROOT / "notebooks" / "prereg"


def _doc(**over):
    doc = {
        "claim": "a beats b",
        "world": "carry",
        "status": "prospective",
        "arms": ["a", "b"],
        "seeds": [0, 1],
        "primary_endpoint": {
            "measure": "final accuracy",
            "arms": ["a", "b"],
            "direction": "greater",
            "test": "welch",
        },
        "predictions": [
            {"measure": "final accuracy", "arms": ["a", "b"], "direction": "greater"},
            {"measure": "late entropy", "arms": ["a", None], "direction": "same", "tolerance": 1},
        ],
        "tests": {"default": "welch", "late entropy": "mann-whitney"},
        "correction": "holm",
        "notes": "",
    }
    doc.update(over)
    return doc


def test_a_valid_file_loads(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(_doc()))
    pre = prereg.load(p)
    assert pre.name == "c" and pre.seeds == (0, 1) and pre.status == "prospective"
    assert pre.test_for("late entropy") == "mann-whitney" and pre.test_for("x") == "welch"
    c = pre.predictions[1].check()
    assert (c.outcome, c.arm, c.reference, c.sign, c.tolerance) == ("late entropy", "a", None, 0, 1)
    assert pre.primary.check().sign == +1 and pre.first_declared("late entropy") == "late entropy"
    inverted = _doc(tests={"welch": ["final accuracy"], "mann-whitney": "late entropy"})
    p.write_text(yaml.safe_dump(inverted))
    assert prereg.load(p).tests == {"final accuracy": "welch", "late entropy": "mann-whitney"}
    p.write_text(yaml.safe_dump(_doc(tests=["wilcoxon-paired"])))
    assert prereg.load(p).test_for("late entropy") == "wilcoxon-paired"


@pytest.mark.parametrize(
    "over,key",
    [
        ({"status": "maybe"}, "status"),
        ({"seeds": [0, "1"]}, "seeds"),
        ({"correction": "bonferroni"}, "correction"),
        ({"tests": {"default": "t-test"}}, "tests.default"),
        ({"tests": {"late entropy": "welch"}}, "predictions[0].test"),
        ({"predictions": []}, "predictions"),
        ({"predictions": [{"measure": "m", "arms": ["a"], "direction": "less"}]}, "arms"),
        ({"predictions": [{"measure": "m", "arms": ["a", "c"], "direction": "less"}]}, "arms"),
        ({"predictions": [{"measure": "m", "arms": ["a", "b"], "direction": "up"}]}, "direction"),
        ({"predictions": [{"measure": "m", "arms": ["a", "b"], "direction": "same"}]}, "tolerance"),
        ({"measure_changes": [{"measure": "m"}]}, "measure_changes[0].first_declared"),
    ],
)
def test_a_bad_file_names_the_file_and_the_key(tmp_path, over, key):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(_doc(**over)))
    with pytest.raises(prereg.PreregError) as e:
        prereg.load(p)
    assert str(e.value).startswith(f"{p}: ") and key in str(e.value)


def test_a_missing_key_is_named(tmp_path):
    doc = _doc()
    del doc["primary_endpoint"]
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump(doc))
    with pytest.raises(prereg.PreregError, match=r"m\.yaml: primary_endpoint: missing"):
        prereg.load(p)


def test_every_committed_prereg_loads_and_the_retrospective_ones_are_the_table_checks():
    pres = prereg.load_all(PREREG)
    retro = [p for p in pres.values() if p.status == "retrospective"]
    # every claim with committed runs has a file
    with_runs = {
        k
        for k, ab in ablations.ABLATIONS.items()
        if any(ablations.is_done(COMMITTED, a, s) for a in ab.arms for s in ab.seeds)
    }
    assert len(with_runs) >= 8 and with_runs <= {p.ablation for p in pres.values()}
    # every claim has one, and the checks its notebook prints are the file's predictions
    assert sorted(p.ablation for p in pres.values()) == sorted(ablations.ABLATIONS)
    assert len(retro) == 8
    for p in pres.values():
        ab = ablations.ABLATIONS[p.ablation]
        assert sorted(p.arms) == sorted(ab.arm_keys) and list(p.seeds) == list(ab.seeds)
        assert [x.check() for x in p.predictions] == list(CHECKS[p.ablation]), p.path
    for p in retro:
        assert list(p.arms) == ablations.ABLATIONS[p.ablation].arm_keys
        assert p.primary.check() == CHECKS[p.ablation][0]
        for x in p.predictions:
            assert x.measure in OUTCOMES and p.first_declared(x.measure) in OUTCOMES


def test_holm_steps_down_and_keeps_nan():
    adj = corrected.holm([0.01, 0.04, math.nan, 0.03])
    assert adj[:2] == pytest.approx([0.03, 0.06]) and adj[3] == pytest.approx(0.06)
    assert math.isnan(adj[2])
    assert corrected.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert corrected.holm([]) == []


def test_rank_and_paired_tests():
    lo, hi = [0.1, 0.2, 0.3, 0.4, 0.5], [0.6, 0.7, 0.8, 0.9, 1.0]
    # fully separated 5 vs 5: the smallest exact two-sided p, 2 / C(10, 5)
    assert corrected.rank_p(lo, hi) == pytest.approx(2 / 252)
    assert corrected.rank_p([0.1, 0.6, 0.3, 0.9, 0.5], [0.2, 0.7, 0.4, 0.8, 1.0]) > 0.3
    assert math.isnan(corrected.rank_p([0.1], hi))
    assert corrected.paired_p(lo, hi) == pytest.approx(0.0625)  # 5 positive signs, exact
    assert math.isnan(corrected.paired_p(lo, lo))


def test_rank_p_is_scipys_exact_without_ties_and_the_permutation_p_with_them():
    from scipy import stats

    rng = np.random.default_rng(0)
    for n, m in ((5, 5), (8, 8), (4, 7), (16, 16)):
        a, b = rng.normal(size=n), rng.normal(0.8, size=m)
        want = stats.mannwhitneyu(a, b, alternative="two-sided", method="exact").pvalue
        assert corrected.rank_p(b, a) == pytest.approx(want, rel=1e-9)
    # ties: against the full permutation distribution of U (every split enumerated)
    for a, b in (
        ([0.5, 0.5, 0.25, 0.75, 0.5], [0.5, 0.75, 0.75, 1.0, 0.5]),
        ([1, 1, 2, 2, 3, 3], [2, 3, 3, 4, 4, 4]),
        ([0.0] * 4 + [0.25], [0.0, 0.0, 0.25, 0.25, 0.5, 0.5]),
    ):
        perm = stats.permutation_test(
            (a, b),
            lambda x, y: stats.mannwhitneyu(x, y, method="asymptotic").statistic,
            permutation_type="independent",
            n_resamples=np.inf,
        ).pvalue
        assert corrected.rank_p(b, a) == pytest.approx(perm, rel=1e-9)
        ties_ignored = stats.mannwhitneyu(a, b, method="exact").pvalue
        assert corrected.rank_p(b, a) != pytest.approx(ties_ignored, rel=1e-3)
    # the lock-out claim's primary endpoint: U = 13.5 of 8 vs 8 seeds (0.065 ignoring ties)
    adaptive = [
        0.5,
        0.50585938,
        0.49121094,
        0.51855469,
        0.43554688,
        0.49609375,
        0.48242188,
        0.50488281,
    ]
    none = [
        0.50292969,
        0.5078125,
        0.52734375,
        0.515625,
        0.51757812,
        0.49707031,
        0.50488281,
        0.51660156,
    ]
    assert corrected.rank_p(none, adaptive) == pytest.approx(0.05345765, rel=1e-6)
    assert math.isnan(corrected.rank_p([0.1, math.nan, 0.3], [0.2, 0.4]))


def test_verdicts_come_from_the_holm_adjusted_p(tmp_path):
    """Three predictions each at raw p < 0.05: Holm within the claim keeps only the
    smallest."""
    arms = {"a": [0.0, 0.1, 0.2, 0.3, 0.4]}

    def runs(shift):
        return [
            Run(f"s{i}", tmp_path, [{"step": 0, "entropy": 0.0}], [{"step": 1, "accuracy": v}], {})
            for i, v in enumerate(x + shift for x in arms["a"])
        ]

    pre = prereg.parse(
        tmp_path / "t.yaml",
        _doc(
            arms=["a", "b", "c", "d"],
            primary_endpoint={
                "measure": "final accuracy",
                "arms": ["b", "a"],
                "direction": "greater",
            },
            predictions=[
                {"measure": "final accuracy", "arms": ["c", "a"], "direction": "greater"},
                {"measure": "final accuracy", "arms": ["d", "a"], "direction": "less"},
            ],
            tests="welch",
        ),
    )
    got = {"a": runs(0.0), "b": runs(0.5), "c": runs(0.25), "d": runs(0.25)}
    rows = corrected.correct({"t": corrected.claim_rows(pre, got)})["t"]
    assert [r.primary for r in rows] == [True, False, False]
    assert all(r.p < 0.05 for r in rows)
    assert [r.verdict for r in rows] == ["reproduced", "inconclusive", "inconclusive"]
    assert rows[2].against and not rows[1].against
    assert corrected.primary_verdict(rows) == "reproduced"
    assert corrected.label(rows) == "final accuracy: reproduced in 1 of 3"
    assert rows[0].p_rank == pytest.approx(2 / 252)


def _git(cwd, *args):
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env |= {"GIT_COMMITTER_EMAIL": "t@t", "HOME": str(cwd), "PATH": "/usr/bin:/bin"}
    subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)


def _run_json(d: Path, **rec):
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps(rec))


def test_runs_before_the_pre_registration_commit_are_found(tmp_path):
    _git(tmp_path, "init", "-q")
    reg = tmp_path / "prereg"
    reg.mkdir()
    (reg / "c.yaml").write_text(yaml.safe_dump(_doc()))
    pre = prereg.load(reg / "c.yaml")
    results = tmp_path / "results"
    # a run recorded at a commit made before the claim file
    (tmp_path / "x").write_text("x")
    _git(tmp_path, "add", "x")
    _git(tmp_path, "commit", "-qm", "before")
    before = prereg.head_state(tmp_path)["commit"]
    _run_json(results / "runs" / "a" / "seed0", commit=before, dirty=False)
    assert prereg.late_runs(pre, results) == [
        f"{results}/runs/a/seed0: {reg / 'c.yaml'} is not committed"
    ]
    _git(tmp_path, "add", "prereg/c.yaml")
    _git(tmp_path, "commit", "-qm", "prereg")
    after = prereg.head_state(tmp_path)
    assert after["dirty"] is False and prereg.added_in(reg / "c.yaml") == after["commit"]
    late = prereg.late_runs(pre, results)
    assert len(late) == 1 and f"ran at {before[:7]}, before the pre-registration" in late[0]
    (results / "runs" / "a" / "seed0" / "run.json").write_text(json.dumps(after))
    _run_json(results / "runs" / "b" / "seed1", **after)
    assert prereg.late_runs(pre, results) == []
    # a run without a recorded commit: the newest commit before it started
    start = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    _run_json(results / "runs" / "b" / "seed0", finished=start.isoformat(), wall_s=10.0)
    origin = prereg.run_origin(results / "runs" / "b" / "seed0")
    assert origin.commit == after["commit"] and not origin.recorded
    assert prereg.late_runs(pre, results) == []
    (reg / "c.yaml").write_text("# edited\n" + (reg / "c.yaml").read_text())
    assert prereg.head_state(tmp_path)["dirty"] is True


@pytest.mark.heavy
def test_every_run_of_a_prospective_claim_follows_its_pre_registration():
    """The table's runs: each prospective claim's were made at or after the commit that
    added its file; retrospective claims are flagged as such in the table."""
    pres = prereg.load_all(PREREG)
    for p in pres.values():
        if p.status == "prospective":
            assert prereg.late_runs(p, COMMITTED) == [], p.path
    summary = claims_table.summary_table(COMMITTED, PREREG)
    for name, p in pres.items():
        if p.status == "retrospective":
            assert f"| {name} | retrospective |" in summary


def test_committed_runs_have_a_commit_before_the_one_that_added_them():
    d = COMMITTED / "runs" / "carry-fixed-2" / "seed4"
    o = prereg.run_origin(d)
    assert o.commit and o.committed_in and not o.recorded
    assert prereg.is_ancestor(o.commit, o.committed_in, ROOT)


def test_the_disclosed_measure_changes_came_after_their_runs():
    """Each measure change a file discloses was committed after every run of its claim
    finished (what makes it a change after the data)."""
    for p in prereg.load_all(PREREG).values():
        for c in p.measure_changes:
            t = prereg.git(["show", "-s", "--format=%ct", c.commit], ROOT)
            assert t, c.commit
            finished = [
                datetime.datetime.fromisoformat(json.loads(f.read_text())["finished"]).timestamp()
                for a in p.arms
                for f in COMMITTED.glob(f"runs/{a}/seed*/run.json")
            ]
            assert finished and max(finished) < int(t), (p.path, c.commit)


def test_the_runner_records_the_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "watch", lambda *a, **k: 0)  # the training run
    arm = ablations.Arm("x-arm", "x")
    dest = ablations.run_one("x", arm, 0, tmp_path, world="default", log=lambda _: None)
    rec = json.loads((dest / "run.json").read_text())
    head = prereg.head_state(ROOT)
    assert rec["commit"] == head["commit"] and len(rec["commit"]) == 40
    assert isinstance(rec["dirty"], bool)


def _metric_run(tmp_path, rows):
    return Run("r", tmp_path, rows, [], {})


def test_first_difference_of_two_runs(tmp_path):
    base = [{"step": s, "entropy": 0.1, "reward": 0.5, "t_update_s": s} for s in range(5)]
    other = [dict(r) for r in base]
    other[1]["t_update_s"] = 99  # timings never count
    other[2]["entropy"] = 0.1 + 1e-9  # numbers differ from step 2
    other[4]["reward"] = 0.6  # the rollouts from step 4
    a, b = _metric_run(tmp_path, base), _metric_run(tmp_path, other)
    assert pairing.first_difference(a, b) == 2
    assert pairing.first_difference(a, b, ("reward",)) == 4
    assert pairing.first_difference(a, a) is None


def test_twin_arms_have_the_same_training_config(tmp_path):
    from magic_jax.run.config import load_config

    def cfg(key, **kw):
        ab = next(a for a in ablations.ABLATIONS.values() if key in a.arm_keys)
        arm = ab.arm(key)
        c = load_config(
            ablations.train_config(ab.world),
            [*ablations.overrides_for(arm, 0, world=ab.world), f"output_dir={tmp_path}"],
        )
        return c

    for t in pairing.TWINS:
        a, b = cfg(t.a), cfg(t.b)
        assert a.sampling == b.sampling and a.loss.eps_high == b.loss.eps_high
        assert a.entropy == b.entropy and a.kl_beta(0) == b.kl_beta(0)
        assert (a.kl_beta(1) == b.kl_beta(1)) is (t.until is None)


def test_lockout_measures_read_the_chain_half_and_the_probe_at_stage_1s_end(tmp_path):
    from magic_jax.experiments.verdicts import final_chain_accuracy, probe_log10_p_stage1_end
    from magic_jax.jobs.report import Run

    def run(stages):
        metrics = [{"step": i, "stage": s} for i, s in enumerate(stages)]
        evals = [
            {"step": k, "accuracy": 0.5, "probe": {"log10_p_mean": -k / 10},
             "by_source": {"heldout-chain": k / 100, "heldout-plain": 0.9}}
            for k in (0, 10, 20)
        ]  # fmt: skip
        return Run("r", tmp_path, metrics, evals, {})

    two = run([0] * 10 + [1] * 10)
    assert probe_log10_p_stage1_end(two) == -1.0 and final_chain_accuracy(two) == 0.2
    # one stage of the same length: read at the same step, half its steps
    assert probe_log10_p_stage1_end(run([0] * 20)) == -1.0
    assert math.isnan(probe_log10_p_stage1_end(run([0] * 16)))  # no evaluation at step 8


def test_the_staleness_arms_run_what_their_pre_registration_says(tmp_path, capsys):
    from magic_jax.run.config import load_config

    ab = ablations.ABLATIONS["staleness"]
    pre = prereg.for_ablation("staleness", PREREG)
    assert pre.status == "prospective" and pre.seeds == ab.seeds == ablations.SEEDS_CENTRAL
    assert len(ab.arms) == 9 and not any(a.pending for a in ab.arms)
    shipped = load_config(ablations.train_config("carry"), [f"output_dir={tmp_path}"])
    for arm in ab.arms:
        c = load_config(
            ablations.train_config("carry"),
            [*ablations.overrides_for(arm, 0, world="carry"), f"output_dir={tmp_path}"],
        )
        assert c.entropy == shipped.entropy and c.total_steps == shipped.total_steps == 300
        assert c.rollout.publish_chunks is None
        if arm.key == "carry-stale-sync":
            assert (c.rollout.mode, c.loss.tis_cap) == ("sync", None)
            continue
        s, kind = int(arm.key.split("-")[1][len("stale") :]), arm.key.split("-")[2]
        assert (c.rollout.mode, c.rollout.max_staleness) == ("overlap", s)
        assert c.loss.tis_cap == (2.0 if kind == "decoupled" else None)
    # the runner's dry run prints the command and runs nothing; no runs: no verdict yet
    argv = ["run", "--ablation", "staleness", "--arm", "carry-stale4-decoupled", "--seeds", "0"]
    assert ablations.main([*argv, "--results", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("magic-jax train configs/carry.yaml") == 1 and not (tmp_path / "runs").exists()
    for o in ("rollout.mode=overlap", "rollout.max_staleness=4", "loss.tis_cap=2.0", "seed=0"):
        assert f"--set {o} " in out
    rows = corrected.judge_all({"staleness": pre}, tmp_path)
    assert rows == {"staleness": []} and corrected.primary_verdict([]) == "no runs yet"
    assert sum(p.direction != "same" for p in pre.predictions) == 4  # the Holm family


def test_the_readme_table_quotes_only_the_notes_of_predictions_that_held():
    """A bracket after a measure in notebooks/README.md's table quotes a prediction's note
    only when that prediction was reproduced (Holm within its claim)."""
    readme = (PREREG.parent / "README.md").read_text()
    pres = prereg.load_all(PREREG)
    rows = corrected.judge_all(pres, COMMITTED)
    checked = 0
    for line in readme.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) < 7 or cells[0] not in pres:
            continue
        held = {r.prediction.note for r in rows[cells[0]] if r.verdict == "reproduced"}
        every = {r.prediction.note for r in rows[cells[0]] if r.prediction.note}
        for bracket in re.findall(r"\[([^\]]*)\]", cells[-2]):
            for note in bracket.split("; "):
                if note in every or any(note in n for n in every):
                    assert any(note in n for n in held), (cells[0], note)
                    checked += 1
    assert checked >= 5
    # and the rule itself: an inconclusive prediction's note is not quoted
    r = next(
        r for rs in rows.values() for r in rs if r.prediction.note and r.verdict != "reproduced"
    )
    assert r.prediction.note not in corrected.label([r])


def test_mean_sampler_kl_leaves_out_steps_that_did_not_update():
    # a step whose groups were all filtered out trains nothing and records null
    rows = [{"step": 0, "sampler_kl": 0.0}, {"step": 1, "sampler_kl": None},
            {"step": 2, "sampler_kl": 0.3}, {"step": 3}]  # fmt: skip
    run = Run("r", Path("."), rows, [], {})
    assert OUTCOMES["mean sampler KL"](run) == pytest.approx(0.15)
    assert math.isnan(OUTCOMES["mean sampler KL"](Run("r", Path("."), [{"step": 0}], [], {})))


def test_the_readmes_headline_counts_use_each_claims_declared_test():
    """notebooks/README.md's counts of predictions reaching raw p < 0.05 are taken at each
    claim's declared test (Welch's t for every claim would give 29 and 11, not 26 and 8)."""
    text = " ".join((PREREG.parent / "README.md").read_text().split())
    pres = prereg.load_all(PREREG)
    rows = corrected.judge_all(pres, COMMITTED)

    def counts(status):
        names = [c for c in rows if status is None or pres[c].status == status]
        return corrected.headline(rows, names)

    total, raw, within, table = counts(None)
    assert f"Of its {total} predictions, {raw} reach a raw p < 0.05 with the predicted sign" in text
    assert f"Holm within each claim keeps {within}, Holm across the table keeps {table}" in text
    n, r, _, t = counts("retrospective")
    assert f"Of the eight retrospective claims' {n}, {r} reach it and {t} survive" in text
    n, r, _, t = counts("prospective")
    claims = sum(pres[c].status == "prospective" for c in rows)
    word = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"][claims]
    pre_registered = rf"Of the {word} pre-registered claims' {n}, {r} reach it \([^)]*\) and {t}"
    assert re.search(pre_registered, text)
    # the declared test is what differs: at Welch's t for all the count is another
    welch_raw = sum(x.effect.verdict == "reproduced" for rs in rows.values() for x in rs)
    assert welch_raw != raw
