"""The verifier pool's settings (``RewardsConfig``): workers, deadlines, limits, routing."""

from __future__ import annotations

import dataclasses
import os

from magic_jax.rewards.math_reward import MathConfig
from magic_jax.rewards.registry import check_routes, find_reward
from magic_jax.rewards.sandbox import SandboxConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardsConfig:
    """Verifier pool settings.

    Attributes:
      num_workers: worker processes; ``None`` uses ``os.cpu_count()``.
      max_items_per_worker: a worker is replaced after this many items, which
        bounds what caches and leaks can grow to.
      math_deadline_s: wall-clock limit of a math item, enforced by killing
        the worker (Math-Verify's own SIGALRM limits cannot interrupt C code).
      code_deadline_s: the same for a code item; ``None`` is
        ``sandbox.max_wall_s + 15``.
      worker_memory_mb: RLIMIT_AS of each worker (``None``: unlimited).
      start_timeout_s: a worker that is not ready after this long is replaced.
      sandbox_uid_base: as root, worker ``i`` runs its programs as uid and gid
        ``sandbox_uid_base + i``, so that concurrent sandboxes do not share a
        process limit and a fallback kill by uid hits one sandbox only.
        ``None`` runs every worker as ``sandbox.uid``.
      math: Math-Verify limits.
      sandbox: code sandbox limits.
      abilities: a row's ability -> the reward that scores it (``{math: my_reward}``:
        a registered reward, docs/extending.md); an ability not listed is scored by
        the reward of its own name.
    """

    num_workers: int | None = None
    max_items_per_worker: int = 500
    math_deadline_s: float = 30.0
    code_deadline_s: float | None = None
    worker_memory_mb: int | None = 8192
    start_timeout_s: float = 120.0
    sandbox_uid_base: int | None = 1_900_000_000
    math: MathConfig = dataclasses.field(default_factory=MathConfig)
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
    abilities: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "abilities", check_routes(self.abilities))
        if self.num_workers is not None and (
            not isinstance(self.num_workers, int) or self.num_workers < 1
        ):
            raise ValueError(f"num_workers must be an int >= 1 or None, got {self.num_workers!r}")
        if not isinstance(self.max_items_per_worker, int) or self.max_items_per_worker < 1:
            raise ValueError(
                f"max_items_per_worker must be an int >= 1, got {self.max_items_per_worker!r}"
            )
        for name in ("math_deadline_s", "start_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.code_deadline_s is not None and not self.code_deadline_s > self.sandbox.max_wall_s:
            raise ValueError(
                f"code_deadline_s ({self.code_deadline_s}) must exceed sandbox.max_wall_s "
                f"({self.sandbox.max_wall_s}) so the sandbox can report its own timeouts"
            )
        if self.worker_memory_mb is not None and self.worker_memory_mb < 256:
            raise ValueError(
                f"worker_memory_mb must be >= 256 or None, got {self.worker_memory_mb}"
            )
        if self.sandbox_uid_base is not None and not 0 < self.sandbox_uid_base < 2**31:
            raise ValueError(f"sandbox_uid_base must be in (0, 2**31), got {self.sandbox_uid_base}")

    @property
    def workers(self) -> int:
        """The resolved number of workers."""
        return self.num_workers or os.cpu_count() or 1

    @property
    def code_deadline(self) -> float:
        """The resolved code-item deadline in seconds."""
        return self.code_deadline_s or self.sandbox.max_wall_s + 15.0

    def deadline_for(self, reward: str | None) -> float:
        """The deadline of an item of reward ``reward``: a registered reward's own, else
        the code or the math deadline (an unknown reward's item is an error at once)."""
        spec = find_reward(reward)
        if spec is not None and spec.deadline_s is not None:
            return spec.deadline_s
        return self.code_deadline if reward == "code" else self.math_deadline_s

    def sandbox_for(self, slot: int) -> SandboxConfig:
        """Sandbox config of worker ``slot``."""
        if self.sandbox_uid_base is None:
            return self.sandbox
        uid = self.sandbox_uid_base + slot
        return dataclasses.replace(self.sandbox, uid=uid, gid=uid)
