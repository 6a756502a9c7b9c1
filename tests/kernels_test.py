"""Attention and the SwiGLU MLP with hand-written backward passes against the plain formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_fp32_close

from magic_jax.model.kernels import masked_attention, swiglu


def plain_attention(q, k, v, allowed):
    h = q.shape[-1]
    s = jnp.einsum("BTKGH,BSKH->BKGTS", q, k.astype(q.dtype), preferred_element_type=jnp.float32)
    s = jnp.where(allowed[:, None, None], s * h**-0.5, jnp.finfo(jnp.float32).min)
    return jnp.einsum("BKGTS,BSKH->BTKGH", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


def value_and_grads(fn, args, weight):
    def f(*a):
        return jnp.sum(fn(*a).astype(jnp.float32) * weight)

    return jax.jit(jax.value_and_grad(f, argnums=tuple(range(len(args)))))(*args)


def assert_close(ours, plain, dtype):
    # float32: rounding only (sums over at most 12 terms of size ~1); bfloat16: a few
    # units in the last place of its 8-bit mantissa
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=4e-2, atol=4e-2)
    (v1, g1), (v2, g2) = ours, plain
    np.testing.assert_allclose(float(v1), float(v2), **tol)
    for a, b in zip(g1, g2, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.float32(a), np.float32(b), **tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kv_heads, groups", [(1, 1), (2, 3)])
def test_attention_matches_the_plain_formula(dtype, kv_heads, groups):
    rng = np.random.default_rng(kv_heads * 7 + groups)
    b, t, s, h = 2, 7, 9, 8
    q = jnp.asarray(rng.normal(size=(b, t, kv_heads, groups, h)), dtype)
    k = jnp.asarray(rng.normal(size=(b, s, kv_heads, h)), dtype)
    v = jnp.asarray(rng.normal(size=(b, s, kv_heads, h)), dtype)
    # a random mask, every query seeing at least its own slot (as the model's)
    own = jnp.arange(s)[None, None, :] == jnp.arange(t)[None, :, None] + 2
    allowed = jnp.asarray(rng.random((b, t, s)) < 0.5) | own
    weight = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    ours = value_and_grads(lambda *a: masked_attention(*a, allowed), (q, k, v), weight)
    plain = value_and_grads(lambda *a: plain_attention(*a, allowed), (q, k, v), weight)
    assert_close(ours, plain, dtype)
    # a masked key changes nothing, and gets no gradient
    k_far = k.at[:, -1].set(100.0)
    only = allowed.at[:, :, -1].set(False)
    np.testing.assert_array_equal(
        masked_attention(q, k, v, only), masked_attention(q, k_far, v, only)
    )
    dk = value_and_grads(lambda *a: masked_attention(*a, only), (q, k, v), weight)[1][1]
    assert not np.any(np.float32(dk[:, -1]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_matches_the_plain_formula(dtype):
    rng = np.random.default_rng(0)
    b, t, d, f = 2, 5, 8, 12
    x = jnp.asarray(rng.normal(size=(b, t, d)), dtype)
    gate, up = (jnp.asarray(0.3 * rng.normal(size=(d, f)), dtype) for _ in range(2))
    down = jnp.asarray(0.3 * rng.normal(size=(f, d)), dtype)
    weight = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    args = (x, gate, up, down)
    ours = value_and_grads(swiglu, args, weight)
    plain = value_and_grads(lambda x, g, u, w: (jax.nn.silu(x @ g) * (x @ u)) @ w, args, weight)
    if dtype == jnp.float32:  # a weight's gradient sums over all b * t rows
        assert_fp32_close(ours, plain, terms=b * t * f)
    else:
        assert_close(ours, plain, dtype)
    (_, g1), (_, g2) = ours, plain
    assert all(a.dtype == c.dtype and a.shape == c.shape for a, c in zip(g1, g2, strict=True))
    assert min(float(jnp.abs(g).max()) for g in g1) > 0.1  # every gradient is compared
