"""Chunked token log-probs and entropy from hidden states, and the adaptive entropy controller."""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

# --------------------------------------------------------------------------- log-probs, entropy


def logprob_entropy_lse(
    z_NV: jax.Array, targets_N: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The one formula for a token's log-prob and the entropy, used by sampler and trainer.

    Args:
      z_NV: [..., V] float32 logits, already divided by the temperature.
      targets_N: [...] int token ids.

    Returns:
      (logp_N, ent_N, lse_N): log softmax(z)[target], the entropy of softmax(z),
      and logsumexp(z), all [...].
    """
    lse_N = jax.nn.logsumexp(z_NV, axis=-1)
    tgt_N = jnp.take_along_axis(z_NV, targets_N[..., None], axis=-1)[..., 0]
    # H = -sum p log p = logsumexp(z) - E_p[z]; avoids a second [.., V] log-softmax buffer.
    ent_N = lse_N - jnp.sum(jnp.exp(z_NV - lse_N[..., None]) * z_NV, axis=-1)
    return tgt_N - lse_N, ent_N, lse_N


def _scaled_logits(hidden_BCD: jax.Array, unembed_DV: jax.Array, temperature: float) -> jax.Array:
    logits = jnp.einsum("bcd,dv->bcv", hidden_BCD, unembed_DV, preferred_element_type=jnp.float32)
    return logits / temperature


def _chunk_forward(h_BCD, t_BC, unembed_DV, temperature):
    return logprob_entropy_lse(_scaled_logits(h_BCD, unembed_DV, temperature), t_BC)


def _scan_forward(h_NBCD, unembed_DV, t_NBC, temperature):
    def body(carry, xs):
        return carry, _chunk_forward(*xs, unembed_DV, temperature)

    return jax.lax.scan(body, None, (h_NBCD, t_NBC))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _chunked_logp_entropy(h_NBCD, unembed_DV, t_NBC, temperature):
    logp_NBC, ent_NBC, _ = _scan_forward(h_NBCD, unembed_DV, t_NBC, temperature)
    return logp_NBC, ent_NBC


def _chunked_fwd(h_NBCD, unembed_DV, t_NBC, temperature):
    if h_NBCD.shape[0] == 1:
        # One chunk: its logits are live here and again in the backward pass either way,
        # so they are kept rather than recomputed (a [B, C, D] x [D, V] product saved).
        z_BCV = _scaled_logits(h_NBCD[0], unembed_DV, temperature)
        logp_NBC, ent_NBC, lse_NBC = (x[None] for x in logprob_entropy_lse(z_BCV, t_NBC[0]))
        z_NBCV = z_BCV[None]
    else:
        z_NBCV = None
        logp_NBC, ent_NBC, lse_NBC = _scan_forward(h_NBCD, unembed_DV, t_NBC, temperature)
    return (logp_NBC, ent_NBC), (h_NBCD, unembed_DV, t_NBC, lse_NBC, ent_NBC, z_NBCV)


def _chunked_bwd(temperature, res, cotangents):
    """Recomputes each chunk's logits once (one chunk: keeps them from the forward pass)
    and applies the closed-form softmax gradients.

    With q = softmax(z): d logp / dz = onehot(target) - q and
    dH / dz = -q * (log q + H). Only one chunk's [B, C, V] buffers are live, and
    the [D, V] gradient is accumulated across chunks in fp32.
    """
    h_NBCD, unembed_DV, t_NBC, lse_NBC, ent_NBC, z_NBCV = res
    g_logp_NBC, g_ent_NBC = cotangents
    vocab = unembed_DV.shape[1]

    def body(dw_DV, xs):
        h_BCD, t_BC, lse_BC, ent_BC, gl_BC, ge_BC, *kept = xs
        z_BCV = kept[0] if kept else _scaled_logits(h_BCD, unembed_DV, temperature)
        logq_BCV = z_BCV - lse_BC[..., None]
        q_BCV = jnp.exp(logq_BCV)
        dz_BCV = -q_BCV * (gl_BC[..., None] + ge_BC[..., None] * (logq_BCV + ent_BC[..., None]))
        hit_BCV = jnp.arange(vocab, dtype=t_BC.dtype) == t_BC[..., None]
        dz_BCV = (dz_BCV + jnp.where(hit_BCV, gl_BC[..., None], 0.0)) / temperature
        dz_BCV = dz_BCV.astype(unembed_DV.dtype)
        dh_BCD = jnp.einsum("bcv,dv->bcd", dz_BCV, unembed_DV, preferred_element_type=jnp.float32)
        dw_DV = dw_DV + jnp.einsum("bcd,bcv->dv", h_BCD, dz_BCV, preferred_element_type=jnp.float32)
        return dw_DV, dh_BCD.astype(h_BCD.dtype)

    xs = (h_NBCD, t_NBC, lse_NBC, ent_NBC, g_logp_NBC, g_ent_NBC)
    if z_NBCV is not None:
        dw_DV, dh_BCD = body(
            jnp.zeros(unembed_DV.shape, jnp.float32), [x[0] for x in xs] + [z_NBCV[0]]
        )
        return dh_BCD[None], dw_DV.astype(unembed_DV.dtype), None
    dw_DV, dh_NBCD = jax.lax.scan(body, jnp.zeros(unembed_DV.shape, jnp.float32), xs)
    return dh_NBCD, dw_DV.astype(unembed_DV.dtype), None


_chunked_logp_entropy.defvjp(_chunked_fwd, _chunked_bwd)


def token_logprobs_and_entropy(
    hidden_BTD: jax.Array,
    unembed_DV: jax.Array,
    targets_BT: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    compute_dtype: jnp.dtype | str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of each target token and the full-vocabulary entropy, chunked over T.

    Logits are divided by the sampling temperature before both, as the sampler
    does. The sequence is cut into chunks of ``chunk_size`` positions and a
    ``lax.scan`` runs over them, so at most one chunk's [B, C, V] fp32 logits is
    live. The custom backward pass recomputes each chunk's logits (keeping only
    the [B, T] log-normaliser and entropy from the forward pass) and applies the
    closed-form softmax gradients, so peak memory scales with ``B * chunk_size * V``
    plus the [D, V] gradient, never with ``B * T * V``.

    Args:
      hidden_BTD: [B, T, D] final hidden states (after the final norm).
      unembed_DV: [D, V] unembedding matrix.
      targets_BT: [B, T] int token ids whose log-prob to take at each position.
      temperature: sampling temperature (> 0).
      chunk_size: positions per chunk; T is zero-padded up to a multiple.
      compute_dtype: dtype of the matmul inputs (e.g. bfloat16); accumulation and
        everything after the matmul is float32. None keeps the input dtypes.

    Returns:
      (logp_BT, ent_BT), both float32 [B, T]; differentiable with respect to
      ``hidden_BTD`` and ``unembed_DV``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if compute_dtype is not None:
        hidden_BTD = hidden_BTD.astype(compute_dtype)
        unembed_DV = unembed_DV.astype(compute_dtype)
    # one dtype for both matmul operands, so the custom backward's cotangents match
    dtype = jnp.promote_types(hidden_BTD.dtype, unembed_DV.dtype)
    hidden_BTD, unembed_DV = hidden_BTD.astype(dtype), unembed_DV.astype(dtype)
    B, T, D = hidden_BTD.shape
    C = min(chunk_size, T)
    n_chunks = math.ceil(T / C)
    pad = n_chunks * C - T
    if pad:
        hidden_BTD = jnp.pad(hidden_BTD, ((0, 0), (0, pad), (0, 0)))
        targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
    h_NBCD = hidden_BTD.reshape(B, n_chunks, C, D).swapaxes(0, 1)
    t_NBC = targets_BT.astype(jnp.int32).reshape(B, n_chunks, C).swapaxes(0, 1)
    logp_NBC, ent_NBC = _chunked_logp_entropy(h_NBCD, unembed_DV, t_NBC, float(temperature))
    logp_BT = logp_NBC.swapaxes(0, 1).reshape(B, n_chunks * C)[:, :T]
    ent_BT = ent_NBC.swapaxes(0, 1).reshape(B, n_chunks * C)[:, :T]
    return logp_BT, ent_BT


def token_logprobs_and_entropy_naive(
    hidden_BTD: jax.Array,
    unembed_DV: jax.Array,
    targets_BT: jax.Array,
    *,
    temperature: float = 1.0,
    compute_dtype: jnp.dtype | str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Same as ``token_logprobs_and_entropy`` but materialises the full [B, T, V] logits.

    For tests and the memory benchmark only.
    """
    if compute_dtype is not None:
        hidden_BTD = hidden_BTD.astype(compute_dtype)
        unembed_DV = unembed_DV.astype(compute_dtype)
    logp_BT, ent_BT, _ = logprob_entropy_lse(
        _scaled_logits(hidden_BTD, unembed_DV, temperature), targets_BT
    )
    return logp_BT, ent_BT


# --------------------------------------------------------------------------- adaptive controller


class EntropyEstimator(enum.StrEnum):
    """How the rollout buffer's entropy e_k is measured.

    FULL: mean full-vocabulary entropy per response token (the report's; the
      sampler returns it per token).
    SAMPLED_NLL: negative mean log-prob of the sampled tokens (the reference code's).
    """

    FULL = "full"
    SAMPLED_NLL = "sampled-nll"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EntropyControlConfig:
    """Entropy-bonus coefficient schedule (SPEC item 5).

    Attributes:
      mode: "adaptive" (the MAGIC controller) or "fixed" (alpha = ``init_coef`` always).
      target: target entropy tgt_ent, in nats.
      delta: step of the coefficient per training step.
      init_coef: c_0 (adaptive) or the constant coefficient (fixed).
      max_coef: optional upper clamp of c_k (the reference code uses 5e-3).
      gate: "<=" (report: bonus on while e_k <= target) or "<" (reference code).
      estimator: how e_k is measured, see ``EntropyEstimator``.
    """

    mode: Literal["adaptive", "fixed"] = "adaptive"
    target: float = 0.2
    delta: float = 0.005
    init_coef: float = 0.0
    max_coef: float | None = None
    gate: Literal["<=", "<"] = "<="
    estimator: EntropyEstimator = EntropyEstimator.FULL

    def __post_init__(self):
        if self.mode not in ("adaptive", "fixed"):
            raise ValueError(
                f"EntropyControlConfig.mode must be 'adaptive' or 'fixed', got {self.mode!r}"
            )
        if self.gate not in ("<=", "<"):
            raise ValueError(f"EntropyControlConfig.gate must be '<=' or '<', got {self.gate!r}")
        if self.estimator not in {e.value for e in EntropyEstimator}:
            raise ValueError(
                f"EntropyControlConfig.estimator must be one of "
                f"{[e.value for e in EntropyEstimator]}, got {self.estimator!r}"
            )
        object.__setattr__(self, "estimator", EntropyEstimator(self.estimator))
        if self.target < 0:
            raise ValueError(f"EntropyControlConfig.target must be >= 0, got {self.target}")
        if self.delta < 0:
            raise ValueError(f"EntropyControlConfig.delta must be >= 0, got {self.delta}")
        if self.init_coef < 0:
            raise ValueError(f"EntropyControlConfig.init_coef must be >= 0, got {self.init_coef}")
        if self.max_coef is not None and self.max_coef < self.init_coef:
            raise ValueError(
                f"EntropyControlConfig.max_coef ({self.max_coef}) must be >= init_coef "
                f"({self.init_coef})"
            )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EntropyControlState:
    """Controller state, a pytree of arrays kept in the train state (checkpointed).

    Attributes:
      coef: float32 scalar, c_k.
      num_updates: int32 scalar, training steps the controller has seen.
    """

    coef: jax.Array
    num_updates: jax.Array


def init_entropy_control(config: EntropyControlConfig) -> EntropyControlState:
    """c_0 = ``config.init_coef``."""
    return EntropyControlState(
        coef=jnp.asarray(config.init_coef, jnp.float32), num_updates=jnp.asarray(0, jnp.int32)
    )


# The controller's functions run on host values once per step: jitted, each is one
# compiled program per shape instead of one per primitive.
@functools.partial(jax.jit, static_argnames=("estimator",))
def measure_entropy(
    entropy_BR: jax.Array,
    sampled_logp_BR: jax.Array,
    mask_BR: jax.Array,
    estimator: EntropyEstimator | str = EntropyEstimator.FULL,
) -> jax.Array:
    """e_k: the mean token entropy of a rollout buffer.

    Args:
      entropy_BR: [B, R] per-token full-distribution entropy from the sampler.
      sampled_logp_BR: [B, R] behaviour log-prob of each sampled token.
      mask_BR: [B, R] 1 on the response tokens to average over.
      estimator: ``"full"`` (mean of entropy_BR) or ``"sampled-nll"`` (-mean of logp).

    Returns:
      float32 scalar (0 when the mask is empty).
    """
    x_BR = entropy_BR if EntropyEstimator(estimator) is EntropyEstimator.FULL else -sampled_logp_BR
    m_BR = jnp.asarray(mask_BR, jnp.float32)
    return jnp.sum(jnp.asarray(x_BR, jnp.float32) * m_BR) / jnp.maximum(m_BR.sum(), 1.0)


@functools.partial(jax.jit, static_argnames=("config",))
def entropy_coefficient(
    state: EntropyControlState, entropy: jax.Array, config: EntropyControlConfig
) -> jax.Array:
    """alpha_k = c_k * 1{e_k <= target} (or ``<``); the constant in fixed mode.

    Args:
      state: controller state holding c_k.
      entropy: e_k, measured on step k's rollout buffer.
      config: controller options.

    Returns:
      float32 scalar alpha_k, the entropy-bonus weight of step k's loss.
    """
    if config.mode == "fixed":
        return jnp.asarray(config.init_coef, jnp.float32)
    on = entropy <= config.target if config.gate == "<=" else entropy < config.target
    return jnp.where(on, state.coef, 0.0).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("config",))
def update_entropy_control(
    state: EntropyControlState, entropy: jax.Array, config: EntropyControlConfig
) -> EntropyControlState:
    """c_{k+1} = c_k + delta if e_k < target, c_k - delta if e_k > target, kept in [0, max].

    Args:
      state: controller state holding c_k.
      entropy: e_k, measured on step k's rollout buffer.
      config: controller options.

    Returns:
      The state holding c_{k+1} (unchanged coefficient in fixed mode).
    """
    coef = state.coef
    if config.mode == "adaptive":
        step = jnp.where(entropy < config.target, config.delta, 0.0) - jnp.where(
            entropy > config.target, config.delta, 0.0
        )
        hi = np.inf if config.max_coef is None else config.max_coef
        coef = jnp.clip(coef + step, 0.0, hi).astype(jnp.float32)
    return EntropyControlState(coef=coef, num_updates=state.num_updates + 1)
