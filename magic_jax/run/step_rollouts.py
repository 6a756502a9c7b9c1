"""Where a training step's rollouts come from: one base class, three sources.

``SyncRollouts`` samples step k's groups with the weights after k updates, then the
update runs (``rollout.mode: sync``). ``overlap.OverlapRollouts`` takes them from a
producer thread that generated them during the last updates (``rollout.mode:
overlap``), ``remote.RemoteRollouts`` from a rollout process. The trainer's step is
the same code for all: it asks ``rollout`` for the step's groups, packs them (each
token's staleness where the samples name the version that drew them), updates, and
tells the source the new version (``updated``). ``RolloutSource``'s defaults are a
source that keeps nothing of its own: a checkpoint holds the train state alone, and
nothing runs in the background; the overlap sources override them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from magic_jax.rollout.collect import Collected
    from magic_jax.rollout.protocols import Params
    from magic_jax.run.rundir import JSON
    from magic_jax.run.stages import Stage, StepSampler
    from magic_jax.run.versions import Checkpointed
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


class StepAt(NamedTuple):
    """Where a step's rollout stands in the run.

    Attributes:
      stage: the stage it belongs to.
      step: the global step.
      k: the step within the stage.
      end: the run's last step + 1 (``stop_after`` or the last stage's end).
      resumed: the step follows a checkpoint, so its groups are kept as they finish
        (``StepSampler.store``) and a stop may cut its update short.
    """

    stage: Stage
    step: int
    k: int
    end: int
    resumed: bool


class RolloutSource:
    """What the trainer's step needs of a source of rollouts.

    Attributes:
      keeps_ahead: its groups of later steps are kept too when a step resumes (a
        producer generates ahead of the update).
    """

    keeps_ahead = False

    def rollout(self, at: StepAt, state: TrainState, sampler: StepSampler) -> StepRollout:
        """Step ``at.step``'s groups, made by ``sampler`` (``state``: the weights after
        ``at.step`` updates)."""
        raise NotImplementedError

    def updated(self, version: int, params: Params) -> None:
        """The update made ``version`` (the weights after that many updates): a source
        that samples with the state it is given has nothing to do."""

    def checkpoint_template(self, state: TrainState) -> TrainState | Checkpointed:
        """What a checkpoint holds, shaped like ``state`` (to restore into)."""
        return state

    def resume(self, restored: TrainState | Checkpointed, step: int) -> TrainState:
        """The train state of ``restored`` (``checkpoint_template``'s shape), with the
        source ready to give step ``step``'s rollouts."""
        from magic_jax.run.versions import Checkpointed

        # a checkpoint of a run with lagged versions, resumed in sync mode: its state
        return restored.train_state() if isinstance(restored, Checkpointed) else restored

    def checkpoint_item(self, state: TrainState, step: int) -> TrainState | Checkpointed:
        """What the checkpoint after ``step`` updates saves."""
        return state

    def close(self) -> list[int]:
        """Stops whatever runs in the background; returns steps generated and not taken."""
        return []


class SyncRollouts(RolloutSource):
    """Step k's groups sampled now, with the weights after k updates (``rollout.mode: sync``)."""

    def rollout(self, at: StepAt, state: TrainState, sampler: StepSampler) -> StepRollout:
        store = sampler.store(at.step, at.stage) if at.resumed else None
        driver = at.stage.driver
        params = driver.load_params(state.params)
        got = sampler.collect(at.stage, at.step, at.k, driver, params, store)
        return StepRollout(got, {}, got.wait_s, store is not None)
