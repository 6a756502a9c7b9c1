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
roofline time (decode: bytes / HBM bandwidth; update: flops / peak).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

GiB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
    """Public per-chip figures of a TPU generation (Cloud TPU system architecture pages).

    Attributes:
      name: the generation's topology prefix (``v5e``).
      hbm_gib: HBM per chip, GiB.
      hbm_gbps: HBM bandwidth per chip, GB/s.
      bf16_tflops: peak bf16 matmul throughput per chip, TFLOP/s.
      topologies: slice shapes offered, smallest first (the smallest-fit search).
    """

    name: str
    hbm_gib: float
    hbm_gbps: float
    bf16_tflops: float
    topologies: tuple[str, ...]


_CUBES = ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16",
           "8x16x16", "16x16x16")  # fmt: skip

# Per chip, from cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e} ("System architecture"):
# HBM capacity (listed in GB; the chips hold that many GiB), HBM bandwidth, peak bf16.
CHIPS: dict[str, Chip] = {
    "v4": Chip(
        name="v4",
        hbm_gib=32,
        hbm_gbps=1200,
        bf16_tflops=275,
        topologies=_CUBES,
    ),
    "v5e": Chip(
        name="v5e",
        hbm_gib=16,
        hbm_gbps=819,
        bf16_tflops=197,
        topologies=("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    ),
    "v5p": Chip(
        name="v5p",
        hbm_gib=95,
        hbm_gbps=2765,
        bf16_tflops=459,
        topologies=_CUBES,
    ),
    "v6e": Chip(
        name="v6e",
        hbm_gib=32,
        hbm_gbps=1640,
        bf16_tflops=918,
        topologies=("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    ),
}


class PlanError(ValueError):
    """A plan that cannot be made (no libtpu, an unknown topology or model)."""


def parse_topology(name: str) -> tuple[Chip, int]:
    """``v5e:4x4`` -> (the v5e chip, 16 chips).

    Raises:
      PlanError: an unknown generation or a malformed shape.
    """
    m = re.fullmatch(r"(v\d+[a-z]*)[:_-]((?:\d+x)*\d+)", name.strip())
    if not m:
        raise PlanError(f"--topology {name!r}: expected GENERATION:SHAPE, e.g. v5e:4x4, v5p:2x2x2")
    gen, shape = m.groups()
    if gen not in CHIPS:
        raise PlanError(
            f"--topology {name!r}: unknown TPU generation {gen!r}; known: {list(CHIPS)}"
        )
    return CHIPS[gen], math.prod(int(s) for s in shape.split("x"))


def libtpu_available() -> bool:
    """Whether libtpu is installed (``pip install jax[tpu]``): TPU programs can be compiled."""
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


def topology_devices(name: str) -> list[Any]:
    """The devices of a TPU slice to compile for (needs libtpu: ``pip install jax[tpu]``).

    Raises:
      PlanError: no libtpu, or a slice shape libtpu does not know.
    """
    from jax.experimental import topologies

    _, chips = parse_topology(name)  # a clear error for a malformed name first
    if not libtpu_available():
        raise PlanError(
            "compiling for TPU needs libtpu here: pip install 'jax[tpu]' "
            "(`make test-tpu` sets up .venv-tpu with it)"
        )
    # Nothing runs on a TPU here: several planning processes may load libtpu at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        name = name.replace("-", ":")
        kw = {}
        if chips < 4:  # slices below one host's 2x2 chips
            dims = [int(d) for d in name.split(":")[1].split("x")]
            kw["chips_per_host_bounds"] = tuple([*dims, 1, 1, 1][:3])
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name, **kw)
    except Exception as e:  # libtpu's own message names what is wrong
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PlanError(f"--topology {name!r}: {msg}") from None
    return list(topo.devices)


# --------------------------------------------------------------------------- the model


def resolve_model(model: str, param_dtype: str, preset: str | None = None):
    """The ``ModelConfig`` a run loads, as the trainer builds it (compute dtype = param dtype;
    the update applies the run's ``remat`` and ``compute_dtype`` on top, see
    ``train_step.update_graphdef``).

    ``model`` is read when it is a checkpoint directory here (Hugging Face
    ``config.json`` or a magic_jax checkpoint); otherwise its name picks a preset
    (``.../DeepSeek-R1-Distill-Qwen-7B`` -> ``r1-distill-qwen-7b``), or ``preset`` does.
    """
    import json

    from magic_jax.model_config import PRESETS, ModelConfig

    dtypes = dict(param_dtype=param_dtype, dtype=param_dtype)
    if preset is not None:
        if preset not in PRESETS:
            raise PlanError(f"--preset {preset!r}: expected one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[preset], **dtypes)
    p = Path(model)
    if (p / "config.json").is_file():
        return ModelConfig.from_hf_config(json.loads((p / "config.json").read_text()), **dtypes)
    if (p / "model_config.json").is_file():
        from magic_jax.checkpoint import read_model_config

        return read_model_config(p)
    key = p.name.lower().removeprefix("deepseek-")
    if key in PRESETS:
        return dataclasses.replace(PRESETS[key], **dtypes)
    raise PlanError(
        f"model: {model} is not a checkpoint directory here and its name matches no preset "
        f"({', '.join(sorted(PRESETS))}); pass --preset NAME"
    )


# --------------------------------------------------------------------------- sizes


def shard_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded abstract arrays (the first device's shards)."""
    import jax

    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * x.dtype.itemsize  # also extended (PRNG key) dtypes
    return total


def _abstract(tree: Any, shardings: Any) -> Any:
    import jax

    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


@dataclasses.dataclass
class StagePlan:
    """Per-device bytes and roofline figures of one stage on one mesh.

    Memory (bytes per device): ``params`` and ``opt_state`` (the train state,
    resident all along), ``grads`` (the accumulated gradient: the params' shapes
    and shardings), ``activations`` (the rest of the update step's XLA
    temporaries), ``batch`` (the mini-batch), ``engine_params`` (the weights in
    the sampling layout), ``kv_cache``, ``decode_temps`` (the larger of the
    decode step's and the prefill's temporaries and outputs).

    Roofline inputs, per device: ``update_flops`` of one mini-batch (XLA),
    ``model_flops`` (6 x parameters x its tokens), ``decode_bytes`` and
    ``decode_flops`` of one decode step over the full cache; ``slots`` decode
    slots, ``samples`` = D_R x G responses per training step. ``over_hbm``
    names the programs XLA refused to compile for the chip (too large): their
    temporaries are the sizes XLA's error stated, their costs unknown (0).
    """

    stage: str
    response_length: int
    mesh: dict[str, int]
    rows: int
    micro_batch: int
    sgd_steps: int
    params: int
    opt_state: int
    grads: int
    activations: int
    batch: int
    engine_params: int
    kv_cache: int
    decode_temps: int
    update_flops: float = 0.0
    model_flops: float = 0.0
    decode_bytes: float = 0.0
    decode_flops: float = 0.0
    slots: int = 0
    samples: int = 0
    compiled: bool = True
    over_hbm: tuple[str, ...] = ()

    @property
    def update_total(self) -> int:
        return self.params + self.opt_state + self.grads + self.activations + self.batch

    @property
    def rollout_total(self) -> int:
        return self.params + self.opt_state + self.engine_params + self.kv_cache + self.decode_temps

    def peak(self) -> int:
        return max(self.update_total, self.rollout_total)

    def terms(self) -> dict[str, tuple[int, int]]:
        """Label -> (bytes in the update phase, bytes in the rollout phase)."""
        return {
            "parameters (train layout)": (self.params, self.params),
            "optimizer state": (self.opt_state, self.opt_state),
            "gradients": (self.grads, 0),
            "activations/temporaries": (self.activations, 0),
            "update batch": (self.batch, 0),
            "weights (engine layout)": (0, self.engine_params),
            "KV cache": (0, self.kv_cache),
            "decode/prefill temporaries": (0, self.decode_temps),
        }

    def dominant(self) -> str:
        """The largest term of the phase with the larger peak."""
        col = 0 if self.update_total >= self.rollout_total else 1
        return max(self.terms().items(), key=lambda kv: kv[1][col])[0]


def _mesh(devices: Sequence[Any], mesh_config: Any):
    import jax

    from magic_jax.sharding import MESH_AXES

    shape = mesh_config.resolve(len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=list(devices))
    except NotImplementedError:  # an axis that is no product of physical axes (4 on 8x8)
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, list(devices), allow_split_physical_axes=True)
        return jax.sharding.Mesh(grid, MESH_AXES, axis_types=auto)


def _train_state(config: Any, index: int, model_config: Any, mesh: Any) -> dict[str, Any]:
    """The abstract train state on ``mesh``, placed as the trainer places it."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from magic_jax.entropy import init_entropy_control
    from magic_jax.model import abstract_model
    from magic_jax.sharding import TRAIN_RULES, model_shardings
    from magic_jax.stages import update_config
    from magic_jax.train_state import TrainState, opt_state_shardings
    from magic_jax.train_step import default_update_layer_unroll, make_optimizer

    # the update as it compiles on the slice's platform, not this host's
    platform = mesh.devices.flat[0].platform
    ucfg = update_config(config, index)
    if ucfg.layer_unroll is None:
        ucfg = dataclasses.replace(ucfg, layer_unroll=default_update_layer_unroll(platform))
    graphdef, params = nnx.split(abstract_model(model_config), nnx.Param)
    params = _abstract(params, model_shardings(params, mesh, TRAIN_RULES))
    repl = NamedSharding(mesh, PartitionSpec())
    tx = make_optimizer(ucfg.optimizer)
    # placed as init_train_state places it: moments like their parameters
    opt_sh = opt_state_shardings(tx, params, mesh)
    scalars = jax.eval_shape(lambda: init_entropy_control(ucfg.entropy))
    state = TrainState(
        params=params,
        opt_state=_abstract(jax.eval_shape(tx.init, params), opt_sh),
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=repl),
        skipped=jax.ShapeDtypeStruct((), jnp.int32, sharding=repl),
        entropy=_abstract(scalars, jax.tree.map(lambda _: repl, scalars)),
    )
    # The frozen reference policy (KL on) is a second copy of the weights, read only.
    ref = params if ucfg.loss.kl_beta > 0 else None
    return dict(graphdef=graphdef, config=ucfg, state=state, ref=ref)


def _engine(config: Any, index: int, model_config: Any, mesh: Any) -> dict[str, Any]:
    """The stage's engine (as the trainer builds it) with abstract weights and decode state."""
    import jax

    from magic_jax.engine import Engine, EngineConfig
    from magic_jax.model import abstract_model

    model = abstract_model(model_config)
    engine = Engine(
        model,
        EngineConfig(
            max_concurrent_decodes=config.rollout.max_concurrent_decodes,
            max_prefill_length=config.data.max_prompt_length,
            max_decode_length=config.stages[index].max_response_length,
            decode_steps=config.rollout.decode_steps,
            sampling=config.sampling,
            dtype=config.rollout.dtype,
        ),
        mesh=mesh,
    )
    params = _abstract(engine.abstract_params, engine.param_shardings)
    state = _abstract(jax.eval_shape(engine.init_decode_state), engine.state_shardings())
    return dict(engine=engine, params=params, state=state)


def _batch(config: Any, index: int, rows: int, mesh: Any) -> Any:
    """An abstract mini-batch of ``rows`` rows, padded as ``pack_rollouts`` pads them."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from magic_jax.buffer import RolloutBuffer
    from magic_jax.sharding import BATCH_AXES

    st = config.stages[index]
    p = 64 * math.ceil(config.data.max_prompt_length / 64)
    rb = min(256, st.max_response_length)
    r = rb * math.ceil(st.max_response_length / rb)
    sh = NamedSharding(mesh, PartitionSpec(BATCH_AXES))

    def a(shape, dtype):
        return jax.ShapeDtypeStruct((rows, *shape), dtype, sharding=sh)

    i32, f32 = np.int32, np.float32
    return RolloutBuffer(
        tokens=a((p + r,), i32),
        positions=a((p + r,), i32),
        attention_mask=a((p + r,), i32),
        response_mask=a((r,), f32),
        old_logprobs=a((r,), f32),
        entropies=a((r,), f32),
        rewards=a((), f32),
        truncated=a((), bool),
        group_ids=a((), i32),
        advantages=a((), f32),
        keep=a((), bool),
        valid=a((), bool),
        group_size=st.group_size,
    )


def plan_stage(
    config: Any, index: int, model_config: Any, mesh: Any, *, compile: bool = True
) -> StagePlan:
    """Measures stage ``index`` on ``mesh`` (see the module doc).

    With ``compile=False`` only the sharded terms (parameters, optimizer state,
    gradients, engine weights, KV cache) are filled in; temporaries are 0.
    """
    import functools

    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from magic_jax.decode import decode_step, prefill_fn
    from magic_jax.sharding import BATCH_AXES
    from magic_jax.train_step import loss_and_grads, train_step

    st = config.stages[index]
    t = _train_state(config, index, model_config, mesh)
    e = _engine(config, index, model_config, mesh)
    rows = st.mini_batch_groups * st.group_size
    ucfg = t["config"]
    n_rows = mesh.shape["data"] * mesh.shape["fsdp"]
    if rows % n_rows:
        raise PlanError(
            f"stages[{index}]: a mini-batch's D_T x G = {rows} rows do not split over "
            f"data x fsdp = {n_rows} devices"
        )
    micro = min(ucfg.micro_batch_size or rows, rows)
    if micro % n_rows:
        raise PlanError(
            f"micro_batch_size: a micro-batch of {micro} rows does not split over "
            f"data x fsdp = {n_rows} devices"
        )
    params = shard_bytes(t["state"].params)
    batch = _batch(config, index, rows, mesh)
    out = StagePlan(
        stage=st.name or str(index),
        response_length=st.max_response_length,
        mesh=dict(mesh.shape),
        rows=rows,
        micro_batch=micro,
        sgd_steps=st.prompts_per_step // st.mini_batch_groups * ucfg.num_reuse,
        params=params,
        opt_state=shard_bytes(t["state"].opt_state),
        grads=params,
        activations=0,
        batch=shard_bytes(batch),
        engine_params=shard_bytes(e["params"]),
        kv_cache=shard_bytes(e["state"]),
        decode_temps=0,
        slots=config.rollout.max_concurrent_decodes,
        samples=st.prompts_per_step * st.group_size,
        compiled=compile,
    )
    if not compile:
        return out
    repl = NamedSharding(mesh, PartitionSpec())
    alpha = jax.ShapeDtypeStruct((), "float32", sharding=repl)
    rows_sh = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    state_sh = jax.tree.map(lambda x: x.sharding, t["state"])
    kw = dict(graphdef=t["graphdef"], config=ucfg, ref_params=t["ref"])

    def step(state, batch, alpha):  # as PolicyUpdater compiles it
        new, metrics = train_step(state, batch, alpha, batch_sharding=rows_sh, **kw)
        return jax.lax.with_sharding_constraint(new, state_sh), metrics

    update = _compile(jax.jit(step, donate_argnums=0).lower(t["state"], batch, alpha))
    # XLA's cost analysis counts a loop body once, the micro-batch loop's and the
    # scanned layers' alike: the flops come from one micro-batch compiled alone with
    # its layers unrolled (the memory figures above are the scanned program's).
    flat = _train_state(config, index, dataclasses.replace(model_config, scan_layers=False), mesh)
    one = jax.jit(
        functools.partial(
            loss_and_grads, graphdef=flat["graphdef"], config=ucfg, ref_params=flat["ref"]
        )
    )
    micro_c = _compile(one.lower(flat["state"].params, _batch(config, index, micro, mesh), alpha))
    engine = e["engine"]
    decode = _compile(
        jax.jit(
            functools.partial(decode_step, engine.graphdef, sampling=config.sampling),
            donate_argnums=1,
            out_shardings=(engine.state_shardings(), None),
        ).lower(e["params"], e["state"], engine.eos_array)
    )
    prompt = jax.ShapeDtypeStruct((config.data.max_prompt_length,), "int32", sharding=repl)
    length = jax.ShapeDtypeStruct((), "int32", sharding=repl)
    prefill = jax.jit(functools.partial(prefill_fn, engine.graphdef))
    prefill = _compile(prefill.lower(e["params"], prompt, length))

    n_micro = rows // micro
    out.over_hbm = tuple(
        name
        for name, c in (("update", update), ("decode", decode), ("prefill", prefill))
        if c.over_hbm
    )
    out.activations = max(0, update.temp - out.grads)
    out.decode_temps = max(decode.temp, prefill.temp + prefill.output)
    p_len = batch.tokens.shape[1]
    out.model_flops = 6.0 * model_config.num_params() * rows * p_len / mesh.size
    if update.compiled is not None and micro_c.compiled is not None:
        # the optimizer's few flops per parameter are left out
        out.update_flops = n_micro * micro_c.cost("flops")
    # Every weight and cache byte is read once per step, whatever XLA reports.
    out.decode_bytes = max(decode.cost("bytes accessed"), out.engine_params + out.kv_cache)
    out.decode_flops = decode.cost("flops")
    return out


@dataclasses.dataclass
class _Program:
    """A compiled program's per-device memory, or what XLA said it needs when over HBM."""

    compiled: Any
    temp: int
    output: int
    over_hbm: bool

    def cost(self, key: str) -> float:
        if self.compiled is None:
            return 0.0
        ca = self.compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, list | tuple) else ca
        return float((ca or {}).get(key, 0.0))


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}


def _compile(lowered: Any) -> _Program:
    """Compiles for the TPU; a program over HBM is refused by XLA with its temporaries' size."""
    from jax.errors import JaxRuntimeError

    try:
        c = lowered.compile()
    except JaxRuntimeError as e:
        m = re.search(r"required for HLO temporaries \(([\d.]+)([KMGTP]?)\)", str(e))
        if "RESOURCE_EXHAUSTED" not in str(e) or not m:
            raise
        return _Program(None, int(float(m[1]) * _UNITS[m[2]]), 0, True)
    ma = c.memory_analysis()
    return _Program(c, ma.temp_size_in_bytes, ma.output_size_in_bytes, False)


# --------------------------------------------------------------------------- a run


@dataclasses.dataclass
class RunPlan:
    """A run's stages on one slice, and for each stage that does not fit, the
    smallest slice of the same chip that does (None: none up to the largest);
    ``remat`` and ``compute_dtype`` are the update's, ``rollout_dtype`` the engine's (the
    run's options)."""

    topology: str
    chip: Chip
    devices: int
    chips: int
    model: Any
    stages: list[StagePlan]
    fits_on: dict[str, tuple[str, StagePlan] | None]
    remat: str = "none"
    compute_dtype: str = "float32"
    rollout_dtype: str = "float32"

    @property
    def hbm_bytes(self) -> float:
        return self.chip.hbm_gib * GiB * self.chips / self.devices


def smallest_fit(
    config: Any, index: int, model_config: Any, mesh_config: Any, chip: Chip, hbm: float,
    above: int, compiled: StagePlan,
) -> tuple[str, StagePlan] | None:  # fmt: skip
    """The smallest slice of ``chip`` larger than ``above`` chips where stage ``index`` fits.

    Candidates are screened with their exact sharded terms and the compiled
    plan's temporaries scaled by rows per device (per micro-batch for the
    update, decode slots for the engine); the first that passes is compiled to
    confirm. A micro-batch that does not split over a candidate's data x fsdp
    devices is raised to the smallest size that does (the plan prints it).
    """
    from magic_jax.sharding import MeshConfig

    if -1 not in mesh_config.sizes():  # let fsdp take the extra chips
        mesh_config = MeshConfig(data=mesh_config.data, fsdp=-1, tensor=mesh_config.tensor)
    n_old = compiled.mesh["data"] * compiled.mesh["fsdp"]
    for shape in chip.topologies:
        name = f"{chip.name}:{shape}"
        if math.prod(int(s) for s in shape.split("x")) <= above:
            continue
        devices = topology_devices(name)
        try:
            mesh = _mesh(devices, mesh_config)
            n_new = mesh.shape["data"] * mesh.shape["fsdp"]
            cfg = _split_micro_batch(config, compiled.rows, n_new)
            p = plan_stage(cfg, index, model_config, mesh, compile=False)
        except ValueError:  # the mesh or the batch does not split over this slice
            continue
        rows_per_device = (p.micro_batch / n_new) / (compiled.micro_batch / n_old)
        p.activations = int(compiled.activations * rows_per_device)
        p.decode_temps = int(compiled.decode_temps * n_old / n_new)
        if p.peak() <= hbm:
            p = plan_stage(cfg, index, model_config, mesh)
            if p.peak() <= hbm:
                return name, p
    return None


def _split_micro_batch(config: Any, rows: int, devices: int) -> Any:
    """``config`` with a micro-batch size that splits over ``devices`` row shards: the
    configured one, else the smallest multiple of both that divides ``rows``."""
    micro = config.micro_batch_size
    if micro is None or micro % devices == 0:
        return config
    m = math.lcm(micro, devices)
    return dataclasses.replace(config, micro_batch_size=m) if rows % m == 0 else config


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
      topology: e.g. ``v5p:4x4x4``.
      mesh_config: the mesh (default: the run's, else all devices on fsdp).
      preset: model preset, when ``config.model`` is not a checkpoint here.
      stages: indices of the stages to plan (default all).
      search: for a stage that does not fit, look for the smallest slice that does.
      log: a callable for progress lines.
    """
    from magic_jax.sharding import MeshConfig

    chip, chips = parse_topology(topology)
    devices = topology_devices(topology)
    mesh_config = mesh_config or config.mesh or MeshConfig()
    try:
        mesh = _mesh(devices, mesh_config)
    except ValueError as e:
        raise PlanError(f"--mesh on {topology} ({len(devices)} devices): {e}") from None
    model_config = resolve_model(config.model, config.param_dtype, preset)
    out = RunPlan(topology, chip, len(devices), chips, model_config, [], {})
    out.remat = config.remat
    out.compute_dtype = config.compute_dtype or model_config.dtype
    out.rollout_dtype = config.rollout.dtype or model_config.dtype
    for i in stages if stages is not None else range(len(config.stages)):
        if log:
            log(f"compiling stage {config.stages[i].name or i} for {topology} ...")
        p = plan_stage(config, i, model_config, mesh)
        out.stages.append(p)
        if search and p.peak() > out.hbm_bytes:
            if log:
                log(f"stage {p.stage} does not fit: looking for the smallest {chip.name} slice")
            out.fits_on[p.stage] = smallest_fit(
                config, i, model_config, mesh_config, chip, out.hbm_bytes, chips, p
            )
    return out


def _gib(n: float) -> str:
    return f"{n / GiB:9.2f}"


def format_plan(plan: RunPlan) -> str:
    """The plan as printed by ``magic-jax plan``."""
    c, mc = plan.chip, plan.model
    per_chip = plan.devices // plan.chips
    bw = c.hbm_gbps * 1e9 / per_chip
    peak = c.bf16_tflops * 1e12 / per_chip
    lines = [
        f"model: {mc.num_params() / 1e9:.2f}B parameters, L {mc.num_layers}, D {mc.hidden_size}, "
        f"V {mc.vocab_size}; parameters {mc.param_dtype}; update: compute {plan.compute_dtype}, "
        f"remat {plan.remat}; rollout: weights, compute and KV cache {plan.rollout_dtype}",
        f"slice: {plan.topology}, {plan.chips} chips, {plan.devices} devices",
        f"chip: TPU {c.name}: {c.hbm_gib:g} GiB HBM, {c.hbm_gbps:g} GB/s, "
        f"{c.bf16_tflops:g} TFLOP/s bf16 per chip (cloud.google.com/tpu/docs/{c.name})",
    ]
    for p in plan.stages:
        mesh = " x ".join(f"{k} {v}" for k, v in p.mesh.items())
        lines += [
            "",
            f"stage {p.stage}: T {p.response_length}; mesh {mesh}; update: {p.rows} rows "
            f"in micro-batches of {p.micro_batch}, {p.sgd_steps} optimizer step(s) per step",
            f"  {'per device, GiB':<30}{'update':>9}{'rollout':>9}",
        ]
        for label, (u, r) in p.terms().items():
            lines.append(f"  {label:<30}{_gib(u)}{_gib(r)}".replace("     0.00", "        -"))
        hbm = plan.hbm_bytes
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
        t_dec = max(p.decode_bytes / bw, p.decode_flops / peak)
        t_upd = max(p.update_flops, p.model_flops) / peak
        full = math.ceil(p.samples / p.slots) * p.response_length * t_dec
        lines += [
            f"  decode step over the full cache: {p.decode_bytes / 1e9:.2f} GB read, "
            f"{p.decode_flops / 1e9:.1f} GFLOP per device -> >= {t_dec * 1e3:.2f} ms, "
            f"<= {p.slots / t_dec:,.0f} tokens/s over {p.slots} slots; "
            f"{p.samples} samples all of length T: >= {full / 60:.1f} min",
            f"  update mini-batch: {p.update_flops / 1e12:.1f} TFLOP per device (XLA, 0 if "
            f"not compiled; 6 x params x tokens: {p.model_flops / 1e12:.1f}) -> >= "
            f"{t_upd:.1f} s at the bf16 peak; x {p.sgd_steps} per step",
        ]
        if p.peak() > hbm:
            lines.append(f"  largest term: {p.dominant()}")
            if p.stage in plan.fits_on:
                fit = plan.fits_on[p.stage]
                if fit is None:
                    lines.append(f"  no {c.name} slice up to {c.topologies[-1]} fits it")
                else:
                    name, q = fit
                    m = " x ".join(f"{k} {v}" for k, v in q.mesh.items())
                    lines.append(
                        f"  smallest {c.name} slice that fits: {name} (mesh {m}, micro-batches "
                        f"of {q.micro_batch}): peak {q.peak() / GiB:.2f} GiB per device (compiled)"
                    )
    return "\n".join(lines)
