"""The carry world: its task (strategies, variants, difficulty) and its build's bookkeeping."""

import collections

import numpy as np
import pytest

from magic_jax.data.tasks import carry
from magic_jax.jobs.world import exact_count
from magic_jax.rewards import math_reward


def test_carries_and_the_hurried_sum():
    assert carry.carries(389, 423) == 2 and carry.hurried_sum(389, 423) == 702
    assert carry.carries(12, 34) == 0 and carry.hurried_sum(12, 34) == 46
    # the top column's carry out counts; a missing digit is 0
    assert carry.carries(95, 7) == 2 and carry.hurried_sum(95, 7) == 92
    assert carry.carries(50, 50) == 1 and carry.hurried_sum(50, 50) == 0
    rng = np.random.default_rng(0)
    for _ in range(2000):
        a, b = (int(x) for x in rng.integers(0, 100000, 2))
        assert (carry.hurried_sum(a, b) == a + b) == (carry.carries(a, b) == 0)


def test_solutions_in_both_strategies_and_variants():
    assert carry.checked_solution(389, 423, "a") == (
        "702?\n9+3=12\n8+2+1=11\n3+4+1=8\n=812\n</think>\n\\boxed{812}"
    )
    assert carry.checked_solution(389, 423, "b").split("\n")[1:4] == [
        "3+9=12",
        "2+8+1=11",
        "4+3+1=8",
    ]
    assert carry.quick_solution(389, 423, "a") == "</think>\n\\boxed{702}"
    assert carry.quick_solution(389, 423, "b") == "</think>\n389+423=702\n\\boxed{702}"
    with pytest.raises(ValueError, match="strategy"):
        carry.solution(1, 2, "guess", "a")


def test_the_verifier_rewards_checked_always_and_quick_exactly_without_carries():
    rng = np.random.default_rng(1)
    task = carry.CarryTask()
    for a, b in task.problems(150, rng):
        truth = str(a + b)
        for v in carry.VARIANTS:
            assert math_reward(carry.checked_solution(a, b, v), truth).reward == 1.0
            quick = math_reward(carry.quick_solution(a, b, v), truth).reward
            assert quick == float(carry.carries(a, b) == 0), (a, b, v)


def test_classify_reads_strategy_and_variant_back():
    rng = np.random.default_rng(2)
    for a, b in carry.CarryTask().problems(300, rng):
        for s in carry.STRATEGIES:
            for v in carry.VARIANTS:
                got = carry.classify_in(carry.solution(a, b, s, v), a, b)
                x, y, _ = carry.columns(a, b)[0]
                want = (s, "a") if (s == "checked" and x == y) else (s, v)
                assert got == want, (a, b, s, v, got)
    assert carry.classify("12?\n") == ("checked", "?")


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
    with pytest.raises(ValueError, match="checked_share"):
        carry.CarryTask(checked_share=2.0)


def test_sft_mixture_has_the_exact_share_per_step():
    counts = [exact_count(0.05, 32, k) for k in range(1000)]
    assert sum(counts) == 1600 and set(counts) == {1, 2}
    rng = np.random.default_rng(0)
    task = carry.CarryTask(checked_share=0.2)
    got = [carry.classify(task.sft_response(389, 423, rng))[0] for _ in range(4000)]
    assert abs(got.count("checked") / 4000 - 0.2) < 0.025


def test_tokenizer_covers_every_solution_with_no_unknown_token():
    tok = carry.tokenizer()
    unk = tok.convert_tokens_to_ids("<unk>")
    rng = np.random.default_rng(5)
    longest = 0
    for a, b in carry.CarryTask().problems(200, rng):
        for s in carry.STRATEGIES:
            text = carry.solution(a, b, s, "b")
            ids = tok.encode(text, add_special_tokens=False)
            assert unk not in ids and tok.decode(ids) == text
            longest = max(longest, len(ids) + 1)
    assert longest <= 75  # MAX_RESPONSE = 80 leaves room for every checked solution
