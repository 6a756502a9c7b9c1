"""The MAGIC token-level objective: clip-higher PPO surrogate, entropy bonus, k3 KL, aggregation."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal

import jax
import jax.numpy as jnp


class Aggregation(enum.StrEnum):
    """How per-token loss terms are reduced to the mini-batch loss.

    TOKEN_MEAN: the report's global token mean, sum / T_k with T_k the number of
      response tokens of the whole mini-batch (independent of micro-batching and
      sharding because T_k is passed in).
    SEQ_MEAN_TOKEN_SUM: sum over each sequence's tokens, mean over the mini-batch's
      sequences (``num_seqs``).
    SEQ_MEAN_TOKEN_MEAN: mean over each sequence's tokens, mean over sequences.
    MICRO_TOKEN_MEAN: the public reference code's: token mean within each
      micro-batch, weighted by (sequences in the micro-batch / ``nominal_seqs``).
      It changes with the micro-batch split; kept for comparison only.
    """

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    MICRO_TOKEN_MEAN = "micro-token-mean"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Options of the policy objective (SPEC items 4 and 6).

    Attributes:
      eps_low: lower clip range, ratio >= 1 - eps_low.
      eps_high: upper clip range, ratio <= 1 + eps_high (> eps_low is clip-higher).
      dual_clip: optional c > 1; for A < 0 the surrogate is bounded below by c * A.
      kl_beta: weight of the token-level k3 KL to a frozen reference policy; 0 = no
        KL and no reference forward pass at all.
      kl_clamp: the k3 KL of each token clamped to [-kl_clamp, kl_clamp] (its gradient
        0 where it binds), as Skywork-OR1's code does with 10 (``low_var_kl``); None = no
        clamp (the report's formula).
      kl_reference: the reference policy's checkpoint directory (Hugging Face or
        magic_jax); None = the run's initial weights.
      behaviour_logprobs: the sampler log-probs the ratio divides by: ``"full"``,
        the temperature-scaled full distribution (what the trainer recomputes;
        default), or ``"sampled"``, the top-k / top-p truncated distribution the
        tokens were actually drawn from.
      tis_cap: decoupled PPO, for a sampler that is stale (overlap) or whose
        numerics or truncation differ from the trainer's: the clip ratio is taken
        against the proximal policy (the trainer's own log-probs before the
        update), and each token's surrogate is weighted by the behaviour weight
        ``w = pi_proximal / pi_behaviour`` under ``tis_rule``. None = off (naive
        PPO: the ratio is against the behaviour log-probs directly).
      tis_rule: what ``tis_cap`` does to the behaviour weight: ``"truncate"``,
        ``min(w, tis_cap)`` (truncated importance sampling's convention, usually
        with cap 2); ``"mask"``, tokens with ``w > tis_cap`` are dropped (weight
        0) and the others keep ``w`` (AReaL's rule, whose cap is 5).
      behaviour_clip: with ``tis_cap``, also keep naive PPO's clip against the
        behaviour policy: a token whose ``pi_theta / pi_behaviour`` is past the
        clip range in its advantage's direction gets no gradient. At one
        optimizer step per batch the proximal policy is the current one, so
        the proximal clip never binds and this is the only trust region.
      aggregation: see ``Aggregation``.
      temperature: sampling temperature; training logits are divided by it too.
      logit_chunk: sequence positions per chunk of the log-prob/entropy projection.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    kl_beta: float = 0.0
    kl_clamp: float | None = None
    kl_reference: str | None = None
    behaviour_logprobs: Literal["full", "sampled"] = "full"
    tis_cap: float | None = None
    tis_rule: Literal["truncate", "mask"] = "truncate"
    behaviour_clip: bool = False
    aggregation: Aggregation = Aggregation.TOKEN_MEAN
    temperature: float = 1.0
    logit_chunk: int = 1024

    def __post_init__(self):
        if self.aggregation not in {a.value for a in Aggregation}:
            raise ValueError(
                f"LossConfig.aggregation must be one of {[a.value for a in Aggregation]}, "
                f"got {self.aggregation!r}"
            )
        object.__setattr__(self, "aggregation", Aggregation(self.aggregation))
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"LossConfig.eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0:
            raise ValueError(f"LossConfig.eps_high must be >= 0, got {self.eps_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"LossConfig.dual_clip must be > 1 or None, got {self.dual_clip}")
        if self.kl_beta < 0:
            raise ValueError(f"LossConfig.kl_beta must be >= 0, got {self.kl_beta}")
        if self.kl_clamp is not None and self.kl_clamp <= 0:
            raise ValueError(f"LossConfig.kl_clamp must be > 0 or None, got {self.kl_clamp}")
        if self.behaviour_logprobs not in ("full", "sampled"):
            raise ValueError(
                "LossConfig.behaviour_logprobs must be 'full' or 'sampled', got "
                f"{self.behaviour_logprobs!r}"
            )
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ValueError(f"LossConfig.tis_cap must be >= 1 or None, got {self.tis_cap}")
        if self.tis_rule not in ("truncate", "mask"):
            raise ValueError(
                f"LossConfig.tis_rule must be 'truncate' or 'mask', got {self.tis_rule!r}"
            )
        if self.behaviour_clip and self.tis_cap is None:
            raise ValueError(
                "LossConfig.behaviour_clip needs tis_cap (naive PPO already clips against "
                "the behaviour policy)"
            )
        if self.temperature <= 0:
            raise ValueError(f"LossConfig.temperature must be > 0, got {self.temperature}")
        if self.logit_chunk <= 0:
            raise ValueError(f"LossConfig.logit_chunk must be > 0, got {self.logit_chunk}")


# Metrics that combine across micro-batches by max; all others are already divided by
# the global token count and combine by sum.
MAX_METRICS = ("ratio_max", "sampler_ratio_max", "sampler_abs_log_ratio_max")


def k3_kl(logp_BT: jax.Array, ref_logp_BT: jax.Array, clamp: float | None = None) -> jax.Array:
    """Token-level k3 estimate of KL(pi_theta || pi_ref): r - log r - 1, r = pi_ref / pi_theta;
    with ``clamp``, kept in [-clamp, clamp] (k3 >= 0, so only the upper bound can bind)."""
    log_r = ref_logp_BT - logp_BT
    kl_BT = jnp.exp(log_r) - log_r - 1.0
    return kl_BT if clamp is None else jnp.clip(kl_BT, -clamp, clamp)


def aggregate(
    x_BT: jax.Array,
    mask_BT: jax.Array,
    *,
    mode: Aggregation | str = Aggregation.TOKEN_MEAN,
    num_tokens: jax.Array | float | None = None,
    num_seqs: jax.Array | float | None = None,
    nominal_seqs: jax.Array | float | None = None,
) -> jax.Array:
    """Reduces per-token values to a scalar, see ``Aggregation``.

    Args:
      x_BT: [B, T] per-token values.
      mask_BT: [B, T] 1 on tokens that count.
      mode: the aggregation.
      num_tokens: T_k of the whole mini-batch (TOKEN_MEAN).
      num_seqs: sequences with at least one counted token in the whole mini-batch
        (SEQ_MEAN_*).
      nominal_seqs: nominal sequences per mini-batch (MICRO_TOKEN_MEAN).

    Returns:
      float32 scalar; 0 when nothing counts.
    """
    mode = Aggregation(mode)
    m_BT = jnp.asarray(mask_BT, jnp.float32)
    xm_BT = jnp.where(m_BT > 0, x_BT, 0.0) * m_BT
    if mode is Aggregation.TOKEN_MEAN:
        return xm_BT.sum() / jnp.maximum(_need(num_tokens, "num_tokens", mode), 1.0)
    if mode is Aggregation.SEQ_MEAN_TOKEN_SUM:
        return xm_BT.sum() / jnp.maximum(_need(num_seqs, "num_seqs", mode), 1.0)
    if mode is Aggregation.SEQ_MEAN_TOKEN_MEAN:
        per_seq_B = xm_BT.sum(-1) / jnp.maximum(m_BT.sum(-1), 1.0)
        return per_seq_B.sum() / jnp.maximum(_need(num_seqs, "num_seqs", mode), 1.0)
    nominal = _need(nominal_seqs, "nominal_seqs", mode)
    local_seqs = (m_BT.sum(-1) > 0).sum()
    return xm_BT.sum() / jnp.maximum(m_BT.sum(), 1.0) * local_seqs / nominal


# clip fractions per token staleness: 0, 1, ..., K-2 and K-1 or more versions
STALENESS_BUCKETS = 5


def _need(value: jax.Array | float | None, name: str, mode: Aggregation) -> jax.Array | float:
    if value is None:
        raise ValueError(f"aggregation {mode.value!r} needs {name}")
    return value


def policy_loss(
    logp_BT: jax.Array,
    old_logp_BT: jax.Array,
    adv_B: jax.Array,
    mask_BT: jax.Array,
    entropy_BT: jax.Array,
    *,
    alpha: jax.Array | float,
    config: LossConfig,
    num_tokens: jax.Array | float,
    num_seqs: jax.Array | float | None = None,
    nominal_seqs: jax.Array | float | None = None,
    ref_logp_BT: jax.Array | None = None,
    behaviour_logp_BT: jax.Array | None = None,
    entropy_mask_BT: jax.Array | None = None,
    staleness_BT: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The MAGIC loss of SPEC eq. 3.1 on one (micro-)batch.

    ``L = agg[-(min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + alpha H) + beta k3]``
    with ``rho = exp(logp - old_logp)``; with dual-clip, for A < 0 the surrogate is
    ``max(min(...), c A)``. With ``config.tis_cap`` (TIS), ``old_logp`` is the
    trainer's own log-prob before the update and each token's surrogate is
    multiplied by the constant ``w = min(exp(old_logp - behaviour_logp), tis_cap)``.
    With the default global token mean, summing this loss over
    the micro-batches of a mini-batch gives the mini-batch loss exactly.

    Args:
      logp_BT: [B, T] log-probs of the taken tokens under the policy being trained.
      old_logp_BT: [B, T] behaviour (sampler) log-probs of the same tokens.
      adv_B: [B] advantage of each sequence.
      mask_BT: [B, T] 1 on response tokens of kept groups (EOS included).
      entropy_BT: [B, T] full-vocabulary entropy under the policy being trained.
      alpha: entropy-bonus coefficient alpha_k.
      config: loss options.
      num_tokens: T_k over the whole mini-batch.
      num_seqs: sequences of the whole mini-batch that have tokens (SEQ_MEAN_*).
      nominal_seqs: nominal sequences per mini-batch (MICRO_TOKEN_MEAN).
      ref_logp_BT: [B, T] reference-policy log-probs; required iff ``config.kl_beta > 0``.
      behaviour_logp_BT: [B, T] the sampler's log-probs; default ``old_logp_BT``.
        Required with ``config.tis_cap``.
      entropy_mask_BT: [B, T] 1 on the tokens whose entropy the bonus holds up
        (``entropy.tokens``): the bonus becomes ``alpha * H * entropy_mask``,
        aggregated as before. None (the report's): every token.
      staleness_BT: [B, T] int versions each token's sampler lags the policy being
        updated (overlap mode): adds ``stale_tokens`` and ``stale_clipped``, [K]
        token fractions per staleness 0 .. K-2 and K-1 or more
        (K = ``STALENESS_BUCKETS``), whose ratio is the clip fraction per staleness
        (every clip that binds); with ``tis_cap`` also ``stale_weight`` and
        ``stale_capped`` (``_weight_by_staleness``).

    Returns:
      (loss, metrics). Metrics other than those in ``MAX_METRICS`` are token sums
      divided by ``num_tokens``, so they add up across micro-batches to mini-batch
      token means: ``pg_loss``, ``clipfrac_low``, ``clipfrac_high``,
      ``clipfrac_dual``, ``ratio_mean``, ``entropy``, ``approx_kl`` (k3 to the
      behaviour policy), ``ref_kl`` (k3 to the reference, when on),
      ``sampler_ratio_mean`` and ``sampler_kl`` (pi_theta / pi_behaviour and its
      k3, the rollout/trainer mismatch at the first step of a buffer),
      ``sampler_abs_log_ratio_mean`` (mean |log pi_theta - log pi_behaviour|),
      ``tis_weight_mean`` and ``tis_capped`` (with ``tis_cap``), ``behaviour_clipfrac``
      (with ``behaviour_clip``); ``ratio_max``,
      ``sampler_ratio_max``, ``sampler_abs_log_ratio_max``.
    """
    _check_inputs(config, ref_logp_BT, behaviour_logp_BT)
    behaviour_logp_BT = old_logp_BT if behaviour_logp_BT is None else behaviour_logp_BT
    m_BT = jnp.asarray(mask_BT, jnp.float32)
    on_BT = m_BT > 0
    # Masked positions hold padding; zero their log-ratio so exp cannot overflow into NaN grads.
    log_ratio_BT = jnp.where(on_BT, logp_BT - old_logp_BT, 0.0)
    ratio_BT = jnp.exp(log_ratio_BT)
    a_BT = jnp.broadcast_to(jnp.asarray(adv_B, jnp.float32)[:, None], ratio_BT.shape)
    lo, hi = 1.0 - config.eps_low, 1.0 + config.eps_high
    surr_BT = jnp.minimum(ratio_BT * a_BT, jnp.clip(ratio_BT, lo, hi) * a_BT)
    dual_BT = jnp.zeros_like(on_BT)
    if config.dual_clip is not None:
        dual_BT = (a_BT < 0) & (ratio_BT > config.dual_clip)
        surr_BT = jnp.where(a_BT < 0, jnp.maximum(surr_BT, config.dual_clip * a_BT), surr_BT)
    # rollout/trainer mismatch, pi_theta / pi_behaviour (pi_theta is the trainer's pi_old
    # at the first optimizer step of a buffer)
    log_s_BT = jnp.where(on_BT, logp_BT - behaviour_logp_BT, 0.0)
    weight_BT, capped_BT = _tis_weight(config, on_BT, old_logp_BT, behaviour_logp_BT)
    if weight_BT is not None:
        surr_BT = surr_BT * weight_BT
    surr_BT, behaviour_clipped_BT = _behaviour_clip(config, surr_BT, log_s_BT, a_BT, lo, hi)
    bonus_BT = entropy_BT if entropy_mask_BT is None else entropy_BT * entropy_mask_BT
    term_BT = -surr_BT - alpha * bonus_BT
    ref_kl_BT = None
    if config.kl_beta > 0:
        assert ref_logp_BT is not None, "_check_inputs asks for it with kl_beta > 0"
        ref_kl_BT = k3_kl(logp_BT, jnp.where(on_BT, ref_logp_BT, logp_BT), config.kl_clamp)
        term_BT = term_BT + config.kl_beta * ref_kl_BT
    loss = aggregate(
        term_BT,
        m_BT,
        mode=config.aggregation,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        nominal_seqs=nominal_seqs,
    )

    def tmean(x_BT):
        x_BT = jax.lax.stop_gradient(jnp.asarray(x_BT, jnp.float32))
        return jnp.sum(jnp.where(on_BT, x_BT, 0.0) * m_BT) / jnp.maximum(num_tokens, 1.0)

    metrics = _sampler_metrics(tmean, on_BT, log_s_BT)
    metrics |= {
        "pg_loss": tmean(-surr_BT),
        "clipfrac_low": tmean((a_BT < 0) & (ratio_BT < lo)),
        "clipfrac_high": tmean((a_BT > 0) & (ratio_BT > hi)),
        "clipfrac_dual": tmean(dual_BT),
        "ratio_mean": tmean(ratio_BT),
        "entropy": tmean(entropy_BT),
        "approx_kl": tmean(ratio_BT - 1.0 - log_ratio_BT),
        "ratio_max": jax.lax.stop_gradient(jnp.max(jnp.where(on_BT, ratio_BT, 0.0))),
    }
    if weight_BT is not None:
        metrics["tis_weight_mean"] = tmean(weight_BT)
        metrics["tis_capped"] = tmean(capped_BT)
    if behaviour_clipped_BT is not None:
        metrics["behaviour_clipfrac"] = tmean(behaviour_clipped_BT)
    if ref_kl_BT is not None:
        metrics["ref_kl"] = tmean(ref_kl_BT)
    if staleness_BT is not None:
        w_BT = jnp.where(on_BT, m_BT, 0.0) / jnp.maximum(num_tokens, 1.0)
        # every clip that binds: the ratio's (to the sampler in naive PPO, to the proximal
        # policy in decoupled) and, with behaviour_clip, the sampler's too
        clipped_BT = ((a_BT < 0) & (ratio_BT < lo)) | ((a_BT > 0) & (ratio_BT > hi))
        if behaviour_clipped_BT is not None:
            clipped_BT = clipped_BT | behaviour_clipped_BT
        metrics.update(_by_staleness(staleness_BT, w_BT, clipped_BT))
        if weight_BT is not None:
            metrics.update(_weight_by_staleness(staleness_BT, w_BT, weight_BT, capped_BT))
    return loss, metrics


def _behaviour_clip(config: LossConfig, surr_BT, log_s_BT, a_BT, lo, hi) -> tuple[Any, Any]:
    """With ``config.behaviour_clip``, naive PPO's clip against the sampler kept: no
    gradient for a token whose pi_theta / pi_behaviour is past [lo, hi] in its advantage's
    direction; (the surrogate, those tokens). Else (the surrogate, None)."""
    if not config.behaviour_clip:
        return surr_BT, None
    s_BT = jnp.exp(log_s_BT)
    clipped_BT = ((a_BT < 0) & (s_BT < lo)) | ((a_BT > 0) & (s_BT > hi))
    return jnp.where(clipped_BT, jax.lax.stop_gradient(surr_BT), surr_BT), clipped_BT


def _sampler_metrics(tmean, on_BT, log_s_BT) -> dict:
    """The rollout/trainer mismatch pi_theta / pi_behaviour (``log_s_BT``): its mean,
    max, k3 KL and |log| mean and max."""

    def tmax(x_BT):
        return jax.lax.stop_gradient(jnp.max(jnp.where(on_BT, x_BT, 0.0)))

    return {
        "sampler_ratio_mean": tmean(jnp.exp(log_s_BT)),
        "sampler_ratio_max": tmax(jnp.exp(log_s_BT)),
        "sampler_kl": tmean(jnp.exp(log_s_BT) - 1.0 - log_s_BT),
        "sampler_abs_log_ratio_mean": tmean(jnp.abs(log_s_BT)),
        "sampler_abs_log_ratio_max": tmax(jnp.abs(log_s_BT)),
    }


def _tis_weight(config: LossConfig, on_BT, old_logp_BT, behaviour_logp_BT) -> tuple[Any, Any]:
    """The behaviour weights (constants): min(pi_old / pi_behaviour, cap), or with
    ``tis_rule: mask`` the ratio itself where it is at most the cap and 0 above it; and
    where the ratio is past the cap. (None, None) without ``tis_cap``."""
    if config.tis_cap is None:
        return None, None
    log_w_BT = jax.lax.stop_gradient(jnp.where(on_BT, old_logp_BT - behaviour_logp_BT, 0.0))
    w_BT = jnp.exp(log_w_BT)
    capped_BT = w_BT > config.tis_cap
    if config.tis_rule == "mask":
        return jnp.where(capped_BT, 0.0, w_BT), capped_BT
    return jnp.minimum(w_BT, config.tis_cap), capped_BT


def _check_inputs(config: LossConfig, ref_logp: Any, behaviour_logp: Any) -> None:
    if config.kl_beta > 0 and ref_logp is None:
        raise ValueError("LossConfig.kl_beta > 0 needs ref_logp_BT")
    if config.tis_cap is not None and behaviour_logp is None:
        raise ValueError("LossConfig.tis_cap needs behaviour_logp_BT")


def _by_staleness(staleness_BT: jax.Array, w_BT: jax.Array, clipped_BT: jax.Array) -> dict:
    """``stale_tokens`` and ``stale_clipped``: [K] token fractions (weights ``w_BT``) per
    staleness bucket, of all tokens and of those a clip cut (``clipped_BT``)."""
    k = STALENESS_BUCKETS
    b_BTK = jax.lax.stop_gradient(jax.nn.one_hot(jnp.clip(staleness_BT, 0, k - 1), k))
    w_BT = jax.lax.stop_gradient(w_BT)
    return {
        "stale_tokens": jnp.einsum("bt,btk->k", w_BT, b_BTK),
        "stale_clipped": jnp.einsum("bt,btk->k", w_BT * clipped_BT, b_BTK),
    }


def _weight_by_staleness(staleness_BT, w_BT, weight_BT, capped_BT) -> dict:
    """``stale_weight`` and ``stale_capped``: [K] sums per staleness bucket (token weights
    ``w_BT``) of the behaviour weight as applied and of the tokens past the cap
    (``capped_BT``: truncated, or dropped under ``tis_rule: mask``); divided by
    ``stale_tokens``, their means."""
    k = STALENESS_BUCKETS
    b_BTK = jax.lax.stop_gradient(jax.nn.one_hot(jnp.clip(staleness_BT, 0, k - 1), k))
    w_BT = jax.lax.stop_gradient(w_BT)
    return {
        "stale_weight": jnp.einsum("bt,btk->k", w_BT * jax.lax.stop_gradient(weight_BT), b_BTK),
        "stale_capped": jnp.einsum("bt,btk->k", w_BT * capped_BT, b_BTK),
    }
