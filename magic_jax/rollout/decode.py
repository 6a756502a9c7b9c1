"""The decode engine's compiled programs, as pure functions: prefill, insert and the
one-token forward and step over the KV cache (``engine.Engine`` binds and compiles
them; the on-device decode loop over steps is ``decode_loop``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from magic_jax.model.kv_cache import KVCache, layer_slice, quantize_kv, write_slot, write_token
from magic_jax.model.qwen2 import Qwen2
from magic_jax.rollout import ragged_attention
from magic_jax.rollout import sampling as sampling_lib
from magic_jax.rollout.attention import AttendFn
from magic_jax.rollout.sampling import SamplingConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
    """A prefilled prompt, ready to be inserted into any number of slots.

    Attributes:
      cache: KV cache of one row, [1, P] slots (P the prefill bucket).
      length: () int32 true prompt length (slots past it are padding).
      logits: [V] float32 logits of the first response token.
    """

    cache: KVCache
    length: jax.Array
    logits: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything a decode step transforms; rows are decode slots.

    Attributes:
      cache: the preallocated KV cache [B, S].
      tokens: [B] int32 last sampled token of each slot (fed next step).
      keys: [B] base PRNG key of each slot's sample.
      steps: [B] int32 response tokens sampled so far.
      max_new: [B] int32 response length limit of each slot.
      done: [B] bool, True for a finished or empty slot.
    """

    cache: KVCache
    tokens: jax.Array
    keys: jax.Array
    steps: jax.Array
    max_new: jax.Array
    done: jax.Array


class StepOutput(NamedTuple):
    """Per-slot results of decode steps: [B] for one step, [n, B] for a chunk.

    ``valid`` marks slots that were live and produced ``tokens`` in that step;
    ``done`` whether the slot finished with it.
    """

    tokens: jax.Array
    logprobs: jax.Array
    entropies: jax.Array
    sampling_logprobs: jax.Array
    valid: jax.Array
    done: jax.Array


def _eos_hit(tokens_B: jax.Array, eos_E: jax.Array) -> jax.Array:
    return jnp.any(tokens_B[:, None] == eos_E[None, :], axis=-1)


def prefill_fn(
    graphdef: nnx.GraphDef, params: nnx.State, tokens_P: jax.Array, length: jax.Array
) -> Prefix:
    """Runs a right-padded prompt [P] through the model into a one-row cache.

    Only the last real position is unembedded: the rest of the prompt's logits are
    never used, and at a large vocabulary they cost as much as the layers.
    """
    model: Qwen2 = nnx.merge(graphdef, params)
    p = tokens_P.shape[0]
    mask_1P = (jnp.arange(p) < length)[None]
    cache = KVCache.init(model.config, 1, p)
    hidden_1PD, cache = model(
        tokens_P[None], attention_mask=mask_1P, cache=cache, return_hidden=True
    )
    # Decode writes the response from the true length on, over the padding.
    cache = dataclasses.replace(cache, lengths=length[None].astype(jnp.int32))
    dt = jnp.dtype(model.config.dtype)
    h_D = jax.lax.dynamic_index_in_dim(hidden_1PD[0], length - 1, keepdims=False)
    logits_V = jnp.dot(h_D.astype(dt), model.unembedding().astype(dt))
    return Prefix(cache=cache, length=length.astype(jnp.int32), logits=logits_V.astype(jnp.float32))


def insert_fn(
    prefix: Prefix,
    state: DecodeState,
    slot: jax.Array,
    key: jax.Array,
    max_new: jax.Array,
    eos_E: jax.Array,
    *,
    sampling: SamplingConfig,
) -> tuple[DecodeState, sampling_lib.Draw]:
    """Copies ``prefix`` into row ``slot`` in place and samples the first response token."""
    state, first = _insert_rows(
        prefix, state, slot[None], key[None], max_new[None], eos_E, sampling=sampling
    )
    return state, jax.tree.map(lambda x: x[0], first)


def insert_group_fn(
    prefix: Prefix,
    state: DecodeState,
    slots_n: jax.Array,
    seed: jax.Array,
    step: jax.Array,
    prompt: jax.Array,
    samples_n: jax.Array,
    max_new_n: jax.Array,
    eos_E: jax.Array,
    *,
    sampling: SamplingConfig,
) -> tuple[DecodeState, sampling_lib.Draw]:
    """``insert_fn`` for n samples of one prompt in one call, their keys made on device.

    Sample i goes to ``slots_n[i]`` with the base key ``fold_in(seed, step, prompt,
    samples_n[i])`` (``sampling.sample_key``), exactly as n separate inserts would.
    Returns the state and the n first draws, stacked.
    """
    keys_n = jax.vmap(lambda j: sampling_lib.sample_key(seed, step, prompt, j))(samples_n)
    return _insert_rows(prefix, state, slots_n, keys_n, max_new_n, eos_E, sampling=sampling)


def _insert_rows(
    prefix: Prefix,
    state: DecodeState,
    slots_n: jax.Array,
    keys_n: jax.Array,
    max_new_n: jax.Array,
    eos_E: jax.Array,
    *,
    sampling: SamplingConfig,
) -> tuple[DecodeState, sampling_lib.Draw]:
    """``prefix`` into rows ``slots_n`` (distinct) in place, sample i drawing its first
    token with ``fold_in(keys_n[i], 0)``. The n draws are one batched draw (row-wise,
    so each equals its own single draw), and the prompt's rows are quantized once."""
    n = slots_n.shape[0]
    logits_nV = jnp.broadcast_to(prefix.logits, (n, *prefix.logits.shape))
    first = sampling_lib.draw(
        logits_nV, jax.vmap(jax.random.fold_in, (0, None))(keys_n, 0), sampling
    )
    cache = _write_rows(prefix, state.cache, slots_n)
    done_n = _eos_hit(first.tokens, eos_E) | (max_new_n <= 1)
    state = DecodeState(
        cache=cache,
        tokens=state.tokens.at[slots_n].set(first.tokens),
        keys=state.keys.at[slots_n].set(keys_n),
        steps=state.steps.at[slots_n].set(1),
        max_new=state.max_new.at[slots_n].set(max_new_n),
        done=state.done.at[slots_n].set(done_n),
    )
    return state, first


def _write_rows(prefix: Prefix, c: KVCache, slots_n: jax.Array) -> KVCache:
    """The cache ``c`` with ``prefix``'s one-row cache in rows ``slots_n`` (distinct), each
    row's positions past the prefix emptied; quantized once where the cache is."""
    pos_1S = jnp.full((1, c.max_len), -1, jnp.int32)
    pos_1S = jax.lax.dynamic_update_slice(pos_1S, prefix.cache.pos, (0, 0))
    rows = {"pos": pos_1S}
    for name in ("k", "v"):
        row = getattr(prefix.cache, name)
        if c.quantized:  # the prompt's keys and values are quantized as they enter
            row, rows[f"{name}_scale"] = quantize_kv(row)
        rows[name] = row
    out = {}
    for name, row_1X in rows.items():
        buf = getattr(c, name)
        row_1X = row_1X.astype(buf.dtype)
        for i in range(slots_n.shape[0]):  # one contiguous block per slot: its every layer
            buf = jax.lax.dynamic_update_slice(buf, row_1X, (slots_n[i],) + (0,) * (buf.ndim - 1))
        out[name] = buf
    return KVCache(lengths=c.lengths.at[slots_n].set(prefix.length), **out)


def reprefill_fn(prefix: Prefix, state: DecodeState, slot: jax.Array) -> DecodeState:
    """Row ``slot``'s KV cache replaced by ``prefix`` (its prompt and response so far,
    prefilled again under newer weights); its next token, key, counts and limit kept, so
    decoding goes on where it was."""
    return dataclasses.replace(state, cache=_write_rows(prefix, state.cache, slot[None]))


# From this many cache slots a float32 decode product takes the keys on its left (see
# ``decode_attention``). Measured on CPU (2-core Zen 3, 2026-11-29), keys right / left:
# the default world's rollout (80 slots) 1.35x faster, benchmarks/rollout.py's W1 (320)
# even, its W2 (576) 0.96x and 0.72x (two runs each).
KEYS_LEFT_FROM = 384


def decode_attention(q_BKGH, k_BKSH, v_BKSH, allowed_BS, k_scale_BKS=None, v_scale_BKS=None):
    """One query per row against a layer's whole cache, batched over (B, K): each query
    head against its own kv head's [S, H] keys and values as the cache holds them (no
    transpose, and no kv head gathered from another device when they are split over
    ``tensor``).

    The scores are [B, K, G, S] (the keys the right operand of their product) except
    for a float32 product over a cache of ``KEYS_LEFT_FROM`` slots or more, which holds
    them as [B, K, S, G]: XLA's CPU dot repacks its right operand, a layer's keys every
    layer and step, which costs more than it saves in long caches only. A bfloat16
    product (what TPUs and GPUs run) keeps [B, K, G, S] at every length.

    An int8 cache (``k_scale_BKS`` / ``v_scale_BKS`` given) is dequantized inside
    the products: the int8 values enter the dots, each score is multiplied by its
    key's scale and each probability by its value's scale, so no dequantized copy
    of the cache is made.
    """
    h = q_BKGH.shape[-1]
    # The query takes the cache's dtype (the compute dtype for an int8 cache), so the
    # program holds no float32 copy of a bf16 cache; both products accumulate in fp32.
    dt = q_BKGH.dtype if k_scale_BKS is not None else k_BKSH.dtype
    left = dt == jnp.float32 and k_BKSH.shape[2] >= KEYS_LEFT_FROM
    dims = "bksg" if left else "bkgs"  # the scores' dims, as said above
    scores = jnp.einsum(
        f"bkgh,bksh->{dims}",
        q_BKGH.astype(dt),
        k_BKSH.astype(dt),
        preferred_element_type=jnp.float32,
    )
    probs = _softmax_scaled(scores, dims, allowed_BS, h, k_scale_BKS, v_scale_BKS)
    return jnp.einsum(
        f"{dims},bksh->bkgh",
        probs.astype(dt),
        v_BKSH.astype(dt),
        preferred_element_type=jnp.float32,
    )


def _softmax_scaled(scores, dims, allowed_BS, h, k_scale_BKS, v_scale_BKS):
    """Attention probabilities over the slots from raw q.k ``scores`` ([B, K, G, S] or
    [B, K, S, G]: ``dims``), fp32: times each key's int8 scale (if any) and 1/sqrt(H),
    masked, softmaxed, times each value's int8 scale (if any)."""
    g = dims.index("g")
    if k_scale_BKS is not None:
        scores = scores * jnp.expand_dims(k_scale_BKS, g)
    scores = scores * (h**-0.5)
    scores = jnp.where(jnp.expand_dims(allowed_BS, (1, g)), scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=dims.index("s"))
    if v_scale_BKS is not None:
        probs = probs * jnp.expand_dims(v_scale_BKS, g)
    return probs


def registered_attention(attention: AttendFn, q_BKGH, k_BKSH, v_BKSH, allowed_BS):
    """A registered attention's product over a layer's [B, K, S, H] cache: it takes the
    keys and values as [B, S, K, H] (``attention.AttendFn``)."""
    return attention(q_BKGH, jnp.swapaxes(k_BKSH, 1, 2), jnp.swapaxes(v_BKSH, 1, 2), allowed_BS)


def decode_positions(cache: KVCache, live_B: jax.Array) -> tuple[jax.Array, ...]:
    """Where a decode step's token goes: its position [B], the slot it is written at
    [B] and the cache's positions [B, S] with it (-1, padding, for a finished row)."""
    pos_B = cache.next_positions()
    at_B = jnp.minimum(cache.lengths, cache.max_len - 1)
    pos_BS = write_slot(cache.pos[..., None], jnp.where(live_B, pos_B, -1)[:, None], at_B)[..., 0]
    return pos_B, at_B, pos_BS


def decode_logits(model: Qwen2, x_B1D: jax.Array, unembed_VD: jax.Array | None) -> jax.Array:
    """[B, V] logits of the last layer's output: the final norm and the unembedding
    (``unembed_VD``, the transposed copy ``decode_forward`` describes, when given)."""
    x_BD = model.norm(x_B1D[:, 0])
    dt = jnp.dtype(model.config.dtype)
    if unembed_VD is None:
        return jnp.dot(x_BD.astype(dt), model.unembedding().astype(dt))
    return jnp.einsum("bd,vd->bv", x_BD.astype(dt), unembed_VD.astype(dt))


def decode_forward(
    model: Qwen2,
    tokens_B: jax.Array,
    live_B: jax.Array,
    cache: KVCache,
    unembed_VD: jax.Array | None = None,
    *,
    layer_unroll: int | bool = 1,
    ragged: ragged_attention.RaggedSpec | None = None,
    attention: AttendFn | None = None,
) -> tuple[jax.Array, KVCache]:
    """The model's forward for one new token per row, with the decode attention above.

    The layers are the model's own ``DecoderLayer`` (run through
    ``model.run_layers``, one scan over the stacked layers), given the decode
    attention product (arranged for T = 1) as their ``attend``; the embedding,
    norms and unembedding are the model's too.
    Finished rows (``~live_B``) write a padding entry (pos -1) and do not advance.
    ``unembed_VD``, when given, is the model's unembedding stored transposed,
    [V, D]: XLA's CPU dot is about 2x faster contracting the weight's minor
    dimension, and transposing per call would cost more than it saves, so the caller
    makes it once per weights (docs/benchmarks.md#decode-defaults).
    ``layer_unroll``: see ``EngineConfig.layer_unroll``. ``ragged`` runs
    ``ragged_attention``'s kernel instead: each row reads its past slots ``[0, length)``
    only and the new token is merged in after (no sliding windows, an attended length
    the kernel's blocks divide, and an int8 cache only on the TPU kernel; otherwise the
    dense product runs). An int8 cache's new token is merged as the cache holds it,
    quantized. ``attention``, a registered attention's product (``attention.AttendFn``,
    a float cache, given each layer's keys and values as [B, S, K, H]), runs in place
    of the dense one.

    Returns:
      (logits [B, V], the cache with the token written).
    """
    if attention is not None and (ragged is not None or cache.quantized):
        raise ValueError("a registered decode attention reads a float cache, without ragged")
    windows = model.layer_windows()
    if not ragged_attention.applies(
        ragged, quantized=cache.quantized, sliding=windows is not None, length=cache.max_len
    ):
        ragged = None
    pos_B, at_B, pos_BS = decode_positions(cache, live_B)
    allowed_BS = pos_BS >= 0

    quantized = cache.quantized

    def layer_fn(layer, x_B1D, xs):
        # The scan runs over the layers' index: the cache is read at it (a slice per
        # layer on the dense path; the kernel reads it whole at the index).
        window, li = xs
        mask_BS = allowed_BS if window is None else allowed_BS & (pos_B[:, None] - pos_BS < window)

        def attend(q_B1KGH, k_B1KH, v_B1KH):
            new = {"k": k_B1KH[:, 0], "v": v_B1KH[:, 0]}
            if quantized:
                (new["k"], new["ks"]), (new["v"], new["vs"]) = map(
                    quantize_kv, (new["k"], new["v"])
                )
            if ragged is not None:
                held_B = jnp.where(live_B, at_B, 0)
                if quantized:
                    # the query in the compute dtype; the new token as the cache holds it
                    q_BKGH = q_B1KGH[:, 0]
                    k_BKH, v_BKH = (
                        new[n].astype(jnp.float32) * new[n + "s"][..., None] for n in ("k", "v")
                    )
                    scales = (cache.k_scale, cache.v_scale)
                else:
                    q_BKGH = q_B1KGH[:, 0].astype(cache.k.dtype)
                    k_BKH, v_BKH = (new[n].astype(cache.k.dtype) for n in ("k", "v"))
                    scales = ()
                past = ragged_attention.past_attention(
                    q_BKGH, cache.k, cache.v, li, held_B, ragged, *scales
                )
                out_BKGH = ragged_attention.merge_new_token(*past, q_BKGH, k_BKH, v_BKH)
                return out_BKGH[:, None], new

            def written(name, new_name):  # the layer's [B, K, S, ...] with the token
                return write_slot(layer_slice(getattr(cache, name), li), new[new_name], at_B, 2)

            args = (q_B1KGH[:, 0], written("k", "k"), written("v", "v"), mask_BS)
            if attention is not None:
                out_BKGH = registered_attention(attention, *args)
            elif quantized:
                out_BKGH = decode_attention(
                    *args, written("k_scale", "ks"), written("v_scale", "vs")
                )
            else:
                out_BKGH = decode_attention(*args)
            # Only the new token's key and value leave the layer: returning the whole
            # updated cache slice would copy every layer's cache each step.
            return out_BKGH[:, None], new

        return layer(x_B1D, pos_B[:, None], attend)

    x_B1D = model.embed_tokens(tokens_B[:, None])
    x_B1D, new_L = model.run_layers(
        layer_fn,
        x_B1D,
        (windows, jnp.arange(cache.num_layers, dtype=jnp.int32)),
        unroll=layer_unroll,
    )
    logits_BV = decode_logits(model, x_B1D, unembed_VD)
    lengths_B = jnp.where(live_B, cache.lengths + 1, cache.lengths)
    write = functools.partial(write_token, at_B=at_B)

    new = KVCache(
        k=write(cache.k, new_L["k"]),
        v=write(cache.v, new_L["v"]),
        pos=pos_BS,
        lengths=lengths_B,
        k_scale=None if cache.k_scale is None else write(cache.k_scale, new_L["ks"]),
        v_scale=None if cache.v_scale is None else write(cache.v_scale, new_L["vs"]),
    )
    return logits_BV, new


def decode_step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    state: DecodeState,
    eos_E: jax.Array,
    *,
    sampling: SamplingConfig,
    unembed_VD: jax.Array | None = None,
    layer_unroll: int | bool = 1,
    ragged: ragged_attention.RaggedSpec | None = None,
    attention: AttendFn | None = None,
) -> tuple[DecodeState, StepOutput]:
    """One token for every live slot: feed the last token, sample the next.

    ``eos_E`` [E] int32 holds the ids that end a response (E may be 0);
    ``unembed_VD`` and the attention's options are passed on to ``decode_forward``.
    """
    model: Qwen2 = nnx.merge(graphdef, params)
    logits_BV, cache = decode_forward(
        model,
        state.tokens,
        ~state.done,
        state.cache,
        unembed_VD,
        layer_unroll=layer_unroll,
        ragged=ragged,
        attention=attention,
    )
    return sample_next(state, logits_BV, cache, eos_E, sampling)


def sample_next(
    state: DecodeState, logits_BV: jax.Array, cache: KVCache, eos_E: jax.Array, sampling
) -> tuple[DecodeState, StepOutput]:
    """The second half of a decode step: sample from ``logits_BV`` and advance ``state``
    (its cache replaced by ``cache``, the forward's)."""
    live_B = ~state.done
    keys_B = jax.vmap(jax.random.fold_in)(state.keys, state.steps)
    d = sampling_lib.draw(logits_BV, keys_B, sampling)
    steps_B = state.steps + live_B.astype(jnp.int32)
    finished_B = live_B & (_eos_hit(d.tokens, eos_E) | (steps_B >= state.max_new))
    new = dataclasses.replace(
        state,
        cache=cache,
        tokens=jnp.where(live_B, d.tokens, state.tokens),
        steps=steps_B,
        done=state.done | finished_B,
    )
    return new, StepOutput(*d, valid=live_B, done=finished_B)
