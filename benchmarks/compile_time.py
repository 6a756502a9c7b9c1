"""Compile time vs depth: layers under ``nnx.scan`` against the Python loop, same run.

For 8, 28 and 64 layers of a narrow Qwen2 (D 64, F 128, 4 / 2 heads, V 512, so
it runs on a CPU in minutes), times tracing + lowering and XLA compilation of

  update: one optimizer step (``PolicyUpdater``'s jitted ``train_step``: forward,
          chunked log-probs, clipped loss, backward, AdamW) on 8 x (16 + 48) tokens;
  decode: one decode chunk of the engine (``decode_chunk_fn``: a while loop of
          16 decode steps over 8 slots, cache of 64 + 64 slots),

with ``ModelConfig.scan_layers`` False (the peer: one traced copy per layer) and
True, and prints the ratio loop / scan, in wall seconds and in process CPU
seconds (which hold on a loaded machine). The persistent compilation cache is off.

    .venv/bin/python benchmarks/compile_time.py
    .venv/bin/python benchmarks/compile_time.py --layers 8,28 --remat full
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from magic_jax.model.config import ModelConfig
from magic_jax.model.qwen2 import Qwen2
from magic_jax.rollout.decode_loop import decode_chunk_fn
from magic_jax.rollout.engine import Engine, EngineConfig
from magic_jax.rollout.sampling import SamplingConfig
from magic_jax.testing import Sample
from magic_jax.update.buffer import pack_rollouts
from magic_jax.update.config import UpdateConfig
from magic_jax.update.updater import PolicyUpdater

PROMPT, RESPONSE, GROUPS, G = 16, 48, 2, 4


def _buffer(vocab: int):
    rng = np.random.default_rng(0)
    samples, rewards = [], []
    for p in range(GROUPS):
        prompt = rng.integers(3, vocab, PROMPT).astype(np.int32)
        for s in range(G):
            n = int(rng.integers(8, RESPONSE + 1))
            samples.append(
                Sample(
                    p, s, prompt, rng.integers(3, vocab, n).astype(np.int32),
                    np.full(n, -1.0, np.float32), np.ones(n, np.float32), False, n,
                )
            )  # fmt: skip
            rewards.append(float(s % 2))
    return pack_rollouts(samples, rewards, prompt_len=PROMPT, response_len=RESPONSE)


def _timed(jitted, *args) -> tuple[float, float, float]:
    """(trace + lower wall s, compile wall s, both in process CPU s): the CPU seconds
    hold on a loaded machine, where wall time also counts other processes' turns."""
    c0, t0 = time.process_time(), time.perf_counter()
    lowered = jitted.lower(*args)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1, time.process_time() - c0


def update_compile(model: Qwen2) -> tuple[float, float]:
    graphdef, params = nnx.split(model, nnx.Param)
    updater = PolicyUpdater(graphdef, UpdateConfig(mini_batch_groups=GROUPS))
    state = updater.init_state(params)
    return _timed(updater._compile(state), state, _buffer(model.config.vocab_size), 0.0, None)


def decode_compile(model: Qwen2) -> tuple[float, float]:
    config = EngineConfig(
        max_concurrent_decodes=8, max_prefill_length=64, max_decode_length=64, decode_steps=16
    )
    engine = Engine(model, config)
    params = engine.load_params(model)
    state = engine.init_decode_state()
    fn = functools.partial(
        decode_chunk_fn,
        engine.graphdef,
        sampling=SamplingConfig(),
        num_steps=config.decode_steps,
        attend=config.cache_length,
    )
    jitted = jax.jit(fn, donate_argnums=1)
    return _timed(
        jitted, params, state, None, None, jnp.bool_(False), jnp.int32(0), engine.eos_array
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="8,28,64")
    ap.add_argument("--remat", default="none", choices=("none", "full", "dots_saveable"))
    args = ap.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    print(
        f"jax {jax.__version__} {jax.devices()[0].platform} | cpus {os.cpu_count()} | "
        f"remat {args.remat}"
    )
    rows = []
    for n in (int(x) for x in args.layers.split(",")):
        for what, measure in (("update", update_compile), ("decode chunk", decode_compile)):
            got = {}
            for scan in (False, True):
                cfg = ModelConfig(
                    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=n,
                    num_heads=4, num_kv_heads=2, scan_layers=scan, remat=args.remat,
                )  # fmt: skip
                got[scan] = measure(Qwen2(cfg, rngs=nnx.Rngs(0)))
                print(n, what, "scan" if scan else "loop", got[scan], flush=True)
            rows.append((n, what, got[False], got[True]))
    print()
    print("| layers | program | loop trace+lower s | loop compile s | loop CPU s "
          "| scan trace+lower s | scan compile s | scan CPU s | loop / scan (wall) "
          "| loop / scan (CPU) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, what, loop, scan in rows:
        print(
            f"| {n} | {what} | {loop[0]:.2f} | {loop[1]:.2f} | {loop[2]:.2f} | {scan[0]:.2f} "
            f"| {scan[1]:.2f} | {scan[2]:.2f} | {(loop[0] + loop[1]) / (scan[0] + scan[1]):.1f}x "
            f"| {loop[2] / scan[2]:.1f}x |"
        )


if __name__ == "__main__":
    main()
