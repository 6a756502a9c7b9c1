"""The decode engine's options (``EngineOptions``), its configuration (``EngineConfig``:
the options plus the shapes) and their measured defaults."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

import jax
from jax.sharding import Mesh

from magic_jax.model.config import check_unroll
from magic_jax.model.kv_cache import KV_DTYPES
from magic_jax.rollout.attention import get_attention
from magic_jax.rollout.sampling import SamplingConfig

ENGINE_DTYPES = (None, "float32", "bfloat16")
DECODE_LAYERS = (None, "scan", "split")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """The decode engine's options: what the trainer (``rollout:`` in a run config),
    ``magic-jax eval``, ``estimate-difficulty`` and ``plan`` set alike. The shapes
    (prompt and response limits) and the sampling come with the job (``EngineConfig``).

    Attributes:
      max_concurrent_decodes: B, decode slots over all lanes (the KV cache is
        preallocated for all of them).
      decode_steps: most decode steps run on device per host round trip.
      dtype: the engine's weights, matmuls and KV cache: ``bfloat16`` (half the bytes a
        decode step reads) or ``float32``; None keeps the model's own. Independent of
        the policy's master weights, which are cast when the engine takes them
        (``Engine.load_params``); norms, softmax, RoPE and the sampling distribution
        stay fp32. The trainer recomputes log-probs in its own precision and its
        ``sampler_*`` metrics log the mismatch (``loss.tis_cap`` corrects for it).
      kv_dtype: ``int8`` stores the KV cache as int8 with a float32 scale per token and
        kv head (``kv_cache.quantize_kv``), dequantized inside the decode attention:
        1 + 4/H bytes per element instead of 2 (bf16) or 4, so more slots fit. The
        prompt is prefilled in ``dtype`` and quantized when it is inserted. None keeps
        the cache in ``dtype``.
      decode_attention: ``ragged`` runs the decode attention as a Pallas kernel that
        reads only the cache slots each row holds (``ragged_attention``: the TPU kernel
        on TPU, the Triton kernel on GPU, the TPU kernel interpreted elsewhere: slow,
        for tests); ``dense`` reads the whole attended cache and masks it. None: ragged
        on TPU and GPU, dense on CPU. Ragged reads an int8 cache on TPU (and
        interpreted); on GPU an int8 cache, and on every platform layers with sliding
        windows, run dense. Any other name is a registered attention
        (``attention.register_attention``, docs/extending.md; a float cache).
      decode_layers: how the decode loop holds the cache and runs the layers.
        ``split``: each layer's keys and values as their own arrays for a decode chunk
        (split from the [B, L, K, S, H] cache once per chunk, stacked back at its end)
        and the layers a Python loop over static weight slices, so a step writes and
        reads each layer's cache in place; ``scan``: the layer scan over the whole
        cache, which copies each layer's slice out every step. None: split for a light
        step on CPU (``Engine.light_cpu_step``) of a model of at most
        ``SPLIT_MAX_LAYERS`` layers, else the scan. Split applies to the dense
        attention over a float cache (else the scan runs). Same logits either way.
      lanes: the slots split into this many decode lanes, each in its own host thread
        with its own compiled programs running at once (``driver.RolloutDriver``); it
        must divide ``max_concurrent_decodes``. None: the platform's measured default
        (``default_lanes``: 2 on CPU with 2+ cores, 16+ slots and a light decode step;
        else 1). The engine holds one lane's slots: ``make_driver`` builds it with
        ``max_concurrent_decodes / lanes`` slots and ``lanes=1``.
      compact_batch: once no request waits, decode only the live rows, in a batch of
        the next size in ``EngineConfig.compact_sizes`` (one compilation per size).
        XLA's CPU products round a row with its batch size (below 64 rows), so a
        step's rollout that resumes with only its unfinished groups is bit-identical
        to the uninterrupted one only with ``False``; with ``True`` the resumed groups
        draw with the same keys and differ in the last bits of their log-probs
        (docs/training.md).
        None: on, except on GPU, where XLA's compiler (jax 0.11.2, CUDA 13) fails on
        the compacted chunk (docs/testing.md).
      cache_bucket: the attended cache length is the longest live row rounded up to a
        multiple of this (one compilation per length); 0 attends the whole cache.
      layer_unroll: how the decode step runs the stacked layers: ``True`` inlines every
        layer (static weight slices), an int n unrolls the layer scan n at a time, 1
        is a plain scan. None takes ``default_layer_unroll()`` for the platform.
        Logits are the same either way; only speed and compile time change.
    """

    max_concurrent_decodes: int = 64
    decode_steps: int = 64
    dtype: Literal["float32", "bfloat16"] | None = None
    kv_dtype: Literal["int8"] | None = None
    decode_attention: str | None = None
    decode_layers: Literal["scan", "split"] | None = None
    lanes: int | None = None
    compact_batch: bool | None = None
    cache_bucket: int = 128
    layer_unroll: int | bool | None = None

    def __post_init__(self):
        for name in ("max_concurrent_decodes", "decode_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name}: must be positive, got {value!r}")
        if self.lanes is not None and (self.lanes < 1 or self.max_concurrent_decodes % self.lanes):
            raise ValueError(
                f"lanes: must be >= 1 and divide max_concurrent_decodes "
                f"({self.max_concurrent_decodes}), got {self.lanes}"
            )
        if self.cache_bucket < 0:
            raise ValueError(f"cache_bucket: must be >= 0, got {self.cache_bucket}")
        for name, allowed in (
            ("dtype", ENGINE_DTYPES),
            ("kv_dtype", KV_DTYPES),
            ("decode_layers", DECODE_LAYERS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: must be one of {allowed}, got {getattr(self, name)!r}")
        check_unroll("layer_unroll", self.layer_unroll, allow_none=True)
        if self.decode_attention is not None:
            try:
                attention = get_attention(self.decode_attention)
            except ValueError as e:
                raise ValueError(f"decode_attention: {e}") from None
            if self.kv_dtype is not None and not attention.reads_int8:
                raise ValueError(
                    f"decode_attention: {attention.name} reads a float cache; "
                    f"kv_dtype={self.kv_dtype!r} runs the dense attention (unset kv_dtype)"
                )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig(EngineOptions):
    """One engine: its options (``EngineOptions``, here ``max_concurrent_decodes`` is
    this engine's slots) and the shapes and sampling of the job.

    Attributes:
      max_prefill_length: longest prompt in tokens.
      max_decode_length: longest response in tokens (the stage's T).
      prefill_buckets: prompt lengths are right-padded up to the first bucket that
        fits (one compilation per bucket). Default: powers of two from 16, then
        ``max_prefill_length``.
      sampling: the sampling strategy.
      eos_ids: ids that end a response; None takes the model config's.
    """

    max_prefill_length: int = 1024
    max_decode_length: int = 1024
    prefill_buckets: tuple[int, ...] = ()
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    eos_ids: tuple[int, ...] | None = None

    @classmethod
    def of(cls, options: EngineOptions, **shapes: object) -> EngineConfig:
        """The engine of ``options`` (an ``EngineOptions`` or a subclass: only its
        engine options are read) with ``shapes`` (this class's own fields, or an
        option to override)."""
        own = {f.name: getattr(options, f.name) for f in dataclasses.fields(EngineOptions)}
        return cls(**own | shapes)

    def __post_init__(self):
        super().__post_init__()
        for name in ("max_prefill_length", "max_decode_length"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if any(b <= 0 for b in self.prefill_buckets) or list(self.prefill_buckets) != sorted(
            set(self.prefill_buckets)
        ):
            raise ValueError(
                f"prefill_buckets: must be increasing positive lengths, got {self.prefill_buckets}"
            )
        if self.prefill_buckets and self.prefill_buckets[-1] < self.max_prefill_length:
            raise ValueError(
                f"prefill_buckets: the largest ({self.prefill_buckets[-1]}) is below "
                f"max_prefill_length ({self.max_prefill_length})"
            )

    @property
    def cache_length(self) -> int:
        """S, slots per row of the KV cache: the longest prompt plus the longest response."""
        return self.max_prefill_length + self.max_decode_length

    def compact_sizes(self, min_rows: int = 1) -> tuple[int, ...]:
        """Batch sizes for compacted decoding: halvings of the slots down to a sixteenth
        (and not below ``min_rows``).

        Each size is one compiled decode loop, so there are at most five. A
        decode step's cost grows slowly with its rows (weights are read once per
        step whatever the rows), so the rows a halving leaves idle cost little,
        and below B/16 live rows the step runs at B/16 (measured in
        benchmarks/rollout.py: W2's long tail). ``Engine.compact_sizes`` sets
        ``min_rows`` for a light step on CPU (``LIGHT_COMPACT_FRACTION``).
        """
        b = self.max_concurrent_decodes
        sizes, s = {b}, b
        while s % 2 == 0 and s // 2 >= max(1, b // 16, min_rows):
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


# Default of ``EngineOptions.layer_unroll`` per platform: on CPU the plain scan decodes
# fastest (unrolled, inlined or looped layers are slower; docs/benchmarks.md#decode-defaults).
# GPU and TPU were not measured and keep the scan too (set the option to compare).
LAYER_UNROLL_DEFAULT: dict[str, int | bool] = {"cpu": 1}


# Default of ``EngineOptions.decode_layers``: split for a light decode step on CPU
# (``LIGHT_STEP_FLOPS``), where the scan's per-step copy of each layer's cache slice is
# a large share of the step; the scan otherwise, where splitting is slower and compiles
# longer (docs/benchmarks.md#decode-defaults). GPU and TPU run the ragged kernel, which
# reads the cache in place; their dense path keeps the scan until measured.
# Split only for at most this many layers: a split decode loop's compile time grows with
# the layers it unrolls, the scan's does not.
SPLIT_MAX_LAYERS = 4
# A decode step is light when its matmuls (2 x parameters x rows) are at most this:
# then it is bound by XLA's per-op cost on CPU. Set between the shipped 0.74M model
# at 64 rows (0.09 GFLOP, per-op bound) and benchmarks/rollout.py's 57.7M model at 16-32
# rows (1.8-3.7 GFLOP, matmul bound).
LIGHT_STEP_FLOPS = 0.4e9


def light_step(num_params: int, rows: int) -> bool:
    """Whether a decode step of ``rows`` rows of a ``num_params`` model is light on CPU
    (``LIGHT_STEP_FLOPS``): its matmuls, 2 x parameters x rows, at most that."""
    return 2 * num_params * rows <= LIGHT_STEP_FLOPS


# A light step on CPU compacts down to a quarter of the slots, not a sixteenth: below
# that a step costs XLA's per-op floor, and a smaller batch only adds a compiled
# program (docs/benchmarks.md#decode-defaults).
LIGHT_COMPACT_FRACTION = 4


def default_layer_unroll(platform: str | None = None) -> int | bool:
    """The decode loop's layer unroll for ``platform`` (default: jax's default backend)."""
    return LAYER_UNROLL_DEFAULT.get(platform or jax.default_backend(), 1)


# Default decode lanes per platform, where the work allows (``default_lanes``). On CPU a
# light decode step is bound by XLA's per-op cost on one core, so a second lane on the
# second core speeds it up; a heavier step's matmuls already use both cores and lanes
# slow it (docs/benchmarks.md#decode-defaults). So lanes split only a light step: a
# lane's matmul work per decode step (2 x parameters x its slots) at most
# ``LIGHT_STEP_FLOPS``. Accelerators keep one lane.
DECODE_LANES_DEFAULT: dict[str, int] = {"cpu": 2}


def default_lanes(
    max_concurrent_decodes: int, mesh: Mesh | None = None, num_params: int = 0
) -> int:
    """Decode lanes for a driver of ``max_concurrent_decodes`` slots of a model of
    ``num_params`` parameters: the platform's ``DECODE_LANES_DEFAULT``, at most the cores
    this process may use, and 1 over a mesh of several devices, where a lane would hold
    fewer than 8 slots (or the slots do not divide) or a lane's decode step would do more
    than ``LIGHT_STEP_FLOPS`` of matmuls."""
    if mesh is not None and mesh.devices.size > 1:
        return 1
    platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lanes = min(DECODE_LANES_DEFAULT.get(platform, 1), cores or 1)
    while lanes > 1 and (
        max_concurrent_decodes % lanes
        or max_concurrent_decodes // lanes < 8
        or not light_step(num_params, max_concurrent_decodes // lanes)
    ):
        lanes -= 1
    return lanes


def compacts(options: EngineOptions) -> bool:
    """Whether ``options`` decode compacted batches (``EngineOptions.compact_batch``)."""
    if options.compact_batch is not None:
        return options.compact_batch
    return jax.default_backend() != "gpu"
