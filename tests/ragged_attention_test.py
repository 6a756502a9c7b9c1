"""rollout.decode_attention: ragged — the decode attention kernels that read only the cache
slots each row holds (the TPU kernel interpreted, the GPU kernel in Pallas's interpreter
and lowered for CUDA), against the dense path: kernel outputs (of a float and an int8
cache), the new token's merge, decode logits and the engine's samples, unsharded and
over a mesh."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import reference_past

from magic_jax.model.config import ModelConfig
from magic_jax.model.kv_cache import KVCache, quantize_kv
from magic_jax.model.qwen2 import Qwen2
from magic_jax.model.sharding import MeshConfig, make_mesh
from magic_jax.rollout import ragged_attention as ra
from magic_jax.rollout.decode import decode_forward
from magic_jax.rollout.driver import RolloutDriver
from magic_jax.rollout.engine import Engine, EngineConfig
from magic_jax.rollout.sampling import SamplingConfig

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=96,
    intermediate_size=128,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
)  # head dim 16, three query heads per kv head
PROMPTS = [[5, 9, 13, 2, 7, 11, 3], [17, 4], [8, 8, 30, 41, 12], [60], [3, 14, 15, 9, 26, 5]]
# Rows at every edge of the 32-slot blocks of a 96-slot cache: empty, one slot, a block
# but one, a block, a block and one, all.
LENGTHS = [0, 1, 31, 32, 33, 96]


def _qkv(dtype, seed=0, b=6, s=96, k=2, g=3, h=16):
    """q [B, K, G, H] and one layer's k, v [B, S, K, H]."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, k, g, h), jnp.float32).astype(dtype)
    return q, *(jax.random.normal(x, (b, s, k, h), jnp.float32).astype(dtype) for x in (kk, kv))


def _stacked(x_BSKX, layer, num_layers=3):
    """A [B, L, K, S, ...] cache (``KVCache``'s keys, values or scales) holding one layer's
    ``x_BSKX`` at ``layer`` and NaN in every other layer: a kernel that read another
    layer returns NaN."""
    x_BKSX = jnp.swapaxes(x_BSKX, 1, 2)
    x = jnp.full((x_BKSX.shape[0], num_layers, *x_BKSX.shape[1:]), jnp.nan, x_BKSX.dtype)
    return x.at[:, layer].set(x_BKSX)


def _kernel(name):
    """(q, k, v [B, S, K, H], lengths) -> the kernel's (out, lse), the layer read from the
    middle of a stacked cache."""

    def run(q, k, v, lengths):
        ks, vs = _stacked(k, 1), _stacked(v, 1)
        if name == "gpu":  # the Triton kernel, run by Pallas's interpreter
            return ra._gpu_past(q, ks, vs, jnp.int32(1), lengths, interpret=True)
        if name == "tpu-1":  # one kv head, as a device holds at tensor 2
            outs = [
                ra.past_attention(
                    q[:, i : i + 1],
                    ks[:, :, i : i + 1],
                    vs[:, :, i : i + 1],
                    1,
                    lengths,
                    ra.RaggedSpec("interpret"),
                )
                for i in range(q.shape[1])
            ]
            return tuple(jnp.concatenate(x, axis=1) for x in zip(*outs))
        return ra.past_attention(q, ks, vs, jnp.int32(1), lengths, ra.RaggedSpec("interpret"))

    return run


def _tol(dtype, v):
    # bf16: the probabilities enter the value product rounded to 8 bits, so an output
    # moves by at most ~2^-8 of the largest value (twice that, both sides rounded).
    return 1e-5 if dtype == jnp.float32 else 2.0**-7 * float(jnp.abs(v).max())


@pytest.mark.parametrize("kernel", ["tpu", "tpu-1", "gpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_equal_the_reference_and_never_read_a_block_past_a_rows_length(kernel, dtype):
    q, k, v = _qkv(dtype)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    want_out, want_lse = reference_past(q, k, v, lengths)
    # Every block that starts at or past a row's length is poisoned: a kernel that read
    # it (or the dense path, which reads everything) returns NaN for that row.
    start = jnp.arange(k.shape[1]) // 32 * 32
    past = (start[None] >= lengths[:, None])[..., None, None]
    k_nan, v_nan = (jnp.where(past, jnp.nan, x).astype(dtype) for x in (k, v))
    out, lse = _kernel(kernel)(q, k_nan, v_nan, lengths)
    assert out.shape == want_out.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(out, want_out, atol=_tol(dtype, v), rtol=0)
    assert bool(jnp.all(jnp.isneginf(lse[0]))) and not np.any(np.asarray(out[0]))
    np.testing.assert_allclose(lse[1:], want_lse[1:], atol=1e-4 if dtype == jnp.float32 else 0.05)


def _numpy_past(q_BKGH, k_BSKH, v_BSKH, lengths_B):
    """The past's attention in float64 NumPy, row by row: (out [B, K, G, H], lse [B, K, G])."""
    q, k, v = (np.asarray(x, np.float64) for x in (q_BKGH, k_BSKH, v_BSKH))
    out, lse = np.zeros(q.shape), np.full(q.shape[:-1], -np.inf)
    for i, n in enumerate(np.asarray(lengths_B)):
        if n == 0:
            continue
        s_KGS = np.einsum("kgh,skh->kgs", q[i], k[i, :n]) / np.sqrt(q.shape[-1])
        m_KG = s_KGS.max(-1)
        p_KGS = np.exp(s_KGS - m_KG[..., None])
        out[i] = np.einsum("kgs,skh->kgh", p_KGS, v[i, :n]) / p_KGS.sum(-1)[..., None]
        lse[i] = m_KG + np.log(p_KGS.sum(-1))
    return out, lse


@pytest.mark.parametrize(
    ("dtype", "s", "lengths", "heads"),
    [  # kv heads: two, one (a device's at tensor 2) and four
        (jnp.float32, 256, [0, 1, 127, 128, 129, 256], 2),
        (jnp.bfloat16, 256, [0, 1, 127, 128, 129, 256], 1),
        (jnp.float32, 96, [0, 1, 31, 33, 95, 96], 1),
        (jnp.bfloat16, 96, [0, 1, 31, 33, 95, 96], 2),
        (jnp.bfloat16, 256, [0, 1, 127, 128, 129, 256], 4),
    ],
)
def test_the_tpu_kernel_reads_an_int8_cache_and_its_scales_as_the_reference(
    dtype, s, lengths, heads
):
    """The int8 keys and values with their per-token scales, read in the middle of a
    stacked cache whose other layers' scales are NaN: the kernel equals attention over the
    dequantized cache (float64 NumPy) and reads no block past a row's length (blocks of
    128 slots; a cache of fewer slots is one block)."""
    q, k, v = _qkv(jnp.float32, s=s, k=heads)
    q = q.astype(dtype)
    (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
    lengths = jnp.asarray(lengths, jnp.int32)
    want_out, want_lse = _numpy_past(
        q.astype(jnp.float32), k8 * ks[..., None], v8 * vs[..., None], lengths
    )
    bs = ra.block_size(s, quantized=True)
    assert bs == min(s, 128)
    start = jnp.arange(s) // bs * bs
    past = (start[None] >= lengths[:, None])[..., None]
    # a block read past a row's length makes its row NaN
    ks_nan, vs_nan = (jnp.where(past, jnp.nan, x) for x in (ks, vs))
    k8s, v8s = _stacked(k8, 1).astype(jnp.int8), _stacked(v8, 1).astype(jnp.int8)
    past = jax.jit(functools.partial(ra.past_attention, spec=ra.RaggedSpec("interpret")))
    out, lse = past(
        q, k8s, v8s, jnp.int32(1), lengths, ks_BLKS=_stacked(ks_nan, 1), vs_BLKS=_stacked(vs_nan, 1)
    )
    assert out.shape == want_out.shape and out.dtype == jnp.float32
    # bf16: the query and each probability (times its value's scale) enter the products
    # rounded to 8 bits
    v_max = float(jnp.abs(v8 * vs[..., None]).max())
    tol = 1e-5 if dtype == jnp.float32 else 2.0**-7 * v_max
    np.testing.assert_allclose(out, want_out, atol=tol, rtol=0)
    assert bool(jnp.all(jnp.isneginf(lse[0]))) and not np.any(np.asarray(out[0]))
    lse_tol = 1e-4 if dtype == jnp.float32 else 0.05
    np.testing.assert_allclose(lse[1:], want_lse[1:], atol=lse_tol, rtol=0)


def test_the_int8_kernel_over_a_mesh_equals_it_on_one_device():
    """Rows over data x fsdp and kv heads over tensor (a device's one kv head): the
    kernel runs per device on its rows, heads and their scales."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    q, k, v = _qkv(jnp.bfloat16, b=4, s=128, k=2)
    (k8, ks), (v8, vs) = (quantize_kv(_stacked(x.astype(jnp.float32), 0, 2)) for x in (k, v))
    lengths = jnp.asarray([0, 1, 100, 128], jnp.int32)
    sharded = ra.RaggedSpec("interpret", mesh, ("data", "fsdp"), "tensor")
    outs = [
        jax.jit(functools.partial(ra.past_attention, spec=spec))(
            q, k8, v8, jnp.int32(0), lengths, ks_BLKS=ks, vs_BLKS=vs
        )
        for spec in (ra.RaggedSpec("interpret"), sharded)
    ]
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_merging_the_new_token_equals_attention_over_the_written_cache():
    q, k, v = _qkv(jnp.float32, seed=1)
    lengths = jnp.asarray([0, 1, 31, 32, 33, 95], jnp.int32)
    k_new, v_new = k[:, -1], v[:, -1]
    # the dense way: the new token written at each row's length, attended with the rest
    rows = jnp.arange(k.shape[0])
    k_w, v_w = k.at[rows, lengths].set(k_new), v.at[rows, lengths].set(v_new)
    want, _ = reference_past(q, k_w, v_w, lengths + 1)
    got = ra.merge_new_token(*reference_past(q, k, v, lengths), q, k_new, v_new)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def _model(cfg=CFG, dtype="float32", seed=0):
    return Qwen2(dataclasses.replace(cfg, dtype=dtype, param_dtype=dtype), rngs=nnx.Rngs(seed))


@pytest.mark.slow  # ~8 s each: the interpreted kernel in three decode steps
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ragged_decode_logits_match_the_dense_path(dtype):
    """Three decode steps from a prefilled cache with one finished row; each step's
    logits of the live rows and its written cache agree with the dense product's (a
    finished row reads nothing in the kernel; its logits are never used)."""
    model = _model(dtype=dtype, seed=2)
    tokens = jnp.asarray(np.random.RandomState(0).randint(1, 64, (3, 20)), jnp.int32)
    _, cache = model(tokens, cache=KVCache.init(model.config, 3, 64))
    live = jnp.asarray([True, False, True])
    tok = jnp.asarray([5, 7, 9], jnp.int32)
    for _ in range(3):
        dense, cache_d = decode_forward(model, tok, live, cache)
        ragged, cache_r = decode_forward(model, tok, live, cache, ragged=ra.RaggedSpec("interpret"))
        tol = 1e-5 if dtype == "float32" else 2.0**-6 * float(jnp.abs(dense).max())
        np.testing.assert_allclose(ragged[live], dense[live], atol=tol, rtol=0)
        np.testing.assert_array_equal(cache_r.pos, cache_d.pos)
        np.testing.assert_array_equal(cache_r.lengths, cache_d.lengths)
        for a, b in ((cache_r.k, cache_d.k), (cache_r.v, cache_d.v)):  # [B, L, K, S, H]
            np.testing.assert_allclose(
                a[live].astype(jnp.float32), b[live].astype(jnp.float32), atol=tol, rtol=0
            )
        cache, tok = cache_d, jnp.argmax(dense, -1).astype(jnp.int32)


def test_sliding_windows_unblocked_lengths_and_int8_on_the_gpu_run_the_dense_path():
    spec = ra.RaggedSpec("interpret")
    windowed = _model(dataclasses.replace(CFG, sliding_window=3, sliding_layers=(1,)))
    tok, live = jnp.asarray([5, 7], jnp.int32), jnp.asarray([True, True])
    for model, cache, ragged in [
        (windowed, KVCache.init(windowed.config, 2, 32), spec),
        (_model(), KVCache.init(CFG, 2, 40), spec),  # no block of 16..128 divides 40
        # an int8 cache's blocks: 128 slots, or all of them below 128 in rows of 32
        (_model(), KVCache.init(CFG, 2, 48, kv_dtype="int8"), spec),
        # the Triton kernel reads a float cache (nothing runs on a GPU here)
        (_model(), KVCache.init(CFG, 2, 32, kv_dtype="int8"), ra.RaggedSpec("gpu")),
    ]:
        want, _ = decode_forward(model, tok, live, cache)
        got, _ = decode_forward(model, tok, live, cache, ragged=ragged)
        np.testing.assert_array_equal(got, want)
    assert not ra.applies(spec, quantized=True, sliding=False, length=160)
    assert ra.applies(spec, quantized=True, sliding=False, length=32)
    assert ra.applies(spec, quantized=True, sliding=False, length=384)
    # the engine takes the pair: on TPU (and interpreted) the kernel reads the int8
    # cache, on GPU the step runs the dense product (above)
    assert EngineConfig(decode_attention="ragged", kv_dtype="int8").kv_dtype == "int8"
    with pytest.raises(ValueError, match="decode_attention: unknown decode attention 'paged'"):
        EngineConfig(decode_attention="paged")
    q, k, v = _qkv(jnp.float32, s=40)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        ra.past_attention(q, _stacked(k, 0, 1), _stacked(v, 0, 1), 0, jnp.zeros(6, jnp.int32), spec)
    (k8, ks), (v8, vs) = (quantize_kv(_stacked(x, 0, 1)) for x in (k, v))
    with pytest.raises(ValueError, match="not a multiple of 128, or of 32 below it"):
        ra.past_attention(q, k8, v8, 0, jnp.zeros((6,), jnp.int32), spec, ks, vs)


def _engine(model, mesh=None, **kw):
    base = dict(
        max_concurrent_decodes=4,
        max_prefill_length=8,
        max_decode_length=24,
        decode_steps=4,
        cache_bucket=16,
        sampling=SamplingConfig(temperature=1.0),
    )
    return Engine(model, EngineConfig(**(base | kw)), mesh=mesh)


def _sample(engine, model, seed=0):
    samples, _ = RolloutDriver(engine).run(
        engine.load_params(model), PROMPTS, num_samples=2, seed=seed, max_new_tokens=20
    )
    return samples


@pytest.mark.slow  # ~25 s: two interpreted rollouts
def test_engine_samples_are_the_same_with_ragged_attention_unsharded_and_on_a_mesh():
    """Refills, compaction and attended-length buckets (16 and 32 slots) through the
    kernel: the same tokens as the dense engine, log-probs within fp32 rounding; on a
    mesh the kernel runs per device on its rows and kv heads."""
    model = _model(seed=1)
    dense = _engine(model)
    assert dense.ragged_spec is None  # CPU's default
    ref = _sample(dense, model, seed=4)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    for m in (None, mesh):
        engine = _engine(model, mesh=m, decode_attention="ragged")
        spec = engine.ragged_spec
        assert spec.backend == "interpret"
        if m is not None:
            assert (spec.row_axes, spec.head_axes) == (("data", "fsdp"), "tensor")
        got = _sample(engine, model, seed=4)
        assert sum(len(s.tokens) for s in got) > 40
        for a, b in zip(ref, got):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_the_gpu_kernel_lowers_for_cuda():
    """Lowered for CUDA on this machine (no GPU needed): a Triton call per layer, over
    the stacked cache at a traced layer index."""
    q, k, v = _qkv(jnp.bfloat16, k=2, g=7, h=128, s=256, b=4)
    fn = jax.jit(lambda q, k, v, i, n: ra.past_attention(q, k, v, i, n, ra.RaggedSpec("gpu")))
    k, v = _stacked(k, 0, 28), _stacked(v, 0, 28)
    args = (q, k, v, jnp.int32(0), jnp.zeros((4,), jnp.int32))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in text.as_text()
