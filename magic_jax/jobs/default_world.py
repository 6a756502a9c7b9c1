"""The default world: the shipped base model that adds numbers, its problems, its build.

``magic-jax train`` with no config runs ``configs/default.yaml`` (``demo.run_default``):
MAGIC on a 0.74M-parameter Qwen2 that adds multi-digit numbers
(``magic_jax.data.tasks.addition``), shipped inside the package as a Hugging
Face checkpoint (``magic_jax/assets/default/model``) with its training and
held-out problems. ``magic-jax build-default`` rebuilds those files from a
fixed seed (``worlds.build_world`` of ``DEFAULT``): supervised training from
scratch, first on a long worked solution style, then on its mixture with a
short guessing style, each phase long enough that held-out accuracy has
stopped improving (the supervised plateau).
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
    sft_examples,
    world_driver,
)

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "default"
MODEL_DIR = ASSETS / "model"
TRAIN_FILE = ASSETS / "train.jsonl"
HELDOUT_FILE = ASSETS / "heldout.jsonl"
CONFIG_FILE = ASSETS / "default.yaml"
MAX_RESPONSE = 64  # tokens: the longest worked solution (5 columns) is 60 with EOS


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildConfig(BuildOptions):
    """How the shipped base model is built.

    Supervised training runs in two phases: ``worked_steps`` on worked
    solutions only (the model learns to add column by column), then
    ``mixture_steps`` on the task's style mixture (``worked_share`` worked,
    the rest quick), long enough for the style choice and the quick style to
    settle: the plateau of the mixture data. The learning rate warms up, then
    decays (cosine) over both phases.

    Attributes:
      worked_steps / mixture_steps: the two phases, in steps of ``batch`` fresh examples.
      worked_share: the mixture's share of worked solutions.
    """

    worked_steps: int = 1600
    mixture_steps: int = 1000
    worked_share: float = 0.3
    eval_every: int = 200  # the style settles within a few hundred steps

    def steps(self) -> int:
        return self.worked_steps + self.mixture_steps


def addition_response(worked: bool, a: int, b: int, rng: np.random.Generator) -> str:
    """A worked (column by column) or quick solution of ``a + b``."""
    from magic_jax.data.tasks import addition

    return addition.worked_solution(a, b) if worked else addition.quick_solution(a, b, rng)


def mixture_examples(task: Any, tok: Any, rng: np.random.Generator, n: int, step: int, held: set):
    """``n`` supervised pairs of the task's style mixture at ``step`` (``compare_sft``'s data)."""
    from magic_jax.data.tasks import addition

    n_worked = task.worked_in_batch(step, n)
    return sft_examples(
        addition,
        task,
        tok,
        rng,
        n,
        held,
        lambda i, a, b: addition_response(i < n_worked, a, b, rng),
    )


def style_of(text: str) -> str:
    """``"quick"`` if a response closes its reasoning at once, else ``"worked"``."""
    return "quick" if text.lstrip().startswith("</think>") else "worked"


def make_evaluator(
    model: Any, tok: Any, rows: list[dict[str, Any]], *, num_samples: int, seed: int = 0
) -> Callable[[Any, int], dict[str, float]]:
    """(params, step) -> held-out avg@n at temperature 1, overall and per solution style.

    Uses the training engine (T = ``MAX_RESPONSE``) and the math reward.
    """
    driver = world_driver(model, 1.0, MAX_RESPONSE)

    def run(params, step):
        _, groups = sample_heldout(
            driver, params, tok, rows, num_samples=num_samples, seed=seed, step=step
        )
        by_style: dict[str, list[float]] = {"worked": [], "quick": []}
        ent_sum, tokens, n = 0.0, 0, 0
        for g in groups:
            for s, text, r in zip(g.samples, g.texts, g.rewards):
                by_style[style_of(text)].append(float(r))
                ent_sum += float(np.sum(s.entropies[: s.length]))
                tokens += s.length
                n += 1
        return {
            "accuracy": float(sum(map(sum, by_style.values())) / n),
            "worked_share": len(by_style["worked"]) / n,
            "worked_accuracy": float(np.mean(by_style["worked"])) if by_style["worked"] else 0.0,
            "quick_accuracy": float(np.mean(by_style["quick"])) if by_style["quick"] else 0.0,
            "entropy": ent_sum / max(tokens, 1),
        }

    return run


def _response(task: Any, config: BuildConfig, rng, step: int, i: int, a: int, b: int) -> str:
    """Worked solutions only, then the task's style mixture."""
    if step < config.worked_steps:
        return addition_response(True, a, b, rng)
    n_worked = task.worked_in_batch(step - config.worked_steps, config.batch)
    return addition_response(i < n_worked, a, b, rng)


def _evaluator(model: Any, tok: Any, heldout: list[dict[str, Any]], config: BuildConfig):
    rows = heldout[: config.eval_problems]
    return make_evaluator(model, tok, rows, num_samples=config.eval_samples), None


def _task(config: BuildConfig) -> Any:
    from magic_jax.data.tasks import addition

    return addition.AdditionTask(worked_share=config.worked_share)


DEFAULT = World(
    tag="build", task="addition", make_task=_task, response=_response, evaluator=_evaluator
)


def build_default(
    out: str | Path = ASSETS, config: BuildConfig | None = None, *, log=print
) -> dict[str, Any]:
    """Builds the shipped base model and its problem files under ``out``
    (``worlds.build_world`` of ``DEFAULT``)."""
    return build_world(DEFAULT, out, config or BuildConfig(), log=log)
