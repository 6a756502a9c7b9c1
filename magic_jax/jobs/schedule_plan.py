"""The plan's rollout schedule (``[schedule]`` lines): each stage's step time for a
response-length distribution, from ``rollout.schedule.simulate`` replaying the engine's
continuous batching on the roofline costs of the decode step the plan compiled.

Length shapes (``magic-jax plan --lengths``; each drawn i.i.d. at the stage's T, seed 0):

* ``full``: every response runs to T (the roofline bounds' assumption);
* ``tail``: lognormal, mean 0.35 T, 3% reaching T: a stage under way, the mean well under
  T and a long tail (the report's from-scratch 16K run averages about 12.5K tokens);
* ``early``: lognormal, mean 0.7 T, 40% reaching T: a stage's first steps (the report:
  about 40% of the responses truncated at its first 8K steps);
* ``tail-grouped``, ``early-grouped``: the same lengths, but a group's responses share
  half their log-length's variance (a hard prompt's responses run long together);
* ``lognormal:MEAN,CLIP[,RHO]``: the mean and the share reaching T, as shares of T, and
  the share RHO of the log-length's variance a group's responses share (default 0);
* ``run:DIR``: fitted to a run's records: the mean of its last 20 steps'
  ``response_length_mean / max_response_length`` and ``truncated_fraction``.

A lognormal clipped at T with a share c reaching T and mean m T has mu = ln T - z sigma,
z = Phi^-1(1 - c), and sigma solving m = exp(-z sigma + sigma^2 / 2) Phi(z - sigma) + c.
With RHO, a response's log-length is mu + sigma (sqrt(RHO) x_group + sqrt(1 - RHO) x_own),
x standard normals: each response's length is drawn as before, the group's together.

Costs on d rollout devices (``overlap_plan.RolloutCost``): a decode step over r live
rows costs step(r, d) = F + its roofline (with the ragged kernel each live row reads its
cache at the shape's mean held context P + E[L^2] / 2 E[L]; the dense kernel reads every
slot's, the step charged at all S rows), F a step's fixed cost (``--step-floor-ms``); a
prompt's prefill max(2 x params x P / (d x peak), weights / bandwidth), P the longest
prompt; a token prefilled again 2 x params / (d x peak). Host work, inserts and the
verifier are left out, as in the roofline.

The update U on all N devices, per shape: padded, every row at the step's P + T (the
plan's mini-batch flops: ``costs.update_row_flops``); packed (``update.packing``),
each mini-batch's rows (prompt at P + response) first-fit-decreasing into bins of P + T,
K bins a micro-batch, only the micro-batches that hold rows run: U x (the packed
micro-batches' bins) / (the padded micro-batches' rows). An int8 cache on the ragged
kernel (``int8-ragged``) is charged its int8 bytes (with their scales), no relayout, and
the slots they fit.

Per stage and shape:

* sync: rollout(N) + U, with the drain's share of the step: the time from the last
  insert to the end beyond what its tokens take with every slot busy (slots idle while
  the longest responses finish);
* overlap on shared devices: the same step (a device runs one program at a time);
* overlap split, r devices generating: max(rollout(r), U x N / (N - r)), r the best of
  the splits that hold the model (``overlap_plan.SplitMemory``; the generating side runs
  the slots that fit its own HBM);
* partial rollouts (``publish_chunks`` n, the run's, else 16): the same schedule, the
  drain included; with ``publish_cache: reprefill`` each of up to ``max_staleness``
  publishes a rollout prefills the context in flight again;
* carried: a step ends at its batch of finished responses and the unfinished ones go on
  into the next, so slots never drain (not built: the engine finishes every group of a
  step); the difference from sync is what the drain costs; on shared devices, and split
  at the r best for it.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from magic_jax.jobs.overlap_plan import RolloutCost, SplitMemory, stage_inputs
from magic_jax.jobs.stage_plan import StagePlan
from magic_jax.rollout.schedule import Costs, Publish, carried, simulate

SHAPES = {"full": (1.0, 1.0), "tail": (0.35, 0.03), "early": (0.7, 0.4)}
GROUP_SHARE = 0.5  # the ``-grouped`` shapes' share of the log-variance a group shares
DEFAULT_SHAPES = ("tail", "early", "full")
STEP_FLOORS_MS = (0.0, 4.0, 8.0)  # a decode step's fixed costs the run's hours are shown at
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
    share reaching T (1: every response); ``about`` says where the shape comes from;
    ``shared`` the share of the log-length's variance a group's responses share."""

    name: str
    mean: float
    clipped: float
    about: str = ""
    shared: float = 0.0

    def __post_init__(self) -> None:
        if self.clipped >= 1.0 and self.mean == 1.0:
            return
        if not 0.0 < self.clipped < self.mean < 1.0:
            raise ValueError(
                f"--lengths {self.name}: a lognormal needs 0 < share at T ({self.clipped:g}) "
                f"< mean ({self.mean:g}) < 1"
            )
        if not 0.0 <= self.shared <= 1.0:
            raise ValueError(f"--lengths {self.name}: RHO ({self.shared:g}) must be in [0, 1]")

    def sigma_z(self) -> tuple[float, float]:
        """(sigma, z) of the lognormal: mu = ln T - z sigma."""
        c, m = self.clipped, self.mean
        z = _bisect(lambda x: 1.0 - c - _cdf(x), -40.0, 40.0)

        def excess(s: float) -> float:
            return math.exp(-z * s + s * s / 2) * _cdf(z - s) + c - m

        return _bisect(excess, 1e-9, 20.0), z

    def draw(self, n: int, t: int, seed: int = 0, group: int = 1) -> np.ndarray:
        """``n`` response lengths in [1, t], ``group`` after ``group`` of one prompt (``n``
        a multiple of it)."""
        if self.clipped >= 1.0:
            return np.full(n, t, np.int64)
        sigma, z = self.sigma_z()
        mu, rng = math.log(t) - z * sigma, np.random.default_rng(seed)
        if self.shared > 0.0 and group > 1:
            shared = np.repeat(rng.standard_normal(n // group), group)
            x = math.sqrt(self.shared) * shared
            x = np.exp(mu + sigma * (x + math.sqrt(1.0 - self.shared) * rng.standard_normal(n)))
        else:
            x = rng.lognormal(mu, sigma, n)
        return np.clip(np.rint(x), 1, t).astype(np.int64)

    def describe(self) -> str:
        if self.clipped >= 1.0:
            return f"{self.name}: every response T"
        about = f" ({self.about})" if self.about else ""
        share = f"{self.clipped * 100:.2g}%"
        grouped = f", a group sharing {self.shared:.0%} of the log-variance" if self.shared else ""
        text = f"{self.name}: lognormal, mean {self.mean:.2f} T, {share} reach T{grouped}"
        return text + about


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
    name, grouped = spec.removesuffix("-grouped"), spec.endswith("-grouped")
    if name in SHAPES and not (grouped and name == "full"):
        about = {"tail": "a stage under way", "early": "a stage's first steps"}
        share = GROUP_SHARE if grouped else 0.0
        return LengthShape(spec, *SHAPES[name], about.get(name, ""), share)
    if spec.startswith("run:"):
        return from_records(spec[4:])
    if spec.startswith("lognormal:"):
        values = spec[len("lognormal:") :].split(",")
        try:
            mean, clip, *rho = (float(x) for x in values)
        except ValueError:
            rho = [0.0, 0.0]
        if len(rho) > 1:
            raise ValueError(f"--lengths {spec}: expected lognormal:MEAN,CLIP[,RHO]")
        return LengthShape(spec, mean, clip, "", *rho)
    names = ", ".join([*SHAPES, "tail-grouped", "early-grouped", "lognormal:MEAN,CLIP[,RHO]"])
    names += ", run:DIR"
    raise ValueError(f"--lengths {spec!r}: not a length shape ({names})")


@dataclasses.dataclass(frozen=True)
class Mode:
    """A step of ``rollout_s`` (its drain ``drain_s``) and ``update_s``, one after the other
    on the same devices (``shared``) or at once on ``rollout_devices`` and the others;
    ``slots`` the rollout's decode slots."""

    rollout_s: float
    update_s: float
    drain_s: float = 0.0
    rollout_devices: int = 0
    shared: bool = True
    slots: int = 0

    @property
    def step_s(self) -> float:
        if self.shared:
            return self.rollout_s + self.update_s
        return max(self.rollout_s, self.update_s)


@dataclasses.dataclass(frozen=True)
class StageSchedule:
    """One stage's modes for one shape (``sync``; the best ``split``, None when none holds;
    ``reprefill_s`` per step and ``publishes``; ``carried`` on all devices and
    ``carried_split`` at its own best split); ``packed`` the packed update's share of the
    padded one's (None: padded), ``floor_s`` a decode step's fixed cost."""

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
    packed: float | None = None
    floor_s: float = 0.0


def packed_share(p: StagePlan, lengths: np.ndarray) -> float:
    """The packed update's cost over the padded one's for one step's response ``lengths``
    (its samples in prompt order, cut into mini-batches of ``p.rows``): each mini-batch's
    rows (prompt at P, then the response) first-fit-decreasing into bins of the padded row
    length, K = ``p.bins`` a micro-batch, against its rows in micro-batches of
    ``p.micro_batch`` (a micro-batch costs its slots either way)."""
    from magic_jax.update.packing import first_fit_decreasing

    capacity = p.row_length or p.prompt_length + p.response_length
    k, m = p.bins or p.micro_batch, max(p.micro_batch, 1)
    flat = np.minimum(p.prompt_length + np.asarray(lengths).reshape(-1), capacity)
    used = padded = 0
    for i in range(0, flat.size, max(p.rows, 1)):
        part = flat[i : i + p.rows]
        bins = int(first_fit_decreasing(part, capacity)[0].max()) + 1
        used += -(-bins // k) * k
        padded += -(-part.size // m) * m
    return used / padded if padded else 1.0


def _best(mode: Any, held: Sequence[int], update: Any) -> Mode | None:
    """The shortest step over the held splits ``held`` (ascending), ``mode(r)`` a split's
    Mode and ``update(r)`` its update's seconds: the rollout shrinks as r grows and the
    update grows, so the step, their max, is least where they cross; the two splits
    around the crossing (found by bisection) are replayed."""
    if not held:
        return None
    lo, hi = 0, len(held) - 1  # the first held split whose rollout is within its update
    while lo < hi:
        mid = (lo + hi) // 2
        if mode(held[mid]).rollout_s <= update(held[mid]):
            hi = mid
        else:
            lo = mid + 1
    near = [mode(held[i]) for i in {max(lo - 1, 0), lo}]
    return min(near, key=lambda m: (m.step_s, m.rollout_devices))


def _held_cost(cost: RolloutCost, p: StagePlan, lengths: np.ndarray) -> RolloutCost:
    """``cost`` with each live row reading its cache at ``lengths``' mean held context
    P + E[L^2] / 2 E[L] on the ragged kernel (the dense one reads every slot's: ``cost``)."""
    if not p.ragged:
        return cost
    pl, t = p.prompt_length, p.response_length
    share = (pl + (lengths**2).sum() / (2 * lengths.sum())) / (pl + t)
    return dataclasses.replace(cost, slot_bytes=cost.slot_bytes * share / p.held_share)


def _held_splits(memory: SplitMemory, tensor: int, devices: int) -> list[int]:
    """The rollout device counts r (ascending, whole tensor groups on both sides) at which
    a split holds the model on both sides."""
    return [
        r
        for r in range(tensor, devices, tensor)
        if memory.holds(r, devices) and (devices - r) % tensor == 0
    ]


def _reprefill(
    lengths: np.ndarray, every: int, engine: Any, prompt_length: int, **run: Any
) -> tuple[float, int]:
    """(seconds a step spends prefilling again, publishes) of partial rollouts publishing
    every ``every`` chunks with ``publish_cache: reprefill``, up to the engine's
    ``max_staleness`` publishes a rollout; ``run``: ``simulate``'s costs, slots and
    decode steps."""
    staleness = max(int(getattr(engine, "max_staleness", 1)), 1)
    s = simulate(lengths, publish=Publish(every, staleness, True, prompt_length), **run)
    return s.reprefill_s, s.publishes


def stage_schedule(
    p: StagePlan,
    shape: LengthShape,
    update_s: float,
    slots: int,
    chip: tuple[float, float, float],
    devices: int,
    engine: Any,
    params: int,
    *,
    floor_s: float = 0.0,
    packing: bool | None = None,
    partial: bool = True,
    cache: dict[Any, Any] | None = None,
) -> StageSchedule:
    """The modes of one planned stage for ``shape`` (the module's docstring states how);
    ``update_s`` the padded update on all devices, ``slots`` the rollout's on all devices,
    ``params`` the model's parameter count, ``floor_s`` a decode step's fixed cost,
    ``packing`` whether the update packs its rows (None: the plan's ``update.packing``);
    ``partial`` False leaves the partial rollouts out (0 re-prefill); ``cache`` a dict
    shared by calls that differ only in the update (``update_s``, ``packing``): the
    rollouts are replayed once."""
    _, bandwidth, peak = chip
    cost, memory = stage_inputs(p, slots, chip, devices, floor_s)
    g, t, pl = max(p.group_size, 1), p.response_length, p.prompt_length
    prompts = max(p.samples // g, 1)
    lengths = shape.draw(prompts * g, t, group=g).reshape(prompts, g)
    packed = packed_share(p, lengths) if (p.packing if packing is None else packing) else None
    update_s *= 1.0 if packed is None else packed
    cost = _held_cost(cost, p, lengths)
    steps = max(int(getattr(engine, "decode_steps", 64) or 64), 1)

    def slots_on(d: int) -> int:  # a split's generating side runs the slots it holds
        return max(slots, 1) if d == devices else memory.slots(d, devices)

    def costs(d: int) -> Costs:
        n = slots_on(d)
        sizes = sorted({1 << i for i in range(n.bit_length())} | {n})
        return Costs(
            step_s={r: cost.step_s(r, d) for r in sizes},
            prefill_s=max(2 * params * pl / (d * peak), cost.weights / bandwidth),
            reprefill_token_s=2 * params / (d * peak),
            by_live=p.ragged,
        )

    def upd(d: int) -> float:
        return update_s if d == devices else update_s * devices / (devices - d)

    memo = {} if cache is None else cache  # the rollouts do not depend on the update

    def rollout(d: int) -> Mode:  # rollout on d devices, the others updating (d < N)
        if ("rollout", d) not in memo:
            c, n = costs(d), slots_on(d)
            s = simulate(lengths, costs=c, slots=n, decode_steps=steps)
            full = s.drain_tokens * c.step(n) / n  # with every slot busy
            memo["rollout", d] = (s.total_s, max(s.drain_s - full, 0.0), n)
        total, drain, n = memo["rollout", d]
        return Mode(total, upd(d), drain, d, d == devices, n)

    def carried_on(d: int) -> Mode:
        n = slots_on(d)
        if ("carried", d) not in memo:
            more = prompts * (CARRIED_STEPS + 2) + -(-n // g)  # outlasts the carried steps
            stream = shape.draw(more * g, t, seed=1, group=g).reshape(more, g)
            c = costs(d)
            memo["carried", d] = carried(
                stream, decode_steps=steps, batch=p.samples, steps=CARRIED_STEPS, costs=c, slots=n
            )
        return Mode(memo["carried", d], upd(d), 0.0, d, d == devices, n)

    held = _held_splits(memory, cost.tensor, devices)
    split = _best(rollout, held, upd)
    # carried at the drained rollout's best split too: it is no slower there
    near = [_best(carried_on, held, upd)] + ([carried_on(split.rollout_devices)] if split else [])
    carried_split = min((m for m in near if m), key=lambda m: m.step_s, default=None)
    every = getattr(engine, "publish_chunks", None) or PUBLISH_CHUNKS
    run = dict(costs=costs(devices), slots=max(slots, 1), decode_steps=steps)
    reprefill, publishes = _reprefill(lengths, every, engine, pl, **run) if partial else (0.0, 0)
    return StageSchedule(
        stage=p.stage,
        steps=p.steps,
        shape=shape,
        mean_tokens=float(lengths.mean()),
        devices=devices,
        sync=rollout(devices),
        split=split,
        reprefill_s=reprefill,
        publishes=publishes,
        publish_chunks=every,
        carried=carried_on(devices),
        carried_split=carried_split,
        packed=packed,
        floor_s=floor_s,
    )


def _dur(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _split(m: Mode, n: int) -> str:
    return f"{m.rollout_devices} generate ({m.slots} slots) / {n - m.rollout_devices} update"


def _update_text(s: StageSchedule) -> str:
    if s.packed is None:
        return "padded"
    return f"packed: {s.packed:.0%} of the padded micro-batches' slots"


def _stage_lines(s: StageSchedule) -> list[str]:
    n, sync = s.devices, s.sync
    head = f"[schedule]   stage {s.stage}, {s.shape.name}:"
    lines = [
        f"[schedule]   stage {s.stage}, {s.shape.name} (mean {s.mean_tokens:,.0f} tokens): "
        f"sync and overlap on shared devices: step {_dur(sync.step_s)} = rollout "
        f"{_dur(sync.rollout_s)} + update {_dur(sync.update_s)} ({_update_text(s)}); the "
        f"drain {_dur(sync.drain_s)}, {sync.drain_s / sync.step_s:.0%} of the step"
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


MODES = (("split", "split"), ("carried", "carried"), ("carried split", "carried_split"))


def run_hours(per_stage: Sequence[StageSchedule]) -> dict[str, float | None]:
    """Hours of the stages' steps (one schedule per stage) in each mode: ``sync`` and
    ``MODES``' (None where a stage has no split that holds)."""
    out: dict[str, float | None] = {"sync": sum(s.steps * s.sync.step_s for s in per_stage) / 3600}
    for label, field in MODES:
        modes = [getattr(s, field) for s in per_stage]
        if any(m is None for m in modes):
            out[label] = None
        else:
            seconds = sum(s.steps * m.step_s for s, m in zip(per_stage, modes, strict=True))
            out[label] = seconds / 3600
    return out


def _hours_text(h: dict[str, float | None]) -> str:
    sync = h["sync"] or 0.0
    parts = [f"sync {sync:.1f} h"]
    for label, _ in MODES:
        x = h[label]
        if x is None:
            parts.append(f"{label} none holds")
        else:
            parts.append(f"{label} {x:.1f} h ({sync / x if x else 0:.2f}x)")
    return "; ".join(parts)


def schedule_lines(
    stages: Sequence[Sequence[StageSchedule]],
    chips: int,
    engine: Any,
    slots_label: str,
    variants: Sequence[tuple[str, Sequence[Sequence[StageSchedule]]]] = (),
) -> list[str]:
    """The plan's ``[schedule]`` section: ``stages[i][j]`` stage i under shape j, as the run
    is configured; ``variants``: (label, schedules laid out the same) for the run's hours
    with other update and cache settings and step floors."""
    if not stages or not stages[0]:
        return []
    shapes = [s.shape for s in stages[0]]
    floor = stages[0][0].floor_s
    lines = [
        "",
        "[schedule] the rollout replayed step by step (rollout.schedule.simulate): "
        f"continuous batching in one lane at {slots_label} (a split's generating side: the "
        f"slots its own HBM holds), decode_steps {getattr(engine, 'decode_steps', 64)}, on "
        f"the roofline decode step + {floor * 1e3:g} ms fixed; prefill at the longest prompt; "
        "host work, inserts and the verifier left out",
        "[schedule] lengths: " + "; ".join(x.describe() for x in shapes),
    ]
    for per_shape in stages:
        for s in per_shape:
            lines += _stage_lines(s)
    for j, shape in enumerate(shapes):
        h = run_hours([st[j] for st in stages])
        sync = h["sync"] or 0.0
        lines.append(
            f"[schedule] run, {shape.name}: {_hours_text(h)}; sync = {sync * chips:,.0f} chip-hours"
        )
    if variants:
        lines.append(
            "[schedule] run hours by update, KV cache and a decode step's fixed cost F "
            "(sync; the best split; carried on shared devices; carried at its own best split):"
        )
    for label, sched in variants:
        for j, shape in enumerate(s.shape for s in sched[0]):
            per_stage = [st[j] for st in sched]
            floor = per_stage[0].floor_s * 1e3
            lines.append(
                f"[schedule] run, {shape.name}, {label}, F {floor:g} ms: "
                f"{_hours_text(run_hours(per_stage))}"
            )
    return lines
