"""Evaluation probes by name: exact measures of the policy taken at every evaluation.

A probe is ``fn(context) -> {figure: value}``, run by the trainer's evaluation when
``eval.probe`` names it, its figures recorded under ``probe`` in ``eval.jsonl``. The
built-in ``lockout`` probe measures whether a run of the lock-out world
(``magic_jax.data.tasks.lockout``) can still sample the better strategy: the exact
probability, by teacher forcing, that the policy writes the full check of each
held-out chain problem, and how many such samples a training step should draw; the
built-in ``decision`` probe reads the decision world's exact P(``<check>``) at each
line of the full check (``magic_jax.data.tasks.decision``). ``register_probe`` adds
others (from a config's ``extensions`` module).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from magic_jax.data.rows import PromptRow
from magic_jax.registry import Registry
from magic_jax.rollout.protocols import Driver, Params, Tokenizer, Verifiers

# Teacher-forced sequences are padded to a multiple of this length (few compiled shapes).
_LENGTH_BUCKET = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeContext:
    """What a probe sees at an evaluation.

    Attributes:
      graphdef / params: the policy (``nnx.split(model, nnx.Param)``).
      rows: the evaluation problems, tokenised (``PromptRow.token_ids``).
      tokenizer: encodes response texts.
      eos_ids: the model's end-of-sequence ids (a response ends at one of them).
      temperature: the rollouts' sampling temperature (the distribution probed:
        the full one, before any top-k or top-p).
      samples_per_step: prompts x G of a training step (the stage after the evaluation).
      driver / driver_params: the evaluation's engine and the policy in its layout, for
        probes that sample (None: the probe only teacher-forces).
      num_samples / seed / step: the evaluation's samples per problem, the run's seed and
        the step (a probe that samples with ``eval_seed(seed)`` and ``step`` draws the
        evaluation's own samples).
      final: the run's last evaluation.
      pool: the verifier pool (None: verify in this thread).
    """

    graphdef: nnx.GraphDef
    params: Params
    rows: Sequence[PromptRow]
    tokenizer: Tokenizer
    eos_ids: tuple[int, ...]
    temperature: float = 1.0
    samples_per_step: int = 0
    driver: Driver | None = None
    driver_params: Params | None = None
    num_samples: int = 0
    seed: int = 0
    step: int = 0
    final: bool = False
    pool: Verifiers | None = None


ProbeFn = Callable[[ProbeContext], dict[str, object]]


@functools.partial(jax.jit, static_argnums=0)
def _token_logprobs(graphdef, params, ids_BL, mask_BL, temperature):
    """[B, L] log-prob of each token given the ones before it (position 0: 0)."""
    logits_BLV = nnx.merge(graphdef, params)(ids_BL, attention_mask=mask_BL)
    logp_BLV = jax.nn.log_softmax(logits_BLV[:, :-1].astype(jnp.float32) / temperature, axis=-1)
    logp_BL = jnp.take_along_axis(logp_BLV, ids_BL[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(logp_BL, ((0, 0), (1, 0)))


def token_logprobs(
    graphdef: nnx.GraphDef,
    params: Params,
    prompts: Sequence[np.ndarray],
    responses: Sequence[Sequence[int]],
    *,
    temperature: float = 1.0,
) -> np.ndarray:
    """[n, width] float64: the log-prob of each response token given the prompt and the
    tokens before it, by teacher forcing at ``temperature``, at its position in the
    prompt-then-response row (0 at the prompt's positions and the padding). One forward
    pass over every pair, right-padded.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts, {len(responses)} responses")
    if not prompts:
        return np.zeros((0, 0), np.float64)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    width = _LENGTH_BUCKET * math.ceil(max(lengths) / _LENGTH_BUCKET)
    ids = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    scored = np.zeros((len(prompts), width), bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, : lengths[i]] = np.concatenate([np.asarray(p), np.asarray(r)]).astype(np.int32)
        mask[i, : lengths[i]] = 1
        scored[i, len(p) : lengths[i]] = True
    logp = _token_logprobs(graphdef, params, ids, mask, jnp.float32(temperature))
    return np.where(scored, np.asarray(logp, np.float64), 0.0)


def sequence_logprobs(
    graphdef: nnx.GraphDef,
    params: Params,
    prompts: Sequence[np.ndarray],
    responses: Sequence[Sequence[int]],
    *,
    temperature: float = 1.0,
) -> np.ndarray:
    """log P(response | prompt) under the policy at ``temperature``, by teacher forcing.

    The sum over the response's tokens of their log-probs given the prompt and the
    tokens before them (float64 [n]); each response as given (its EOS included if it
    has one). One forward pass over every pair, right-padded (``token_logprobs``).
    """
    return token_logprobs(graphdef, params, prompts, responses, temperature=temperature).sum(1)


def response_ids(tokenizer: Tokenizer, text: str, eos_ids: Sequence[int]) -> list[int]:
    """A response text's tokens as sampled: the text, then an EOS unless it ends with one."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids or ids[-1] not in eos_ids:
        ids.append(int(eos_ids[0]))
    return ids


# Samples per problem of the lock-out probe's sample statistics at a run's last evaluation
# (pass@k up to k = 64).
FINAL_SAMPLES = 64
# Sample texts the probe keeps per evaluation (the first chain and plain problems' first).
EXAMPLES = 2


def _mean(x: Sequence[float]) -> float:
    return float(np.mean(x)) if len(x) else float("nan")


def lockout_samples(ctx: ProbeContext, num_samples: int) -> dict[str, object]:
    """The lock-out world's figures of the policy's own samples (``num_samples`` per held-out
    problem, the evaluation's sampling keys): strategy shares, entropy by token class and by
    position, pass@k, and a few sample texts.

    Returns:
      ``samples``; ``check_rate_chain`` / ``check_rate_plain`` (columns checked, well-formed
      responses), ``check_rate_by_column`` (chains, right to left), ``full_check`` (chain
      samples checking every column), ``well_formed``; ``entropy_by_class`` (mean token
      entropy per ``carry.TOKEN_CLASSES`` class, NaN for a class with no token) and
      ``tokens_by_class``; ``entropy_by_position`` (mean entropy at each response position);
      ``pass_at_k_chain`` / ``pass_at_k_plain`` (k = 1, 2, 4 ... ``num_samples``);
      ``examples`` (``EXAMPLES`` texts of each half, with their rewards).
    """
    from magic_jax.data.tasks import carry, lockout
    from magic_jax.data.tasks.vocab import TokenPieces
    from magic_jax.rollout.evaluate import eval_seed, k_values, pass_at_k
    from magic_jax.rollout.scoring import Scoring, score_groups

    assert ctx.driver is not None and ctx.driver_params is not None, "a probe that samples"
    groups, _, _ = score_groups(
        ctx.driver,
        ctx.driver_params,
        list(ctx.rows),
        Scoring(ctx.tokenizer, ctx.pool, keep_texts=True),
        num_samples=num_samples,
        seed=eval_seed(ctx.seed),
        step=ctx.step,
    )
    checks: dict[str, list] = {"chain": [], "plain": [], "full": [], "formed": []}
    by_column: list[list[bool]] = [[] for _ in range(lockout.DIGITS)]
    ent: dict[str, list[float]] = {c: [] for c in carry.TOKEN_CLASSES}
    pos: list[list[float]] = []
    passed: dict[str, list[int]] = {"chain": [], "plain": []}
    examples: list[dict[str, object]] = []
    pieces = TokenPieces(ctx.tokenizer.decode)
    for row, g in zip(ctx.rows, groups):
        half = "chain" if lockout.probe_target(row) is not None else "plain"
        passed[half].append(sum(float(r) >= 1.0 for r in g.rewards))
        assert g.texts is not None, "Scoring(keep_texts=True) keeps them"
        for s, text in zip(g.samples, g.texts):
            read = carry.read_checks(text)
            formed = read is not None and len(read) == lockout.DIGITS
            checks["formed"].append(formed)
            if read is not None and formed:
                checks[half].extend(read)
                if half == "chain":
                    checks["full"].append(all(read))
                    for col, c in zip(by_column, read):
                        col.append(c)
            classes = carry.token_classes(pieces(s.tokens[: s.length]))
            for i, (token_class, e) in enumerate(zip(classes, s.entropies)):
                ent[token_class].append(float(e))
                pos.extend([] for _ in range(i + 1 - len(pos)))
                pos[i].append(float(e))
        if sum(x["half"] == half for x in examples) < EXAMPLES:
            examples.append({"half": half, "text": g.texts[0], "reward": float(g.rewards[0])})
    pass_at = {
        f"pass_at_k_{h}": {
            str(k): _mean([pass_at_k(num_samples, c, k) for c in v]) for k in k_values(num_samples)
        }
        if v
        else {}
        for h, v in passed.items()
    }
    return {
        "samples": len(checks["formed"]),
        "check_rate_chain": _mean(checks["chain"]),
        "check_rate_plain": _mean(checks["plain"]),
        "check_rate_by_column": [_mean(c) for c in by_column],
        "full_check": _mean(checks["full"]),
        "well_formed": _mean(checks["formed"]),
        "entropy_by_class": {c: _mean(v) for c, v in ent.items()},
        "tokens_by_class": {c: len(v) for c, v in ent.items()},
        "entropy_by_position": [round(_mean(v), 5) for v in pos],
        **pass_at,
        "examples": examples,
    }


def lockout_probe(ctx: ProbeContext) -> dict[str, object]:
    """The lock-out world's probe: can the policy still sample the full check of a chain?

    Returns:
      ``problems`` (held-out chain problems probed), ``p_mean`` (the mean over them
      of the exact probability of the full check at the rollout temperature),
      ``p_median``, ``p_min``, ``log10_p_mean`` (the mean of log10 p: the typical
      order of magnitude), ``chain_share`` (chain problems among the evaluated) and
      ``expected_per_step`` (``samples_per_step x chain_share x p_mean``: how many
      full checks a training step is expected to sample; below about 1/steps left,
      the strategy is locked out). With a driver, also ``lockout_samples``'s figures of
      the evaluation's own samples under ``sampled`` (``FINAL_SAMPLES`` per problem at
      the last evaluation).
    """
    from magic_jax.data.tasks import lockout

    targets = [(row, lockout.probe_target(row)) for row in ctx.rows]
    chains = [(row, text) for row, text in targets if text is not None]
    if not chains:  # nothing to probe: every figure but the counts is NaN
        nan = float("nan")
        figures = ("p_mean", "p_median", "p_min", "log10_p_mean", "expected_per_step")
        return {"problems": 0, "chain_share": 0.0, **dict.fromkeys(figures, nan)}
    logp = sequence_logprobs(
        ctx.graphdef,
        ctx.params,
        [np.asarray(row.token_ids, np.int32) for row, _ in chains],
        [response_ids(ctx.tokenizer, text, ctx.eos_ids) for _, text in chains],
        temperature=ctx.temperature,
    )
    p = np.exp(logp)
    share = len(chains) / len(ctx.rows)
    sampled = {}
    if ctx.driver is not None and ctx.num_samples:
        n = FINAL_SAMPLES if ctx.final else ctx.num_samples
        sampled = {"sampled": lockout_samples(ctx, n)}
    return {
        **sampled,
        "problems": len(chains),
        "p_mean": float(p.mean()),
        "p_median": float(np.median(p)),
        "p_min": float(p.min()),
        "log10_p_mean": float(logp.mean() / math.log(10)),
        "chain_share": share,
        "expected_per_step": float(ctx.samples_per_step * share * p.mean()),
    }


def decision_probe(ctx: ProbeContext) -> dict[str, object]:
    """The decision world's probe: the policy's exact probability of choosing ``<check>``.

    Teacher-forcing each held-out chain's full check (``magic_jax.data.tasks.decision``),
    it reads the probability of ``<check>`` at every line's decision token, given the
    lines before it written right: the choice alone, apart from the digits.

    Returns:
      ``problems`` (held-out chains probed); ``p_mean`` (the mean over them of the product
      of those probabilities: P(every decision of the full check), the P of the lock-out
      and learnable thresholds), ``p_median``, ``p_min``, ``log10_p_mean``;
      ``p_check_first`` (mean P(``<check>``) at the first line) and ``p_check_line``
      (mean over every line); ``p_sequence_mean`` (the full check's whole text, digits
      included); ``chain_share``; ``expected_per_step`` (``samples_per_step x
      chain_share x p_mean``: full-check decisions a training step is expected to draw).

    Raises:
      ValueError: the tokenizer does not hold ``<check>`` as one token.
    """
    from magic_jax.data.tasks import decision

    check = list(ctx.tokenizer.encode(decision.CHECK, add_special_tokens=False))
    if len(check) != 1:
        raise ValueError(
            f"decision probe: the tokenizer encodes {decision.CHECK!r} as {check}, not one "
            f"token (a model of the decision world has it in its vocabulary)"
        )
    targets = [(row, decision.probe_target(row)) for row in ctx.rows]
    chains = [(row, ab) for row, ab in targets if ab is not None]
    if not chains:  # nothing to probe: every figure but the counts is NaN
        nan = float("nan")
        figures = ["p_mean", "p_median", "p_min", "log10_p_mean", "p_check_first"]
        figures += ["p_check_line", "p_sequence_mean", "expected_per_step"]
        return {"problems": 0, "chain_share": 0.0, **dict.fromkeys(figures, nan)}
    prompts = [np.asarray(row.token_ids, np.int32) for row, _ in chains]
    responses = [
        response_ids(ctx.tokenizer, decision.full_check(*ab), ctx.eos_ids) for _, ab in chains
    ]
    logp = token_logprobs(ctx.graphdef, ctx.params, prompts, responses, temperature=ctx.temperature)
    lines = [
        logp[i, [len(p) + j for j, t in enumerate(r) if t == check[0]]]
        for i, (p, r) in enumerate(zip(prompts, responses))
    ]
    log_p = np.asarray([x.sum() for x in lines])
    p = np.exp(log_p)
    share = len(chains) / len(ctx.rows)
    return {
        "problems": len(chains),
        "p_mean": float(p.mean()),
        "p_median": float(np.median(p)),
        "p_min": float(p.min()),
        "log10_p_mean": float(log_p.mean() / math.log(10)),
        "p_check_first": float(np.mean([math.exp(x[0]) for x in lines])),
        "p_check_line": float(np.exp(np.concatenate(lines)).mean()),
        "p_sequence_mean": float(np.exp(logp.sum(axis=1)).mean()),
        "chain_share": share,
        "expected_per_step": float(ctx.samples_per_step * share * p.mean()),
    }


_PROBES: Registry[ProbeFn] = Registry(
    "probe", {"lockout": lockout_probe, "decision": decision_probe}
)


def register_probe(name: str, fn: ProbeFn, *, replace: bool = False) -> None:
    """Registers ``fn`` (``ProbeFn``) as the probe ``name`` (what ``eval.probe`` names).

    Raises:
      ValueError: an empty name, a built-in's name, or a name another function holds
        (unless ``replace``).
    """
    if not callable(fn):
        raise ValueError(f"probe {name!r}: {fn!r} is not callable")
    _PROBES.add(name, fn, replace=replace)


def get_probe(name: str) -> ProbeFn:
    """The probe ``name``.

    Raises:
      ValueError: one line naming ``name`` and the registered probes.
    """
    return _PROBES.get(name)


def probe_names() -> tuple[str, ...]:
    """Every probe's name: the built-ins, then the registered ones."""
    return _PROBES.names()
