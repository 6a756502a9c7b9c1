"""The carry world: its task (a check-or-hurry choice per column, difficulty by carries)."""

import collections
import itertools

import numpy as np
import pytest

from magic_jax.data.tasks import carry
from magic_jax.rewards import math_reward


def hurried_sum(a: int, b: int) -> int:
    """The column-wise sum with every carry dropped (every column hurried)."""
    return int("".join(str((x + y) % 10) for x, y, _ in reversed(carry.columns(a, b))))


def answer_of(a: int, b: int, checks) -> int:
    """The number ``carry.solution(a, b, checks)`` boxes."""
    text = carry.solution(a, b, checks)
    return int(text[text.rindex("{") + 1 : -1])


def test_carries_needed_columns_and_the_hurried_sum():
    assert carry.carries(389, 423) == 2 and hurried_sum(389, 423) == 702
    assert carry.needed(389, 423) == [True, True, True]
    assert carry.carries(12, 34) == 0 and carry.needed(12, 34) == [False, False]
    # the top column's carry out counts; a missing digit is 0
    assert carry.carries(95, 7) == 2 and carry.needed(95, 7) == [True, True]
    assert carry.needed(1905, 12) == [False, False, False, False]
    assert carry.needed(1905, 15) == [True, True, False, False]


def test_lines_check_or_hurry_each_column():
    assert carry.solution(389, 423, [True] * 3) == (
        "9+3=12\n8+2+1=11\n3+4+1=8\n</think>\n\\boxed{812}"
    )
    assert carry.solution(389, 423, [False] * 3) == "2\n0\n7\n</think>\n\\boxed{702}"
    # a hurried column drops the carry it gets; a checked top column carries into a leading 1
    assert carry.solution(389, 423, [True, False, True]) == (
        "9+3=12\n0\n3+4=7\n</think>\n\\boxed{702}"
    )
    assert carry.solution(95, 7, [True, True]) == "5+7=12\n9+0+1=10\n</think>\n\\boxed{102}"
    with pytest.raises(ValueError, match="3 columns, got 2 choices"):
        carry.solution(389, 423, [True, True])


def test_an_answer_is_right_exactly_when_every_needed_column_is_checked():
    rng = np.random.default_rng(1)
    for a, b in carry.CarryTask().problems(300, rng):
        need = carry.needed(a, b)
        for checks in itertools.product((False, True), repeat=len(need)):
            right = answer_of(a, b, checks) == a + b
            assert right == all(c for c, n in zip(checks, need) if n), (a, b, checks)
            assert carry.read_checks(carry.solution(a, b, checks)) == list(checks)
    # and the math verifier agrees
    for a, b in carry.CarryTask().problems(40, rng):
        n = len(carry.needed(a, b))
        assert math_reward(carry.solution(a, b, [True] * n), str(a + b)).reward == 1.0
        hurried = math_reward(carry.solution(a, b, [False] * n), str(a + b)).reward
        assert hurried == float(carry.carries(a, b) == 0)
    assert carry.read_checks("9+3=12\n8+2") is None  # truncated: the reasoning never closed


def test_problems_spread_over_carry_counts_and_exclude_a_held_out_set():
    task = carry.CarryTask()
    rows = carry.verl_rows(3000, seed=3, task=task)
    counts = collections.Counter(r["extra_info"]["carries"] for r in rows)
    assert set(counts) == set(range(6))
    # with 2-5 digit operands, 0-2 carries are each about a fifth of the problems
    assert all(0.17 < counts[c] / 3000 < 0.27 for c in (0, 1, 2)), counts
    for r in rows[:50]:
        a, b = carry.row_problem(r)
        assert r["reward_model"]["ground_truth"] == str(a + b)
        assert 10 <= a < 100000 and 10 <= b < 100000
    held = {carry.row_problem(r) for r in rows[:500]}
    more = carry.verl_rows(500, seed=4, task=task, exclude=held)
    assert not held & {carry.row_problem(r) for r in more}
    with pytest.raises(ValueError, match="check_rate"):
        carry.CarryTask(check_rate=2.0)


def test_supervised_solutions_check_columns_at_the_set_rate():
    rng = np.random.default_rng(0)
    task = carry.CarryTask(check_rate=0.25)
    checks = [
        c for _ in range(2000) for c in carry.read_checks(task.sft_response(38905, 4231, rng))
    ]
    assert abs(np.mean(checks) - 0.25) < 0.02
    assert all(carry.read_checks(task.sft_response(389, 42, rng, check_rate=1.0)))


def test_tokenizer_covers_every_solution_with_no_unknown_token():
    from magic_jax.jobs.carry_world import MAX_RESPONSE

    tok = carry.tokenizer()
    unk = tok.convert_tokens_to_ids("<unk>")
    rng = np.random.default_rng(5)
    longest = 0
    for a, b in carry.CarryTask().problems(300, rng):
        text = carry.solution(a, b, [True] * len(carry.columns(a, b)))
        ids = tok.encode(text, add_special_tokens=False)
        assert unk not in ids and tok.decode(ids) == text
        longest = max(longest, len(ids) + 1)
    assert longest <= MAX_RESPONSE


@pytest.mark.slow  # ~30 s: a few supervised steps, then held-out statistics
def test_build_world_writes_a_loadable_model_its_curve_and_statistics(tmp_path):
    from magic_jax.jobs.carry_world import WorldBuildConfig, build_carry_world
    from magic_jax.run.policy import load_policy

    cfg = WorldBuildConfig(balanced_steps=8, mixture_steps=8, batch=4, train_problems=16,
                           heldout_problems=8, eval_every=8, eval_samples=2,
                           eval_problems=4)  # fmt: skip
    info = build_carry_world(tmp_path / "w", cfg, log=lambda s: None)
    assert {p.name for p in (tmp_path / "w").iterdir()} >= {
        "model", "train.jsonl", "heldout.jsonl", "build.json"}  # fmt: skip
    assert len(info["evals"]) >= 2
    st = info["statistics"]
    assert st["samples"] == 8 * 8 and 0.0 <= st["accuracy"] <= 1.0
    assert st["entropy"] > 0.0 and 1 <= st["length"] <= 64
    assert sum(v["samples"] for v in st["by_carries"].values()) == st["samples"]
    rows = [r for r in (tmp_path / "w" / "heldout.jsonl").read_text().splitlines() if r]
    assert len(rows) == 8
    load_policy(str(tmp_path / "w" / "model"), "float32", None)
    with pytest.raises(FileExistsError, match="not a build of this command"):
        (tmp_path / "x").mkdir()
        (tmp_path / "x" / "keep.txt").write_text("mine")
        build_carry_world(tmp_path / "x", cfg, log=lambda s: None)
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"


def test_the_shipped_base_has_the_worlds_structure():
    """The base in magic_jax/assets/carry, as its build measured it (256 held-out x 8)."""
    import json

    from magic_jax.jobs.carry_world import CARRY_BUILD

    info = json.loads(CARRY_BUILD.read_text())
    st = info["statistics"]
    assert info["build"]["seed"] == 0 and st["samples"] == 256 * 8
    assert info["parameters"] < 1_000_000  # the model file stays small (< 20 MB)
    # the better strategy is rare: a quarter of the carry columns checked, few right answers
    assert 0.15 < st["check_rate_needed"] < 0.35 and 0.15 < st["accuracy"] < 0.3
    # hurrying is right with no carry and wrong with carries: headroom at every difficulty
    acc = {int(c): v["accuracy"] for c, v in st["by_carries"].items()}
    assert acc[0] > 0.9 and max(acc[c] for c in (2, 3, 4, 5)) < 0.05
    assert st["well_formed"] > 0.99 and st["truncated"] == 0.0


@pytest.mark.slow  # 8 s: samples the whole held-out set twice
def test_model_statistics_reads_a_saved_model_and_a_rows_file():
    import json

    from magic_jax.jobs.carry_world import CARRY_ASSETS, model_statistics

    rows = [json.loads(x) for x in (CARRY_ASSETS / "heldout.jsonl").read_text().splitlines()][:24]
    st = model_statistics(CARRY_ASSETS / "model", rows, num_samples=2, seed=3)
    assert st["samples"] == 48 and 0.0 <= st["accuracy"] <= 1.0
    assert st["well_formed"] > 0.9 and 18 <= st["length"] <= 64
    # entropy by token class: every response token counted once, the mean recovered
    by, n = st["entropy_by_class"], st["tokens_by_class"]
    assert sum(n.values()) == pytest.approx(st["length"] * 48)
    mean = sum(by[c] * n[c] for c in by if n[c]) / sum(n.values())
    assert mean == pytest.approx(st["entropy"], rel=1e-5) and by["choice"] > by["digit"]
    again = model_statistics(
        CARRY_ASSETS / "model", CARRY_ASSETS / "heldout.jsonl", num_samples=1, seed=3
    )
    assert again["samples"] == 256


@pytest.mark.slow  # ~4 min: the carry world's run as docs/carry-world.md gives it
def test_the_carry_run_as_written_climbs_from_the_base(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    exe = str(Path(sys.executable).with_name("magic-jax"))
    out = tmp_path / "carry"
    cmd = [exe, "train", "configs/carry.yaml", "--set", f"output_dir={out}"]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    before, after = evals[0]["accuracy"], evals[-1]["accuracy"]
    assert evals[-1]["step"] == 300 and after >= before + 0.15, (before, after)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # The controller acted and held entropy up: without a bonus late entropy falls to about
    # 0.02 (a quarter of the target); with it, 0.08-0.12 over 5 seeds (docs/carry-world.md).
    assert max(m["alpha"] for m in metrics) > 0.1
    late = [m["entropy"] for m in metrics[200:]]
    assert sum(late) / len(late) > 0.5 * 0.08, sum(late) / len(late)
