"""The carry world: its base model (and how it is built) and its statistics.

``magic-jax build-world`` builds a 0.74M-parameter Qwen2 from a seed by
supervised training on ``magic_jax.data.tasks.carry``: first with every
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
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from magic_jax.jobs.demo import MAX_PROMPT, MODEL  # the default's model shape and prompts

CARRY_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "carry"
CARRY_BUILD = CARRY_ASSETS / "build.json"  # the shipped base's build settings and statistics
MAX_RESPONSE = 64  # tokens: the longest solution (5 columns, all checked) is 60 with EOS
SFT_LENGTH = 80  # the longest prompt and response, rounded up


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorldBuildConfig:
    """How the carry world's base model is built.

    Attributes:
      seed: model initialisation, problems and checking choices.
      balanced_steps: steps where every column is checked with probability 1/2
        (the model learns to execute both kinds of line).
      mixture_steps: steps at the base's habit, ``check_rate`` per column.
      batch: examples per step.
      learning_rate: AdamW peak rate (warm-up, then cosine decay over both phases).
      check_rate: the base's probability of checking a column.
      train_problems / heldout_problems: RL training prompts and held-out problems.
      eval_every / eval_samples / eval_problems: plateau tracking during the build.
    """

    seed: int = 0
    balanced_steps: int = 3200
    mixture_steps: int = 800
    batch: int = 32
    learning_rate: float = 2e-3
    check_rate: float = 0.25
    train_problems: int = 4096
    heldout_problems: int = 256
    eval_every: int = 400
    eval_samples: int = 4
    eval_problems: int = 128


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
      tokens); ``truncated`` (share that hit T).
    """
    from magic_jax.data.rows import parse_row, tokenize_rows
    from magic_jax.data.tasks import carry
    from magic_jax.rollout.evaluate import eval_seed
    from magic_jax.rollout.scoring import score_groups

    if driver is None:
        driver = world_driver(model, temperature, max_response_length)
    parsed = [parse_row(r, "held-out", f"h{i}") for i, r in enumerate(rows)]
    parsed, _ = tokenize_rows(parsed, tok, max_prompt_length=MAX_PROMPT)
    groups, _, _ = score_groups(
        driver, params, parsed, tokenizer=tok, num_samples=num_samples,
        seed=eval_seed(seed), step=0, keep_texts=True,
    )  # fmt: skip
    by = defaultdict(list)  # key -> rewards
    rate = {True: [], False: []}  # needed column? -> checked or not
    ent = {True: [0.0, 0], False: [0.0, 0]}
    lengths, truncated, lines_ok = [], [], []
    for row, g in zip(rows, groups):
        a, b = carry.row_problem(row)
        c = carry.carries(a, b)
        need = carry.needed(a, b)
        for s, text, r in zip(g.samples, g.texts, g.rewards):
            right = float(r) > 0.5
            by["all"].append(float(r))
            by[("carries", c)].append(float(r))
            checks = carry.read_checks(text)
            lines_ok.append(checks is not None and len(checks) == len(need))
            if lines_ok[-1]:
                for n, k in zip(need, checks):
                    rate[n].append(k)
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
    from magic_jax.jobs.demo import read_rows_file
    from magic_jax.model.convert import load_hf

    if not isinstance(rows, list):
        rows = read_rows_file(Path(rows))
    model = load_hf(str(model_dir))
    _, params = nnx.split(model, nnx.Param)
    return world_statistics(
        model, params, carry.tokenizer(), rows,
        num_samples=num_samples, temperature=temperature, seed=seed,
    )  # fmt: skip


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
        return _examples(task, tok, rng, n, rate, held)

    def evaluator(model, tok, rows, *, num_samples, seed):
        driver = world_driver(model)

        def run(params, step):  # the scalar figures (train_sft prints them)
            st = world_statistics(
                model, params, tok, rows, num_samples=num_samples, seed=seed, driver=driver
            )
            return {k: v for k, v in st.items() if isinstance(v, float)}

        return run

    out = compare_sft(
        model_dir, seconds, heldout=heldout or CARRY_ASSETS / "heldout.jsonl",
        num_samples=num_samples, seed=seed, examples=examples, evaluator=evaluator, log=log,
    )  # fmt: skip
    return {**out, "check_rate": rate}


def world_driver(model: Any, temperature: float = 1.0, max_response_length: int = MAX_RESPONSE):
    """The engine the statistics sample with."""
    from magic_jax.rollout.driver import make_driver
    from magic_jax.rollout.sampling import SamplingConfig

    return make_driver(
        model,
        max_prompt_length=MAX_PROMPT,
        max_response_length=max_response_length,
        sampling=SamplingConfig(temperature=temperature),
        max_concurrent_decodes=128,
    )


def _examples(task, tok, rng: np.random.Generator, n: int, rate: float, exclude: set):
    """``n`` fresh supervised (prompt ids, response ids + EOS) pairs, each column checked
    with probability ``rate``, none held out."""
    from magic_jax.data.rows import render_r1
    from magic_jax.data.tasks import carry

    prompts, responses = [], []
    while len(prompts) < n:
        a, b = task.sample(rng)
        if (a, b) in exclude:
            continue
        msgs = [{"role": "user", "content": carry.prompt(a, b)}]
        p = tok.encode(render_r1(msgs), add_special_tokens=False)
        r = tok.encode(task.sft_response(a, b, rng, rate), add_special_tokens=False)
        prompts.append(np.asarray(p, np.int32))
        responses.append(np.asarray([*r, tok.eos_token_id], np.int32))
    return prompts, responses


def build_world(
    out: str | Path, config: WorldBuildConfig | None = None, *, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Builds the carry world's base model and its problem files under ``out``.

    Writes ``model/`` (Hugging Face checkpoint + tokenizer, saved at every
    evaluation), ``train.jsonl``, ``heldout.jsonl`` and ``build.json`` (the
    settings, the held-out curve and the final model's ``world_statistics``).
    """
    import jax.numpy as jnp
    from flax import nnx

    from magic_jax.data.tasks import carry
    from magic_jax.model.config import ModelConfig
    from magic_jax.model.convert import save_hf
    from magic_jax.model.qwen2 import Qwen2, count_params
    from magic_jax.update.sft import SFTConfig, SFTTrainer, pack_sft, train_sft

    config = config or WorldBuildConfig()
    out = Path(out)
    if out.is_dir() and any(out.iterdir()) and not (out / "build.json").exists():
        raise FileExistsError(
            f"{out}: not empty and not a build of this command (no build.json); "
            f"choose a new or empty directory"
        )
    out.mkdir(parents=True, exist_ok=True)
    task = carry.CarryTask(check_rate=config.check_rate)
    tok = carry.tokenizer()
    heldout = carry.verl_rows(config.heldout_problems, seed=config.seed + 1, source="heldout")
    held = {carry.row_problem(r) for r in heldout}
    train = carry.verl_rows(
        config.train_problems, seed=config.seed + 2, source="train", exclude=held
    )
    for name, rows in (("heldout.jsonl", heldout), ("train.jsonl", train)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    mcfg = ModelConfig(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **MODEL
    )
    model = Qwen2(mcfg, rngs=nnx.Rngs(config.seed))
    log(f"[build-world] {count_params(model):,} parameters, vocabulary {len(tok)} (characters)")
    graphdef, params = nnx.split(model, nnx.Param)
    total = config.balanced_steps + config.mixture_steps
    sft = SFTTrainer(
        graphdef,
        params,
        SFTConfig(learning_rate=config.learning_rate, decay_steps=max(total - 20, 1)),
    )
    rng = np.random.default_rng(config.seed + 3)

    def make_batch(step):
        rate = 0.5 if step < config.balanced_steps else config.check_rate
        p, r = _examples(task, tok, rng, config.batch, rate, held)
        return pack_sft(p, r, length=SFT_LENGTH, pad_id=tok.pad_token_id)

    driver = world_driver(model)
    model_dir = out / "model"

    def evaluate_and_save(params, step):
        save_hf(nnx.merge(graphdef, params), model_dir, dtype=jnp.float32)
        tok.save_pretrained(model_dir)
        st = world_statistics(
            model, params, tok, heldout[: config.eval_problems],
            num_samples=config.eval_samples, driver=driver, seed=config.seed,
        )  # fmt: skip
        return {
            k: st[k]
            for k in ("accuracy", "check_rate_needed", "check_rate_other", "well_formed", "entropy")
        }

    t0 = time.perf_counter()
    res = train_sft(
        sft, make_batch, steps=total, evaluate=evaluate_and_save,
        eval_every=config.eval_every, log=log,
    )  # fmt: skip
    stats = world_statistics(
        model, sft.params, tok, heldout, num_samples=8, driver=driver, seed=config.seed
    )
    info = {
        "build": dataclasses.asdict(config),
        "task": dataclasses.asdict(task),
        "parameters": count_params(model),
        "wall_s": time.perf_counter() - t0,
        **{k: res[k] for k in ("steps", "train_s", "loss", "evals")},
        "statistics": stats,
    }
    (out / "build.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"[build-world] wrote {model_dir} ({res['steps']} steps, {info['wall_s']:.0f}s)")
    return info
