"""Token log-probs and full-vocabulary entropy from logits or final hidden states.

One formula (``logprob_entropy_lse``) serves the sampler and the update; the
update's ``token_logprobs_and_entropy`` chunks it over the sequence with a
hand-written backward pass so the [B, T, V] logits are never live at once.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


def logprob_entropy_lse(
    z_NV: jax.Array, targets_N: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The one formula for a token's log-prob and the entropy, used by sampler and trainer.

    Args:
      z_NV: [..., V] float32 logits, already divided by the temperature.
      targets_N: [...] int token ids.

    Returns:
      (logp_N, ent_N, lse_N): log softmax(z)[target], the entropy of softmax(z),
      and logsumexp(z), all [...].
    """
    lse_N = jax.nn.logsumexp(z_NV, axis=-1)
    tgt_N = jnp.take_along_axis(z_NV, targets_N[..., None], axis=-1)[..., 0]
    # H = -E_p[log p] = (lse - m) - E_p[z - m], m the row's largest logit: both terms are of
    # H's own size (z - m <= 0, and p is small wherever it is large), so H keeps fp32's
    # precision up to the rounding of lse, as a log-softmax does (1.4e-5 nats at |z| ~ 140).
    # Taken as lse - E_p[z], H is the small difference of two numbers of the logits' size
    # and loses 4e-3 there. Same passes over the logits as before (benchmarks/entropy_formula.py).
    m_N = jax.lax.stop_gradient(jnp.max(z_NV, axis=-1))
    dz_NV = z_NV - m_N[..., None]
    ent_N = (lse_N - m_N) - jnp.sum(jnp.exp(z_NV - lse_N[..., None]) * dz_NV, axis=-1)
    return tgt_N - lse_N, ent_N, lse_N


def _scaled_logits(hidden_BCD: jax.Array, unembed_DV: jax.Array, temperature: float) -> jax.Array:
    logits = jnp.einsum("bcd,dv->bcv", hidden_BCD, unembed_DV, preferred_element_type=jnp.float32)
    return logits / temperature


def _chunk_forward(h_BCD, t_BC, unembed_DV, temperature):
    return logprob_entropy_lse(_scaled_logits(h_BCD, unembed_DV, temperature), t_BC)


def _scan_forward(h_NBCD, unembed_DV, t_NBC, temperature):
    def body(carry, xs):
        return carry, _chunk_forward(*xs, unembed_DV, temperature)

    return jax.lax.scan(body, None, (h_NBCD, t_NBC))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _chunked_logp_entropy(h_NBCD, unembed_DV, t_NBC, temperature):
    logp_NBC, ent_NBC, _ = _scan_forward(h_NBCD, unembed_DV, t_NBC, temperature)
    return logp_NBC, ent_NBC


def _chunked_fwd(h_NBCD, unembed_DV, t_NBC, temperature):
    if h_NBCD.shape[0] == 1:
        # One chunk: its logits are live here and again in the backward pass either way,
        # so they are kept rather than recomputed (a [B, C, D] x [D, V] product saved).
        z_BCV = _scaled_logits(h_NBCD[0], unembed_DV, temperature)
        logp_NBC, ent_NBC, lse_NBC = (x[None] for x in logprob_entropy_lse(z_BCV, t_NBC[0]))
        z_NBCV = z_BCV[None]
    else:
        z_NBCV = None
        logp_NBC, ent_NBC, lse_NBC = _scan_forward(h_NBCD, unembed_DV, t_NBC, temperature)
    return (logp_NBC, ent_NBC), (h_NBCD, unembed_DV, t_NBC, lse_NBC, ent_NBC, z_NBCV)


def _chunked_bwd(temperature, res, cotangents):
    """Recomputes each chunk's logits once (one chunk: keeps them from the forward pass)
    and applies the closed-form softmax gradients.

    With q = softmax(z): d logp / dz = onehot(target) - q and
    dH / dz = -q * (log q + H). Only one chunk's [B, C, V] buffers are live, and
    the [D, V] gradient is accumulated across chunks in fp32.
    """
    h_NBCD, unembed_DV, t_NBC, lse_NBC, ent_NBC, z_NBCV = res
    g_logp_NBC, g_ent_NBC = cotangents
    vocab = unembed_DV.shape[1]

    def body(dw_DV, xs):
        h_BCD, t_BC, lse_BC, ent_BC, gl_BC, ge_BC, *kept = xs
        z_BCV = kept[0] if kept else _scaled_logits(h_BCD, unembed_DV, temperature)
        logq_BCV = z_BCV - lse_BC[..., None]
        q_BCV = jnp.exp(logq_BCV)
        dz_BCV = -q_BCV * (gl_BC[..., None] + ge_BC[..., None] * (logq_BCV + ent_BC[..., None]))
        hit_BCV = jnp.arange(vocab, dtype=t_BC.dtype) == t_BC[..., None]
        dz_BCV = (dz_BCV + jnp.where(hit_BCV, gl_BC[..., None], 0.0)) / temperature
        dz_BCV = dz_BCV.astype(unembed_DV.dtype)
        dh_BCD = jnp.einsum("bcv,dv->bcd", dz_BCV, unembed_DV, preferred_element_type=jnp.float32)
        dw_DV = dw_DV + jnp.einsum("bcd,bcv->dv", h_BCD, dz_BCV, preferred_element_type=jnp.float32)
        return dw_DV, dh_BCD.astype(h_BCD.dtype)

    xs = (h_NBCD, t_NBC, lse_NBC, ent_NBC, g_logp_NBC, g_ent_NBC)
    if z_NBCV is not None:
        dw_DV, dh_BCD = body(
            jnp.zeros(unembed_DV.shape, jnp.float32), [x[0] for x in xs] + [z_NBCV[0]]
        )
        return dh_BCD[None], dw_DV.astype(unembed_DV.dtype), None
    dw_DV, dh_NBCD = jax.lax.scan(body, jnp.zeros(unembed_DV.shape, jnp.float32), xs)
    return dh_NBCD, dw_DV.astype(unembed_DV.dtype), None


_chunked_logp_entropy.defvjp(_chunked_fwd, _chunked_bwd)


def token_logprobs_and_entropy(
    hidden_BTD: jax.Array,
    unembed_DV: jax.Array,
    targets_BT: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    compute_dtype: jnp.dtype | str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of each target token and the full-vocabulary entropy, chunked over T.

    Logits are divided by the sampling temperature before both, as the sampler
    does. The sequence is cut into chunks of ``chunk_size`` positions and a
    ``lax.scan`` runs over them, so at most one chunk's [B, C, V] fp32 logits is
    live. The custom backward pass recomputes each chunk's logits (keeping only
    the [B, T] log-normaliser and entropy from the forward pass) and applies the
    closed-form softmax gradients, so peak memory scales with ``B * chunk_size * V``
    plus the [D, V] gradient, never with ``B * T * V``.

    Args:
      hidden_BTD: [B, T, D] final hidden states (after the final norm).
      unembed_DV: [D, V] unembedding matrix.
      targets_BT: [B, T] int token ids whose log-prob to take at each position.
      temperature: sampling temperature (> 0).
      chunk_size: positions per chunk; T is zero-padded up to a multiple.
      compute_dtype: dtype of the matmul inputs (e.g. bfloat16); accumulation and
        everything after the matmul is float32. None keeps the input dtypes.

    Returns:
      (logp_BT, ent_BT), both float32 [B, T]; differentiable with respect to
      ``hidden_BTD`` and ``unembed_DV``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if compute_dtype is not None:
        hidden_BTD = hidden_BTD.astype(compute_dtype)
        unembed_DV = unembed_DV.astype(compute_dtype)
    # one dtype for both matmul operands, so the custom backward's cotangents match
    dtype = jnp.promote_types(hidden_BTD.dtype, unembed_DV.dtype)
    hidden_BTD, unembed_DV = hidden_BTD.astype(dtype), unembed_DV.astype(dtype)
    B, T, D = hidden_BTD.shape
    C = min(chunk_size, T)
    n_chunks = math.ceil(T / C)
    pad = n_chunks * C - T
    if pad:
        hidden_BTD = jnp.pad(hidden_BTD, ((0, 0), (0, pad), (0, 0)))
        targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
    h_NBCD = hidden_BTD.reshape(B, n_chunks, C, D).swapaxes(0, 1)
    t_NBC = targets_BT.astype(jnp.int32).reshape(B, n_chunks, C).swapaxes(0, 1)
    logp_NBC, ent_NBC = _chunked_logp_entropy(h_NBCD, unembed_DV, t_NBC, float(temperature))
    logp_BT = logp_NBC.swapaxes(0, 1).reshape(B, n_chunks * C)[:, :T]
    ent_BT = ent_NBC.swapaxes(0, 1).reshape(B, n_chunks * C)[:, :T]
    return logp_BT, ent_BT
