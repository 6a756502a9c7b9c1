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
from typing import TYPE_CHECKING, Any

from magic_jax import distributed, interrupt, storage, watchdog
from magic_jax.data.rows import offline_filter, tokenize_rows
from magic_jax.data.sources import read_rows
from magic_jax.rollout.sampling import SamplingConfig
from magic_jax.run import rundir
from magic_jax.run.config import ConfigError, TrainConfig
from magic_jax.run.config_dict import to_dict
from magic_jax.run.policy import export_policy, load_policy, load_tokenizer, reference_params
from magic_jax.run.resume import newest_good_checkpoint, open_run_dir, resume_from
from magic_jax.run.stages import LoopState, Schedule, Stage, build_stage, pack_step, update_config
from magic_jax.run.step_row import format_eval, format_row, step_row

if TYPE_CHECKING:
    from magic_jax.rollout.driver import RolloutDriver
    from magic_jax.rollout.protocols import Verifiers
    from magic_jax.run.checkpoint import TrainCheckpoints
    from magic_jax.update.state import TrainState

logger = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
EVALS = "eval.jsonl"


class Trainer:
    """Runs a ``TrainConfig`` to the end of its last stage, resuming if it can.

    Example:
      summary = Trainer(load_config("configs/default.yaml")).run()
    """

    def __init__(self, config: TrainConfig, *, log: Callable[[str], None] = print):
        self.config = config
        self.log = log
        self.out = storage.path(config.output_dir, what="output_dir")
        self._eval_driver = None
        self._extra_eval_drivers: dict[float, RolloutDriver] = {}

    def _setup(self) -> None:
        from flax import nnx

        from magic_jax.run.overlap import split_meshes

        cfg = self.config
        ro = cfg.rollout
        ov = ro.mode == "overlap"
        self.mesh, self.rollout_mesh = split_meshes(cfg.mesh, ro.devices, overlap=ov, log=self.log)
        self.model = load_policy(cfg.model, cfg.param_dtype, self.mesh)
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.graphdef, params = nnx.split(self.model, nnx.Param)
        rows = read_rows(cfg.data.train)
        n_read = len(rows)
        if (d := cfg.data).offline_filter_model:
            keep = d.offline_filter_keep_unrated
            rows = offline_filter(
                rows, d.offline_filter_model, d.offline_filter_samples, keep_unrated=keep
            )
        # the one tokenisation of the run's prompts: the rollouts sample from row.token_ids
        self.rows, _ = self._tokenize(rows, "data.train")
        if not self.rows:
            raise ConfigError(
                f"data.max_prompt_length: all {len(rows)} prompts are longer than "
                f"{cfg.data.max_prompt_length} tokens"
            )
        self.log(
            f"[data] {n_read} prompts read, {len(self.rows)} after filtering; "
            f"{len(cfg.stages)} stage(s), {cfg.total_steps} steps"
        )
        self._params = params

    def _tokenize(self, rows: list, name: str) -> tuple[list, int]:
        """``rows`` with their token ids, those longer than data.max_prompt_length left out."""
        limit = self.config.data.max_prompt_length
        kept, _ = tokenize_rows(rows, self.tokenizer, max_prompt_length=limit)
        if len(kept) < len(rows):
            self.log(
                f"[data] {name}: {len(rows) - len(kept)} of {len(rows)} prompts are longer "
                f"than data.max_prompt_length ({limit} tokens) and are left out"
            )
        return kept, len(rows) - len(kept)

    def _driver(self, max_response_length: int, sampling: Any = None):
        """A rollout driver with the run's slots and sampling (or ``sampling``), for one limit."""
        from magic_jax.rollout.driver import make_driver

        cfg = self.config
        return make_driver(
            self.model,
            cfg.rollout,
            max_prompt_length=cfg.data.max_prompt_length,
            max_response_length=max_response_length,
            sampling=cfg.sampling if sampling is None else sampling,
            mesh=self.mesh,
        )

    def _stage(self, index: int, excluded: list[str]) -> Stage:
        stage = build_stage(
            self.config,
            index,
            self.rows,
            excluded,
            policy=self.model,
            graphdef=self.graphdef,
            mesh=self.mesh,
            rollout_mesh=self.rollout_mesh,
        )
        self.log(stage.describe())
        return stage

    def run(self, *, stop_after: int | None = None) -> dict[str, Any]:
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
        if cfg.mesh is not None:
            # before anything asks jax for devices or the process index
            maybe_initialize_distributed()
        raw = to_dict(cfg)
        with contextlib.ExitStack() as stack:
            # Process 0 claims, locks and checks the directory; the others start once it
            # has (on_primary is a barrier) and never write into it themselves.
            finished = distributed.on_primary(
                lambda: open_run_dir(
                    self.out, raw, stack, total_steps=cfg.total_steps, log=self.log
                )
            )
            if finished:
                return rundir.finished_summary(self.out, cfg.total_steps) or {}
            signals = stack.enter_context(rundir.StopSignals())
            return self._run(stop_after, signals)

    def _run(self, stop_after: int | None, signals: rundir.StopSignals) -> dict[str, object]:
        """Trains from the newest good checkpoint (or the start) to ``stop_after``, the end
        of the last stage or a stop; returns the summary."""
        from magic_jax.rewards import VerifierPool
        from magic_jax.run.checkpoint import TrainCheckpoints
        from magic_jax.run.overlap import OverlapRollouts

        cfg, ro = self.config, self.config.rollout
        self._setup()
        state = self._initial_state()
        found = newest_good_checkpoint(self.out, log=self.log)
        ckpts = TrainCheckpoints(self.out, keep=cfg.keep_checkpoints)
        ov = OverlapRollouts.of(ro, cfg.loss.tis_cap, log=lambda m: self.log(m))  # None: sync
        self._overlap = ov  # overlap: the checkpoints also hold the s versions in flight
        state, loop = resume_from(
            self.out, found, ckpts, ov.template(state) if ov else state, log=self.log
        )
        state = ov.start(state, loop.step) if ov else state
        self._saved = self._kept_rollouts = loop.step  # the newest checkpoint's step
        self._stage_now: Stage | None = None
        self._start_monitor(loop.step)
        # the stop signal every process agrees on (0: none), asked once per step
        stop = distributed.max_int(signals.received or 0)
        end = self._end = (
            cfg.total_steps if stop_after is None else min(stop_after, cfg.total_steps)
        )
        counts = _counts(state)  # what the summary says of the state (an update may consume it)
        try:
            with (
                self._monitor,
                VerifierPool(cfg.rewards) as pool,
                self._profiler,
                watchdog.Watchdog(cfg.watchdog_s, self.out),  # watchdog_s: stacks, then exit
            ):
                if not stop:
                    state, stop, counts = self._train(state, loop, end, pool, ckpts, signals)
        finally:
            if ov is not None:
                ov.close()
            ckpts.close()
        return self._summary(state, loop, stop, counts)

    def _initial_state(self) -> TrainState:
        """The train state of the initial weights (and the KL reference policy)."""
        from magic_jax.update.state import init_train_state

        cfg = self.config
        # the KL reference: the initial weights (copied before any update) or loss.kl_reference
        self.ref_params = reference_params(cfg, self._params, self.mesh)
        if self.ref_params is not None:
            self.log(f"[kl] reference policy: {cfg.loss.kl_reference or 'the initial weights'}")
        state = init_train_state(self._params, update_config(cfg, 0), mesh=self.mesh)
        del self._params
        return state

    def _start_monitor(self, step: int) -> None:
        from magic_jax.run.monitor import Monitor
        from magic_jax.run.profile import StepProfiler

        cfg = self.config
        self._monitor = Monitor(
            self.out,
            stage_steps=[s.steps for s in cfg.stages],
            start_step=step,
            log=self.log,
            primary=distributed.is_primary(),
        )
        self.log = self._monitor.write  # the run's other lines print above the progress bar
        self._profiler = StepProfiler(self.out, cfg.profile_steps, log=self.log)

    def _train(
        self,
        state: TrainState,
        loop: LoopState,
        end: int,
        pool: Verifiers,
        ckpts: TrainCheckpoints,
        signals: rundir.StopSignals,
    ) -> tuple[TrainState, int, dict[str, float]]:
        """Steps until ``end``, the last stage's end or a stop, checkpointing as due;
        returns (the state, the stop signal or 0, the summary's counts of the state)."""
        cfg, schedule = self.config, loop.schedule
        counts, stop = _counts(state), 0
        while loop.step < end and not schedule.finished(cfg):
            try:
                if cfg.eval is not None and loop.step == 0:
                    self._evaluate(state, 0, pool, schedule)
                state, ended = self._one_step(loop.step, state, loop, pool)
                counts = _counts(state)
            except interrupt.Interrupted as e:
                # Only a rollout or an update with its groups saved is cut short
                # (``_step``): the state is that of `step` steps, or checkpointed.
                self.log(f"[stop] {e}: step {loop.step} is redone on resume")
                if self._saved < loop.step:  # a rollout without saved groups: keep the state
                    self._save(ckpts, state, loop)
                return state, e.signum, counts
            stop = distributed.max_int(signals.received or 0)
            if not stop and distributed.preemption_notice(loop.step):
                self.log(f"[stop] preemption notice at step {loop.step}")
                stop = int(signal.SIGTERM)
            due = loop.step % cfg.checkpoint_every == 0 or ended is not None
            if due or loop.step == end or stop:
                self._save(ckpts, state, loop)
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
                f"[stop] {name}: stopped at step {step} (checkpoint at step {self._saved}); "
                f"run the same command to resume"
            )
        elif schedule.finished(cfg) and cfg.export_hf:
            # every process gathers the weights tensor by tensor; process 0 writes them
            out = self.out / "hf_final"
            export_policy(out, self.graphdef, state.params, self.tokenizer, cfg.export_dtype)
            summary["hf_export"] = str(out)
        if distributed.is_primary():
            rundir.write_summary(self.out, summary)
        return summary

    def _one_step(
        self, step: int, state: TrainState, loop: LoopState, pool: Verifiers
    ) -> tuple[TrainState, str | None]:
        """Global step ``step``: rollouts, update, its record, evaluation when due and the
        stage switch (``loop.step`` becomes the next step); returns (the new state, how
        its stage ended or None).

        Raises:
          interrupt.Interrupted: a stop came during the rollout, update or evaluation.
        """
        cfg, schedule = self.config, loop.schedule
        stage = self._stage_now
        if stage is None or stage.index != schedule.index:
            stage = self._stage_now = self._stage(schedule.index, loop.excluded)
        interrupt.at(step)
        with self._profiler.step(step):  # profile_steps: a trace of steps A to B-1
            state, row = self._step(
                state, stage, step, schedule.stage_step(step), pool, loop.tracker
            )
        step = loop.step = step + 1
        ended = schedule.after_step(cfg, step, row["truncated_fraction"])
        if ended is not None:
            row["stage_end"] = ended
        self._monitor.step(row, format_row(row))
        interrupt.kill_point("step", step)
        last = ended is not None and schedule.index == len(cfg.stages) - 1
        if cfg.eval is not None and (step % cfg.eval.every == 0 or last):
            with interrupt.deferred():  # a stop waits for the evaluation, then checkpoints
                ev = self._evaluate(state, step, pool, None if ended else schedule)
            ended = ended or ev.get("stage_end")
        if ended is not None:
            # the stage switch: online filtering, fresh statistics (checkpointed)
            self.log(f"[stage {schedule.index}] ends at step {step}: {ended}")
            loop.end_stage(cfg, ended)
        return state, ended

    def _save(self, ckpts: TrainCheckpoints, state: TrainState, loop: LoopState) -> Path:
        import jax

        jax.block_until_ready(state)
        # the records up to this step are durable before the checkpoint that implies them
        self._monitor.flush()
        ov, step = self._overlap, loop.step
        item = state if ov is None else ov.checkpoint_item(state, step)
        path = ckpts.save(step, item, loop.meta(), self.model.config)
        self._saved = loop.step
        return path

    def _evaluate(
        self, state: Any, step: int, pool: Any, schedule: Schedule | None = None
    ) -> dict[str, Any]:
        """avg@n on the eval set; with ``schedule``, its until rule sees the result."""
        from magic_jax.rollout.evaluate import evaluate

        cfg, ev = self.config, self.config.eval
        if self._eval_driver is None:
            self._eval_rows, self._eval_skipped = self._tokenize(read_rows(ev.data), "eval.data")
            if not self._eval_rows:
                raise ConfigError("eval.data: no problem fits data.max_prompt_length")
            limit = ev.max_response_length or max(s.max_response_length for s in cfg.stages)

            def sampling_at(t):  # the evaluation's own protocol, whatever training samples with
                return SamplingConfig(temperature=t, top_p=ev.top_p)

            self._eval_driver = self._driver(limit, sampling_at(ev.temperature))
            # one engine and KV cache for every temperature (they run one after another)
            self._extra_eval_drivers = {
                t: self._eval_driver.with_sampling(sampling_at(t)) for t in ev.extra_temperatures
            }
        t0 = time.perf_counter()

        def run(driver):
            return evaluate(
                driver,
                driver.load_params(state.params),
                self._eval_rows,
                self.tokenizer,
                num_samples=ev.num_samples,
                seed=cfg.seed,
                step=step,
                max_prompt_length=cfg.data.max_prompt_length,
                pool=pool,
            )

        row = run(self._eval_driver)
        if self._extra_eval_drivers:
            row["by_temperature"] = {
                f"{t:g}": {k: v for k, v in run(d).items() if isinstance(v, int | float)}
                for t, d in self._extra_eval_drivers.items()
            }
        row["skipped_long_prompts"] = self._eval_skipped
        if ev.probe is not None:  # a probe of the policy itself (rollout/probes.py)
            row["probe"] = self._probe(state, step, pool)
        row = {"step": step, **row, "t_eval_s": time.perf_counter() - t0}
        ended = None if schedule is None else schedule.after_eval(cfg, row["accuracy"])
        if ended is not None:
            row["stage_end"] = ended
        self._monitor.eval(row, format_eval(row, ev.num_samples))
        return row

    def _probe(self, state: Any, step: int, pool: Any) -> dict[str, object]:
        """``eval.probe`` of the policy after ``step`` (its figures: ``probe`` in eval.jsonl)."""
        from magic_jax.rollout.probes import ProbeContext, get_probe
        from magic_jax.run.stages import planned_stage

        cfg, st, d = self.config, planned_stage(self.config, step), self._eval_driver
        ctx = ProbeContext(
            graphdef=self.graphdef,
            params=state.params,
            rows=self._eval_rows,
            tokenizer=self.tokenizer,
            eos_ids=self.model.config.eos_ids,
            temperature=cfg.sampling.temperature,
            samples_per_step=st.prompts_per_step * st.group_size,
            driver=d,
            driver_params=d.load_params(state.params),
            pool=pool,
            num_samples=cfg.eval.num_samples,
            seed=cfg.seed,
            step=step,
            final=step >= cfg.total_steps,
        )
        return get_probe(cfg.eval.probe)(ctx)

    def _step(self, state, stage: Stage, step: int, k: int, pool, tracker):
        import jax

        from magic_jax.rollout import partial
        from magic_jax.run import runlock
        from magic_jax.run.overlap import clip_by_staleness, with_staleness

        cfg, st, ov = self.config, stage.config, self._overlap
        t0, cpu0 = time.perf_counter(), time.process_time()
        store, extra = None, {}

        def store_at(j):  # step j's groups, kept as they finish (rollout.partial)
            fence, limit = runlock.check_fence, st.max_response_length
            return partial.StepStore(self.out, j, limit=limit, log=self.log, fence=fence)

        if step == self._saved:  # a stop resumes here: keep the groups as they finish
            kept = range(self._kept_rollouts, self._end + 1) if ov else (step, self._kept_rollouts)
            if jax.process_index() == 0:  # the previous step's, until its checkpoint is whole
                partial.prune(self.out, keep=kept)  # overlap: and the steps in flight, ahead
            self._kept_rollouts, store = step, None if ov else store_at(step)
        if ov is not None:  # generated during the last updates (run/overlap.py)

            def rollout(j, driver, params):  # partial rollouts are redone whole (overlap.py)
                saved = store_at(j) if cfg.rollout.publish_chunks is None else None
                return self._collect(stage, j, j - step + k, driver, params, pool, saved)

            end = min(step - k + st.steps, self._end)
            got, extra = ov.take(stage, step, end, rollout)
        if ov is None:
            params = stage.driver.load_params(state.params)
            got = self._collect(stage, step, k, stage.driver, params, pool, store)
            params = None  # the engine's copy of the weights is not needed for the update
        t1 = time.perf_counter()
        for g in got.every:
            tracker.record(g.row.uid, g.rewards)
        buffer = pack_step(cfg, stage, got, self.tokenizer, self.pad_id)
        if ov is not None:  # each token's staleness: the loss counts clipping per staleness
            buffer = with_staleness(buffer, got.groups, step)
        t2 = time.perf_counter()
        rng = jax.random.fold_in(jax.random.key(cfg.seed), step)
        # an update is cut short only where its groups and the state before it are kept
        with contextlib.nullcontext() if store is not None else interrupt.deferred():
            state, m = stage.updater.update(state, buffer, rng, ref_params=self.ref_params)
        interrupt.kill_point("update", step)  # the update is dispatched, not yet done
        if ov is not None:
            ov.published(step + 1, state.params)
        jax.block_until_ready(state.params)
        t3 = time.perf_counter()
        wait = 0.0 if ov else got.wait_s  # overlap: t_rollout_s is the wait for the producer
        times = {"t_rollout_s": t1 - t0 - wait, "t_update_s": t3 - t2, "t_other_s": t2 - t1 + wait}
        times["t_cpu_s"] = time.process_time() - cpu0  # every thread's, verifiers apart
        row = step_row(cfg, stage.index, st, step, k, got, m, int(state.skipped), times)
        return state, row | extra | clip_by_staleness(m)

    def _collect(self, stage: Stage, step: int, k: int, driver, params, pool, store):
        """Step ``step``'s (stage step ``k``'s) groups: ``collect_groups`` of its rounds."""
        import jax

        from magic_jax.rollout.collect import collect_groups

        cfg, st = self.config, stage.config
        rounds = [stage.batches[k]]
        if cfg.rollout.refill:
            first, n = k * cfg.rollout.refill_max_rounds, cfg.rollout.refill_max_rounds
            rounds += [stage.refill_batches[first + r] for r in range(n)]
        return collect_groups(
            driver,
            params,
            rounds,
            tokenizer=self.tokenizer,
            pool=pool,
            group_size=st.group_size,
            num_groups=st.prompts_per_step,
            advantage=cfg.advantage,
            seed=cfg.seed,
            step=step,
            refill=cfg.rollout.refill,
            truncation=cfg.rollout.truncation,
            per_host=jax.process_count() > 1,
            saved=store,
        )


def _counts(state: Any) -> dict[str, Any]:
    s, skipped, coef = int(state.step), int(state.skipped), float(state.entropy.coef)
    return {"optimizer_steps": s, "skipped_updates": skipped, "entropy_coef": coef}
