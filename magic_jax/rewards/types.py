"""Reward result, status and work-item types shared by the verifiers and the pool."""

from __future__ import annotations

import dataclasses
import enum
import numbers
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

# The built-in verifiers; ``registry.reward_names()`` adds the registered rewards.
ABILITIES = ("math", "code")


class RewardStatus(enum.StrEnum):
    """Why a response got its reward.

    Only ``CORRECT`` earns reward 1. A partial score (0 < reward < 1, from a
    registered reward) is ``WRONG``: not fully correct. The other statuses earn 0
    and are kept apart so that timeouts and broken ground truth are counted and
    logged separately from plain wrong answers.
    """

    CORRECT = "correct"
    WRONG = "wrong"
    NO_ANSWER = "no_answer"
    TIMEOUT = "timeout"
    ERROR = "error"


class GroundTruthError(ValueError):
    """The ground truth of an item is malformed (bad JSON, unknown shape, empty)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardResult:
    """Outcome of verifying one response.

    Attributes:
      reward: the score in [0, 1]: 1.0 when ``status`` is ``CORRECT``; a ``WRONG``
        response may hold partial credit (0 <= reward < 1); any other status 0.0.
      status: the verdict.
      detail: a short human-readable reason (empty for plain verdicts).
      elapsed_s: wall-clock seconds spent verifying (set by the pool).
    """

    reward: float
    status: RewardStatus
    detail: str = ""
    elapsed_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.status, RewardStatus):
            object.__setattr__(self, "status", RewardStatus(self.status))
        if not (isinstance(self.reward, numbers.Real) and 0.0 <= self.reward <= 1.0):
            raise ValueError(f"reward must be a finite number in [0, 1], got {self.reward!r}")
        if self.status is RewardStatus.WRONG:
            if self.reward == 1.0:
                raise ValueError("reward=1.0 does not match status=wrong (expected < 1)")
            return
        expected = 1.0 if self.status is RewardStatus.CORRECT else 0.0
        if self.reward != expected:
            raise ValueError(
                f"reward={self.reward} does not match status={self.status.value} "
                f"(expected {expected})"
            )

    @classmethod
    def of(cls, status: RewardStatus, detail: str = "", elapsed_s: float = 0.0) -> RewardResult:
        """Builds a result whose reward follows from ``status``."""
        reward = 1.0 if status is RewardStatus.CORRECT else 0.0
        return cls(reward=reward, status=status, detail=detail, elapsed_s=elapsed_s)

    @classmethod
    def scored(cls, score: float, detail: str = "") -> RewardResult:
        """A result of a score in [0, 1]: ``CORRECT`` at 1, else ``WRONG`` with the score
        as its (partial) reward."""
        score = float(score)
        status = RewardStatus.CORRECT if score == 1.0 else RewardStatus.WRONG
        return cls(reward=score, status=status, detail=detail)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardItem:
    """One response to verify.

    Attributes:
      response: the decoded model output (special tokens removed).
      ground_truth: ``reward_model.ground_truth`` as stored in the data: a plain
        string, a JSON string, or an already-parsed list or dict.
      ability: the reward that scores it: ``"math"``, ``"code"`` or a registered
        one (the row's ``ability`` field, or where ``RewardsConfig.abilities`` routes
        it). ``None`` infers math or code from the ground-truth shape (a test dict
        means code). An unknown ability is not rejected here: it verifies to
        ``ERROR`` so that a bad data row does not stop a training run.
      deadline_s: wall-clock limit enforced by the pool; ``None`` uses the
        reward's own (``register_reward``) or the pool's default.
      uid: the row's uid, named in the errors about the item (optional).
    """

    response: str
    ground_truth: Any
    ability: str | None = None
    deadline_s: float | None = None
    uid: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.response, str):
            raise TypeError(f"response must be a str, got {type(self.response).__name__}")
        if self.ability is not None and not isinstance(self.ability, str):
            raise TypeError(f"ability must be a str or None, got {type(self.ability).__name__}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s}")

    @classmethod
    def from_row(
        cls,
        row: Mapping[str, Any],
        response: str,
        *,
        deadline_s: float | None = None,
        uid: str | None = None,
    ) -> RewardItem:
        """Builds an item from a verl / Skywork-OR1 data row and a response.

        Args:
          row: a mapping with ``ability`` and ``reward_model.ground_truth``.
          response: the decoded response to verify.
          deadline_s: optional per-item deadline.
          uid: the row's uid (for error messages).

        Raises:
          GroundTruthError: ``row`` has no ``reward_model.ground_truth``.
        """
        reward_model = row.get("reward_model")
        if not isinstance(reward_model, Mapping) or "ground_truth" not in reward_model:
            raise GroundTruthError("row has no reward_model.ground_truth")
        return cls(
            response=response,
            ground_truth=reward_model["ground_truth"],
            ability=row.get("ability"),
            deadline_s=deadline_s,
            uid=uid,
        )


def status_counts(results: Iterable[RewardResult]) -> dict[str, int]:
    """Counts results per status, every status present (for step metrics)."""
    counts = Counter(r.status.value for r in results)
    return {s.value: counts.get(s.value, 0) for s in RewardStatus}
