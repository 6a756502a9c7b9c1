"""avg@n evaluation: n sampled responses per problem, scored with the training reward.

The report's protocol (SPEC item 13): temperature 1, top-p 1, n samples per
problem, accuracy averaged over all of them (avg@n); pass@n is reported too.
Responses come from the same continuous-batching engine as training, rewards
from the verifier pool (or in-process when no pool is given).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import numpy as np

from magic_jax.data import PromptRow, encode_prompts

# Evaluation draws its samples from its own stream, apart from training steps.
EVAL_SEED_OFFSET = 1_000_003


def evaluate(
    driver: Any,
    params: Any,
    rows: Sequence[PromptRow],
    tokenizer: Any,
    *,
    num_samples: int,
    max_prompt_length: int,
    max_new_tokens: int | None = None,
    seed: int = 0,
    step: int = 0,
    pool: Any = None,
) -> dict[str, Any]:
    """Samples ``num_samples`` responses per row and scores them.

    Args:
      driver: a ``RolloutDriver`` (its engine's sampling settings apply).
      params: parameters in the engine's layout.
      rows: the evaluation problems.
      tokenizer: a Hugging Face tokenizer (or anything ``encode_prompts`` takes,
        with ``decode``).
      num_samples: n of avg@n.
      max_prompt_length: longer prompts are left out (and counted).
      max_new_tokens: response limit (default: the engine's).
      seed / step: sampling keys (offset from the training stream).
      pool: a ``VerifierPool``; None verifies in this process (main thread).

    Returns:
      ``accuracy`` (avg@n), ``pass_at_n``, ``by_source`` (avg@n per
      ``data_source``), ``truncated_fraction``, ``response_length_mean``,
      ``problems``, ``skipped_long_prompts``, ``num_samples``, ``reward_status``.
    """
    from magic_jax.rewards import RewardItem, compute_reward, status_counts

    n_in = len(rows)
    ids, kept = encode_prompts(rows, tokenizer, max_prompt_length=max_prompt_length)
    rows = [rows[i] for i in kept]
    if not rows:
        raise ValueError("evaluate: no problem fits max_prompt_length")
    samples, _ = driver.run(
        params,
        ids,
        num_samples=num_samples,
        seed=seed + EVAL_SEED_OFFSET,
        step=step,
        max_new_tokens=max_new_tokens,
    )
    items = [
        RewardItem.from_row(
            rows[s.prompt_index].as_verl_row(),
            tokenizer.decode(s.tokens, skip_special_tokens=True),
        )
        for s in samples
    ]
    results = pool.map(items) if pool is not None else [compute_reward(i) for i in items]
    reward = np.asarray([r.reward for r in results], np.float32).reshape(len(rows), num_samples)
    by_source: dict[str, list[float]] = collections.defaultdict(list)
    for row, r in zip(rows, reward):
        by_source[row.data_source].extend(r.tolist())
    return {
        "accuracy": float(reward.mean()),
        "pass_at_n": float((reward.max(axis=1) > 0).mean()),
        "by_source": {k: float(np.mean(v)) for k, v in sorted(by_source.items())},
        "truncated_fraction": float(np.mean([s.truncated for s in samples])),
        "response_length_mean": float(np.mean([s.length for s in samples])),
        "problems": len(rows),
        "skipped_long_prompts": n_in - len(rows),
        "num_samples": num_samples,
        "reward_status": status_counts(results),
    }
