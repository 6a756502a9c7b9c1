"""One stage of a run on a slice: its update and decode programs compiled ahead of time at
the model's real shapes, with XLA's memory and cost analyses."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from magic_jax.jobs.costs import decode_step_flops, update_row_flops
from magic_jax.jobs.topology import PlanError
from magic_jax.jobs.xla_programs import Program, cache_copies, compile_program
from magic_jax.rollout.engine_config import EngineOptions

if TYPE_CHECKING:
    from magic_jax.model.config import DType, ModelConfig


def resolve_model(model: str, param_dtype: DType, preset: str | None = None) -> ModelConfig:
    """The ``ModelConfig`` a run loads, as the trainer builds it (compute dtype = param dtype;
    the update applies the run's ``remat`` and ``compute_dtype`` on top, see
    ``update.step.update_graphdef``).

    ``model`` is read when it is a checkpoint directory here (Hugging Face
    ``config.json`` or a magic_jax checkpoint); otherwise its name picks a preset
    (``.../DeepSeek-R1-Distill-Qwen-7B`` -> ``r1-distill-qwen-7b``), or ``preset`` does.
    """
    import json

    from magic_jax.model.config import PRESETS, ModelConfig

    if preset is not None:
        if preset not in PRESETS:
            raise PlanError(f"--preset {preset!r}: expected one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[preset], param_dtype=param_dtype, dtype=param_dtype)
    p = Path(model)
    if (p / "config.json").is_file():
        hf = json.loads((p / "config.json").read_text())
        return ModelConfig.from_hf_config(hf, param_dtype=param_dtype, dtype=param_dtype)
    if (p / "model_config.json").is_file():
        from magic_jax.run.checkpoint import read_model_config

        return read_model_config(p)
    key = p.name.lower().removeprefix("deepseek-")
    if key in PRESETS:
        return dataclasses.replace(PRESETS[key], param_dtype=param_dtype, dtype=param_dtype)
    raise PlanError(
        f"model: {model} is not a checkpoint directory here and its name matches no preset "
        f"({', '.join(sorted(PRESETS))}); pass --preset NAME"
    )


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


@dataclasses.dataclass(frozen=True)
class Int8Decode:
    """The decode step compiled with an int8 KV cache (bfloat16 weights), per device.

    Attributes:
      kv_cache: bytes of the int8 cache and its float32 scales.
      temps: XLA's temporaries of the step (what XLA asked for when over HBM).
      step_bytes: bytes one step reads at least (its weights and cache once), or XLA's
        count when larger.
      cache_copies: copies of a layer's cache or more in the compiled step (relayouts).
      error: why it did not compile (None: it did); over HBM is reported in ``over_hbm``.
      over_hbm: XLA refused it for the chip's HBM.
    """

    kv_cache: int = 0
    temps: int = 0
    step_bytes: float = 0.0
    cache_copies: int = 0
    error: str | None = None
    over_hbm: bool = False


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
    ``model_flops`` of one padded mini-batch counted (``costs.update_row_flops``: remat's
    extra forward and the attention's scores included), ``decode_bytes`` and ``decode_flops``
    of one decode step over the full cache (the bytes at least its weights and cache, each
    read once; the flops at least ``costs.decode_step_flops``: XLA counts the layer loop's
    body once); ``decode_cache_copies``, the copies of a layer's cache or more in the compiled
    step (a relayout XLA inserts, each a read and write of that much); ``slots`` decode
    slots, ``samples`` = D_R x G responses per training step (G ``group_size``),
    ``steps`` the stage's training steps. ``over_hbm`` names the programs XLA refused to
    compile for the chip (too large): their temporaries are the sizes XLA's error stated,
    their costs unknown (0). ``int8`` is the decode step compiled again with
    ``rollout.kv_dtype: int8`` and bfloat16 weights (None: not compiled, e.g. the run's
    own cache is int8). ``packing``: the run's ``update.packing``; ``bins`` K, bins of
    ``row_length`` (the padded row, P + T bucketed) per packed micro-batch (the
    updater's ``packed_bins``).
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
    decode_cache_copies: int = 0
    decode_flops: float = 0.0
    slots: int = 0
    samples: int = 0
    compiled: bool = True
    over_hbm: tuple[str, ...] = ()
    prompt_length: int = 0
    ragged: bool = False
    steps: int = 0
    int8: Int8Decode | None = None
    group_size: int = 1
    packing: bool = False
    bins: int = 0
    row_length: int = 0

    @property
    def update_total(self) -> int:
        return self.params + self.opt_state + self.grads + self.activations + self.batch

    @property
    def rollout_total(self) -> int:
        return self.params + self.opt_state + self.engine_params + self.kv_cache + self.decode_temps

    def peak(self) -> int:
        return max(self.update_total, self.rollout_total)

    def slots_fit(self, hbm: float) -> int:
        """Decode slots at T that fit in ``hbm`` bytes per device at the compiled precision:
        room beside the train state, the engine's weights and the decode temporaries (as
        compiled), by the compiled cache's bytes per slot (0: none)."""
        per_slot = self.kv_cache / self.slots if self.slots else 0
        room = hbm - self.params - self.opt_state - self.engine_params - self.decode_temps
        return max(0, int(room // per_slot)) if per_slot > 0 else 0

    @property
    def held_share(self) -> float:
        """The share of the cache a decode step reads: P + T/2 of P + T slots on average for
        responses run to T with the ragged kernel (all of it with the dense attention)."""
        if not self.ragged:
            return 1.0
        p, t = self.prompt_length, self.response_length
        return (p + t / 2) / (p + t)

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


def _train_state(config: Any, index: int, model_config: Any, mesh: Any) -> dict[str, Any]:
    """The abstract train state on ``mesh``, placed as the trainer places it."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from magic_jax.model.qwen2 import abstract_model
    from magic_jax.model.sharding import TRAIN_RULES, model_shardings
    from magic_jax.run.stages import update_config
    from magic_jax.update.entropy_control import init_entropy_control
    from magic_jax.update.state import TrainState, opt_state_shardings
    from magic_jax.update.step import make_optimizer, with_platform_defaults

    # the update as it compiles on the slice's platform, not this host's
    platform = mesh.devices.flat[0].platform
    ucfg = with_platform_defaults(update_config(config, index), platform)
    graphdef, params = nnx.split(abstract_model(model_config), nnx.Param)
    params = _abstract(params, model_shardings(params, mesh, TRAIN_RULES))
    repl = NamedSharding(mesh, PartitionSpec())
    tx = make_optimizer(ucfg.optimizer)
    # placed as init_train_state places it: moments like their parameters
    opt_sh = opt_state_shardings(tx, params, mesh)
    scalars = jax.eval_shape(lambda: init_entropy_control(ucfg.entropy))
    opt_state = _abstract(jax.eval_shape(tx.init, params), opt_sh)
    count = jax.ShapeDtypeStruct((), jnp.int32, sharding=repl)
    entropy = _abstract(scalars, jax.tree.map(lambda _: repl, scalars))
    # an abstract train state (shapes, dtypes and shardings), which its array fields cannot say
    state = TrainState(params, opt_state, count, count, entropy)  # type: ignore[arg-type]
    # The frozen reference policy (KL on) is a second copy of the weights, read only.
    ref = params if ucfg.loss.kl_beta > 0 else None
    return dict(graphdef=graphdef, config=ucfg, state=state, ref=ref)


def _engine(
    options: EngineOptions, config: Any, index: int, model_config: Any, mesh: Any
) -> dict[str, Any]:
    """The stage's engine with ``options`` (the run's ``rollout``: as the trainer builds
    it, all its slots in one lane) with abstract weights and decode state."""
    import jax

    from magic_jax.model.qwen2 import abstract_model
    from magic_jax.rollout.engine import Engine, EngineConfig

    model = abstract_model(model_config)
    engine = Engine(
        model,
        EngineConfig.of(
            options,
            lanes=None,
            max_prefill_length=config.data.max_prompt_length,
            max_decode_length=config.stages[index].max_response_length,
            sampling=config.sampling,
        ),
        mesh=mesh,
    )
    params = _abstract(engine.abstract_params, engine.param_shardings)
    state = _abstract(jax.eval_shape(engine.init_decode_state), engine.state_shardings())
    return dict(engine=engine, params=params, state=state)


def _runs_ragged(engine: Any) -> bool:
    """Whether the engine's decode step runs the ragged kernel over its whole cache
    (``decode.decode_forward`` falls back to the dense product otherwise)."""
    from magic_jax.rollout.ragged_attention import applies

    return applies(
        engine.ragged_spec,
        quantized=engine.config.kv_dtype is not None,
        sliding=bool(engine.model_config.sliding_layers),
        length=engine.config.cache_length,
    )


def _batch(config: Any, index: int, rows: int, mesh: Any) -> Any:
    """An abstract mini-batch of ``rows`` rows of stage ``index``."""
    st = config.stages[index]
    return abstract_batch(
        config.data.max_prompt_length, st.max_response_length, rows, mesh, st.group_size
    )


def abstract_batch(
    prompt_length: int, response_length: int, rows: int, mesh: Any, group_size: int = 2
) -> Any:
    """An abstract ``RolloutBuffer`` of ``rows`` rows sharded over the mesh's data axes,
    padded as ``pack_rollouts`` pads them."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from magic_jax.model.sharding import BATCH_AXES
    from magic_jax.update.buffer import RolloutBuffer

    p = 64 * math.ceil(prompt_length / 64)
    rb = min(256, response_length)
    r = rb * math.ceil(response_length / rb)
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
        group_size=group_size,
    )


def plan_stage(
    config: Any,
    index: int,
    model_config: Any,
    mesh: Any,
    *,
    compile: bool = True,
    int8_probe: bool = True,
) -> StagePlan:
    """Measures stage ``index`` on ``mesh`` (see the module doc), its engine with the
    run's engine options (``config.rollout``, an ``EngineOptions``).

    With ``compile=False`` only the sharded terms (parameters, optimizer state,
    gradients, engine weights, KV cache) are filled in; temporaries are 0. With
    ``int8_probe`` (and a float cache in the run) the decode step is compiled a second
    time with ``rollout.kv_dtype: int8`` (``StagePlan.int8``).
    """
    options: EngineOptions = config.rollout
    t = _train_state(config, index, model_config, mesh)
    e = _engine(options, config, index, model_config, mesh)
    out = _sharded_terms(config, index, mesh, t, e)
    out.compiled = compile
    if not compile:
        return out
    _compiled_terms(out, config, index, model_config, mesh, t, e)
    if int8_probe and options.kv_dtype is None:
        out.int8 = _int8_decode(options, config, index, model_config, mesh)
    return out


def _sharded_terms(
    config: Any, index: int, mesh: Any, t: dict[str, Any], e: dict[str, Any]
) -> StagePlan:
    """The stage's plan with the sharded terms only (temporaries 0)."""
    st = config.stages[index]
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
            f"update.micro_batch_size: a micro-batch of {micro} rows does not split over "
            f"data x fsdp = {n_rows} devices"
        )
    params = shard_bytes(t["state"].params)
    batch = _batch(config, index, rows, mesh)
    length = batch.tokens.shape[1]
    if ucfg.micro_batch_tokens is not None:  # as the updater's packed_bins
        bins = max(n_rows, ucfg.micro_batch_tokens // length // n_rows * n_rows)
    else:
        bins = max(n_rows, micro // n_rows * n_rows)
    return StagePlan(
        stage=st.name or str(index),
        response_length=st.max_response_length,
        prompt_length=config.data.max_prompt_length,
        ragged=_runs_ragged(e["engine"]),
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
        slots=e["engine"].config.max_concurrent_decodes,
        samples=st.prompts_per_step * st.group_size,
        group_size=st.group_size,
        steps=st.steps,
        compiled=True,
        packing=ucfg.packing,
        bins=bins,
        row_length=length,
    )


def _compiled_terms(
    out: StagePlan,
    config: Any,
    index: int,
    model_config: Any,
    mesh: Any,
    t: dict[str, Any],
    e: dict[str, Any],
) -> None:
    """Fills in ``out``'s temporaries and costs from the stage's compiled update, decode
    step and prefill."""
    import functools

    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from magic_jax.model.sharding import BATCH_AXES
    from magic_jax.rollout.decode import prefill_fn
    from magic_jax.update.step import StepSpec, loss_and_grads, train_step

    rows, micro, ucfg = out.rows, out.micro_batch, t["config"]
    batch = _batch(config, index, rows, mesh)
    repl = NamedSharding(mesh, PartitionSpec())
    alpha = jax.ShapeDtypeStruct((), "float32", sharding=repl)
    rows_sh = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    state_sh = jax.tree.map(lambda x: x.sharding, t["state"])
    spec = StepSpec(t["graphdef"], ucfg, batch_sharding=rows_sh)

    def step(state, batch, alpha):  # as PolicyUpdater compiles it
        new, metrics = train_step(state, batch, alpha, spec, ref_params=t["ref"])
        return jax.lax.with_sharding_constraint(new, state_sh), metrics

    update = compile_program(jax.jit(step, donate_argnums=0).lower(t["state"], batch, alpha))
    # XLA's cost analysis counts a loop body once, the micro-batch loop's and the
    # scanned layers' alike: the flops come from one micro-batch compiled alone with
    # its layers unrolled (the memory figures above are the scanned program's).
    flat = _train_state(config, index, dataclasses.replace(model_config, scan_layers=False), mesh)
    one = jax.jit(
        functools.partial(
            loss_and_grads,
            spec=StepSpec(flat["graphdef"], ucfg, batch_sharding=rows_sh),
            ref_params=flat["ref"],
        )
    )
    micro_c = compile_program(
        one.lower(flat["state"].params, _batch(config, index, micro, mesh), alpha)
    )
    decode = _compile_decode(e, config.sampling)
    prompt = jax.ShapeDtypeStruct((config.data.max_prompt_length,), "int32", sharding=repl)
    length = jax.ShapeDtypeStruct((), "int32", sharding=repl)
    jitted_prefill = jax.jit(functools.partial(prefill_fn, e["engine"].graphdef))
    prefill = compile_program(jitted_prefill.lower(e["params"], prompt, length))

    out.over_hbm = tuple(
        name
        for name, c in (("update", update), ("decode", decode), ("prefill", prefill))
        if c.over_hbm
    )
    out.activations = max(0, update.temp - out.grads)
    out.decode_temps = max(decode.temp, prefill.temp + prefill.output)
    remat = ucfg.remat or model_config.remat
    chunk = model_config.attention_chunk if ucfg.attention_chunk is None else ucfg.attention_chunk
    attention = ucfg.attention or model_config.attention
    row = update_row_flops(model_config, out.row_length, remat, chunk, attention)
    out.model_flops = row * rows / mesh.size
    if update.compiled is not None and micro_c.compiled is not None:
        # the optimizer's few flops per parameter are left out
        out.update_flops = rows // micro * micro_c.cost("flops")
    # Every weight and cache byte is read once per step, whatever XLA reports.
    out.decode_bytes = max(decode.cost("bytes accessed"), out.engine_params + out.kv_cache)
    out.decode_cache_copies = cache_copies(decode, e["state"].cache.k)
    cache_length = e["engine"].config.cache_length
    analytic = decode_step_flops(model_config, out.slots, cache_length) / mesh.size
    out.decode_flops = max(decode.cost("flops"), analytic)


def _compile_decode(e: dict[str, Any], sampling: Any) -> Program:
    """The engine's decode step (``_engine``'s), compiled as the engine compiles it."""
    import functools

    import jax

    from magic_jax.rollout.decode import decode_step

    engine = e["engine"]
    step = functools.partial(
        decode_step, engine.graphdef, sampling=sampling, **engine.decode_statics()
    )
    jitted = jax.jit(step, donate_argnums=1, out_shardings=(engine.state_shardings(), None))
    return compile_program(jitted.lower(e["params"], e["state"], engine.eos_array))


def _int8_decode(
    options: EngineOptions, config: Any, index: int, model_config: Any, mesh: Any
) -> Int8Decode:
    """The stage's decode step compiled with ``options`` but ``kv_dtype: int8`` and bfloat16
    weights (the ``bf16 + int8 KV`` option); what went wrong, when it does not compile."""
    int8 = dataclasses.replace(options, dtype="bfloat16", kv_dtype="int8", decode_attention=None)
    try:
        e = _engine(int8, config, index, model_config, mesh)
        decode = _compile_decode(e, config.sampling)
    # A probe beside the plan: whatever stops it (a lowering or compiler error) is
    # reported in the plan, not raised.
    except Exception as err:
        text = str(err).strip()
        return Int8Decode(error=f"{type(err).__name__}: {text.splitlines()[0] if text else ''}")
    kv = shard_bytes(e["state"])
    weights = shard_bytes(e["params"])
    return Int8Decode(
        kv_cache=kv,
        temps=decode.temp,
        step_bytes=max(decode.cost("bytes accessed"), weights + kv),
        cache_copies=cache_copies(decode, e["state"].cache.k),
        over_hbm=decode.over_hbm,
    )
