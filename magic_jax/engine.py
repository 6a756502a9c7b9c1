"""Decode-slot inference engine over Qwen2 (JetStream API): prefill, insert, generate."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from magic_jax import sampling as sampling_lib
from magic_jax.model import KVCache, Qwen2, abstract_model, check_unroll
from magic_jax.sampling import SamplingConfig
from magic_jax.sharding import SAMPLE_RULES, Rules, logical_to_spec, model_shardings

ENGINE_DTYPES = (None, "float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Shapes and schedule of the decode engine.

    Attributes:
      max_concurrent_decodes: B, the number of decode slots (fixed; the KV cache
        is preallocated for all of them).
      max_prefill_length: longest prompt in tokens.
      max_decode_length: longest response in tokens (the stage's T).
      prefill_buckets: prompt lengths are right-padded up to the first bucket that
        fits (one compilation per bucket). Default: powers of two from 16, then
        ``max_prefill_length``.
      decode_steps: most decode steps run on device per host round trip.
      cache_bucket: the attended cache length is the longest live row rounded up
        to a multiple of this (one compilation per length); 0 attends the whole cache.
      compact_batch: once no request waits, decode only the live rows, in a batch
        of the next size in ``compact_sizes()`` (one compilation per size).
      sampling: the sampling strategy.
      eos_ids: ids that end a response; None takes the model config's.
      layer_unroll: how the decode step runs the stacked layers: ``True`` inlines
        every layer (static weight slices), an int n unrolls the layer scan n at
        a time, 1 is a plain scan. None takes ``default_layer_unroll()`` for
        the platform. Logits are the same either way; only speed and compile
        time change.
      dtype: the engine's weight, compute and KV-cache dtype (``"bfloat16"`` or
        ``"float32"``), independent of the policy's master weights: the weights
        are cast when they are placed (``Engine.load_params``). None keeps the
        model's own. Norms, softmax, RoPE and the sampling distribution stay fp32.
    """

    max_concurrent_decodes: int = 32
    max_prefill_length: int = 1024
    max_decode_length: int = 1024
    prefill_buckets: tuple[int, ...] = ()
    decode_steps: int = 64
    cache_bucket: int = 128
    compact_batch: bool = True
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    eos_ids: tuple[int, ...] | None = None
    layer_unroll: int | bool | None = None
    dtype: str | None = None

    def __post_init__(self):
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(
                f"EngineConfig.dtype must be one of {ENGINE_DTYPES}, got {self.dtype!r}"
            )
        check_unroll("EngineConfig.layer_unroll", self.layer_unroll, allow_none=True)
        for name in ("max_concurrent_decodes", "max_prefill_length", "max_decode_length"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive, got {getattr(self, name)}")
        if self.decode_steps <= 0:
            raise ValueError(f"EngineConfig.decode_steps must be positive, got {self.decode_steps}")
        if self.cache_bucket < 0:
            raise ValueError(f"EngineConfig.cache_bucket must be >= 0, got {self.cache_bucket}")
        if any(b <= 0 for b in self.prefill_buckets) or list(self.prefill_buckets) != sorted(
            set(self.prefill_buckets)
        ):
            raise ValueError(
                f"EngineConfig.prefill_buckets must be increasing positive lengths, "
                f"got {self.prefill_buckets}"
            )
        if self.prefill_buckets and self.prefill_buckets[-1] < self.max_prefill_length:
            raise ValueError(
                f"EngineConfig.prefill_buckets' largest ({self.prefill_buckets[-1]}) is below "
                f"max_prefill_length ({self.max_prefill_length})"
            )

    @property
    def cache_length(self) -> int:
        """S, slots per row of the KV cache: the longest prompt plus the longest response."""
        return self.max_prefill_length + self.max_decode_length

    def compact_sizes(self) -> tuple[int, ...]:
        """Batch sizes for compacted decoding: halvings of the slots down to a sixteenth.

        Each size is one compiled decode loop, so there are at most five. A
        decode step's cost grows slowly with its rows (weights are read once per
        step whatever the rows), so the rows a halving leaves idle cost little,
        and below B/16 live rows the step runs at B/16 (measured in
        benchmarks/rollout.py: W2's long tail).
        """
        b = self.max_concurrent_decodes
        sizes, s = {b}, b
        while s % 2 == 0 and s // 2 >= max(1, b // 16):
            s //= 2
            sizes.add(s)
        return tuple(sorted(sizes))

    def buckets(self) -> tuple[int, ...]:
        if self.prefill_buckets:
            return self.prefill_buckets
        out, b = [], 16
        while b < self.max_prefill_length:
            out.append(b)
            b *= 2
        return (*out, self.max_prefill_length)


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


# Measured default of ``EngineConfig.layer_unroll`` per platform. CPU (2-core AMD EPYC,
# benchmarks/rollout.py W1, 58M model, batch 32): a plain scan 18.5 ms per decode step,
# unroll 2 22.3 ms, every layer inlined 29.7 ms, unstacked layers in a Python loop
# 24.8 ms: the scan stays. GPU and TPU were not measured: they keep the scan too until
# a measurement says otherwise (set the option to compare).
LAYER_UNROLL_DEFAULT: dict[str, int | bool] = {"cpu": 1}


def default_layer_unroll(platform: str | None = None) -> int | bool:
    """The decode loop's layer unroll for ``platform`` (default: jax's default backend)."""
    return LAYER_UNROLL_DEFAULT.get(platform or jax.default_backend(), 1)


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


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
    first = sampling_lib.draw(prefix.logits[None], jax.random.fold_in(key, 0)[None], sampling)
    c = state.cache

    def put(buf_LBSKH, row_L1PKH):
        at = (0, slot, 0, 0, 0)
        return jax.lax.dynamic_update_slice(buf_LBSKH, row_L1PKH.astype(buf_LBSKH.dtype), at)

    pos_1S = jnp.full((1, c.max_len), -1, jnp.int32)
    pos_1S = jax.lax.dynamic_update_slice(pos_1S, prefix.cache.pos, (0, 0))
    cache = KVCache(
        k=put(c.k, prefix.cache.k),
        v=put(c.v, prefix.cache.v),
        pos=jax.lax.dynamic_update_slice(c.pos, pos_1S, (slot, 0)),
        lengths=c.lengths.at[slot].set(prefix.length),
    )
    done = _eos_hit(first.tokens, eos_E)[0] | (max_new <= 1)
    state = DecodeState(
        cache=cache,
        tokens=state.tokens.at[slot].set(first.tokens[0]),
        keys=state.keys.at[slot].set(key),
        steps=state.steps.at[slot].set(1),
        max_new=state.max_new.at[slot].set(max_new),
        done=state.done.at[slot].set(done),
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
    draws = []
    for i in range(slots_n.shape[0]):
        key = sampling_lib.sample_key(seed, step, prompt, samples_n[i])
        state, d = insert_fn(prefix, state, slots_n[i], key, max_new_n[i], eos_E, sampling=sampling)
        draws.append(d)
    return state, jax.tree.map(lambda *x: jnp.stack(x), *draws)


def _write_slot(buf_BSX: jax.Array, new_BX: jax.Array, at_B: jax.Array) -> jax.Array:
    """Writes ``new_BX[b]`` at slot ``at_B[b]`` of row b (in place under donation)."""
    zeros = (0,) * (buf_BSX.ndim - 2)
    return jax.vmap(lambda r, n, i: jax.lax.dynamic_update_slice(r, n[None], (i, *zeros)))(
        buf_BSX, new_BX.astype(buf_BSX.dtype), at_B
    )


def _decode_attention(q_BKGH, k_BSKH, v_BSKH, allowed_BS):
    """One query per row against the whole cache, without relayouting the cache.

    A [B, K, ...]-batched einsum over the [B, S, K, H] cache makes XLA transpose the
    whole cache every layer and step (measured: most of the decode step at long
    S on CPU). Here both products keep the cache as stored, [B, S*K, H] and
    [B, S, K*H], and compute every (query head, kv head) pair; the K x K blocks
    off the diagonal are discarded (K x the score flops, which are tiny at T = 1).
    """
    b, kh, g, h = q_BKGH.shape
    s = k_BSKH.shape[1]
    # The query takes the cache's dtype, so the program holds no float32 copy of a
    # bf16 cache; both products accumulate in fp32.
    q_BNH = q_BKGH.reshape(b, kh * g, h).astype(k_BSKH.dtype)
    scores_BMN = jnp.einsum(
        "bmh,bnh->bmn",
        k_BSKH.reshape(b, s * kh, h),
        q_BNH,
        preferred_element_type=jnp.float32,
    )  # M = (S, K'), N = (K, G)
    eye_KK = jnp.eye(kh, dtype=bool)
    scores_BSKKG = scores_BMN.reshape(b, s, kh, kh, g)  # [b, s, k', k, g]
    scores_BKGS = jnp.sum(
        jnp.where(eye_KK[None, None, :, :, None], scores_BSKKG, 0.0), axis=2
    ).transpose(0, 2, 3, 1)
    scores_BKGS = scores_BKGS * (h**-0.5)
    scores_BKGS = jnp.where(allowed_BS[:, None, None, :], scores_BKGS, jnp.finfo(jnp.float32).min)
    probs_BNS = jax.nn.softmax(scores_BKGS, axis=-1).reshape(b, kh * g, s).astype(v_BSKH.dtype)
    out_BNKH = jnp.einsum(
        "bns,bsm->bnm",
        probs_BNS,
        v_BSKH.reshape(b, s, kh * h),
        preferred_element_type=jnp.float32,
    ).reshape(b, kh, g, kh, h)
    return jnp.sum(jnp.where(eye_KK[None, :, None, :, None], out_BNKH, 0.0), axis=3)


def decode_forward(
    model: Qwen2,
    tokens_B: jax.Array,
    live_B: jax.Array,
    cache: KVCache,
    unembed_VD: jax.Array | None = None,
    *,
    layer_unroll: int | bool = 1,
) -> tuple[jax.Array, KVCache]:
    """The model's forward for one new token per row, with the decode attention above.

    The layers are the model's own ``DecoderLayer`` (run through
    ``model.run_layers``, one scan over the stacked layers), given the decode
    attention product (arranged for T = 1) as their ``attend``; the embedding,
    norms and unembedding are the model's too.
    Finished rows (``~live_B``) write a padding entry (pos -1) and do not advance.
    ``unembed_VD``, when given, is the model's unembedding stored transposed,
    [V, D]: XLA's CPU dot is ~2x faster contracting the weight's minor dimension
    (measured 10 vs 19 ms at B 32, D 512, V 32768), and transposing per call
    would cost more than it saves (37 ms), so the caller makes it once per weights.
    ``layer_unroll``: see ``EngineConfig.layer_unroll``.

    Returns:
      (logits [B, V], the cache with the token written).
    """
    cfg = model.config
    pos_B = cache.next_positions()
    at_B = jnp.minimum(cache.lengths, cache.max_len - 1)
    pos_BS = _write_slot(cache.pos[..., None], jnp.where(live_B, pos_B, -1)[:, None], at_B)[..., 0]
    allowed_BS = pos_BS >= 0

    def layer_fn(layer, x_B1D, xs):
        window, k_BSKH, v_BSKH = xs
        mask_BS = allowed_BS if window is None else allowed_BS & (pos_B[:, None] - pos_BS < window)

        def attend(q_B1KGH, k_B1KH, v_B1KH):
            k_BKH, v_BKH = k_B1KH[:, 0], v_B1KH[:, 0]
            out_BKGH = _decode_attention(
                q_B1KGH[:, 0],
                _write_slot(k_BSKH, k_BKH, at_B),
                _write_slot(v_BSKH, v_BKH, at_B),
                mask_BS,
            )
            # Only the new token's key and value leave the layer: returning the whole
            # updated cache slice would copy every layer's cache each step.
            return out_BKGH[:, None], (k_BKH, v_BKH)

        return layer(x_B1D, pos_B[:, None], attend)

    x_B1D = model.embed_tokens(tokens_B[:, None])
    x_B1D, (k_LBKH, v_LBKH) = model.run_layers(
        layer_fn, x_B1D, (model.layer_windows(), cache.k, cache.v), unroll=layer_unroll
    )
    x_BD = model.norm(x_B1D[:, 0])
    dt = jnp.dtype(cfg.dtype)
    if unembed_VD is None:
        logits_BV = jnp.dot(x_BD.astype(dt), model.unembedding().astype(dt))
    else:
        logits_BV = jnp.einsum("bd,vd->bv", x_BD.astype(dt), unembed_VD.astype(dt))
    lengths_B = jnp.where(live_B, cache.lengths + 1, cache.lengths)
    write = jax.vmap(_write_slot, in_axes=(0, 0, None))
    new = KVCache(
        k=write(cache.k, k_LBKH, at_B),
        v=write(cache.v, v_LBKH, at_B),
        pos=pos_BS,
        lengths=lengths_B,
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
) -> tuple[DecodeState, StepOutput]:
    """One token for every live slot: feed the last token, sample the next.

    ``eos_E`` [E] int32 holds the ids that end a response (E may be 0);
    ``unembed_VD`` is passed on to ``decode_forward``.
    """
    model: Qwen2 = nnx.merge(graphdef, params)
    live_B = ~state.done
    logits_BV, cache = decode_forward(
        model, state.tokens, live_B, state.cache, unembed_VD, layer_unroll=layer_unroll
    )
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


def _take_rows(state: DecodeState, rows_b: jax.Array | None, attend: int) -> DecodeState:
    """The sub-state of ``rows_b`` (all rows if None) with the cache cut to ``attend`` slots."""

    def take(x, axis=0):
        return x if rows_b is None else jnp.take(x, rows_b, axis=axis)

    c = state.cache
    cache = KVCache(
        k=take(c.k, axis=1)[:, :, :attend],
        v=take(c.v, axis=1)[:, :, :attend],
        pos=take(c.pos)[:, :attend],
        lengths=take(c.lengths),
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

    def put_kv(full_LBSKH, part_LbsKH):
        if rows_b is None:
            return jax.lax.dynamic_update_slice(full_LBSKH, part_LbsKH, (0,) * full_LBSKH.ndim)
        return full_LBSKH.at[:, rows_b, :attend].set(part_LbsKH)

    def put_vec(full, part):
        return part if rows_b is None else full.at[rows_b].set(part)

    c, s = state.cache, sub.cache
    cache = KVCache(
        k=put_kv(c.k, s.k),
        v=put_kv(c.v, s.v),
        pos=put(c.pos, s.pos),
        lengths=put_vec(c.lengths, s.lengths),
    )
    rest = {
        f: put_vec(getattr(state, f), getattr(sub, f))
        for f in ("tokens", "keys", "steps", "max_new", "done")
    }
    return DecodeState(cache=cache, **rest)


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
) -> tuple[DecodeState, StepOutput, jax.Array]:
    """Up to ``num_steps`` decode steps on device, stopping early when the host has work.

    The loop runs on rows ``rows_b`` (all if None) with the cache cut to its first
    ``attend`` slots, and stops when: every row is done; ``stop_on_free`` (an int32
    count, 0 = never) rows finished (so the host can refill them: a whole group
    at once); at most ``min_live`` rows are live (so
    the host can compact); or a live row reached ``attend``. ``unembed_VD`` is
    ``Engine.decode_unembedding(params)``, or None for the model's own layout.

    Returns:
      (state, outputs [num_steps, b] (rows past the step count are invalid), steps run).
    """
    sub = _take_rows(state, rows_b, attend)
    b = sub.tokens.shape[0]
    done0_b = sub.done
    zf = jnp.zeros((num_steps, b), jnp.float32)
    zb = jnp.zeros((num_steps, b), bool)
    outs0 = StepOutput(jnp.zeros((num_steps, b), jnp.int32), zf, zf, zf, zb, zb)

    def cond(carry):
        i, sub, _ = carry
        live = ~sub.done
        longest = jnp.max(jnp.where(live, sub.cache.lengths, 0))
        freed = jnp.sum(sub.done & ~done0_b)
        return (
            (i < num_steps)
            & (jnp.sum(live) > min_live)
            & ~((stop_on_free > 0) & (freed >= stop_on_free))
            & (longest < attend)
        )

    def body(carry):
        i, sub, outs = carry
        sub, out = decode_step(
            graphdef,
            params,
            sub,
            eos_E,
            sampling=sampling,
            unembed_VD=unembed_VD,
            layer_unroll=layer_unroll,
        )
        outs = jax.tree.map(lambda o, x: o.at[i].set(x), outs, out)
        return i + 1, sub, outs

    n, sub, outs = jax.lax.while_loop(cond, body, (jnp.int32(0), sub, outs0))
    return _put_rows(state, sub, rows_b), outs, n


@functools.cache
def _compiled(
    name: str, graphdef: nnx.GraphDef, shardings: Any, sampling: SamplingConfig, statics: tuple
) -> Any:
    """The jitted engine functions, shared by every engine with the same model graph,
    shardings and static settings (so a new engine per stage does not recompile)."""
    kw = dict(statics)
    # What the host reads (sampled tokens, log-probs, step counts; a few KB) comes back
    # replicated on every device: with several processes, each one then holds all of
    # it and reads it locally (np.asarray of a slot-sharded output would need devices
    # of other processes), and every process makes the same scheduling decisions.
    host = None if shardings is None else NamedSharding(shardings.tokens.mesh, PartitionSpec())
    if name == "prefill":
        return jax.jit(functools.partial(prefill_fn, graphdef))
    if name == "unembed_VD":
        return jax.jit(lambda params: nnx.merge(graphdef, params).unembedding().T)
    if name == "insert":
        fn = functools.partial(insert_fn, sampling=sampling)
        return jax.jit(fn, donate_argnums=1, out_shardings=(shardings, host))
    if name == "insert_group":
        fn = functools.partial(insert_group_fn, sampling=sampling)
        return jax.jit(fn, donate_argnums=1, out_shardings=(shardings, host))
    if name == "generate":
        fn = functools.partial(decode_step, graphdef, sampling=sampling, **kw)
        return jax.jit(fn, donate_argnums=1, out_shardings=(shardings, host))
    fn = functools.partial(decode_chunk_fn, graphdef, sampling=sampling, **kw)
    return jax.jit(fn, donate_argnums=1, out_shardings=(shardings, host, host))


class Engine:
    """Prefill / insert / generate over ``max_concurrent_decodes`` slots.

    The JetStream contract, natively: ``prefill`` turns a prompt into a
    ``Prefix``; ``insert`` copies it into a free slot of the preallocated
    ``DecodeState`` (in place: the state is donated); ``generate`` runs one decode
    step for all slots, ``generate_chunk`` several without a host round trip.
    Parameters are placed with the sampling rule table (tensor parallel) and the
    slots split over the data axes of ``mesh``.
    """

    def __init__(
        self,
        model: Qwen2,
        config: EngineConfig,
        *,
        mesh: Mesh | None = None,
        rules: Rules = SAMPLE_RULES,
    ):
        self.config = config
        mc = model.config
        if config.dtype is not None and (mc.param_dtype, mc.dtype) != (config.dtype,) * 2:
            # the engine's own graph in its dtype; the policy's weights are cast to it
            mc = dataclasses.replace(mc, param_dtype=config.dtype, dtype=config.dtype)
            model = abstract_model(mc)
        self.model_config = mc
        self.graphdef, abstract = nnx.split(model)
        self._abstract_params = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract
        )
        self._mesh, self._rules = mesh, rules
        self.param_shardings = None if mesh is None else model_shardings(abstract, mesh, rules)
        self.eos_ids = tuple(config.eos_ids if config.eos_ids is not None else model.config.eos_ids)
        self._shardings = self.state_shardings()
        self._cast = None
        eos_E = np.asarray(self.eos_ids, np.int32).reshape(-1)
        if mesh is not None and set(mesh.devices.flat).isdisjoint(jax.devices()):
            # A mesh of compile-only devices (magic_jax.plan) holds no data: shapes only.
            self._eos_E = jax.ShapeDtypeStruct(
                eos_E.shape, eos_E.dtype, sharding=self._sharding((), ())
            )
        else:
            self._eos_E = jax.device_put(eos_E, None if mesh is None else self._sharding((), ()))

    @property
    def layer_unroll(self) -> int | bool:
        """The decode loop's layer unroll (the config's, or the platform default)."""
        u = self.config.layer_unroll
        if u is None:
            platform = None if self._mesh is None else self._mesh.devices.flat[0].platform
            u = default_layer_unroll(platform)
        return u

    @property
    def eos_array(self) -> jax.Array:
        """[E] int32 ids that end a response, on device (E may be 0)."""
        return self._eos_E

    def _fn(self, name: str, **statics: Any) -> Any:
        key = tuple(statics.items())
        return _compiled(name, self.graphdef, self._shardings, self.config.sampling, key)

    # ------------------------------------------------------------------ placement

    @property
    def mesh(self) -> Mesh | None:
        return self._mesh

    @property
    def max_concurrent_decodes(self) -> int:
        return self.config.max_concurrent_decodes

    @property
    def max_prefill_length(self) -> int:
        return self.config.max_prefill_length

    def _sharding(self, names: tuple, shape: tuple) -> NamedSharding | None:
        if self._mesh is None:
            return None
        return NamedSharding(self._mesh, logical_to_spec(names, self._rules, self._mesh, shape))

    def state_shardings(self) -> DecodeState | None:
        """Shardings of the decode state: slots over the data axes, kv heads over tensor."""
        if self._mesh is None:
            return None
        cfg, mc = self.config, self.model_config
        b, s = cfg.max_concurrent_decodes, cfg.cache_length
        kv = self._sharding(
            ("layers", "batch", None, "kv_heads", None),
            (mc.num_layers, b, s, mc.num_kv_heads, mc.head_size),
        )
        vec = self._sharding(("batch",), (b,))
        return DecodeState(
            cache=KVCache(
                k=kv,
                v=kv,
                pos=self._sharding(("batch", None), (b, s)),
                lengths=vec,
            ),
            tokens=vec,
            keys=vec,
            steps=vec,
            max_new=vec,
            done=vec,
        )

    @property
    def abstract_params(self) -> nnx.State:
        """Shapes and dtypes of the engine's weights (``ShapeDtypeStruct`` leaves)."""
        return self._abstract_params

    def load_params(self, model_or_params: Qwen2 | nnx.State) -> nnx.State:
        """The parameters of a model (or a state), cast to the engine's dtype and placed
        with the sampling shardings: one compiled program, so the trainer's shards move
        by collectives on device (never through the host) and no second full-precision
        copy is made. The trainer's arrays are left intact."""
        params = (
            nnx.state(model_or_params)
            if isinstance(model_or_params, nnx.Module)
            else model_or_params
        )
        want = jnp.dtype(self.model_config.param_dtype)
        same = all(x.dtype == want for x in jax.tree.leaves(params) if _is_float(x))
        if same and self.param_shardings is None:
            return params
        if self.mesh is not None:
            mesh_devices = set(self.mesh.devices.flat)
            if any(set(x.sharding.device_set) != mesh_devices for x in jax.tree.leaves(params)):
                # weights on other devices (a model loaded on one device): placed first,
                # since one program cannot take inputs and give outputs on different devices
                params = jax.device_put(params, self.param_shardings)
                if same:
                    return params
        if self._cast is None:
            self._cast = jax.jit(
                lambda p: jax.tree.map(lambda x: x.astype(want) if _is_float(x) else x, p),
                out_shardings=self.param_shardings,
            )
        return self._cast(params)

    def init_decode_state(self) -> DecodeState:
        """All slots empty (done), the KV cache preallocated."""
        cfg, b = self.config, self.config.max_concurrent_decodes

        def make():
            return DecodeState(
                cache=KVCache.init(self.model_config, b, cfg.cache_length),
                tokens=jnp.zeros((b,), jnp.int32),
                keys=jax.random.split(jax.random.key(0), b),
                steps=jnp.zeros((b,), jnp.int32),
                max_new=jnp.zeros((b,), jnp.int32),
                done=jnp.ones((b,), bool),
            )

        return jax.jit(make, out_shardings=self.state_shardings())()

    # ------------------------------------------------------------------ the contract

    def prefill(self, params: nnx.State, tokens: Any, *, true_length: int | None = None) -> Prefix:
        """Prefills one prompt (1-D token ids; padding past ``true_length`` ignored)."""
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        n = len(tokens) if true_length is None else int(true_length)
        if not 0 < n <= self.config.max_prefill_length:
            raise ValueError(
                f"prompt length {n} is not in [1, max_prefill_length="
                f"{self.config.max_prefill_length}]"
            )
        bucket = next(b for b in self.config.buckets() if b >= n)
        padded = np.zeros((bucket,), np.int32)
        padded[:n] = tokens[:n]
        return self._fn("prefill")(params, jnp.asarray(padded), jnp.int32(n))

    def insert(
        self,
        prefix: Prefix,
        state: DecodeState,
        slot: int,
        *,
        key: jax.Array,
        max_new_tokens: int | None = None,
    ) -> tuple[DecodeState, sampling_lib.Draw]:
        """Puts ``prefix`` in ``slot`` (donating ``state``) and samples token 0 with
        ``fold_in(key, 0)``; returns the new state and that token's ``Draw``."""
        limit = self.config.max_decode_length if max_new_tokens is None else max_new_tokens
        if not 0 < limit <= self.config.max_decode_length:
            raise ValueError(
                f"max_new_tokens {limit} is not in [1, {self.config.max_decode_length}]"
            )
        return self._fn("insert")(
            prefix, state, jnp.int32(slot), key, jnp.int32(limit), self._eos_E
        )

    def insert_group(
        self,
        prefix: Prefix,
        state: DecodeState,
        slots: Any,
        *,
        seed: int,
        step: int,
        prompt: int,
        samples: Any,
        max_new_tokens: Any,
    ) -> tuple[DecodeState, sampling_lib.Draw]:
        """Puts ``prefix`` in several ``slots`` in one call (donating ``state``).

        Sample ``samples[i]`` goes to ``slots[i]`` with the key
        ``sample_key(seed, step, prompt, samples[i])`` and its own limit
        ``max_new_tokens[i]``; the same as one ``insert`` per sample. Returns
        the new state and the first draws, stacked [n].
        """
        slots = np.asarray(slots, np.int32).reshape(-1)
        samples = np.asarray(samples, np.int32).reshape(-1)
        limits = np.broadcast_to(np.asarray(max_new_tokens, np.int32), slots.shape)
        bad = limits[(limits <= 0) | (limits > self.config.max_decode_length)]
        if bad.size:
            raise ValueError(
                f"max_new_tokens {int(bad[0])} is not in [1, {self.config.max_decode_length}]"
            )
        return self._fn("insert_group")(
            prefix,
            state,
            slots,
            np.int32(seed),
            np.int32(step),
            np.int32(prompt),
            samples,
            np.ascontiguousarray(limits),
            self._eos_E,
        )

    def generate(self, params: nnx.State, state: DecodeState) -> tuple[DecodeState, StepOutput]:
        """One decode step for every slot (donates ``state``)."""
        return self._fn("generate", layer_unroll=self.layer_unroll)(params, state, self._eos_E)

    def decode_unembedding(self, params: nnx.State) -> jax.Array:
        """The unembedding of ``params`` as [V, D], on device, for ``generate_chunk``.

        Make it once per weights (it is a copy of the [D, V] matrix): the decode
        loop's logits are faster from this layout on CPU.
        """
        return self._fn("unembed_VD")(params)

    def generate_chunk(
        self,
        params: nnx.State,
        state: DecodeState,
        *,
        unembed_VD: jax.Array | None = None,
        rows: np.ndarray | None = None,
        attend: int | None = None,
        stop_on_free: bool | int = False,
        min_live: int = 0,
    ) -> tuple[DecodeState, StepOutput, jax.Array]:
        """Up to ``decode_steps`` decode steps in one call; see ``decode_chunk_fn``.

        ``stop_on_free``: stop once this many rows finished (True: one; False: never).

        ``unembed_VD`` from ``decode_unembedding(params)`` speeds the logits up.
        """
        attend = self.config.cache_length if attend is None else attend
        fn = self._fn(
            "chunk",
            num_steps=self.config.decode_steps,
            attend=attend,
            layer_unroll=self.layer_unroll,
        )
        rows_b = None if rows is None else jnp.asarray(rows, jnp.int32)
        return fn(
            params,
            state,
            unembed_VD,
            rows_b,
            jnp.int32(int(stop_on_free)),
            jnp.int32(min_live),
            self._eos_E,
        )
