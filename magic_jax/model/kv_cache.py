"""The decoder's KV cache: preallocated slots per row, in a float dtype or int8 with a
scale per token and kv head (``quantize_kv``). Einsum letters as in ``qwen2.py``.

The cache is slot-major, [B, L, S, K, H]: a decode slot's keys (or values) of every
layer are one contiguous block. A decode step's write of each slot's new token is
then a per-slot ``dynamic_update_slice`` that XLA does in place; over a layer-major
[L, B, S, K, H] cache the same write is a scatter over slots that the TPU compiler
turns into whole-cache copies when a device holds one kv head
(``benchmarks/decode_cache_write.py``). A layer is read at its index
(``layer_slice``), or by the decode kernels at a prefetched index without a slice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from magic_jax.model.config import ModelConfig

KV_DTYPES = (None, "int8")
# Largest magnitude of a quantized key or value: symmetric int8, -127..127.
_INT8_MAX = 127.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Preallocated key/value cache; each row (decode slot) advances on its own.

    Attributes:
      k: keys of every layer, [B, L, S, K, H] (slot-major).
      v: values of every layer, [B, L, S, K, H].
      pos: [B, S] int32 position of the token held in each slot, -1 if empty
        or padding (never attended).
      lengths: [B] int32 slots used so far; the next write starts there.
      k_scale, v_scale: for an int8 cache, the float32 scale of each stored key and
        value vector, [B, L, S, K] (one per token and kv head: ``k ~ k_int8 *
        k_scale``); None for a cache in a float dtype.
    """

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    lengths: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @classmethod
    def init(
        cls,
        config: ModelConfig,
        batch: int,
        max_len: int,
        dtype: Any = None,
        kv_dtype: str | None = None,
    ) -> KVCache:
        """An empty cache of ``max_len`` slots per row.

        ``dtype`` defaults to the compute dtype; ``kv_dtype="int8"`` stores int8
        keys and values with per-token-and-head scales instead.
        """
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        shape = (batch, config.num_layers, max_len, config.num_kv_heads, config.head_size)
        pos = jnp.full((batch, max_len), -1, jnp.int32)
        lengths = jnp.zeros((batch,), jnp.int32)
        if kv_dtype == "int8":
            scale = jnp.ones(shape[:-1], jnp.float32)
            zeros = jnp.zeros(shape, jnp.int8)
            return cls(k=zeros, v=zeros, pos=pos, lengths=lengths, k_scale=scale, v_scale=scale)
        dtype = jnp.dtype(dtype or config.dtype)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), pos=pos, lengths=lengths)

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def max_len(self) -> int:
        return self.pos.shape[1]

    @property
    def num_layers(self) -> int:
        return self.k.shape[1]

    def layers_first(self) -> tuple[jax.Array, ...]:
        """(k, v) as [L, B, S, K, H], for a scan over layers (a copy unless B is 1)."""
        return tuple(jnp.moveaxis(x, 1, 0) for x in (self.k, self.v))

    def next_positions(self) -> jax.Array:
        """[B] the position the next real token of each row takes."""
        return jnp.sum(self.pos >= 0, axis=1).astype(jnp.int32)


def quantize_kv(x_XH: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 quantization of key or value vectors over their last axis (H).

    Returns (int8 values [..., H], float32 scales [...]) with ``x ~ q * scale``;
    each vector's largest magnitude maps to 127, so the rounding error of an
    element is at most ``max|x| / 254``. An all-zero vector gets scale 1.
    """
    x32 = x_XH.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1)
    scale = jnp.where(amax > 0, amax / _INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(x32 / scale[..., None]), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
    return q, scale


def layer_slice(x_BLSX: jax.Array | None, layer: jax.Array) -> jax.Array | None:
    """Layer ``layer`` (a traced index) of a slot-major cache array: [B, S, ...]."""
    if x_BLSX is None:
        return None
    return jax.lax.dynamic_index_in_dim(x_BLSX, layer, axis=1, keepdims=False)


def write_rows(buf_BS: jax.Array, new_BT: jax.Array, start_B: jax.Array) -> jax.Array:
    """Writes ``new_BT[b]`` into ``buf_BS[b]`` at slot ``start_B[b]`` (trailing dims kept)."""
    zeros = (0,) * (buf_BS.ndim - 2)
    return jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice(b, n, (s, *zeros)))(
        buf_BS, new_BT.astype(buf_BS.dtype), start_B
    )


def write_slot(buf_BSX: jax.Array, new_BX: jax.Array, at_B: jax.Array) -> jax.Array:
    """Writes ``new_BX[b]`` at slot ``at_B[b]`` of row b (in place under donation)."""
    zeros = (0,) * (buf_BSX.ndim - 2)
    return jax.vmap(lambda r, n, i: jax.lax.dynamic_update_slice(r, n[None], (i, *zeros)))(
        buf_BSX, new_BX.astype(buf_BSX.dtype), at_B
    )


def write_token(buf_BLSX: jax.Array, new_LBX: jax.Array, at_B: jax.Array) -> jax.Array:
    """Each slot's new token of every layer (``new_LBX``, the decode scan's output) into
    the slot-major cache at slot ``at_B[b]``: a per-slot ``dynamic_update_slice`` of
    the slot's contiguous [L, S, ...] block, in place under donation."""
    zeros = (0,) * (buf_BLSX.ndim - 3)
    return jax.vmap(lambda r, n, i: jax.lax.dynamic_update_slice(r, n[:, None], (0, i, *zeros)))(
        buf_BLSX, jnp.swapaxes(new_LBX, 0, 1).astype(buf_BLSX.dtype), at_B
    )
