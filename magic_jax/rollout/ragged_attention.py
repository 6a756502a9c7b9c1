"""Decode attention that reads only the cache slots each row holds.

A decode step's query attends to a row's past keys ``[0, length)`` and to the token
it is writing now. The dense path (``decode.decode_attention``) reads every slot of
the attended cache and masks what a row does not hold; the kernels here read, per
row, only the blocks below its length:

- TPU (Mosaic): a flash-decoding grid (rows, key blocks). The key/value block index
  of a row stops at its last held block, so the pipeline fetches nothing past it,
  and the blocks past it run no compute. The lengths are prefetched to SMEM.
- GPU (Triton): one program per (row, kv head) loops over the blocks below its
  length.
- ``interpret``: the TPU kernel's program run by Pallas's interpreter (CPU tests).

An int8 cache (``kv_cache.quantize_kv``) runs the TPU kernel (and its interpreted
program): it reads int8 key and value blocks with their per-token scales and folds the
scales into the products (each score times its key's scale, each probability times its
value's scale before the value product), so no dequantized copy of the cache is made.

Every kernel reads the cache as the engine stores it, the whole [B, L, K, S, H] array
and [B, L, K, S] scales (``kv_cache.KVCache``), at a layer index given at run time (on
TPU a prefetched scalar of the block index, on GPU an offset into the block): no layer
is sliced out of it. A TPU block is a row's [K, bs, H] keys (a kv head's [bs, H] slots
a tile row) and [K, bs] scales (a lane-dense row per head), as the TPU lays out the
stored arrays, so the compiled decode step and loop hold no copy of the cache
(``tests/tpu_decode_test.py`` counts them). Every kernel returns the past's attention
with its log-sum-exp; ``merge_new_token`` adds the new token, so the cache is never
rewritten before it is read (the dense path writes the token into a copy of the
layer's cache first).
Einsum letters as in ``qwen2.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

BACKENDS = ("tpu", "gpu", "interpret")
# A ``PartitionSpec`` entry: one mesh axis, several, or none.
AxisEntry = str | tuple[str, ...] | None
# Key-block sizes tried, largest first: the block must divide the attended length.
_BLOCKS = (128, 64, 32, 16)
# An int8 cache's block: 128 slots (a lane row of its scales), or the whole attended
# length when that is below 128 (a block of int8 rows holds a multiple of 32 slots).
_INT8_BLOCK, _INT8_ROWS = 128, 32


@dataclasses.dataclass(frozen=True)
class RaggedSpec:
    """Static settings of the kernel path (hashable: part of the compile key).

    Attributes:
      backend: ``"tpu"``, ``"gpu"`` or ``"interpret"`` (the TPU kernel interpreted).
      mesh: the mesh the cache is split over (None: one device). The kernel runs per
        device on its rows and kv heads (``shard_map``): it holds no collective.
      row_axes / head_axes: the mesh axes of the cache's rows and kv heads (a
        ``PartitionSpec`` entry each).
    """

    backend: str
    mesh: Mesh | None = None
    row_axes: AxisEntry = None
    head_axes: AxisEntry = None

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"RaggedSpec.backend must be one of {BACKENDS}, got {self.backend!r}")


def block_size(s: int, quantized: bool = False) -> int | None:
    """The key-block size for an attended length ``s`` (of an int8 cache if ``quantized``),
    or None when no block divides it."""
    if quantized:
        if s % _INT8_BLOCK == 0:
            return _INT8_BLOCK
        return s if s < _INT8_BLOCK and s % _INT8_ROWS == 0 else None
    return next((b for b in _BLOCKS if s % b == 0), None)


def applies(spec: RaggedSpec | None, *, quantized: bool, sliding: bool, length: int) -> bool:
    """Whether a decode step runs the kernel: no sliding-window layers, an attended
    ``length`` its blocks divide, and a float cache or an int8 one on the TPU kernel (not
    the GPU's); else the dense product runs."""
    if spec is None or sliding or (quantized and spec.backend == "gpu"):
        return False
    return block_size(length, quantized) is not None


def _finish(acc, m, denom):
    """(acc / denom, m + log denom) with a row that held nothing giving (0, -inf)."""
    held = denom > 0
    safe = jnp.where(held, denom, 1.0)
    return acc / safe[..., None], jnp.where(held, m + jnp.log(safe), -jnp.inf)


def merge_new_token(out_BKGH, lse_BKG, q_BKGH, k_BKH, v_BKH):
    """Attention over the past (``out``, ``lse``) and the new token's key and value."""
    h = q_BKGH.shape[-1]
    s_BKG = jnp.einsum("bkgh,bkh->bkg", q_BKGH.astype(jnp.float32), k_BKH.astype(jnp.float32)) * (
        h**-0.5
    )
    m_BKG = jnp.maximum(lse_BKG, s_BKG)  # finite: the new token's score is
    w_past, w_new = jnp.exp(lse_BKG - m_BKG), jnp.exp(s_BKG - m_BKG)
    num = w_past[..., None] * out_BKGH + w_new[..., None] * v_BKH[:, :, None].astype(jnp.float32)
    return num / (w_past + w_new)[..., None]


def _tpu_kernel(lay_ref, len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, bs):
    from jax.experimental import pallas as pl

    del lay_ref  # used by the index maps only
    b, j = pl.program_id(0), pl.program_id(1)
    n = len_ref[b]

    _tpu_init(j, m_sc, l_sc, acc_sc)

    @pl.when(j * bs < n)
    def _block():
        for kh in range(q_ref.shape[0]):  # static: a kv head's query group against its keys
            s_GS = _dot_t(q_ref[kh].astype(k_ref.dtype), k_ref[kh])
            v_SH = v_ref[kh]
            _online_softmax(
                kh,
                s_GS * q_ref.shape[-1] ** -0.5,
                lambda p_GS, v_SH=v_SH: _dot(p_GS.astype(v_SH.dtype), v_SH),
                j * bs,
                n,
                m_sc,
                l_sc,
                acc_sc,
            )

    _tpu_out(o_ref, lse_ref, m_sc, l_sc, acc_sc)


def _tpu_int8_kernel(
    lay_ref,
    len_ref,
    q_ref,
    k_ref,
    v_ref,
    ks_ref,
    vs_ref,
    o_ref,
    lse_ref,
    m_sc,
    l_sc,
    acc_sc,
    *,
    bs,
):
    """``_tpu_kernel`` over [K, bs, H] int8 blocks and their [K, bs] scales: the int8
    values enter the dots in the query's dtype; each score is multiplied by its key's
    scale and each probability by its value's scale (``decode.decode_attention``'s way)."""
    from jax.experimental import pallas as pl

    del lay_ref  # used by the index maps only
    b, j = pl.program_id(0), pl.program_id(1)
    n = len_ref[b]
    _tpu_init(j, m_sc, l_sc, acc_sc)

    @pl.when(j * bs < n)
    def _block():
        dt = q_ref.dtype
        for kh in range(q_ref.shape[0]):
            # int8 -> float32 -> the compute dtype: a convert every TPU generation has
            k_SH, v_SH = (r[kh].astype(jnp.float32).astype(dt) for r in (k_ref, v_ref))
            s_GS = _dot_t(q_ref[kh], k_SH) * (ks_ref[kh : kh + 1, :] * q_ref.shape[-1] ** -0.5)
            vs_1S = vs_ref[kh : kh + 1, :]
            _online_softmax(
                kh,
                s_GS,
                lambda p_GS, v_SH=v_SH, vs_1S=vs_1S: _dot((p_GS * vs_1S).astype(dt), v_SH),
                j * bs,
                n,
                m_sc,
                l_sc,
                acc_sc,
            )

    _tpu_out(o_ref, lse_ref, m_sc, l_sc, acc_sc)


def _dot_t(a_GH, b_SH):
    """a . b^T in float32: [G, S]."""
    dims = (((1,), (1,)), ((), ()))
    return jax.lax.dot_general(a_GH, b_SH, dims, preferred_element_type=jnp.float32)


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _tpu_init(j, m_sc, l_sc, acc_sc):
    from jax.experimental import pallas as pl

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)


def _online_softmax(kh, s_GS, pv, start, n, m_sc, l_sc, acc_sc):
    """Kv head ``kh``'s scores of the block at slot ``start`` (slots from ``n`` on masked)
    into its running max, sum and output; ``pv(p_GS)`` is the block's value product."""
    slot = start + jax.lax.broadcasted_iota(jnp.int32, s_GS.shape, 1)
    s_GS = jnp.where(slot < n, s_GS, -jnp.inf)
    m_prev = m_sc[kh]
    m_new = jnp.maximum(m_prev, jnp.max(s_GS, axis=1, keepdims=True))
    p_GS = jnp.exp(s_GS - m_new)
    corr = jnp.exp(m_prev - m_new)
    l_sc[kh] = corr * l_sc[kh] + jnp.sum(p_GS, axis=1, keepdims=True)
    acc_sc[kh] = corr * acc_sc[kh] + pv(p_GS)
    m_sc[kh] = m_new


def _tpu_out(o_ref, lse_ref, m_sc, l_sc, acc_sc):
    from jax.experimental import pallas as pl

    @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)
    def _out():
        out, lse = _finish(acc_sc[...], m_sc[...][..., 0], l_sc[...][..., 0])
        o_ref[...] = out
        lse_ref[...] = lse[..., None]


def _tpu_past(q_BKGH, k_BLKSH, v_BLKSH, layer, lengths_B, *, interpret: bool):
    b, k, _, h = q_BKGH.shape
    s = k_BLKSH.shape[3]
    bs = block_size(s)
    itemsize = k_BLKSH.dtype.itemsize
    return _tpu_call(
        functools.partial(_tpu_kernel, bs=bs),
        q_BKGH,
        (k_BLKSH, v_BLKSH),
        (),
        layer,
        lengths_B,
        bs=bs,
        interpret=interpret,
        name="ragged_decode_attention",
        # What XLA's cost analysis counts for the kernel: the layer's whole attended
        # cache (an upper bound: rows read only their held blocks).
        kv_bytes=2 * b * s * k * h * itemsize,
    )


def _tpu_int8_past(q_BKGH, k_BLKSH, v_BLKSH, ks_BLKS, vs_BLKS, layer, lengths_B, *, interpret):
    b, k, _, h = q_BKGH.shape
    s = k_BLKSH.shape[3]
    bs = block_size(s, quantized=True)
    return _tpu_call(
        functools.partial(_tpu_int8_kernel, bs=bs),
        q_BKGH,
        (k_BLKSH, v_BLKSH),
        (ks_BLKS, vs_BLKS),
        layer,
        lengths_B,
        bs=bs,
        interpret=interpret,
        name="ragged_decode_attention_int8",
        kv_bytes=2 * b * s * k * (h + 4),  # int8 values and fp32 scales
    )


def _tpu_call(kernel, q_BKGH, kv, scales, layer, lengths_B, *, bs, interpret, name, kv_bytes):
    """The TPU kernel's call over grid (rows, key blocks): a row's [K, bs, H] blocks of
    ``kv`` ([B, L, K, S, H] each) and [K, bs] of ``scales`` ([B, L, K, S] each, if any),
    at the layer and blocks the prefetched scalars say."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    b, k, g, h = q_BKGH.shape
    s = kv[0].shape[3]

    def held(i, j, lens):  # blocks past a row's last held one repeat it: no fetch
        return jnp.minimum(j, jnp.maximum(lens[i] - 1, 0) // bs)

    def row(i, j, lay, lens):
        return (i, 0, 0, 0)

    kv_spec = pl.BlockSpec(
        (None, None, k, bs, h), lambda i, j, lay, lens: (i, lay[0], 0, held(i, j, lens), 0)
    )
    scale_spec = pl.BlockSpec(
        (None, None, k, bs), lambda i, j, lay, lens: (i, lay[0], 0, held(i, j, lens))
    )
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, s // bs),
        in_specs=[
            pl.BlockSpec((None, k, g, h), row),
            *(kv_spec,) * len(kv),
            *(scale_spec,) * len(scales),
        ],
        out_specs=[pl.BlockSpec((None, k, g, h), row), pl.BlockSpec((None, k, g, 1), row)],
        scratch_shapes=[
            pltpu.VMEM((k, g, 1), jnp.float32),
            pltpu.VMEM((k, g, 1), jnp.float32),
            pltpu.VMEM((k, g, h), jnp.float32),
        ],
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=grid,
        out_shape=[
            jax.ShapeDtypeStruct((b, k, g, h), jnp.float32),
            jax.ShapeDtypeStruct((b, k, g, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=4 * b * k * g * s * h,
            transcendentals=b * k * g * s,
            bytes_accessed=kv_bytes + 2 * q_BKGH.size * 4,
        ),
        interpret=interpret,
        name=name,
    )(jnp.reshape(layer, (1,)), lengths_B.astype(jnp.int32), q_BKGH, *kv, *scales)
    return out, lse[..., 0]


def _gpu_kernel(lay_ref, len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, bs):
    from jax.experimental import pallas as pl

    lay, n = lay_ref[()], len_ref[()]
    q_GH = q_ref[...].astype(k_ref.dtype)
    scale = q_GH.shape[-1] ** -0.5
    g, h = q_GH.shape

    def body(j, carry):
        acc, m, denom = carry
        at = pl.ds(pl.multiple_of(j * bs, bs), bs)
        s_GS = (
            jax.lax.dot_general(
                q_GH,
                k_ref[lay, at, :],
                (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32,
            )
            * scale
        )
        slot = j * bs + jnp.arange(bs)[None, :]
        s_GS = jnp.where(slot < n, s_GS, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s_GS, axis=1))
        p_GS = jnp.exp(s_GS - m_new[:, None])
        corr = jnp.exp(m - m_new)
        v_SH = v_ref[lay, at, :]
        pv = jnp.dot(p_GS.astype(v_SH.dtype), v_SH, preferred_element_type=jnp.float32)
        return corr[:, None] * acc + pv, m_new, corr * denom + jnp.sum(p_GS, axis=1)

    init = (
        jnp.zeros((g, h), jnp.float32),
        jnp.full((g,), -jnp.inf, jnp.float32),
        jnp.zeros((g,), jnp.float32),
    )
    out, lse = _finish(*jax.lax.fori_loop(0, pl.cdiv(n, bs), body, init))
    o_ref[...] = out
    lse_ref[...] = lse


def _gpu_past(q_BKGH, k_BLKSH, v_BLKSH, layer, lengths_B, *, interpret: bool = False):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    b, k, g, h = q_BKGH.shape
    nl, s = k_BLKSH.shape[1], k_BLKSH.shape[3]
    # Triton's blocks are powers of two, and its dots at least 16 wide: the query
    # group is padded (the padding rows are dropped after).
    gp = max(16, 1 << (g - 1).bit_length())
    q = jnp.pad(q_BKGH, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    # a program's block is its row's and kv head's [L, S, H]; the kernel reads the
    # layer's held blocks of it
    kv = pl.BlockSpec((None, nl, None, s, h), lambda i, kh: (i, 0, kh, 0, 0))
    out, lse = pl.pallas_call(
        functools.partial(_gpu_kernel, bs=block_size(s)),
        grid=(b, k),
        in_specs=[
            pl.BlockSpec((), lambda i, kh: ()),
            pl.BlockSpec((None,), lambda i, kh: (i,)),
            pl.BlockSpec((None, None, gp, h), lambda i, kh: (i, kh, 0, 0)),
            kv,
            kv,
        ],
        out_specs=[
            pl.BlockSpec((None, None, gp, h), lambda i, kh: (i, kh, 0, 0)),
            pl.BlockSpec((None, None, gp), lambda i, kh: (i, kh, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, k, gp, h), jnp.float32),
            jax.ShapeDtypeStruct((b, k, gp), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="ragged_decode_attention",
    )(layer, lengths_B.astype(jnp.int32), q, k_BLKSH, v_BLKSH)
    return out[:, :, :g], lse[:, :, :g]


def past_attention(
    q_BKGH, k_BLKSH, v_BLKSH, layer, lengths_B, spec: RaggedSpec, ks_BLKS=None, vs_BLKS=None
):
    """Each row's query against its slots ``[0, lengths_B)`` of layer ``layer`` (an int32
    scalar, traced or not) of the [B, L, K, S, H] cache, by ``spec``'s kernel.

    An int8 cache comes with its scales ``ks_BLKS`` / ``vs_BLKS`` ([B, L, K, S] float32,
    ``kv_cache.KVCache``) and runs the TPU kernel (interpreted unless on TPU); the query
    is then in the compute dtype, which the int8 values take in the products.

    Returns (out [B, K, G, H] fp32, lse [B, K, G] fp32), as the dense attention over the
    layer's [B, K, S, H].
    """
    s = k_BLKSH.shape[3]
    quantized = ks_BLKS is not None
    if block_size(s, quantized) is None:
        need = (
            f"a multiple of {_INT8_BLOCK}, or of {_INT8_ROWS} below it, for an int8 cache"
            if quantized
            else f"a multiple of {_BLOCKS[-1]}"
        )
        raise ValueError(f"ragged decode attention: the attended length {s} is not {need}")
    fn = _kernel(spec.backend, quantized)
    # the query and the cache operands: an int8 cache adds its scales
    args: tuple[jax.Array, ...]
    if quantized:
        args = (q_BKGH, k_BLKSH, v_BLKSH, ks_BLKS, vs_BLKS)
    else:
        args = (q_BKGH, k_BLKSH, v_BLKSH)

    layer = jnp.asarray(layer, jnp.int32)
    if spec.mesh is None:
        return fn(*args, layer, lengths_B)
    from jax.sharding import PartitionSpec as P

    # A compacted batch may be smaller than the row axes: then its rows are gathered.
    rows = _dividing(spec.mesh, spec.row_axes, q_BKGH.shape[0])
    heads = _dividing(spec.mesh, spec.head_axes, q_BKGH.shape[1])
    kv = P(rows, None, heads)  # the cache [B, L, K, S, H] and its scales [B, L, K, S]
    return jax.shard_map(
        fn,
        mesh=spec.mesh,
        in_specs=(P(rows, heads), *(kv,) * (len(args) - 1), P(), P(rows)),
        out_specs=(P(rows, heads), P(rows, heads)),
        check_vma=False,
    )(*args, layer, lengths_B)


def _kernel(backend: str, quantized: bool) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """``backend``'s kernel: (q, k, v[, k_scale, v_scale], layer, lengths) -> (out, lse)."""
    interpret = backend == "interpret"
    if quantized:
        if backend == "gpu":
            raise ValueError("ragged decode attention: the GPU kernel reads a float cache")
        return functools.partial(_tpu_int8_past, interpret=interpret)
    if backend == "gpu":
        return _gpu_past
    return functools.partial(_tpu_past, interpret=interpret)


def _dividing(mesh, axes, size: int):
    """``axes`` (a PartitionSpec entry) when their devices divide ``size``, else None."""
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    n = 1
    for a in names:
        n *= mesh.shape[a]
    return axes if size % n == 0 else None
