"""Engine: greedy parity with transformers' generate, sharding, donation, weight resharding."""

import jax
import numpy as np
import pytest
import torch

from magic_jax.convert import load_hf
from magic_jax.engine import Engine, EngineConfig
from magic_jax.reshard import Resharder
from magic_jax.rollout import RolloutDriver
from magic_jax.sampling import SamplingConfig
from magic_jax.sharding import SAMPLE_RULES, TRAIN_RULES, MeshConfig, make_mesh, model_shardings
from magic_jax.testing import make_hf_model, save_hf_model

GREEDY = SamplingConfig(greedy=True)
PROMPTS = [
    [5, 9, 13, 2, 7, 11, 3],
    [17, 4],
    [8, 8, 30, 41, 12],
    [60],
    [3, 14, 15, 9, 26, 5, 35, 8, 9],
]


@pytest.fixture(scope="module")
def hf_and_model(tmp_path_factory):
    hf = make_hf_model(
        seed=1,
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=2,
    )
    # Random init gives near-flat logits where fp32 noise could flip an arg-max;
    # a larger output scale makes the greedy path well separated.
    with torch.no_grad():
        hf.lm_head.weight.mul_(30.0)
    path = save_hf_model(hf, tmp_path_factory.mktemp("tiny"))
    return hf, load_hf(path)


def _hf_greedy(hf, prompts, new_tokens):
    """transformers' generate on one left-padded batch, greedy, no early stop."""
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
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, width:].numpy()


def _engine(model, mesh=None, **kw):
    base = dict(
        max_concurrent_decodes=4,
        max_prefill_length=16,
        max_decode_length=24,
        decode_steps=4,
        cache_bucket=0,
        compact_batch=False,
        sampling=GREEDY,
        eos_ids=(),
    )
    return Engine(model, EngineConfig(**(base | kw)), mesh=mesh)


def test_greedy_matches_transformers_generate(hf_and_model):
    hf, model = hf_and_model
    want = _hf_greedy(hf, PROMPTS, 20)
    # Five prompts on four slots: the last is inserted mid-flight; bucketed
    # attention and batch compaction are on.
    engine = _engine(model, cache_bucket=16, compact_batch=True)
    samples, _ = RolloutDriver(engine).run(
        engine.load_params(model), [np.array(p) for p in PROMPTS], max_new_tokens=20
    )
    got = np.stack([s.tokens for s in samples])
    np.testing.assert_array_equal(got, want)


def test_raw_engine_api_matches_transformers(hf_and_model):
    """prefill / insert / generate by hand, one step at a time, slots out of order."""
    hf, model = hf_and_model
    want = _hf_greedy(hf, PROMPTS[:3], 6)
    engine = _engine(model, max_concurrent_decodes=3)
    params = engine.load_params(model)
    state = engine.init_decode_state()
    got = {i: [] for i in range(3)}
    for slot, i in ((2, 0), (0, 1), (1, 2)):
        state, first = engine.insert(
            engine.prefill(params, PROMPTS[i]), state, slot, key=jax.random.key(0)
        )
        got[i].append(int(first.tokens))
    for _ in range(5):
        state, out = engine.generate(params, state)
        for slot, i in ((2, 0), (0, 1), (1, 2)):
            assert bool(out.valid[slot])
            got[i].append(int(out.tokens[slot]))
    np.testing.assert_array_equal(np.array([got[i] for i in range(3)]), want)


def test_insert_and_generate_donate_the_state(hf_and_model):
    _, model = hf_and_model
    engine = _engine(model)
    params = engine.load_params(model)
    state = engine.init_decode_state()
    new, _ = engine.insert(engine.prefill(params, [1, 2, 3]), state, 1, key=jax.random.key(0))
    assert state.cache.k[0].is_deleted()
    newer, _ = engine.generate(params, new)
    assert new.cache.k[0].is_deleted() and not newer.cache.k[0].is_deleted()


def test_sharded_engine_matches_unsharded(hf_and_model):
    _, model = hf_and_model
    prompts = [np.array(p) for p in PROMPTS]
    sampling = SamplingConfig(temperature=0.9, top_k=20)
    ref, _ = RolloutDriver(_engine(model, sampling=sampling)).run(
        _engine(model).load_params(model), prompts, num_samples=2, seed=4, max_new_tokens=12
    )
    engine = _engine(model, mesh=make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)), sampling=sampling)
    params = engine.load_params(model)
    q_kernel = params["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
    assert q_kernel.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    got, _ = RolloutDriver(engine).run(params, prompts, num_samples=2, seed=4, max_new_tokens=12)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_reshard_train_to_sample_layout_stays_on_device(hf_and_model):
    _, model = hf_and_model
    from flax import nnx

    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    state = nnx.state(model)
    train = jax.device_put(state, model_shardings(state, mesh, TRAIN_RULES))
    resharder = Resharder(state, mesh)
    sample_engine = _engine(model, mesh=mesh)
    decode_state = sample_engine.init_decode_state()
    with jax.transfer_guard("disallow"):
        sampled = resharder(train)
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
