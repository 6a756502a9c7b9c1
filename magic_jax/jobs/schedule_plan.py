"""The plan's rollout schedule (``[schedule]`` lines): each stage's step time for a
response-length distribution, from ``rollout.schedule.simulate`` replaying the engine's
continuous batching on the roofline costs of the decode step the plan compiled.

Length shapes (``magic-jax plan --lengths``; each drawn i.i.d. at the stage's T, seed 0):

* ``full``: every response runs to T (the roofline bounds' assumption);
* ``tail``: lognormal, mean 0.35 T, 3% reaching T: a stage under way, the mean well under
  T and a long tail (the report's from-scratch 16K run averages about 12.5K tokens);
* ``early``: lognormal, mean 0.7 T, 40% reaching T: a stage's first steps (the report:
  about 40% of the responses truncated at its first 8K steps);
* ``lognormal:MEAN,CLIP``: the mean and the share reaching T, as shares of T;
* ``run:DIR``: fitted to a run's records: the mean of its last 20 steps'
  ``response_length_mean / max_response_length`` and ``truncated_fraction``.

A lognormal clipped at T with a share c reaching T and mean m T has mu = ln T - z sigma,
z = Phi^-1(1 - c), and sigma solving m = exp(-z sigma + sigma^2 / 2) Phi(z - sigma) + c.

Costs on d rollout devices (``overlap_plan.RolloutCost``): a decode step over r live
rows costs step(r, d) (with the ragged kernel each live row reads its cache at the
shape's mean held context P + E[L^2] / 2 E[L]; the dense kernel reads every slot's, the
step charged at all S rows); a prompt's prefill max(2 x params x P / (d x peak),
weights / bandwidth), P the longest prompt; a token prefilled again 2 x params / (d x
peak). Host work, inserts and the verifier are left out, as in the roofline; lengths
are independent within a group (real ones are not: a hard prompt's run long together).

Per stage and shape, U the update on all N devices:

* sync: rollout(N) + U, with the drain's share of the step: the time from the last
  insert to the end beyond what its tokens take with every slot busy (slots idle while
  the longest responses finish);
* overlap on shared devices: the same step (a device runs one program at a time);
* overlap split, r devices generating: max(rollout(r), U x N / (N - r)), r the best of
  the splits that hold the model (``overlap_plan.SplitMemory``);
* partial rollouts (``publish_chunks`` n, the run's, else 16): the same schedule, the
  drain included; with ``publish_cache: reprefill`` each of up to ``max_staleness``
  publishes a rollout prefills the context in flight again;
* carried: a step ends at its batch of finished responses and the unfinished ones go on
  into the next, so slots never drain (not built: the engine finishes every group of a
  step); the difference from sync is what the drain costs.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from magic_jax.jobs.overlap_plan import stage_inputs
from magic_jax.jobs.stage_plan import StagePlan
from magic_jax.rollout.schedule import Costs, Publish, carried, simulate

SHAPES = {"full": (1.0, 1.0), "tail": (0.35, 0.03), "early": (0.7, 0.4)}
DEFAULT_SHAPES = ("tail", "early", "full")
RECORD_STEPS = 20  # a run's last steps a ``run:DIR`` shape is fitted to
CARRIED_STEPS = 4  # carried steps measured, after one to fill the slots
PUBLISH_CHUNKS = 16  # partial rollouts' publish interval when the run sets none


def _cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def _bisect(f: Any, lo: float, hi: float) -> float:
    """The root of ``f`` in [lo, hi], f(lo) > 0 > f(hi)."""
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
    return 0.5 * (lo + hi)


@dataclasses.dataclass(frozen=True)
class LengthShape:
    """Response lengths as shares of T: ``mean`` after clipping at T, ``clipped`` the
    share reaching T (1: every response); ``about`` says where the shape comes from."""

    name: str
    mean: float
    clipped: float
    about: str = ""

    def __post_init__(self) -> None:
        if self.clipped >= 1.0 and self.mean == 1.0:
            return
        if not 0.0 < self.clipped < self.mean < 1.0:
            raise ValueError(
                f"--lengths {self.name}: a lognormal needs 0 < share at T ({self.clipped:g}) "
                f"< mean ({self.mean:g}) < 1"
            )

    def sigma_z(self) -> tuple[float, float]:
        """(sigma, z) of the lognormal: mu = ln T - z sigma."""
        c, m = self.clipped, self.mean
        z = _bisect(lambda x: 1.0 - c - _cdf(x), -40.0, 40.0)

        def excess(s: float) -> float:
            return math.exp(-z * s + s * s / 2) * _cdf(z - s) + c - m

        return _bisect(excess, 1e-9, 20.0), z

    def draw(self, n: int, t: int, seed: int = 0) -> np.ndarray:
        """``n`` response lengths in [1, t]."""
        if self.clipped >= 1.0:
            return np.full(n, t, np.int64)
        sigma, z = self.sigma_z()
        x = np.random.default_rng(seed).lognormal(math.log(t) - z * sigma, sigma, n)
        return np.clip(np.rint(x), 1, t).astype(np.int64)

    def describe(self) -> str:
        if self.clipped >= 1.0:
            return f"{self.name}: every response T"
        about = f" ({self.about})" if self.about else ""
        share = f"{self.clipped * 100:.2g}%"
        return f"{self.name}: lognormal, mean {self.mean:.2f} T, {share} reach T{about}"


def from_records(run_dir: str) -> LengthShape:
    """The shape of a run's last ``RECORD_STEPS`` steps (``metrics.jsonl``)."""
    from magic_jax import storage

    where = storage.path(run_dir) / "metrics.jsonl"
    packed = where.with_name("metrics.jsonl.gz")  # a committed ablation run's records
    if not where.is_file() and not packed.is_file():
        raise ValueError(f"--lengths run:{run_dir}: no {where}")
    if where.is_file():
        text = where.read_text()
    else:
        where, text = packed, gzip.decompress(packed.read_bytes()).decode()
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lengths run:{run_dir}: {where} line {i}: {e}") from None
        if isinstance(row, dict) and "response_length_mean" in row:
            rows.append(row)
    if not rows:
        raise ValueError(f"--lengths run:{run_dir}: {where} has no step with response lengths")
    rows = rows[-RECORD_STEPS:]
    mean = float(np.mean([r["response_length_mean"] / r["max_response_length"] for r in rows]))
    clipped = float(np.mean([r.get("truncated_fraction", 0.0) for r in rows]))
    about = f"{run_dir}, its last {len(rows)} steps"
    if clipped < 1e-3:  # a lognormal needs some share at T
        about, clipped = about + f"; {clipped:.2%} at T taken as 0.1%", 1e-3
    return LengthShape(f"run:{run_dir}", mean, min(clipped, mean / 2), about)


def parse_shape(spec: str) -> LengthShape:
    """A ``--lengths`` value (the module's docstring lists them)."""
    if spec in SHAPES:
        about = {"tail": "a stage under way", "early": "a stage's first steps"}
        return LengthShape(spec, *SHAPES[spec], about.get(spec, ""))
    if spec.startswith("run:"):
        return from_records(spec[4:])
    if spec.startswith("lognormal:"):
        try:
            mean, clip = (float(x) for x in spec[len("lognormal:") :].split(","))
        except ValueError:
            raise ValueError(f"--lengths {spec}: expected lognormal:MEAN,CLIP") from None
        return LengthShape(spec, mean, clip)
    names = ", ".join([*SHAPES, "lognormal:MEAN,CLIP", "run:DIR"])
    raise ValueError(f"--lengths {spec!r}: not a length shape ({names})")


@dataclasses.dataclass(frozen=True)
class Mode:
    """A step of ``rollout_s`` (its drain ``drain_s``) and ``update_s``, one after the other
    on the same devices (``shared``) or at once on ``rollout_devices`` and the others."""

    rollout_s: float
    update_s: float
    drain_s: float = 0.0
    rollout_devices: int = 0
    shared: bool = True

    @property
    def step_s(self) -> float:
        if self.shared:
            return self.rollout_s + self.update_s
        return max(self.rollout_s, self.update_s)


@dataclasses.dataclass(frozen=True)
class StageSchedule:
    """One stage's modes for one shape (``sync``; the best ``split``, None when none holds;
    ``reprefill_s`` per step and ``publishes``; ``carried`` on all devices and
    ``carried_split`` at the best split)."""

    stage: str
    steps: int
    shape: LengthShape
    mean_tokens: float
    devices: int
    sync: Mode
    split: Mode | None
    reprefill_s: float
    publishes: int
    publish_chunks: int
    carried: Mode
    carried_split: Mode | None


def stage_schedule(
    p: StagePlan,
    shape: LengthShape,
    update_s: float,
    slots: int,
    chip: tuple[float, float, float],
    devices: int,
    engine: Any,
    params: int,
) -> StageSchedule:
    """The modes of one planned stage for ``shape`` (the module's docstring states how);
    ``params`` the model's parameter count."""
    _, bandwidth, peak = chip
    cost, memory = stage_inputs(p, slots, chip, devices)
    g, t, pl = max(p.group_size, 1), p.response_length, p.prompt_length
    prompts = max(p.samples // g, 1)
    lengths = shape.draw(prompts * g, t).reshape(prompts, g)
    if p.ragged:  # each live row reads its cache at the shape's mean held context
        held = (pl + (lengths**2).sum() / (2 * lengths.sum())) / (pl + t)
        cost = dataclasses.replace(cost, slot_bytes=cost.slot_bytes * held / p.held_share)
    sizes = sorted({1 << i for i in range(max(slots, 1).bit_length())} | {max(slots, 1)})

    def costs(d: int) -> Costs:
        return Costs(
            step_s={r: cost.step_s(r, d) for r in sizes},
            prefill_s=max(2 * params * pl / (d * peak), cost.weights / bandwidth),
            reprefill_token_s=2 * params / (d * peak),
            by_live=p.ragged,
        )

    steps = max(int(getattr(engine, "decode_steps", 64) or 64), 1)
    run = dict(slots=max(slots, 1), decode_steps=steps)
    more = prompts * (CARRIED_STEPS + 2) + -(-slots // g)  # outlasts the carried steps
    stream = shape.draw(more * g, t, seed=1).reshape(more, g)

    def rollout(d: int) -> Mode:  # rollout on d devices, the others updating (d < N)
        c = costs(d)
        s = simulate(lengths, costs=c, **run)
        upd = update_s if d == devices else update_s * devices / (devices - d)
        full = s.drain_tokens * c.step(run["slots"]) / run["slots"]  # with every slot busy
        return Mode(s.total_s, upd, max(s.drain_s - full, 0.0), d, d == devices)

    def carried_on(d: int) -> Mode:
        s = carried(stream, batch=p.samples, steps=CARRIED_STEPS, costs=costs(d), **run)
        upd = update_s if d == devices else update_s * devices / (devices - d)
        return Mode(s, upd, 0.0, d, d == devices)

    tensor = cost.tensor
    held = [
        r
        for r in range(tensor, devices, tensor)
        if memory.holds(r, devices) and (devices - r) % tensor == 0
    ]
    best = min(map(rollout, held), key=lambda m: m.step_s, default=None)
    every = getattr(engine, "publish_chunks", None) or PUBLISH_CHUNKS
    pub = Publish(every, max(int(getattr(engine, "max_staleness", 1)), 1), True, pl)
    partial = simulate(lengths, costs=costs(devices), publish=pub, **run)
    return StageSchedule(
        stage=p.stage,
        steps=p.steps,
        shape=shape,
        mean_tokens=float(lengths.mean()),
        devices=devices,
        sync=rollout(devices),
        split=best,
        reprefill_s=partial.reprefill_s,
        publishes=partial.publishes,
        publish_chunks=every,
        carried=carried_on(devices),
        carried_split=None if best is None else carried_on(best.rollout_devices),
    )


def _dur(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _split(m: Mode, n: int) -> str:
    return f"{m.rollout_devices} generate / {n - m.rollout_devices} update"


def _stage_lines(s: StageSchedule) -> list[str]:
    n, sync = s.devices, s.sync
    head = f"[schedule]   stage {s.stage}, {s.shape.name}:"
    lines = [
        f"[schedule]   stage {s.stage}, {s.shape.name} (mean {s.mean_tokens:,.0f} tokens): "
        f"sync and overlap on shared devices: step {_dur(sync.step_s)} = rollout "
        f"{_dur(sync.rollout_s)} + update {_dur(sync.update_s)}; the drain "
        f"{_dur(sync.drain_s)}, {sync.drain_s / sync.step_s:.0%} of the step"
    ]
    if s.split is None:
        lines.append(f"{head} overlap, split: no split holds the model on both sides")
    else:
        m = s.split
        lines.append(
            f"{head} overlap, best split {_split(m, n)}: step {_dur(m.step_s)} = max(rollout "
            f"{_dur(m.rollout_s)}, the drain {m.drain_s / m.step_s:.0%} of the step; update "
            f"{_dur(m.update_s)}), {sync.step_s / m.step_s:.2f}x sync's speed"
        )
    lines.append(
        f"{head} partial rollouts (publish_chunks {s.publish_chunks}): the same steps "
        f"(drain included); with publish_cache reprefill + {_dur(s.reprefill_s)} a step "
        f"({s.publishes} publish(es), {s.reprefill_s / sync.step_s:.1%} of sync's step)"
    )
    c, cs = s.carried, s.carried_split
    text = f"{head} carried (not built): step {_dur(c.step_s)} on shared devices "
    text += f"({sync.step_s / c.step_s:.2f}x sync's speed)"
    if cs is not None:
        text += f", {_dur(cs.step_s)} split {_split(cs, n)} ({sync.step_s / cs.step_s:.2f}x)"
    return [*lines, text + ": the drain's worth"]


def schedule_lines(
    stages: Sequence[Sequence[StageSchedule]], chips: int, engine: Any, slots_label: str
) -> list[str]:
    """The plan's ``[schedule]`` section: ``stages[i][j]`` stage i under shape j."""
    if not stages or not stages[0]:
        return []
    shapes = [s.shape for s in stages[0]]
    lines = [
        "",
        "[schedule] the rollout replayed step by step (rollout.schedule.simulate): "
        f"continuous batching in one lane at {slots_label}, decode_steps "
        f"{getattr(engine, 'decode_steps', 64)}, on the roofline decode step; prefill at the "
        "longest prompt; host work, inserts and the verifier left out",
        "[schedule] lengths: " + "; ".join(x.describe() for x in shapes),
    ]
    for per_shape in stages:
        for s in per_shape:
            lines += _stage_lines(s)
    for j, shape in enumerate(shapes):
        sync = sum(st[j].steps * st[j].sync.step_s for st in stages) / 3600
        parts = [f"sync >= {sync:.1f} h = {sync * chips:,.0f} chip-hours"]
        for label, pick in (("best splits", "split"), ("carried, shared", "carried")):
            modes = [getattr(st[j], pick) for st in stages]
            if all(m is not None for m in modes):
                h = sum(st[j].steps * m.step_s for st, m in zip(stages, modes, strict=True))
                parts.append(f"{label} {h / 3600:.1f} h ({sync * 3600 / h if h else 0:.2f}x)")
        lines.append(f"[schedule] run, {shape.name}: " + "; ".join(parts))
    return lines
