"""The decision world: its base model (and how it is built), its statistics and its runs.

``magic-jax build-world --world decision`` builds a 0.74M-parameter Qwen2 from a seed
(``worlds.build_world`` of ``DECISION``) by supervised training on
``magic_jax.data.tasks.decision``: ``digits``-digit additions, a share ``chain_share``
of full carry chains and the rest with no carry, each line opening with ``<check>``
(probability ``check_rate``) or ``<skip>``, and ``}`` an end-of-sequence token.
``world_statistics`` measures a model on held-out problems, the decision probe
(``magic_jax.rollout.probes.decision_probe``) among them; ``run_config`` writes the
two-stage run of one pilot arm (``magic_jax.experiments.pilots``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from magic_jax.jobs.worlds import (
    BuildOptions,
    World,
    build_world,
    sample_heldout,
    world_driver,
)

SAMPLES_PER_STEP = 16 * 8  # a training step of run_config: 16 prompts x G 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecisionBuildConfig(BuildOptions):
    """How the decision world's base model is built.

    Attributes:
      sft_steps: supervised steps, each line ``<check>`` with probability ``check_rate``.
      check_rate: the base's habit, in (0, 1): P(full check) of a chain is about
        ``check_rate ** digits``.
      chain_share: share of chain problems, in (0, 1] (the rest have no carry).
      digits: operand size and decisions per response (2-4).
    """

    sft_steps: int = 2400
    check_rate: float = 0.5
    chain_share: float = 0.5
    digits: int = 3
    eval_every: int = 600

    def __post_init__(self):
        from magic_jax.data.tasks import decision

        if self.sft_steps <= 0:
            raise ValueError(f"sft_steps must be positive, got {self.sft_steps}")
        decision.DecisionTask(
            digits=self.digits, chain_share=self.chain_share, check_rate=self.check_rate
        )

    def steps(self) -> int:
        return self.sft_steps


def _tally(rows, groups) -> dict[str, Any]:
    """Per half (chain or not): rewards, decisions, full checks and their rewards."""
    from magic_jax.data.tasks import decision

    t: dict[str, Any] = {k: [] for k in ("chain", "plain", "checks", "full", "full_right")}
    t.update(formed=[], entropy=[0.0, 0], lengths=[])
    for row, g in zip(rows, groups):
        chain = decision.is_chain(*decision.row_problem(row))
        for s, text, r in zip(g.samples, g.texts, g.rewards):
            t["chain" if chain else "plain"].append(float(r))
            read = decision.read_decisions(text)
            formed = read is not None and len(read) == len(str(row["extra_info"]["a"]))
            t["formed"].append(formed)
            if read is not None and formed:
                t["checks"].extend(read)
                if chain:
                    t["full"].append(all(read))
                    if all(read):
                        t["full_right"].append(float(r))
            t["entropy"][0] += float(np.sum(s.entropies[: s.length]))
            t["entropy"][1] += int(s.length)
            t["lengths"].append(int(s.length))
    return t


def world_statistics(
    model: Any,
    params: Any,
    tok: Any,
    rows: list[dict[str, Any]],
    *,
    num_samples: int = 8,
    seed: int = 0,
    driver: Any = None,
) -> dict[str, Any]:
    """Samples ``num_samples`` responses per held-out row (temperature 1, stage 2's T).

    Returns:
      ``accuracy``, ``accuracy_chain``, ``accuracy_plain``; ``check_rate`` (lines opened
      with ``<check>``, well-formed responses); ``full_check`` (chain samples checking
      every line) and ``full_check_accuracy``; ``well_formed``; ``entropy`` (mean token
      entropy); ``length``; ``samples``; ``probe`` (the decision probe).
    """
    from flax import nnx

    from magic_jax.data.tasks import decision
    from magic_jax.rollout.probes import ProbeContext, decision_probe

    digits = len(str(rows[0]["extra_info"]["a"]))
    if driver is None:
        driver = world_driver(model, 1.0, decision.stage2_limit(digits))
    parsed, groups = sample_heldout(driver, params, tok, rows, num_samples=num_samples, seed=seed)
    t = _tally(rows, groups)

    def mean(x):
        return float(np.mean(x)) if len(x) else float("nan")

    graphdef, _ = nnx.split(model, nnx.Param)
    ctx = ProbeContext(
        graphdef=graphdef,
        params=params,
        rows=parsed,
        tokenizer=tok,
        eos_ids=model.config.eos_ids,
        samples_per_step=SAMPLES_PER_STEP,
    )
    return {
        "accuracy": mean(t["chain"] + t["plain"]),
        "accuracy_chain": mean(t["chain"]),
        "accuracy_plain": mean(t["plain"]),
        "check_rate": mean(t["checks"]),
        "full_check": mean(t["full"]),
        "full_check_accuracy": mean(t["full_right"]),
        "well_formed": mean(t["formed"]),
        "entropy": t["entropy"][0] / max(t["entropy"][1], 1),
        "length": mean(t["lengths"]),
        "samples": len(t["chain"]) + len(t["plain"]),
        "probe": decision_probe(ctx),
    }


def _response(task: Any, config: DecisionBuildConfig, rng, step: int, i: int, a: int, b: int):
    """Each line ``<check>`` with probability ``check_rate`` throughout."""
    return task.sft_response(a, b, rng, config.check_rate)


def _evaluator(model: Any, tok: Any, heldout: list[dict[str, Any]], config: DecisionBuildConfig):
    """The held-out figures during the build, and the whole set's statistics at its end."""
    from magic_jax.data.tasks import decision

    driver = world_driver(model, 1.0, decision.stage2_limit(config.digits))
    keys = ("accuracy", "accuracy_chain", "check_rate", "full_check", "full_check_accuracy")

    def statistics(params, rows, n):
        return world_statistics(
            model, params, tok, rows, num_samples=n, driver=driver, seed=config.seed
        )

    def evaluate(params, step):
        st = statistics(params, heldout[: config.eval_problems], config.eval_samples)
        return {**{k: st[k] for k in keys}, "probe_p_mean": st["probe"]["p_mean"]}

    return evaluate, lambda params: statistics(params, heldout, 8)


def _task(config: DecisionBuildConfig) -> Any:
    from magic_jax.data.tasks import decision

    return decision.DecisionTask(
        digits=config.digits, chain_share=config.chain_share, check_rate=config.check_rate
    )


DECISION = World(
    tag="build-decision",
    task="decision",
    make_task=_task,
    response=_response,
    evaluator=_evaluator,
    stop="}",
    rows_task=True,
)


def build_decision_world(
    out: str | Path,
    config: DecisionBuildConfig | None = None,
    *,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Builds the decision world's base model and its problem files under ``out``
    (``worlds.build_world`` of ``DECISION``; ``build.json`` adds ``world_statistics``)."""
    return build_world(DECISION, out, config or DecisionBuildConfig(), log=log)


def run_config(
    base: str | Path,
    *,
    digits: int,
    stage1_steps: int,
    stage2_steps: int,
    eval_every: int,
    seed: int,
    output_dir: str | Path,
    overrides: Sequence[str] = (),
    extra: Mapping[str, Any] | None = None,
) -> Any:
    """The two-stage run of a decision world built under ``base`` (a ``TrainConfig``).

    Stage 1 (T = ``stage1_limit``: any checked line truncated) and stage 2 (T =
    ``stage2_limit``: the full check fits), 16 prompts x G 8 a step, evaluation every
    ``eval_every`` steps with the decision probe. The entropy settings are the shipped
    adaptive ones of the lock-out world unless ``overrides`` (``"entropy.mode=fixed"``,
    ...) say otherwise.

    Raises:
      ConfigError: a bad option, named by its path.
    """
    from magic_jax.data.tasks import decision
    from magic_jax.run.config import load_config

    base = Path(base)
    stage = dict(prompts_per_step=16, mini_batch_groups=16, group_size=8)
    limits = (decision.stage1_limit(digits), decision.stage2_limit(digits))
    raw = {
        "model": str(base / "model"),
        "output_dir": str(output_dir),
        "data": {"train": [str(base / "train.jsonl")], "max_prompt_length": 16},
        "eval": {
            "data": [str(base / "heldout.jsonl")],
            "every": eval_every,
            "num_samples": 4,
            "max_response_length": limits[1],
            "probe": "decision",
        },
        "stages": [
            {"name": f"T{limits[0]}", "steps": stage1_steps, "max_response_length": limits[0]},
            {"name": f"T{limits[1]}", "steps": stage2_steps, "max_response_length": limits[1]},
        ],
        "sampling": {"temperature": 1.0},
        "loss": {"eps_low": 0.2, "eps_high": 0.28},
        "entropy": {"mode": "adaptive", "target": 0.09, "delta": 0.01, "max_coef": None},
        "optimizer": {"learning_rate": 3.0e-4, "weight_decay": 0.0},
        "rollout": {"max_concurrent_decodes": 128, "decode_steps": 64},
        "rewards": {"num_workers": 2},
        "seed": seed,
        "checkpoint_every": stage1_steps + stage2_steps,
        "keep_checkpoints": 1,
        "export_hf": False,
        **(extra or {}),
    }
    for s in raw["stages"]:
        s.update(stage)
    return load_config(raw=raw, overrides=list(overrides), name="decision run")
