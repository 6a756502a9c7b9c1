"""Evaluation: n sampled responses per problem scored by the verifiers; avg@n and pass@k.

The report's protocol (SPEC item 13): temperature 1, top-p 1, n samples per
problem, accuracy averaged over all of them (avg@n), with pass@k for k = 1, 2,
4, ..., n from the unbiased estimator. Responses come from the same
continuous-batching engine as training, rewards from the verifier pool (or in
process when no pool is given). The trainer's in-run evaluation
(``evaluate``) and the ``magic-jax eval`` command (``magic_jax.jobs.eval``)
both score problems with ``score_problems`` and tabulate with ``summarize``,
so they report the same numbers for the same inputs.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from magic_jax.data.rows import PromptRow, tokenize_rows

if TYPE_CHECKING:
    from magic_jax.rollout.protocols import Driver, Params, Tokenizer, Verifiers

# a result as JSON (a problem's line, a data set's summary table)
JSON = dict[str, object]

# Evaluation draws its samples from its own stream, apart from training steps.
EVAL_SEED_OFFSET = 1_000_003


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: ``1 - C(n-c, k) / C(n, k)``.

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``, which never forms the
    binomials (they overflow floats from n of about 1000).

    Raises:
      ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def k_values(n: int) -> list[int]:
    """The k of the pass@k table: 1, 2, 4, ... below n, then n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def eval_seed(seed: int, chunk: int = 0) -> int:
    """The sampling seed of chunk ``chunk`` of an evaluation (chunk 0: the trainer's)."""
    return seed + EVAL_SEED_OFFSET + chunk


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProblemResult:
    """The n scored samples of one problem.

    Attributes:
      index: the problem's position in its data set.
      uid / data_source: from the row.
      rewards / statuses / lengths / truncated: per sample, in sample order
        (reward in [0, 1]: 0 or 1 from the built-in verifiers, partial credit from a
        registered reward; ``RewardStatus`` value, response tokens, no EOS within
        the limit).
      responses: the decoded responses, when kept.
    """

    index: int
    uid: str
    data_source: str
    rewards: tuple[float, ...]
    statuses: tuple[str, ...]
    lengths: tuple[int, ...]
    truncated: tuple[bool, ...]
    responses: tuple[str, ...] | None = None

    @property
    def correct(self) -> int:
        """Samples with full credit (reward 1): pass@k's c and the difficulty count."""
        return int(sum(r >= 1.0 for r in self.rewards))

    def to_json(self) -> JSON:
        """One JSON line of the per-problem output."""
        samples = [
            {"reward": r, "status": s, "length": n, "truncated": t}
            for r, s, n, t in zip(self.rewards, self.statuses, self.lengths, self.truncated)
        ]
        if self.responses is not None:
            for s, text in zip(samples, self.responses):
                s["response"] = text
        return {
            "index": self.index,
            "uid": self.uid,
            "data_source": self.data_source,
            "n": len(self.rewards),
            "correct": self.correct,
            "samples": samples,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, object]) -> ProblemResult:
        line: dict[str, Any] = dict(d)  # to_json's line: its values read as written
        s = line["samples"]
        texts = tuple(x["response"] for x in s) if s and "response" in s[0] else None
        return cls(
            index=int(line["index"]),
            uid=line["uid"],
            data_source=line["data_source"],
            rewards=tuple(float(x["reward"]) for x in s),
            statuses=tuple(x["status"] for x in s),
            lengths=tuple(int(x["length"]) for x in s),
            truncated=tuple(bool(x["truncated"]) for x in s),
            responses=texts,
        )


def score_problems(
    driver: Driver,
    params: Params,
    rows: Sequence[PromptRow],
    tokenizer: Tokenizer,
    *,
    num_samples: int,
    seed: int,
    step: int = 0,
    indices: Sequence[int] | None = None,
    max_new_tokens: int | None = None,
    pool: Verifiers | None = None,
    keep_responses: bool = False,
) -> list[ProblemResult]:
    """Samples ``num_samples`` responses per problem and verifies them (``scoring.score_groups``).

    Args:
      driver: a ``RolloutDriver`` (its engine's sampling settings apply).
      params: parameters in the engine's layout.
      rows: the problems, tokenised (``data.tokenize_rows``).
      tokenizer: decodes responses.
      num_samples: n.
      seed / step: sampling keys.
      indices: each row's position in its data set (default 0, 1, ...).
      max_new_tokens: response limit (default: the engine's).
      pool: a ``VerifierPool``; None verifies in this process.
      keep_responses: keep the decoded texts in the results.

    Returns:
      One ``ProblemResult`` per row, in order.
    """
    import jax

    from magic_jax.rollout.scoring import Scoring, score_groups

    if indices is None:
        indices = range(len(rows))
    # A multi-host job: every process holds all ``rows``, passes its contiguous share,
    # and gets every row's group back (``Scoring.per_host``), in order.
    hosts, host = jax.process_count(), jax.process_index()
    if hosts > 1 and keep_responses:
        raise ValueError("keeping the responses is not supported on a multi-host job yet")
    share = rows[len(rows) * host // hosts : len(rows) * (host + 1) // hosts]
    groups, _, _ = score_groups(
        driver,
        params,
        share,
        Scoring(tokenizer, pool, keep_texts=keep_responses, per_host=hosts > 1),
        num_samples=num_samples,
        seed=seed,
        step=step,
        max_new_tokens=max_new_tokens,
    )
    return [
        ProblemResult(
            index=int(i),
            uid=row.uid,
            data_source=row.data_source,
            rewards=tuple(float(r) for r in g.rewards),
            statuses=tuple(r.status.value for r in g.results or ()),
            lengths=tuple(int(s.length) for s in g.samples),
            truncated=tuple(bool(s.truncated) for s in g.samples),
            responses=None if g.texts is None else tuple(g.texts),
        )
        for i, row, g in zip(indices, rows, groups)
    ]


def summarize(problems: Sequence[ProblemResult]) -> JSON:
    """The summary table of one data set.

    Args:
      problems: scored problems, all with the same n (> 0).

    Returns:
      ``problems``, ``num_samples`` (n), ``accuracy`` (avg@n, the mean reward
      over all samples: partial credit counts as its fraction), ``accuracy_stderr``
      (standard error over problems), ``pass_at_k`` (``{k: unbiased pass@k averaged
      over problems}`` for k in ``k_values(n)``, a pass being a full-credit sample),
      ``response_length_mean``, ``response_length_max``,
      ``truncated_fraction`` and ``reward_status`` (samples per status).

    Raises:
      ValueError: no problems, or problems with different n.
    """
    from magic_jax.rewards import RewardStatus

    if not problems:
        raise ValueError("summarize: no problems")
    ns = {len(p.rewards) for p in problems}
    if len(ns) != 1 or 0 in ns:
        raise ValueError(f"summarize: every problem needs the same n > 0, got {sorted(ns)}")
    (n,) = ns
    reward_PN = np.asarray([p.rewards for p in problems], np.float64)
    lengths = np.asarray([p.lengths for p in problems], np.float64)
    per_problem = reward_PN.mean(axis=1)
    stderr = per_problem.std(ddof=1) / np.sqrt(len(problems)) if len(problems) > 1 else 0.0
    counts = collections.Counter(s for p in problems for s in p.statuses)
    status = {s.value: counts.pop(s.value, 0) for s in RewardStatus}
    status.update(counts)
    return {
        "problems": len(problems),
        "num_samples": n,
        "accuracy": float(reward_PN.mean()),
        "accuracy_stderr": float(stderr),
        "pass_at_k": {
            str(k): float(np.mean([pass_at_k(n, p.correct, k) for p in problems]))
            for k in k_values(n)
        },
        "response_length_mean": float(lengths.mean()),
        "response_length_max": int(lengths.max()),
        "truncated_fraction": float(np.mean([p.truncated for p in problems])),
        "reward_status": status,
    }


def format_summary(name: str, summary: Mapping[str, object]) -> str:
    """A data set's summary as aligned text lines."""
    table: dict[str, Any] = dict(summary)  # summarize's JSON: its values read as written
    n = table["num_samples"]
    statuses = ", ".join(f"{k} {v}" for k, v in table["reward_status"].items() if v)
    skipped = table.get("skipped_long_prompts", 0)
    lines = [
        f"{name}: {table['problems']} problems, n = {n}"
        + (f" ({skipped} skipped: prompt too long)" if skipped else ""),
        f"  avg@{n:<8} {table['accuracy']:.4f} +- {table['accuracy_stderr']:.4f}",
    ]
    lines += [f"  pass@{k:<7} {v:.4f}" for k, v in table["pass_at_k"].items()]
    lines += [
        f"  length     mean {table['response_length_mean']:.1f}, "
        f"max {table['response_length_max']} tokens",
        f"  truncated  {100 * table['truncated_fraction']:.2f}%",
        f"  statuses   {statuses}",
    ]
    return "\n".join(lines)


def evaluate(
    driver: Driver,
    params: Params,
    rows: Sequence[PromptRow],
    tokenizer: Tokenizer,
    *,
    num_samples: int,
    max_prompt_length: int,
    max_new_tokens: int | None = None,
    seed: int = 0,
    step: int = 0,
    pool: Verifiers | None = None,
) -> JSON:
    """The trainer's in-run evaluation: every row scored in one batch, then ``summarize``.

    Args:
      driver: a ``RolloutDriver`` (its engine's sampling settings apply).
      params: parameters in the engine's layout.
      rows: the evaluation problems; those without ``token_ids`` are tokenised
        here (a job that evaluates often tokenises them once, ``data.tokenize_rows``).
      tokenizer: a Hugging Face tokenizer (or anything ``encode_prompts`` takes,
        with ``decode``).
      num_samples: n of avg@n.
      max_prompt_length: longer prompts are left out (and counted).
      max_new_tokens: response limit (default: the engine's).
      seed / step: sampling keys (``eval_seed(seed)``, apart from training's).
      pool: a ``VerifierPool``; None verifies in this process (main thread).

    Returns:
      ``summarize``'s table plus ``pass_at_n``, ``by_source`` (avg@n per
      ``data_source``) and ``skipped_long_prompts``.
    """
    given = len(rows)
    if any(r.token_ids is None for r in rows):
        rows, kept = tokenize_rows(rows, tokenizer, max_prompt_length=max_prompt_length)
    else:
        rows, kept = list(rows), list(range(len(rows)))
    if not kept:
        raise ValueError("evaluate: no problem fits max_prompt_length")
    problems = score_problems(
        driver,
        params,
        rows,
        tokenizer,
        num_samples=num_samples,
        seed=eval_seed(seed),
        step=step,
        indices=kept,
        max_new_tokens=max_new_tokens,
        pool=pool,
    )
    table: dict[str, Any] = summarize(problems)
    by_source: dict[str, list[float]] = collections.defaultdict(list)
    for p in problems:
        by_source[p.data_source].extend(p.rewards)
    return {
        **table,
        "pass_at_n": table["pass_at_k"][str(num_samples)],
        "by_source": {k: float(np.mean(v)) for k, v in sorted(by_source.items())},
        "skipped_long_prompts": given - len(kept),
    }
