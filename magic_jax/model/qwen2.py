"""Qwen2 decoder (DeepSeek-R1-Distill-Qwen) in flax.nnx, with an explicit KV cache.

Einsum letters, used everywhere in magic_jax:
  B batch, T query length, S key length (cache slots), D model width,
  N query heads, K kv heads, G query heads per kv head (N = K * G),
  H head dim, F mlp width, V vocabulary, L layers.

Parameters carry logical axis names (``embed``, ``q_heads``, ``kv_heads``,
``mlp``, ``vocab``, ``norm``, and ``layers`` for the stacked layer axis);
``sharding.py`` maps them onto mesh axes. Module and parameter names mirror
Hugging Face so that conversion is a table.

By default the decoder layers are one module whose parameters carry a leading
layer axis [L, ...], run under ``nnx.scan``: compile time no longer grows with
depth. ``ModelConfig.scan_layers=False`` keeps a Python list of layers (the
same maths, one traced copy per layer).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from magic_jax.model.config import ModelConfig
from magic_jax.model.kernels import masked_attention, swiglu
from magic_jax.model.kv_cache import KVCache, write_rows
from magic_jax.model.splash import splash_attend

LAYER_AXIS = "layers"
# The window of a full-attention layer when windows are per-layer data: longer than
# any position difference, so the mask term is always true.
_NO_WINDOW = 2**30


# --------------------------------------------------------------------------- layers


def _param(init: Any, key: jax.Array, shape: Sequence[int], dtype: Any, names: tuple) -> nnx.Param:
    # eager_sharding=False: placement is done by sharding.py from the logical names,
    # so a model can be built with no mesh in context.
    return nnx.Param(init(key, shape, dtype), out_sharding=names, eager_sharding=False)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel [in, out] is the transpose of torch's weight."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        bias: bool,
        names: tuple[str, str],
        config: ModelConfig,
        rngs: nnx.Rngs,
    ):
        pdt = jnp.dtype(config.param_dtype)
        init = nnx.initializers.normal(0.02)
        self.kernel = _param(init, rngs.params(), (d_in, d_out), pdt, names)
        self.bias = (
            _param(nnx.initializers.zeros, rngs.params(), (d_out,), pdt, (names[1],))
            if bias
            else None
        )
        self.dtype = jnp.dtype(config.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class RMSNorm(nnx.Module):
    """Root-mean-square norm, computed in fp32."""

    def __init__(self, dim: int, *, config: ModelConfig, rngs: nnx.Rngs):
        self.scale = _param(
            nnx.initializers.ones, rngs.params(), (dim,), jnp.dtype(config.param_dtype), ("norm",)
        )
        self.eps = config.rms_norm_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.scale[...].astype(jnp.float32) * x32).astype(x.dtype)


def apply_rope(x_BTxH: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, half-split layout (as Hugging Face Qwen2), in fp32.

    Args:
      x_BTxH: [B, T, ..., H] queries or keys.
      positions_BT: [B, T] integer positions.
      theta: base frequency.
    """
    h = x_BTxH.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    angles = positions_BT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    extra = x_BTxH.ndim - 3
    angles = angles.reshape(angles.shape[:2] + (1,) * extra + angles.shape[-1:])
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x = x_BTxH.astype(jnp.float32)
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTxH.dtype)


def _attend(
    q_BTKGH,
    q_slot_BT,
    positions_BT,
    q_seg_BT=None,
    *,
    k_BSKH,
    v_BSKH,
    key_pos_BS,
    key_seg_BS,
    window,
):
    """Masked softmax attention of queries at cache slots ``q_slot_BT`` (fp32 softmax);
    with segment ids (packed rows), a query sees only the keys of its own segment."""
    s = k_BSKH.shape[1]
    slot_S = jnp.arange(s, dtype=jnp.int32)
    allowed_BTS = (key_pos_BS[:, None, :] >= 0) & (slot_S[None, None, :] <= q_slot_BT[:, :, None])
    if key_seg_BS is not None:
        allowed_BTS &= q_seg_BT[:, :, None] == key_seg_BS[:, None, :]
    if window is not None:
        allowed_BTS &= positions_BT[:, :, None] - key_pos_BS[:, None, :] < window
    # A padding query may have no visible key; letting it see its own slot keeps
    # the softmax finite (its output is ignored).
    allowed_BTS |= slot_S[None, None, :] == q_slot_BT[:, :, None]
    return masked_attention(q_BTKGH, k_BSKH, v_BSKH, allowed_BTS)


def sequence_attention(
    q_BTKGH,
    k_BTKH,
    v_BTKH,
    *,
    cache_kv,
    positions_BT,
    q_slot_BT,
    key_pos_BS,
    write_at_B,
    window,
    chunk,
    segments_BT=None,
):
    """The model's attention over a sequence: the T new keys and values are written
    into the cache (when there is one) and every query attends to what it holds.

    ``window`` is the layer's sliding window: None (full attention), an int, or a
    traced () int32 when the window is per-layer data under the scan. ``chunk``
    (``ModelConfig.attention_chunk``): longer sequences attend one query chunk at
    a time, rematerialised in the backward pass, so the scores take [B, N, c, S]
    memory rather than [B, N, T, S]. ``segments_BT`` (no cache): each row holds
    several sequences, packed; a query attends only within its own segment.

    Returns:
      (out [B, T, K, G, H], the layer's updated (k, v) cache ([B, K, S, H] each, as
      ``KVCache`` holds a layer), or the new keys and values without a cache).
    """
    if cache_kv is None:
        k_BSKH, v_BSKH = k_BTKH, v_BTKH
        new_kv = (k_BTKH, v_BTKH)
    else:
        new_kv = tuple(
            write_rows(c_BKSH, jnp.swapaxes(x_BTKH, 1, 2), write_at_B, axis=2)
            for c_BKSH, x_BTKH in zip(cache_kv, (k_BTKH, v_BTKH))
        )
        k_BSKH, v_BSKH = (jnp.swapaxes(x, 1, 2) for x in new_kv)
    attend = functools.partial(
        _attend,
        k_BSKH=k_BSKH,
        v_BSKH=v_BSKH,
        key_pos_BS=key_pos_BS,
        key_seg_BS=segments_BT,
        window=window,
    )
    b, t = q_BTKGH.shape[:2]
    q_args = (q_BTKGH, q_slot_BT, positions_BT)
    if segments_BT is not None:
        q_args += (segments_BT,)
    if not chunk or t <= chunk:
        return attend(*q_args), new_kv
    n = -(-t // chunk)
    pad = n * chunk - t

    def chunks(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), mode="edge")
        return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

    out = jax.lax.map(jax.checkpoint(lambda a: attend(*a)), tuple(chunks(x) for x in q_args))
    out_BTKGH = jnp.moveaxis(out, 0, 1).reshape(b, n * chunk, *q_BTKGH.shape[2:])[:, :t]
    return out_BTKGH, new_kv


class Attention(nnx.Module):
    """Grouped-query attention with q/k/v biases and RoPE."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, h = config.hidden_size, config.head_size
        n, k = config.num_heads, config.num_kv_heads
        linear = functools.partial(Linear, config=config, rngs=rngs)
        self.q_proj = linear(d, n * h, bias=True, names=("embed", "q_heads"))
        self.k_proj = linear(d, k * h, bias=True, names=("embed", "kv_heads"))
        self.v_proj = linear(d, k * h, bias=True, names=("embed", "kv_heads"))
        self.o_proj = linear(n * h, d, bias=False, names=("q_heads", "embed"))
        self.num_heads = n
        self.num_kv_heads = k
        self.head_dim = h
        self.rope_theta = config.rope_theta

    def __call__(self, x_BTD, positions_BT, attend):
        """Projects, rotates, attends with ``attend`` and projects back.

        ``attend(q_BTKGH, k_BTKH, v_BTKH) -> (out_BTKGH, kv)`` is where the keys
        and values go: ``sequence_attention`` for a forward over a sequence, the
        engine's one-token product for decode. Returns the output [B, T, D] and
        the ``kv`` ``attend`` gave.
        """
        b, t, _ = x_BTD.shape
        kh, g, h = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        q_BTKGH = self.q_proj(x_BTD).reshape(b, t, kh, g, h)
        k_BTKH = self.k_proj(x_BTD).reshape(b, t, kh, h)
        v_BTKH = self.v_proj(x_BTD).reshape(b, t, kh, h)
        q_BTKGH = apply_rope(q_BTKGH, positions_BT, self.rope_theta)
        k_BTKH = apply_rope(k_BTKH, positions_BT, self.rope_theta)
        out_BTKGH, kv = attend(q_BTKGH, k_BTKH, v_BTKH)
        out = self.o_proj(out_BTKGH.reshape(b, t, kh * g * h).astype(x_BTD.dtype))
        return out, kv


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        linear = functools.partial(Linear, bias=False, config=config, rngs=rngs)
        self.gate_proj = linear(d, f, names=("embed", "mlp"))
        self.up_proj = linear(d, f, names=("embed", "mlp"))
        self.down_proj = linear(f, d, names=("mlp", "embed"))
        self.use_kernel = config.mlp_kernel

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        if self.use_kernel:
            dt = self.gate_proj.dtype
            return swiglu(
                x_BTD.astype(dt),
                *(p.kernel[...].astype(dt) for p in (self.gate_proj, self.up_proj, self.down_proj)),
            )
        return self.down_proj(jax.nn.silu(self.gate_proj(x_BTD)) * self.up_proj(x_BTD))


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP blocks with residual connections."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config=config, rngs=rngs)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config=config, rngs=rngs)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x_BTD, positions_BT, attend):
        """The layer on [B, T, D]; ``attend`` as in ``Attention``. Returns (x, its kv)."""
        attn, new_kv = self.self_attn(self.input_layernorm(x_BTD), positions_BT, attend)
        x_BTD = x_BTD + attn
        x_BTD = x_BTD + self.mlp(self.post_attention_layernorm(x_BTD))
        return x_BTD, new_kv


class Embed(nnx.Module):
    """Token embedding table [V, D]."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.embedding = _param(
            nnx.initializers.normal(0.02),
            rngs.params(),
            (config.vocab_size, config.hidden_size),
            jnp.dtype(config.param_dtype),
            ("vocab", "embed"),
        )
        self.dtype = jnp.dtype(config.dtype)

    def __call__(self, ids_BT: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids_BT, axis=0).astype(self.dtype)


class Qwen2(nnx.Module):
    """Qwen2 causal language model.

    Call: ``model(input_ids, positions=None, attention_mask=None, cache=None,
    return_hidden=False)``. Without a cache it returns logits [B, T, V] (or
    the final-norm hidden states [B, T, D] with ``return_hidden``); with a
    cache it returns ``(out, new_cache)``.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = Embed(config, rngs=rngs)
        # under scan_layers one layer of stacked [L, ...] parameters, else L layers
        self.layers: DecoderLayer | nnx.List[DecoderLayer]
        if config.scan_layers:
            self.layers = _stacked_layers(config, rngs)
        else:
            self.layers = nnx.List(
                [DecoderLayer(config, rngs=rngs) for _ in range(config.num_layers)]
            )
        self.norm = RMSNorm(config.hidden_size, config=config, rngs=rngs)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(
                config.hidden_size,
                config.vocab_size,
                bias=False,
                names=("embed", "vocab"),
                config=config,
                rngs=rngs,
            )
        )

    def layer_windows(self) -> jax.Array | None:
        """[L] int32 sliding window of each layer (a huge value for full attention), or
        None when no layer slides (then no window mask is built at all)."""
        cfg = self.config
        if not cfg.sliding_layers:
            return None
        return jnp.asarray(
            [cfg.layer_window(i) or _NO_WINDOW for i in range(cfg.num_layers)], jnp.int32
        )

    def run_layers(
        self,
        fn: Any,
        carry: Any,
        per_layer: Any = None,
        *,
        remat: bool = False,
        unroll: int | bool = 1,
    ):
        """Runs ``fn(layer, carry, xs) -> (carry, ys)`` over the decoder layers in order.

        ``per_layer`` is a pytree of [L, ...] arrays; layer i receives their i-th
        slices as ``xs``. Under ``scan_layers`` this is one ``nnx.scan`` over the
        stacked layer (one traced copy), otherwise a Python loop. With ``remat``
        each layer is wrapped in ``nnx.remat`` with the config's policy.
        ``unroll`` is the scan's (``True``: every layer inlined, static weight
        slices; the parameters stay stacked).

        Returns:
          (the final carry, the ``ys`` stacked on a leading [L] axis).
        """
        policy = self.config.remat
        if remat and policy != "none":
            saved = jax.checkpoint_policies.dots_saveable if policy == "dots_saveable" else None
            fn = nnx.remat(fn, policy=saved, prevent_cse=not self.config.scan_layers)
        if self.config.scan_layers:
            scan = nnx.scan(
                fn,
                in_axes=(0, nnx.Carry, 0),
                out_axes=(nnx.Carry, 0),
                # Layers are read, never restructured, inside: the plain (no graph
                # updates) scan, which also accepts a model merged in an outer trace
                # (the engine's decode loop).
                graph_updates=False,
                unroll=unroll,
            )
            return scan(self.layers, carry, per_layer)
        assert isinstance(self.layers, nnx.List), "without scan_layers, one module per layer"
        ys = []
        for i, layer in enumerate(self.layers):
            carry, y = fn(layer, carry, jax.tree.map(lambda x, i=i: x[i], per_layer))
            ys.append(y)
        return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)

    def unembedding(self) -> jax.Array:
        """The output projection [D, V] (the embedding transposed when tied)."""
        if self.lm_head is None:
            return self.embed_tokens.embedding[...].T
        return self.lm_head.kernel[...]

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        cache: KVCache | None = None,
        return_hidden: bool = False,
        row_sharding: jax.sharding.NamedSharding | None = None,
        segment_ids: jax.Array | None = None,
    ):
        """Forward pass.

        Args:
          input_ids: [B, T] int32 token ids.
          positions: [B, T] int32 RoPE positions. Default: count of real tokens
            before each one (so left padding is skipped), continuing the cache.
          attention_mask: [B, T], 1 for real tokens and 0 for padding.
          cache: a ``KVCache``; the T new tokens are written at each row's
            ``lengths`` and attend to everything already held.
          return_hidden: return final-norm hidden states [B, T, D] instead of logits.
          row_sharding: the sharding of the batch's rows (the update's, over
            ``data`` x ``fsdp``). The residual stream keeps it, and between layers
            (the input remat keeps of each layer) is also split over ``tensor``
            along the embed axis. Without it XLA may contract over the weights'
            ``fsdp``-sharded embed axis instead, every device holding every row's
            activations (docs/benchmarks.md, ``update_activations.py``).
          segment_ids: [B, T] int32, rows that hold several sequences packed
            (``update.packing``): a token attends only to earlier tokens of the same
            id (0 = padding); ``positions`` should restart at 0 for each. No cache.

        Without a cache, ``config.attention`` other than ``dense`` attends by the splash
        kernel (``splash.py``; ``splash`` raises a ValueError off TPU).
        """
        if cache is not None and cache.quantized:
            raise ValueError(
                "Qwen2.__call__ takes a float KV cache; an int8 cache is the decode "
                "engine's (rollout.kv_dtype), which quantizes when it inserts a prefix"
            )
        if cache is not None and segment_ids is not None:
            raise ValueError("Qwen2.__call__: segment_ids (packed rows) take no KV cache")
        b, t = input_ids.shape
        mask_BT = jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool)
        if positions is None:
            start_B = jnp.zeros((b,), jnp.int32) if cache is None else cache.next_positions()
            positions = start_B[:, None] + jnp.cumsum(mask_BT, axis=1, dtype=jnp.int32) - 1
            positions = jnp.maximum(positions, 0)
        positions = positions.astype(jnp.int32)
        new_pos_BT = jnp.where(mask_BT, positions, -1)

        if cache is None:
            write_at_B = jnp.zeros((b,), jnp.int32)
            key_pos_BS = new_pos_BT
        else:
            write_at_B = cache.lengths
            key_pos_BS = write_rows(cache.pos, new_pos_BT, write_at_B)
        q_slot_BT = write_at_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]

        layer_sharding = row_sharding
        if row_sharding is not None and "tensor" in row_sharding.mesh.axis_names:
            # what remat keeps of each layer, its input: the rows', split over tensor too
            first = row_sharding.spec[0] if row_sharding.spec else None
            spec = jax.sharding.PartitionSpec(first, None, "tensor")
            layer_sharding = jax.sharding.NamedSharding(row_sharding.mesh, spec)

        def rows(x, between_layers=False):
            sh = layer_sharding if between_layers else row_sharding
            return x if sh is None else jax.lax.with_sharding_constraint(x, sh)

        splash = None
        if cache is None and self.config.attention != "dense":
            # unpacked rows: one segment; each padding slot (0) apart, as in the dense mask
            segs_BT = mask_BT.astype(jnp.int32) if segment_ids is None else segment_ids
            splash = splash_attend(self.config.attention, segs_BT, row_sharding)

        def layer_fn(layer, x_BTD, xs):
            window, kv = xs
            x_BTD = rows(x_BTD, between_layers=True)
            attend = splash or functools.partial(
                sequence_attention,
                cache_kv=kv,
                positions_BT=positions,
                q_slot_BT=q_slot_BT,
                key_pos_BS=key_pos_BS,
                write_at_B=write_at_B,
                window=window,
                chunk=self.config.attention_chunk,
                segments_BT=segment_ids,
            )
            x_BTD, new_kv = layer(x_BTD, positions, attend)
            x_BTD = rows(x_BTD, between_layers=True)
            # Without a cache nothing leaves the layer but x: the keys and values of
            # every layer would otherwise be stacked as outputs.
            return x_BTD, (None if kv is None else new_kv)

        kv_L = None if cache is None else cache.layers_first()
        x_BTD, new_kv = self.run_layers(
            layer_fn,
            rows(self.embed_tokens(input_ids)),
            (self.layer_windows(), kv_L),
            remat=True,
            unroll=self.config.layer_unroll,
        )
        x_BTD = rows(self.norm(x_BTD))

        if return_hidden:
            out = x_BTD
        else:
            dt = jnp.dtype(self.config.dtype)
            out = jnp.dot(x_BTD.astype(dt), self.unembedding().astype(dt))
        if cache is None:
            return out
        k, v = (jnp.moveaxis(x, 0, 1) for x in new_kv)  # back to [B, L, K, S, H]
        new_cache = KVCache(k=k, v=v, pos=key_pos_BS, lengths=cache.lengths + t)
        return out, new_cache


def _stacked_layers(config: ModelConfig, rngs: nnx.Rngs) -> DecoderLayer:
    """One ``DecoderLayer`` whose parameters have a leading [L] axis named ``layers``."""

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYER_AXIS})
    def make(rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(config, rngs=rngs)

    return make(rngs)


def abstract_model(config: ModelConfig) -> Qwen2:
    """The model with ShapeDtypeStruct leaves: shapes and names, no memory."""
    return nnx.eval_shape(lambda: Qwen2(config, rngs=nnx.Rngs(0)))


def count_params(model_or_state: Any) -> int:
    """Number of parameters in a model or state (works on abstract models)."""
    state = (
        nnx.state(model_or_state, nnx.Param)
        if isinstance(model_or_state, nnx.Module)
        else model_or_state
    )
    return sum(int(x.size) for x in jax.tree.leaves(state))
