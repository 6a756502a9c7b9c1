"""Where a training step's rollouts come from: one small interface, two implementations.

``SyncRollouts`` samples step k's groups with the weights after k updates, then the
update runs (``rollout.mode: sync``). ``overlap.OverlapRollouts`` takes them from a
producer thread that generated them during the last updates (``rollout.mode:
overlap``). The trainer's step is the same code for both: it asks ``rollout`` for
the step's groups, packs them (``annotate`` adds what the loss needs of their
versions), updates, and tells the source the new version (``updated``); a
checkpoint holds what ``checkpoint_item`` gives and is restored into
``checkpoint_template``, then handed back to ``resume``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from magic_jax.rollout.collect import Collected
    from magic_jax.rollout.protocols import Params
    from magic_jax.rollout.scoring import Group
    from magic_jax.run.rundir import JSON
    from magic_jax.run.stages import Stage, StepSampler
    from magic_jax.run.versions import Checkpointed
    from magic_jax.update.buffer import RolloutBuffer
    from magic_jax.update.state import TrainState


class StepRollout(NamedTuple):
    """One step's rollouts, as the trainer's step uses them.

    Attributes:
      got: the step's groups (``collect.Collected``).
      metrics: what the source adds to the step's metrics line (overlap: staleness).
      other_s: seconds of the rollout phase that were not sampling (sync: the wait for
        the verifiers after decoding), counted as ``t_other_s``.
      saved: the groups were kept on disk as they finished, so a stop may cut the
        update short (the step is redone from them on resume).
    """

    got: Collected
    metrics: JSON
    other_s: float
    saved: bool


class StepRollouts(Protocol):
    """What the trainer's step needs of a source of rollouts (sync or overlap)."""

    def checkpoint_template(self, state: TrainState) -> TrainState | Checkpointed:
        """What a checkpoint holds, shaped like ``state`` (to restore into)."""
        ...

    def resume(self, restored: TrainState | Checkpointed, step: int) -> TrainState:
        """The train state of ``restored`` (``checkpoint_template``'s shape), with the
        source ready to give step ``step``'s rollouts."""
        ...

    def kept_steps(self, step: int, first: int, end: int) -> Sequence[int]:
        """The steps whose saved groups are kept when step ``step`` follows a checkpoint
        (``first``: the oldest still needed; ``end``: the run's last step)."""
        ...

    def rollout(
        self,
        stage: Stage,
        step: int,
        k: int,
        state: TrainState,
        sampler: StepSampler,
        *,
        resumed: bool,
        end: int,
    ) -> StepRollout:
        """Step ``step``'s (stage step ``k``'s) groups, made by ``sampler``; ``resumed``:
        the step follows a checkpoint (its groups may be kept as they finish, in
        ``sampler.store``)."""
        ...

    def annotate(self, buffer: RolloutBuffer, groups: Sequence[Group], step: int) -> RolloutBuffer:
        """``buffer`` (packed from ``groups``) with what the loss needs of its versions."""
        ...

    def updated(self, version: int, params: Params) -> None:
        """The update made ``version`` (the weights after that many updates)."""
        ...

    def checkpoint_item(self, state: TrainState, step: int) -> TrainState | Checkpointed:
        """What the checkpoint after ``step`` updates saves."""
        ...

    def close(self) -> list[int]:
        """Stops whatever runs in the background; returns steps generated and not taken."""
        ...


class SyncRollouts:
    """Step k's groups sampled now, with the weights after k updates (``rollout.mode: sync``)."""

    def checkpoint_template(self, state: TrainState) -> TrainState:
        return state

    def resume(self, restored: TrainState | Checkpointed, step: int) -> TrainState:
        from magic_jax.run.versions import Checkpointed

        # what comes back has the template's shape: the train state itself
        return restored.train_state() if isinstance(restored, Checkpointed) else restored

    def kept_steps(self, step: int, first: int, end: int) -> Sequence[int]:
        # this step's and, until its checkpoint is whole, the previous checkpoint's
        return (step, first)

    def rollout(
        self,
        stage: Stage,
        step: int,
        k: int,
        state: TrainState,
        sampler: StepSampler,
        *,
        resumed: bool,
        end: int,
    ) -> StepRollout:
        store = sampler.store(step, stage) if resumed else None
        params = stage.driver.load_params(state.params)
        got = sampler.collect(stage, step, k, stage.driver, params, store)
        return StepRollout(got, {}, got.wait_s, store is not None)

    def annotate(self, buffer: RolloutBuffer, groups: Sequence[Group], step: int) -> RolloutBuffer:
        return buffer

    def updated(self, version: int, params: Params) -> None:
        pass

    def checkpoint_item(self, state: TrainState, step: int) -> TrainState:
        return state

    def close(self) -> list[int]:
        return []
