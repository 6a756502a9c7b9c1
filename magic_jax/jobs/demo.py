"""The default run: ``magic-jax train`` with no config, and ``magic-jax demo``.

``run_default`` runs ``configs/default.yaml`` (MAGIC on the default world's
shipped base model, ``default_world``), writes its report and prints a
before -> after line. ``compare_sft`` continues supervised training from the
shipped model for a given wall time: the baseline a MAGIC run must beat.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from magic_jax.jobs.default_world import ASSETS, CONFIG_FILE, HELDOUT_FILE
from magic_jax.jobs.worlds import SFT_LENGTH, read_rows_file

RUN_TIME_FILE = "default_run.json"  # in the run directory: the wall time of the whole command


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
    from magic_jax.data.sources import read_rows
    from magic_jax.data.tasks import addition
    from magic_jax.run.config import ConfigError

    rows = [r.as_verl_row() for r in read_rows(config.data.train)]
    if not rows or "a" not in rows[0].get("extra_info", {}):
        return  # not the addition task's rows: nothing to check
    need = shortest_response(rows, addition.tokenizer())
    limits = [
        (f"stages[{i}].max_response_length", s.max_response_length)
        for i, s in enumerate(config.stages)
    ]
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
    shown = None if config_path else "configs/default.yaml"  # as --help names it
    config = load_config(config_path or CONFIG_FILE, list(overrides), name=shown)
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
    summary.update(
        compile_s=clock.compile_seconds,
        compiled=clock.compiled,
        cache_read_s=clock.read_seconds,
        cache_hits=clock.cache_hits,
    )
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
    from magic_jax.jobs.default_world import make_evaluator, mixture_examples
    from magic_jax.model.convert import load_hf
    from magic_jax.run.policy import load_tokenizer
    from magic_jax.update.sft import SFTConfig, SFTTrainer, pack_sft, train_sft

    model = load_hf(model_dir)
    tok = load_tokenizer(model_dir)
    rows = read_rows_file(Path(heldout))
    held = {addition.row_problem(r) for r in rows}
    if examples is None:
        task = addition.AdditionTask(worked_share=worked_share)

        def examples(tok, rng, n, step, held):
            return mixture_examples(task, tok, rng, n, step, held)

    graphdef, params = nnx.split(model, nnx.Param)
    sft = SFTTrainer(graphdef, params, SFTConfig(learning_rate=learning_rate))
    rng = np.random.default_rng(seed + 7)

    def make_batch(step):
        p, r = examples(tok, rng, batch, step, held)
        return pack_sft(p, r, length=SFT_LENGTH, pad_id=tok.pad_token_id)

    evaluate = (evaluator or make_evaluator)(model, tok, rows, num_samples=num_samples, seed=seed)
    before = evaluate(nnx.state(model, nnx.Param), 0)
    log(f"[sft-continuation] before: held-out avg@{num_samples} {before['accuracy']:.3f}")
    res = train_sft(sft, make_batch, seconds=seconds, evaluate=evaluate, eval_every=10**9, log=log)
    after = res["evals"][-1]
    log(
        f"[sft-continuation] {res['steps']} steps in {res['train_s']:.0f}s: held-out "
        f"avg@{num_samples} {before['accuracy']:.3f} -> {after['accuracy']:.3f}"
    )
    return {
        "before": before,
        "after": after,
        "steps": res["steps"],
        "train_s": res["train_s"],
        "learning_rate": learning_rate,
        "batch": batch,
    }
