"""Routes a reward item to its reward (``registry``): math, code or a registered one."""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from collections.abc import Mapping
from typing import Any

from magic_jax.rewards.code_tests import looks_like_code_ground_truth
from magic_jax.rewards.math_reward import MathConfig, integer_verdict
from magic_jax.rewards.registry import RewardScoreError, as_result, find_reward, reward_names
from magic_jax.rewards.sandbox import SandboxConfig
from magic_jax.rewards.types import RewardItem, RewardResult, RewardStatus

logger = logging.getLogger(__name__)


def as_item(item: RewardItem | Mapping[str, Any]) -> RewardItem:
    """Accepts a ``RewardItem`` or a mapping with its fields."""
    if isinstance(item, RewardItem):
        return item
    if isinstance(item, Mapping):
        return RewardItem(**item)
    raise TypeError(f"expected a RewardItem or a mapping, got {type(item).__name__}")


def resolve_ability(item: RewardItem) -> str | None:
    """The name of the reward that scores ``item``; None for an unknown ability."""
    if item.ability is None:
        return "code" if looks_like_code_ground_truth(item.ground_truth) else "math"
    spec = find_reward(item.ability)
    return None if spec is None else spec.name


def route(item: RewardItem, abilities: Mapping[str, str]) -> RewardItem:
    """``item`` with its ability replaced by the reward ``abilities`` routes it to
    (``RewardsConfig.abilities``; an ability not listed stays)."""
    target = abilities.get(resolve_ability(item) or "") if abilities else None
    return item if target is None else dataclasses.replace(item, ability=target)


def compute_reward(
    item: RewardItem | Mapping[str, Any],
    *,
    math_config: MathConfig | None = None,
    sandbox_config: SandboxConfig | None = None,
) -> RewardResult:
    """Verifies one item in this process (its main thread, for math).

    Never raises for bad data: an unknown ability, malformed ground truth or an
    internal failure comes back as ``ERROR`` with a detail naming it. So does a
    registered reward's score outside [0, 1] (NaN included), with a warning that names
    the reward and the row: one bad score must not stop a training run, and
    ``reward_status.error`` in the step's metrics counts it.
    """
    start = time.monotonic()
    try:
        item = as_item(item)
        spec = find_reward(resolve_ability(item))
        if spec is None:
            result = RewardResult.of(
                RewardStatus.ERROR,
                f"unknown ability {item.ability!r}; expected one of {', '.join(reward_names())}",
            )
        else:
            configs = {"math": math_config, "sandbox": sandbox_config}
            kwargs = {"config": configs[spec.config]} if spec.config else {}
            result = as_result(spec, spec.fn(item.response, item.ground_truth, **kwargs), item.uid)
    except RewardScoreError as e:
        logger.warning("%s", e)
        result = RewardResult.of(RewardStatus.ERROR, str(e))
    except Exception as e:
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        result = RewardResult.of(RewardStatus.ERROR, f"verifier failed: {last}")
    return dataclasses.replace(result, elapsed_s=time.monotonic() - start)


def quick_reward(item: RewardItem) -> RewardResult | None:
    """``compute_reward``'s result where it is certain without running a verifier
    (microseconds, any thread), else None: a math item whose answer and gold
    answers are integers (``integer_verdict``). ``VerifierPool`` decides these at
    submit instead of sending them to a worker."""
    if resolve_ability(item) == "math":
        return integer_verdict(item.response, item.ground_truth)
    return None
