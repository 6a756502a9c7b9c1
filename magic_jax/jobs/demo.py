"""The embedded default: the shipped base model (and how it is built), its data and its run.

``magic-jax train`` with no config runs ``configs/default.yaml``: MAGIC on a
0.74M-parameter Qwen2 that adds multi-digit numbers
(``magic_jax.data.tasks.addition``), shipped inside the package as a Hugging Face
checkpoint (``magic_jax/assets/default/model``) with its training and
held-out problems. ``magic-jax build-default`` rebuilds those files from a
fixed seed: supervised training from scratch, first on a long worked
solution style, then on its mixture with a short guessing style, each phase
long enough that held-out accuracy has stopped improving (the supervised
plateau). ``compare_sft`` continues supervised
training from the shipped model for a given wall time: the baseline a MAGIC
run must beat.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "default"
MODEL_DIR = ASSETS / "model"
TRAIN_FILE = ASSETS / "train.jsonl"
HELDOUT_FILE = ASSETS / "heldout.jsonl"
CONFIG_FILE = ASSETS / "default.yaml"
RUN_TIME_FILE = "default_run.json"  # in the run directory: the wall time of the whole command

MODEL = dict(
    hidden_size=128,
    intermediate_size=352,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    tie_word_embeddings=True,
    rope_theta=1e4,
)
MAX_PROMPT = 16  # tokens: BOS, User, 11 characters at most, Assistant, <think>, \n
MAX_RESPONSE = 64  # tokens: the longest worked solution (5 columns) is 60 with EOS


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """How the shipped base model is built.

    Supervised training runs in two phases: ``worked_steps`` on worked
    solutions only (the model learns to add column by column), then
    ``mixture_steps`` on the task's style mixture (``worked_share`` worked,
    the rest quick), long enough for the style choice and the quick style to
    settle: the plateau of the mixture data. The learning rate warms up, then
    decays (cosine) over both phases.

    Attributes:
      seed: model initialisation, problems and style choices.
      worked_steps / mixture_steps: the two phases, in steps of ``batch`` fresh examples.
      batch: examples per step.
      learning_rate: AdamW peak rate.
      worked_share: the mixture's share of worked solutions.
      train_problems / heldout_problems: RL training prompts and held-out problems.
      eval_every / eval_samples / eval_problems: plateau tracking during the build.
    """

    seed: int = 0
    worked_steps: int = 1600
    mixture_steps: int = 1000
    batch: int = 32
    learning_rate: float = 2e-3
    worked_share: float = 0.3
    train_problems: int = 4096
    heldout_problems: int = 256
    eval_every: int = 200
    eval_samples: int = 4
    eval_problems: int = 128


def _examples(task, tok, rng: np.random.Generator, n: int, n_worked: int, exclude: set):
    """``n`` fresh supervised (prompt ids, response ids + EOS) pairs, none held out.

    The first ``n_worked`` problems get worked solutions, the rest quick ones
    (problems are random, so the order says nothing).
    """
    from magic_jax.data.rows import render_r1
    from magic_jax.data.tasks import addition

    prompts, responses = [], []
    while len(prompts) < n:
        a, b = task.sample(rng)
        if (a, b) in exclude:
            continue
        msgs = [{"role": "user", "content": addition.prompt(a, b)}]
        p = tok.encode(render_r1(msgs), add_special_tokens=False)
        if len(prompts) < n_worked:
            text = addition.worked_solution(a, b)
        else:
            text = addition.quick_solution(a, b, rng)
        r = tok.encode(text, add_special_tokens=False)
        prompts.append(np.asarray(p, np.int32))
        responses.append(np.asarray([*r, tok.eos_token_id], np.int32))
    return prompts, responses


def style_of(text: str) -> str:
    """``"quick"`` if a response closes its reasoning at once, else ``"worked"``."""
    return "quick" if text.lstrip().startswith("</think>") else "worked"


def make_evaluator(
    model: Any, tok: Any, rows: list[dict[str, Any]], *, num_samples: int, seed: int = 0
) -> Callable[[Any, int], dict[str, float]]:
    """(params, step) -> held-out avg@n at temperature 1, overall and per solution style.

    Uses the training engine (T = ``MAX_RESPONSE``) and the math reward.
    """
    from magic_jax.data.rows import parse_row, tokenize_rows
    from magic_jax.rollout.driver import make_driver
    from magic_jax.rollout.evaluate import eval_seed
    from magic_jax.rollout.sampling import SamplingConfig
    from magic_jax.rollout.scoring import score_groups

    parsed = [parse_row(r, "held-out", f"h{i}") for i, r in enumerate(rows)]
    parsed, _ = tokenize_rows(parsed, tok, max_prompt_length=MAX_PROMPT)
    driver = make_driver(
        model,
        max_prompt_length=MAX_PROMPT,
        max_response_length=MAX_RESPONSE,
        sampling=SamplingConfig(temperature=1.0),
        max_concurrent_decodes=128,
    )

    def run(params, step):
        groups, _, _ = score_groups(
            driver,
            params,
            parsed,
            tokenizer=tok,
            num_samples=num_samples,
            seed=eval_seed(seed),
            step=step,
            keep_texts=True,
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


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def read_rows_file(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def build_default(
    out: str | Path = ASSETS, config: BuildConfig | None = None, *, log=print
) -> dict[str, Any]:
    """Builds the shipped base model and its problem files under ``out``.

    Writes ``model/`` (Hugging Face checkpoint + tokenizer), ``train.jsonl``,
    ``heldout.jsonl`` and ``build.json`` (the build's settings and its
    held-out accuracy curve). Deterministic for a seed up to XLA's CPU
    floating-point differences.
    """
    import jax.numpy as jnp
    from flax import nnx

    from magic_jax.data.tasks import addition
    from magic_jax.model.config import ModelConfig
    from magic_jax.model.convert import save_hf
    from magic_jax.model.qwen2 import Qwen2, count_params
    from magic_jax.update.sft import SFTConfig, SFTTrainer, pack_sft, train_sft

    config = config or BuildConfig()
    out = Path(out)
    if out.is_dir() and any(out.iterdir()) and not (out / "build.json").exists():
        raise FileExistsError(
            f"{out}: not empty and not a build of this command (no build.json); "
            f"choose a new or empty directory"
        )
    out.mkdir(parents=True, exist_ok=True)
    task = addition.AdditionTask(worked_share=config.worked_share)
    tok = addition.tokenizer()
    heldout = addition.verl_rows(config.heldout_problems, seed=config.seed + 1, source="heldout")
    held = {addition.row_problem(r) for r in heldout}
    train = addition.verl_rows(
        config.train_problems, seed=config.seed + 2, source="train", exclude=held
    )
    _write_rows(out / "heldout.jsonl", heldout)
    _write_rows(out / "train.jsonl", train)
    mcfg = ModelConfig(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **MODEL
    )
    model = Qwen2(mcfg, rngs=nnx.Rngs(config.seed))
    log(f"[build] {count_params(model):,} parameters, vocabulary {len(tok)} (characters)")
    graphdef, params = nnx.split(model, nnx.Param)
    total = config.worked_steps + config.mixture_steps
    sft = SFTTrainer(
        graphdef,
        params,
        SFTConfig(learning_rate=config.learning_rate, decay_steps=total - 20),
    )
    rng = np.random.default_rng(config.seed + 3)
    length = 80  # the longest prompt (16) and worked response (60 with EOS), rounded up

    def make_batch(step):
        if step < config.worked_steps:
            n_worked = config.batch
        else:
            n_worked = task.worked_in_batch(step - config.worked_steps, config.batch)
        p, r = _examples(task, tok, rng, config.batch, n_worked, held)
        return pack_sft(p, r, length=length, pad_id=tok.pad_token_id)

    evaluate = make_evaluator(
        model, tok, heldout[: config.eval_problems], num_samples=config.eval_samples
    )
    model_dir = out / "model"

    def save():
        # fp32: the model is tiny (3 MB), and bf16 weights cost it accuracy
        save_hf(nnx.merge(graphdef, sft.params), model_dir, dtype=jnp.float32)
        tok.save_pretrained(model_dir)

    def evaluate_and_save(params, step):
        save()  # a usable model at every evaluation of a long build
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
    info = {
        "build": dataclasses.asdict(config),
        "task": dataclasses.asdict(task),
        "parameters": count_params(model),
        "wall_s": time.perf_counter() - t0,
        **{k: res[k] for k in ("steps", "train_s", "loss", "evals")},
    }
    (out / "build.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"[build] wrote {model_dir} ({res['steps']} steps, {info['wall_s']:.0f}s)")
    return info


# --------------------------------------------------------------------------- the default run


def check_shipped_model(path: str | Path) -> None:
    """Raises ``CheckpointError`` in one line if a model directory is missing or unreadable.

    Checked before the run starts, so a bad model leaves no run directory behind.
    """
    from magic_jax.model.convert import CheckpointError

    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(
            f"model {p}: missing (the shipped base model; rebuild it with "
            f"`magic-jax build-default --out {ASSETS}`)"
        )
    if not (p / "config.json").is_file():
        raise CheckpointError(f"model {p}: config.json is missing")
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"model {p}: no *.safetensors weights")
    from safetensors import safe_open

    for f in files:  # the header names every tensor: a truncated or garbled file fails here
        try:
            with safe_open(f, "numpy") as st:
                st.keys()
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"model {f}: not a readable safetensors file ({e})") from None


def shortest_response(rows: list[dict[str, Any]], tok: Any) -> int:
    """Tokens (EOS included) of the shortest correct response to any addition row."""
    from magic_jax.data.tasks import addition

    best = None
    for r in rows:
        a, b = addition.row_problem(r)
        n = len(tok.encode(f"</think>\n\\boxed{{{a + b}}}", add_special_tokens=False)) + 1
        best = n if best is None else min(best, n)
    return best or 0


def check_task(config: Any) -> None:
    """Refuses a default-task config whose response limits no correct answer fits.

    Raises:
      ConfigError: naming the stage (or ``eval.max_response_length``) whose T is
        shorter than the shortest correct response of the task's problems.
    """
    from magic_jax.data.rows import read_rows
    from magic_jax.data.tasks import addition
    from magic_jax.run.config import ConfigError

    rows = [r.as_verl_row() for r in read_rows(config.data.train)]
    if not rows or "a" not in rows[0].get("extra_info", {}):
        return  # not the addition task's rows: nothing to check
    need = shortest_response(rows, addition.tokenizer())
    limits = [(f"stages[{i}].max_response_length", s.max_response_length)
              for i, s in enumerate(config.stages)]  # fmt: skip
    if config.eval is not None and config.eval.max_response_length is not None:
        limits.append(("eval.max_response_length", config.eval.max_response_length))
    for name, t in limits:
        if t < need:
            raise ConfigError(
                f"{name}: T = {t} is shorter than any correct answer of the task "
                f"(the shortest takes {need} tokens with EOS)"
            )


def overview_figure(run_dir: str | Path, png: str | Path) -> Path:
    """One PNG of a run's MAGIC dynamics: entropy with its target and alpha, held-out
    accuracy, response length with the limit T, truncated fraction (stages marked)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from magic_jax.jobs import report

    runs = [report.load_run(run_dir)]
    fig = Figure(figsize=(11, 6.4), dpi=100)
    axes = fig.subplots(2, 2).ravel()
    panels = {stem: (title, ylabel, plot) for stem, title, ylabel, plot in report.PANELS}
    for ax, stem in zip(axes, ("entropy", "eval", "length", "truncated")):
        title, ylabel, plot = panels[stem]
        plot(ax, runs)
        if stem == "entropy":  # alpha_k on its own scale
            twin = ax.twinx()
            x, y = runs[0].series("alpha")
            twin.plot(x, y, color="tab:red", linewidth=1.0, alpha=0.7)
            twin.set_ylabel("alpha_k", color="tab:red")
            title = "Token entropy, target (dashed) and alpha_k (red)"
        report.mark_stages(ax, runs)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)
    return Path(png)


def _first_last_eval(output_dir: Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    path = output_dir / "eval.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return (rows[0], rows[-1]) if rows else None


def run_default(
    overrides: list[str] | tuple[str, ...] = (),
    *,
    config_path: str | Path | None = None,
    report: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """``magic-jax train`` with no config: the default run, its report and a final line.

    Returns the trainer's summary plus ``accuracy_before``, ``accuracy_after``,
    ``wall_s`` and ``report`` (the HTML page, if written).
    """
    from magic_jax.run.config import load_config
    from magic_jax.run.trainer import Trainer

    t0 = time.perf_counter()
    config = load_config(config_path or CONFIG_FILE, list(overrides))
    check_shipped_model(config.model)
    check_task(config)
    out = Path(config.output_dir)
    timing = out / RUN_TIME_FILE
    ran_before = timing.exists()
    summary = dict(Trainer(config, log=log).run())
    summary.update(output_dir=str(out), model=config.model)
    if report:
        from magic_jax.jobs.report import write_report

        try:
            summary["report"] = str(write_report([out], out / "report.html"))
            overview_figure(out, out / "overview.png")
        except ImportError as e:  # matplotlib missing: the run itself is complete
            log(f"[report] not written: {e}")
    from magic_jax import compile_cache

    wall = time.perf_counter() - t0
    if ran_before:  # a finished run reported again: its own wall time
        wall = json.loads(timing.read_text())["wall_s"]
    elif summary.get("stopped_by") is None:
        timing.write_text(json.dumps({"wall_s": wall}) + "\n")
    summary["wall_s"] = wall
    clock = compile_cache.CLOCK
    summary.update(compile_s=clock.compile_seconds, compiled=clock.compiled,
                   cache_read_s=clock.read_seconds, cache_hits=clock.cache_hits)  # fmt: skip
    ends = _first_last_eval(out)
    if ends is not None:
        first, last = ends
        summary["accuracy_before"], summary["accuracy_after"] = first["accuracy"], last["accuracy"]
        n = first.get("num_samples", "n")
        log(
            f"[done] held-out avg@{n}: {first['accuracy']:.3f} before -> {last['accuracy']:.3f} "
            f"after (step {last['step']}); wall time {wall / 60:.1f} min, "
            f"{compile_cache.CLOCK.summary()}"
            + (f"; report {summary['report']}" if "report" in summary else "")
        )
    return summary


def compare_sft(
    model_dir: str | Path,
    seconds: float,
    *,
    heldout: str | Path = HELDOUT_FILE,
    num_samples: int = 8,
    learning_rate: float = 3e-4,
    batch: int = 32,
    worked_share: float = 0.3,
    seed: int = 0,
    examples: Callable[..., tuple[list, list]] | None = None,
    evaluator: Callable[..., Callable[[Any, int], dict[str, Any]]] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Continues supervised training of ``model_dir`` on the task's mixture for ``seconds``.

    The baseline of a MAGIC run from the same model: the same held-out problems
    and avg@n at temperature 1, evaluated before and after ``seconds`` of
    training steps (evaluation time not counted). Fresh AdamW, constant
    ``learning_rate`` after a 20-step warm-up.

    Another task's data and measures (the carry world's): ``examples(tok, rng, n, step,
    held)`` returns ``n`` (prompt ids, response ids) pairs avoiding the held-out
    problems ``held``; ``evaluator(model, tok, rows, num_samples=, seed=)`` returns
    ``(params, step) -> {"accuracy": ..., ...}``. By default, the addition task's style
    mixture (``worked_share``) and ``make_evaluator``.
    """
    from flax import nnx

    from magic_jax.data.tasks import addition
    from magic_jax.model.convert import load_hf
    from magic_jax.run.trainer import load_tokenizer
    from magic_jax.update.sft import SFTConfig, SFTTrainer, pack_sft, train_sft

    model = load_hf(model_dir)
    tok = load_tokenizer(model_dir)
    rows = read_rows_file(Path(heldout))
    held = {addition.row_problem(r) for r in rows}
    if examples is None:
        task = addition.AdditionTask(worked_share=worked_share)

        def examples(tok, rng, n, step, held):
            return _examples(task, tok, rng, n, task.worked_in_batch(step, n), held)

    graphdef, params = nnx.split(model, nnx.Param)
    sft = SFTTrainer(graphdef, params, SFTConfig(learning_rate=learning_rate))
    rng = np.random.default_rng(seed + 7)

    def make_batch(step):
        p, r = examples(tok, rng, batch, step, held)
        return pack_sft(p, r, length=80, pad_id=tok.pad_token_id)

    evaluate = (evaluator or make_evaluator)(model, tok, rows, num_samples=num_samples, seed=seed)
    before = evaluate(nnx.state(model, nnx.Param), 0)
    log(f"[sft-continuation] before: held-out avg@{num_samples} {before['accuracy']:.3f}")
    res = train_sft(sft, make_batch, seconds=seconds, evaluate=evaluate, eval_every=10**9, log=log)
    after = res["evals"][-1]
    log(
        f"[sft-continuation] {res['steps']} steps in {res['train_s']:.0f}s: held-out "
        f"avg@{num_samples} {before['accuracy']:.3f} -> {after['accuracy']:.3f}"
    )
    return {"before": before, "after": after, "steps": res["steps"], "train_s": res["train_s"],
            "learning_rate": learning_rate, "batch": batch}  # fmt: skip
