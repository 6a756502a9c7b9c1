"""The embedded default task, the SFT warm-up and avg@n evaluation."""

import numpy as np
import pytest
from flax import nnx

from magic_jax.data.rows import parse_row, render_r1
from magic_jax.data.tasks import addition
from magic_jax.model.config import ModelConfig
from magic_jax.model.qwen2 import Qwen2
from magic_jax.rewards import math_reward
from magic_jax.rollout.evaluate import evaluate
from magic_jax.rollout.samples import Sample
from magic_jax.update.sft import SFTConfig, SFTTrainer, pack_sft, sft_loss


def test_worked_solution_carries_column_by_column():
    assert addition.worked_solution(39, 25) == "9+5=14\n3+2+1=6\n</think>\n\\boxed{64}"
    # a missing digit is 0; the last carry shows only in the sum
    assert addition.worked_solution(95, 7) == "5+7=12\n9+0+1=10\n</think>\n\\boxed{102}"


def test_quick_solution_guesses_digits():
    rng = np.random.default_rng(0)
    texts = [addition.quick_solution(23, 589, rng) for _ in range(200)]
    assert all(t.startswith("</think>\n\\boxed{") and len(t) == len("</think>\n\\boxed{123}")
               for t in texts)  # fmt: skip
    guesses = [int(t[len("</think>\n\\boxed{") : -1]) for t in texts]
    assert min(guesses) >= 100 and max(guesses) <= 999 and len(set(guesses)) > 100
    assert math_reward(f"</think>\n\\boxed{{{612}}}", "612").reward == 1.0


def test_supervised_styles_mix_in_the_set_proportion():
    task = addition.AdditionTask(worked_share=0.3)
    rng = np.random.default_rng(0)
    styles = [task.sft_response(12, 79, rng).startswith("</think>") for _ in range(4000)]
    assert abs(np.mean(styles) - 0.7) < 0.03
    # supervised batches: the exact proportion, no batch-to-batch sampling noise
    counts = [task.worked_in_batch(k, 32) for k in range(1000)]
    assert set(counts) == {9, 10} and sum(counts) == 9600
    with pytest.raises(ValueError, match="worked_share"):
        addition.AdditionTask(worked_share=1.5)


def test_problems_are_distinct_and_exclude_a_held_out_set():
    held = addition.verl_rows(200, seed=1)
    held_set = {addition.row_problem(r) for r in held}
    assert len(held_set) == 200
    task = addition.AdditionTask(min_digits=1, max_digits=1)  # only 100 problems exist
    got = task.problems(60, np.random.default_rng(0), exclude=[(1, 2), (3, 4)])
    assert len(set(got)) == 60 and (1, 2) not in got and (3, 4) not in got


def test_solutions_score_and_tokenize_exactly():
    tok = addition.tokenizer()
    rng = np.random.default_rng(0)
    task = addition.AdditionTask()
    lengths = []
    for _ in range(50):
        a, b = task.sample(rng)
        assert 10 <= a < 100_000 and 10 <= b < 100_000
        sol = addition.worked_solution(a, b)
        assert math_reward(sol, str(a + b)).reward == 1.0
        assert math_reward(sol, str(a + b + 1)).reward == 0.0
        ids = tok.encode(sol, add_special_tokens=False)
        assert tok.unk_token_id not in ids and tok.decode(ids) == sol
        lengths.append(len(ids) + 1)  # + EOS
        quick = tok.encode(addition.quick_solution(a, b, rng), add_special_tokens=False)
        assert 12 <= len(quick) + 1 <= 16
    # the worked style grows with the columns: stage 1's T = 44 cuts the longest
    assert min(lengths) >= 25 and max(lengths) <= 60 and np.mean(np.array(lengths) > 44) > 0.3


def test_verl_rows_parse_and_are_reproducible():
    rows = addition.verl_rows(5, seed=3)
    assert rows == addition.verl_rows(5, seed=3) and rows != addition.verl_rows(5, seed=4)
    parsed = [parse_row(r, f"x:{i}", f"x:{i}") for i, r in enumerate(rows)]
    a, b = rows[2]["extra_info"]["a"], rows[2]["extra_info"]["b"]
    assert parsed[2].ground_truth == str(a + b) and parsed[2].uid == "addition:2"
    with pytest.raises(ValueError, match="min_digits"):
        addition.AdditionTask(min_digits=3, max_digits=2)


TINY = ModelConfig(
    vocab_size=29, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2
)


def test_pack_sft_masks_response_targets():
    b = pack_sft([np.array([1, 2, 3]), np.array([4])], [np.array([7, 8]), np.array([9, 9, 9])])
    assert b["tokens"].shape == (2, 32)
    np.testing.assert_array_equal(b["tokens"][0, :5], [1, 2, 3, 7, 8])
    # position t predicts token t + 1: the response starts at index 3 (row 0), 1 (row 1)
    np.testing.assert_array_equal(np.flatnonzero(b["loss_mask"][0]), [2, 3])
    np.testing.assert_array_equal(np.flatnonzero(b["loss_mask"][1]), [0, 1, 2])
    np.testing.assert_array_equal(b["attention_mask"].sum(1), [5, 4])
    with pytest.raises(ValueError, match="length 4"):
        pack_sft([np.array([1, 2, 3])], [np.array([7, 8])], length=4)


def test_sft_loss_matches_numpy():
    model = Qwen2(TINY, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 29, n) for n in (3, 6)]
    responses = [rng.integers(3, 29, n) for n in (5, 2)]
    batch = pack_sft(prompts, responses, bucket=8)
    graphdef, params = nnx.split(model, nnx.Param)
    loss, _ = sft_loss(params, batch, graphdef=graphdef, chunk=4)
    logits = np.asarray(model(batch["tokens"], attention_mask=batch["attention_mask"]), np.float64)
    z = logits - logits.max(-1, keepdims=True)
    logq = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        for j in range(len(r)):
            t = len(p) + j
            want.append(-logq[i, t - 1, batch["tokens"][i, t]])
    np.testing.assert_allclose(float(loss), np.mean(want), rtol=1e-5)


def test_sft_memorises_a_batch():
    model = Qwen2(TINY, rngs=nnx.Rngs(1))
    graphdef, params = nnx.split(model, nnx.Param)
    sft = SFTTrainer(graphdef, params, SFTConfig(learning_rate=1e-2, warmup_steps=2))
    rng = np.random.default_rng(1)
    batch = pack_sft(
        [rng.integers(3, 29, 4) for _ in range(8)], [rng.integers(3, 29, 6) for _ in range(8)]
    )
    losses = [sft.step(batch)["loss"] for _ in range(40)]
    assert losses[-1] < 0.3 * losses[0], losses


class _ScriptedDriver:
    """Returns fixed responses, as a RolloutDriver would."""

    def __init__(self, tok, texts):
        self.tok, self.texts = tok, texts

    def run(self, params, prompts, *, num_samples, **kw):
        out = []
        for p in range(len(prompts)):
            for j in range(num_samples):
                ids = np.asarray(self.tok.encode(self.texts[p][j], add_special_tokens=False))
                out.append(
                    Sample(
                        prompt_index=p,
                        sample_index=j,
                        prompt_tokens=prompts[p],
                        tokens=ids.astype(np.int32),
                        logprobs=np.zeros(len(ids), np.float32),
                        entropies=np.zeros(len(ids), np.float32),
                        sampling_logprobs=np.zeros(len(ids), np.float32),
                        truncated=j == 2,
                        length=len(ids),
                        finish_reason="length" if j == 2 else "eos",
                    )
                )
                kw["on_sample"](out[-1])
        return out, None


def test_evaluate_reports_avg_and_pass_at_n():
    tok = addition.tokenizer()
    rows = [parse_row(r, "e", f"e{i}") for i, r in enumerate(addition.verl_rows(3, seed=0))]
    gold = [r.ground_truth for r in rows]
    texts = [
        [f"</think>\\boxed{{{gold[0]}}}"] * 3,  # 3 of 3
        ["</think>\\boxed{0}", f"</think>\\boxed{{{gold[1]}}}", "1+1"],  # 1 of 3
        ["</think>\\boxed{0}"] * 3,  # 0 of 3
    ]
    long_row = parse_row(
        addition.verl_rows(1, seed=9, task=addition.AdditionTask(min_digits=5))[0]
        | {"prompt": [{"role": "user", "content": "1" * 40}]},
        "e",
        "long",
    )
    out = evaluate(
        _ScriptedDriver(tok, texts),
        None,
        [*rows, long_row],
        tok,
        num_samples=3,
        max_prompt_length=len(tok.encode(render_r1(rows[0].messages))) + 8,
    )
    assert out["accuracy"] == pytest.approx(4 / 9)
    assert out["pass_at_n"] == pytest.approx(2 / 3)
    assert out["problems"] == 3 and out["skipped_long_prompts"] == 1
    assert out["truncated_fraction"] == pytest.approx(1 / 3)
    assert out["reward_status"]["correct"] == 4


def test_saved_task_tokenizer_loads_back_exactly(tmp_path):
    """Beside a Qwen2 config.json, AutoTokenizer would substitute Qwen2's own class."""
    import json

    from magic_jax.run.policy import load_tokenizer

    tok = addition.tokenizer()
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    back = load_tokenizer(tmp_path)
    text = render_r1([{"role": "user", "content": "12+34"}]) + addition.worked_solution(12, 34)
    ids = tok.encode(text, add_special_tokens=False)
    assert back.encode(text, add_special_tokens=False) == ids
    assert back.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)
    assert (back.eos_token_id, back.pad_token_id, len(back)) == (2, 0, len(tok))
