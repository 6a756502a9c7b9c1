"""What runs after a training step, registered by when it runs.

The trainer's loop is a step (rollouts, scoring, packing, the update, the step's
record) followed by its hooks: the record written, evaluation every
``eval.every`` steps, the stage switch when a stage ends, a checkpoint every
``checkpoint_every`` steps. Each hook is a function of the finished step
(``StepDone``), added with how often it runs and, where a count is not enough,
a condition:

    hooks = StepHooks()
    hooks.add(write_record)                                     # every step
    hooks.add(evaluate, every=cfg.eval.every, also=last_stage_ended)
    hooks.add(switch_stage, every=None, also=stage_ended)

Hooks run in the order they were added, so a later one sees what an earlier one
changed (an evaluation's ``until`` rule may end the stage before the switch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from magic_jax.rollout.protocols import Verifiers
    from magic_jax.run.rundir import JSON
    from magic_jax.run.stages import LoopState
    from magic_jax.update.state import TrainState


@dataclasses.dataclass
class StepDone:
    """A finished training step, as its hooks see it.

    Attributes:
      step: the steps done (the finished step's number + 1).
      state: the train state after its update.
      record: its line of ``metrics.jsonl``.
      ended: why its stage ends after it (the step budget or an ``until`` rule;
        an evaluation hook may set it), or None.
      last_stage: the stage is the run's last one.
      loop: where the loop stands (its stage progress, the newest checkpoint).
      pool: the run's verifier pool.
    """

    step: int
    state: TrainState
    record: JSON
    ended: str | None
    last_stage: bool
    loop: LoopState
    pool: Verifiers


class Hook(NamedTuple):
    """``fn`` after every ``every``-th step (None: never by count) or when ``also`` holds."""

    fn: Callable[[StepDone], None]
    every: int | None
    also: Callable[[StepDone], bool] | None

    def due(self, done: StepDone) -> bool:
        by_count = self.every is not None and done.step % self.every == 0
        return by_count or (self.also is not None and self.also(done))


class StepHooks:
    """The hooks of a run, in the order they run."""

    def __init__(self) -> None:
        self.hooks: list[Hook] = []

    def add(
        self,
        fn: Callable[[StepDone], None],
        *,
        every: int | None = 1,
        also: Callable[[StepDone], bool] | None = None,
    ) -> None:
        """Runs ``fn`` after each step whose count is a multiple of ``every`` (None:
        never by count), or for which ``also`` holds."""
        if every is not None and every <= 0:
            raise ValueError(f"a hook's every must be a positive step count, got {every}")
        self.hooks.append(Hook(fn, every, also))

    def run(self, done: StepDone) -> None:
        """Runs the hooks due after ``done``, in order."""
        for hook in self.hooks:
            if hook.due(done):
                hook.fn(done)
