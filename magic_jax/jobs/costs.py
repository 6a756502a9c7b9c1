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


def update_row_flops(model_config: Any, length: int, remat: str, chunk: int) -> float:
    """Flops of one row (or packed bin) of ``length`` slots through the update: forward and
    backward (3 forwards' worth), one more forward with ``remat: full`` (each layer runs
    again in the backward), and the attention's dense masked L^2 scores, whose query
    chunks (``attention_chunk`` < L) are checkpointed and so run forward once more."""
    passes = 4.0 if remat == "full" else 3.0
    attn = passes + (1.0 if chunk and length > chunk else 0.0)
    linear = 2.0 * matmul_params(model_config) * length
    return passes * linear + attn * attention_flops(model_config, length, length)


def decode_step_flops(model_config: Any, slots: int, cache_length: int) -> float:
    """Flops of one decode step over ``slots`` rows attending to ``cache_length`` keys each
    (all devices together)."""
    per_row = 2.0 * matmul_params(model_config) + attention_flops(model_config, 1, cache_length)
    return slots * per_row
