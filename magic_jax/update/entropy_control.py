"""The adaptive entropy controller: how the entropy bonus's coefficient follows the
rollouts' measured entropy (SPEC item 5)."""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from magic_jax.update.token_classes import parse_token_selection


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
      max_coef: optional upper clamp of c_k (the reference code's scripts use 5e-3).
      gate: when the bonus is on and how a tie moves the coefficient.
        ``"<="`` (the report): alpha_k = c_k * 1{e_k <= target}, c unchanged at a tie.
        ``"<"``: alpha_k = c_k * 1{e_k < target}, c unchanged at a tie.
        ``"reference-code"`` (Skywork-OR1's own code, ``EntController``): the switch lags
        one step, alpha_k = c_k * 1{e_{k-1} < target} with the switch on at the first step,
        and a tie lowers the coefficient (c_{k+1} = c_k - delta unless e_k < target).
        Its scripts pair it with ``delta`` 1e-4, ``max_coef`` 5e-3 and
        ``estimator: sampled-nll``; those stay separate options.
      estimator: how e_k is measured, see ``EntropyEstimator``.
      tokens: None (the report's): the bonus and e_k cover every response token;
        ``"classifier:class[+class...]"`` (``"carry:choice"``): only the response
        tokens of those classes (``token_classes``; beyond the report's recipe).
    """

    mode: Literal["adaptive", "fixed"] = "adaptive"
    target: float = 0.2
    delta: float = 0.005
    init_coef: float = 0.0
    max_coef: float | None = None
    gate: Literal["<=", "<", "reference-code"] = "<="
    estimator: EntropyEstimator = EntropyEstimator.FULL
    tokens: str | None = None

    def __post_init__(self):
        if self.tokens is not None:
            try:
                parse_token_selection(self.tokens)
            except ValueError as e:
                raise ValueError(f"tokens: {e}") from None
        if self.mode not in ("adaptive", "fixed"):
            raise ValueError(
                f"EntropyControlConfig.mode must be 'adaptive' or 'fixed', got {self.mode!r}"
            )
        if self.gate not in GATES:
            raise ValueError(
                f"EntropyControlConfig.gate must be one of {list(GATES)}, got {self.gate!r}"
            )
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


GATES = ("<=", "<", "reference-code")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EntropyControlState:
    """Controller state, a pytree of arrays kept in the train state (checkpointed).

    Attributes:
      coef: float32 scalar, c_k.
      num_updates: int32 scalar, training steps the controller has seen.
      switch: float32 scalar, the lagged on/off switch 1{e_{k-1} < target} of
        ``gate: reference-code`` (1 before the first step); None for the other gates, so
        their state (and checkpoints) hold only the two scalars above.
      coef64: ``gate: reference-code`` only: c_k as the reference code holds it, a float64
        (a Python float), stored as its two 32-bit words (uint32 [2]) so that the
        coefficient follows the original's float64 steps to the last bit; ``coef`` is its
        float32 rounding, the weight the loss uses, as a float32 loss does there.
    """

    coef: jax.Array
    num_updates: jax.Array
    switch: jax.Array | None = None
    coef64: jax.Array | None = None


def init_entropy_control(config: EntropyControlConfig) -> EntropyControlState:
    """c_0 = ``config.init_coef``; the reference code's switch starts on."""
    if config.mode == "adaptive" and config.gate == "reference-code":
        return _reference_state(float(config.init_coef), 1.0, 0)
    return EntropyControlState(
        coef=jnp.asarray(config.init_coef, jnp.float32), num_updates=jnp.asarray(0, jnp.int32)
    )


def _reference_state(value: float, switch: float, num_updates: int) -> EntropyControlState:
    return EntropyControlState(
        coef=jnp.asarray(np.float32(value)),
        num_updates=jnp.asarray(num_updates, jnp.int32),
        switch=jnp.asarray(switch, jnp.float32),
        coef64=jnp.asarray(np.array([value], np.float64).view(np.uint32)),
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
    """alpha_k = c_k * 1{e_k <= target} (``<``; ``reference-code``: c_k times the switch set
    from e_{k-1}); the constant in fixed mode.

    Args:
      state: controller state holding c_k.
      entropy: e_k, measured on step k's rollout buffer.
      config: controller options.

    Returns:
      float32 scalar alpha_k, the entropy-bonus weight of step k's loss.
    """
    if config.mode == "fixed":
        return jnp.asarray(config.init_coef, jnp.float32)
    if config.gate == "reference-code":
        switch, _ = _reference_words(state)
        return (state.coef * switch).astype(jnp.float32)
    on = entropy <= config.target if config.gate == "<=" else entropy < config.target
    return jnp.where(on, state.coef, 0.0).astype(jnp.float32)


def update_entropy_control(
    state: EntropyControlState, entropy: jax.Array | float, config: EntropyControlConfig
) -> EntropyControlState:
    """c_{k+1} = c_k + delta if e_k < target, c_k - delta if e_k > target, kept in [0, max].

    With ``gate: reference-code`` (the original's ``EntController.update``): c_k - delta
    also at e_k == target, the switch of step k + 1 becomes 1{e_k < target}, and the
    arithmetic is the original's, in float64 on the host.

    Args:
      state: controller state holding c_k.
      entropy: e_k, measured on step k's rollout buffer.
      config: controller options.

    Returns:
      The state holding c_{k+1} (unchanged coefficient in fixed mode).
    """
    if config.mode == "adaptive" and config.gate == "reference-code":
        _, coef64 = _reference_words(state)
        value = float(_local(coef64).astype(np.uint32).view(np.float64)[0])
        below = float(_local(entropy)) < config.target
        value = value + config.delta if below else value - config.delta
        hi = np.inf if config.max_coef is None else config.max_coef
        value = float(np.clip(value, 0.0, hi))
        return _reference_state(value, float(below), int(_local(state.num_updates)) + 1)
    return _update(state, entropy, config)


@functools.partial(jax.jit, static_argnames=("config",))
def _update(
    state: EntropyControlState, entropy: jax.Array, config: EntropyControlConfig
) -> EntropyControlState:
    coef = state.coef
    if config.mode == "adaptive":
        step = jnp.where(entropy < config.target, config.delta, 0.0) - jnp.where(
            entropy > config.target, config.delta, 0.0
        )
        hi = np.inf if config.max_coef is None else config.max_coef
        coef = jnp.clip(coef + step, 0.0, hi).astype(jnp.float32)
    return dataclasses.replace(state, coef=coef, num_updates=state.num_updates + 1)


def _local(x: jax.Array | float) -> np.ndarray:
    """A replicated value as this process holds it (a multi-host array is not fully
    addressable, but every device of a replicated one holds all of it)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return np.asarray(x)


def _reference_words(state: EntropyControlState) -> tuple[jax.Array, jax.Array]:
    """``gate: reference-code``'s (lagged switch, float64 coefficient words)."""
    if state.switch is None or state.coef64 is None:
        raise ValueError(
            "entropy.gate 'reference-code' needs the controller state's lagged switch; this "
            "state was made for another gate (init_entropy_control with this config makes one)"
        )
    return state.switch, state.coef64
