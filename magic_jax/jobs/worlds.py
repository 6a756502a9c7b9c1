"""The small worlds' base models: the one procedure that builds any of them.

A world is a task of ``magic_jax.data.tasks`` (the default's ``addition``, the
carry world's ``carry``) with a base model trained on it from scratch by
supervised steps, and the problems an RL run trains and is evaluated on.
``build_world`` writes them for a ``World``: the held-out and training
problems, a 0.74M-parameter Qwen2 of one shape (``MODEL``), its supervised
phases, its evaluation (the model is saved at each), and ``build.json``. The
worlds themselves are data: ``default_world.DEFAULT`` and ``carry_world.CARRY``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# Every world's base model: a 0.74M-parameter Qwen2 over a character vocabulary.
# the worlds' model shape (ModelConfig's options); each world adds its vocabulary
MODEL: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=352,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    tie_word_embeddings=True,
    rope_theta=1e4,
)
MAX_PROMPT = 16  # tokens: BOS, User, 11 characters at most, Assistant, <think>, \n
SFT_LENGTH = 80  # the longest prompt (16) and response (60 with EOS), rounded up

# (params, step) -> held-out figures ("accuracy" among them)
Evaluate = Callable[[Any, int], dict[str, Any]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildOptions:
    """What every world's base-model build takes; each world adds its phases.

    Attributes:
      seed: model initialisation, problems and the choices in the solutions.
      batch: examples per supervised step.
      learning_rate: AdamW peak rate (warm-up, then cosine decay over every step).
      train_problems / heldout_problems: RL training prompts and held-out problems.
      eval_every / eval_samples / eval_problems: plateau tracking during the build.
    """

    seed: int = 0
    batch: int = 32
    learning_rate: float = 2e-3
    train_problems: int = 4096
    heldout_problems: int = 256
    eval_every: int = 400
    eval_samples: int = 4
    eval_problems: int = 128

    def steps(self) -> int:
        """Supervised steps in all."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class World:
    """What a world's build needs beside the shared procedure.

    Attributes:
      tag: the build's log lines' prefix.
      task: the task's module in ``magic_jax.data.tasks`` (``tokenizer``,
        ``verl_rows``, ``row_problem``, ``prompt``).
      make_task: the build config -> the task object (its settings go to ``build.json``).
      response: ``(task, config, rng, step, i, a, b)`` -> the supervised response
        to ``a + b``, example ``i`` of step ``step``'s batch: the phases.
      evaluator: ``(model, tok, heldout rows, config)`` -> ``(evaluate, final)``:
        ``evaluate(params, step)`` runs at every evaluation of the build, after the
        model is saved; ``final(params)`` (or None) gives the finished model's
        ``statistics`` in ``build.json``.
      stop: characters that also end a response (end-of-sequence ids of the model
        beside the tokenizer's EOS): the lock-out world's ``}`` ends decoding at the answer.
      rows_task: draw the problem files with the build's task (``make_task``), for a
        world whose settings shape the problems (the decision world's ``digits`` and
        ``chain_share``); False: the task module's default problems.
    """

    tag: str
    task: str
    make_task: Callable[[Any], Any]
    response: Callable[..., str]
    evaluator: Callable[..., tuple[Evaluate, Callable[[Any], dict[str, Any]] | None]]
    stop: str = ""
    rows_task: bool = False

    def module(self) -> Any:
        return importlib.import_module(f"magic_jax.data.tasks.{self.task}")


def sft_examples(
    task_module: Any,
    task: Any,
    tok: Any,
    rng: np.random.Generator,
    n: int,
    exclude: set,
    response: Callable[[int, int, int], str],
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``n`` fresh supervised (prompt ids, response ids + EOS) pairs, none held out.

    ``response(i, a, b)``: the text of example ``i``, the problem ``a + b``.
    """
    from magic_jax.data.rows import render_r1

    prompts: list[np.ndarray] = []
    responses: list[np.ndarray] = []
    while len(prompts) < n:
        a, b = task.sample(rng)
        if (a, b) in exclude:
            continue
        msgs = [{"role": "user", "content": task_module.prompt(a, b)}]
        p = tok.encode(render_r1(msgs), add_special_tokens=False)
        r = tok.encode(response(len(prompts), a, b), add_special_tokens=False)
        prompts.append(np.asarray(p, np.int32))
        responses.append(np.asarray([*r, tok.eos_token_id], np.int32))
    return prompts, responses


def world_driver(model: Any, temperature: float, max_response_length: int) -> Any:
    """The engine a world's held-out figures sample with (128 decodes at once)."""
    from magic_jax.rollout.driver import make_driver
    from magic_jax.rollout.engine_config import EngineOptions
    from magic_jax.rollout.sampling import SamplingConfig

    return make_driver(
        model,
        EngineOptions(max_concurrent_decodes=128),
        max_prompt_length=MAX_PROMPT,
        max_response_length=max_response_length,
        sampling=SamplingConfig(temperature=temperature),
    )


def sample_heldout(
    driver: Any,
    params: Any,
    tok: Any,
    rows: list[dict[str, Any]],
    *,
    num_samples: int,
    seed: int,
    step: int = 0,
) -> tuple[list[Any], list[Any]]:
    """(parsed rows, their scored groups with texts): ``num_samples`` responses to each
    held-out row, with the evaluation's seed (``evaluate.eval_seed``)."""
    from magic_jax.data.rows import parse_row, tokenize_rows
    from magic_jax.rollout.evaluate import eval_seed
    from magic_jax.rollout.scoring import Scoring, score_groups

    parsed = [parse_row(r, "held-out", f"h{i}") for i, r in enumerate(rows)]
    parsed, _ = tokenize_rows(parsed, tok, max_prompt_length=MAX_PROMPT)
    groups, _, _ = score_groups(
        driver,
        params,
        parsed,
        Scoring(tok, keep_texts=True),
        num_samples=num_samples,
        seed=eval_seed(seed),
        step=step,
    )
    return parsed, groups


def write_rows_file(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def read_rows_file(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def _problems(world: World, config: Any, out: Path, task: Any) -> tuple[list[dict], set]:
    """Writes ``heldout.jsonl`` and ``train.jsonl`` (no held-out problem among the
    training ones); the held-out rows and their problems."""
    mod = world.module()
    task = task if world.rows_task else None
    heldout = mod.verl_rows(config.heldout_problems, config.seed + 1, task, source="heldout")
    held = {mod.row_problem(r) for r in heldout}
    train = mod.verl_rows(
        config.train_problems, config.seed + 2, task, source="train", exclude=held
    )
    write_rows_file(out / "heldout.jsonl", heldout)
    write_rows_file(out / "train.jsonl", train)
    return heldout, held


def _check_out(out: Path) -> None:
    if out.is_dir() and any(out.iterdir()) and not (out / "build.json").exists():
        raise FileExistsError(
            f"{out}: not empty and not a build of this command (no build.json); "
            f"choose a new or empty directory"
        )
    out.mkdir(parents=True, exist_ok=True)


def build_world(
    world: World, out: str | Path, config: Any, *, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Builds ``world``'s base model and its problem files under ``out``.

    Writes ``model/`` (Hugging Face checkpoint + tokenizer, saved at every
    evaluation), ``train.jsonl``, ``heldout.jsonl`` and ``build.json`` (the build's
    settings, its held-out curve, and the world's ``statistics`` of the final model
    if it has any). ``config`` has ``seed``, ``batch``, ``learning_rate``, the problem
    counts, ``eval_every`` and the steps of its phases (``steps()``). Deterministic
    for a seed up to XLA's CPU floating-point differences.
    """
    import jax.numpy as jnp
    from flax import nnx

    from magic_jax.model.config import ModelConfig
    from magic_jax.model.convert import save_hf
    from magic_jax.model.qwen2 import Qwen2, count_params
    from magic_jax.update.sft import SFTConfig, SFTTrainer, pack_sft, train_sft

    out = Path(out)
    _check_out(out)
    task, tok = world.make_task(config), world.module().tokenizer()
    heldout, held = _problems(world, config, out, task)
    eos = tok.eos_token_id
    if world.stop:
        eos = (eos, *tok.convert_tokens_to_ids(list(world.stop)))
    mcfg = ModelConfig(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=eos, **MODEL
    )
    model = Qwen2(mcfg, rngs=nnx.Rngs(config.seed))
    log(f"[{world.tag}] {count_params(model):,} parameters, vocabulary {len(tok)} (characters)")
    graphdef, params = nnx.split(model, nnx.Param)
    total = config.steps()
    sft_config = SFTConfig(learning_rate=config.learning_rate, decay_steps=max(total - 20, 1))
    sft = SFTTrainer(graphdef, params, sft_config)
    rng = np.random.default_rng(config.seed + 3)

    def make_batch(step):
        def response(i, a, b):
            return world.response(task, config, rng, step, i, a, b)

        p, r = sft_examples(world.module(), task, tok, rng, config.batch, held, response)
        return pack_sft(p, r, length=SFT_LENGTH, pad_id=tok.pad_token_id)

    evaluate, final = world.evaluator(model, tok, heldout, config)
    model_dir = out / "model"

    def evaluate_and_save(params, step):  # a usable model at every evaluation of a long build
        # fp32: the model is tiny (3 MB), and bf16 weights cost it accuracy
        save_hf(nnx.merge(graphdef, params), model_dir, dtype=jnp.float32)
        tok.save_pretrained(model_dir)
        return evaluate(params, step)

    t0 = time.perf_counter()
    res = train_sft(
        sft,
        make_batch,
        steps=total,
        evaluate=evaluate_and_save,
        eval_every=config.eval_every,
        log=log,
    )
    statistics = None if final is None else final(sft.params)
    info = {
        "build": dataclasses.asdict(config),
        "task": dataclasses.asdict(task),
        "parameters": count_params(model),
        "wall_s": time.perf_counter() - t0,
        **{k: res[k] for k in ("steps", "train_s", "loss", "evals")},
    }
    if statistics is not None:
        info["statistics"] = statistics
    (out / "build.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"[{world.tag}] wrote {model_dir} ({res['steps']} steps, {info['wall_s']:.0f}s)")
    return info
