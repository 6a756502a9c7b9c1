"""Attention over a sequence, and the SwiGLU MLP, as functions with hand-written backward passes.

Each computes what the plain formula computes (tests compare values and gradients);
what changes is the work and memory of the backward pass. Autodiff of
``softmax(q k^T) v`` keeps the [B, K, G, T, S] probabilities for the backward pass
and walks them several times, through transposed copies. Here the queries are laid
out [B, K, G * T, H] (each kv head's queries one block of rows), so every product
is a plain batched matrix product over [.., G * T, S] and no transposed copy of the
scores is made. The backward pass keeps only the output and each query's
log-normaliser (``lse``, [B, K, G * T]), recomputes the scores with one product and
applies the softmax gradient in one elementwise pass:

    p = exp(s - lse),  dv = p^T do,  dp = do v^T,  ds = p * (dp - rowsum(do * o)),
    dq = ds k,  dk = ds^T q   (each scaled by 1 / sqrt(H) where s was).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_MASKED = jnp.finfo(jnp.float32).min


def _heads_first(x_BTKGH):
    """[B, T, K, G, H] -> [B, K, G * T, H]: each kv head's queries as one block of rows."""
    b, t, k, g, h = x_BTKGH.shape
    return x_BTKGH.transpose(0, 2, 3, 1, 4).reshape(b, k, g * t, h)


def _heads_back(x_BKMH, shape):
    b, t, k, g, h = shape
    return x_BKMH.reshape(b, k, g, t, h).transpose(0, 3, 1, 2, 4)


def _scores(q_BKMH, k_BKSH, allowed_BTS):
    b, kh, m, h = q_BKMH.shape
    t, s = allowed_BTS.shape[1:]
    s_BKMS = jnp.einsum("bkmh,bksh->bkms", q_BKMH, k_BKSH, preferred_element_type=jnp.float32)
    s_BKGTS = s_BKMS.reshape(b, kh, m // t, t, s) * (h**-0.5)
    return jnp.where(allowed_BTS[:, None, None], s_BKGTS, _MASKED).reshape(b, kh, m, s)


def _forward(q_BTKGH, k_BSKH, v_BSKH, allowed_BTS):
    q_BKMH = _heads_first(q_BTKGH)
    k_BKSH = k_BSKH.astype(q_BTKGH.dtype).transpose(0, 2, 1, 3)
    v_BKSH = v_BSKH.transpose(0, 2, 1, 3)
    s_BKMS = _scores(q_BKMH, k_BKSH, allowed_BTS)
    m_BKM = jnp.max(s_BKMS, axis=-1)
    p_BKMS = jnp.exp(s_BKMS - m_BKM[..., None])
    l_BKM = jnp.sum(p_BKMS, axis=-1)
    # normalise the [.., M, H] output rather than the [.., M, S] probabilities
    pv = p_BKMS.astype(v_BSKH.dtype)
    o_BKMH = jnp.einsum("bkms,bksh->bkmh", pv, v_BKSH, preferred_element_type=jnp.float32)
    o_BKMH = (o_BKMH / l_BKM[..., None]).astype(v_BSKH.dtype)
    return _heads_back(o_BKMH, q_BTKGH.shape), m_BKM + jnp.log(l_BKM)


@jax.custom_vjp
def masked_attention(q_BTKGH, k_BSKH, v_BSKH, allowed_BTS):
    """softmax(q k^T / sqrt(H), masked to ``allowed_BTS``) v, the softmax in float32.

    Args:
      q_BTKGH: [B, T, K, G, H] queries (G query heads share each of the K kv heads).
      k_BSKH / v_BSKH: [B, S, K, H] keys and values.
      allowed_BTS: [B, T, S] bool, which keys each query sees; every query must see
        at least one key.

    Returns:
      [B, T, K, G, H] in ``v``'s dtype.
    """
    return _forward(q_BTKGH, k_BSKH, v_BSKH, allowed_BTS)[0]


def _fwd(q_BTKGH, k_BSKH, v_BSKH, allowed_BTS):
    o_BTKGH, lse_BKM = _forward(q_BTKGH, k_BSKH, v_BSKH, allowed_BTS)
    return o_BTKGH, (q_BTKGH, k_BSKH, v_BSKH, allowed_BTS, o_BTKGH, lse_BKM)


def _bwd(res, do_BTKGH):
    q_BTKGH, k_BSKH, v_BSKH, allowed_BTS, o_BTKGH, lse_BKM = res
    dt = q_BTKGH.dtype
    scale = q_BTKGH.shape[-1] ** -0.5
    f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
    q_BKMH, do_BKMH = _heads_first(q_BTKGH), _heads_first(do_BTKGH.astype(dt))
    k_BKSH = k_BSKH.astype(dt).transpose(0, 2, 1, 3)
    v_BKSH = v_BSKH.astype(dt).transpose(0, 2, 1, 3)
    p_BKMS = jnp.exp(_scores(q_BKMH, k_BKSH, allowed_BTS) - lse_BKM[..., None])
    dv_BKSH = f32("bkms,bkmh->bksh", p_BKMS.astype(dt), do_BKMH)
    dp_BKMS = f32("bkmh,bksh->bkms", do_BKMH, v_BKSH)
    o_BKMH = _heads_first(o_BTKGH)
    rows_BKM = jnp.sum(do_BKMH.astype(jnp.float32) * o_BKMH.astype(jnp.float32), axis=-1)
    ds_BKMS = (p_BKMS * (dp_BKMS - rows_BKM[..., None]) * scale).astype(dt)
    dq_BKMH = f32("bkms,bksh->bkmh", ds_BKMS, k_BKSH)
    dk_BKSH = f32("bkms,bkmh->bksh", ds_BKMS, q_BKMH)
    return (
        _heads_back(dq_BKMH, q_BTKGH.shape).astype(dt),
        dk_BKSH.transpose(0, 2, 1, 3).astype(k_BSKH.dtype),
        dv_BKSH.transpose(0, 2, 1, 3).astype(v_BSKH.dtype),
        None,
    )


masked_attention.defvjp(_fwd, _bwd)


@jax.custom_vjp
def swiglu(x_TD, gate_DF, up_DF, down_FD):
    """``(silu(x gate) * (x up)) down`` over the last axis of ``x`` ([..., D]).

    The backward pass forms every product with the rows (tokens) as the leading
    axis of both operands. Autodiff of the same formula instead fuses the SiLU's
    gradient with a transposed [F, tokens] copy for the gate's weight gradient; on
    XLA's CPU backend that strided pass costs as much as a product (the model's
    ``mlp_kernel``, on for the update on CPU: ``update.step.UPDATE_MLP_KERNEL_DEFAULT``).
    The pass keeps the gate and up pre-activations ([..., F] each), as autodiff does.
    """
    return _swiglu_fwd(x_TD, gate_DF, up_DF, down_FD)[0]


def _swiglu_fwd(x_TD, gate_DF, up_DF, down_FD):
    g_TF, u_TF = x_TD @ gate_DF, x_TD @ up_DF
    y_TD = (jax.nn.silu(g_TF) * u_TF) @ down_FD
    return y_TD, (x_TD, gate_DF, up_DF, down_FD, g_TF, u_TF)


def _swiglu_bwd(res, dy_TD):
    x_TD, gate_DF, up_DF, down_FD, g_TF, u_TF = res
    dy_TD = dy_TD.astype(x_TD.dtype)
    sig_TF = jax.nn.sigmoid(g_TF)
    a_TF = g_TF * sig_TF  # silu(g)
    dh_TF = dy_TD @ down_FD.T
    du_TF = dh_TF * a_TF
    dg_TF = dh_TF * u_TF * (sig_TF * (1 + g_TF * (1 - sig_TF)))
    dx_TD = dg_TF @ gate_DF.T + du_TF @ up_DF.T
    return (
        dx_TD,
        _outer(x_TD, dg_TF, gate_DF.dtype),
        _outer(x_TD, du_TF, up_DF.dtype),
        _outer(a_TF * u_TF, dy_TD, down_FD.dtype),
    )


def _outer(a_TI, b_TO, dtype):
    """A weight's gradient [I, O]: a[..., i] b[..., o] summed over every leading axis."""
    a = a_TI.reshape(-1, a_TI.shape[-1])
    b = b_TO.reshape(-1, b_TO.shape[-1])
    return jnp.einsum("ti,to->io", a, b, preferred_element_type=jnp.float32).astype(dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
