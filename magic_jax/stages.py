"""Stages of the multi-stage schedule: building one, and what changes from one to the next.

A stage (SPEC item 9) fixes the response limit T, the batch sizes D_R / D_T / G
and a step budget. The train state (weights, optimizer, entropy controller,
step) carries across stages; what a new stage changes is built here: its
prompt set (online filtering drops the prompts solved every time in the
previous stage, SPEC item 10), its prompt order, its decode engine and its
jitted update step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from magic_jax.config import StageConfig, TrainConfig
from magic_jax.data import AccuracyTracker, PromptRow, online_filter, prompt_batches


@dataclasses.dataclass
class Stage:
    """The working parts of one stage.

    Attributes:
      index: position in ``TrainConfig.stages``.
      config: the stage's options.
      rows: its prompts (after online filtering).
      excluded: uids dropped by online filtering up to this stage (saved with checkpoints).
      batches: ``prompt_batches``: element k is stage step k's prompts.
      driver: the ``RolloutDriver`` over an engine with this stage's T.
      updater: the ``PolicyUpdater`` with this stage's D_T and loss options.
    """

    index: int
    config: StageConfig
    rows: list[PromptRow]
    excluded: list[str]
    batches: Any
    driver: Any
    updater: Any

    def describe(self) -> str:
        """One log line: the stage's shape and prompt count."""
        st = self.config
        return (
            f"[stage {self.index}{' ' + st.name if st.name else ''}] T {st.max_response_length}, "
            f"D_R {st.prompts_per_step}, D_T {st.mini_batch_groups}, G {st.group_size}, "
            f"{st.steps} steps; {len(self.rows)} prompts "
            f"({len(self.excluded)} dropped by online filtering)"
        )


def update_config(config: TrainConfig, index: int) -> Any:
    """The ``UpdateConfig`` of stage ``index``: its D_T and KL weight, the run's other options."""
    from magic_jax.train_step import UpdateConfig

    st = config.stages[index]
    return UpdateConfig(
        mini_batch_groups=st.mini_batch_groups,
        mini_batch_split=config.mini_batch_split,
        micro_batch_size=config.micro_batch_size,
        num_reuse=config.num_reuse,
        loss=dataclasses.replace(config.loss, kl_beta=config.kl_beta(index)),
        entropy=config.entropy,
        optimizer=config.optimizer,
    )


def build_stage(
    config: TrainConfig,
    index: int,
    rows: Sequence[PromptRow],
    excluded: Sequence[str],
    *,
    graphdef: Any,
    mesh: Any,
    make_engine: Callable[[int], Any],
) -> Stage:
    """Builds stage ``index``: its prompts, prompt order, rollout driver and updater.

    Args:
      config: the run.
      index: the stage.
      rows: every training prompt of the run (after offline filtering).
      excluded: uids online filtering has dropped so far.
      graphdef: the policy's ``nnx.GraphDef``.
      mesh: the training mesh, or None.
      make_engine: response limit T -> a decode engine with the run's slots and sampling.
    """
    from magic_jax.rollout import RolloutDriver
    from magic_jax.train_step import PolicyUpdater

    st = config.stages[index]
    kept = online_filter(rows, set(excluded))
    batches = prompt_batches(kept, st.prompts_per_step, seed=config.seed + 1000 * index)
    driver = RolloutDriver(make_engine(st.max_response_length))
    updater = PolicyUpdater(graphdef, update_config(config, index), mesh=mesh)
    return Stage(index, st, kept, list(excluded), batches, driver, updater)


def excluded_after(
    config: TrainConfig, excluded: Sequence[str], tracker: AccuracyTracker
) -> list[str]:
    """The uids the next stage drops: those dropped so far, plus (with
    ``data.online_filter``) the prompts solved every time in the stage that ended."""
    if not config.data.online_filter:
        return list(excluded)
    return sorted(set(excluded) | tracker.solved())
