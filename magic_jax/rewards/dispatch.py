"""Routes a reward item to the math or code verifier by its ability and ground-truth shape."""

from __future__ import annotations

import time
import traceback
from collections.abc import Mapping
from typing import Any

from magic_jax.rewards.code_reward import code_reward
from magic_jax.rewards.code_tests import looks_like_code_ground_truth
from magic_jax.rewards.math_reward import MathConfig, integer_verdict, math_reward
from magic_jax.rewards.sandbox import SandboxConfig
from magic_jax.rewards.types import ABILITIES, RewardItem, RewardResult, RewardStatus


def as_item(item: RewardItem | Mapping[str, Any]) -> RewardItem:
    """Accepts a ``RewardItem`` or a mapping with its fields."""
    if isinstance(item, RewardItem):
        return item
    if isinstance(item, Mapping):
        return RewardItem(**item)
    raise TypeError(f"expected a RewardItem or a mapping, got {type(item).__name__}")


def resolve_ability(item: RewardItem) -> str | None:
    """``"math"`` or ``"code"``; None for an ability that is neither."""
    if item.ability is None:
        return "code" if looks_like_code_ground_truth(item.ground_truth) else "math"
    ability = item.ability.strip().lower()
    return ability if ability in ABILITIES else None


def compute_reward(
    item: RewardItem | Mapping[str, Any],
    *,
    math_config: MathConfig | None = None,
    sandbox_config: SandboxConfig | None = None,
) -> RewardResult:
    """Verifies one item in this process (its main thread, for math).

    Never raises for bad data: an unknown ability, malformed ground truth or an
    internal failure comes back as ``ERROR`` with a detail naming it.
    """
    start = time.monotonic()
    try:
        item = as_item(item)
        ability = resolve_ability(item)
        if ability == "math":
            result = math_reward(item.response, item.ground_truth, config=math_config)
        elif ability == "code":
            result = code_reward(item.response, item.ground_truth, config=sandbox_config)
        else:
            result = RewardResult.of(
                RewardStatus.ERROR,
                f"unknown ability {item.ability!r}; expected one of {', '.join(ABILITIES)}",
            )
    except Exception as e:
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        result = RewardResult.of(RewardStatus.ERROR, f"verifier failed: {last}")
    return RewardResult.of(result.status, result.detail, elapsed_s=time.monotonic() - start)


def quick_reward(item: RewardItem) -> RewardResult | None:
    """``compute_reward``'s result where it is certain without running a verifier
    (microseconds, any thread), else None: a math item whose answer and gold
    answers are integers (``integer_verdict``). ``VerifierPool`` decides these at
    submit instead of sending them to a worker."""
    if resolve_ability(item) == "math":
        return integer_verdict(item.response, item.ground_truth)
    return None
