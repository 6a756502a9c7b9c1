"""Partial rollouts: at a version change the responses in flight keep their KV cache
(written by the older version) or have it prefilled again under the new one
(``rollout.publish_cache``), on the driver with a two-version schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from magic_jax.model.config import ModelConfig
from magic_jax.model.qwen2 import Qwen2
from magic_jax.rollout.driver import RolloutDriver
from magic_jax.rollout.engine import Engine, EngineConfig
from magic_jax.rollout.sampling import SamplingConfig

CFG = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2
)
PROMPTS = [np.array(p, np.int32) for p in ([5, 9, 13, 7], [17, 4], [8, 30, 41, 12, 3])]


class TwoVersions:
    """A ``VersionSchedule``: version 0 for a lane's first chunk, version 1 after it."""

    start = 0

    def __init__(self, params, reprefill):
        self._params, self.reprefill = params, reprefill

    def version_at(self, chunks):
        return min(chunks, 1)

    def params(self, version):
        return self._params[version]


@pytest.fixture(scope="module")
def two_models():
    return Qwen2(CFG, rngs=nnx.Rngs(0)), Qwen2(CFG, rngs=nnx.Rngs(1))


def _rollout(models, reprefill, kv_dtype=None):
    config = EngineConfig(
        max_concurrent_decodes=4,
        max_prefill_length=8,
        max_decode_length=12,
        decode_steps=2,
        cache_bucket=0,
        compact_batch=False,
        kv_dtype=kv_dtype,
        sampling=SamplingConfig(temperature=1.0),
    )
    engine = Engine(models[0], config)
    params = [engine.load_params(m) for m in models]
    driver = RolloutDriver(engine)
    # 3 prompts x 2 samples in 4 slots: some samples start after the version change
    return driver.run(
        params[0], PROMPTS, num_samples=2, seed=3, schedule=TwoVersions(params, reprefill)
    )


def _teacher_forced_gap(models, sample):
    """|recorded log-prob - the log-prob the version that sampled each token gives it,
    recomputed over the whole sequence|, per token."""
    ids = jnp.asarray(np.concatenate([sample.prompt_tokens, sample.tokens])[None], jnp.int32)
    n, t = len(sample.prompt_tokens), np.arange(len(sample.tokens))
    want = np.zeros(len(sample.tokens), np.float32)
    for v, model in enumerate(models):
        logp = np.asarray(jax.nn.log_softmax(model(ids)[0].astype(jnp.float32)))
        mine = sample.versions == v
        want[mine] = logp[n - 1 : -1][t, sample.tokens][mine]
    return np.abs(sample.logprobs - want)


def test_reprefill_makes_every_token_its_own_versions(two_models):
    samples, stats = _rollout(two_models, reprefill=True)
    assert stats.reprefills > 0
    assert any(set(s.versions) == {0, 1} for s in samples)  # responses that span the change
    assert any(s.versions[0] == 1 for s in samples)  # and responses begun after it
    for s in samples:
        gap = _teacher_forced_gap(two_models, s)
        assert gap.max() < 1e-4, (s.prompt_index, s.sample_index, s.versions, gap)


def test_keeping_the_cache_mixes_versions_and_says_so(two_models):
    """With the older version's cache kept, a token after the change is sampled from
    neither version's distribution (its recorded log-prob is still the sampler's)."""
    samples, stats = _rollout(two_models, reprefill=False)
    assert stats.reprefills == 0
    spanning = [s for s in samples if set(s.versions) == {0, 1}]
    assert spanning
    gaps = np.concatenate([_teacher_forced_gap(two_models, s)[s.versions == 1] for s in spanning])
    assert gaps.max() > 1e-2, gaps


def test_reprefill_is_deterministic_and_fits_an_int8_cache(two_models):
    first, _ = _rollout(two_models, reprefill=True, kv_dtype="int8")
    again, _ = _rollout(two_models, reprefill=True, kv_dtype="int8")
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.versions, b.versions)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert any(set(s.versions) == {0, 1} for s in first)


def test_reprefill_longer_than_the_prefill_buckets(two_models):
    """A response re-prefilled past ``max_prefill_length`` uses the cache-length buckets."""
    model = two_models[0]
    engine = Engine(
        model,
        EngineConfig(
            max_concurrent_decodes=2,
            max_prefill_length=4,
            max_decode_length=20,
            decode_steps=2,
            cache_bucket=0,
            compact_batch=False,
        ),
    )
    params = engine.load_params(model)
    state = engine.init_decode_state()
    seq = np.arange(1, 18, dtype=np.int32)  # 17 tokens: bucket 24 (the cache length)
    state = engine.reprefill(params, state, 1, seq)
    assert int(state.cache.lengths[1]) == 17 and int(state.cache.lengths[0]) == 0
    with pytest.raises(ValueError, match="cache_length=24"):
        engine.reprefill(params, state, 0, np.ones(25, np.int32))
