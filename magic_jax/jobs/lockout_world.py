"""The lock-out world: its base model (and how it is built) and its statistics.

``magic-jax build-world --world lockout`` builds a 0.74M-parameter Qwen2 from a seed
(``worlds.build_world`` of ``LOCKOUT``) by supervised training on
``magic_jax.data.tasks.lockout``: 4-digit additions, half full carry chains and half
with no carry, each column checked with probability ``check_rate`` (one phase), and
``}`` an end-of-sequence token of the model (decoding ends at the answer).
``world_statistics`` measures a model on held-out problems: accuracy on each half,
how often columns are checked, how often a chain gets its full check and how often
that full check is right, token entropy, and the lock-out probe (the exact
probability of the full check, ``magic_jax.rollout.probes.lockout_probe``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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

LOCKOUT_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "lockout"
LOCKOUT_BUILD = LOCKOUT_ASSETS / "build.json"  # the shipped base's build settings and statistics
SAMPLES_PER_STEP = 16 * 8  # configs/lockout.yaml's training step: 16 prompts x G 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class LockoutBuildConfig(BuildOptions):
    """How the lock-out world's base model is built.

    Attributes:
      sft_steps: supervised steps, every column checked with probability ``check_rate``.
      check_rate: the base's probability of checking a column (the full check of a
        chain: ``check_rate ** 4``).
      chain_share: share of chain problems (the rest have no carry).
    """

    sft_steps: int = 2400
    check_rate: float = 0.5
    chain_share: float = 0.5
    eval_every: int = 600  # four evaluations over the 2400 steps

    def steps(self) -> int:
        return self.sft_steps


def _tally(rows, groups) -> dict[str, Any]:
    """Per half (chain or not): rewards, check choices, full checks and their rewards."""
    from magic_jax.data.tasks import carry, lockout

    t: dict[str, Any] = {k: [] for k in ("chain", "plain", "checks_chain", "checks_plain")}
    t.update(full=[], full_right=[], formed=[], entropy=[0.0, 0], lengths=[], truncated=[])
    for row, g in zip(rows, groups):
        chain = lockout.is_chain(*lockout.row_problem(row))
        half = "chain" if chain else "plain"
        for s, text, r in zip(g.samples, g.texts, g.rewards):
            t[half].append(float(r))
            checks = carry.read_checks(text)
            formed = checks is not None and len(checks) == lockout.DIGITS
            t["formed"].append(formed)
            if checks is not None and formed:
                t[f"checks_{half}"].extend(checks)
                if chain:
                    t["full"].append(all(checks))
                    if all(checks):
                        t["full_right"].append(float(r))
            t["entropy"][0] += float(np.sum(s.entropies[: s.length]))
            t["entropy"][1] += int(s.length)
            t["lengths"].append(int(s.length))
            t["truncated"].append(bool(s.truncated))
    return t


def world_statistics(
    model: Any,
    params: Any,
    tok: Any,
    rows: list[dict[str, Any]],
    *,
    num_samples: int = 8,
    temperature: float = 1.0,
    max_response_length: int | None = None,
    seed: int = 0,
    driver: Any = None,
) -> dict[str, Any]:
    """Samples ``num_samples`` responses per held-out row and measures the world's figures.

    Returns:
      ``accuracy`` (all), ``accuracy_chain`` / ``accuracy_plain`` (each half);
      ``check_rate_chain`` / ``check_rate_plain`` (columns checked, well-formed
      responses); ``full_check`` (share of chain samples that check every column)
      and ``full_check_accuracy`` (how often those are right); ``well_formed``;
      ``entropy`` (mean token entropy); ``length``; ``truncated``; ``probe`` (the
      lock-out probe at ``temperature``, for ``SAMPLES_PER_STEP`` samples a step).
    """
    from flax import nnx

    from magic_jax.data.tasks import lockout
    from magic_jax.rollout.probes import ProbeContext, lockout_probe

    if driver is None:
        driver = world_driver(model, temperature, max_response_length or lockout.STAGE2_T)
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
        temperature=temperature,
        samples_per_step=SAMPLES_PER_STEP,
    )
    return {
        "accuracy": mean(t["chain"] + t["plain"]),
        "accuracy_chain": mean(t["chain"]),
        "accuracy_plain": mean(t["plain"]),
        "check_rate_chain": mean(t["checks_chain"]),
        "check_rate_plain": mean(t["checks_plain"]),
        "full_check": mean(t["full"]),
        "full_check_accuracy": mean(t["full_right"]),
        "well_formed": mean(t["formed"]),
        "entropy": t["entropy"][0] / max(t["entropy"][1], 1),
        "length": mean(t["lengths"]),
        "truncated": mean(t["truncated"]),
        "samples": len(t["chain"]) + len(t["plain"]),
        "probe": lockout_probe(ctx),
    }


def _response(task: Any, config: LockoutBuildConfig, rng, step: int, i: int, a: int, b: int):
    """Each column checked with probability ``check_rate`` throughout."""
    return task.sft_response(a, b, rng, config.check_rate)


def _evaluator(model: Any, tok: Any, heldout: list[dict[str, Any]], config: LockoutBuildConfig):
    """The held-out figures during the build, and the whole set's statistics at its end."""
    from magic_jax.data.tasks import lockout

    driver = world_driver(model, 1.0, lockout.STAGE2_T)
    keys = ("accuracy", "accuracy_chain", "check_rate_chain", "full_check", "full_check_accuracy")

    def evaluate(params, step):
        st = world_statistics(
            model,
            params,
            tok,
            heldout[: config.eval_problems],
            num_samples=config.eval_samples,
            driver=driver,
            seed=config.seed,
        )
        return {**{k: st[k] for k in keys}, "probe_p_mean": st["probe"]["p_mean"]}

    def final(params):
        return world_statistics(
            model, params, tok, heldout, num_samples=8, driver=driver, seed=config.seed
        )

    return evaluate, final


def _task(config: LockoutBuildConfig) -> Any:
    from magic_jax.data.tasks import lockout

    return lockout.LockoutTask(chain_share=config.chain_share, check_rate=config.check_rate)


LOCKOUT = World(
    tag="build-lockout",
    task="lockout",
    make_task=_task,
    response=_response,
    evaluator=_evaluator,
    stop="}",
)


def build_lockout_world(
    out: str | Path,
    config: LockoutBuildConfig | None = None,
    *,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Builds the lock-out world's base model and its problem files under ``out``
    (``worlds.build_world`` of ``LOCKOUT``; ``build.json`` adds the final model's
    ``world_statistics``)."""
    return build_world(LOCKOUT, out, config or LockoutBuildConfig(), log=log)
