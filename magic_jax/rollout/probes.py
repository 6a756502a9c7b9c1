"""Evaluation probes by name: exact measures of the policy taken at every evaluation.

A probe is ``fn(context) -> {figure: value}``, run by the trainer's evaluation when
``eval.probe`` names it, its figures recorded under ``probe`` in ``eval.jsonl``. The
built-in ``lockout`` probe measures whether a run of the lock-out world
(``magic_jax.data.tasks.lockout``) can still sample the better strategy: the exact
probability, by teacher forcing, that the policy writes the full check of each
held-out chain problem, and how many such samples a training step should draw.
``register_probe`` adds others (from a config's ``extensions`` module).
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
from magic_jax.rollout.protocols import Params, Tokenizer

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
    """

    graphdef: nnx.GraphDef
    params: Params
    rows: Sequence[PromptRow]
    tokenizer: Tokenizer
    eos_ids: tuple[int, ...]
    temperature: float = 1.0
    samples_per_step: int = 0


ProbeFn = Callable[[ProbeContext], dict[str, float]]


@functools.partial(jax.jit, static_argnums=0)
def _token_logprobs(graphdef, params, ids_BL, mask_BL, temperature):
    """[B, L] log-prob of each token given the ones before it (position 0: 0)."""
    logits_BLV = nnx.merge(graphdef, params)(ids_BL, attention_mask=mask_BL)
    logp_BLV = jax.nn.log_softmax(logits_BLV[:, :-1].astype(jnp.float32) / temperature, axis=-1)
    logp_BL = jnp.take_along_axis(logp_BLV, ids_BL[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(logp_BL, ((0, 0), (1, 0)))


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
    has one). One forward pass over every pair, right-padded.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts, {len(responses)} responses")
    if not prompts:
        return np.zeros((0,), np.float64)
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
    return np.where(scored, np.asarray(logp, np.float64), 0.0).sum(axis=1)


def response_ids(tokenizer: Tokenizer, text: str, eos_ids: Sequence[int]) -> list[int]:
    """A response text's tokens as sampled: the text, then an EOS unless it ends with one."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids or ids[-1] not in eos_ids:
        ids.append(int(eos_ids[0]))
    return ids


def lockout_probe(ctx: ProbeContext) -> dict[str, float]:
    """The lock-out world's probe: can the policy still sample the full check of a chain?

    Returns:
      ``problems`` (held-out chain problems probed), ``p_mean`` (the mean over them
      of the exact probability of the full check at the rollout temperature),
      ``p_median``, ``p_min``, ``log10_p_mean`` (the mean of log10 p: the typical
      order of magnitude), ``chain_share`` (chain problems among the evaluated) and
      ``expected_per_step`` (``samples_per_step x chain_share x p_mean``: how many
      full checks a training step is expected to sample; below about 1/steps left,
      the strategy is locked out).
    """
    from magic_jax.data.tasks import lockout

    chains = [(row, lockout.probe_target(row)) for row in ctx.rows]
    chains = [(row, text) for row, text in chains if text is not None]
    if not chains:  # nothing to probe: every figure but the counts is NaN
        nan = float("nan")
        figures = ("p_mean", "p_median", "p_min", "log10_p_mean", "expected_per_step")
        return {"problems": 0, "chain_share": 0.0, **dict.fromkeys(figures, nan)}
    logp = sequence_logprobs(
        ctx.graphdef,
        ctx.params,
        [row.token_ids for row, _ in chains],
        [response_ids(ctx.tokenizer, text, ctx.eos_ids) for _, text in chains],
        temperature=ctx.temperature,
    )
    p = np.exp(logp)
    share = len(chains) / len(ctx.rows)
    return {
        "problems": len(chains),
        "p_mean": float(p.mean()),
        "p_median": float(np.median(p)),
        "p_min": float(p.min()),
        "log10_p_mean": float(logp.mean() / math.log(10)),
        "chain_share": share,
        "expected_per_step": float(ctx.samples_per_step * share * p.mean()),
    }


_PROBES: dict[str, ProbeFn] = {"lockout": lockout_probe}
_BUILTIN = ("lockout",)


def register_probe(name: str, fn: ProbeFn, *, replace: bool = False) -> None:
    """Registers ``fn`` (``ProbeFn``) as the probe ``name`` (what ``eval.probe`` names).

    Raises:
      ValueError: an empty name, a built-in's name, or a name another function holds
        (unless ``replace``).
    """
    if not isinstance(name, str) or not name.strip() or name in _BUILTIN:
        raise ValueError(f"probe name {name!r} is empty or built in")
    if not callable(fn):
        raise ValueError(f"probe {name!r}: {fn!r} is not callable")
    old = _PROBES.get(name)
    if old is not None and old is not fn and not replace:
        raise ValueError(f"probe {name!r} is already registered; pass replace=True")
    _PROBES[name] = fn


def get_probe(name: str) -> ProbeFn:
    """The probe ``name``.

    Raises:
      ValueError: one line naming ``name`` and the registered probes.
    """
    fn = _PROBES.get(name) if isinstance(name, str) else None
    if fn is None:
        raise ValueError(f"unknown probe {name!r}; registered: {', '.join(_PROBES)}")
    return fn


def probe_names() -> tuple[str, ...]:
    """Every probe's name: the built-ins, then the registered ones."""
    return tuple(_PROBES)
