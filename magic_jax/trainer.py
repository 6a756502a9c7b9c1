"""The MAGIC training loop: stages, rollouts, rewards, updates, metrics, checkpoints, resume.

One training step k (SPEC items 1-12): take step k's D_R prompts, sample G
responses each with the continuous-batching engine (each finished response goes
to the verifier pool at once), pack the rollout buffer with group advantages
and rejection sampling, run the N_SGD optimizer steps of ``PolicyUpdater.update``
(which measures e_k and applies the adaptive entropy coefficient), then log one
line of metrics. Stages change the response limit T and the batch sizes; the
train state (weights, optimizer, entropy controller, step) carries across them,
and at each new stage the prompts solved every time in the previous one are
dropped (online filtering).

Checkpoints hold the whole train state (orbax) plus the loop's own state
(``trainer.json``: next step, per-prompt accuracy of the stage, the filtered
prompt set); they are written under a temporary name and renamed when
complete. A run started in a directory that has checkpoints resumes from the
newest, and because step k's prompts and sampling keys are functions of k
alone, the resumed run computes what the uninterrupted one would have.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from magic_jax.config import ConfigError, TrainConfig, to_dict
from magic_jax.data import AccuracyTracker, encode_prompts, offline_filter, read_rows
from magic_jax.policy import load_policy, load_tokenizer
from magic_jax.stages import Stage, build_stage, excluded_after, update_config

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
EVALS = "eval.jsonl"
TRAINER_STATE = "trainer.json"


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of a run directory (None if there is none)."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    done = sorted(
        p for p in root.iterdir() if p.name.startswith("step_") and (p / TRAINER_STATE).exists()
    )
    return done[-1] if done else None


class Trainer:
    """Runs a ``TrainConfig`` to the end of its last stage, resuming if it can.

    Example:
      summary = Trainer(load_config("configs/tiny.yaml")).run()
    """

    def __init__(self, config: TrainConfig, *, log: Callable[[str], None] = print):
        self.config = config
        self.log = log
        self.out = Path(config.output_dir)
        self._eval_driver = None

    # ------------------------------------------------------------------ set-up

    def _setup(self) -> None:
        from flax import nnx

        from magic_jax.sharding import make_mesh, maybe_initialize_distributed

        cfg = self.config
        if cfg.mesh is not None:
            maybe_initialize_distributed()
        self.mesh = None if cfg.mesh is None else make_mesh(cfg.mesh)
        self.model = load_policy(cfg.model, cfg.param_dtype, self.mesh)
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = 0
        self.graphdef, params = nnx.split(self.model, nnx.Param)
        rows = read_rows(cfg.data.train)
        n_read = len(rows)
        if cfg.data.offline_filter_model:
            d = cfg.data
            rows = offline_filter(rows, d.offline_filter_model, d.offline_filter_samples)
        self.rows = rows
        self.log(
            f"[data] {n_read} prompts read, {len(rows)} after offline filtering; "
            f"{len(cfg.stages)} stage(s), {cfg.total_steps} steps"
        )
        self._params = params

    def _engine(self, max_response_length: int):
        """A decode engine with the run's slots and sampling, for one response limit."""
        from magic_jax.engine import Engine, EngineConfig

        cfg = self.config
        return Engine(
            self.model,
            EngineConfig(
                max_concurrent_decodes=cfg.rollout.max_concurrent_decodes,
                max_prefill_length=cfg.data.max_prompt_length,
                max_decode_length=max_response_length,
                decode_steps=cfg.rollout.decode_steps,
                sampling=cfg.sampling,
            ),
            mesh=self.mesh,
        )

    def _stage(self, index: int, excluded: list[str]) -> Stage:
        stage = build_stage(
            self.config,
            index,
            self.rows,
            excluded,
            graphdef=self.graphdef,
            mesh=self.mesh,
            make_engine=self._engine,
        )
        self.log(stage.describe())
        return stage

    # ------------------------------------------------------------------ checkpoints

    def _save(self, state: Any, step: int, stage: Stage, tracker: AccuracyTracker) -> Path:
        import jax
        import orbax.checkpoint as ocp

        root = self.out / CHECKPOINTS
        final = _step_dir(root, step)
        tmp = final.with_name(final.name + ".partial")
        if tmp.exists():
            shutil.rmtree(tmp)
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp / "state", state)
            ckptr.wait_until_finished()
        if jax.process_index() == 0:
            meta = {
                "next_step": step,
                "stage": stage.index,
                "excluded": stage.excluded,
                "tracker": tracker.state_dict(),
            }
            (tmp / TRAINER_STATE).write_text(json.dumps(meta))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            old = sorted(p for p in root.iterdir() if p.name.startswith("step_"))
            for p in old[: -self.config.keep_checkpoints]:
                if not p.name.endswith(".partial"):
                    shutil.rmtree(p)
        return final

    def _restore(self, state: Any, path: Path) -> tuple[Any, dict[str, Any]]:
        import jax
        import orbax.checkpoint as ocp

        try:
            meta = json.loads((path / TRAINER_STATE).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path / TRAINER_STATE}: unreadable trainer state: {e}") from None
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
        try:
            with ocp.StandardCheckpointer() as ckptr:
                restored = ckptr.restore(path / "state", target)
        except Exception as e:  # orbax raises many types for a mismatched tree
            raise ConfigError(
                f"{path}: the checkpoint does not match this run's model and optimizer: {e}"
            ) from None
        return restored, meta

    # ------------------------------------------------------------------ the loop

    def run(self, *, stop_after: int | None = None) -> dict[str, Any]:
        """Trains to the end of the last stage; returns a summary (also in ``summary.json``).

        Args:
          stop_after: stop (with a checkpoint) once this global step count is
            reached, e.g. to split a run into jobs; the next ``run`` resumes.
        """
        import jax
        import yaml

        from magic_jax.rewards import VerifierPool
        from magic_jax.train_step import init_train_state

        cfg = self.config
        self.out.mkdir(parents=True, exist_ok=True)
        self._setup()
        state = init_train_state(self._params, update_config(cfg, 0), mesh=self.mesh)
        del self._params
        step, tracker, excluded = 0, AccuracyTracker(), []
        ckpt = latest_checkpoint(self.out)
        if ckpt is not None:
            state, meta = self._restore(state, ckpt)
            step = int(meta["next_step"])
            tracker = AccuracyTracker.from_state_dict(meta["tracker"])
            excluded = list(meta["excluded"])
            self.log(f"[resume] {ckpt}: continuing at step {step}")
            self._trim_metrics(step)
        (self.out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        if step >= cfg.total_steps:
            self.log(f"[done] all {cfg.total_steps} steps are in {ckpt}")
        stage: Stage | None = None
        history: list[dict[str, Any]] = []
        evals: list[dict[str, Any]] = []
        with VerifierPool(cfg.rewards) as pool:
            if cfg.eval is not None and step == 0:
                evals.append(self._evaluate(state, 0, pool))
            end = cfg.total_steps if stop_after is None else min(stop_after, cfg.total_steps)
            while step < end:
                index, k = cfg.stage_at(step)
                if stage is None or stage.index != index:
                    if stage is not None:  # a new stage: online filtering, fresh statistics
                        excluded = excluded_after(cfg, excluded, tracker)
                        tracker.reset()
                    stage = self._stage(index, excluded)
                state, row = self._step(state, stage, step, k, pool, tracker)
                history.append(row)
                with open(self.out / METRICS, "a") as f:
                    f.write(json.dumps(row) + "\n")
                self.log(_format(row))
                step += 1
                end_of_stage = cfg.stage_at(step)[0] != index
                if cfg.eval is not None and (step % cfg.eval.every == 0 or step == end):
                    evals.append(self._evaluate(state, step, pool))
                if step % cfg.checkpoint_every == 0 or end_of_stage or step == end:
                    jax.block_until_ready(state)
                    self._save(state, step, stage, tracker)
        summary = {
            "steps": step,
            "optimizer_steps": int(state.step),
            "skipped_updates": int(state.skipped),
            "entropy_coef": float(state.entropy.coef),
            "last": history[-1] if history else None,
            "evals": [{"step": e["step"], "accuracy": e["accuracy"]} for e in evals],
        }
        if cfg.export_hf and step == cfg.total_steps and jax.process_index() == 0:
            import jax.numpy as jnp
            from flax import nnx

            from magic_jax.convert import save_hf

            out = self.out / "hf_final"
            if out.exists():
                shutil.rmtree(out)
            save_hf(nnx.merge(self.graphdef, state.params), out, dtype=jnp.dtype(cfg.export_dtype))
            self.tokenizer.save_pretrained(out)
            summary["hf_export"] = str(out)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _trim_metrics(self, step: int) -> None:
        """Drops the lines of steps after the checkpoint (they are computed again)."""
        for name, last in ((METRICS, step - 1), (EVALS, step)):
            path = self.out / name
            if path.exists():
                lines = path.read_text().splitlines()
                keep = [line for line in lines if json.loads(line)["step"] <= last]
                path.write_text("".join(line + "\n" for line in keep))

    def _evaluate(self, state: Any, step: int, pool: Any) -> dict[str, Any]:
        from magic_jax.evaluate import evaluate
        from magic_jax.rollout import RolloutDriver

        cfg, ev = self.config, self.config.eval
        if self._eval_driver is None:
            self._eval_rows = read_rows(ev.data)
            limit = ev.max_response_length or max(s.max_response_length for s in cfg.stages)
            self._eval_driver = RolloutDriver(self._engine(limit))
        t0 = time.perf_counter()
        driver = self._eval_driver
        row = evaluate(
            driver,
            driver.engine.load_params(state.params),
            self._eval_rows,
            self.tokenizer,
            num_samples=ev.num_samples,
            max_prompt_length=cfg.data.max_prompt_length,
            seed=cfg.seed,
            step=step,
            pool=pool,
        )
        row = {"step": step, **row, "t_eval_s": time.perf_counter() - t0}
        with open(self.out / EVALS, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.log(
            f"[eval step {step}] avg@{ev.num_samples} {row['accuracy']:.3f} "
            f"pass@{ev.num_samples} {row['pass_at_n']:.3f} on {row['problems']} problems, "
            f"len {row['response_length_mean']:.0f}, trunc {row['truncated_fraction']:.2f} "
            f"({row['t_eval_s']:.1f}s)"
        )
        return row

    def _step(self, state, stage: Stage, step: int, k: int, pool, tracker):
        import jax

        from magic_jax.buffer import pack_rollouts
        from magic_jax.rewards import RewardItem, status_counts

        cfg, st = self.config, stage.config
        t0 = time.perf_counter()
        rows = stage.batches[k]
        ids, kept = encode_prompts(
            rows, self.tokenizer, max_prompt_length=cfg.data.max_prompt_length
        )
        rows = [rows[i] for i in kept]
        if not rows:
            raise ConfigError(
                f"step {step}: every prompt is longer than data.max_prompt_length "
                f"({cfg.data.max_prompt_length})"
            )
        tickets: dict[tuple[int, int], int] = {}

        def submit(s):
            text = self.tokenizer.decode(s.tokens, skip_special_tokens=True)
            item = RewardItem.from_row(rows[s.prompt_index].as_verl_row(), text)
            tickets[s.prompt_index, s.sample_index] = pool.submit(item)

        params = stage.driver.engine.load_params(state.params)
        samples, rstats = stage.driver.run(
            params,
            ids,
            num_samples=st.group_size,
            seed=cfg.seed,
            step=step,
            truncation=cfg.rollout.truncation,
            on_sample=submit,
        )
        del params
        t1 = time.perf_counter()
        results = pool.collect([tickets[s.prompt_index, s.sample_index] for s in samples])
        rewards = np.asarray([r.reward for r in results], np.float32)
        prompt_of = np.asarray([s.prompt_index for s in samples])
        for p, row in enumerate(rows):
            tracker.record(row.uid, rewards[prompt_of == p])
        buffer = pack_rollouts(
            samples,
            rewards,
            group_size=st.group_size,
            num_groups=st.prompts_per_step,
            advantage=cfg.advantage,
            prompt_bucket=min(64, cfg.data.max_prompt_length),
            response_bucket=min(256, st.max_response_length),
            pad_id=self.pad_id,
        )
        t2 = time.perf_counter()
        rng = jax.random.fold_in(jax.random.key(cfg.seed), step)
        state, m = stage.updater.update(state, buffer, rng)
        jax.block_until_ready(state.params)
        t3 = time.perf_counter()
        lengths = np.asarray([s.length for s in samples])
        truncated = np.asarray([s.truncated for s in samples])
        counts = status_counts(results)

        def mean(key):
            return float(np.mean(m[key])) if key in m and np.size(m[key]) else 0.0

        return state, {
            "step": step,
            "stage": stage.index,
            "stage_step": k,
            "max_response_length": st.max_response_length,
            "prompts": len(rows),
            "reward": float(rewards.mean()),
            "accuracy_not_truncated": (
                float(rewards[~truncated].mean()) if (~truncated).any() else 0.0
            ),
            "truncated_fraction": float(truncated.mean()),
            "response_length_mean": float(lengths.mean()),
            "response_length_max": int(lengths.max()),
            "entropy": m["buffer_entropy"],
            "alpha": m["alpha"],
            "entropy_coef_next": m["entropy_coef_next"],
            "kept_group_fraction": m["kept_group_fraction"],
            "sgd_steps": m["num_sgd_steps"],
            "loss": mean("loss"),
            "clipfrac_low": mean("clipfrac_low"),
            "clipfrac_high": mean("clipfrac_high"),
            "ratio_max": float(np.max(m["ratio_max"])) if np.size(m.get("ratio_max", [])) else 0.0,
            "approx_kl": mean("approx_kl"),
            "grad_norm": mean("grad_norm"),
            "skipped_updates": int(state.skipped),
            "reward_status": counts,
            "rollout_tokens_per_s": rstats.tokens / max(rstats.wall_s, 1e-9),
            "t_rollout_s": t1 - t0,
            "t_update_s": t3 - t2,
            "t_other_s": t2 - t1,
        }


def _format(row: dict[str, Any]) -> str:
    return (
        "[step {step}] stage {stage} reward {reward:.3f} trunc {truncated_fraction:.2f} "
        "len {response_length_mean:.0f}/{response_length_max} entropy {entropy:.3f} "
        "alpha {alpha:.4f} kept {kept_group_fraction:.2f} sgd {sgd_steps} "
        "clip {clipfrac_low:.3f}/{clipfrac_high:.3f} kl {approx_kl:.2e} gnorm {grad_norm:.3f} "
        "t_R {t_rollout_s:.1f}s t_T {t_update_s:.1f}s t_O {t_other_s:.1f}s"
    ).format(**row)
