"""Math reward: Math-Verify on the answer region, gold wrapping, statuses and timeouts."""

import os
import threading
import time

import pytest
from conftest import reward_statuses

from magic_jax.rewards import (
    GroundTruthError,
    MathConfig,
    RewardResult,
    extract_answer_region,
    math_reward,
    parse_math_ground_truth,
    status_counts,
)

C, W, N, T, E = reward_statuses()
AIME24 = "/work/shared/data/skywork_or1_eval/aime24.parquet"

# (response, gold, expected status)
CASES = [
    # integers and leading zeros (AIME gold answers are zero-padded strings)
    ("The answer is \\boxed{204}.", "204", C),
    ("\\boxed{25}", "025", C),
    ("\\boxed{025}", "025", C),
    ("\\boxed{025}", "25", C),
    ("\\boxed{205}", "204", W),
    ("\\boxed{-204}", "204", W),
    # equivalent forms
    ("\\boxed{0.5}", "\\frac{1}{2}", C),
    ("\\boxed{\\frac12}", "0.5", C),
    ("\\boxed{\\dfrac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", C),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", C),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", C),
    ("\\boxed{x=3}", "3", C),
    ("\\boxed{10\\%}", "10", C),
    ("\\boxed{\\frac{1}{3}}", "0.34", W),
    # sets and intervals
    ("\\boxed{\\{1, 2, 3\\}}", "\\{3,2,1\\}", C),
    ("\\boxed{\\{1, 2\\}}", "\\{3,2,1\\}", W),
    ("\\boxed{(1, 2]}", "(1,2]", C),
    ("\\boxed{[1, 2]}", "(1,2]", W),
    ("\\boxed{1,2}", "1, 2", C),
    # degrees
    ("\\boxed{336}", "336^\\circ", C),
    ("\\boxed{336^{\\circ}}", "336^\\circ", C),
    ("\\boxed{336^\\circ}", "336", C),
    ("\\boxed{335^\\circ}", "336^\\circ", W),
    # no answer, empty box, answer only inside the reasoning
    ("I am not sure.", "204", N),
    ("\\boxed{}", "204", N),
    ("<think>so it is \\boxed{204}</think>", "204", N),
    ("<think>so it is \\boxed{204}</think>Final answer: none.", "204", N),
    ("<think>a very long reasoning that was truncated", "204", N),
    # the answer region is after the first </think>
    ("<think>maybe \\boxed{7}</think>The answer is \\boxed{204}", "204", C),
    ("<think>maybe \\boxed{204}</think>The answer is \\boxed{7}", "204", W),
    # several gold answers (JSON list): any match counts
    ("\\boxed{3}", '["3", "4"]', C),
    ("\\boxed{4}", '["3", "4"]', C),
    ("\\boxed{5}", '["3", "4"]', W),
    ("\\boxed{7}", '"7"', C),
]


@pytest.mark.parametrize(("response", "gold", "expected"), CASES)
def test_math_table(response, gold, expected):
    result = math_reward(response, gold)
    assert result.status is expected, result
    assert result.reward == (1.0 if expected is C else 0.0)


def test_answer_region():
    assert extract_answer_region("<think>a</think>b</think>c") == "b</think>c"
    assert extract_answer_region("no think tags") == "no think tags"
    assert extract_answer_region("<think>unfinished") == "<think>unfinished"


def test_ground_truth_forms():
    assert parse_math_ground_truth("025") == ["025"]
    assert parse_math_ground_truth("3.50") == ["3.50"]  # a JSON number keeps its text
    assert parse_math_ground_truth('["1", "2"]') == ["1", "2"]
    assert parse_math_ground_truth("[1, 2]") == ["[1, 2]"]  # an interval, not two answers
    assert parse_math_ground_truth(["336^\\circ"]) == ["336^\\circ"]
    assert parse_math_ground_truth(12) == ["12"]
    for bad in ("", "   ", [], {"a": 1}, None, ["1", 2.5j]):
        with pytest.raises(GroundTruthError):
            parse_math_ground_truth(bad)


def test_bad_gold_is_error_not_wrong():
    result = math_reward("\\boxed{1}", "")
    assert result.status is E and "empty" in result.detail
    result = math_reward("\\boxed{1}", {"answer": 1})
    assert result.status is E and "dict" in result.detail


def test_power_tower_ends_within_its_limit():
    start = time.monotonic()
    result = math_reward("\\boxed{9^{9^{9^{9}}}}", "204", config=MathConfig(verify_timeout_s=1))
    elapsed = time.monotonic() - start
    assert result.status in (T, W), result
    assert result.reward == 0.0
    assert elapsed < 4.0, elapsed


def test_non_main_thread_is_an_error_status():
    out = []
    thread = threading.Thread(target=lambda: out.append(math_reward("\\boxed{1}", "1")))
    thread.start()
    thread.join()
    assert out[0].status is E and "main thread" in out[0].detail


def test_result_reward_must_match_status():
    with pytest.raises(ValueError, match="does not match status"):
        RewardResult(reward=1.0, status=W)
    assert RewardResult.of(C).reward == 1.0
    counts = status_counts([RewardResult.of(C), RewardResult.of(T), RewardResult.of(T)])
    assert counts == {"correct": 1, "wrong": 0, "no_answer": 0, "timeout": 2, "error": 0}


def _long_cot(problem: str, final: str, *, inner: str = "") -> str:
    steps = "\n".join(f"Step {k}: consider the constraint again and simplify." for k in range(200))
    return f"{problem}\n<think>\n{steps}\nPerhaps \\boxed{{{inner or 1}}}?\n</think>\n\n{final}"


@pytest.mark.skipif(not os.path.exists(AIME24), reason="shared AIME24 data not present")
def test_real_aime24_gold_answers():
    pq = pytest.importorskip("pyarrow.parquet")
    rows = pq.read_table(AIME24).to_pylist()[:6]
    golds = [r["reward_model"]["ground_truth"] for r in rows]
    assert "025" in golds  # the zero-padded case is among the first rows
    for row, gold in zip(rows, golds):
        problem = row["prompt"][0]["content"]
        value = int(gold)
        right = _long_cot(problem, f"The answer is $\\boxed{{{value}}}$.", inner=str(value + 1))
        padded = _long_cot(problem, f"So the answer is \\boxed{{{gold}}}.")
        wrong = _long_cot(problem, f"Thus \\boxed{{{value + 1}}}.", inner=str(value))
        silent = _long_cot(problem, "I could not finish.", inner=str(value))
        assert math_reward(right, gold).status is C, gold
        assert math_reward(padded, gold).status is C, gold
        assert math_reward(wrong, gold).status is W, gold
        assert math_reward(silent, gold).status is N, gold


def _integer_cases():
    """Responses around the integer fast path: lone boxes, leading zeros, signs, extra text."""
    import random

    rng = random.Random(0)
    cases = []
    for _ in range(400):
        gold = str(rng.choice([0, 7, 42, 936, 10**5 + 3, -12, rng.randrange(-999, 99999)]))
        near = rng.choice([gold, str(int(gold) + 1), "0" + gold.lstrip("-"), "-" + gold, "-0"])
        region = rng.choice(
            [
                f"\\boxed{{{near}}}",
                f"\n  \\boxed{{{near}}}\n",
                f"The answer is \\boxed{{{near}}}.",
                f"\\boxed{{{near}}} and \\boxed{{{gold}}}",
                f"\\boxed{{{near}.0}}",
                f"$\\boxed{{{near}}}$",
            ]
        )
        think = rng.choice(["<think>\n1+2=3\n</think>\n", "<think>\\boxed{5}</think>", ""])
        golds = rng.choice([gold, f'["{gold}", "{near}"]', f"0{gold.lstrip('-')}"])
        cases.append((think + region, golds))
    return cases


def test_integer_fast_path_agrees_with_math_verify(monkeypatch):
    """Wherever ``integer_verdict`` decides, Math-Verify (the fast path switched off)
    gives the same status; and it does decide the shipped tasks' answer format."""
    import importlib

    mr = importlib.import_module("magic_jax.rewards.math_reward")
    cases = _integer_cases()
    verdict_of = mr.integer_verdict
    fast = [verdict_of(r, g) for r, g in cases]
    assert verdict_of("<think>\n4+8+1=13\n</think>\n\\boxed{936}", "936").status == C
    assert verdict_of("<think>x</think>\\boxed{0936}", "936") is None  # leading zero
    assert verdict_of("<think>x</think>\\boxed{7} or 8", "7") is None  # more text
    assert verdict_of("<think>x</think>\\boxed{7}", "7.0") is None  # gold not integer
    monkeypatch.setattr(mr, "_integer_verdict", lambda *_: None)
    decided = 0
    for (response, gold), verdict in zip(cases, fast):
        if verdict is None:
            continue
        decided += 1
        full = mr.math_reward(response, gold)
        assert (verdict.status, verdict.reward) == (full.status, full.reward), (response, gold)
    assert decided >= 40
    both = {v.status for v in fast if v is not None}
    assert both == {C, W}
