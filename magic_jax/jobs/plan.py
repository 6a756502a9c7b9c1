"""Whether a run fits a Cloud TPU slice: each stage's programs compiled ahead of time for it.

With ``jax[tpu]`` (libtpu) installed, ``jax.experimental.topologies`` gives the
devices of a TPU slice to compile for on any machine. For each stage of a run
configuration, ``plan`` compiles, at the model's real shapes (abstract arrays:
no weight is materialised) and the run's mesh and batch sizes:

* the update step (one mini-batch of D_T * G rows, micro-batched as configured),
  and one micro-batch alone (XLA's cost analysis counts a loop body once);
* the engine's prefill (one prompt of ``max_prompt_length``) and decode step
  (``max_concurrent_decodes`` slots over a cache of prompt + T).

XLA's memory analysis of those programs, with the exact per-device sizes of
the sharded parameters, optimizer state and KV cache, gives the per-device
memory of the two phases of a training step; XLA's cost analysis gives a
roofline time (decode: bytes / HBM bandwidth; update: flops / peak), from which
``overlap_plan`` predicts the step in sync and overlap modes (``[overlap]`` lines).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from magic_jax.jobs.overlap_plan import overlap_lines, stage_overlap
from magic_jax.jobs.roofline import (
    DecodeBound,
    DecodeOption,
    TimeBound,
    chip_hours,
    decode_bound,
    decode_options,
    own_option,
    recommend_slots,
    update_bound,
)
from magic_jax.jobs.schedule_plan import (
    DEFAULT_SHAPES,
    STEP_FLOORS_MS,
    LengthShape,
    parse_shape,
    schedule_lines,
    stage_schedule,
)
from magic_jax.jobs.stage_plan import StagePlan, plan_stage, resolve_model
from magic_jax.jobs.topology import Chip, GiB, PlanError, resolve_topology, topology_devices
from magic_jax.model.sharding import make_mesh
from magic_jax.rollout.engine_config import EngineOptions

# --------------------------------------------------------------------------- a run


@dataclasses.dataclass
class RunPlan:
    """A run's stages on one slice, and for each stage that does not fit, the
    smallest slice of the same chip that does (None: none up to the largest);
    ``remat`` and ``compute_dtype`` are the update's, ``engine`` the run's engine
    options (its ``rollout`` section)."""

    topology: str
    chip: Chip
    devices: int
    chips: int
    model: Any
    stages: list[StagePlan]
    fits_on: dict[str, tuple[str, StagePlan] | None]
    remat: str = "none"
    compute_dtype: str = "float32"
    engine: EngineOptions = dataclasses.field(default_factory=EngineOptions)

    @property
    def rollout_dtype(self) -> str:
        """The engine's weights and compute: its ``dtype``, else the model's."""
        return self.engine.dtype or self.model.dtype

    @property
    def kv_dtype(self) -> str | None:
        return self.engine.kv_dtype

    @property
    def hbm_bytes(self) -> float:
        return self.chip.hbm_gib * GiB * self.chips / self.devices


def smallest_fit(
    config: Any,
    index: int,
    model_config: Any,
    mesh_config: Any,
    chip: Chip,
    hbm: float,
    above: int,
    compiled: StagePlan,
) -> tuple[str, StagePlan] | None:
    """The smallest slice of ``chip`` larger than ``above`` chips where stage ``index`` fits.

    Candidates are screened with their exact sharded terms and the compiled
    plan's temporaries scaled by rows per device (per micro-batch for the
    update, decode slots for the engine); the first that passes is compiled to
    confirm. A micro-batch that does not split over a candidate's data x fsdp
    devices is raised to the smallest size that does (the plan prints it).
    """
    from magic_jax.model.sharding import MeshConfig

    if -1 not in mesh_config.sizes():  # let fsdp take the extra chips
        mesh_config = MeshConfig(data=mesh_config.data, fsdp=-1, tensor=mesh_config.tensor)
    n_old = compiled.mesh["data"] * compiled.mesh["fsdp"]
    for shape in chip.topologies:
        name = f"{chip.name}:{shape}"
        if math.prod(int(s) for s in shape.split("x")) <= above:
            continue
        devices = topology_devices(name)
        try:
            mesh = make_mesh(mesh_config, devices)
            n_new = mesh.shape["data"] * mesh.shape["fsdp"]
            cfg = _split_micro_batch(config, compiled.rows, n_new)
            p = plan_stage(cfg, index, model_config, mesh, compile=False)
        except ValueError:  # the mesh or the batch does not split over this slice
            continue
        rows_per_device = (p.micro_batch / n_new) / (compiled.micro_batch / n_old)
        p.activations = int(compiled.activations * rows_per_device)
        # What XLA states for a decode step over HBM is no size of one that fits (33.6 GiB
        # for the 32B 24K stage on v6e-64, 0.14 compiled at 16K): left out, the compile checks.
        over = "decode" in compiled.over_hbm
        p.decode_temps = 0 if over else int(compiled.decode_temps * n_old / n_new)
        if p.peak() <= hbm:
            p = plan_stage(cfg, index, model_config, mesh, int8_probe=False)
            if p.peak() <= hbm:
                return name, p
    return None


def _split_micro_batch(config: Any, rows: int, devices: int) -> Any:
    """``config`` with a micro-batch size that splits over ``devices`` row shards: the
    configured one, else the smallest multiple of both that divides ``rows``."""
    micro = config.update.micro_batch_size
    if micro is None or micro % devices == 0:
        return config
    m = math.lcm(micro, devices)
    if rows % m:
        return config
    update = dataclasses.replace(config.update, micro_batch_size=m)
    return dataclasses.replace(config, update=update)


def plan_run(
    config: Any,
    topology: str,
    *,
    mesh_config: Any = None,
    preset: str | None = None,
    stages: Sequence[int] | None = None,
    search: bool = True,
    log: Any = None,
) -> RunPlan:
    """Plans ``config`` (a ``TrainConfig``) on the TPU slice ``topology``.

    Args:
      config: the run.
      topology: a gcloud accelerator type (``v5p-128``) or ``GEN:SHAPE`` (``v5p:4x4x4``).
      mesh_config: the mesh (default: the run's, else all devices on fsdp).
      preset: model preset, when ``config.model`` is not a checkpoint here.
      stages: indices of the stages to plan (default all).
      search: for a stage that does not fit, look for the smallest slice that does.
      log: a callable for progress lines.
    """
    from magic_jax.model.sharding import MeshConfig

    slice_ = resolve_topology(topology)
    chip, chips = slice_.chip, slice_.chips
    devices = topology_devices(topology)
    mesh_config = mesh_config or config.mesh or MeshConfig()
    try:
        mesh = make_mesh(mesh_config, devices)
    except ValueError as e:
        raise PlanError(f"--mesh on {topology} ({len(devices)} devices): {e}") from None
    model_config = resolve_model(config.model, config.param_dtype, preset)
    out = RunPlan(topology, chip, len(devices), chips, model_config, [], {})
    out.remat = config.update.remat or model_config.remat
    out.compute_dtype = config.update.compute_dtype or model_config.dtype
    out.engine = config.rollout
    for i in stages if stages is not None else range(len(config.stages)):
        if log:
            log(f"compiling stage {config.stages[i].name or i} for {slice_} ...")
        p = plan_stage(config, i, model_config, mesh)
        out.stages.append(p)
        if search and p.peak() > out.hbm_bytes:
            if log:
                log(f"stage {p.stage} does not fit: looking for the smallest {chip.name} slice")
            out.fits_on[p.stage] = smallest_fit(
                config, i, model_config, mesh_config, chip, out.hbm_bytes, chips, p
            )
    return out


def _copies(n: int) -> str:
    if n == 0:
        return "the compiled step copies no cache"
    return f"the compiled step copies the cache {n} time(s): a relayout, more bytes than this"


def _ragged_lines(p: StagePlan, float32_step: float) -> list[str]:
    """What the ragged decode attention reads: the weights and each row's held slots."""
    if not p.ragged or not p.kv_cache:
        return ["  decode attention: dense (the whole attended cache every step)"]
    s = p.prompt_length + p.response_length
    step = p.engine_params + p.kv_cache * p.held_share
    return [
        "  decode attention: ragged (the TPU kernel, in the decode step above): rows hold "
        f"P + T/2 = {p.prompt_length + p.response_length // 2} of {s} slots on average, so a step "
        f"reads {step / 1e9:.2f} GB ({(p.engine_params + p.kv_cache) / step:.2f}x less than "
        f"the full cache, {float32_step / step:.2f}x less than float32's full step)"
    ]


def _gib(n: float) -> str:
    return f"{n / GiB:9.2f}"


def _int8_line(p: StagePlan, weights: float, hbm: float, kv_dtype: str | None) -> str:
    """The decode step compiled with an int8 cache: its sizes, or why there are none."""
    q = p.int8
    if q is None:
        why = "the run's own cache is int8: * above" if kv_dtype else "not asked for"
        return f"    int8 KV cache: not compiled separately ({why})"
    if q.error:
        return f"    int8 KV cache: the decode step did not compile: {q.error}"
    head = (
        f"    int8 KV cache, compiled (rollout.kv_dtype int8, bf16 weights): KV "
        f"{q.kv_cache / GiB:.2f} GiB, decode temporaries {q.temps / GiB:.2f} GiB"
    )
    if q.over_hbm:
        return head + " (XLA refused it: over HBM)"
    # with copies of the cache the temporaries grow with the slots: scaled with them
    per_slot = (q.kv_cache + (q.temps if q.cache_copies else 0)) / p.slots
    room = hbm - p.params - p.opt_state - weights - (0 if q.cache_copies else q.temps)
    fit = max(0, int(room // per_slot)) if per_slot > 0 else 0
    return (
        f"{head}, a step reads >= {q.step_bytes / 1e9:.2f} GB, "
        f"{_copies(q.cache_copies)}; slots that fit: {fit}"
    )


def _stage_header(p: StagePlan, hbm: float) -> list[str]:
    mesh = " x ".join(f"{k} {v}" for k, v in p.mesh.items())
    lines = [
        "",
        f"stage {p.stage}: T {p.response_length}, {p.steps} steps; mesh {mesh}; update: "
        f"{p.rows} rows in micro-batches of {p.micro_batch}, {p.sgd_steps} optimizer step(s) "
        "per step",
        f"  {'per device, GiB':<30}{'update':>9}{'rollout':>9}",
    ]
    for label, (u, r) in p.terms().items():
        lines.append(f"  {label:<30}{_gib(u)}{_gib(r)}".replace("     0.00", "        -"))
    verdict = "fits" if p.peak() <= hbm else "DOES NOT FIT"
    lines.append(
        f"  {'total':<30}{_gib(p.update_total)}{_gib(p.rollout_total)}"
        f"  of {hbm / GiB:.2f}: {verdict}"
    )
    if p.over_hbm:
        lines.append(
            f"  XLA refused the {' and '.join(p.over_hbm)} program(s) for this chip "
            "(over HBM); their temporaries above are the sizes XLA stated"
        )
    return lines


def _option_lines(plan: RunPlan, p: StagePlan, opts: list[DecodeOption]) -> list[str]:
    own = own_option(plan.rollout_dtype, plan.kv_dtype)
    lines = [
        f"  decode by rollout precision (sizes scaled from this plan's, * compiled; "
        f"{p.slots} slots at T {p.response_length}):"
    ]
    for o in opts:
        mark = "*" if o.label == own else " "
        lines.append(
            f"   {mark}{o.label:<15} weights {o.weights / GiB:6.2f} GiB, "
            f"KV {o.kv_cache / GiB:6.2f} GiB: {o.step_bytes / 1e9:6.2f} GB/step "
            f"({opts[0].step_bytes / o.step_bytes:.2f}x less than "
            f"float32), <= {o.tokens_per_s:,.0f} tokens/s; slots that fit: {o.slots_fit}"
        )
    lines.append("    (set by rollout.dtype and rollout.kv_dtype; the last is bfloat16 + int8)")
    return [*lines, _int8_line(p, opts[-1].weights, plan.hbm_bytes, plan.kv_dtype)]


def _bound_text(b: DecodeBound) -> str:
    return (
        f"{b.slots} slots >= {b.step_s * 1e3:.2f} ms/step, <= {b.tokens_per_s:,.0f} tokens/s, "
        f">= {b.rollout_s / 60:.1f} min"
    )


def _slot_lines(plan: RunPlan, p: StagePlan, bw: float, peak: float) -> tuple[list[str], int]:
    """The recommended decode slots and the decode bound there and as configured."""
    over = "decode" in p.over_hbm  # its temporaries are XLA's ask, not a fitting step's
    fit = (dataclasses.replace(p, decode_temps=0) if over else p).slots_fit(plan.hbm_bytes)
    shards = p.mesh.get("data", 1) * p.mesh.get("fsdp", 1)
    rec = recommend_slots(fit, p.samples, shards)
    precision = plan.rollout_dtype + (" + int8 KV" if plan.kv_dtype else "")
    why = (
        f"the largest power of two, a multiple of the {shards} slot shards, within the {fit} "
        f"slots that fit at {precision} and the {p.samples} samples per step"
    )
    if not rec:
        return [f"  recommended rollout.max_concurrent_decodes: none fits ({why})"], 0
    reads = "ragged reads" if p.ragged else "the whole cache"
    lines = [
        f"  recommended rollout.max_concurrent_decodes: {rec} ({why}; scaled from the "
        "compiled sizes, decode temporaries "
        + ("left out: the step was over HBM as configured)" if over else "as compiled)"),
        f"  decode roofline ({reads}, {p.samples} samples of T): configured "
        f"{_bound_text(decode_bound(p, p.slots, bw, peak))}; recommended "
        f"{_bound_text(decode_bound(p, rec, bw, peak))}",
    ]
    return lines, rec


def _decode_step_lines(p: StagePlan, bw: float, peak: float, base: float) -> list[str]:
    t_dec = max(p.decode_bytes / bw, p.decode_flops / peak)
    full = math.ceil(p.samples / p.slots) * p.response_length * t_dec
    return [
        f"  decode step over the full cache: {p.decode_bytes / 1e9:.2f} GB read "
        f"({_copies(p.decode_cache_copies)}), "
        f"{p.decode_flops / 1e9:.1f} GFLOP per device -> >= {t_dec * 1e3:.2f} ms, "
        f"<= {p.slots / t_dec:,.0f} tokens/s over {p.slots} slots; "
        f"{p.samples} samples all of length T: >= {full / 60:.1f} min",
        *_ragged_lines(p, base),
        f"  update mini-batch: {p.update_flops / 1e12:.1f} TFLOP per device (XLA, 0 if "
        f"not compiled; counted, every row at P + T with remat and the attention's L^2: "
        f"{p.model_flops / 1e12:.1f}) -> >= "
        f"{max(p.update_flops, p.model_flops) / peak:.1f} s at the bf16 peak; "
        f"x {p.sgd_steps} per step",
    ]


def _no_fit_lines(plan: RunPlan, p: StagePlan) -> list[str]:
    c = plan.chip
    lines = [f"  largest term: {p.dominant()}"]
    if p.stage in plan.fits_on:
        fit = plan.fits_on[p.stage]
        if fit is None:
            lines.append(f"  no {c.name} slice up to {c.topologies[-1]} fits it")
        else:
            name, q = fit
            m = " x ".join(f"{k} {v}" for k, v in q.mesh.items())
            lines.append(
                f"  smallest {c.name} slice that fits: {resolve_topology(name)} (mesh {m}, "
                f"micro-batches of {q.micro_batch}): peak {q.peak() / GiB:.2f} GiB per device "
                "(compiled)"
            )
    return lines


def _dur(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _money(chip_h: float, price: float | None) -> str:
    return f"; at ${price:g} per chip-hour: >= ${chip_h * price:,.0f}" if price else ""


def _time_lines(
    plan: RunPlan, bounds: list[TimeBound], at_rec: list[TimeBound], price: float | None
) -> list[str]:
    """The recipe's time, chip-hour and cost bounds (as configured and at the
    recommended slots)."""
    lines = [
        "",
        "time (roofline lower bounds: a decode step's bytes / HBM bandwidth, an update's "
        "flops / bf16 peak; every response run to T; prefill, the log-prob pass, "
        "collectives and host work left out: real steps are slower)",
    ]
    for b in bounds:
        lines.append(
            f"  stage {b.stage}: per step >= {_dur(b.step)} (rollout >= {_dur(b.rollout)} + "
            f"update >= {_dur(b.update)}) x {b.steps} steps: >= {b.total / 3600:.1f} h"
        )
    unfit = [p.stage for p in plan.stages if p.peak() > plan.hbm_bytes]
    for label, bs in (("as configured", bounds), ("at the recommended slots", at_rec)):
        if len(bs) < len(plan.stages):
            continue
        hours = sum(b.total for b in bs) / 3600
        ch = chip_hours(bs, plan.chips)
        lines.append(
            f"  stage(s) {' + '.join(b.stage for b in bs)} {label}: >= {hours:.1f} h on "
            f"{plan.chips} chips = >= {ch:,.0f} chip-hours{_money(ch, price)}"
        )
    if unfit:
        lines.append(f"  (stage(s) {', '.join(unfit)} do not fit this slice as configured)")
    return lines


def format_plan(
    plan: RunPlan,
    price: float | None = None,
    shapes: Sequence[LengthShape] | None = None,
    floors_ms: Sequence[float] = STEP_FLOORS_MS,
) -> str:
    """The plan as printed by ``magic-jax plan``; ``price``: US dollars per chip-hour, for
    a cost line; ``shapes``: the response lengths of the ``[schedule]`` lines (None: the
    default shapes); ``floors_ms``: a decode step's fixed costs, milliseconds (the
    ``[overlap]`` and per-stage ``[schedule]`` lines at the first; the run's hours at
    each, for each update and KV cache variant, except at every response T; none: 0 ms
    and no variants)."""
    if shapes is None:
        shapes = [parse_shape(x) for x in DEFAULT_SHAPES]
    floors = [x / 1e3 for x in floors_ms] or [0.0]
    varied = [x for x in shapes if x.clipped < 1.0]  # every row at T: nothing to pack
    c, mc = plan.chip, plan.model
    per_chip = plan.devices // plan.chips
    bw = c.hbm_gbps * 1e9 / per_chip
    peak = c.bf16_tflops * 1e12 / per_chip
    lines = [
        f"model: {mc.num_params() / 1e9:.2f}B parameters, L {mc.num_layers}, D {mc.hidden_size}, "
        f"V {mc.vocab_size}; parameters {mc.param_dtype}; update: compute {plan.compute_dtype}, "
        f"remat {plan.remat}; rollout: weights and compute {plan.rollout_dtype}, KV cache "
        f"{plan.kv_dtype or plan.rollout_dtype}",
        f"slice: {resolve_topology(plan.topology)}, {plan.chips} chips, {plan.devices} devices",
        f"chip: TPU {c.name}: {c.hbm_gib:g} GiB HBM, {c.hbm_gbps:g} GB/s, "
        f"{c.bf16_tflops:g} TFLOP/s bf16 per chip (cloud.google.com/tpu/docs/{c.name})",
    ]
    bounds, at_rec, overlap, sched = [], [], [], []
    variants: dict[tuple[str, float], list[list[Any]]] = {}
    n_params = mc.num_params()
    for p in plan.stages:
        lines += _stage_header(p, plan.hbm_bytes)
        head_dim = mc.head_dim or mc.hidden_size // mc.num_heads
        opts = decode_options(p, plan.rollout_dtype, head_dim, plan.hbm_bytes, bw, plan.kv_dtype)
        lines += _option_lines(plan, p, opts)
        slot_lines, rec = _slot_lines(plan, p, bw, peak)
        lines += _decode_step_lines(p, bw, peak, opts[0].step_bytes) + slot_lines
        if p.peak() > plan.hbm_bytes:
            lines += _no_fit_lines(plan, p)
        upd = update_bound(p, peak)
        bounds.append(
            TimeBound(p.stage, p.steps, decode_bound(p, p.slots, bw, peak).rollout_s, upd)
        )
        if rec:
            at_rec.append(
                TimeBound(p.stage, p.steps, decode_bound(p, rec, bw, peak).rollout_s, upd)
            )
        chip = (plan.hbm_bytes, bw, peak)
        slots = rec or p.slots
        overlap.append(
            stage_overlap(p, upd, slots, chip, plan.devices, plan.engine, floor_s=floors[0])
        )
        if p.peak() <= plan.hbm_bytes:
            args = (upd, slots, chip, plan.devices, plan.engine, n_params)
            sched.append([stage_schedule(p, x, *args, floor_s=floors[0]) for x in shapes])
            caches: dict[Any, dict[Any, Any]] = {}  # padded and packed: the same rollouts
            for (label, q, n, packing), floor in itertools.product(
                _variants(plan, p, opts, slots) if floors_ms else (), floors
            ):
                row = [
                    stage_schedule(q, x, upd, n, *args[2:], floor_s=floor, packing=packing,
                                   partial=False, cache=caches.setdefault((id(q), floor, x), {}))
                    for x in varied
                ]  # fmt: skip
                variants.setdefault((label, floor), []).append(row)
    label = {len(bounds): "the recommended slots", 0: "the slots as configured"}.get(
        len(at_rec), "the recommended slots, as configured where none fits"
    )
    lines += _time_lines(plan, bounds, at_rec, price)
    lines += overlap_lines(overlap, plan.chips, plan.engine, label)
    rows = [(k[0], v) for k, v in variants.items() if len(v) == len(sched) and varied]
    return "\n".join(lines + schedule_lines(sched, plan.chips, plan.engine, label, rows))


def _variants(
    plan: RunPlan, p: StagePlan, opts: list[DecodeOption], slots: int
) -> list[tuple[str, StagePlan, int, bool]]:
    """(label, the stage as planned or with an int8 cache on the ragged kernel, its
    rollout slots, packing) for the run's hours: the update padded and packed, the run's
    own cache and ``int8-ragged`` (``opts``' bf16 + int8 KV sizes, every step on the ragged
    kernel: no relayout, the slots its bytes fit)."""
    int8 = dataclasses.replace(
        p,
        engine_params=int(opts[-1].weights),
        kv_cache=int(opts[-1].kv_cache),
        ragged=True,
        decode_cache_copies=0,
    )
    shards = p.mesh.get("data", 1) * p.mesh.get("fsdp", 1)
    slots8 = recommend_slots(int8.slots_fit(plan.hbm_bytes), p.samples, shards) or slots
    own = f"{plan.kv_dtype or plan.rollout_dtype} KV"
    out = []
    for kv, q, n in ((own, p, slots), ("int8-ragged KV", int8, slots8)):
        for packing in (False, True):
            mine = " (as configured)" if (packing == p.packing and q is p) else ""
            update = "packed" if packing else "padded"
            out.append((f"{update}, {kv}{mine}", q, n, packing))
    return out


def plan_command(args: Any) -> int:
    """``magic-jax plan``: the plan of ``args.config`` on ``args.topology``, printed (the
    progress on stderr unless ``--quiet``)."""
    from magic_jax.model.sharding import MeshConfig
    from magic_jax.run.config import load_config

    price = args.price_per_chip_hour
    if price is not None and not 0 < price < float("inf"):
        raise ValueError(f"--price-per-chip-hour {price:g}: expected a positive number of USD")
    floors = getattr(args, "step_floor_ms", None)
    bad = [x for x in floors or () if not 0 <= x < float("inf")]
    if bad:
        raise ValueError(f"--step-floor-ms {bad[0]:g}: expected milliseconds >= 0")
    config = load_config(args.config, args.set or ())
    shapes = [parse_shape(x) for x in args.lengths or DEFAULT_SHAPES]
    mesh = None
    if args.mesh:
        try:
            kw = {k.strip(): int(v) for k, v in (p.split("=") for p in args.mesh.split(","))}
            mesh = MeshConfig(**kw)
        except (ValueError, TypeError) as e:
            raise ValueError(f"--mesh {args.mesh!r}: {e}") from None
    stages = None if args.stage is None else [args.stage]
    if stages and not 0 <= args.stage < len(config.stages):
        raise ValueError(f"--stage {args.stage}: the config has {len(config.stages)} stage(s)")
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if not args.quiet else None
    t0 = time.perf_counter()
    result = plan_run(
        config,
        args.topology,
        mesh_config=mesh,
        preset=args.preset,
        stages=stages,
        search=not args.no_search,
        log=log,
    )
    shown = [args.config, "--topology", args.topology]
    shown += ["--mesh", args.mesh] if args.mesh else []
    shown += ["--stage", str(args.stage)] if args.stage is not None else []
    shown += [a for kv in args.set or () for a in ("--set", kv)]
    shown += ["--price-per-chip-hour", f"{price:g}"] if price else []
    shown += [a for x in args.lengths or () for a in ("--lengths", x)]
    shown += [a for x in floors or () for a in ("--step-floor-ms", f"{x:g}")]
    print("magic-jax plan " + " ".join(shown))
    print(format_plan(result, price=price, shapes=shapes, floors_ms=floors or STEP_FLOORS_MS))
    if log:
        log(f"planned in {time.perf_counter() - t0:.0f}s")
    return 0
