"""The MAGIC training loop: stages, rollouts, rewards, updates, metrics, checkpoints, resume.

One training step (SPEC items 1-12, ``Trainer._step``): take step k's D_R prompts,
sample G responses each (each finished response goes to the verifier pool at
once), pack the rollout buffer with group advantages and rejection sampling, run
the N_SGD optimizer steps of ``PolicyUpdater.update`` (the adaptive entropy
coefficient, the KL reference), make the step's record. Then the hooks due after
it (``hooks``): the record written, evaluation, the stage switch (online
filtering), a checkpoint. Stages change the response limit, the batch sizes and
the KL weight, and end on their step budget or ``until`` rules.

A checkpoint holds the train state and the loop's own state (``LoopState``:
``trainer.json``); a run started in a directory with checkpoints resumes from the
newest one that verifies, and computes what the uninterrupted run would have
(step k's prompts and sampling keys are functions of k alone). The run directory
is claimed and locked for the run (``rundir``); SIGINT and SIGTERM stop the loop
at its next safe point with a checkpoint. Multi-host (``mesh`` set): every
process runs this loop (``magic_jax.distributed``); process 0 alone writes records.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from magic_jax import distributed, interrupt, storage, watchdog
from magic_jax.run import rundir
from magic_jax.run.config import ConfigError, TrainConfig
from magic_jax.run.config_dict import to_dict
from magic_jax.run.evaluation import Evaluator
from magic_jax.run.hooks import StepDone, StepHooks
from magic_jax.run.inputs import load_inputs
from magic_jax.run.policy import export_policy, reference_params
from magic_jax.run.resume import newest_good_checkpoint, open_run_dir, resume_from
from magic_jax.run.rundir import JSON
from magic_jax.run.stages import (
    LoopState,
    Stage,
    StepSampler,
    build_stage,
    pack_step,
    update_config,
)
from magic_jax.run.step_rollouts import RolloutSource, StepAt, StepRollout, SyncRollouts
from magic_jax.run.step_row import format_eval, format_row, step_row

if TYPE_CHECKING:
    from types import TracebackType

    from magic_jax.rollout.collect import Collected
    from magic_jax.rollout.protocols import Verifiers
    from magic_jax.run.checkpoint import TrainCheckpoints
    from magic_jax.run.monitor import Monitor
    from magic_jax.run.profile import StepProfiler
    from magic_jax.run.remote import Side
    from magic_jax.update.buffer import RolloutBuffer
    from magic_jax.update.state import TrainState
    from magic_jax.update.updater import Metrics

logger = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
EVALS = "eval.jsonl"


class Trainer:
    """Runs a ``TrainConfig`` to the end of its last stage, resuming if it can.

    Everything a run holds beyond its config is made in ``_open``, once, before the
    first step; each step is ``_step``, the same code in sync and overlap mode (the
    difference is the ``step_rollouts.RolloutSource`` it takes its groups from).

    Example:
      summary = Trainer(load_config("configs/default.yaml")).run()
    """

    def __init__(self, config: TrainConfig, *, log: Callable[[str], None] = print):
        self.config = config
        self.out = storage.path(config.output_dir, what="output_dir")
        self._print = log
        self.monitor: Monitor | None = None
        self.remote: Side | None = None  # this process's side of a rollout.hosts job
        self.seam_key: bytes | None = None  # the run's key for the rollout process
        self.rollouts: RolloutSource = SyncRollouts()  # until ``_open`` makes the run's
        self.said_farewell = False

    def log(self, line: str) -> None:
        """One line of the run's output (above the progress bar once the run has one)."""
        (self._print if self.monitor is None else self.monitor.write)(line)

    def _stage(self, index: int, excluded: list[str]) -> Stage:
        stage = build_stage(self.config, index, self.inputs, excluded)
        self.log(stage.describe())
        return stage

    def run(self, *, stop_after: int | None = None) -> JSON:
        """Trains to the end of the last stage; returns a summary (also in ``summary.json``).

        The output directory is claimed (``rundir.claim_run_dir``) and locked
        for the run. A run that finished all its steps before says so and
        changes nothing. A resumed run checks its config against the stored one
        (``rundir.check_resume_config``) and continues from the newest
        checkpoint that verifies.

        Args:
          stop_after: stop (with a checkpoint) once this global step count is
            reached, e.g. to split a run into jobs; the next ``run`` resumes.

        Returns:
          The summary, built from the run directory's records;
          ``summary["stopped_by"]`` names the signal that stopped the run early.

        Raises:
          ConfigError: a bad ``stop_after`` or a config or data problem.
          RunDirError: the directory is not usable (not ours, locked, a changed
            config, no usable checkpoint).
        """
        from magic_jax.model.sharding import maybe_initialize_distributed

        cfg = self.config
        if stop_after is not None and stop_after <= 0:
            raise ConfigError(f"stop_after must be a positive number of steps, got {stop_after}")
        self.remote = None
        self.seam_key = None
        if cfg.rollout.hosts is not None:  # two runtimes: process 0 generates, 1 updates
            from magic_jax.run import remote, rollout_worker

            self.remote = remote.side_of(cfg)
            if self.remote.generates:
                return rollout_worker.serve(cfg, self.remote, load_inputs, log=self.log)
            return self._in_run_dir(stop_after)
        if cfg.mesh is not None:
            # before anything asks jax for devices or the process index
            maybe_initialize_distributed()
        return self._in_run_dir(stop_after)

    def _in_run_dir(self, stop_after: int | None) -> JSON:
        """``run`` once this process's runtime is up: claims the directory and trains."""
        cfg = self.config
        raw = to_dict(cfg)
        with contextlib.ExitStack() as stack:
            # Process 0 claims, locks and checks the directory; the others start once it
            # has (on_primary is a barrier) and never write into it themselves.
            finished = distributed.on_primary(
                lambda: open_run_dir(
                    self.out, raw, stack, total_steps=cfg.total_steps, log=self.log
                )
            )
            if self.remote is not None:  # the key the rollout process knows this one by
                from magic_jax.run import channel

                self.seam_key = channel.write_key(self.out)
                stack.callback(channel.remove_key, self.out)
                stack.push(self._farewell)
            if finished:
                self._farewell(None, None, None)
                return rundir.finished_summary(self.out, cfg.total_steps) or {}
            signals = stack.enter_context(rundir.StopSignals())
            end = cfg.total_steps if stop_after is None else min(stop_after, cfg.total_steps)
            try:
                return self._run(end, signals)
            except interrupt.Interrupted as e:
                if self.remote is None or self._said_hello():
                    raise
                # a stop while it waited for the rollout process: it stops too
                self.log(f"[stop] {e}")
                self._farewell(None, None, None, e.signum)
                return {"stopped_by": signal.Signals(e.signum).name}

    def _monitor(self) -> Monitor:
        assert self.monitor is not None, "made by _open"
        return self.monitor

    def _said_hello(self) -> bool:
        """This trainer said hello to the rollout process of a ``rollout.hosts`` job."""
        from magic_jax.run.remote import RemoteRollouts

        return isinstance(self.rollouts, RemoteRollouts) and self.rollouts.connected

    def _farewell(
        self,
        _type: type[BaseException] | None,
        error: BaseException | None,
        _tb: TracebackType | None,
        signum: int = 0,
    ) -> bool:
        """Tells the rollout process of a ``rollout.hosts`` job that this one ends before
        its hello: the run had finished, a stop, or ``error`` (an exit callback of the run
        directory's stack: said before its key goes and its lock is released)."""
        from magic_jax.run.remote import farewell

        if self.remote is None:  # one process: no rollout process to tell
            return False
        if not self._said_hello() and not self.said_farewell:
            self.said_farewell = True
            farewell(self.remote, self.seam_key, error, signum)
        return False

    def _open(self, end: int) -> tuple[TrainState, LoopState]:
        """Makes what the run holds (the one place the trainer's state is made): its
        inputs, the KL reference, the source of its rollouts, checkpoints, monitor,
        profiler and evaluator; resumes from the newest good checkpoint, if any.
        Returns the train state and where the loop stands."""
        from magic_jax.run.checkpoint import TrainCheckpoints
        from magic_jax.run.monitor import Monitor
        from magic_jax.run.overlap import OverlapRollouts
        from magic_jax.run.profile import StepProfiler
        from magic_jax.update.state import init_train_state

        cfg = self.config
        self.inputs, params = load_inputs(cfg, log=self.log)
        # the KL reference: the initial weights (copied before any update) or loss.kl_reference
        self.ref_params = reference_params(cfg, params, self.inputs.mesh)
        if self.ref_params is not None:
            self.log(f"[kl] reference policy: {cfg.loss.kl_reference or 'the initial weights'}")
        state = init_train_state(params, update_config(cfg, 0), mesh=self.inputs.mesh)
        del params  # the train state owns the weights now
        source: type[OverlapRollouts] = OverlapRollouts
        kw: dict[str, object] = {}
        if self.remote is not None:  # another process generates
            from magic_jax.run.remote import RemoteRollouts

            source = RemoteRollouts
            kw = {"side": self.remote, "config": to_dict(cfg), "key": self.seam_key}
        overlap = source.of(
            cfg.rollout,
            cfg.loss.tis_cap,
            behaviour_clip=cfg.loss.behaviour_clip,
            log=self.log,
            **kw,
        )
        # the base class: the checkpoint item's shape is the source's own
        rollouts: RolloutSource = SyncRollouts() if overlap is None else overlap
        self.rollouts = rollouts
        self.ckpts: TrainCheckpoints = TrainCheckpoints(self.out, keep=cfg.keep_checkpoints)
        found = newest_good_checkpoint(self.out, log=self.log)
        restore_into = self.rollouts.checkpoint_template(state)
        restored, loop = resume_from(self.out, found, self.ckpts, restore_into, log=self.log)
        state = self.rollouts.resume(restored, loop.step)
        self.end = end
        self.stage: Stage | None = None
        self.monitor = Monitor(
            self.out,
            stage_steps=[s.steps for s in cfg.stages],
            start_step=loop.step,
            log=self._print,
            primary=distributed.is_primary(),
        )
        self.profiler: StepProfiler = StepProfiler(self.out, cfg.profile_steps, log=self.log)
        self.evaluator: Evaluator | None = None
        if cfg.eval is not None:
            self.evaluator = Evaluator(cfg, self.inputs, log=self.log)
        return state, loop

    def _run(self, end: int, signals: rundir.StopSignals) -> dict[str, object]:
        """Trains from the newest good checkpoint (or the start) to ``end`` (the last
        stage's end or ``stop_after``) or a stop; returns the summary."""
        from magic_jax.rewards import VerifierPool

        cfg = self.config
        state, loop = self._open(end)
        try:
            # the stop signal every process agrees on (0: none), asked once per step
            stop = distributed.max_int(signals.received or 0)
            counts = _counts(state)  # what the summary says of the state (an update may consume it)
            with (
                self._monitor(),
                VerifierPool(cfg.rewards) as pool,
                self.profiler,
                watchdog.Watchdog(cfg.watchdog_s, self.out),  # watchdog_s: stacks, then exit
            ):
                if not stop:
                    tokenizer = self.inputs.tokenizer
                    sampler = StepSampler(cfg, tokenizer, pool, self.out, self.log)
                    state, stop, counts = self._train(state, loop, sampler, signals)
        finally:
            self.rollouts.close()
            self.ckpts.close()
        return self._summary(state, loop, stop, counts)

    def _train(
        self,
        state: TrainState,
        loop: LoopState,
        sampler: StepSampler,
        signals: rundir.StopSignals,
    ) -> tuple[TrainState, int, dict[str, float]]:
        """The loop: each step (``_step``), then the hooks due after it (``_hooks``),
        until ``self.end``, the last stage's end or a stop; returns (the state, the stop
        signal or 0, the summary's counts of the state)."""
        cfg, schedule = self.config, loop.schedule
        hooks = self._hooks()
        counts, stop = _counts(state), 0
        while loop.step < self.end and not schedule.finished(cfg):
            try:
                if cfg.eval is not None and loop.step == 0:
                    self._evaluate(state, 0, sampler.pool, loop, until=True)
                state, done = self._step(state, loop, sampler)
                hooks.run(done)
                counts = _counts(state)
            except interrupt.Interrupted as e:
                # Only a rollout or an update with its groups saved is cut short
                # (``_step``): the state is that of `step` steps, or checkpointed.
                self.log(f"[stop] {e}: step {loop.step} is redone on resume")
                if loop.saved < loop.step:  # a rollout without saved groups: keep the state
                    self._save(state, loop)
                return state, e.signum, counts
            stop = distributed.max_int(signals.received or 0)
            if not stop and distributed.preemption_notice(loop.step):
                self.log(f"[stop] preemption notice at step {loop.step}")
                stop = int(signal.SIGTERM)
            if stop:
                if loop.saved < loop.step:
                    self._save(state, loop)
                break
        return state, stop, counts

    def _hooks(self) -> StepHooks:
        """What runs after a step, in order: its record; evaluation every ``eval.every``
        steps and at the last stage's end; the stage switch; a checkpoint every
        ``checkpoint_every`` steps, at a stage's end and at the run's."""
        cfg = self.config
        hooks = StepHooks()
        hooks.add(self._record)
        if cfg.eval is not None:
            hooks.add(
                self._evaluate_after, every=cfg.eval.every, also=lambda d: _ends(d) and d.last_stage
            )
        hooks.add(self._switch_stage, every=None, also=_ends)
        hooks.add(
            self._checkpoint,
            every=cfg.checkpoint_every,
            also=lambda d: _ends(d) or d.step == self.end,
        )
        return hooks

    def _summary(
        self, state: TrainState, loop: LoopState, stop: int, counts: dict[str, float]
    ) -> dict[str, object]:
        """The run's summary (written by process 0), with the export of a finished run."""
        cfg, step, schedule = self.config, loop.step, loop.schedule
        summary = rundir.build_summary(
            self.out,
            # a run whose last stage ended on an until rule is finished at that step
            total_steps=step if schedule.finished(cfg) else cfg.total_steps,
            planned_steps=cfg.total_steps,
            **counts,
        )
        if stop:
            name = signal.Signals(stop).name
            summary["stopped_by"] = name
            self.log(
                f"[stop] {name}: stopped at step {step} (checkpoint at step {loop.saved}); "
                f"run the same command to resume"
            )
        elif schedule.finished(cfg) and cfg.export_hf:
            # every process gathers the weights tensor by tensor; process 0 writes them
            export, inputs = self.out / "hf_final", self.inputs
            export_policy(export, inputs.graphdef, state.params, inputs.tokenizer, cfg.export_dtype)
            summary["hf_export"] = str(export)
        if distributed.is_primary():
            rundir.write_summary(self.out, summary)
        return summary

    def _step(
        self, state: TrainState, loop: LoopState, sampler: StepSampler
    ) -> tuple[TrainState, StepDone]:
        """One training step, ``loop.step``: its rollouts (scored as they finish), their
        buffer, the update, the step's record; ``loop.step`` becomes the next step.
        Returns (the new state, the finished step for the hooks).

        Raises:
          interrupt.Interrupted: a stop came during the rollout or the update.
        """
        from magic_jax.run.overlap import clip_by_staleness

        cfg, schedule = self.config, loop.schedule
        if self.stage is None or self.stage.index != schedule.index:
            self.stage = self._stage(schedule.index, loop.excluded)
        stage, step = self.stage, loop.step
        k = schedule.stage_step(step)
        interrupt.at(step)
        with self.profiler.step(step):  # profile_steps: a trace of steps A to B-1
            t0, cpu0 = time.perf_counter(), time.process_time()
            rollout = self._rollout(stage, step, k, state, sampler, loop)
            t1 = time.perf_counter()
            buffer = self._buffer(stage, step, rollout.got)
            t2 = time.perf_counter()
            state, metrics = self._update(stage, step, state, buffer, rollout.saved)
            t3 = time.perf_counter()
        times = {
            "t_rollout_s": t1 - t0 - rollout.other_s,
            "t_update_s": t3 - t2,
            "t_other_s": t2 - t1 + rollout.other_s,
            "t_cpu_s": time.process_time() - cpu0,  # every thread's, verifiers apart
        }
        skipped = int(state.skipped)
        record = step_row(cfg, stage, step, k, rollout.got, metrics, skipped, times)
        record |= rollout.metrics | clip_by_staleness(metrics)
        loop.step = step + 1
        ended = schedule.after_step(cfg, loop.step, record["truncated_fraction"])
        last_stage = schedule.index == len(cfg.stages) - 1
        return state, StepDone(loop.step, state, record, ended, last_stage, loop, sampler.pool)

    def _rollout(
        self,
        stage: Stage,
        step: int,
        k: int,
        state: TrainState,
        sampler: StepSampler,
        loop: LoopState,
    ) -> StepRollout:
        """Step ``step``'s (stage step ``k``'s) groups from the run's rollout source, each
        prompt's rewards counted for online filtering."""
        from magic_jax.rollout import partial

        resumed = step == loop.saved  # a stop resumes here: keep the groups as they finish
        if resumed:
            # this step's groups and, until its checkpoint is whole, the previous one's;
            # with a producer ahead of the update, the steps in flight too
            first, ahead = loop.kept_from, self.rollouts.keeps_ahead
            if distributed.is_primary():
                partial.prune(self.out, keep=range(first, self.end + 1) if ahead else (step, first))
            loop.kept_from = step
        at = StepAt(stage, step, k, self.end, resumed)
        rollout = self.rollouts.rollout(at, state, sampler)
        for group in rollout.got.every:
            loop.tracker.record(group.row.uid, group.rewards)
        return rollout

    def _buffer(self, stage: Stage, step: int, got: Collected) -> RolloutBuffer:
        """The update's buffer of ``got``: advantages and padding, and the staleness of
        each token where its samples say which version drew it (overlap mode)."""
        inputs = self.inputs
        buffer = pack_step(self.config, stage, got, inputs.tokenizer, inputs.pad_id)
        from magic_jax.run.overlap import with_staleness

        versioned = any(s.versions is not None for g in got.groups for s in g.samples)
        return with_staleness(buffer, got.groups, step) if versioned else buffer

    def _update(
        self, stage: Stage, step: int, state: TrainState, buffer: RolloutBuffer, saved: bool
    ) -> tuple[TrainState, Metrics]:
        """Step ``step``'s optimizer steps on ``buffer``; the rollout source is told the
        new version. Cut short by a stop only when the step's groups are ``saved``."""
        import jax

        rng = jax.random.fold_in(jax.random.key(self.config.seed), step)
        with contextlib.nullcontext() if saved else interrupt.deferred():
            state, metrics = stage.updater.update(state, buffer, rng, ref_params=self.ref_params)
        interrupt.kill_point("update", step)  # the update is dispatched, not yet done
        self.rollouts.updated(step + 1, state.params)
        jax.block_until_ready(state.params)
        return state, metrics

    def _record(self, done: StepDone) -> None:
        """The hook of every step: its record in ``metrics.jsonl`` and the progress line."""
        if done.ended is not None:
            done.record["stage_end"] = done.ended
        self._monitor().step(done.record, format_row(done.record))
        interrupt.kill_point("step", done.step)

    def _evaluate_after(self, done: StepDone) -> None:
        """The evaluation hook; its ``until`` rule may end the stage."""
        with interrupt.deferred():  # a stop waits for the evaluation, then checkpoints
            row = self._evaluate(done.state, done.step, done.pool, done.loop, until=not _ends(done))
        done.ended = done.ended or row.get("stage_end")

    def _switch_stage(self, done: StepDone) -> None:
        """The stage switch (the hook of a stage's end): online filtering, fresh statistics
        (checkpointed by the next hook)."""
        assert done.ended is not None, "a hook of a stage's end"
        self.log(f"[stage {done.loop.schedule.index}] ends at step {done.step}: {done.ended}")
        interrupt.kill_point("stage", done.step)  # the switch is made, not yet checkpointed
        done.loop.end_stage(self.config, done.ended)

    def _checkpoint(self, done: StepDone) -> None:
        """The checkpoint hook."""
        self._save(done.state, done.loop)

    def _save(self, state: TrainState, loop: LoopState) -> Path:
        import jax

        jax.block_until_ready(state)
        # the records up to this step are durable before the checkpoint that implies them
        self._monitor().flush()
        item = self.rollouts.checkpoint_item(state, loop.step)
        path = self.ckpts.save(loop.step, item, loop.meta(), self.inputs.model.config)
        loop.saved = loop.step
        return path

    def _evaluate(
        self, state: TrainState, step: int, pool: Verifiers, loop: LoopState, *, until: bool
    ) -> JSON:
        """avg@n on the eval set, recorded; ``until``: the stage's until rule sees it."""
        assert self.evaluator is not None, "made by _open when the config has eval"
        row = self.evaluator(state.params, step, pool)
        ended = loop.schedule.after_eval(self.config, row["accuracy"]) if until else None
        if ended is not None:
            row["stage_end"] = ended
        self._monitor().eval(row, format_eval(row, self.evaluator.eval.num_samples))
        return row


def _ends(done: StepDone) -> bool:
    """The finished step ends its stage."""
    return done.ended is not None


def _counts(state: TrainState) -> dict[str, float]:
    s, skipped, coef = int(state.step), int(state.skipped), float(state.entropy.coef)
    return {"optimizer_steps": s, "skipped_updates": skipped, "entropy_coef": coef}
