"""A stage plan's roofline figures: the decode at each rollout precision, the slots to run,
and the time bounds of rollout and update (``plan.format_plan`` prints them)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from magic_jax.jobs.stage_plan import StagePlan

# (label, weight dtype, KV cache dtype, KV bytes per element as a function of head_dim)
ROLLOUT_OPTIONS: tuple[tuple[str, str, str | None, Any], ...] = (
    ("float32", "float32", None, lambda h: 4.0),
    ("bfloat16", "bfloat16", None, lambda h: 2.0),
    # rollout.kv_dtype=int8: int8 values and one float32 scale per token and KV head
    ("bf16 + int8 KV", "bfloat16", "int8", lambda h: 1.0 + 4.0 / h),
)


@dataclasses.dataclass(frozen=True)
class DecodeOption:
    """One rollout precision's decode figures for a stage, per device (from its plan's sizes).

    Attributes:
      label: ``float32``, ``bfloat16`` or ``bf16 + int8 KV``.
      weights / kv_cache: bytes of the engine's weights and of the whole KV cache at the
        stage's slots and T.
      step_bytes: bytes one decode step reads (every weight and cache byte once).
      tokens_per_s: the HBM roofline, slots / (step_bytes / bandwidth).
      slots_fit: decode slots at the stage's T that fit in HBM beside the train state, the
        weights and the compiled decode temporaries (0: none).
    """

    label: str
    weights: float
    kv_cache: float
    step_bytes: float
    tokens_per_s: float
    slots_fit: int


def decode_options(
    p: StagePlan,
    rollout_dtype: str,
    head_dim: int,
    hbm: float,
    bandwidth: float,
    kv_dtype: str | None = None,
) -> list[DecodeOption]:
    """Each of ``ROLLOUT_OPTIONS`` scaled from the stage's compiled sizes, which are in
    ``rollout_dtype`` with the cache in ``kv_dtype`` (weights by their dtype's bytes, the
    cache by bytes per element; decode temporaries kept as compiled). ``hbm`` and
    ``bandwidth`` are per device (bytes, bytes/s)."""
    import jax.numpy as jnp

    have = jnp.dtype(rollout_dtype).itemsize
    # an int8 cache holds 1 + 4/H bytes per element whatever the weights' dtype
    have_kv = have if kv_dtype is None else ROLLOUT_OPTIONS[-1][3](head_dim)
    out = []
    for label, wdtype, _, kv_bytes in ROLLOUT_OPTIONS:
        weights = p.engine_params * jnp.dtype(wdtype).itemsize / have
        kv = p.kv_cache * kv_bytes(head_dim) / have_kv
        step = weights + kv
        per_slot = kv / p.slots if p.slots else math.inf
        room = hbm - p.params - p.opt_state - weights - p.decode_temps
        fit = max(0, int(room // per_slot)) if per_slot > 0 else 0
        tps = p.slots / (step / bandwidth) if step > 0 else 0.0
        out.append(DecodeOption(label, weights, kv, step, tps, fit))
    return out


def own_option(rollout_dtype: str, kv_dtype: str | None) -> str | None:
    """The ``ROLLOUT_OPTIONS`` label of a run's own engine settings (None: not listed)."""
    return next(
        (label for label, wd, kd, _ in ROLLOUT_OPTIONS if (wd, kd) == (rollout_dtype, kv_dtype)),
        None,
    )


def recommend_slots(fit: int, samples: int, shards: int) -> int:
    """``rollout.max_concurrent_decodes`` to run: the largest power of two that is a
    multiple of the ``shards`` slot shards (data x fsdp) and at most both the slots that
    fit and the samples per step; else the largest such multiple; 0 when none fits."""
    limit = min(fit, samples)
    if limit < shards:
        return 0
    n = 1 << (limit.bit_length() - 1)
    while n >= shards:
        if n % shards == 0:
            return n
        n //= 2
    return limit // shards * shards


@dataclasses.dataclass(frozen=True)
class DecodeBound:
    """A stage's decode at ``slots`` slots on the roofline: ``step_s`` (the bytes a step
    reads / HBM bandwidth, or its flops / peak), ``tokens_per_s`` = slots / step_s, and
    ``rollout_s`` for the stage's samples each run to T (ceil(samples / slots) x T steps)."""

    slots: int
    step_s: float
    tokens_per_s: float
    rollout_s: float


def decode_bound(p: StagePlan, slots: int, bandwidth: float, peak: float) -> DecodeBound:
    """The decode roofline at ``slots`` slots, the cache and flops scaled from the compiled
    step's (``bandwidth`` bytes/s and ``peak`` flop/s per device)."""
    scale = slots / p.slots
    step_bytes = p.engine_params + p.kv_cache * scale * p.held_share
    step = max(step_bytes / bandwidth, p.decode_flops * scale / peak)
    steps = math.ceil(p.samples / slots) * p.response_length
    return DecodeBound(slots, step, slots / step, steps * step)


def update_bound(p: StagePlan, peak: float) -> float:
    """Seconds of a training step's updates at the bf16 peak: each optimizer step's flops
    (XLA's count, or 6 x parameters x tokens when larger) / peak."""
    return max(p.update_flops, p.model_flops) / peak * p.sgd_steps


@dataclasses.dataclass(frozen=True)
class TimeBound:
    """Roofline lower bounds of a stage, seconds: ``rollout`` + ``update`` per step, and the
    stage's ``steps`` of them."""

    stage: str
    steps: int
    rollout: float
    update: float

    @property
    def step(self) -> float:
        return self.rollout + self.update

    @property
    def total(self) -> float:
        return self.steps * self.step


def chip_hours(bounds: Sequence[TimeBound], chips: int) -> float:
    """chips x hours of the stages' bounds, summed."""
    return chips * sum(b.total for b in bounds) / 3600
