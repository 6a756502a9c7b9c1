"""``magic-jax demo``: the embedded default: a tiny model learns addition with MAGIC on a CPU.

1. A Qwen2-shaped model of 0.74M parameters (d 128, 4 layers, 4 / 2 heads,
   tied embeddings) and a character-level tokenizer with the R1-Distill chat
   markers (``magic_jax.tasks.addition``).
2. Supervised warm-up on worked solutions (one line per column with its
   carry, then ``</think>`` and ``\\boxed{sum}``), stopped as soon as the
   held-out avg@2 accuracy at temperature 1 reaches ``sft_target``: RL then
   starts from a policy that is right sometimes, which is what group
   advantages need.
3. The warmed-up model is written as a Hugging Face checkpoint with its
   tokenizer; prompts (train and held-out) are written as verl rows; a run
   config is written as YAML.
4. ``magic-jax train`` on that config: two stages (T 56, then 64), MAGIC's
   adaptive entropy control, rejection sampling, on-policy updates, avg@4
   evaluation on held-out problems, checkpoints and a final export.

Every file it writes is under ``workdir``; ``summary.json`` holds the
accuracy before and after RL.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Sizes of the demo run.

    Attributes:
      workdir: output directory (replaced).
      seed: model initialisation, problems and sampling.
      sft_target: held-out avg@2 accuracy that ends the warm-up.
      sft_max_steps: warm-up step budget (batches of ``sft_batch``).
      rl_steps: RL steps, split evenly over the two stages.
      eval_problems: held-out problems for evaluation.
      quick: a smoke-test size (a few steps of each phase, no learning expected).
    """

    workdir: str = "runs/demo"
    seed: int = 0
    sft_target: float = 0.2
    sft_max_steps: int = 800
    sft_batch: int = 64
    rl_steps: int = 120
    eval_problems: int = 128
    quick: bool = False


MODEL = dict(
    hidden_size=128,
    intermediate_size=352,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    tie_word_embeddings=True,
    rope_theta=1e4,
)


def _sft(config: DemoConfig, work: Path, log) -> tuple[Path, dict[str, Any]]:
    import jax.numpy as jnp
    from flax import nnx

    from magic_jax.convert import save_hf
    from magic_jax.data import parse_row, render_r1
    from magic_jax.engine import Engine, EngineConfig
    from magic_jax.evaluate import evaluate
    from magic_jax.model import ModelConfig, Qwen2, count_params
    from magic_jax.rollout import RolloutDriver
    from magic_jax.sampling import SamplingConfig
    from magic_jax.sft import SFTConfig, SFTTrainer, pack_sft
    from magic_jax.tasks import addition

    tok = addition.tokenizer()
    mcfg = ModelConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **MODEL,
    )
    model = Qwen2(mcfg, rngs=nnx.Rngs(config.seed))
    log(f"[model] {count_params(model):,} parameters, vocabulary {len(tok)} (characters)")
    graphdef, params = nnx.split(model, nnx.Param)
    sft = SFTTrainer(graphdef, params, SFTConfig(learning_rate=2e-3))
    eval_rows = [
        parse_row(r, "held-out", f"h{i}")
        for i, r in enumerate(addition.verl_rows(64, seed=config.seed + 2))
    ]
    engine = Engine(
        model,
        EngineConfig(
            max_concurrent_decodes=128,
            max_prefill_length=24,
            max_decode_length=64,
            sampling=SamplingConfig(temperature=1.0),
        ),
    )
    driver = RolloutDriver(engine)
    rng = np.random.default_rng(config.seed + 1)
    task = addition.AdditionTask()
    t0 = time.perf_counter()
    every = 5 if config.quick else 50
    max_steps = 10 if config.quick else config.sft_max_steps
    acc, step = 0.0, 0
    while step < max_steps:
        prompts, responses = [], []
        for _ in range(config.sft_batch):
            a, b = task.sample(rng)
            msgs = [{"role": "user", "content": addition.prompt(a, b)}]
            p = tok.encode(render_r1(msgs), add_special_tokens=False)
            r = tok.encode(addition.worked_solution(a, b), add_special_tokens=False)
            prompts.append(np.asarray(p, np.int32))
            responses.append(np.asarray([*r, tok.eos_token_id], np.int32))
        m = sft.step(pack_sft(prompts, responses, length=96, pad_id=tok.pad_token_id))
        step += 1
        if step % every == 0:
            ev = evaluate(
                driver, sft.params, eval_rows, tok, num_samples=2, max_prompt_length=24, step=step
            )
            acc = ev["accuracy"]
            log(
                f"[sft step {step}] loss {m['loss']:.3f}  held-out avg@2 {acc:.3f}  "
                f"({time.perf_counter() - t0:.0f}s)"
            )
            if acc >= config.sft_target:
                break
    out = work / "sft_model"
    # fp32: the model is tiny, and bf16 weights cost it most of what it learned
    save_hf(nnx.merge(graphdef, sft.params), out, dtype=jnp.float32)
    tok.save_pretrained(out)
    return out, {"sft_steps": step, "sft_accuracy": acc, "sft_s": time.perf_counter() - t0}


def run_config(config: DemoConfig, work: Path, model_dir: Path) -> dict[str, Any]:
    """The RL run's configuration (what ``run.yaml`` holds)."""
    half = max(1, config.rl_steps // 2)
    steps = (2, 1) if config.quick else (half, config.rl_steps - half)
    stage = dict(prompts_per_step=16, mini_batch_groups=16, group_size=8)
    return {
        "model": str(model_dir),
        "output_dir": str(work / "rl"),
        "data": {"train": [str(work / "train.jsonl")], "max_prompt_length": 24},
        "eval": {
            "data": [str(work / "heldout.jsonl")],
            "every": 2 if config.quick else 20,
            "num_samples": 4,
            "max_response_length": 64,
        },
        "stages": [
            {"name": "T56", "steps": steps[0], "max_response_length": 56, **stage},
            {"name": "T64", "steps": steps[1], "max_response_length": 64, **stage},
        ],
        "sampling": {"temperature": 1.0},
        "loss": {"eps_low": 0.2, "eps_high": 0.28},
        "entropy": {"mode": "adaptive", "target": 0.1, "delta": 0.002, "max_coef": 0.02},
        "optimizer": {"learning_rate": 3e-4, "weight_decay": 0.0},
        "rollout": {"max_concurrent_decodes": 128, "decode_steps": 64},
        "rewards": {"num_workers": 2},
        "seed": config.seed,
        "checkpoint_every": 20,
        "keep_checkpoints": 1,
        "export_dtype": "float32",
    }


def run(config: DemoConfig, log=print) -> dict[str, Any]:
    """Runs the demo; returns (and writes to ``summary.json``) its summary."""
    import yaml

    from magic_jax.config import load_config
    from magic_jax.tasks import addition
    from magic_jax.trainer import Trainer

    work = Path(config.workdir)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    log("magic-jax demo: a 0.74M-parameter Qwen2 learns multi-digit addition, on this CPU:")
    log("supervised warm-up on worked solutions, then MAGIC (GRPO + adaptive entropy control).")
    model_dir, sft = _sft(config, work, log)
    n_train, n_eval = (64, 16) if config.quick else (8192, config.eval_problems)
    for name, n, seed in (
        ("train.jsonl", n_train, config.seed + 3),
        ("heldout.jsonl", n_eval, config.seed + 4),
    ):
        rows = addition.verl_rows(n, seed=seed, source=name.split(".")[0])
        (work / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = run_config(config, work, model_dir)
    (work / "run.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    log(f"[rl] magic-jax train {work / 'run.yaml'}")
    rl = Trainer(load_config(work / "run.yaml"), log=log).run()
    evals = rl["evals"]
    summary = {
        **sft,
        "rl_steps": rl["steps"],
        "accuracy_before_rl": evals[0]["accuracy"] if evals else None,
        "accuracy_after_rl": evals[-1]["accuracy"] if evals else None,
        "evals": evals,
        "skipped_updates": rl["skipped_updates"],
        "hf_export": rl.get("hf_export"),
        "wall_s": time.perf_counter() - t0,
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    if evals:
        log(
            f"[done] held-out avg@4: {evals[0]['accuracy']:.3f} before RL -> "
            f"{evals[-1]['accuracy']:.3f} after {rl['steps']} MAGIC steps "
            f"({summary['wall_s']:.0f}s in all); metrics in {work / 'rl'}"
        )
    return summary
