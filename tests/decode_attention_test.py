"""The dense decode attention (``decode.decode_attention``): equal to a float64 NumPy
reference in each of its two product orders, and on CPU the order it takes in the
engine's compiled decode programs.

XLA's CPU dot repacks its right operand. With a layer's keys there, a float32 decode
step repacks every layer's keys in every step, which costs more than it saves in long
caches only (``decode.KEYS_LEFT_FROM``); the compiled HLO shows it only as the
operands' order: that order is pinned here."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from magic_jax.model.config import ModelConfig
from magic_jax.model.kv_cache import quantize_kv
from magic_jax.model.qwen2 import Qwen2
from magic_jax.rollout.decode import KEYS_LEFT_FROM, decode_attention
from magic_jax.rollout.engine import Engine, EngineConfig

# an HLO dot's result, operands and contracting dims; an instruction's name and shape
_DOT = re.compile(
    r"= \S+ dot\(%([\w.-]+), %([\w.-]+)\), lhs_batch_dims=\{[\d,]*\}, "
    r"lhs_contracting_dims=\{(\d+)\}, rhs_batch_dims=\{[\d,]*\}, rhs_contracting_dims=\{(\d+)\}"
)
_SHAPE = re.compile(r"%([\w.-]+) = \w+\[([\d,]*)\]")


def _reference(q_BKGH, k_BKSH, v_BKSH, allowed_BS):
    """The decode attention in float64 NumPy."""
    q, k, v = (np.asarray(x, np.float64) for x in (q_BKGH, k_BKSH, v_BKSH))
    s_BKGS = np.einsum("bkgh,bksh->bkgs", q, k) / np.sqrt(q.shape[-1])
    s_BKGS = np.where(np.asarray(allowed_BS)[:, None, None, :], s_BKGS, -np.inf)
    p_BKGS = np.exp(s_BKGS - s_BKGS.max(axis=-1, keepdims=True))
    p_BKGS /= p_BKGS.sum(axis=-1, keepdims=True)
    return np.einsum("bkgs,bksh->bkgh", p_BKGS, v)


# float32 products hold [B, K, S, G] scores, bfloat16 ones [B, K, G, S]; an int8 cache
# computes in the query's dtype. bfloat16's tolerance: the probabilities enter the value
# product in bfloat16 (a relative error of 2^-8 of values of magnitude up to ~3).
@pytest.mark.parametrize(
    "dtype, kv_dtype, atol",
    [
        ("float32", None, 1e-5),
        ("float32", "int8", 1e-5),
        ("bfloat16", None, 2e-2),
        ("bfloat16", "int8", 2e-2),
    ],
)
def test_decode_attention_equals_the_float64_reference(dtype, kv_dtype, atol):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q_BKGH = jax.random.normal(kq, (3, 2, 3, 16)).astype(dtype)  # 2 kv heads, 3 queries each
    k_BKSH = jax.random.normal(kk, (3, 2, 24, 16))  # 24 slots
    v_BKSH = jax.random.normal(kv, (3, 2, 24, 16))
    allowed_BS = jnp.arange(24)[None] < jnp.array([[5], [24], [1]])  # rows hold 5, 24, 1
    if kv_dtype == "int8":
        (k8, ks), (v8, vs) = quantize_kv(k_BKSH), quantize_kv(v_BKSH)
        out = decode_attention(q_BKGH, k8, v8, allowed_BS, ks, vs)
        k_BKSH, v_BKSH = k8 * ks[..., None], v8 * vs[..., None]  # what the cache holds
    else:
        k_BKSH, v_BKSH = k_BKSH.astype(dtype), v_BKSH.astype(dtype)
        out = decode_attention(q_BKGH, k_BKSH, v_BKSH, allowed_BS)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(
        out, _reference(q_BKGH, k_BKSH, v_BKSH, allowed_BS), rtol=0, atol=atol
    )


def score_operands(hlo: str, layer_shape: tuple[int, ...]) -> list[str]:
    """For each dot in compiled ``hlo`` that contracts a layer's keys (``layer_shape``,
    [B, K, S, H]) over H, the side they enter it on: "left" or "right"."""
    shapes = {n: tuple(int(d) for d in dims.split(",") if d) for n, dims in _SHAPE.findall(hlo)}
    sides = []
    for lhs, rhs, lhs_dim, rhs_dim in _DOT.findall(hlo):
        if shapes[lhs] == layer_shape and lhs_dim == "3":
            sides.append("left")
        if shapes[rhs] == layer_shape and rhs_dim == "3":
            sides.append("right")
    return sides


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA's CPU programs")
@pytest.mark.parametrize(
    "dtype, kv_dtype, length, side",
    [
        ("float32", None, 32, "right"),
        ("float32", None, KEYS_LEFT_FROM, "left"),
        ("float32", "int8", KEYS_LEFT_FROM, "left"),
        ("bfloat16", None, KEYS_LEFT_FROM, "right"),
    ],
)
@pytest.mark.parametrize("decode_layers", ["scan", "split"])
def test_the_cpu_decode_programs_take_float32_keys_on_the_left_in_long_caches(
    dtype, kv_dtype, length, side, decode_layers
):
    """The engine's decode step and decode chunk (both loops over the layers): a float32
    scores product (a float32 cache, or an int8 one computing in float32) over a cache
    of ``KEYS_LEFT_FROM`` slots or more takes the layer's keys as its left operand, over
    a shorter one as its right; a bfloat16 one always as its right."""
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=96,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
    model = Qwen2(cfg, rngs=nnx.Rngs(0))
    engine = Engine(
        model,
        EngineConfig(
            max_concurrent_decodes=6,
            max_prefill_length=8,
            max_decode_length=length,
            dtype=dtype,
            kv_dtype=kv_dtype,
            decode_layers=decode_layers,
        ),
    )
    params = engine.load_params(model)
    state = engine.init_decode_state()
    b, _, k, s, h = state.cache.k.shape
    layer = (b, k, s, h)
    assert len(set(layer)) == 4  # the shape names the keys alone
    step = engine._fn("generate", **engine.decode_statics())
    chunk = engine._fn(
        "chunk",
        num_steps=4,
        attend=s,
        split_layers=engine.split_layers,
        **engine.decode_statics(),
    )
    zero = jnp.int32(0)
    programs = [
        step.lower(params, state, engine.eos_array),
        chunk.lower(params, state, None, None, zero, zero, engine.eos_array),
    ]
    for lowered in programs:
        sides = score_operands(lowered.compile().as_text(), layer)
        assert sides and set(sides) == {side}, sides
