"""The decoder's KV cache: preallocated slots per row, in a float dtype or int8 with a
scale per token and kv head (``quantize_kv``). Einsum letters as in ``qwen2.py``.

The cache is row-major with the kv heads before the slots, [B, L, K, S, H] (scales
[B, L, K, S]): a decode slot's keys (or values) of every layer are one contiguous
block, and a layer's keys of one kv head are an [S, H] matrix. A decode step's write
of each slot's new token is then a per-slot ``dynamic_update_slice`` that XLA does in
place; over a layer-major [L, B, ...] cache the same write is a scatter over slots
that the TPU compiler turns into whole-cache copies when a device holds one kv head
(``benchmarks/decode_cache_write.py``). With the heads before the slots the TPU
keeps one layout for the stored cache, a decode step's and the decode loop's carry
(with the slots before the heads the loop's carry took another and copied the cache
every step: ``tests/tpu_decode_test.py``), and the attention's products are batched
over (B, K) with no transpose. A layer is read at its index (``layer_slice``), or by
the decode kernels at a prefetched index without a slice.
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
      k: keys of every layer, [B, L, K, S, H].
      v: values of every layer, [B, L, K, S, H].
      pos: [B, S] int32 position of the token held in each slot, -1 if empty
        or padding (never attended).
      lengths: [B] int32 slots used so far; the next write starts there.
      k_scale, v_scale: for an int8 cache, the float32 scale of each stored key and
        value vector, [B, L, K, S] (one per token and kv head: ``k ~ k_int8 *
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
        shape = (batch, config.num_layers, config.num_kv_heads, max_len, config.head_size)
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
        """(k, v) as [L, B, K, S, H], for a scan over layers (a copy unless B is 1)."""
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


def layer_slice(x_BLKX: jax.Array | None, layer: jax.Array) -> jax.Array | None:
    """Layer ``layer`` (a traced index) of a cache array: [B, K, S, ...]."""
    if x_BLKX is None:
        return None
    return jax.lax.dynamic_index_in_dim(x_BLKX, layer, axis=1, keepdims=False)


def write_rows(buf_BS: jax.Array, new_BT: jax.Array, start_B: jax.Array, axis: int = 1):
    """Writes ``new_BT[b]`` into ``buf_BS[b]`` at index ``start_B[b]`` of ``axis`` (the
    slots: 1 for [B, S, ...], 2 for a layer's [B, K, S, H]); the other dims kept."""
    at = [0] * (buf_BS.ndim - 1)

    def one(b, n, s):
        at[axis - 1] = s
        return jax.lax.dynamic_update_slice(b, n, tuple(at))

    return jax.vmap(one)(buf_BS, new_BT.astype(buf_BS.dtype), start_B)


def write_slot(buf_BSX: jax.Array, new_BX: jax.Array, at_B: jax.Array, axis: int = 1):
    """Writes ``new_BX[b]`` at index ``at_B[b]`` of ``axis`` (the slots: 1 for [B, S, ...],
    2 for a layer's [B, K, S, H]) of row b (in place under donation)."""
    return write_rows(buf_BSX, jnp.expand_dims(new_BX, axis), at_B, axis)


def write_token(buf_BLKSX: jax.Array, new_LBKX: jax.Array, at_B: jax.Array) -> jax.Array:
    """Each slot's new token of every layer (``new_LBKX``, the decode scan's output) into
    the cache ([B, L, K, S, ...]) at slot ``at_B[b]``: a per-slot
    ``dynamic_update_slice`` of the slot's contiguous [L, K, S, ...] block, in place
    under donation."""
    zeros = (0,) * (buf_BLKSX.ndim - 4)
    return jax.vmap(
        lambda r, n, i: jax.lax.dynamic_update_slice(r, n[:, :, None], (0, 0, i, *zeros))
    )(buf_BLKSX, jnp.swapaxes(new_LBKX, 0, 1).astype(buf_BLKSX.dtype), at_B)
