"""Qwen2 model: logits parity with transformers, KV-cache decoding, configs and presets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import TINY_CONFIGS, assert_fp32_close, torch_logits

from magic_jax.model.config import PRESETS, ModelConfig
from magic_jax.model.convert import load_hf
from magic_jax.model.qwen2 import KVCache, Qwen2, abstract_model, count_params
from magic_jax.testing import make_hf_model, save_hf_model

PUBLISHED_PARAMS = {
    "r1-distill-qwen-1.5b": 1_777_088_000,
    "r1-distill-qwen-7b": 7_615_616_512,
    "r1-distill-qwen-32b": 32_763_876_352,
}


def _left_padded_batch(vocab, lengths, total, seed=0):
    rng = np.random.RandomState(seed)
    ids = rng.randint(3, vocab, (len(lengths), total)).astype(np.int32)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, total - n :] = 1
        ids[row, : total - n] = 0
    return ids, mask


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def hf_pair(request, tmp_path_factory):
    hf = make_hf_model(seed=3, **TINY_CONFIGS[request.param])
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_hf(path)


def test_logits_match_transformers(hf_pair):
    hf, model = hf_pair
    ids, mask = _left_padded_batch(hf.config.vocab_size, [12, 7, 1], 12)
    ref = torch_logits(hf, ids, mask)
    out = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    real = mask.astype(bool)
    rel = np.abs(out - ref)[real].max() / np.abs(ref[real]).max()
    assert rel <= 1e-4, rel
    # no padding at all: the default positions must be 0..T-1
    full = np.asarray(model(jnp.asarray(ids[:1])))
    np.testing.assert_allclose(full, torch_logits(hf, ids[:1]), atol=1e-4 * np.abs(ref).max())


def test_hidden_and_unembedding_give_logits(hf_pair):
    _, model = hf_pair
    ids = jnp.arange(10, dtype=jnp.int32)[None] % model.config.vocab_size
    hidden = model(ids, return_hidden=True)
    assert hidden.shape == (1, 10, model.config.hidden_size)
    np.testing.assert_allclose(hidden @ model.unembedding(), model(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gqa_untied", "mha_tied"])
def test_prefill_then_decode_equals_full_forward(name):
    kw = TINY_CONFIGS[name]
    cfg = ModelConfig(
        vocab_size=101,
        hidden_size=kw["hidden_size"],
        intermediate_size=kw["intermediate_size"],
        num_layers=kw["num_hidden_layers"],
        num_heads=kw["num_attention_heads"],
        num_kv_heads=kw["num_key_value_heads"],
        rope_theta=kw["rope_theta"],
        tie_word_embeddings=kw["tie_word_embeddings"],
    )
    model = Qwen2(cfg, rngs=nnx.Rngs(1))
    prompt_len, new = 6, 5
    ids, mask = _left_padded_batch(101, [6, 3, 5], prompt_len + new, seed=2)
    # left padding lives in the prompt only; generated tokens are all real
    ids = np.concatenate([ids[:, new:], ids[:, :new] * 0 + 7 + np.arange(new)], axis=1)
    mask = np.concatenate([mask[:, new:], np.ones((3, new), np.int32)], axis=1)
    full = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))

    cache = KVCache.init(cfg, batch=3, max_len=32)
    step = nnx.jit(lambda m, x, a, c: m(x, attention_mask=a, cache=c))
    logits, cache = step(
        model, jnp.asarray(ids[:, :prompt_len]), jnp.asarray(mask[:, :prompt_len]), cache
    )
    outs = [np.asarray(logits)]
    for t in range(prompt_len, prompt_len + new):
        logits, cache = step(
            model, jnp.asarray(ids[:, t : t + 1]), jnp.asarray(mask[:, t : t + 1]), cache
        )
        outs.append(np.asarray(logits))
    incremental = np.concatenate(outs, axis=1)
    real = mask.astype(bool)
    np.testing.assert_allclose(incremental[real], full[real], rtol=1e-5, atol=1e-5)
    assert np.asarray(cache.lengths).tolist() == [prompt_len + new] * 3
    assert np.asarray(cache.next_positions()).tolist() == [6 + new, 3 + new, 5 + new]


def test_rows_advance_independently():
    """Rows at different cache lengths decode in one step as if alone."""
    cfg = ModelConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
    model = Qwen2(cfg, rngs=nnx.Rngs(0))
    fwd = nnx.jit(lambda m, x, a=None, c=None: m(x, attention_mask=a, cache=c))
    a = jnp.array([[5, 6, 7, 8]], jnp.int32)
    b = jnp.array([[9, 10]], jnp.int32)
    cache = KVCache.init(cfg, 2, 8)
    # prefill row 0 with 4 tokens and row 1 with 2 (right padding is never attended)
    batch = jnp.array([[5, 6, 7, 8], [9, 10, 0, 0]], jnp.int32)
    m = jnp.array([[1, 1, 1, 1], [1, 1, 0, 0]], jnp.int32)
    _, cache = fwd(model, batch, m, cache)
    cache = KVCache(k=cache.k, v=cache.v, pos=cache.pos, lengths=jnp.array([4, 2], jnp.int32))
    nxt, _ = fwd(model, jnp.array([[11], [12]], jnp.int32), None, cache)
    alone_a = fwd(model, jnp.concatenate([a, jnp.array([[11]])], 1))[:, -1]
    alone_b = fwd(model, jnp.concatenate([b, jnp.array([[12]])], 1))[:, -1]
    np.testing.assert_allclose(nxt[0, 0], alone_a[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(nxt[1, 0], alone_b[0], rtol=1e-5, atol=1e-5)


def test_sliding_window_matches_transformers(tmp_path):
    kw = dict(
        TINY_CONFIGS["gqa_untied"],
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        attn_implementation="eager",
    )
    hf = make_hf_model(seed=5, **kw)
    model = load_hf(save_hf_model(hf, tmp_path))
    assert model.config.sliding_layers == (1,)
    ids = np.random.RandomState(0).randint(3, 128, (2, 10))
    np.testing.assert_allclose(
        np.asarray(model(jnp.asarray(ids))), torch_logits(hf, ids), atol=1e-4
    )


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_parameter_counts(name):
    model = abstract_model(PRESETS[name])
    assert count_params(model) == PUBLISHED_PARAMS[name]
    assert PRESETS[name].num_params() == PUBLISHED_PARAMS[name]
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(model)))


def test_hf_config_round_trip():
    cfg = PRESETS["r1-distill-qwen-32b"]
    again = ModelConfig.from_hf_config(cfg.to_hf_config())
    assert again == cfg


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(num_heads=6, num_kv_heads=4), "num_kv_heads"),
        (dict(dtype="int8"), "dtype"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(sliding_layers=(0,)), "sliding_layers"),
        (dict(remat="everything"), "remat"),
    ],
)
def test_config_validation_names_the_field(change, field):
    base = dict(
        vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1
    )
    with pytest.raises(ValueError, match=field):
        ModelConfig(**(base | change))


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        ModelConfig.from_hf_config({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    hf = PRESETS["r1-distill-qwen-7b"].to_hf_config()
    hf["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_config(hf)


def test_query_chunked_attention_equals_full():
    """Chunked attention (with padding of the last chunk) changes neither values nor grads."""
    base = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
    full = Qwen2(ModelConfig(**base, attention_chunk=0), rngs=nnx.Rngs(3))
    chunked = Qwen2(ModelConfig(**base, attention_chunk=4), rngs=nnx.Rngs(3))
    ids, mask = _left_padded_batch(61, [11, 6], 11, seed=4)

    def loss(m):
        logits = m(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
        return jnp.sum(jax.nn.log_softmax(logits)[..., 5] * mask)

    (la, ga), (lb, gb) = (nnx.jit(nnx.value_and_grad(loss))(m) for m in (full, chunked))
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _stacked_like(loop: Qwen2, **change) -> Qwen2:
    """A scanned model holding exactly ``loop``'s weights (layer i at index i)."""
    import dataclasses

    cfg = dataclasses.replace(loop.config, scan_layers=True, **change)
    graphdef, state = nnx.split(abstract_model(cfg))
    flat = dict(nnx.to_flat_state(nnx.state(loop)))
    leaves = []
    for path, var in nnx.to_flat_state(state):
        if path[0] == "layers":
            parts = [flat[("layers", i, *path[1:])][...] for i in range(cfg.num_layers)]
            leaves.append((path, var.replace(jnp.stack(parts))))
        else:
            leaves.append((path, var.replace(flat[path][...])))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


@pytest.mark.parametrize(
    "remat, unroll",
    [
        ("none", 1),
        ("full", 1),
        ("none", True),
        pytest.param("dots_saveable", 1, marks=pytest.mark.slow),
        pytest.param("full", 2, marks=pytest.mark.slow),
    ],
)
@pytest.mark.heavy
def test_scanned_layers_equal_the_loop_values_and_grads(remat, unroll):
    """nnx.scan over stacked layers (per-layer sliding windows as data), each remat
    policy and layer unroll give the loop's logits, KV-cache decode and gradients."""
    base = dict(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
        num_kv_heads=2, sliding_window=3, sliding_layers=(1,), scan_layers=False,
    )  # fmt: skip
    loop = Qwen2(ModelConfig(**base), rngs=nnx.Rngs(7))
    scan = _stacked_like(loop, remat=remat, layer_unroll=unroll)
    assert scan.layers.mlp.up_proj.kernel.shape == (3, 32, 48)
    ids, mask = _left_padded_batch(61, [9, 5], 9, seed=2)

    def loss(m):
        logits = m(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
        return jnp.sum(jax.nn.log_softmax(logits)[..., 5] * mask)

    (la, ga), (lb, gb) = (nnx.jit(nnx.value_and_grad(loss))(m) for m in (loop, scan))
    np.testing.assert_allclose(la, lb, rtol=1e-6)
    assert float(jnp.abs(ga["layers"][1]["self_attn"]["q_proj"]["kernel"][...]).max()) > 0
    # gradients sum over 2 x 9 tokens through 3 layers: scale the tolerance to that
    for i in range(3):
        stacked = [x[i] for x in jax.tree.leaves(gb["layers"])]
        assert_fp32_close(jax.tree.leaves(ga["layers"][i]), stacked, terms=54, err_msg=f"layer {i}")
    for key in ("embed_tokens", "norm", "lm_head"):
        assert_fp32_close(jax.tree.leaves(ga[key]), jax.tree.leaves(gb[key]), terms=54, err_msg=key)
    # prefill into a cache and decode one token: same cache contents and logits
    outs = []
    for m in (loop, scan):
        cache = KVCache.init(m.config, 2, 12)
        _, cache = m(jnp.asarray(ids), attention_mask=jnp.asarray(mask), cache=cache)
        nxt, cache = m(jnp.asarray([[4], [6]]), cache=cache)
        outs.append((nxt, cache))
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[0][1].k, outs[1][1].k, rtol=1e-5, atol=1e-6)
