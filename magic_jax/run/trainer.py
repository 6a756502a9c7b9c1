"""The MAGIC training loop: stages, rollouts, rewards, updates, metrics, checkpoints, resume.

One training step k (SPEC items 1-12): take step k's D_R prompts, sample G
responses each with the continuous-batching engine (each finished response goes
to the verifier pool at once; ``collect`` adds refill rounds when asked), pack
the rollout buffer with group advantages and rejection sampling, run the N_SGD
optimizer steps of ``PolicyUpdater.update`` (which measures e_k, applies the
adaptive entropy coefficient and, with KL on, reads the frozen reference
policy), then log one line of metrics. Stages (``stages``) change the response
limit T, the batch sizes and the KL weight, and end on their step budget or
``until`` rules; the train state (weights, optimizer, entropy controller, step)
carries across them, and at each new stage the prompts solved every time in
the previous one are dropped (online filtering).

Checkpoints (``magic_jax.run.checkpoint``) hold the whole train state plus the
loop's own state (``trainer.json``: next step, stage, per-prompt accuracy of the
stage, the filtered prompt set) and a manifest of checksums. A run started in a
directory that has checkpoints resumes from the newest one that verifies, and
because step k's prompts and sampling keys are functions of k alone, the
resumed run computes what the uninterrupted one would have. The run directory
is claimed and locked for the run's life (``magic_jax.run.rundir``); SIGINT and
SIGTERM stop the loop after the current step with a checkpoint.

Multi-host (``mesh`` set, under ``jax.distributed``): every process runs this
same loop (``magic_jax.distributed`` says what they agree on and how); process
0 alone owns the run directory and writes records, all take part in
checkpoints and the export.
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
from magic_jax.rollout.sampling import SamplingConfig
from magic_jax.run import rundir
from magic_jax.run.config import ConfigError, TrainConfig
from magic_jax.run.config_dict import to_dict
from magic_jax.run.evaluation import Evaluator
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
from magic_jax.run.step_rollouts import StepRollouts, SyncRollouts
from magic_jax.run.step_row import format_eval, format_row, step_row

if TYPE_CHECKING:
    from types import TracebackType

    from magic_jax.rollout.protocols import Verifiers
    from magic_jax.run.checkpoint import TrainCheckpoints
    from magic_jax.run.monitor import Monitor
    from magic_jax.run.profile import StepProfiler
    from magic_jax.run.remote import Side
    from magic_jax.update.state import TrainState

logger = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
EVALS = "eval.jsonl"


class Trainer:
    """Runs a ``TrainConfig`` to the end of its last stage, resuming if it can.

    Everything a run holds beyond its config is made in ``_open``, once, before the
    first step; each step is ``_step``, the same code in sync and overlap mode (the
    difference is the ``step_rollouts.StepRollouts`` it takes its groups from).

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

    def log(self, line: str) -> None:
        """One line of the run's output (above the progress bar once the run has one)."""
        (self._print if self.monitor is None else self.monitor.write)(line)

    def _driver(self, max_response_length: int, sampling: SamplingConfig | None = None):
        """A rollout driver with the run's slots and sampling (or ``sampling``), for one limit."""
        from magic_jax.rollout.driver import make_driver

        cfg = self.config
        return make_driver(
            self.inputs.model,
            cfg.rollout,
            max_prompt_length=cfg.data.max_prompt_length,
            max_response_length=max_response_length,
            sampling=cfg.sampling if sampling is None else sampling,
            mesh=self.inputs.mesh,
        )

    def _stage(self, index: int, excluded: list[str]) -> Stage:
        i = self.inputs
        stage = build_stage(
            self.config,
            index,
            i.rows,
            excluded,
            policy=i.model,
            graphdef=i.graphdef,
            mesh=i.mesh,
            rollout_mesh=i.rollout_mesh,
        )
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
        return getattr(getattr(self, "rollouts", None), "connected", False)

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
        if not self._said_hello() and not getattr(self, "_said_farewell", False):
            self._said_farewell = True
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
        # the protocol, not the class: the checkpoint item's shape is the source's own
        rollouts: StepRollouts = SyncRollouts() if overlap is None else overlap
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
            i = self.inputs
            self.evaluator = Evaluator(
                cfg, i.model, i.graphdef, i.tokenizer, self._driver, log=self.log
            )
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
                    i = self.inputs
                    sampler = StepSampler(cfg, i.tokenizer, pool, self.out, self.log)
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
        """Steps until ``self.end``, the last stage's end or a stop, checkpointing as due;
        returns (the state, the stop signal or 0, the summary's counts of the state)."""
        cfg, schedule = self.config, loop.schedule
        counts, stop = _counts(state), 0
        while loop.step < self.end and not schedule.finished(cfg):
            try:
                if cfg.eval is not None and loop.step == 0:
                    self._evaluate(state, 0, sampler.pool, loop, until=True)
                state, ended = self._one_step(loop.step, state, loop, sampler)
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
            due = loop.step % cfg.checkpoint_every == 0 or ended is not None
            if due or loop.step == self.end or stop:
                self._save(state, loop)
            if stop:
                break
        return state, stop, counts

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
            out, i = self.out / "hf_final", self.inputs
            export_policy(out, i.graphdef, state.params, i.tokenizer, cfg.export_dtype)
            summary["hf_export"] = str(out)
        if distributed.is_primary():
            rundir.write_summary(self.out, summary)
        return summary

    def _one_step(
        self, step: int, state: TrainState, loop: LoopState, sampler: StepSampler
    ) -> tuple[TrainState, str | None]:
        """Global step ``step``: rollouts, update, its record, evaluation when due and the
        stage switch (``loop.step`` becomes the next step); returns (the new state, how
        its stage ended or None).

        Raises:
          interrupt.Interrupted: a stop came during the rollout, update or evaluation.
        """
        cfg, schedule = self.config, loop.schedule
        if self.stage is None or self.stage.index != schedule.index:
            self.stage = self._stage(schedule.index, loop.excluded)
        interrupt.at(step)
        with self.profiler.step(step):  # profile_steps: a trace of steps A to B-1
            k = schedule.stage_step(step)
            state, row = self._step(state, self.stage, step, k, sampler, loop)
        step = loop.step = step + 1
        ended = schedule.after_step(cfg, step, row["truncated_fraction"])
        if ended is not None:
            row["stage_end"] = ended
        self._monitor().step(row, format_row(row))
        interrupt.kill_point("step", step)
        last = ended is not None and schedule.index == len(cfg.stages) - 1
        if cfg.eval is not None and (step % cfg.eval.every == 0 or last):
            with interrupt.deferred():  # a stop waits for the evaluation, then checkpoints
                ev = self._evaluate(state, step, sampler.pool, loop, until=ended is None)
            ended = ended or ev.get("stage_end")
        if ended is not None:
            # the stage switch: online filtering, fresh statistics (checkpointed)
            self.log(f"[stage {schedule.index}] ends at step {step}: {ended}")
            interrupt.kill_point("stage", step)  # the switch is made, not yet checkpointed
            loop.end_stage(cfg, ended)
        return state, ended

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

    def _step(
        self,
        state: TrainState,
        stage: Stage,
        step: int,
        k: int,
        sampler: StepSampler,
        loop: LoopState,
    ) -> tuple[TrainState, JSON]:
        """Step ``step`` (stage step ``k``): its rollouts, their buffer, the update and
        the step's metrics line; returns (the new state, the line)."""
        import jax

        from magic_jax.rollout import partial
        from magic_jax.run.overlap import clip_by_staleness

        cfg, source = self.config, self.rollouts
        t0, cpu0 = time.perf_counter(), time.process_time()
        resumed = step == loop.saved  # a stop resumes here: keep the groups as they finish
        if resumed:
            if jax.process_index() == 0:
                partial.prune(self.out, keep=source.kept_steps(step, loop.kept_from, self.end))
            loop.kept_from = step
        r = source.rollout(stage, step, k, state, sampler, resumed=resumed, end=self.end)
        t1 = time.perf_counter()
        for g in r.got.every:
            loop.tracker.record(g.row.uid, g.rewards)
        i = self.inputs
        buffer = pack_step(cfg, stage, r.got, i.tokenizer, i.pad_id)
        buffer = source.annotate(buffer, r.got.groups, step)
        t2 = time.perf_counter()
        rng = jax.random.fold_in(jax.random.key(cfg.seed), step)
        # an update is cut short only where its groups and the state before it are kept
        with contextlib.nullcontext() if r.saved else interrupt.deferred():
            state, m = stage.updater.update(state, buffer, rng, ref_params=self.ref_params)
        interrupt.kill_point("update", step)  # the update is dispatched, not yet done
        source.updated(step + 1, state.params)
        jax.block_until_ready(state.params)
        t3 = time.perf_counter()
        times = {
            "t_rollout_s": t1 - t0 - r.other_s,
            "t_update_s": t3 - t2,
            "t_other_s": t2 - t1 + r.other_s,
            "t_cpu_s": time.process_time() - cpu0,  # every thread's, verifiers apart
        }
        st = stage.config
        row = step_row(cfg, stage.index, st, step, k, r.got, m, int(state.skipped), times)
        return state, row | r.metrics | clip_by_staleness(m)


def _counts(state: TrainState) -> dict[str, float]:
    s, skipped, coef = int(state.step), int(state.skipped), float(state.entropy.coef)
    return {"optimizer_steps": s, "skipped_updates": skipped, "entropy_coef": coef}
