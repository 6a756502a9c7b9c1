"""Engine: greedy parity with transformers' generate, sharding, donation, weight resharding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import TINY_CONFIGS

from magic_jax.model.config import ModelConfig
from magic_jax.model.convert import load_hf
from magic_jax.model.qwen2 import KVCache, Qwen2
from magic_jax.model.sharding import (
    SAMPLE_RULES,
    TRAIN_RULES,
    MeshConfig,
    make_mesh,
    model_shardings,
)
from magic_jax.rollout.decode import decode_forward
from magic_jax.rollout.decode_loop import layer_modules, split_forward
from magic_jax.rollout.driver import RolloutDriver
from magic_jax.rollout.engine import Engine, EngineConfig
from magic_jax.rollout.sampling import SamplingConfig
from magic_jax.testing import make_hf_model, save_hf_model

GREEDY = SamplingConfig(greedy=True)
EOS = 2
PROMPTS = [
    [5, 9, 13, 2, 7, 11, 3],
    [17, 4],
    [8, 8, 30, 41, 12],
    [60],
    [3, 14, 15, 9, 26, 5, 35, 8, 9],
]


HF_CONFIGS = {
    # grouped-query attention (2 kv heads), untied
    "gqa": dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    # one kv head, head_dim (32) larger than hidden / heads (16), another rope theta
    "wide_heads": dict(vocab_size=96, **TINY_CONFIGS["wide_heads"]),
}


def _load(name, tmp_path_factory):
    hf = make_hf_model(seed=1, eos_token_id=EOS, **HF_CONFIGS[name])
    # Random init gives near-flat logits (fp32 noise could flip an arg-max) and a
    # greedy path stuck on one token; larger embeddings and output scale give
    # varied sequences whose arg-maxes are separated by > 1e-2, some ending in EOS.
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(20.0)
        hf.lm_head.weight.mul_(30.0)
    path = save_hf_model(hf, tmp_path_factory.mktemp(name))
    return hf, load_hf(path)


@pytest.fixture(scope="module")
def hf_and_model(tmp_path_factory):
    return _load("gqa", tmp_path_factory)


def _hf_greedy(hf, prompts, new_tokens):
    """transformers' generate on one left-padded batch, greedy, stopping at the
    checkpoint's EOS; each row is cut after its EOS (generate pads past it)."""
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.as_tensor(ids),
            attention_mask=torch.as_tensor(mask),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    rows = []
    for row in out[:, width:].numpy():
        hits = np.flatnonzero(row == EOS)
        rows.append(row[: hits[0] + 1] if len(hits) else row)
    return rows


def _engine(model, mesh=None, **kw):
    base = dict(
        max_concurrent_decodes=4,
        max_prefill_length=16,
        max_decode_length=24,
        decode_steps=4,
        cache_bucket=0,
        compact_batch=False,
        sampling=GREEDY,
    )
    return Engine(model, EngineConfig(**(base | kw)), mesh=mesh)


# gqa in the slow target (27 s here); wide_heads runs the same path in the default suite
@pytest.mark.parametrize("name", [pytest.param("gqa", marks=pytest.mark.slow), "wide_heads"])
def test_greedy_matches_transformers_generate(name, tmp_path_factory):
    hf, model = _load(name, tmp_path_factory)
    want = _hf_greedy(hf, PROMPTS, 20)
    assert any(len(w) < 20 for w in want) and any(len(w) == 20 for w in want)
    # Five prompts of mixed lengths on four slots: the last is inserted mid-flight
    # into a freed slot; bucketed attention and batch compaction are on. EOS is
    # the checkpoint's.
    engine = _engine(model, cache_bucket=16, compact_batch=True)
    assert engine.eos_ids == (EOS,)
    samples, _ = RolloutDriver(engine).run(
        engine.load_params(model), [np.array(p) for p in PROMPTS], max_new_tokens=20
    )
    for s, w in zip(samples, want):
        np.testing.assert_array_equal(s.tokens, w)
        assert s.finish_reason == ("eos" if w[-1] == EOS else "length")


def test_raw_engine_api_matches_transformers(hf_and_model):
    """prefill / insert / generate by hand, one step at a time, slots out of order,
    one prompt right-padded as JetStream sends it (``true_length``)."""
    hf, model = hf_and_model
    want = _hf_greedy(hf, PROMPTS[:3], 8)
    engine = _engine(model, max_concurrent_decodes=3)
    params = engine.load_params(model)
    state = engine.init_decode_state()
    got = {i: [] for i in range(3)}
    order = ((2, 0), (0, 1), (1, 2))
    for slot, i in order:
        padded = np.zeros(16, np.int32)
        padded[: len(PROMPTS[i])] = PROMPTS[i]
        prefix = engine.prefill(params, padded, true_length=len(PROMPTS[i]))
        state, first = engine.insert(prefix, state, slot, key=jax.random.key(0))
        got[i].append(int(first.tokens))
    for _ in range(7):
        state, out = engine.generate(params, state)
        for slot, i in order:
            if bool(out.valid[slot]):
                got[i].append(int(out.tokens[slot]))
    for i in range(3):
        np.testing.assert_array_equal(got[i], want[i])


def test_decode_forward_equals_model_forward():
    """The T = 1 decode path against the model's own cached forward, on a model with
    a sliding-window layer, left-padded rows of different lengths and a finished row."""
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        sliding_window=3,
        sliding_layers=(1,),
    )
    model = Qwen2(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, (3, 6)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :1] = 0
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, ids, mask, tok, live):
        m = nnx.merge(graphdef, state)
        _, cache = m(ids, attention_mask=mask, cache=KVCache.init(cfg, 3, 10))
        want = m(tok[:, None], attention_mask=live[:, None], cache=cache)
        got = decode_forward(m, tok, live, cache)
        transposed, _ = decode_forward(m, tok, live, cache, m.unembedding().T)
        unrolled = decode_forward(m, tok, live, cache, layer_unroll=True)
        kv_L = tuple((cache.k[:, i], cache.v[:, i]) for i in range(cfg.num_layers))
        split_logits, split_cache, kv_L = split_forward(m, layer_modules(m), tok, live, cache, kv_L)
        split = dataclasses.replace(
            split_cache, **{n: jnp.stack([kv[j] for kv in kv_L], 1) for j, n in enumerate("kv")}
        )
        return want, got, transposed, unrolled, (split_logits, split)

    tok = jnp.asarray([5, 7, 9], jnp.int32)
    live = jnp.asarray([True, True, False])
    (
        (want_logits, want),
        (got_logits, got),
        unembed_logits,
        (unrolled_logits, unrolled),
        (split_logits, split),
    ) = run(state, jnp.asarray(ids), jnp.asarray(mask), tok, live)
    # EngineConfig.decode_layers="split": each layer's cache apart, the same logits and cache
    np.testing.assert_allclose(split_logits, got_logits, atol=1e-5, rtol=1e-5)
    for name in ("k", "v", "pos", "lengths"):
        np.testing.assert_allclose(getattr(split, name), getattr(got, name), atol=1e-6)
    rows = np.asarray(live)
    np.testing.assert_allclose(got_logits[rows], want_logits[rows, 0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(unembed_logits, got_logits, atol=1e-5, rtol=1e-5)
    # EngineConfig.layer_unroll: the layers inlined give the scan's logits and cache
    np.testing.assert_allclose(unrolled_logits, got_logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(unrolled.k, got.k, atol=1e-6)
    np.testing.assert_array_equal(got.pos, want.pos)
    np.testing.assert_array_equal(got.lengths, [7, 7, 6])
    for a, b in ((got.k, want.k), (got.v, want.v)):  # [B, L, K, S, H]
        np.testing.assert_allclose(a[rows], b[rows], atol=1e-6)


@pytest.mark.heavy  # 10-16 s on 2 cores
def test_bf16_engine_casts_the_weights_and_cache_and_stays_within_bf16_of_fp32(hf_and_model):
    """EngineConfig.dtype: the fp32 policy's weights become bf16 when the engine takes
    them, the KV cache is bf16, and the engine's logits (prefill and one decode step)
    stay within bf16 rounding of the fp32 engine's: |diff| <= 2^-7 x max|logit| per
    layer of rounding, here 4 (2 layers, attention and MLP), so 2^-5 x max|logit|."""
    _, model = hf_and_model
    engines = {d: _engine(model, dtype=d) for d in ("float32", "bfloat16")}
    params = {d: e.load_params(model) for d, e in engines.items()}
    leaves = jax.tree.leaves(params["bfloat16"])
    assert leaves and all(x.dtype == jnp.bfloat16 for x in leaves)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params["float32"]))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model)))  # untouched
    assert engines["bfloat16"].init_decode_state().cache.k.dtype == jnp.bfloat16
    ids = jnp.asarray([PROMPTS[0]], jnp.int32)
    out = {}
    for d, e in engines.items():
        m = nnx.merge(e.graphdef, params[d])
        cache = KVCache.init(m.config, 1, 16)
        logits, cache = m(ids, cache=cache)
        step, _ = decode_forward(m, jnp.asarray([4]), jnp.asarray([True]), cache)
        out[d] = (np.asarray(logits[0], np.float32), np.asarray(step, np.float32))
    for want, got in zip(out["float32"], out["bfloat16"]):
        scale = float(np.abs(want).max())
        assert np.abs(got - want).max() <= 2.0**-5 * scale, (np.abs(got - want).max(), scale)
        assert np.abs(got - want).max() > 0  # the bf16 engine did compute in bf16


@pytest.mark.heavy
def test_bf16_rollout_logprobs_match_the_fp32_recompute(hf_and_model):
    """Sampling from the bf16 engine: each token's log-prob from the sampler is close to
    the fp32 policy's recomputed one (the mismatch the trainer logs as sampler_*)."""
    _, model = hf_and_model
    engine = _engine(model, dtype="bfloat16", sampling=SamplingConfig(temperature=1.0))
    samples, _ = RolloutDriver(engine).run(
        engine.load_params(model), PROMPTS[:2], num_samples=2, seed=0, max_new_tokens=6
    )
    diffs = []
    for s in samples:
        ids = np.concatenate([s.prompt_tokens, s.tokens])[None]
        logp = jax.nn.log_softmax(model(jnp.asarray(ids, jnp.int32))[0].astype(jnp.float32))
        n = len(s.prompt_tokens)
        want = np.asarray(logp[n - 1 : -1])[np.arange(len(s.tokens)), s.tokens]
        diffs.append(np.abs(s.logprobs - want))
    diffs = np.concatenate(diffs)
    assert diffs.max() < 0.25 and diffs.mean() < 0.05, (diffs.mean(), diffs.max())


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_insert_group_equals_one_insert_per_sample(hf_and_model, kv_dtype):
    """The batched group insert: the same state and first draws as n single inserts
    with the samples' keys, into slots out of order, each with its own limit."""
    from magic_jax.rollout.sampling import sample_key

    _, model = hf_and_model
    engine = _engine(model, max_concurrent_decodes=6, kv_dtype=kv_dtype, sampling=SamplingConfig())
    params = engine.load_params(model)
    prefix = engine.prefill(params, PROMPTS[0])
    slots, samples, limits = [4, 1, 5, 0], [0, 3, 1, 2], [3, 1, 16, 7]
    single = engine.init_decode_state()
    draws = []
    for slot, j, limit in zip(slots, samples, limits):
        single, d = engine.insert(
            prefix, single, slot, key=sample_key(3, 2, 7, j), max_new_tokens=limit
        )
        draws.append(d)
    group, first = engine.insert_group(
        prefix, engine.init_decode_state(), slots,
        seed=3, step=2, prompt=7, samples=samples, max_new_tokens=limits,
    )  # fmt: skip
    for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(group)):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for field, x in zip(first._fields, first):
        np.testing.assert_array_equal(np.stack([getattr(d, field) for d in draws]), x)
    assert bool(group.done[1]) and not bool(group.done[4])  # a limit of 1 ends at insert
    assert set(np.flatnonzero(np.asarray(group.steps))) == set(slots)


def test_cpu_step_defaults_follow_the_step_weight_and_depth(monkeypatch):
    """A light CPU decode step splits the layers' caches and compacts to a quarter of
    the slots; a heavy step, a deeper model or an explicit option does otherwise."""
    from magic_jax.rollout import engine_config as config_lib

    def engine(layers=2, **kw):
        cfg = ModelConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=layers,
            num_heads=4, num_kv_heads=2,
        )  # fmt: skip
        config = EngineConfig(
            max_concurrent_decodes=64, max_prefill_length=8, max_decode_length=8, **kw
        )
        return Engine(Qwen2(cfg, rngs=nnx.Rngs(0)), config)

    cpu = jax.default_backend() == "cpu"
    light = engine()
    assert light.light_cpu_step == light.split_layers == cpu
    assert light.compact_sizes() == ((16, 32, 64) if cpu else (4, 8, 16, 32, 64))
    assert not engine(layers=config_lib.SPLIT_MAX_LAYERS + 1).split_layers
    assert not engine(decode_layers="scan").split_layers
    assert engine(decode_layers="split").split_layers
    monkeypatch.setattr(config_lib, "LIGHT_STEP_FLOPS", 1.0)
    heavy = engine()
    assert not heavy.light_cpu_step and not heavy.split_layers
    assert heavy.compact_sizes() == (4, 8, 16, 32, 64)
    with pytest.raises(ValueError, match="decode_layers"):
        engine(decode_layers="unrolled")


def test_insert_and_generate_donate_the_state(hf_and_model):
    _, model = hf_and_model
    engine = _engine(model)
    params = engine.load_params(model)
    state = engine.init_decode_state()
    new, _ = engine.insert(engine.prefill(params, [1, 2, 3]), state, 1, key=jax.random.key(0))
    assert state.cache.k.is_deleted()
    newer, _ = engine.generate(params, new)
    assert new.cache.k.is_deleted() and not newer.cache.k.is_deleted()


@pytest.mark.heavy
def test_sharded_engine_matches_unsharded(hf_and_model):
    _, model = hf_and_model
    prompts = [np.array(p) for p in PROMPTS]
    sampling = SamplingConfig(temperature=0.9, top_k=20)
    ref, _ = RolloutDriver(_engine(model, sampling=sampling)).run(
        _engine(model).load_params(model), prompts, num_samples=2, seed=4, max_new_tokens=12
    )
    engine = _engine(model, mesh=make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)), sampling=sampling)
    params = engine.load_params(model)
    q_kernel = params["layers"]["self_attn"]["q_proj"]["kernel"][...]  # [L, D, N*H]
    assert q_kernel.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")
    got, _ = RolloutDriver(engine).run(params, prompts, num_samples=2, seed=4, max_new_tokens=12)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_reshard_train_to_sample_layout_stays_on_device(hf_and_model):
    _, model = hf_and_model
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    state = nnx.state(model)
    train = jax.device_put(state, model_shardings(state, mesh, TRAIN_RULES))
    sample_engine = _engine(model, mesh=mesh)
    decode_state = sample_engine.init_decode_state()
    sample_engine.load_params(train)  # compiled outside the guard
    with jax.transfer_guard("disallow"):
        sampled = sample_engine.load_params(train)
        # The engine consumes the resharded weights with no transfer either.
        decode_state, _ = sample_engine.generate(sampled, decode_state)
        jax.block_until_ready(decode_state)
    want = model_shardings(state, mesh, SAMPLE_RULES)
    for got_leaf, want_leaf, train_leaf in zip(
        jax.tree.leaves(sampled), jax.tree.leaves(want), jax.tree.leaves(train)
    ):
        assert got_leaf.sharding == want_leaf
        np.testing.assert_array_equal(np.asarray(got_leaf), np.asarray(train_leaf))
    emb = sampled["embed_tokens"]["embedding"][...]
    assert emb.sharding.spec == jax.sharding.PartitionSpec("tensor", None)
    assert train["embed_tokens"]["embedding"][...].sharding.spec == jax.sharding.PartitionSpec(
        "tensor", "fsdp"
    )


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_concurrent_decodes": 0}, "max_concurrent_decodes"),
        ({"decode_steps": 0}, "decode_steps"),
        ({"cache_bucket": -1}, "cache_bucket"),
        ({"prefill_buckets": (32, 16)}, "prefill_buckets"),
        ({"layer_unroll": 0}, "layer_unroll"),
        ({"dtype": "float16"}, "dtype"),
        ({"max_prefill_length": 64, "prefill_buckets": (16, 32)}, "prefill_buckets"),
    ],
)
def test_config_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_prompt_too_long_is_rejected(hf_and_model):
    _, model = hf_and_model
    engine = _engine(model)
    with pytest.raises(ValueError, match="max_prefill_length"):
        engine.prefill(engine.load_params(model), np.arange(17))


def test_compacted_decoding_is_on_except_on_gpu(monkeypatch):
    """compact_batch None: on (CPU, TPU) but off on GPU, whose compiler (XLA, jax 0.11.2)
    fails on the compacted chunk; an explicit value wins everywhere."""
    import jax

    from magic_jax.rollout.engine_config import EngineOptions, compacts

    for backend, want in (("cpu", True), ("tpu", True), ("gpu", False)):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert compacts(EngineOptions()) is want
        assert compacts(EngineOptions(compact_batch=True)) is True
        assert compacts(EngineOptions(compact_batch=False)) is False
