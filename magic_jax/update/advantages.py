"""Group-relative (GRPO) advantages, advantage estimators by name, truncation masks and the
rejection-sampling keep mask."""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from magic_jax.registry import Registry


class TruncationMask(enum.StrEnum):
    """How truncated responses (no EOS within the length limit) enter the advantages.

    NONE: truncated responses keep their (usually negative) advantage (the report's default).
    BEFORE: truncated responses are left out of the group mean/std and get A = 0.
    AFTER: the group mean/std use every response, then truncated responses get A = 0.
    """

    NONE = "none"
    BEFORE = "before"
    AFTER = "after"


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    """Options of the group advantages (SPEC items 1-3).

    Attributes:
      mask: truncation advantage mask (``"none"`` is the report's default).
      eps: added to the group std.
      ddof: delta degrees of freedom of the group std (1 = unbiased, as the reference code).
      estimator: the advantage estimator by name: ``"grpo"`` (``group_advantages``,
        the report's) or one added with ``register_advantage`` (docs/extending.md),
        which gets these options and may use or ignore them.
    """

    mask: TruncationMask = TruncationMask.NONE
    eps: float = 1e-6
    ddof: int = 1
    estimator: str = "grpo"

    def __post_init__(self):
        try:
            get_advantage(self.estimator)
        except ValueError as e:
            raise ValueError(f"estimator: {e}") from None
        if self.mask not in {m.value for m in TruncationMask}:
            raise ValueError(
                f"AdvantageConfig.mask must be one of {[m.value for m in TruncationMask]}, "
                f"got {self.mask!r}"
            )
        object.__setattr__(self, "mask", TruncationMask(self.mask))
        if self.eps < 0:
            raise ValueError(f"AdvantageConfig.eps must be >= 0, got {self.eps}")
        if self.ddof not in (0, 1):
            raise ValueError(f"AdvantageConfig.ddof must be 0 or 1, got {self.ddof}")


# Called on host arrays once per step: one compiled program per shape instead of one
# per primitive.
@functools.partial(jax.jit, static_argnames=("mask", "eps", "ddof"))
def group_advantages(
    rewards_NG: jax.Array,
    truncated_NG: jax.Array | None = None,
    *,
    mask: TruncationMask | str = TruncationMask.NONE,
    valid_NG: jax.Array | None = None,
    eps: float = 1e-6,
    ddof: int = 1,
) -> jax.Array:
    """Outcome advantages ``A = (r - mean_group r) / (std_group r + eps)``.

    Statistics are taken over the responses of each group that count (see
    ``TruncationMask``); a group whose statistics rest on a single response uses
    mean 0 and std 1, as the reference code does (its unbiased std is undefined).
    With ``mask="before"`` a group with at most one untruncated response gets
    A = 0 everywhere: there is nothing to compare against.

    Args:
      rewards_NG: [N prompts, G samples] rewards (binary in the recipe).
      truncated_NG: [N, G] bool, response hit the length limit; None = none truncated.
      mask: truncation advantage mask, ``"none"``, ``"before"`` or ``"after"``.
      valid_NG: [N, G] bool, False for padding slots (they get A = 0 and are left
        out of the statistics); None = all valid.
      eps: added to the std.
      ddof: delta degrees of freedom of the std (1 = unbiased, as the reference code).

    Returns:
      [N, G] float32 advantages, one per response (every token of a response shares it).
    """
    mask = TruncationMask(mask)
    r_NG = jnp.asarray(rewards_NG, jnp.float32)
    valid_NG = jnp.ones(r_NG.shape, bool) if valid_NG is None else jnp.asarray(valid_NG, bool)
    trunc_NG = (
        jnp.zeros(r_NG.shape, bool) if truncated_NG is None else jnp.asarray(truncated_NG, bool)
    )
    counts_NG = valid_NG & ~trunc_NG if mask is TruncationMask.BEFORE else valid_NG
    w_NG = counts_NG.astype(jnp.float32)
    n_N = w_NG.sum(-1)
    mean_N = (r_NG * w_NG).sum(-1) / jnp.maximum(n_N, 1.0)
    var_N = (jnp.square(r_NG - mean_N[:, None]) * w_NG).sum(-1) / jnp.maximum(n_N - ddof, 1.0)
    single_N = n_N <= 1
    mean_N = jnp.where(single_N, 0.0, mean_N)
    std_N = jnp.where(single_N, 1.0, jnp.sqrt(var_N))
    adv_NG = (r_NG - mean_N[:, None]) / (std_N[:, None] + eps)
    zero_NG = ~valid_NG
    if mask is not TruncationMask.NONE:
        zero_NG = zero_NG | trunc_NG
    if mask is TruncationMask.BEFORE:
        zero_NG = zero_NG | single_N[:, None]
    return jnp.where(zero_NG, 0.0, adv_NG)


class AdvantageFn(Protocol):
    """An advantage estimator: one advantage per response, from the rewards of its group.

    Called once per round of rollouts on host arrays (numpy): ``rewards_NG`` [N prompts,
    G samples] float32 in [0, 1], ``truncated_NG`` [N, G] bool (no EOS within the
    limit), ``valid_NG`` [N, G] bool or None (False for padding slots, which get 0
    whatever it returns), ``config`` the run's ``AdvantageConfig``. Returns [N, G]
    (any array; it is taken as float32). A group whose advantages are all 0 does not
    train (``group_keep_mask``).
    """

    def __call__(
        self,
        rewards_NG: np.ndarray,
        truncated_NG: np.ndarray,
        valid_NG: np.ndarray | None,
        config: AdvantageConfig,
    ) -> Any: ...


def _grpo(rewards_NG, truncated_NG, valid_NG, config):
    return group_advantages(
        rewards_NG,
        truncated_NG,
        mask=config.mask,
        valid_NG=valid_NG,
        eps=config.eps,
        ddof=config.ddof,
    )


_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator", {"grpo": _grpo})


def register_advantage(name: str, fn: AdvantageFn, *, replace: bool = False) -> None:
    """Registers ``fn`` (an ``AdvantageFn``) as the estimator ``name``
    (``advantage.estimator: name`` in a run's config).

    Raises:
      ValueError: an empty name, a built-in's name, or a name another function holds
        (unless ``replace``).
    """
    if not callable(fn):
        raise ValueError(f"advantage estimator {name!r}: {fn!r} is not callable")
    _ESTIMATORS.add(name, fn, replace=replace)


def get_advantage(name: str) -> AdvantageFn:
    """The estimator ``name``.

    Raises:
      ValueError: one line naming ``name`` and the registered estimators.
    """
    return _ESTIMATORS.get(name)


def estimate_advantages(
    config: AdvantageConfig,
    rewards_NG: Any,
    truncated_NG: Any,
    valid_NG: Any = None,
) -> np.ndarray:
    """[N, G] float32 advantages by ``config.estimator`` (the one path the rollouts and
    ``buffer.pack_rollouts`` take); padding slots (``valid_NG`` False) get 0.

    Raises:
      ValueError: a registered estimator returned another shape, or NaN or infinity.
    """
    name = config.estimator
    r_NG = np.asarray(rewards_NG, np.float32)
    t_NG = np.asarray(truncated_NG, bool)
    adv_NG = np.asarray(get_advantage(name)(r_NG, t_NG, valid_NG, config), np.float32)
    if _ESTIMATORS.is_builtin(name):
        return adv_NG
    if adv_NG.shape != r_NG.shape:
        raise ValueError(
            f"advantage estimator {name!r} returned shape {adv_NG.shape}, expected {r_NG.shape}"
        )
    if not np.isfinite(adv_NG).all():
        raise ValueError(f"advantage estimator {name!r} returned NaN or infinite advantages")
    return adv_NG if valid_NG is None else np.where(valid_NG, adv_NG, np.float32(0))


@jax.jit
def group_keep_mask(adv_NG: jax.Array) -> jax.Array:
    """Rejection sampling: keep a group only if some advantage in it is non-zero.

    Groups that are all correct or all wrong (or, under a truncation mask, all
    masked) carry no learning signal and are dropped. The result is a mask, never a
    reshape, so shapes stay static under jit.

    Args:
      adv_NG: [N, G] advantages from ``group_advantages``.

    Returns:
      [N] bool, True for groups that train.
    """
    return jnp.any(jnp.asarray(adv_NG) != 0, axis=-1)


def count_loss_tokens(response_mask_BR: jax.Array, keep_B: jax.Array) -> jax.Array:
    """T_k: the number of response tokens (EOS included) of the kept sequences.

    Every response token of a kept group counts, also those of responses whose
    advantage a truncation mask zeroed: they still carry the entropy term.

    Args:
      response_mask_BR: [B, R] 1 on response tokens.
      keep_B: [B] bool, the sequence's group is kept.

    Returns:
      float32 scalar.
    """
    mask_BR = jnp.asarray(response_mask_BR, jnp.float32) * jnp.asarray(keep_B, jnp.float32)[:, None]
    return mask_BR.sum()
