"""Rollout driver: continuous vs static batching, trainer log-prob parity, scheduling invariance."""

import dataclasses
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from magic_jax.model.config import ModelConfig
from magic_jax.model.qwen2 import KVCache, Qwen2
from magic_jax.rollout.driver import RolloutDriver
from magic_jax.rollout.engine import Engine, EngineConfig
from magic_jax.rollout.sampling import SamplingConfig
from magic_jax.update.buffer import pack_rollouts
from magic_jax.update.losses import LossConfig
from magic_jax.update.step import compute_logprobs

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
        dict(decode_layers="split"),
        dict(decode_layers="scan"),
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


@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(temperature=0.7), SamplingConfig(top_p=0.8), SamplingConfig(top_k=5)],
)
def test_logprobs_equal_trainer_recompute(model, sampling):
    """The on-policy guarantee: the sampler's log-probs and entropies are what the
    trainer recomputes (``pack_rollouts`` -> ``compute_logprobs``: left-padded
    prompts, a full forward, chunked log-probs over the hidden states), fp32."""
    engine = _engine(
        model, sampling=sampling, max_concurrent_decodes=4, cache_bucket=0, compact_batch=False
    )
    samples, _ = RolloutDriver(engine).run(
        engine.load_params(model), PROMPTS, num_samples=3, seed=1, step=2, max_new_tokens=12
    )
    buf = pack_rollouts(samples, np.zeros(len(samples)), prompt_bucket=8, response_bucket=16)
    graphdef, state = nnx.split(model)
    loss = LossConfig(temperature=sampling.temperature, logit_chunk=5)
    batch = jax.tree.map(jnp.asarray, buf)
    logp, ent = jax.jit(compute_logprobs, static_argnums=(0, 3))(graphdef, state, batch, loss)
    mask = buf.response_mask > 0
    assert mask.sum() == sum(s.length for s in samples)
    np.testing.assert_allclose(np.asarray(logp)[mask], buf.old_logprobs[mask], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(ent)[mask], buf.entropies[mask], atol=1e-4, rtol=0)

    # Truncated sampling: every token lies in the top-k / top-p set of the model's
    # distribution (a sorting reference on the full forward's logits), and
    # ``sampling_logprobs`` is its log-prob in that renormalised set.
    forward = jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids))
    for s in samples:
        n = len(s.prompt_tokens) + s.length
        full = np.zeros((1, 8 + 12), np.int32)
        full[0, :n] = np.concatenate([s.prompt_tokens, s.tokens])
        z_TV = np.asarray(forward(state, jnp.asarray(full))[0, len(s.prompt_tokens) - 1 : n - 1])
        z_TV = z_TV.astype(np.float64) / sampling.temperature
        keep_TV = _sorting_keep(z_TV, sampling.top_k, sampling.top_p)
        assert keep_TV[np.arange(s.length), s.tokens].all()
        zt_TV = np.where(keep_TV, z_TV, -np.inf)
        want = zt_TV[np.arange(s.length), s.tokens] - _logsumexp(zt_TV)
        np.testing.assert_allclose(s.sampling_logprobs, want, atol=1e-4, rtol=0)
        if not sampling.truncates:
            np.testing.assert_array_equal(s.sampling_logprobs, s.logprobs)


def _logsumexp(z):
    m = z.max(-1)
    return m + np.log(np.exp(z - m[:, None]).sum(-1))


def _sorting_keep(z_TV, top_k, top_p):
    """Top-k, then the top-p nucleus of the renormalised rest, by sorting."""
    keep = np.ones_like(z_TV, bool)
    for t, z in enumerate(z_TV):
        order = np.argsort(-z, kind="stable")
        if top_k:
            keep[t, order[top_k:]] = False
        p = np.where(keep[t], np.exp(z - z.max()), 0.0)
        p = p[order] / p.sum()
        keep[t, order[np.cumsum(p) - p >= top_p]] = False
    return keep


def test_sampled_frequencies_match_model_distribution():
    """Temperature 1 through the whole engine (insert samples token 0, a decode step
    token 1) on an 8-token vocabulary: the frequencies of the 64 (token 0, token 1)
    pairs over 1024 samples match p(t0) p(t1 | t0) from the model's full forward."""
    cfg = dataclasses.replace(CFG, vocab_size=8)
    m = Qwen2(cfg, rngs=nnx.Rngs(11))
    m.lm_head.kernel[...] = m.lm_head.kernel[...] * 6.0  # far from uniform
    prompt = np.array([3, 1, 4, 1, 5])
    n = 1024
    engine = _engine(m, sampling=SamplingConfig(), max_concurrent_decodes=32, decode_steps=2)
    samples, _ = RolloutDriver(engine).run(
        engine.load_params(m), [prompt], num_samples=n, seed=3, max_new_tokens=2
    )
    pairs = np.array([s.tokens for s in samples])
    counts = np.bincount(pairs[:, 0] * 8 + pairs[:, 1], minlength=64)

    ids = np.stack([np.concatenate([prompt, [t]]) for t in range(8)])
    logits = np.asarray(m(jnp.asarray(ids)), np.float64)

    def p_at(temperature):
        z = logits / temperature
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p = p_at(1.0)
    p0 = p[0, len(prompt) - 1]
    p01 = (p0[:, None] * p[:, len(prompt)]).ravel()
    p01 /= p01.sum()  # exactly, in float64, for scipy's sum check
    assert p0.max() < 0.9 and np.sort(p0)[-2] > 0.05  # a distribution worth testing
    # Pool pairs expected fewer than 5 times into one cell (chi-square validity).
    small = n * p01 < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(n * p01[~small], n * p01[small].sum())
    assert stats.chisquare(obs, exp).pvalue > 1e-3
    # The test has power against plausible bugs: a wrong temperature (0.8), or a
    # second token drawn without the first one fed (the prompt's distribution again).
    for q_V, q_VV in (
        (p_at(0.8)[0, len(prompt) - 1], p_at(0.8)[:, len(prompt)]),
        (p0, np.broadcast_to(p0, (8, 8))),
    ):
        q = (q_V[:, None] * q_VV).ravel()
        q /= q.sum()
        alt = np.append(n * q[~small], n * q[small].sum())
        assert stats.chisquare(obs, alt).pvalue < 1e-3


@pytest.mark.heavy
def test_results_do_not_depend_on_scheduling(model, monkeypatch):
    """Same seed, different slot counts / chunking / bucketing / lanes / insert rules (a
    light step inserts whole groups only, a heavy one single samples too): identical
    samples."""
    from magic_jax.rollout import engine_config as config_lib

    sampling = SamplingConfig(temperature=1.0)
    runs = []
    compact = SCHED_A | {"compact_batch": True}
    for kw, lanes, heavy in (
        (SCHED_A, 1, False),
        (SCHED_B, 1, False),
        (SCHED_B, 1, True),
        (SCHED_A, 2, False),
        (compact, 3, False),
        (compact | {"max_concurrent_decodes": 4}, 1, True),
    ):
        monkeypatch.setattr(config_lib, "LIGHT_STEP_FLOPS", 0.0 if heavy else 0.4e9)
        engine = _engine(model, sampling=sampling, eos_ids=(3,), **kw)
        assert engine.light_cpu_step == (not heavy and jax.default_backend() == "cpu")
        runs.append(
            RolloutDriver(engine, lanes=lanes).run(
                engine.load_params(model), PROMPTS, num_samples=3, seed=5, step=1
            )[0]
        )
    for other in runs[1:]:
        assert len(other) == len(runs[0]) == len(PROMPTS) * 3
        for a, b in zip(runs[0], other):
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


def test_on_sample_reports_each_sample_as_it_ends(model):
    """Short samples are handed out while long ones still decode, each exactly once."""
    engine = _engine(model, sampling=SamplingConfig(), **SCHED_A)
    limits = np.array([[12, 2, 12], [1, 12, 3]])  # per (prompt, sample)
    seen = []
    samples, _ = RolloutDriver(engine).run(
        engine.load_params(model),
        PROMPTS[:2],
        num_samples=3,
        max_new_tokens=limits,
        on_sample=seen.append,
    )
    assert sorted(seen, key=lambda s: (s.prompt_index, s.sample_index)) == samples
    order = [(s.prompt_index, s.sample_index) for s in seen]
    # Two slots: (0, 0) and (0, 1) start; (0, 1) ends after 2 tokens, long before
    # (0, 0) ends after 12, and is reported first although it sorts second.
    assert order[0] == (0, 1) and order.index((0, 1)) < order.index((0, 0))
    assert [s.length for s in samples] == list(limits.reshape(-1))
    boom = RuntimeError("callback failed")

    def fail(_):
        raise boom

    driver = RolloutDriver(engine)
    with pytest.raises(RuntimeError, match="callback failed"):
        driver.run(engine.load_params(model), PROMPTS[:1], max_new_tokens=2, on_sample=fail)
    # a failed rollout leaves the driver usable
    again, _ = driver.run(engine.load_params(model), PROMPTS[:1], max_new_tokens=2)
    assert again[0].length == 2


def test_lanes_report_one_sample_at_a_time(model):
    """Lanes decode in their own threads: every sample once, one prefill per prompt,
    ``on_sample`` never entered twice at once, and a lane's failure raised by ``run``."""
    engine = _engine(model, sampling=SamplingConfig(), eos_ids=(3,), **SCHED_A)
    driver = RolloutDriver(engine, lanes=2)
    assert driver.max_concurrent_decodes == 4
    params = engine.load_params(model)
    inside, seen, overlaps, threads = [0], [], [0], set()

    def report(sample):
        inside[0] += 1
        overlaps[0] += inside[0] > 1
        threads.add(threading.current_thread().name)
        time.sleep(0.002)  # widens the window a second, unserialized call would hit
        seen.append(sample)
        inside[0] -= 1

    samples, stats = driver.run(params, PROMPTS, num_samples=3, seed=0, on_sample=report)
    assert overlaps[0] == 0 and len(threads) == 2  # both lanes finished samples
    assert sorted(seen, key=lambda s: (s.prompt_index, s.sample_index)) == samples
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (p, j) for p in range(len(PROMPTS)) for j in range(3)
    ]
    assert stats.prefills == len(PROMPTS) and stats.tokens == sum(s.length for s in samples)
    assert sum(n for n, _ in stats.by_batch.values()) == stats.steps

    def fail_off_main(sample):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("lane callback failed")

    with pytest.raises(RuntimeError, match="lane callback failed"):
        driver.run(params, PROMPTS, num_samples=3, on_sample=fail_off_main)
    again, _ = driver.run(params, PROMPTS, num_samples=3, seed=0)  # usable afterwards
    assert [s.tokens.tolist() for s in again] == [s.tokens.tolist() for s in samples]
    with pytest.raises(ValueError, match="lanes"):
        RolloutDriver(engine, lanes=0)


def test_each_lane_decodes_fixed_prompts_so_a_seed_repeats_bit_for_bit(model):
    """Prompt p's samples are decoded by lane p % lanes whatever the threads' timing, so a
    lane's batches, and XLA's rounding of each row in them, repeat from run to run."""
    engine = _engine(model, sampling=SamplingConfig(), eos_ids=(3,), **SCHED_A)
    driver = RolloutDriver(engine, lanes=2)
    params = engine.load_params(model)
    prompts = PROMPTS * 3  # 12 prompts: 6 per lane

    def run(slow_lane):
        lane_of = {}

        def report(sample):
            name = threading.current_thread().name
            lane_of.setdefault(sample.prompt_index, set()).add(name)
            if name == slow_lane:
                time.sleep(0.003)  # holds this lane back: a shared queue would rebalance

        samples, _ = driver.run(params, prompts, num_samples=3, seed=4, on_sample=report)
        return samples, lane_of

    a, lanes_a = run("MainThread")
    b, lanes_b = run("rollout-lane-1")
    want = {p: {"MainThread" if p % 2 == 0 else "rollout-lane-1"} for p in range(len(prompts))}
    assert lanes_a == lanes_b == want
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.entropies, y.entropies)  # bit for bit
        np.testing.assert_array_equal(x.logprobs, y.logprobs)


def test_default_lanes(monkeypatch):
    from magic_jax.rollout import driver as driver_lib
    from magic_jax.rollout.engine_config import EngineOptions
    from magic_jax.run.config import RolloutConfig

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    assert driver_lib.default_lanes(128) == (2 if jax.default_backend() == "cpu" else 1)
    assert driver_lib.default_lanes(128, num_params=740_000) == driver_lib.default_lanes(128)
    assert driver_lib.default_lanes(32, num_params=58_000_000) == 1  # matmul-bound step
    assert driver_lib.default_lanes(8) == 1  # a lane would hold fewer than 8 slots
    assert driver_lib.default_lanes(17) == 1  # the slots do not split evenly
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0}, raising=False)
    assert driver_lib.default_lanes(128) == 1  # one core
    with pytest.raises(ValueError, match="lanes: must be >= 1 and divide"):
        EngineOptions(max_concurrent_decodes=6, lanes=4)
    with pytest.raises(ValueError, match="lanes: must be >= 1 and divide"):
        RolloutConfig(max_concurrent_decodes=6, lanes=4)
    options = EngineOptions(max_concurrent_decodes=8, lanes=2)
    driver = driver_lib.make_driver(
        Qwen2(CFG, rngs=nnx.Rngs(0)),
        options,
        max_prompt_length=8,
        max_response_length=8,
        sampling=SamplingConfig(),
    )
    assert (driver.lanes, driver.engine.config.max_concurrent_decodes) == (2, 4)
    assert driver.max_concurrent_decodes == 8


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
    from magic_jax.rollout.samples import Sample

    names = {f.name for f in dataclasses.fields(Sample)}
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


def test_a_driver_with_other_sampling_shares_the_cache_and_samples_as_a_fresh_one(model):
    """``with_sampling``: the same samples as a driver of its own at that sampling, on the
    decode state (KV cache) of the driver it came from."""
    hot = SamplingConfig(temperature=1.5, top_k=7)
    engine = _engine(model, sampling=SamplingConfig(temperature=0.7))
    params = engine.load_params(model)
    first = RolloutDriver(engine)
    first.run(params, PROMPTS, num_samples=2, seed=3, max_new_tokens=9)
    shared = first.with_sampling(hot)
    assert shared._states is first._states and shared.engine.config.sampling == hot
    got, _ = shared.run(params, PROMPTS, num_samples=2, seed=3, max_new_tokens=9)
    want, _ = RolloutDriver(_engine(model, sampling=hot)).run(
        params, PROMPTS, num_samples=2, seed=3, max_new_tokens=9
    )
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
