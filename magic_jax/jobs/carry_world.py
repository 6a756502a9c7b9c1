"""The carry world: its base model (and how it is built) and its statistics.

``magic-jax build-world`` builds a 0.74M-parameter Qwen2 from a seed
(``worlds.build_world`` of ``CARRY``) by supervised training on
``magic_jax.data.tasks.carry``: first with every
column checked half the time (``balanced_steps``: the model learns to
execute both kinds of line), then at the base's habit of checking a column
with probability ``check_rate`` (``mixture_steps``: long enough for the habit
to settle, the supervised plateau). ``world_statistics`` measures a model on
held-out problems: how often it checks the columns that need it and the
others, accuracy per carry count, and the token entropy of correct against
wrong responses.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from magic_jax.jobs.worlds import (
    BuildOptions,
    World,
    build_world,
    read_rows_file,
    sample_heldout,
    sft_examples,
    world_driver,
)

CARRY_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "carry"
CARRY_BUILD = CARRY_ASSETS / "build.json"  # the shipped base's build settings and statistics
MAX_RESPONSE = 64  # tokens: the longest solution (5 columns, all checked) is 60 with EOS


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorldBuildConfig(BuildOptions):
    """How the carry world's base model is built.

    Attributes:
      balanced_steps: steps where every column is checked with probability 1/2
        (the model learns to execute both kinds of line).
      mixture_steps: steps at the base's habit, ``check_rate`` per column.
      check_rate: the base's probability of checking a column.
    """

    balanced_steps: int = 3200
    mixture_steps: int = 800
    check_rate: float = 0.25

    def steps(self) -> int:
        return self.balanced_steps + self.mixture_steps


def world_statistics(
    model: Any,
    params: Any,
    tok: Any,
    rows: list[dict[str, Any]],
    *,
    num_samples: int = 8,
    temperature: float = 1.0,
    max_response_length: int = MAX_RESPONSE,
    seed: int = 0,
    driver: Any = None,
) -> dict[str, Any]:
    """Samples ``num_samples`` responses per held-out row and measures the world's figures.

    Returns:
      ``accuracy``; ``check_rate_needed`` / ``check_rate_other``: how often
      a column is checked among the columns that must be and among the others;
      ``well_formed`` (share of responses with one line per column and the
      reasoning closed); ``by_carries``: accuracy per carry count; ``entropy`` (mean token entropy
      over all response tokens), ``entropy_correct`` / ``entropy_wrong`` (the
      same over correct and over wrong responses); ``length`` (mean response
      tokens); ``truncated`` (share that hit T); ``entropy_by_class`` (mean entropy
      of each ``carry.TOKEN_CLASSES`` class: choice, digit, format, after the answer)
      and ``tokens_by_class``.
    """
    from magic_jax.data.tasks import carry
    from magic_jax.data.tasks.vocab import TokenPieces

    if driver is None:
        driver = world_driver(model, temperature, max_response_length)
    _, groups = sample_heldout(driver, params, tok, rows, num_samples=num_samples, seed=seed)
    by: defaultdict[str | tuple[str, int], list[float]] = defaultdict(list)  # key -> rewards
    rate: dict[bool, list[bool]] = {True: [], False: []}  # needed column? -> checked or not
    ent: dict[bool, list[float]] = {True: [0.0, 0], False: [0.0, 0]}  # right? -> (sum, count)
    lengths, truncated, lines_ok = [], [], []
    by_class: dict[str, list[float]] = {c: [] for c in carry.TOKEN_CLASSES}  # class -> entropies
    pieces = TokenPieces(tok.decode)
    for row, g in zip(rows, groups):
        a, b = carry.row_problem(row)
        c = carry.carries(a, b)
        need = carry.needed(a, b)
        assert g.texts is not None, "sample_heldout keeps the texts"
        for s, text, r in zip(g.samples, g.texts, g.rewards):
            right = float(r) > 0.5
            by["all"].append(float(r))
            by[("carries", c)].append(float(r))
            checks = carry.read_checks(text)
            formed = checks is not None and len(checks) == len(need)
            lines_ok.append(formed)
            if checks is not None and formed:
                for needed, checked in zip(need, checks):
                    rate[needed].append(checked)
            for cls, e in zip(carry.token_classes(pieces(s.tokens[: s.length])), s.entropies):
                by_class[cls].append(float(e))
            ent[right][0] += float(np.sum(s.entropies[: s.length]))
            ent[right][1] += int(s.length)
            lengths.append(int(s.length))
            truncated.append(bool(s.truncated))
    n = len(by["all"])

    def mean(x):
        return float(np.mean(x)) if len(x) else float("nan")

    return {
        "accuracy": mean(by["all"]),
        "check_rate_needed": mean(rate[True]),
        "check_rate_other": mean(rate[False]),
        "well_formed": mean(lines_ok),
        "by_carries": {
            c: {"accuracy": mean(by[("carries", c)]), "samples": len(by[("carries", c)])}
            for c in sorted(k[1] for k in by if isinstance(k, tuple) and k[0] == "carries")
        },
        "entropy": (ent[True][0] + ent[False][0]) / max(ent[True][1] + ent[False][1], 1),
        "entropy_correct": ent[True][0] / max(ent[True][1], 1),
        "entropy_wrong": ent[False][0] / max(ent[False][1], 1),
        "length": mean(lengths),
        "truncated": mean(truncated),
        "samples": n,
        "entropy_by_class": {c: mean(v) for c, v in by_class.items()},
        "tokens_by_class": {c: len(v) for c, v in by_class.items()},
    }


def model_statistics(
    model_dir: str | Path,
    rows: list[dict[str, Any]] | str | Path,
    *,
    num_samples: int = 8,
    temperature: float = 1.0,
    seed: int = 0,
) -> dict[str, Any]:
    """``world_statistics`` of a saved Hugging Face model (a run's export, a built base).

    ``rows``: carry-world rows, or a ``.jsonl`` file of them (a world's ``heldout.jsonl``).
    """
    from flax import nnx

    from magic_jax.data.tasks import carry
    from magic_jax.model.convert import load_hf

    if not isinstance(rows, list):
        rows = read_rows_file(Path(rows))
    model = load_hf(str(model_dir))
    _, params = nnx.split(model, nnx.Param)
    return world_statistics(
        model,
        params,
        carry.tokenizer(),
        rows,
        num_samples=num_samples,
        temperature=temperature,
        seed=seed,
    )


def sft_continuation(
    seconds: float,
    *,
    seed: int = 0,
    num_samples: int = 4,
    model_dir: str | Path | None = None,
    heldout: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Supervised training continued from the carry world's base for ``seconds`` (steps only).

    The baseline a carry-world RL run must beat in the same wall time: fresh
    solutions at the base's own habit (``check_rate`` of its build, the data it
    plateaued on), batch 32, AdamW 3e-4; ``world_statistics`` of the held-out
    problems before and after (``before`` / ``after``).
    """
    from magic_jax.data.tasks import carry
    from magic_jax.jobs.demo import compare_sft

    model_dir = Path(model_dir or CARRY_ASSETS / "model")
    build = model_dir.parent / "build.json"
    rate = json.loads(build.read_text())["build"]["check_rate"] if build.exists() else 0.25
    task = carry.CarryTask(check_rate=rate)

    def examples(tok, rng, n, step, held):
        return checked_examples(task, tok, rng, n, rate, held)

    def evaluator(model, tok, rows, *, num_samples, seed):
        driver = world_driver(model, 1.0, MAX_RESPONSE)

        def run(params, step):  # the scalar figures (train_sft prints them)
            st = world_statistics(
                model, params, tok, rows, num_samples=num_samples, seed=seed, driver=driver
            )
            return {k: v for k, v in st.items() if isinstance(v, float)}

        return run

    out = compare_sft(
        model_dir,
        seconds,
        heldout=heldout or CARRY_ASSETS / "heldout.jsonl",
        num_samples=num_samples,
        seed=seed,
        examples=examples,
        evaluator=evaluator,
        log=log,
    )
    return {**out, "check_rate": rate}


def checked_examples(task, tok, rng: np.random.Generator, n: int, rate: float, exclude: set):
    """``n`` fresh supervised (prompt ids, response ids + EOS) pairs, each column checked
    with probability ``rate``, none held out."""
    from magic_jax.data.tasks import carry

    def response(i, a, b):
        return task.sft_response(a, b, rng, rate)

    return sft_examples(carry, task, tok, rng, n, exclude, response)


def _response(task: Any, config: WorldBuildConfig, rng, step: int, i: int, a: int, b: int) -> str:
    """Every column checked half the time, then at the base's habit (``check_rate``)."""
    rate = 0.5 if step < config.balanced_steps else config.check_rate
    return task.sft_response(a, b, rng, rate)


def _evaluator(model: Any, tok: Any, heldout: list[dict[str, Any]], config: WorldBuildConfig):
    """The held-out figures during the build, and the whole set's statistics at its end."""
    driver = world_driver(model, 1.0, MAX_RESPONSE)
    keys = ("accuracy", "check_rate_needed", "check_rate_other", "well_formed", "entropy")

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
        return {k: st[k] for k in keys}

    def final(params):
        return world_statistics(
            model, params, tok, heldout, num_samples=8, driver=driver, seed=config.seed
        )

    return evaluate, final


def _task(config: WorldBuildConfig) -> Any:
    from magic_jax.data.tasks import carry

    return carry.CarryTask(check_rate=config.check_rate)


CARRY = World(
    tag="build-world", task="carry", make_task=_task, response=_response, evaluator=_evaluator
)


def build_carry_world(
    out: str | Path, config: WorldBuildConfig | None = None, *, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Builds the carry world's base model and its problem files under ``out``
    (``worlds.build_world`` of ``CARRY``; ``build.json`` adds the final model's
    ``world_statistics``)."""
    return build_world(CARRY, out, config or WorldBuildConfig(), log=log)
