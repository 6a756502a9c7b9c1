"""Stages of the multi-stage schedule: when one ends, building the next, what changes.

A stage (SPEC item 9) fixes the response limit T, the batch sizes D_R / D_T / G,
its KL weight and a step budget. The train state (weights, optimizer, entropy
controller, step) carries across stages; what a new stage changes is built
here: its prompt set (online filtering drops the prompts solved every time in
the previous stage, SPEC item 10), its prompt order, its decode engine and its
jitted update step. A stage ends on its step budget or earlier on its
``until`` rules; ``StageProgress`` tracks where the run is and is saved with every
checkpoint, so a resumed run switches stages at the same steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from magic_jax.data.rows import AccuracyTracker, PromptRow, online_filter, prompt_batches
from magic_jax.run.config import StageConfig, TrainConfig
from magic_jax.run.rundir import JSON  # what ``StageProgress`` and ``LoopState`` store

if TYPE_CHECKING:
    from pathlib import Path

    from magic_jax.rollout.collect import Collected
    from magic_jax.rollout.driver import RolloutDriver
    from magic_jax.rollout.partial import StepStore
    from magic_jax.rollout.protocols import Driver, Params, Tokenizer, Verifiers
    from magic_jax.run.inputs import RunInputs
    from magic_jax.update.buffer import RolloutBuffer
    from magic_jax.update.config import UpdateConfig
    from magic_jax.update.token_classes import TokenMask
    from magic_jax.update.updater import Updater


class BatchSource(Protocol):
    """The prompts of each step of a stage, by step: element k is stage step k's
    (``data.prompt_batches``, a ``grain.MapDataset``, is one)."""

    def __getitem__(self, k: int) -> Sequence[PromptRow]: ...


@dataclasses.dataclass
class Stage:
    """The working parts of one stage.

    Attributes:
      index: position in ``TrainConfig.stages``.
      config: the stage's options.
      rows: its prompts (after online filtering).
      excluded: uids dropped by online filtering up to this stage (saved with checkpoints).
      batches: ``prompt_batches``: element k is stage step k's prompts (this
        host's slice of them in a multi-host run).
      refill_batches: with ``rollout.refill``, element ``k * R + r - 1`` is the
        prompts of refill round r of stage step k (R = ``refill_max_rounds``);
        a second order of the same prompts, so every round is a function of
        (k, r) alone and a resumed run samples the same. None without refill.
      driver: the ``RolloutDriver`` over an engine with this stage's T.
      updater: the ``PolicyUpdater`` with this stage's D_T and loss options.
      entropy_tokens: with ``entropy.tokens``, its ``token_classes.TokenMask`` (built
        by ``pack_step`` at the stage's first step; it caches each id's text).
    """

    index: int
    config: StageConfig
    rows: list[PromptRow]
    excluded: list[str]
    batches: BatchSource
    driver: RolloutDriver
    updater: Updater
    refill_batches: BatchSource | None = None
    entropy_tokens: TokenMask | None = None

    def describe(self) -> str:
        """One log line: the stage's shape and prompt count."""
        st = self.config
        return (
            f"[stage {self.index}{' ' + st.name if st.name else ''}] T {st.max_response_length}, "
            f"D_R {st.prompts_per_step}, D_T {st.mini_batch_groups}, G {st.group_size}, "
            f"{st.steps} steps; {len(self.rows)} prompts "
            f"({len(self.excluded)} dropped by online filtering)"
        )


def update_config(config: TrainConfig, index: int) -> UpdateConfig:
    """The ``UpdateConfig`` of stage ``index``: the run's ``update`` options with the
    stage's D_T and KL weight."""
    from magic_jax.update.config import UpdateConfig

    st = config.stages[index]
    return UpdateConfig.of(
        config.update,
        mini_batch_groups=st.mini_batch_groups,
        loss=dataclasses.replace(config.loss, kl_beta=config.kl_beta(index)),
        entropy=config.entropy,
        optimizer=config.optimizer,
    )


def pack_step(
    config: TrainConfig, stage: Stage, got: Collected, tokenizer: Tokenizer, pad_id: int
) -> RolloutBuffer:
    """The rollout buffer of one step of ``stage``: the collected groups ``got`` with
    their advantages, padded to the stage's shapes, and with ``entropy.tokens`` set its
    ``entropy_mask`` (token ids decoded by ``tokenizer``, each once per stage).
    """
    import numpy as np

    from magic_jax.rollout.collect import flatten
    from magic_jax.update.buffer import pack_rollouts
    from magic_jax.update.token_classes import TokenMask

    st = stage.config
    if config.entropy.tokens is not None and stage.entropy_tokens is None:
        stage.entropy_tokens = TokenMask(config.entropy.tokens, tokenizer.decode)
    samples, rewards = flatten(got.groups)
    return pack_rollouts(
        samples,
        rewards,
        group_size=st.group_size,
        num_groups=st.prompts_per_step,
        advantages=np.concatenate(got.advantages),
        prompt_bucket=min(64, config.data.max_prompt_length),
        response_bucket=min(256, st.max_response_length),
        pad_id=pad_id,
        entropy_tokens=stage.entropy_tokens,
    )


def build_stage(
    config: TrainConfig, index: int, inputs: RunInputs, excluded: Sequence[str]
) -> Stage:
    """Builds stage ``index``: its prompts, prompt order, rollout driver and updater.

    Args:
      config: the run.
      index: the stage.
      inputs: the run's prompts (after offline filtering), policy (the engine takes its
        graph and shapes, not its weights), training mesh and, when other devices
        generate (``rollout.devices``), the rollout mesh.
      excluded: uids online filtering has dropped so far.
    """
    import jax

    from magic_jax.rollout.driver import make_driver
    from magic_jax.update.updater import PolicyUpdater

    st, mesh = config.stages[index], inputs.mesh
    kept = online_filter(inputs.rows, set(excluded))
    seed = config.seed + 1000 * index
    # each host reads its own slice of every step's prompts (scoring.score_groups gathers)
    hosts = dict(process_index=jax.process_index(), process_count=jax.process_count())
    batches = prompt_batches(kept, st.prompts_per_step, seed=seed, **hosts)
    refill = None
    if config.rollout.refill:
        refill = prompt_batches(kept, st.prompts_per_step, seed=seed + 500, **hosts)
    driver = make_driver(
        inputs.model,
        config.rollout,
        max_prompt_length=config.data.max_prompt_length,
        max_response_length=st.max_response_length,
        sampling=config.sampling,
        mesh=mesh if inputs.rollout_mesh is None else inputs.rollout_mesh,
    )
    updater = PolicyUpdater(inputs.graphdef, update_config(config, index), mesh=mesh)
    return Stage(index, st, kept, list(excluded), batches, driver, updater, refill)


@dataclasses.dataclass(frozen=True)
class StepSampler:
    """How a step's groups are made and kept, the same in every rollout source and in
    either process of a two-process job: the step's rounds sampled and scored
    (``collect``), its groups kept as they finish behind the run directory's fence
    (``store``).

    Attributes:
      config: the run's.
      tokenizer: decodes responses for the verifiers.
      pool: the verifiers.
      out: the run directory (where finished groups are kept).
      log: where the store's lines go.
      names_step: ``collect`` names its step to ``interrupt.at`` (a rollout process,
        whose test hooks name the step it generates; the trainer names its own).
    """

    config: TrainConfig
    tokenizer: Tokenizer
    pool: Verifiers
    out: Path
    log: Callable[[str], None]
    names_step: bool = False

    def store(self, step: int, stage: Stage) -> StepStore:
        """Step ``step``'s groups kept as they finish (``rollout.partial``)."""
        from magic_jax.rollout.partial import StepStore
        from magic_jax.run.fence import check_fence

        limit = stage.config.max_response_length
        return StepStore(self.out, step, limit=limit, log=self.log, fence=check_fence)

    def collect(
        self,
        stage: Stage,
        step: int,
        k: int,
        driver: Driver,
        params: Params,
        store: StepStore | None,
    ) -> Collected:
        """Global step ``step``'s (stage step ``k``'s) groups: ``collect_groups`` of its
        rounds (the step's own prompts, then its refill rounds' with ``rollout.refill``),
        sampled by ``driver`` with ``params``, scored by the pool, kept in ``store``."""
        import jax

        from magic_jax import interrupt
        from magic_jax.rollout.collect import CollectSpec, collect_groups
        from magic_jax.rollout.scoring import Scoring

        if self.names_step:
            interrupt.at(step)
        st, ro = stage.config, self.config.rollout
        rounds = [stage.batches[k]]
        if ro.refill:
            assert stage.refill_batches is not None, "built with rollout.refill"
            first, n = k * ro.refill_max_rounds, ro.refill_max_rounds
            rounds += [stage.refill_batches[first + r] for r in range(n)]
        per_host = jax.process_count() > 1
        scoring = Scoring(self.tokenizer, self.pool, ro.truncation, per_host=per_host)
        spec = CollectSpec(
            scoring,
            st.group_size,
            st.prompts_per_step,
            self.config.advantage,
            self.config.seed,
            ro.refill,
        )
        return collect_groups(driver, params, rounds, spec, step=step, saved=store)


def planned_stage(config: TrainConfig, step: int) -> StageConfig:
    """The stage global step ``step + 1`` belongs to by the step budgets (``until`` rules
    may end a stage sooner); the last stage after the last step."""
    end = 0
    for st in config.stages:
        end += st.steps
        if step < end:
            return st
    return config.stages[-1]


def excluded_after(
    config: TrainConfig, excluded: Sequence[str], tracker: AccuracyTracker
) -> list[str]:
    """The uids the next stage drops: those dropped so far, plus (with
    ``data.online_filter``) the prompts solved every time in the stage that ended."""
    if not config.data.online_filter:
        return list(excluded)
    return sorted(set(excluded) | tracker.solved())


@dataclasses.dataclass
class StageProgress:
    """Where the run is in its stages, and the state of the current stage's ``until`` rules.

    Plain JSON (``state_dict``), stored in each checkpoint's trainer state under
    ``"schedule"``.

    Attributes:
      index: the current stage (``len(stages)`` once the last one ended).
      start: the global step at which it began; stage step k = step - start.
      low_truncation_steps: consecutive steps with the truncated fraction under
        ``until.truncated_below``.
      best_eval: the best avg@n of the stage so far (None before its first evaluation).
      evals_without_gain: evaluations in a row without a gain over ``best_eval``.
      switches: every stage end so far: ``{"stage", "step", "reason"}``.
    """

    index: int = 0
    start: int = 0
    low_truncation_steps: int = 0
    best_eval: float | None = None
    evals_without_gain: int = 0
    switches: list[JSON] = dataclasses.field(default_factory=list)

    def finished(self, config: TrainConfig) -> bool:
        return self.index >= len(config.stages)

    def stage_step(self, step: int) -> int:
        """k, the step within the current stage, of global step ``step``."""
        return step - self.start

    def after_step(
        self, config: TrainConfig, next_step: int, truncated_fraction: float
    ) -> str | None:
        """Counts a finished step; returns why the stage ends now, or None.

        Args:
          config: the run.
          next_step: the global step that comes next (the finished one + 1).
          truncated_fraction: the finished step's fraction of truncated responses.
        """
        st = config.stages[self.index]
        until = st.until
        if until is not None and until.truncated_below is not None:
            low = truncated_fraction < until.truncated_below
            self.low_truncation_steps = self.low_truncation_steps + 1 if low else 0
            if self.low_truncation_steps >= until.truncated_steps:
                return (
                    f"truncated fraction under {until.truncated_below} for "
                    f"{until.truncated_steps} step(s)"
                )
        if next_step - self.start >= st.steps:
            return f"step budget of {st.steps}"
        return None

    def after_eval(self, config: TrainConfig, accuracy: float) -> str | None:
        """Counts an evaluation of the current stage; returns why the stage ends now, or None."""
        if self.finished(config):
            return None
        until = config.stages[self.index].until
        if until is None or until.eval_patience is None:
            return None
        if self.best_eval is None or accuracy > self.best_eval + until.eval_min_gain:
            self.best_eval = accuracy
            self.evals_without_gain = 0
            return None
        self.evals_without_gain += 1
        if self.evals_without_gain >= until.eval_patience:
            return f"no eval gain for {until.eval_patience} evaluation(s)"
        return None

    def advance(self, step: int, reason: str) -> None:
        """Ends the current stage at global step ``step``; the next one starts there."""
        self.switches.append({"stage": self.index, "step": step, "reason": reason})
        self.index += 1
        self.start = step
        self.low_truncation_steps = 0
        self.best_eval = None
        self.evals_without_gain = 0

    def state_dict(self) -> JSON:
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, state: JSON) -> StageProgress:
        return cls(**state)


@dataclasses.dataclass
class LoopState:
    """Where the training loop is, beside the train state; saved as a checkpoint's
    ``trainer.json`` (``meta``) and read back on resume (``from_meta``).

    Attributes:
      step: the next global step.
      schedule: the stage and its ``until`` rules' counters.
      tracker: the current stage's per-prompt accuracy (for online filtering).
      excluded: uids dropped by online filtering so far.
      saved: the newest checkpoint's step (a resumed loop's: the step it resumes at).
      kept_from: the oldest step whose groups, kept as they finished, are still needed.
    """

    step: int = 0
    schedule: StageProgress = dataclasses.field(default_factory=StageProgress)
    tracker: AccuracyTracker = dataclasses.field(default_factory=AccuracyTracker)
    excluded: list[str] = dataclasses.field(default_factory=list)
    saved: int = 0
    kept_from: int = 0

    def end_stage(self, config: TrainConfig, reason: str) -> None:
        """The stage switch at ``step``: online filtering, fresh statistics."""
        self.schedule.advance(self.step, reason)
        self.excluded = excluded_after(config, self.excluded, self.tracker)
        self.tracker.reset()

    def meta(self) -> JSON:
        """Plain JSON for ``trainer.json``."""
        return {
            "next_step": self.step,
            "stage": self.schedule.index,
            "excluded": list(self.excluded),
            "tracker": self.tracker.state_dict(),
            # stage switches (until rules) and the rules' counters, so a resume switches alike
            "schedule": self.schedule.state_dict(),
        }

    @classmethod
    def from_meta(cls, meta: JSON) -> LoopState:
        """The loop state of a checkpoint's ``trainer.json`` (checked by
        ``checkpoint.read_trainer_state``)."""
        step = meta["next_step"]
        return cls(
            step=step,
            saved=step,
            kept_from=step,
            schedule=StageProgress.from_state_dict(meta["schedule"]),
            tracker=AccuracyTracker.from_state_dict(meta["tracker"]),
            excluded=list(meta["excluded"]),
        )
