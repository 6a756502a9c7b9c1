"""The update's and the decode step's flops counted by hand from the model's shapes (XLA's
cost analysis counts a loop body once; the plan takes the larger of the two)."""

from __future__ import annotations

from typing import Any


def matmul_params(model_config: Any) -> int:
    """Parameters a token's forward multiplies by (the input embedding is a lookup; tied,
    it is also the unembedding)."""
    embed = 0 if model_config.tie_word_embeddings else model_config.vocab_size
    return model_config.num_params() - embed * model_config.hidden_size


def attention_flops(model_config: Any, queries: int, keys: int) -> float:
    """Forward flops of one sequence's attention products (q.k and p.v, every layer) for
    ``queries`` x ``keys`` scores computed, masked or not."""
    heads = model_config.num_heads * model_config.head_size
    return 4.0 * model_config.num_layers * heads * queries * keys


def update_row_flops(
    model_config: Any, length: int, remat: str, chunk: int, attention: str = "dense"
) -> float:
    """Flops of one row (or packed bin) of ``length`` slots through the update: forward and
    backward (3 forwards' worth), one more forward with ``remat: full`` (each layer runs
    again in the backward), and the attention's scores. ``dense`` (``attention``, the
    model's ``attention``): every query against every key, L^2, its query chunks
    (``attention_chunk`` < L) checkpointed and so run forward once more. ``splash``:
    the kernel's tiles on and below the diagonal (``splash.causal_tiles``, about L^2 / 2:
    a row holding one sequence of L, as a padded row with every response at T; a packed
    bin of several runs fewer, the tiles between them skipped), and its backward's dq and
    dkv kernels each compute the scores and dp again: 1.5 forwards more."""
    from magic_jax.model.splash import causal_tiles  # jax: imported when a plan counts

    passes = 4.0 if remat == "full" else 3.0
    linear = 2.0 * matmul_params(model_config) * length
    if attention == "dense":
        attn = passes + (1.0 if chunk and length > chunk else 0.0)
        return passes * linear + attn * attention_flops(model_config, length, length)
    return passes * linear + (passes + 1.5) * attention_flops(model_config, causal_tiles(length), 1)


def decode_step_flops(model_config: Any, slots: int, cache_length: int) -> float:
    """Flops of one decode step over ``slots`` rows attending to ``cache_length`` keys each
    (all devices together)."""
    per_row = 2.0 * matmul_params(model_config) + attention_flops(model_config, 1, cache_length)
    return slots * per_row
