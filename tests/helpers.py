"""What only the tests use: tiny models and data, tolerances, reference implementations."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from magic_jax.data.tasks.vocab import char_tokenizer
from magic_jax.model.logprobs import logprob_entropy_lse
from magic_jax.testing import make_hf_model, save_hf_model


def token_logprobs_and_entropy_naive(
    hidden_BTD: jax.Array,
    unembed_DV: jax.Array,
    targets_BT: jax.Array,
    *,
    temperature: float = 1.0,
    compute_dtype: jnp.dtype | str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``model.logprobs.token_logprobs_and_entropy`` without chunks: the full [B, T, V]
    logits are materialised, and autodiff gives the backward pass."""
    if compute_dtype is not None:
        hidden_BTD = hidden_BTD.astype(compute_dtype)
        unembed_DV = unembed_DV.astype(compute_dtype)
    logits_BTV = jnp.einsum(
        "btd,dv->btv", hidden_BTD, unembed_DV, preferred_element_type=jnp.float32
    )
    logp_BT, ent_BT, _ = logprob_entropy_lse(logits_BTV / temperature, targets_BT)
    return logp_BT, ent_BT


def dequantize_kv(q_XH: jax.Array, scale_X: jax.Array, dtype: Any) -> jax.Array:
    """The inverse of ``model.kv_cache.quantize_kv``, in ``dtype``."""
    return (q_XH.astype(jnp.float32) * scale_X[..., None]).astype(dtype)


TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # grouped-query attention, untied, as the R1-Distill checkpoints
    "gqa_untied": dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    # multi-head attention, tied embeddings, other rope theta
    "mha_tied": dict(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    # explicit head_dim larger than hidden/heads, single kv head
    "wide_heads": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        rope_theta=5e5,
        tie_word_embeddings=False,
    ),
}


def torch_logits(model: Any, input_ids: Any, attention_mask: Any = None):
    """Logits [B, T, V] as a float32 numpy array from a torch model."""
    import torch

    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    kw = {}
    if attention_mask is not None:
        mask = torch.as_tensor(np.asarray(attention_mask), dtype=torch.long)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        kw = {"attention_mask": mask, "position_ids": pos}
    with torch.no_grad():
        return model(ids, **kw).logits.float().numpy()


def make_char_tokenizer(
    chars: str = "abcdefghijklmnopqrstuvwxyz0123456789 +-*/=?.,()\n\\{}$^_", **kw: Any
):
    """A character-level tokenizer with the R1-Distill markers (see ``tasks.vocab``)."""
    return char_tokenizer(chars, **kw)


# The vocabulary of one-digit sums: a random policy hits the gold answer often enough
# that groups with mixed rewards (which train) occur in every short run.
SUMS_CHARS = "0123+= "


def save_sums_model(path: str | os.PathLike, seed: int = 0) -> Path:
    """A tiny tied Qwen2 (d 32, 2 layers, 4 / 2 heads) with the sums tokenizer, saved at ``path``.

    The run, eval and difficulty tests train or sample it on one-digit sums.
    """
    tok = make_char_tokenizer(chars=SUMS_CHARS)
    hf = make_hf_model(
        seed=seed,
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    out = save_hf_model(hf, path)
    tok.save_pretrained(out)
    return out


def sums_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` verl rows asking one-digit sums ``a+b=`` (a, b in {0, 1}) with their gold answers."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(0, 2, 2))
        rows.append(
            {
                "data_source": "sums",
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "ability": "math",
                "reward_model": {"ground_truth": str(a + b), "style": "rule"},
                "extra_info": {"index": i},
            }
        )
    return rows


# float32's unit roundoff: two programs that sum the same terms in another order (another
# processor, thread count, fusion or micro-batch split) agree to about this many ulps per term.
F32_EPS = 2.0**-23


def assert_fp32_close(
    actual: Any, desired: Any, *, terms: int, rtol: float = 1e-5, err_msg: str = ""
) -> None:
    """Asserts two float32 results agree up to the rounding of a reordered sum.

    A reduction of ``terms`` float32 terms summed in another order can differ by
    about ``terms * eps * max|term|``; the largest magnitude compared stands in
    for the terms' (a gradient's entries are sums of terms of that size). So the
    absolute tolerance is ``4 * eps * terms * max(|desired|)``: it scales with
    what is compared and with the reduction length, never a fixed 1e-7. ``rtol``
    still bounds each entry relative to itself. Works on arrays and pytrees
    (the scale is taken per leaf).

    Args:
      actual, desired: arrays, scalars or pytrees of them with the same structure.
      terms: the longest reduction behind the values (e.g. tokens x layers).
      rtol: relative tolerance per entry.
      err_msg: shown on failure.
    """
    a_leaves, d_leaves = jax.tree.leaves(actual), jax.tree.leaves(desired)
    assert len(a_leaves) == len(d_leaves), f"{err_msg}: {len(a_leaves)} vs {len(d_leaves)} leaves"
    for i, (a, d) in enumerate(zip(a_leaves, d_leaves)):
        a, d = np.asarray(a, np.float64), np.asarray(d, np.float64)
        scale = float(np.max(np.abs(d))) if d.size else 0.0
        atol = 4 * F32_EPS * max(terms, 1) * scale
        np.testing.assert_allclose(a, d, rtol=rtol, atol=atol, err_msg=f"{err_msg} (leaf {i})")


def reference_past(q_BKGH, k_BSKH, v_BSKH, lengths_B):
    """``rollout.ragged_attention.past_attention`` in plain jnp over one layer's
    [B, S, K, H]: (out [B, K, G, H] fp32, lse [B, K, G] fp32).

    ``out`` is normalized over the slots ``[0, length)``; a row of length 0 gets
    out 0 and lse -inf.
    """
    h = q_BKGH.shape[-1]
    dt = k_BSKH.dtype
    s_BKGS = jnp.einsum(
        "bkgh,bskh->bkgs", q_BKGH.astype(dt), k_BSKH, preferred_element_type=jnp.float32
    ) * (h**-0.5)
    held_BS = jnp.arange(k_BSKH.shape[1])[None] < lengths_B[:, None]
    s_BKGS = jnp.where(held_BS[:, None, None], s_BKGS, -jnp.inf)
    m_BKG = jnp.max(s_BKGS, axis=-1)
    safe_m = jnp.where(jnp.isfinite(m_BKG), m_BKG, 0.0)
    p_BKGS = jnp.exp(s_BKGS - safe_m[..., None])
    l_BKG = jnp.sum(p_BKGS, axis=-1)
    acc_BKGH = jnp.einsum(
        "bkgs,bskh->bkgh", p_BKGS.astype(dt), v_BSKH, preferred_element_type=jnp.float32
    )
    held = l_BKG > 0
    safe = jnp.where(held, l_BKG, 1.0)
    return acc_BKGH / safe[..., None], jnp.where(held, safe_m + jnp.log(safe), -jnp.inf)
