"""The model's attention over a sequence by splash attention, JAX's block-sparse Pallas TPU
kernel (``ModelConfig.attention``): causal, with segment ids for packed rows.

The dense path (``qwen2.sequence_attention``) computes every query block against every
key of the row and masks the scores. Splash attention runs a grid of (query tile, key
tile) pairs; its tile tables, built here at run time from each row's segment ids
(``running_tiles``), skip the pairs above the diagonal and those between two sequences
of a packed row (or padding), and the causal and segment masks apply inside the tiles
that run. Its forward keeps only the output and each query's log-sum-exp, and its
backward recomputes the scores tile by tile, so no [T, S] score array exists in HBM.

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
# The first padding id: above any segment's (a mini-batch's rows at most).
_PADDING = 2**30


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


def _causal(q_ids, kv_ids):
    """The kernel's mask inside a tile it runs (with the segment ids): causal."""
    return q_ids >= kv_ids


def _next_running(run, axis: int):
    """For each grid step along ``axis`` of the [query tile, key tile] table ``run``: the
    next running tile's index at or after it, else the last running one before it, so
    that a skipped step fetches a tile the grid reads anyway (no new copy)."""
    n = run.shape[axis]
    idx = jnp.arange(n, dtype=jnp.int32).reshape((n, 1) if axis == 0 else (1, n))
    ahead = jax.lax.cummin(jnp.where(run, idx, n), axis=axis, reverse=True)
    behind = jax.lax.cummax(jnp.where(run, idx, -1), axis=axis)
    return jnp.where(ahead < n, ahead, behind)


def running_tiles(seg_T: jax.Array, block: int) -> jax.Array:
    """[n, n] bool: which (query tile, key tile) pairs of a row the kernel runs, from its
    segment ids ``seg_T`` ([n * block] int32; each padding slot an id of its own): those
    on and below the diagonal whose tiles' id ranges meet. A packed row's ids ascend, so
    these are exactly the pairs holding a query and a key of one segment: the tiles
    between two sequences are skipped too, not only those above the diagonal. The
    diagonal always runs (every query sees itself)."""
    n = seg_T.shape[0] // block
    tiles = seg_T.reshape(n, block)
    lo, hi = tiles.min(axis=1), tiles.max(axis=1)
    idx = jnp.arange(n)
    below = idx[None, :] <= idx[:, None]
    return below & (lo[:, None] <= hi[None, :]) & (lo[None, :] <= hi[:, None])


def _row_kernel(seg_T, block: int, interpret: bool):
    """The splash kernel for one row of segment ids ``seg_T``, its tile tables built at run
    time (``running_tiles``; JAX's static ``CausalMask`` tables would run every tile
    below the diagonal, the segment ids masking inside them)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import BlockSizes
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info import (
        MaskInfo,
    )

    n = seg_T.shape[0] // block
    run = running_tiles(seg_T, block)
    # the tables live in the core's scalar memory: the smallest integer type that holds n
    small = jnp.int8 if n <= 127 else jnp.int16
    mask = run.astype(jnp.int8)[None]  # 1: run, masked inside (causal and segments)
    q_sequence = jnp.arange(seg_T.shape[0], dtype=jnp.int32)

    def info(data_next):
        return MaskInfo(
            data_next=data_next.astype(small)[None],
            mask_next=None,
            block_mask=mask,
            partial_mask_blocks=None,
            q_sequence=q_sequence,
        )

    fwd = info(_next_running(run, 1))  # the forward's and dq's grid walks key tiles
    dkv = info(_next_running(run, 0))  # dkv's walks query tiles
    b = block
    # separate dq and dkv kernels: the fused backward keeps a dq per key tile
    sizes = BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        block_q_dq=b,
        block_kv_dq=b,
    )
    return sk.SplashAttentionKernel(
        fwd,
        fwd,
        dkv,
        block_sizes=sizes,
        is_mqa=False,
        save_residuals=False,
        mask_value=sk.DEFAULT_MASK_VALUE,
        attn_logits_soft_cap=None,
        residual_checkpoint_name=None,
        mask_function=_causal,
        interpret=interpret,
    )


def _rows(q_BNTH, k_BKTH, v_BKTH, seg_BT, *, block: int, interpret: bool):
    """The kernel over the rows (and heads) one device holds."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    def one(q_NTH, k_KTH, v_KTH, seg_T):
        kernel = _row_kernel(seg_T, block, interpret)
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
      segments_BT: [B, T] int32: a query sees the keys at or before it with its id (> 0);
        a slot of id <= 0 is padding and sees only itself (as in the dense mask).
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
    if pad:
        q_BNTH, k_BKTH, v_BKTH = (
            jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q_BNTH, k_BKTH, v_BKTH)
        )
    seg_BT = jnp.pad(segments_BT.astype(jnp.int32), ((0, 0), (0, pad)))
    # a padding slot (id <= 0, and those added here) is a segment of its own that sees only
    # itself, as in the dense mask: ids above every sequence's, ascending, so that a packed
    # row's ids ascend throughout and its padding's tiles run only on the diagonal
    slot_T = jnp.arange(t + pad, dtype=jnp.int32)
    seg_BT = jnp.where(seg_BT > 0, seg_BT, _PADDING + slot_T)
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
