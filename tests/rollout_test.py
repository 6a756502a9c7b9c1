"""Rollout driver: continuous vs static batching, trainer log-prob parity, scheduling invariance."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from magic_jax.engine import Engine, EngineConfig
from magic_jax.model import KVCache, ModelConfig, Qwen2
from magic_jax.rollout import RolloutDriver
from magic_jax.sampling import SamplingConfig

CFG = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2
)
SCHED_A = dict(max_concurrent_decodes=2, decode_steps=3, compact_batch=False)
SCHED_B = dict(max_concurrent_decodes=5, decode_steps=8, cache_bucket=0, compact_batch=False)
PROMPTS = [np.array(p) for p in ([5, 9, 13, 2, 7], [17, 4], [8, 8, 30, 41, 12, 3, 3], [60])]


@pytest.fixture(scope="module")
def model():
    m = Qwen2(CFG, rngs=nnx.Rngs(7))
    # Sharper logits than the 0.02 init, so greedy arg-maxes are well separated.
    m.lm_head.kernel[...] = m.lm_head.kernel[...] * 40.0
    return m


def _engine(model, **kw):
    base = dict(
        max_concurrent_decodes=3,
        max_prefill_length=8,
        max_decode_length=16,
        decode_steps=4,
        cache_bucket=8,
        eos_ids=(),
        sampling=SamplingConfig(greedy=True),
    )
    return Engine(model, EngineConfig(**(base | kw)))


def _static_greedy(model, prompts, new_tokens):
    """Reference: one left-padded batch through the model's own KV cache, every row
    to ``new_tokens`` tokens (no slots, no refills)."""
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    graphdef, state = nnx.split(model)
    call = jax.jit(lambda st, x, m, c: nnx.merge(graphdef, st)(x, attention_mask=m, cache=c))
    cache = KVCache.init(model.config, len(prompts), width + new_tokens)
    logits, cache = call(state, jnp.asarray(ids), jnp.asarray(mask), cache)
    out = []
    for _ in range(new_tokens):
        tok = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        out.append(np.asarray(tok))
        logits, cache = call(state, tok[:, None], jnp.ones_like(tok[:, None]), cache)
    return np.stack(out, axis=1)


def _cut(row, eos, limit):
    hits = np.flatnonzero(np.isin(row[:limit], eos))
    return row[: hits[0] + 1] if len(hits) else row[:limit]


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(max_concurrent_decodes=2, decode_steps=1, cache_bucket=0, compact_batch=False),
        pytest.param(
            dict(max_concurrent_decodes=4, decode_steps=16, cache_bucket=4),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_continuous_batching_equals_static_batching(model, kw):
    prompts = PROMPTS * 2
    static = _static_greedy(model, prompts, 16)
    # An EOS id that ends some rows early and not others exercises refills.
    counts = np.bincount(static[:, 1:].ravel(), minlength=CFG.vocab_size)
    eos = int(np.argsort(counts)[-3])
    limits = np.array([16, 9, 12, 5, 16, 3, 7, 1])[:, None]
    engine = _engine(model, eos_ids=(eos,), **kw)
    samples, stats = RolloutDriver(engine).run(
        engine.load_params(model), prompts, max_new_tokens=limits
    )
    assert any(s.finish_reason == "eos" for s in samples)
    assert any(s.finish_reason == "length" for s in samples)
    for i, s in enumerate(samples):
        want = _cut(static[i], [eos], limits[i, 0])
        np.testing.assert_array_equal(s.tokens, want)
        assert s.length == len(want) and s.truncated == (s.finish_reason == "length")
    assert stats.tokens == sum(s.length for s in samples)


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.7), SamplingConfig(top_p=0.8)])
def test_logprobs_equal_trainer_recompute(model, sampling):
    engine = _engine(
        model, sampling=sampling, max_concurrent_decodes=4, cache_bucket=0, compact_batch=False
    )
    samples, _ = RolloutDriver(engine).run(
        engine.load_params(model), PROMPTS, num_samples=3, seed=1, step=2, max_new_tokens=12
    )
    graphdef, state = nnx.split(model)
    # A plain full forward, as the trainer runs it (right padding to one shape:
    # the model is causal, so it does not change the positions that are read).
    forward = jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids))
    for s in samples:
        full = np.zeros((1, 8 + 12), np.int32)
        n = len(s.prompt_tokens) + s.length
        full[0, :n] = np.concatenate([s.prompt_tokens, s.tokens])
        logits = forward(state, jnp.asarray(full))[0, len(s.prompt_tokens) - 1 : n - 1]
        logp_TV = jax.nn.log_softmax(logits.astype(jnp.float32) / sampling.temperature, axis=-1)
        want = np.take_along_axis(np.asarray(logp_TV), s.tokens[:, None], axis=-1)[:, 0]
        np.testing.assert_allclose(s.logprobs, want, atol=1e-4, rtol=0)
        ent = -np.sum(np.exp(logp_TV) * logp_TV, axis=-1)
        np.testing.assert_allclose(s.entropies, ent, atol=1e-4, rtol=0)
        if sampling.top_p < 1:
            assert np.all(s.sampling_logprobs >= s.logprobs - 1e-6)
        else:
            np.testing.assert_array_equal(s.sampling_logprobs, s.logprobs)


def test_results_do_not_depend_on_scheduling(model):
    """Same seed, different slot counts / chunking / bucketing: identical samples."""
    sampling = SamplingConfig(temperature=1.0)
    runs = []
    for kw in (SCHED_A, SCHED_B):
        engine = _engine(model, sampling=sampling, eos_ids=(3,), **kw)
        runs.append(
            RolloutDriver(engine).run(
                engine.load_params(model), PROMPTS, num_samples=3, seed=5, step=1
            )[0]
        )
    for a, b in zip(*runs):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    # ... and a different step gives different samples.
    engine = _engine(model, sampling=sampling, eos_ids=(3,), **SCHED_A)
    other, _ = RolloutDriver(engine).run(
        engine.load_params(model), PROMPTS, num_samples=3, seed=5, step=2
    )
    assert any(not np.array_equal(a.tokens, b.tokens) for a, b in zip(runs[0], other))


def test_groups_share_one_prefill_and_carry_indices(model):
    engine = _engine(model, sampling=SamplingConfig(), eos_ids=(3,), **SCHED_B)
    driver = RolloutDriver(engine)
    samples, stats = driver.run(
        engine.load_params(model), PROMPTS, num_samples=5, seed=0, max_new_tokens=6
    )
    assert stats.prefills == len(PROMPTS)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (p, j) for p in range(len(PROMPTS)) for j in range(5)
    ]
    for s in samples:
        np.testing.assert_array_equal(s.prompt_tokens, PROMPTS[s.prompt_index])
        assert s.tokens.dtype == np.int32 and s.logprobs.dtype == np.float32
        assert s.length == len(s.tokens) == len(s.logprobs) == len(s.entropies) <= 6
        assert s.truncated == (3 not in s.tokens)
    # The preallocated state is reused by the next call.
    again, _ = driver.run(engine.load_params(model), PROMPTS[:1], num_samples=2, max_new_tokens=3)
    assert len(again) == 2


def test_truncation_modes(model):
    prompts = PROMPTS[:2]
    static = _static_greedy(model, prompts, 8)
    eos = int(static[0, 4])  # sample 0 ends with EOS as its 5th token (if not earlier)
    first = int(np.flatnonzero(static[0] == eos)[0])
    limit = first + 1  # the EOS is the last allowed token
    engine = _engine(model, eos_ids=(eos,))
    params = engine.load_params(model)
    driver = RolloutDriver(engine)
    no_eos, _ = driver.run(params, prompts, max_new_tokens=limit)
    by_len, _ = driver.run(params, prompts, max_new_tokens=limit, truncation="length")
    assert no_eos[0].finish_reason == "eos" and no_eos[0].length == limit
    assert not no_eos[0].truncated  # it has an EOS ...
    assert by_len[0].truncated  # ... but its length equals T, as the reference code counts
    hit = np.isin(static[1, :limit], [eos]).any()
    assert no_eos[1].truncated == (not hit)
    with pytest.raises(ValueError, match="truncation"):
        driver.run(params, prompts, truncation="eos")


def test_sample_is_frozen_dataclass_with_trainer_fields():
    names = {f.name for f in dataclasses.fields(__import__("magic_jax.rollout").rollout.Sample)}
    assert {
        "prompt_index",
        "sample_index",
        "prompt_tokens",
        "tokens",
        "logprobs",
        "entropies",
        "truncated",
        "length",
    } <= names
