"""Rule-based rewards: Math-Verify for math, sandboxed unit tests for code, registered
rewards (``register_reward``), and a verifier pool.

Importing this package is cheap and never imports JAX; Math-Verify (sympy) is
loaded on first use, in the worker processes when ``VerifierPool`` is used.
"""

from magic_jax.rewards.code_reward import code_reward, extract_code
from magic_jax.rewards.code_tests import CodeTests, parse_code_ground_truth
from magic_jax.rewards.dispatch import compute_reward
from magic_jax.rewards.math_reward import (
    MathConfig,
    extract_answer_region,
    math_reward,
    parse_math_ground_truth,
)
from magic_jax.rewards.pool import RewardsConfig, VerifierPool
from magic_jax.rewards.registry import (
    RewardScoreError,
    RewardSpec,
    get_reward,
    register_reward,
    reward_names,
)
from magic_jax.rewards.sandbox import SandboxConfig, isolation_plan
from magic_jax.rewards.types import (
    GroundTruthError,
    RewardItem,
    RewardResult,
    RewardStatus,
    status_counts,
)

__all__ = [
    "CodeTests",
    "GroundTruthError",
    "MathConfig",
    "RewardItem",
    "RewardResult",
    "RewardScoreError",
    "RewardSpec",
    "RewardStatus",
    "RewardsConfig",
    "SandboxConfig",
    "VerifierPool",
    "code_reward",
    "compute_reward",
    "extract_answer_region",
    "extract_code",
    "get_reward",
    "isolation_plan",
    "math_reward",
    "parse_code_ground_truth",
    "parse_math_ground_truth",
    "register_reward",
    "reward_names",
    "status_counts",
]
