"""Decode-slot inference engine over Qwen2 (JetStream API): prefill, insert, generate."""

from __future__ import annotations

import copy
import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from magic_jax.model.kv_cache import KVCache
from magic_jax.model.qwen2 import Qwen2, abstract_model
from magic_jax.model.sharding import SAMPLE_RULES, Rules, logical_to_spec, model_shardings
from magic_jax.rollout import engine_config
from magic_jax.rollout import sampling as sampling_lib
from magic_jax.rollout.attention import DecodeAttention, get_attention
from magic_jax.rollout.decode import (
    DecodeState,
    Prefix,
    StepOutput,
    decode_step,
    insert_fn,
    insert_group_fn,
    prefill_fn,
    reprefill_fn,
)
from magic_jax.rollout.decode_loop import decode_chunk_fn
from magic_jax.rollout.engine_config import (  # noqa: F401  (re-exported)
    DECODE_LAYERS,
    ENGINE_DTYPES,
    LAYER_UNROLL_DEFAULT,
    LIGHT_COMPACT_FRACTION,
    LIGHT_STEP_FLOPS,
    SPLIT_MAX_LAYERS,
    EngineConfig,
    EngineOptions,
    default_layer_unroll,
)
from magic_jax.rollout.ragged_attention import RaggedSpec
from magic_jax.rollout.sampling import SamplingConfig


def _is_float(x: jax.Array | np.ndarray) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


_COMPILED_LOCK = threading.Lock()


@functools.cache
def _compiled(
    name: str,
    graphdef: nnx.GraphDef,
    shardings: DecodeState | None,
    mesh: Mesh | None,
    sampling: SamplingConfig,
    statics: tuple[tuple[str, object], ...],
) -> jax.stages.Wrapped:
    """The jitted engine functions, shared by every engine with the same model graph,
    shardings (``Engine.state_shardings``, on ``mesh``) and static settings (so a new
    engine per stage does not recompile)."""
    # the static options go on as keywords, of several types: each function checks its own
    kw: dict[str, Any] = dict(statics)
    # What the host reads (sampled tokens, log-probs, step counts; a few KB) comes back
    # replicated on every device: with several processes, each one then holds all of
    # it and reads it locally (np.asarray of a slot-sharded output would need devices
    # of other processes), and every process makes the same scheduling decisions.
    host = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    if name == "prefill":
        return jax.jit(functools.partial(prefill_fn, graphdef))
    if name == "unembed_VD":
        return jax.jit(lambda params: nnx.merge(graphdef, params).unembedding().T)
    fn: Callable[..., Any]
    if name == "insert":
        fn = functools.partial(insert_fn, sampling=sampling)
        return jax.jit(fn, donate_argnums=1, out_shardings=(shardings, host))
    if name == "insert_group":
        fn = functools.partial(insert_group_fn, sampling=sampling)
        return jax.jit(fn, donate_argnums=1, out_shardings=(shardings, host))
    if name == "reprefill":
        return jax.jit(reprefill_fn, donate_argnums=1, out_shardings=shardings)
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
        self._mesh = mesh
        self._rules = rules
        self.param_shardings = None if mesh is None else model_shardings(abstract, mesh, rules)
        self.eos_ids = tuple(config.eos_ids if config.eos_ids is not None else model.config.eos_ids)
        self._shardings = self.state_shardings()
        self._cast: Callable[[nnx.State], nnx.State] | None = None
        self._fns: dict[tuple, jax.stages.Wrapped] = {}
        eos_E = np.asarray(self.eos_ids, np.int32).reshape(-1)
        self._eos_E: jax.Array | jax.ShapeDtypeStruct
        if mesh is not None and set(mesh.devices.flat).isdisjoint(jax.devices()):
            # A mesh of compile-only devices (magic_jax.jobs.plan) holds no data: shapes only.
            self._eos_E = jax.ShapeDtypeStruct(
                eos_E.shape, eos_E.dtype, sharding=self._sharding((), ())
            )
        else:
            self._eos_E = jax.device_put(eos_E, None if mesh is None else self._sharding((), ()))

    def with_sampling(self, sampling: SamplingConfig) -> Engine:
        """This engine with another sampling strategy: the same graph, shardings and
        shapes (so the same decode state fits both); its programs compile for ``sampling``."""
        other = copy.copy(self)
        other.config = dataclasses.replace(self.config, sampling=sampling)
        return other

    @property
    def layer_unroll(self) -> int | bool:
        """The decode loop's layer unroll (the config's, or the platform default)."""
        u = self.config.layer_unroll
        if u is None:
            u = default_layer_unroll(self._platform())
        return u

    @functools.cached_property
    def attention(self) -> DecodeAttention:
        """The decode attention (``EngineConfig.decode_attention``), looked up once here:
        a registered one is a static argument of the compiled decode programs."""
        mode = self.config.decode_attention
        if mode is None:
            platform = self._platform() or jax.default_backend()
            mode = "ragged" if platform in ("tpu", "gpu") else "dense"
        return get_attention(mode)

    @functools.cached_property
    def ragged_spec(self) -> RaggedSpec | None:
        """The ragged decode attention's settings, or None for a dense product (where
        the kernel does not apply, ``ragged_attention.applies``, the step runs dense)."""
        if not self.attention.ragged:
            return None
        platform = self._platform() or jax.default_backend()
        backend = platform if platform in ("tpu", "gpu") else "interpret"
        kv = self._kv_sharding()
        if kv is None:
            return RaggedSpec(backend)
        spec = tuple(kv.spec) + (None,) * (5 - len(kv.spec))  # [B, L, K, S, H]
        return RaggedSpec(backend, self._mesh, spec[0], spec[2])

    def _platform(self) -> str | None:
        """The mesh's device platform; None without a mesh."""
        return None if self._mesh is None else self._mesh.devices.flat[0].platform

    @functools.cached_property
    def light_cpu_step(self) -> bool:
        """Whether a decode step over all slots is light (``LIGHT_STEP_FLOPS``) on CPU."""
        platform = self._platform() or jax.default_backend()
        rows = self.config.max_concurrent_decodes
        return platform == "cpu" and engine_config.light_step(self.model_config.num_params(), rows)

    def compact_sizes(self) -> tuple[int, ...]:
        """``EngineConfig.compact_sizes``, down to a quarter of the slots for a light CPU
        step (``LIGHT_COMPACT_FRACTION``)."""
        b = self.config.max_concurrent_decodes
        return self.config.compact_sizes(
            min_rows=b // LIGHT_COMPACT_FRACTION if self.light_cpu_step else 1
        )

    @property
    def split_layers(self) -> bool:
        """Whether the decode loop holds each layer's cache apart (``decode_layers``)."""
        mode = self.config.decode_layers
        if mode is None:
            few = self.model_config.num_layers <= SPLIT_MAX_LAYERS
            mode = "split" if self.light_cpu_step and few else "scan"
        return mode == "split"

    def decode_statics(self) -> dict[str, object]:
        """The decode step's static options: the layer unroll, the ragged kernel's
        settings (``ragged_spec``) and a registered attention's
        product (``attention``, only then: the built-ins' programs keep their keys)."""
        statics: dict[str, object] = dict(layer_unroll=self.layer_unroll, ragged=self.ragged_spec)
        if self.attention.attend is not None:
            statics["attention"] = self.attention.attend
        return statics

    @property
    def eos_array(self) -> jax.Array | jax.ShapeDtypeStruct:
        """[E] int32 ids that end a response, on device (E may be 0); on a mesh of
        compile-only devices, their shape."""
        return self._eos_E

    def _fn(self, name: str, **statics: object) -> jax.stages.Wrapped:
        # Memoised per engine: ``_compiled``'s own cache hashes the whole graph on every
        # lookup, and the rollout loop asks once per prefill, insert and decode chunk.
        key = (name, tuple(statics.items()), self.config.sampling)
        fn = self._fns.get(key)
        if fn is None:
            with _COMPILED_LOCK:  # the driver's lanes ask from several threads
                fn = self._fns.get(key)
                if fn is None:
                    fn = self._fns[key] = _compiled(
                        name,
                        self.graphdef,
                        self._shardings,
                        self._mesh,
                        self.config.sampling,
                        key[1],
                    )
        return fn

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

    def _kv_sharding(self) -> NamedSharding | None:
        """The cache's keys' (and values') sharding, [B, L, K, S, H]."""
        cfg, mc = self.config, self.model_config
        return self._sharding(
            ("batch", "layers", "kv_heads", None, None),
            (
                cfg.max_concurrent_decodes,
                mc.num_layers,
                mc.num_kv_heads,
                cfg.cache_length,
                mc.head_size,
            ),
        )

    def state_shardings(self) -> DecodeState | None:
        """Shardings of the decode state: slots over the data axes, kv heads over tensor.

        A ``DecodeState`` whose leaves are ``NamedSharding`` s (JAX's pytree of
        shardings), which its array-typed fields cannot say: hence the ignore."""
        if self._mesh is None:
            return None
        cfg, mc = self.config, self.model_config
        b, s = cfg.max_concurrent_decodes, cfg.cache_length
        kv = self._kv_sharding()
        scale = None
        if cfg.kv_dtype == "int8":
            scale = self._sharding(
                ("batch", "layers", "kv_heads", None), (b, mc.num_layers, mc.num_kv_heads, s)
            )
        vec = self._sharding(("batch",), (b,))
        pos = self._sharding(("batch", None), (b, s))
        return DecodeState(KVCache(kv, kv, pos, vec, scale, scale), vec, vec, vec, vec, vec)  # type: ignore[arg-type]

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
                cache=KVCache.init(self.model_config, b, cfg.cache_length, kv_dtype=cfg.kv_dtype),
                tokens=jnp.zeros((b,), jnp.int32),
                keys=jax.random.split(jax.random.key(0), b),
                steps=jnp.zeros((b,), jnp.int32),
                max_new=jnp.zeros((b,), jnp.int32),
                done=jnp.ones((b,), bool),
            )

        shardings = self.state_shardings()
        # Committed to the device, as every later state (an insert's or a chunk's
        # output) is: an uncommitted first state compiled the first insert twice.
        placed = SingleDeviceSharding(jax.devices()[0]) if shardings is None else shardings
        return jax.jit(make, out_shardings=placed)()

    # ------------------------------------------------------------------ the contract

    def prefill(
        self,
        params: nnx.State,
        tokens: Sequence[int] | np.ndarray,
        *,
        true_length: int | None = None,
    ) -> Prefix:
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

    def reprefill(
        self, params: nnx.State, state: DecodeState, slot: int, tokens: np.ndarray
    ) -> DecodeState:
        """Prefills ``tokens`` (what row ``slot``'s cache holds: its prompt and response
        so far, the newest token excepted) again under ``params`` into that row (donating
        ``state``); the row's next token and sampling state are kept. Lengths are padded
        to the prefill buckets, then to powers of two, up to the cache length."""
        n, s_max = len(tokens), self.config.cache_length
        if not 0 < n <= s_max:
            raise ValueError(f"re-prefill of {n} tokens is not in [1, cache_length={s_max}]")
        bucket = next((b for b in self.config.buckets() if b >= n), None)
        if bucket is None:
            bucket = min(s_max, 1 << (n - 1).bit_length())
        padded = np.zeros((bucket,), np.int32)
        padded[:n] = tokens
        prefix = self._fn("prefill")(params, jnp.asarray(padded), jnp.int32(n))
        return self._fn("reprefill")(prefix, state, jnp.int32(slot))

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
        slots: Sequence[int] | np.ndarray,
        *,
        seed: int,
        step: int,
        prompt: int,
        samples: Sequence[int] | np.ndarray,
        max_new_tokens: int | Sequence[int] | np.ndarray,
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
        return self._fn("generate", **self.decode_statics())(params, state, self._eos_E)

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
            split_layers=self.split_layers,
            **self.decode_statics(),
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
