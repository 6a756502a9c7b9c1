"""The model's attention over a sequence by splash attention, JAX's block-sparse Pallas TPU
kernel (``ModelConfig.attention``): causal, with segment ids for packed rows.

The dense path (``qwen2.sequence_attention``) computes every query block against every
key of the row and masks the scores. Splash attention runs a grid of (query block, key
block) tiles and skips the tiles above the diagonal (its mask is static: ``CausalMask``);
segment ids (a packed row's sequences, or the padding of an unpacked row) are applied
inside the tiles it runs. Its forward keeps only the output and each query's
log-sum-exp, and its backward recomputes the scores tile by tile, so no [T, S] score
array exists in HBM at any length.

Grouped-query attention runs as the kernel's multi-head form: query head n reads kv
head n // G (the queries' [K, G] heads in order), so the K keys and values are never
repeated. The kernel works on one row on one device; rows are vmapped, and under a mesh
it runs per device on its rows and kv heads (``shard_map``, the heads split as the
``kv_heads`` rule of ``sharding.TRAIN_RULES`` says when they divide evenly).
Einsum letters as in ``qwen2.py``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from magic_jax.model.sharding import TRAIN_RULES

# The kernel's query and key tile; a row is padded up to a multiple of it (of 128, the
# TPU's lane width, for a row shorter than a tile).
BLOCK = 512
_LANES = 128


def tile(length: int, block: int = BLOCK) -> int:
    """The tile the kernel runs a row of ``length`` slots with: ``block``, or ``length``
    rounded up to a multiple of 128 when that is shorter."""
    return min(block, -(-length // _LANES) * _LANES)


def causal_tiles(length: int, block: int = BLOCK) -> int:
    """Score entries the kernel computes for one head of a row of ``length`` slots: the
    tiles on and below the diagonal of the padded row, n (n + 1) / 2 tiles of b x b."""
    b = tile(length, block)
    n = -(-length // b)
    return b * b * n * (n + 1) // 2


@functools.lru_cache(maxsize=16)
def _kernel(heads: int, length: int, block: int, interpret: bool):
    """The splash kernel for ``heads`` query heads over rows of ``length`` slots (cached:
    the mask's tile tables take seconds to build at 32K slots, once per shape)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    mask = sa.MultiHeadMask([sa.CausalMask((length, length))] * heads)
    b = block
    sizes = sa.BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        # separate dq and dkv kernels: the fused backward keeps a dq per key tile
        block_q_dq=b,
        block_kv_dq=b,
    )
    # built once, outside any trace: its tile tables are constants, not the trace's values
    with jax.ensure_compile_time_eval():
        return sa.make_splash_mha(
            mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
        )


def _rows(q_BNTH, k_BKTH, v_BKTH, seg_BT, *, block: int, interpret: bool):
    """The kernel over the rows (and heads) one device holds."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    kernel = _kernel(q_BNTH.shape[1], q_BNTH.shape[2], block, interpret)

    def one(q_NTH, k_KTH, v_KTH, seg_T):
        return kernel(q_NTH, k_KTH, v_KTH, segment_ids=SegmentIds(q=seg_T, kv=seg_T))

    return jax.vmap(one)(q_BNTH, k_BKTH, v_BKTH, seg_BT)


def _dividing(mesh, axes: Any, size: int) -> Any:
    """``axes`` (a PartitionSpec entry) when their devices divide ``size``, else None."""
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    n = math.prod(mesh.shape[a] for a in names)
    return axes if names and size % n == 0 else None


def _head_axes(mesh) -> Any:
    """The mesh axes the kv heads are split over (``TRAIN_RULES``' ``kv_heads``), those
    of ``mesh`` only; None when it has none."""
    target = dict(TRAIN_RULES)["kv_heads"]
    names = (target,) if isinstance(target, str) else tuple(target or ())
    names = tuple(a for a in names if a in mesh.axis_names)
    return None if not names else names[0] if len(names) == 1 else names


def splash_attention(
    q_BTKGH: jax.Array,
    k_BTKH: jax.Array,
    v_BTKH: jax.Array,
    segments_BT: jax.Array,
    *,
    row_sharding: NamedSharding | None = None,
    interpret: bool = False,
    block: int = BLOCK,
) -> jax.Array:
    """Causal softmax(q k^T / sqrt(H)) v within each segment, by the splash kernel.

    Args:
      q_BTKGH: [B, T, K, G, H] queries (G query heads share each of the K kv heads).
      k_BTKH / v_BTKH: [B, T, K, H] keys and values of the same T slots.
      segments_BT: [B, T] int32: a query sees the keys at or before it with its id.
      row_sharding: the rows' sharding (its first entry splits the rows); the kernel
        runs per device under its mesh. None: one device (or XLA gathers the operands).
      interpret: run the kernel's program in Pallas's interpreter (any platform).
      block: the query and key tile (``tile``); T is padded up to a multiple of it.

    Returns:
      [B, T, K, G, H] in ``q``'s dtype.
    """
    b, t, kh, g, h = q_BTKGH.shape
    blk = tile(t, block)
    pad = -(-t // blk) * blk - t
    # the kernel takes no scale: the queries carry 1 / sqrt(H), applied in float32
    q = (q_BTKGH.astype(jnp.float32) * h**-0.5).astype(q_BTKGH.dtype)
    q_BNTH = q.transpose(0, 2, 3, 1, 4).reshape(b, kh * g, t, h)
    k_BKTH, v_BKTH = (x.transpose(0, 2, 1, 3).astype(q.dtype) for x in (k_BTKH, v_BTKH))
    seg_BT = segments_BT.astype(jnp.int32)
    if pad:
        # padded slots: a segment of their own (-1), after every real slot
        q_BNTH, k_BKTH, v_BKTH = (
            jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q_BNTH, k_BKTH, v_BKTH)
        )
        seg_BT = jnp.pad(seg_BT, ((0, 0), (0, pad)), constant_values=-1)
    fn = functools.partial(_rows, block=blk, interpret=interpret)
    if row_sharding is not None:
        mesh = row_sharding.mesh
        first = row_sharding.spec[0] if row_sharding.spec else None
        rows = _dividing(mesh, first, b)
        heads = _dividing(mesh, _head_axes(mesh), kh)
        fn = jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=(PartitionSpec(rows, heads),) * 3 + (PartitionSpec(rows),),
            out_specs=PartitionSpec(rows, heads),
            check_vma=False,
        )
    out_BNTH = fn(q_BNTH, k_BKTH, v_BKTH, seg_BT)[:, :, :t]
    return out_BNTH.reshape(b, kh, g, t, h).transpose(0, 3, 1, 2, 4)


def check_platform(attention: str, row_sharding: NamedSharding | None) -> None:
    """Raises a ValueError naming the option when ``attention`` is ``splash`` and the
    forward runs (on ``row_sharding``'s devices, else jax's default backend) where the
    Mosaic kernel cannot: anywhere but TPU."""
    if attention != "splash":
        return
    if row_sharding is not None:
        platform = row_sharding.mesh.devices.flat[0].platform
    else:
        platform = jax.default_backend()
    if platform != "tpu":
        raise ValueError(
            f"ModelConfig.attention (update.attention) 'splash' runs a TPU kernel; this "
            f"forward runs on {platform}: use 'dense' there (or 'splash-interpret', the "
            f"kernel in Pallas's interpreter, slow)"
        )


def splash_attend(
    attention: str, segments_BT: jax.Array, row_sharding: NamedSharding | None = None
):
    """``Attention``'s ``attend`` for a forward without a cache under ``attention``
    (``splash`` or ``splash-interpret``): ``(q, k, v) -> (out, (k, v))``.

    Raises:
      ValueError: ``splash`` off TPU (``check_platform``).
    """
    check_platform(attention, row_sharding)
    interpret = attention == "splash-interpret"

    def attend(q_BTKGH, k_BTKH, v_BTKH):
        out = splash_attention(
            q_BTKGH,
            k_BTKH,
            v_BTKH,
            segments_BT,
            row_sharding=row_sharding,
            interpret=interpret,
        )
        return out, (k_BTKH, v_BTKH)

    return attend
