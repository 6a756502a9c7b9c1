"""The rollout/update overlap prediction of ``magic-jax plan``: a stage's step time in sync
mode, in overlap mode on shared devices, and in overlap mode with the devices split
between generating and updating (``rollout.mode``, ``rollout.devices``; see
``run/overlap.py``), on the roofline of the decode step the plan compiled.

The rollout on d generating devices (``RolloutCost``). The engine's weights shard over the
tensor axis only and are replicated over the data groups (``SAMPLE_RULES``; a split's
generating mesh keeps the tensor axis), so every device reads its weight shard W once per
decode step whatever d is; the S slots' cache and flops spread over d devices. A step with
s live slots on d devices takes step(s, d) = F + max((W + c x s / d) / bandwidth, f x s /
d / peak), c and f a slot's cache bytes read (ragged share) and flops, F a step's fixed
cost (dispatch, collectives, sampling: ``--step-floor-ms``). A step's rollout is the larger
of two regimes:

* throughput: while more responses wait than slots, all S slots are busy: samples x L
  tokens / (S / step(S, d)), L the mean response length (the plan's: every response runs
  to T, L = T; samples / S waves, not rounded up as the time bounds above round them);
* tail: the longest response decodes T steps at the end, each at least step(one slot per
  data group, d): W / bandwidth and one slot's cache. It does not shrink with d (the
  weights are replicated per data group), and with L = T it never exceeds the throughput
  regime: it bounds the rollout only when the mean response is short enough (``tail_at``).

The step, per stage, with U the update's roofline on all N devices:

* sync: rollout(N) + U.
* overlap on shared devices: both phases on every device, one after the other, so a step
  is still rollout(N) + U; what overlap hides is host and verifier idle time, which the
  roofline leaves out.
* overlap with a split, r devices generate and N - r update: max(rollout(r), U x N /
  (N - r)), the best r minimising it. A split gains where rollout(r) grows slower than
  N / r: the weight reads (and the tail) do not grow as the generating side shrinks; a
  rollout tail-bound on N loses nothing to a split until its throughput regime reaches
  the tail.
  ``max_staleness`` does not enter the time (a stale enough schedule is assumed).

Memory rule for a split (``SplitMemory``): the generating side holds the engine's weights
and decode temporaries per device as planned and no train state; it runs the slots that
fit the rest of its HBM (a slot's cache spread over its r devices, N / r times what it
takes on all N), up to a step's samples, a multiple of its r / tensor slot shards (so
that the rollout shrinks as r grows, without the jumps of a power of two). The updating
side holds the planned update total (train state, gradients, activations, batch) scaled
by N / (N - r). Both must fit the HBM per device, and both sides must be multiples of the
mesh's tensor axis.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from magic_jax.jobs.stage_plan import StagePlan


@dataclasses.dataclass(frozen=True)
class RolloutCost:
    """A stage's decode on the roofline, for any number of generating devices.

    Attributes:
      weights: W, bytes of the engine's weights per device (the same on any d).
      slot_bytes: bytes of one slot's cache a step reads, over all devices (ragged share).
      slot_flops: flops of one slot's decode step, over all devices.
      slots: S, the rollout's decode slots.
      samples: responses per training step.
      response_length: T.
      tensor: devices per data group (the tensor axis).
      bandwidth / peak: HBM bytes/s and flop/s per device.
      mean_length: L, tokens per response (None: T, every response run to T).
      floor_s: F, a decode step's fixed cost (dispatch, collectives, sampling).
    """

    weights: float
    slot_bytes: float
    slot_flops: float
    slots: int
    samples: int
    response_length: int
    tensor: int
    bandwidth: float
    peak: float
    mean_length: float | None = None
    floor_s: float = 0.0

    def step_s(self, live: float, d: int) -> float:
        """Seconds of a decode step with ``live`` slots over ``d`` devices."""
        return self.floor_s + max(
            (self.weights + self.slot_bytes * live / d) / self.bandwidth,
            self.slot_flops * live / d / self.peak,
        )

    def throughput_s(self, d: int) -> float:
        """samples x L tokens at S slots busy: samples x L / S steps of step(S, d)."""
        length = self.response_length if self.mean_length is None else self.mean_length
        return self.samples * length / self.slots * self.step_s(self.slots, d)

    def tail_s(self, d: int) -> float:
        """T steps of step(one slot per data group, d): the longest response's floor."""
        return self.response_length * self.step_s(d / self.tensor, d)

    def rollout(self, d: int) -> tuple[float, str]:
        """(seconds, ``throughput`` or ``tail``: the regime that bounds it) on ``d``."""
        thr, tail = self.throughput_s(d), self.tail_s(d)
        return (thr, "throughput") if thr >= tail else (tail, "tail")

    def tail_at(self, d: int) -> float:
        """The mean response length, as a share of T, below which the tail bounds the
        rollout on ``d`` devices."""
        per_token = self.samples / self.slots * self.step_s(self.slots, d)
        return self.tail_s(d) / self.response_length / per_token if per_token else math.inf


@dataclasses.dataclass(frozen=True)
class SplitMemory:
    """Per-device bytes of the two phases as planned on all devices, for the split rule.

    Attributes:
      rollout_fixed: engine weights and decode temporaries (unchanged by the split).
      slot_bytes: one decode slot's KV cache per device, spread over all N devices (x N / r
        on r).
      update: the update phase's total (x N / (N - r)).
      hbm: bytes of HBM per device.
      samples: responses per step (the most slots worth running).
      tensor: devices per slot shard (the tensor axis).
    """

    rollout_fixed: float
    slot_bytes: float
    update: float
    hbm: float
    samples: int = 1 << 30
    tensor: int = 1

    def slots(self, r: int, devices: int) -> int:
        """The decode slots the generating side runs on ``r`` of ``devices`` (0: none fit)."""
        if not 0 < r <= devices or r % self.tensor:
            return 0
        room, per_slot = (self.hbm - self.rollout_fixed) * r, self.slot_bytes * devices
        if room < 0:
            return 0
        fit = int(room // per_slot) if per_slot > 0 else self.samples
        shards = r // self.tensor  # the slots split over the data groups
        return min(fit, self.samples) // shards * shards

    def holds(self, r: int, devices: int) -> bool:
        """Whether ``r`` generating and ``devices - r`` updating devices both fit."""
        if not 0 < r < devices:
            return False
        upd = self.update * devices / (devices - r)
        return self.slots(r, devices) > 0 and upd <= self.hbm


@dataclasses.dataclass(frozen=True)
class Split:
    """``rollout`` devices generate, the others update; seconds of each phase per step and
    the step (their max); ``regime``: what bounds the rollout (``throughput`` or
    ``tail``); ``holds``: whether both sides fit the memory rule."""

    rollout_devices: int
    devices: int
    rollout_s: float
    update_s: float
    holds: bool
    regime: str = "throughput"

    @property
    def step_s(self) -> float:
        return max(self.rollout_s, self.update_s)


@dataclasses.dataclass(frozen=True)
class OverlapPrediction:
    """A stage's roofline step time in sync and overlap modes (seconds).

    Attributes:
      stage / steps: the stage's name and training steps.
      devices: N, all the slice's devices.
      rollout_s / update_s: a step's two phases on all devices.
      regime: what bounds the rollout on all devices (``throughput`` or ``tail``).
      tail_at: the mean response length, as a share of T, below which the tail
        would bound the rollout.
      best: the split with the shortest step that holds the model (None: none does).
      candidates: how many splits hold the model.
      configured: the run's ``rollout.devices`` split (None: not set).
      max_staleness: the run's s (recorded; it does not enter the time).
    """

    stage: str
    steps: int
    devices: int
    rollout_s: float
    update_s: float
    regime: str
    tail_at: float
    best: Split | None
    candidates: int
    configured: Split | None = None
    max_staleness: int = 1

    @property
    def sync_s(self) -> float:
        """Sync's step, and overlap's on shared devices: rollout + update."""
        return self.rollout_s + self.update_s

    def speedup(self, split: Split) -> float:
        return self.sync_s / split.step_s if split.step_s > 0 else 0.0


def split_time(cost: RolloutCost, update_s: float, devices: int, r: int) -> tuple[float, ...]:
    """(rollout, update) seconds with ``r`` of ``devices`` generating: rollout(r) and
    U x N / (N - r), ``update_s`` being U on all N (``cost`` at the generating side's
    slots)."""
    return cost.rollout(r)[0], update_s * devices / (devices - r)


def predict_overlap(
    stage: str,
    steps: int,
    cost: RolloutCost,
    update_s: float,
    devices: int,
    memory: SplitMemory,
    *,
    configured: int | None = None,
    max_staleness: int = 1,
) -> OverlapPrediction:
    """The overlap prediction of one stage (the module's docstring states the model).

    Args:
      stage / steps: the stage's name and training steps.
      cost: the stage's decode on the roofline.
      update_s: a step's update roofline bound on all devices.
      devices: N.
      memory: the per-device bytes for the memory rule.
      configured: the run's ``rollout.devices``, reported whether or not it holds.
      max_staleness: recorded only: s does not change the time.
    """
    multiple = cost.tensor  # both sides' device counts: multiples of the tensor axis

    def split(r: int) -> Split:
        ok = memory.holds(r, devices) and r % multiple == 0 and (devices - r) % multiple == 0
        own = memory.slots(r, devices)  # the generating side's own slots (as planned if none)
        mine = dataclasses.replace(cost, slots=own) if own else cost
        (rollout, update), regime = split_time(mine, update_s, devices, r), mine.rollout(r)[1]
        return Split(r, devices, rollout, update, ok, regime)

    held = [s for s in map(split, range(1, devices)) if s.holds]
    best = min(held, key=lambda s: (s.step_s, s.rollout_devices), default=None)
    conf = None
    if configured is not None:
        if 0 < configured < devices:
            conf = split(configured)
        else:  # a side with no device: no time
            conf = Split(configured, devices, math.inf, math.inf, False)
    rollout, regime = cost.rollout(devices)
    tail_at = cost.tail_at(devices)
    fields = (stage, steps, devices, rollout, update_s, regime, tail_at, best, len(held))
    return OverlapPrediction(*fields, conf, max_staleness)


def stage_inputs(
    p: StagePlan,
    slots: int,
    chip: tuple[float, float, float],
    devices: int,
    floor_s: float = 0.0,
) -> tuple[RolloutCost, SplitMemory]:
    """A planned stage's decode on the roofline and its memory for the split rule, with
    ``slots`` decode slots (on all devices), ``chip`` (HBM bytes, bandwidth bytes/s, peak
    flop/s) per device and ``floor_s`` a decode step's fixed cost."""
    hbm, bandwidth, peak = chip
    over = "decode" in p.over_hbm  # its temporaries are XLA's ask, not a fitting step's
    memory = SplitMemory(
        rollout_fixed=p.engine_params + (0 if over else p.decode_temps),
        slot_bytes=p.kv_cache / p.slots if p.slots else 0.0,
        update=p.update_total,
        hbm=hbm,
        samples=p.samples,
        tensor=p.mesh.get("tensor", 1),
    )
    per_slot = devices / p.slots if p.slots else 0.0  # a device's share -> all devices'
    cost = RolloutCost(
        weights=p.engine_params,
        slot_bytes=p.kv_cache * p.held_share * per_slot,
        slot_flops=p.decode_flops * per_slot,
        slots=max(slots, 1),
        samples=p.samples,
        response_length=p.response_length,
        tensor=p.mesh.get("tensor", 1),
        bandwidth=bandwidth,
        peak=peak,
        floor_s=floor_s,
    )
    return cost, memory


def stage_overlap(
    p: StagePlan,
    update_s: float,
    slots: int,
    chip: tuple[float, float, float],
    devices: int,
    engine: Any,
    floor_s: float = 0.0,
) -> OverlapPrediction:
    """``predict_overlap`` for a planned stage: ``update_s`` its update bound on all
    devices, ``slots`` the decode slots the rollout runs, ``chip`` (HBM bytes, bandwidth
    bytes/s, peak flop/s) per device, ``engine`` the run's ``rollout`` section (its
    ``devices`` and ``max_staleness`` when it has them), ``floor_s`` a decode step's fixed
    cost."""
    cost, memory = stage_inputs(p, slots, chip, devices, floor_s)
    return predict_overlap(
        p.stage,
        p.steps,
        cost,
        update_s,
        devices,
        memory,
        configured=getattr(engine, "devices", None),
        max_staleness=getattr(engine, "max_staleness", 1),
    )


def _dur(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _split_text(o: OverlapPrediction, s: Split) -> str:
    return (
        f"{s.rollout_devices} generate / {s.devices - s.rollout_devices} update: step >= "
        f"max(rollout {_dur(s.rollout_s)} ({s.regime}-bound), update {_dur(s.update_s)}) = "
        f"{_dur(s.step_s)}, "
        f"{o.speedup(s):.2f}x sync's speed"
    )


def _stage_lines(o: OverlapPrediction) -> list[str]:
    head = f"[overlap]   stage {o.stage}:"
    lines = [
        f"{head} sync: step >= {_dur(o.sync_s)} (rollout {_dur(o.rollout_s)}, "
        f"{o.regime}-bound, + update {_dur(o.update_s)} on all {o.devices} devices); the "
        f"tail would bound the rollout below a mean response of {o.tail_at:.1%} of T",
        f"{head} overlap, shared devices: step >= {_dur(o.sync_s)}, no gain on the devices "
        "(both phases on each); it hides only host and verifier idle time",
    ]
    if o.best is None:
        lines.append(f"{head} overlap, split: no split holds the model on both sides")
    else:
        lines.append(
            f"{head} overlap, best split {_split_text(o, o.best)} (of {o.candidates} "
            f"split(s) that hold the model; max_staleness {o.max_staleness} not in the time)"
        )
    c = o.configured
    if c is not None:
        if c.rollout_devices >= o.devices:
            why = f"leaves no device to update (of {o.devices})"
        else:
            why = _split_text(o, c) + ("" if c.holds else "; does NOT hold the model")
        lines.append(f"{head} rollout.devices {c.rollout_devices}: {why}")
    return lines


def overlap_lines(
    preds: Sequence[OverlapPrediction], chips: int, engine: Any, slots_label: str
) -> list[str]:
    """The plan's ``[overlap]`` section: each stage's prediction, and the run's total time
    and chip-hours in sync and with the best splits (``slots_label``: which slots' rollout
    bound the times use)."""
    settings = {
        "rollout.mode": getattr(engine, "mode", "sync"),
        "max_staleness": getattr(engine, "max_staleness", 1),
        "publish_chunks": getattr(engine, "publish_chunks", None),
        "rollout.devices": getattr(engine, "devices", None),
    }
    lines = [
        "",
        "[overlap] rollout/update overlap, a roofline model: rollout on d devices = "
        "max(throughput: samples x T tokens at all slots busy, tail: T steps at one slot "
        "per data group); a decode step reads each device's weight shard (replicated over "
        "the data groups: not fewer on more devices) and its slots' cache",
        f"[overlap] decode at {slots_label}, every response run to T (samples / slots waves, "
        "not rounded up); update = U x N / "
        "devices; resharding, collectives and host work left out",
        "[overlap] this run: "
        + ", ".join(f"{k} {'null' if v is None else v}" for k, v in settings.items()),
    ]
    for o in preds:
        lines += _stage_lines(o)
    if not preds:
        return lines
    sync_h = sum(o.steps * o.sync_s for o in preds) / 3600
    lines.append(
        f"[overlap] run, sync (and overlap on shared devices): >= {sync_h:.1f} h = "
        f">= {sync_h * chips:,.0f} chip-hours"
    )
    for label, pick in (
        ("at the best splits", lambda o: o.best),
        (f"at rollout.devices {settings['rollout.devices']}", lambda o: o.configured),
    ):
        splits = [pick(o) for o in preds]
        if any(s is None or math.isinf(s.step_s) for s in splits):
            if label.startswith("at the best"):
                lines.append(f"[overlap] run, overlap {label}: a stage has no split that holds")
            continue
        h = sum(o.steps * s.step_s for o, s in zip(preds, splits, strict=True)) / 3600
        held = "" if all(s.holds for s in splits) else "; does NOT hold the model"
        lines.append(
            f"[overlap] run, overlap {label}: >= {h:.1f} h = >= {h * chips:,.0f} chip-hours "
            f"({sync_h / h if h else 0:.2f}x sync's speed){held}"
        )
    return lines
