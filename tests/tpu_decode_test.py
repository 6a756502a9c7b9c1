"""The engine's decode step and decode loop compiled for TPU chips (no TPU needed; libtpu,
``make test-tpu``): the ragged kernel reads the cache (bf16, or int8 and its scales)
where it is stored, and the loop carries it in its stored layout, so the compiled
programs hold no copy of the cache."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import pytest

from magic_jax.jobs.topology import libtpu_available

needs_libtpu = pytest.mark.skipif(
    not libtpu_available(), reason="libtpu not installed (make test-tpu runs these)"
)

HF = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 256,
    "hidden_size": 1024,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "eos_token_id": 1,
}
# an instruction's result types and its opcode, in the compiled HLO text
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.-]+ = (.+?) ([a-z][\w-]*)\(", re.M)
_SHAPE = re.compile(r"\b[a-z]+\d*\[([\d,]+)\]")


def cache_copies(hlo: str, cache) -> list[str]:
    """The copies and transposes in compiled ``hlo`` of a cache-sized buffer: a result
    that spans the cache length and holds at least one layer of the cache's per-device
    scales (the smallest per-layer array of an int8 cache; a layer's keys are H times
    that). Returns their result types."""
    b, _, k, s, _ = cache.k.sharding.shard_shape(cache.k.shape)
    found = []
    for types, op in _INSTRUCTION.findall(hlo):
        if op not in ("copy", "copy-start", "transpose"):
            continue
        for dims in _SHAPE.findall(types):
            shape = [int(d) for d in dims.split(",")]
            if s in shape and math.prod(shape) >= b * s * k:
                found.append(types)
                break
    return found


def _compile_step(
    topology: str, kv_heads: int, attention: str | None, chunk=False, kv_dtype="int8"
):
    """The engine's decode step (``generate``; ``chunk``: the on-device loop of steps,
    ``generate_chunk``) with an int8 cache (``kv_dtype``; None: bf16) and bf16 weights,
    rows over data 2 and kv heads over tensor 2, compiled for ``topology``."""
    from magic_jax.jobs.stage_plan import _abstract
    from magic_jax.jobs.topology import topology_devices
    from magic_jax.model.config import ModelConfig
    from magic_jax.model.qwen2 import abstract_model
    from magic_jax.model.sharding import MeshConfig, make_mesh
    from magic_jax.rollout.engine import Engine, EngineConfig

    cfg = dataclasses.replace(
        ModelConfig.from_hf_config(HF | {"num_key_value_heads": kv_heads}), dtype="bfloat16"
    )
    mesh = make_mesh(MeshConfig(data=2, tensor=2), topology_devices(topology))
    engine = Engine(
        abstract_model(cfg),
        EngineConfig(
            # 4096 slots, 256 rows per device: at one kv head per device 256 MiB of keys,
            # more than a core's VMEM (XLA moves a cache that fits there whole)
            max_concurrent_decodes=512,
            max_prefill_length=512,
            max_decode_length=3584,
            dtype="bfloat16",
            kv_dtype=kv_dtype,
            decode_attention=attention,
        ),
        mesh=mesh,
    )
    params = _abstract(engine.abstract_params, engine.param_shardings)
    state = _abstract(jax.eval_shape(engine.init_decode_state), engine.state_shardings())
    if kv_dtype == "int8":
        assert state.cache.k.dtype == jnp.int8 and state.cache.k_scale.dtype == jnp.float32
    else:
        assert state.cache.k.dtype == jnp.bfloat16 and state.cache.k_scale is None
    if chunk:
        fn = engine._fn(
            "chunk",
            num_steps=engine.config.decode_steps,
            attend=engine.config.cache_length,
            split_layers=engine.split_layers,
            **engine.decode_statics(),
        )
        zero = jnp.int32(0)
        lowered = fn.lower(params, state, None, None, zero, zero, engine.eos_array)
    else:
        fn = engine._fn("generate", **engine.decode_statics())
        lowered = fn.lower(params, state, engine.eos_array)
    with jax.default_device(mesh.devices.flat[0]):
        compiled = lowered.compile()
    return engine, state, lowered.as_text(), compiled


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
# one, two and four kv heads per device
@pytest.mark.parametrize("kv_heads", [2, 4, 8])
def test_the_int8_decode_step_runs_the_ragged_kernel_and_copies_no_cache(topology, kv_heads):
    """The engine's default attention on TPU with ``kv_dtype: int8``: the ragged kernel
    is in the program, and the compiled step holds no copy or transpose of the cache or
    its scales (the dense int8 product it replaces copies each layer's keys, values and
    scales every step: the next test), nor a cache-sized temporary."""
    from magic_jax.jobs.xla_programs import Program
    from magic_jax.jobs.xla_programs import cache_copies as plan_cache_copies

    engine, state, lowered, compiled = _compile_step(topology, kv_heads, None)
    assert engine.ragged_spec.backend == "tpu"
    assert "ragged_decode_attention_int8" in lowered
    assert cache_copies(compiled.as_text(), state.cache) == []
    # what ``magic-jax plan`` reports for the int8 step
    assert plan_cache_copies(Program(compiled, 0, 0, False), state.cache.k) == 0
    c = state.cache
    cache_bytes = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x in (c.k, c.v, c.k_scale, c.v_scale)
    )
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < cache_bytes / 4, (temp, cache_bytes)


@needs_libtpu
def test_the_dense_int8_decode_step_copies_its_cache_so_the_count_sees_copies():
    """The count above on the dense int8 product (``decode_attention: dense``, what an
    int8 cache ran before the kernel read it): it relayouts the whole cache's keys and
    values, and a layer's keys, values and scales (measured on v6e at one kv head per
    device: 8 copies, 2 of the whole cache; 8 to 10 over v5e, v6e and two kv heads)."""
    _, state, lowered, compiled = _compile_step("v6e:2x2", 2, "dense")
    assert "tpu_custom_call" not in lowered
    found = cache_copies(compiled.as_text(), state.cache)
    assert len(found) >= 4, found
    assert any(t.startswith("s8[") for t in found) and any(t.startswith("f32[") for t in found)
    assert any(t.startswith("s8[256,8,") for t in found)  # all 8 layers at once


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("kv_heads", [2, 4])  # one and two kv heads per device
@pytest.mark.parametrize("kv_dtype", ["int8", None])
def test_the_decode_chunk_copies_no_cache(topology, kv_heads, kv_dtype):
    """The on-device loop of decode steps (``Engine.generate_chunk``, what rollouts run)
    over an int8 or a bf16 cache: the loop carries the cache in its stored layout
    ([B, L, K, S, H], the kv heads before the slots), so neither a step nor the chunk's
    entry and exit copies it (with the slots before the heads, [B, L, S, K, H], XLA gave
    the carry another layout: 6 whole-cache copies per chunk, 2 in every step, bf16 and
    int8 alike, and 4 moves of the int8 scales), nor holds a cache-sized temporary."""
    from magic_jax.jobs.xla_programs import Program
    from magic_jax.jobs.xla_programs import cache_copies as plan_cache_copies

    engine, state, lowered, compiled = _compile_step(
        topology, kv_heads, None, chunk=True, kv_dtype=kv_dtype
    )
    assert engine.ragged_spec.backend == "tpu" and "ragged_decode_attention" in lowered
    assert cache_copies(compiled.as_text(), state.cache) == []
    assert plan_cache_copies(Program(compiled, 0, 0, False), state.cache.k) == 0
    c = state.cache
    cache_bytes = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x in (c.k, c.v, c.k_scale, c.v_scale)
        if x is not None
    )
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < cache_bytes / 4, (temp, cache_bytes)
