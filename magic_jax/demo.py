"""``magic-jax demo``: every pipeline stage that exists, end to end, on a tiny random model.

Stages: write a random tiny Qwen2 as a Hugging Face checkpoint -> ``load_hf``
-> orbax checkpoint -> grouped rollouts with the continuous-batching engine ->
rewards from the verifier pool (Math-Verify) -> group advantages and
rejection sampling -> MAGIC policy updates -> orbax checkpoint -> Hugging Face
export. The model is random, so rewards come from chance hits; the point is
that every stage runs and reports its numbers. The embedded default task (a
tiny model that learns on a laptop CPU) replaces the task here when it lands.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import numpy as np

# Character-level vocabulary of the demo task: "a+b=" -> a one-digit answer.
SPECIALS = ("<pad>", "<bos>", "<eos>", "<think>", "</think>")
CHARS = tuple("0123456789+= \n\\{}boxed")
VOCAB = SPECIALS + tuple(dict.fromkeys(CHARS))
PAD, BOS, EOS = 0, 1, 2


def encode(text: str) -> np.ndarray:
    index = {c: i for i, c in enumerate(VOCAB)}
    return np.asarray([BOS] + [index[c] for c in text], np.int32)


def decode(ids: np.ndarray) -> str:
    return "".join(VOCAB[i] for i in ids if i >= len(SPECIALS) or VOCAB[i] == "</think>")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Sizes of the demo run."""

    workdir: str = "runs/demo"
    steps: int = 3
    prompts_per_step: int = 8
    group_size: int = 8
    max_new_tokens: int = 12
    learning_rate: float = 1e-3
    seed: int = 0


def _problems(rng: np.random.Generator, n: int) -> list[tuple[str, str]]:
    out = []
    for _ in range(n):
        a = int(rng.integers(0, 10))
        b = int(rng.integers(0, 10 - a))
        out.append((f"{a}+{b}=", str(a + b)))
    return out


def run(config: DemoConfig) -> dict:
    """Runs the demo and returns its final metrics (also printed)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from magic_jax.buffer import pack_rollouts
    from magic_jax.checkpoint import load_model, save_model
    from magic_jax.convert import load_hf, save_hf
    from magic_jax.engine import Engine, EngineConfig
    from magic_jax.entropy import EntropyControlConfig
    from magic_jax.model import ModelConfig, Qwen2, count_params
    from magic_jax.rewards import PoolConfig, RewardItem, VerifierPool
    from magic_jax.rollout import RolloutDriver
    from magic_jax.sampling import SamplingConfig
    from magic_jax.train_step import OptimizerConfig, PolicyUpdater, UpdateConfig

    print("magic-jax demo: the embedded default task is not built yet, so this runs every")
    print("pipeline stage that exists on a random tiny model (rewards come from chance hits).")
    work = Path(config.workdir)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    rng = np.random.default_rng(config.seed)

    # 1. a random tiny Qwen2 written as a Hugging Face checkpoint, then loaded back
    mcfg = ModelConfig(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    save_hf(Qwen2(mcfg, rngs=nnx.Rngs(config.seed)), work / "hf_init", dtype=jnp.float32)
    model = load_hf(work / "hf_init")
    save_model(model, work / "ckpt_init")
    model = load_model(work / "ckpt_init")
    print(f"[model] {count_params(model):,} parameters: HF checkpoint -> load_hf -> orbax")

    # 2. engine, verifier pool, updater
    engine = Engine(
        model,
        EngineConfig(
            max_concurrent_decodes=16,
            max_prefill_length=16,
            max_decode_length=config.max_new_tokens,
            sampling=SamplingConfig(temperature=1.0),
            eos_ids=(EOS,),
        ),
    )
    driver = RolloutDriver(engine)
    graphdef, params = nnx.split(model, nnx.Param)
    updater = PolicyUpdater(
        graphdef,
        UpdateConfig(
            mini_batch_groups=config.prompts_per_step,
            entropy=EntropyControlConfig(target=0.2, delta=0.005),
            optimizer=OptimizerConfig(learning_rate=config.learning_rate),
        ),
    )
    state = updater.init_state(params)

    history = []
    with VerifierPool(PoolConfig(num_workers=2)) as pool:
        for step in range(config.steps):
            t0 = time.perf_counter()
            problems = _problems(rng, config.prompts_per_step)
            prompts = [encode(q) for q, _ in problems]
            # Each sample goes to the verifier pool as soon as it ends, while the
            # others still decode; t_O is the wait left after the rollout.
            tickets = {}

            def submit(s, problems=problems, tickets=tickets):
                item = RewardItem(
                    response=decode(s.tokens),
                    ground_truth=problems[s.prompt_index][1],
                    ability="math",
                )
                tickets[s.prompt_index, s.sample_index] = pool.submit(item)

            samples, _ = driver.run(
                engine.load_params(state.params),
                prompts,
                num_samples=config.group_size,
                seed=config.seed,
                step=step,
                on_sample=submit,
            )
            t1 = time.perf_counter()
            results = pool.collect([tickets[s.prompt_index, s.sample_index] for s in samples])
            rewards = np.asarray([r.reward for r in results], np.float32)
            buffer = pack_rollouts(
                samples,
                rewards,
                group_size=config.group_size,
                prompt_bucket=16,
                response_bucket=16,
                pad_id=PAD,
            )
            t2 = time.perf_counter()
            state, m = updater.update(state, buffer, jax.random.key(step))
            jax.block_until_ready(state.params)
            t3 = time.perf_counter()
            row = {
                "step": step,
                "reward": float(rewards.mean()),
                "kept_groups": float(m["kept_group_fraction"]),
                "entropy": float(m["buffer_entropy"]),
                "alpha": float(m["alpha"]),
                "sgd_steps": int(m["num_sgd_steps"]),
                "mean_len": float(np.mean([s.length for s in samples])),
                "t_rollout_s": t1 - t0,
                "t_reward_s": t2 - t1,
                "t_update_s": t3 - t2,
            }
            history.append(row)
            print(
                "[step {step}] reward {reward:.3f}  kept groups {kept_groups:.2f}  "
                "entropy {entropy:.3f}  alpha {alpha:.4f}  sgd steps {sgd_steps}  "
                "mean len {mean_len:.1f}  t_R {t_rollout_s:.2f}s t_O {t_reward_s:.2f}s "
                "t_T {t_update_s:.2f}s".format(**row)
            )

    # 3. the trained policy back out: orbax, then Hugging Face
    model = nnx.merge(graphdef, state.params)
    save_model(model, work / "ckpt_final")
    save_hf(model, work / "hf_final")
    summary = {
        "history": history,
        "skipped_updates": int(state.skipped),
        "hf_export": str(work / "hf_final"),
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"[export] {work / 'ckpt_final'} (orbax) and {work / 'hf_final'} (Hugging Face)")
    return summary
