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
from magic_jax.jobs.plan_lines import stage_lines, time_lines
from magic_jax.jobs.roofline import (
    DecodeOption,
    TimeBound,
    decode_bound,
    decode_options,
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
        head_dim = mc.head_dim or mc.hidden_size // mc.num_heads
        opts = decode_options(p, plan.rollout_dtype, head_dim, plan.hbm_bytes, bw, plan.kv_dtype)
        text, rec = stage_lines(plan, p, opts, bw, peak)
        lines += text
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
                    stage_schedule(
                        q,
                        x,
                        upd,
                        n,
                        *args[2:],
                        floor_s=floor,
                        packing=packing,
                        partial=False,
                        cache=caches.setdefault((id(q), floor, x), {}),
                    )
                    for x in varied
                ]
                variants.setdefault((label, floor), []).append(row)
    label = {len(bounds): "the recommended slots", 0: "the slots as configured"}.get(
        len(at_rec), "the recommended slots, as configured where none fits"
    )
    lines += time_lines(plan, bounds, at_rec, price)
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
    floors = args.step_floor_ms
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
