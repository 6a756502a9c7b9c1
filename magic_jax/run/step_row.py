"""One training step's metrics line (``metrics.jsonl``), from its rollouts and its update."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from magic_jax.rewards import status_counts

if TYPE_CHECKING:
    from magic_jax.rollout.collect import Collected
    from magic_jax.run.config import TrainConfig
    from magic_jax.run.rundir import JSON
    from magic_jax.run.stages import Stage
    from magic_jax.update.updater import Metrics


def step_row(
    cfg: TrainConfig,
    stage: Stage,
    step: int,
    k: int,
    got: Collected,
    m: Metrics,
    skipped: int,
    times: dict[str, float],
) -> JSON:
    """The record of global step ``step`` (``stage``'s step ``k``): ``got`` the rollout's
    ``Collected``, ``m`` the update's metrics, ``skipped`` the updates skipped so far,
    ``times`` the step's wall-clock split."""
    st = stage.config
    every = [s for g in got.every for s in g.samples]
    all_rewards = np.concatenate([g.rewards for g in got.every])
    lengths = np.asarray([s.length for s in every])
    truncated = np.asarray([s.truncated for s in every])
    counts = status_counts([r for g in got.every for r in g.results or ()])

    def mean(key):
        return float(np.mean(m[key])) if key in m and np.size(m[key]) else 0.0

    def first(key):  # the first optimizer step's value: the policy the sampler ran
        return float(m[key][0]) if key in m and np.size(m[key]) else None

    return {
        "step": step,
        "stage": stage.index,
        "stage_step": k,
        "max_response_length": st.max_response_length,
        "sampling": cfg.sampling.name,  # the sampling method by its registered name
        "prompts": len(got.every),
        "reward": float(all_rewards.mean()),
        "accuracy_not_truncated": (
            float(all_rewards[~truncated].mean()) if (~truncated).any() else 0.0
        ),
        "truncated_fraction": float(truncated.mean()),
        "response_length_mean": float(lengths.mean()),
        "response_length_max": int(lengths.max()),
        "entropy": m["buffer_entropy"],
        # with entropy.tokens: e_k over the selected tokens, and their share
        **(
            {
                "entropy_selected": m["buffer_entropy_selected"],
                "selected_token_fraction": m["selected_token_fraction"],
            }
            if "buffer_entropy_selected" in m
            else {}
        ),
        "alpha": m["alpha"],
        "entropy_coef_next": m["entropy_coef_next"],
        "kept_group_fraction": m["kept_group_fraction"],
        "mixed_groups": got.mixed,
        "refill_rounds": got.rounds,
        "extra_rollouts": got.extra_rollouts,
        "sgd_steps": m["num_sgd_steps"],
        "update_token_fill": m.get("update_token_fill", 0.0),
        "loss": mean("loss"),
        "clipfrac_low": mean("clipfrac_low"),
        "clipfrac_high": mean("clipfrac_high"),
        "ratio_max": float(np.max(m["ratio_max"])) if np.size(m.get("ratio_max", [])) else 0.0,
        "approx_kl": mean("approx_kl"),
        "kl_beta": cfg.kl_beta(stage.index),
        "ref_kl": mean("ref_kl"),
        "sampler_ratio_mean": first("sampler_ratio_mean"),
        "sampler_ratio_max": first("sampler_ratio_max"),
        "sampler_kl": first("sampler_kl"),
        "sampler_abs_log_ratio_mean": first("sampler_abs_log_ratio_mean"),
        "sampler_abs_log_ratio_max": first("sampler_abs_log_ratio_max"),
        **(
            {"tis_weight_mean": mean("tis_weight_mean"), "tis_capped": mean("tis_capped")}
            if cfg.loss.tis_cap is not None
            else {}
        ),
        **({"behaviour_clipfrac": mean("behaviour_clipfrac")} if cfg.loss.behaviour_clip else {}),
        "grad_norm": mean("grad_norm"),
        "skipped_updates": skipped,
        "reward_status": counts,
        "rollout_tokens_per_s": sum(r.tokens for r in got.stats)
        / max(sum(r.wall_s for r in got.stats), 1e-9),
        **times,
    }


def format_row(row: JSON) -> str:
    """A step record's log line."""
    return (
        "[step {step}] stage {stage} reward {reward:.3f} trunc {truncated_fraction:.2f} "
        "len {response_length_mean:.0f}/{response_length_max} entropy {entropy:.3f} "
        "alpha {alpha:.4f} kept {kept_group_fraction:.2f} sgd {sgd_steps} "
        "clip {clipfrac_low:.3f}/{clipfrac_high:.3f} kl {approx_kl:.2e} gnorm {grad_norm:.3f} "
        "t_R {t_rollout_s:.1f}s t_T {t_update_s:.1f}s t_O {t_other_s:.1f}s"
    ).format(**row)


def format_eval(row: JSON, n: int) -> str:
    """An evaluation record's log line (avg@``n``)."""
    return (
        f"[eval step {row['step']}] avg@{n} {row['accuracy']:.3f} "
        f"pass@{n} {row['pass_at_n']:.3f} on {row['problems']} problems, "
        f"len {row['response_length_mean']:.0f}, trunc {row['truncated_fraction']:.2f}"
        + "".join(
            f"; at temperature {t}: avg@{n} {r['accuracy']:.3f}"
            for t, r in row.get("by_temperature", {}).items()
        )
        + f" ({row['t_eval_s']:.1f}s)"
    )
