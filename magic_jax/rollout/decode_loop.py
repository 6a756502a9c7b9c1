"""The engine's on-device decode loop (``decode_chunk_fn``): decode steps over a
sub-batch of the slots until the host has work, with each layer's KV cache held apart
through the loop where that is faster (``split_forward``; ``EngineConfig.decode_layers``)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from magic_jax.model.kv_cache import KVCache, write_slot
from magic_jax.model.qwen2 import Qwen2
from magic_jax.rollout import ragged_attention
from magic_jax.rollout.attention import AttendFn
from magic_jax.rollout.decode import (
    DecodeState,
    StepOutput,
    decode_attention,
    decode_logits,
    decode_positions,
    decode_step,
    registered_attention,
    sample_next,
)
from magic_jax.rollout.sampling import SamplingConfig


def layer_modules(model: Qwen2) -> list:
    """The decoder layers as L modules: of stacked weights, static slices of them."""
    if not model.config.scan_layers:
        assert isinstance(model.layers, nnx.List), "without scan_layers, one module per layer"
        return list(model.layers)
    graphdef, stacked = nnx.split(model.layers)
    return [
        nnx.merge(graphdef, jax.tree.map(lambda x, i=i: x[i], stacked))
        for i in range(model.config.num_layers)
    ]


def split_forward(
    model: Qwen2,
    layers: list,
    tokens_B: jax.Array,
    live_B: jax.Array,
    cache: KVCache,
    kv_L: tuple,
    unembed_VD: jax.Array | None = None,
    *,
    attention: AttendFn | None = None,
) -> tuple[jax.Array, KVCache, tuple]:
    """``decode_forward`` over a float cache held as one (k, v) pair of [B, K, S, H]
    arrays per layer (``kv_L``; ``cache`` gives positions and lengths, its k and v are
    unused), the layers a Python loop over ``layers`` (``layer_modules``).

    Each layer writes its new key and value into its own arrays in place and attends
    over them: no per-step copy of a layer's slice out of the [B, L, K, S, H] cache,
    which on CPU is half of a small model's layer time
    (docs/benchmarks.md#decode-defaults). ``attention``: a registered
    attention's product in place of the dense one (``decode_forward``).

    Returns:
      (logits [B, V], ``cache`` with the new positions and lengths, the new ``kv_L``).
    """
    cfg = model.config
    pos_B, at_B, pos_BS = decode_positions(cache, live_B)
    allowed_BS = pos_BS >= 0
    x_B1D = model.embed_tokens(tokens_B[:, None])
    new_kv = []
    for i, layer in enumerate(layers):
        window = cfg.layer_window(i)
        mask_BS = allowed_BS if window is None else allowed_BS & (pos_B[:, None] - pos_BS < window)

        def attend(q_B1KGH, k_B1KH, v_B1KH, kv=kv_L[i], mask_BS=mask_BS):
            k_BKSH = write_slot(kv[0], k_B1KH[:, 0], at_B, axis=2)
            v_BKSH = write_slot(kv[1], v_B1KH[:, 0], at_B, axis=2)
            if attention is not None:
                out_BKGH = registered_attention(attention, q_B1KGH[:, 0], k_BKSH, v_BKSH, mask_BS)
            else:
                out_BKGH = decode_attention(q_B1KGH[:, 0], k_BKSH, v_BKSH, mask_BS)
            return out_BKGH[:, None], (k_BKSH, v_BKSH)

        x_B1D, kv = layer(x_B1D, pos_B[:, None], attend)
        new_kv.append(kv)
    logits_BV = decode_logits(model, x_B1D, unembed_VD)
    lengths_B = jnp.where(live_B, cache.lengths + 1, cache.lengths)
    cache = dataclasses.replace(cache, pos=pos_BS, lengths=lengths_B)
    return logits_BV, cache, tuple(new_kv)


def _take_rows(state: DecodeState, rows_b: jax.Array | None, attend: int) -> DecodeState:
    """The sub-state of ``rows_b`` (all rows if None) with the cache cut to ``attend`` slots."""

    def take(x, axis=0):
        return x if rows_b is None else jnp.take(x, rows_b, axis=axis)

    def take_kv(x_BLKSX):
        return None if x_BLKSX is None else take(x_BLKSX)[:, :, :, :attend]

    c = state.cache
    cache = KVCache(
        k=take_kv(c.k),
        v=take_kv(c.v),
        pos=take(c.pos)[:, :attend],
        lengths=take(c.lengths),
        k_scale=take_kv(c.k_scale),
        v_scale=take_kv(c.v_scale),
    )
    rest = {f: take(getattr(state, f)) for f in ("tokens", "keys", "steps", "max_new", "done")}
    return DecodeState(cache=cache, **rest)


def _put_rows(state: DecodeState, sub: DecodeState, rows_b: jax.Array | None) -> DecodeState:
    """Writes ``sub`` (from ``_take_rows``) back into ``state`` in place."""
    attend = sub.cache.max_len

    def put(full, part):
        if rows_b is None:
            return jax.lax.dynamic_update_slice(full, part, (0,) * full.ndim)
        return full.at[rows_b, :attend].set(part)

    def put_kv(full_BLKSX, part_bLKsX):
        if full_BLKSX is None:
            return None
        if rows_b is None:
            return jax.lax.dynamic_update_slice(full_BLKSX, part_bLKsX, (0,) * full_BLKSX.ndim)
        return full_BLKSX.at[rows_b, :, :, :attend].set(part_bLKsX)

    def put_vec(full, part):
        return part if rows_b is None else full.at[rows_b].set(part)

    c, s = state.cache, sub.cache
    cache = KVCache(
        k=put_kv(c.k, s.k),
        v=put_kv(c.v, s.v),
        pos=put(c.pos, s.pos),
        lengths=put_vec(c.lengths, s.lengths),
        k_scale=put_kv(c.k_scale, s.k_scale),
        v_scale=put_kv(c.v_scale, s.v_scale),
    )
    rest = {
        f: put_vec(getattr(state, f), getattr(sub, f))
        for f in ("tokens", "keys", "steps", "max_new", "done")
    }
    return DecodeState(cache=cache, **rest)


def _runs_on(
    i: jax.Array,
    sub: DecodeState,
    *,
    done0_b: jax.Array,
    num_steps: int,
    min_live: jax.Array,
    stop_on_free: jax.Array,
    attend: int,
) -> jax.Array:
    """Whether a chunk runs step ``i`` (``decode_chunk_fn``'s stopping rules)."""
    live = ~sub.done
    longest = jnp.max(jnp.where(live, sub.cache.lengths, 0))
    freed = jnp.sum(sub.done & ~done0_b)
    return (
        (i < num_steps)
        & (jnp.sum(live) > min_live)
        & ~((stop_on_free > 0) & (freed >= stop_on_free))
        & (longest < attend)
    )


def decode_chunk_fn(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    state: DecodeState,
    unembed_VD: jax.Array | None,
    rows_b: jax.Array | None,
    stop_on_free: jax.Array,
    min_live: jax.Array,
    eos_E: jax.Array,
    *,
    num_steps: int,
    attend: int,
    sampling: SamplingConfig,
    layer_unroll: int | bool = 1,
    ragged: ragged_attention.RaggedSpec | None = None,
    attention: AttendFn | None = None,
    split_layers: bool = False,
) -> tuple[DecodeState, StepOutput, jax.Array]:
    """Up to ``num_steps`` decode steps on device, stopping early when the host has work.

    The loop runs on rows ``rows_b`` (all if None) with the cache cut to its first
    ``attend`` slots, and stops when: every row is done; ``stop_on_free`` (an int32
    count, 0 = never) rows finished (so the host can refill them: a whole group at
    once); at most ``min_live`` rows are live (so the host can compact); or a live
    row reached ``attend``. ``unembed_VD`` is ``Engine.decode_unembedding(params)``,
    or None for the model's own layout. ``split_layers``: the loop holds each
    layer's keys and values apart (``split_forward``; ``EngineConfig.decode_layers``)
    where the cache is float and the attention dense (or ``attention``, a registered
    attention's product).

    Returns:
      (state, outputs [num_steps, b] (rows past the step count are invalid), steps run).
    """
    sub = _take_rows(state, rows_b, attend)
    b = sub.tokens.shape[0]
    zf = jnp.zeros((num_steps, b), jnp.float32)
    zb = jnp.zeros((num_steps, b), bool)
    outs0 = StepOutput(jnp.zeros((num_steps, b), jnp.int32), zf, zf, zf, zb, zb)
    cond = functools.partial(
        _runs_on,
        done0_b=sub.done,
        attend=attend,
        num_steps=num_steps,
        min_live=min_live,
        stop_on_free=stop_on_free,
    )

    split = split_layers and not sub.cache.quantized and ragged is None
    kv0 = None
    if split:
        model: Qwen2 = nnx.merge(graphdef, params)
        layers = layer_modules(model)  # loop invariants: sliced once, outside the loop
        c = sub.cache
        kv0 = tuple((c.k[:, i], c.v[:, i]) for i in range(c.num_layers))
        # the loop carries them apart (kv): the cache's own fields stay empty meanwhile
        hollow = dataclasses.replace(c, k=None, v=None)  # type: ignore[arg-type]
        sub = dataclasses.replace(sub, cache=hollow)

    def body(carry):
        i, sub, kv, outs = carry
        if split:
            logits_BV, cache, kv = split_forward(
                model,
                layers,
                sub.tokens,
                ~sub.done,
                sub.cache,
                kv,
                unembed_VD,
                attention=attention,
            )
            sub, out = sample_next(sub, logits_BV, cache, eos_E, sampling)
        else:
            sub, out = decode_step(
                graphdef,
                params,
                sub,
                eos_E,
                sampling=sampling,
                unembed_VD=unembed_VD,
                layer_unroll=layer_unroll,
                ragged=ragged,
                attention=attention,
            )
        outs = jax.tree.map(lambda o, x: o.at[i].set(x), outs, out)
        return i + 1, sub, kv, outs

    n, sub, kv, outs = jax.lax.while_loop(
        lambda carry: cond(*carry[:2]), body, (jnp.int32(0), sub, kv0, outs0)
    )
    if split:
        assert kv is not None, "a split loop carries the layers' keys and values"
        k, v = (jnp.stack([x[j] for x in kv], axis=1) for j in (0, 1))
        sub = dataclasses.replace(sub, cache=dataclasses.replace(sub.cache, k=k, v=v))
    return _put_rows(state, sub, rows_b), outs, n
