"""The decode engine's configuration (``EngineConfig``) and its measured defaults."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from magic_jax.model.config import check_unroll
from magic_jax.model.kv_cache import KV_DTYPES
from magic_jax.rollout.attention import get_attention
from magic_jax.rollout.sampling import SamplingConfig

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
      kv_dtype: ``"int8"`` stores the KV cache as int8 with a float32 scale per
        token and kv head (``qwen2.quantize_kv``), dequantized inside the decode
        attention: 1 + 4/H bytes per element instead of 2 (bf16) or 4. The prompt
        is prefilled in ``dtype`` and quantized when it is inserted. None keeps
        the cache in ``dtype``.
      decode_attention: ``"ragged"`` runs the decode attention as a Pallas kernel
        that reads only the cache slots each row holds (``ragged_attention``: the
        TPU kernel on TPU, the Triton kernel on GPU, the TPU kernel interpreted
        elsewhere: slow, for tests); ``"dense"`` reads the whole attended cache and
        masks it. None: ragged on TPU and GPU, dense on CPU. Ragged needs a float
        cache (not ``kv_dtype="int8"``) and no sliding-window layers; elsewhere
        the dense product runs. Any other name is a registered attention
        (``attention.register_attention``; a float cache).
      decode_layers: how the decode loop (``generate_chunk``) holds the cache and runs
        the layers. ``"split"``: each layer's keys and values as their own arrays for
        the chunk (split from the slot-major cache once per chunk, stacked back at
        its end) and the layers a Python loop over static weight slices, so a step
        writes and reads each layer's cache in place; ``"scan"``: the layer scan
        over the slot-major cache, which copies each layer's slice out every step.
        None: split for a light step on CPU (``Engine.light_cpu_step``) of a model of
        at most ``SPLIT_MAX_LAYERS`` layers, else the scan. Split applies to the dense attention
        over a float cache (else the scan runs). Same logits either way.
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
    kv_dtype: str | None = None
    decode_attention: str | None = None
    decode_layers: str | None = None

    def __post_init__(self):
        if self.decode_layers not in DECODE_LAYERS:
            raise ValueError(
                f"EngineConfig.decode_layers must be one of {DECODE_LAYERS}, "
                f"got {self.decode_layers!r}"
            )
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(
                f"EngineConfig.dtype must be one of {ENGINE_DTYPES}, got {self.dtype!r}"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"EngineConfig.kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}"
            )
        if self.decode_attention is not None:
            try:
                attention = get_attention(self.decode_attention)
            except ValueError as e:
                raise ValueError(
                    f"EngineConfig.decode_attention must be one of the registered or None: {e}"
                ) from None
            if self.kv_dtype is not None and not attention.reads_int8:
                raise ValueError(
                    f"EngineConfig.decode_attention={self.decode_attention!r} reads a float "
                    f"cache; kv_dtype={self.kv_dtype!r} runs the dense attention"
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


# Measured default of ``EngineConfig.layer_unroll`` per platform. CPU (2-core AMD EPYC,
# benchmarks/rollout.py W1, 58M model, batch 32): a plain scan 18.5 ms per decode step,
# unroll 2 22.3 ms, every layer inlined 29.7 ms, unstacked layers in a Python loop
# 24.8 ms: the scan stays. GPU and TPU were not measured: they keep the scan too until
# a measurement says otherwise (set the option to compare).
LAYER_UNROLL_DEFAULT: dict[str, int | bool] = {"cpu": 1}


# Measured default of ``EngineConfig.decode_layers``: split for a light decode step on
# CPU (``LIGHT_STEP_FLOPS``), else the scan. CPU (2-core Intel Xeon): the shipped 0.74M
# model's decode step at 64 rows, S 80, is 4.0 ms scanned and 3.3 ms split (the scan's
# per-step copy of each layer's cache slice was 0.78 of its 1.48 ms of layer time);
# compiling a decode loop costs about 14% more split (its 4 layers unrolled).
# benchmarks/rollout.py's 57.7M model (32 rows, S 320, 8 layers) is slower split: W1
# 40.9 vs 37.0 ms per step, and its first rollout compiles 7.7 vs 5.3 s. GPU and TPU
# run the ragged kernel, which reads the cache in place; their dense path keeps the
# scan until measured.
DECODE_LAYERS = (None, "scan", "split")
# ... and for at most this many layers: a split decode loop's compile grows with the
# layers it unrolls. Measured (the narrow model of benchmarks/compile_time.py, 8 slots,
# XLA compile of one decode chunk): 4 layers 0.92 s scanned / 0.96 s split, 8 layers
# 0.85 / 1.32 s, 28 layers 0.91 / 3.36 s.
SPLIT_MAX_LAYERS = 4
# A decode step is light when its matmuls (2 x parameters x rows) are at most this:
# then it is bound by XLA's per-op cost on CPU. Set between the measured points: the
# 0.74M model at 64 rows (0.09 GFLOP) and the 57.7M one at 16-32 (1.8-3.7 GFLOP).
LIGHT_STEP_FLOPS = 0.4e9


def light_step(num_params: int, rows: int) -> bool:
    """Whether a decode step of ``rows`` rows of a ``num_params`` model is light on CPU
    (``LIGHT_STEP_FLOPS``): its matmuls, 2 x parameters x rows, at most that."""
    return 2 * num_params * rows <= LIGHT_STEP_FLOPS


# A light step on CPU compacts down to a quarter of the slots, not a sixteenth: below
# that a step costs XLA's per-op floor, and a smaller batch only adds a compiled
# program. Measured (2-core Intel Xeon, split decode, 0.74M model, 64 slots): 3.3 / 1.5 /
# 1.1 / 1.2 ms per step at 64 / 32 / 16 / 4 rows.
LIGHT_COMPACT_FRACTION = 4


def default_layer_unroll(platform: str | None = None) -> int | bool:
    """The decode loop's layer unroll for ``platform`` (default: jax's default backend)."""
    return LAYER_UNROLL_DEFAULT.get(platform or jax.default_backend(), 1)


# Measured default decode lanes per platform, where the work allows (``default_lanes``).
# CPU, 2-core Intel Xeon:
# - the default run's evaluation (256 prompts x 8 samples, T 64, 128 slots of the shipped
#   0.74M model): one lane 3.36-3.50 s, two lanes of 64 slots 2.22-2.44 s (1.42-1.57x).
#   Such a decode step is bound by XLA's per-op cost on one core; a second lane runs on
#   the second core.
# - benchmarks/rollout.py W1 (57.7M model, 32 slots): one lane 791 tok/s, two lanes of 16
#   slots 624 (0.79x): its matmuls already run on both cores.
# So lanes split only a light step: a lane's matmul work per decode step (2 x
# parameters x its slots) at most ``LIGHT_STEP_FLOPS``. Accelerators keep
# one lane.
DECODE_LANES_DEFAULT: dict[str, int] = {"cpu": 2}


def default_lanes(max_concurrent_decodes: int, mesh: Any = None, num_params: int = 0) -> int:
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
