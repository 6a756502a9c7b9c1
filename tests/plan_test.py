"""magic-jax plan: TPU programs compiled ahead of time for a small slice (needs libtpu)."""

import json
import math

import jax
import pytest
import yaml

from magic_jax.jobs.cli import main
from magic_jax.jobs.topology import PlanError, libtpu_available, resolve_topology
from magic_jax.run.config import load_config

needs_libtpu = pytest.mark.skipif(
    not libtpu_available(), reason="libtpu not installed (make test-tpu runs these)"
)

HF = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "eos_token_id": 1,
}


def _run(tmp_path, **over):
    if not (tmp_path / "model").exists():
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text(json.dumps(HF))
    raw = {
        "model": str(tmp_path / "model"),
        "output_dir": str(tmp_path / "run"),
        "data": {"train": ["train.jsonl"], "max_prompt_length": 64},
        "stages": [
            {
                "steps": 2,
                "max_response_length": 128,
                "prompts_per_step": 8,
                "mini_batch_groups": 4,
                "group_size": 4,
            }
        ],
        "rollout": {"max_concurrent_decodes": 16},
        "update": {"micro_batch_size": 8},
        "mesh": {"fsdp": -1, "tensor": 2},
    } | over
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _slice_mesh(topology, **axes):
    from magic_jax.jobs.topology import topology_devices
    from magic_jax.model.sharding import MeshConfig, make_mesh

    return make_mesh(MeshConfig(**axes), topology_devices(topology))


def _hand_param_bytes(fsdp: int, tensor: int) -> int:
    """Per-device parameter bytes from jax.eval_shape and the rule table written out:
    a weight with an ``embed`` axis splits over fsdp; a ``vocab`` / heads / ``mlp``
    axis over tensor; norms are replicated."""
    from flax import nnx

    from magic_jax.model.config import ModelConfig
    from magic_jax.model.qwen2 import Qwen2

    cfg = ModelConfig.from_hf_config(HF)
    state = nnx.state(jax.eval_shape(lambda: Qwen2(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    total = 0
    for _, v in nnx.to_flat_state(state):
        names = v.get_metadata()["out_sharding"]
        split = (fsdp if "embed" in names else 1) * (
            tensor if {"vocab", "q_heads", "kv_heads", "mlp"} & set(names) else 1
        )
        total += math.prod(v.shape) * 4 // split
    return total


def test_topology_names_and_errors(tmp_path, capsys):
    # (gcloud's names and their chip counts: tests/plan_names_test.py)
    assert resolve_topology("v5p:4x4x4").chips == 64 == resolve_topology("v5p-128").chips
    assert resolve_topology("v5e:2x2").chip.hbm_gib == 16
    with pytest.raises(PlanError, match="expected a gcloud accelerator type"):
        resolve_topology("pod:16")
    with pytest.raises(PlanError, match="unknown TPU generation 'v9'"):
        resolve_topology("v9:2x2")
    cfg = _run(tmp_path)
    for bad in ("v9:2x2", "v6e-48"):
        assert main(["plan", str(cfg), "--topology", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and bad in err[0]
    if not libtpu_available():  # the main environment: one line saying what to install
        for name in ("v5e:2x2", "v5litepod-4"):
            assert main(["plan", str(cfg), "--topology", name]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and "jax[tpu]" in err[0]


def test_the_search_raises_a_micro_batch_that_does_not_split(tmp_path):
    from magic_jax.jobs.plan import _split_micro_batch

    config = load_config(_run(tmp_path))  # micro-batches of 8 rows, mini-batches of 16
    assert _split_micro_batch(config, 16, 4) is config
    assert _split_micro_batch(config, 16, 16).update.micro_batch_size == 16
    assert _split_micro_batch(config, 16, 32) is config  # none splits: plan_stage says so


@needs_libtpu
def test_param_and_optimizer_bytes_match_a_hand_count(tmp_path):
    from magic_jax.jobs.stage_plan import plan_stage
    from magic_jax.model.config import ModelConfig

    config = load_config(_run(tmp_path))
    model = ModelConfig.from_hf_config(HF)
    full = model.num_params() * 4
    # Pure data parallelism: every device holds everything.
    p = plan_stage(config, 0, model, _slice_mesh("v5e:2x2", data=4, fsdp=1), compile=False)
    assert p.params == full == _hand_param_bytes(1, 1)
    assert p.opt_state == 2 * full + 4  # Adam's mu and nu, and its int32 count
    # fsdp 2 x tensor 2.
    p = plan_stage(config, 0, model, _slice_mesh("v5e:2x2", fsdp=2, tensor=2), compile=False)
    assert p.params == _hand_param_bytes(2, 2) < full
    assert p.grads == p.params
    # KV cache: slots x (prompt + T) x K x H per layer for k and v, slots over fsdp,
    # kv heads over tensor; plus the cache's positions and the per-slot vectors.
    s, h = 64 + 128, 64 // 4
    kv = 2 * 2 * (16 // 2) * s * (2 // 2) * h * 4
    assert kv < p.kv_cache < kv + (16 // 2) * s * 4 + 1024


@needs_libtpu
def test_optimizer_state_is_sharded_like_the_parameters(tmp_path):
    from magic_jax.jobs.stage_plan import plan_stage
    from magic_jax.model.config import ModelConfig

    config = load_config(_run(tmp_path))
    p = plan_stage(
        config,
        0,
        ModelConfig.from_hf_config(HF),
        _slice_mesh("v5e:2x2", fsdp=2, tensor=2),
        compile=False,
    )
    assert p.opt_state == 2 * p.params + 4


@needs_libtpu
def test_update_step_and_engine_programs_compile_for_v5e(tmp_path, capsys):
    from magic_jax.jobs.plan import plan_run

    config = load_config(_run(tmp_path))
    plan = plan_run(config, "v5e:2x2")
    (p,) = plan.stages
    assert p.mesh == {"data": 1, "fsdp": 2, "tensor": 2} and plan.devices == 4
    # (XLA's temporaries of this 2-layer scanned update are below its gradient bytes,
    # so its activations may show as 0)
    assert p.grads == p.params > 0 and p.activations >= 0 and p.decode_temps > 0
    # XLA counts a loop's body once; the plan counts every micro-batch and every layer:
    # the total is what the plan counts by hand (matmuls and the attention's L^2, forward
    # and backward), plus the softmaxes, norms and the loss's elementwise work.
    assert p.model_flops <= p.update_flops < 1.5 * p.model_flops, (p.update_flops, p.model_flops)
    assert p.decode_bytes >= p.engine_params + p.kv_cache
    # a decode step's flops: every layer's (XLA's count is one scanned layer's), at least
    from magic_jax.jobs.costs import decode_step_flops

    cache = p.prompt_length + p.response_length
    assert p.decode_flops >= decode_step_flops(plan.model, p.slots, cache) / plan.devices > 0
    assert p.peak() < plan.hbm_bytes and not plan.fits_on
    assert main(["plan", str(_run(tmp_path)), "--topology", "v5e:2x2", "-q"]) == 0
    out = capsys.readouterr().out
    assert "of 16.00: fits" in out and "TPU v5e: 16 GiB HBM, 819 GB/s" in out
    # P 64 + T/2 64 of 192 slots held on average: the cache term is read two thirds
    assert (
        "decode attention: ragged (the TPU kernel, in the decode step above): rows hold "
        "P + T/2 = 128 of 192"
    ) in out
    # At head dim 16 the kernel's [bs, 16] blocks are not the TPU's (8, 128) tiles of the
    # cache: XLA relayouts the cache around the call, and the plan says so (at head dim
    # 128, the models', it does not: the v6e test below).
    assert p.decode_cache_copies > 0 and "the compiled step copies the cache" in out
    assert (
        "update: compute float32, remat none; rollout: weights and compute float32, "
        "KV cache float32" in out
    )
    # the decode step compiled again with an int8 cache (1 + 4/16 bytes per element for
    # float32's 4), and its line in the plan
    q = p.int8
    assert q is not None and q.error is None and not q.over_hbm, q
    assert 0.3 < q.kv_cache / p.kv_cache < 0.34 and q.step_bytes > 0 and q.temps >= 0
    assert "int8 KV cache, compiled (rollout.kv_dtype int8, bf16 weights): KV" in out
    # gcloud's name of the same slice, the time bounds, the recommendation and a cost
    args = ["plan", str(_run(tmp_path)), "--topology", "v5litepod-4", "-q"]
    assert main([*args, "--price-per-chip-hour", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "slice: v5litepod-4 (v5e:2x2), 4 chips, 4 devices" in out
    # the 8 x 4 samples per step cap the slots (over fsdp 2 slot shards)
    assert "recommended rollout.max_concurrent_decodes: 32 (" in out
    assert "time (roofline lower bounds" in out and "real steps are slower" in out
    assert "chip-hours; at $1.5 per chip-hour: >= $" in out


@needs_libtpu
def test_gcloud_names_compile_for_their_chips():
    from magic_jax.jobs.topology import topology_devices

    # v5p-N and v4-N count TensorCores: v5p-128 is 64 chips (one device each), v4-32 is 16
    # (libtpu's v4 devices are its TensorCores)
    assert len(topology_devices("v5p-128")) == 64 == resolve_topology("v5p-128").chips
    assert resolve_topology("v4-32").chips == 16 and len(topology_devices("v4-32")) == 32
    assert len(topology_devices("v6e-64")) == 64 and len(topology_devices("v5litepod-8")) == 8
    assert len(topology_devices("v6e-1")) == 1


@needs_libtpu
def test_an_int8_decode_step_that_does_not_compile_says_why(tmp_path, monkeypatch):
    from magic_jax.jobs import stage_plan
    from magic_jax.model.config import ModelConfig

    compile_decode = stage_plan._compile_decode

    def failing(e, sampling):
        if e["engine"].config.kv_dtype == "int8":
            raise RuntimeError("INTERNAL: the int8 step failed\nmore lines")
        return compile_decode(e, sampling)

    monkeypatch.setattr(stage_plan, "_compile_decode", failing)
    config = load_config(_run(tmp_path))
    mesh = _slice_mesh("v5e:2x2", fsdp=2, tensor=2)
    p = stage_plan.plan_stage(config, 0, ModelConfig.from_hf_config(HF), mesh)
    assert p.int8.error == "RuntimeError: INTERNAL: the int8 step failed"


@needs_libtpu
def test_remat_full_shrinks_the_planned_update_temporaries(tmp_path):
    from magic_jax.jobs.stage_plan import plan_stage
    from magic_jax.model.config import ModelConfig

    # 4 layers of 1088-token rows: what the backward keeps of each layer outweighs one
    # layer's working set (at the 2-layer, 192-token size above XLA's temporaries are
    # below the gradients' bytes and tell nothing; at 576 tokens the attention's own
    # backward, which keeps no scores, already leaves too little for remat to save)
    hf = HF | {"num_hidden_layers": 4, "hidden_size": 128, "intermediate_size": 256}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(hf))
    model = ModelConfig.from_hf_config(hf)
    mesh = _slice_mesh("v5e:2x2", fsdp=2, tensor=2)
    stage = {
        "steps": 1,
        "max_response_length": 1024,
        "prompts_per_step": 8,
        "mini_batch_groups": 4,
        "group_size": 4,
    }
    plans = {
        remat: plan_stage(
            load_config(_run(tmp_path, update={"remat": remat}, stages=[stage])), 0, model, mesh
        )
        for remat in ("none", "full")
    }
    none, full = plans["none"], plans["full"]
    assert none.params == full.params and none.opt_state == full.opt_state
    # measured: 9.3 MB against 54.5 MB (at 576 tokens: 8.9 against 9.1 MB)
    assert 0 < full.activations < none.activations / 3


@needs_libtpu
def test_bf16_rollouts_halve_the_engine_weights_cache_and_decode_bytes_int8_kv_more(tmp_path):
    from magic_jax.jobs.stage_plan import plan_stage
    from magic_jax.model.config import ModelConfig

    model = ModelConfig.from_hf_config(HF)
    mesh = _slice_mesh("v5e:2x2", fsdp=2, tensor=2)
    plans = {
        (d, kv): plan_stage(load_config(_run(tmp_path, rollout={
            "max_concurrent_decodes": 16, "dtype": d, "kv_dtype": kv,
            "decode_attention": "dense"})), 0, model, mesh)
        for d, kv in (("float32", None), ("bfloat16", None), ("bfloat16", "int8"))
    }  # fmt: skip
    f32, bf16, int8 = plans.values()
    assert int8.int8 is None and bf16.int8 is not None  # an int8 run's own step is int8
    assert bf16.int8.kv_cache == pytest.approx(int8.kv_cache, rel=0.01)
    assert bf16.params == f32.params and bf16.opt_state == f32.opt_state  # master weights
    assert bf16.engine_params * 2 == f32.engine_params
    # keys and values halve; the cache's int32 positions and lengths do not
    assert 0.5 < bf16.kv_cache / f32.kv_cache < 0.52, (bf16.kv_cache, f32.kv_cache)
    # XLA's bytes per decode step (the dense attention, which XLA counts whole; the
    # ragged kernel's reads depend on the rows' lengths): at this size the fp32 logits
    # and sampling over the vocabulary are a large share (measured 1.51x); on the 7B
    # stage see docs/tpu.md
    assert f32.decode_bytes / bf16.decode_bytes > 1.4, (f32.decode_bytes, bf16.decode_bytes)
    # rollout.kv_dtype=int8 at head dim 16: 1 + 4/16 bytes per element for bf16's 2
    assert int8.engine_params == bf16.engine_params
    assert 0.6 < int8.kv_cache / bf16.kv_cache < 0.65, (int8.kv_cache, bf16.kv_cache)
    print("decode bytes f32 / bf16 / int8 KV:", f32.decode_bytes, bf16.decode_bytes,
          int8.decode_bytes)  # fmt: skip


@needs_libtpu
def test_a_stage_that_does_not_fit_gets_the_smallest_slice_that_does(tmp_path):
    from magic_jax.jobs.plan import smallest_fit
    from magic_jax.jobs.stage_plan import plan_stage
    from magic_jax.jobs.topology import CHIPS
    from magic_jax.model.config import ModelConfig
    from magic_jax.model.sharding import MeshConfig

    # 1024 slots x (64 + 1984) cache slots x 2 layers x (k, v) x 2 kv heads x 256 x 4 bytes
    # = 16 GiB of KV cache on one v5e chip (16 GiB); a quarter of it on 2x2.
    hf = HF | {"head_dim": 256}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(hf))
    stage = {
        "steps": 1,
        "max_response_length": 2048 - 64,
        "prompts_per_step": 1,
        "mini_batch_groups": 1,
        "group_size": 4,
    }
    rollout = {"max_concurrent_decodes": 1024}
    config = load_config(_run(tmp_path, stages=[stage], rollout=rollout, mesh={"fsdp": -1}))
    model = ModelConfig.from_hf_config(hf)
    # The sharded terms alone are over one chip's HBM (compiling a program over HBM
    # makes XLA try hard to fit it: minutes; the CLI does it, the test need not).
    p = plan_stage(config, 0, model, _slice_mesh("v5e:1x1", fsdp=1), compile=False)
    hbm = 16 * 2**30
    assert p.kv_cache > hbm and p.dominant() == "KV cache"
    name, q = smallest_fit(config, 0, model, MeshConfig(fsdp=-1), CHIPS["v5e"], hbm, 1, p)
    assert name == "v5e:2x2" and q.mesh["fsdp"] == 4 and q.compiled
    assert q.kv_cache < p.kv_cache / 3 and q.decode_temps > 0 and q.peak() <= hbm


@needs_libtpu
def test_a_tensor_axis_that_splits_a_physical_axis_makes_a_mesh():
    """tensor=4 on v6e:8x8 is no product of the 8 x 8 torus's axes: the mesh splits one,
    and each tensor group is four chips in a row of one ring."""
    import numpy as np

    from magic_jax.jobs.topology import topology_devices
    from magic_jax.model.sharding import MESH_AXES

    with pytest.raises(NotImplementedError):  # what make_mesh used to call, and fail in
        jax.make_mesh((1, 16, 4), MESH_AXES, devices=topology_devices("v6e:8x8"))
    mesh = _slice_mesh("v6e:8x8", fsdp=16, tensor=4)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 16, "tensor": 4}
    for group in mesh.devices.reshape(-1, 4):
        coords = np.asarray([d.coords[:2] for d in group])
        same = [len(set(coords[:, i])) == 1 for i in range(2)]
        assert any(same), coords  # one row or one column
        moving = coords[:, same.index(False)]
        assert sorted(np.diff(sorted(moving)).tolist()) == [1, 1, 1], coords


@needs_libtpu
def test_the_ragged_decode_kernel_compiles_for_v6e_with_one_and_two_kv_heads_per_device():
    """The TPU kernel (Mosaic) in the engine's decode step, rows over data and kv heads
    over tensor: it compiles for the chip, the program calls it, and the compiled step
    neither copies the slot-major cache (as it did every step for a layer-major one at
    one kv head per device) nor holds a cache-sized temporary."""
    import dataclasses

    import jax.numpy as jnp

    from magic_jax.jobs.stage_plan import _abstract
    from magic_jax.jobs.xla_programs import Program, cache_copies
    from magic_jax.model.config import ModelConfig
    from magic_jax.model.qwen2 import abstract_model
    from magic_jax.rollout.engine import Engine, EngineConfig

    for kv_heads in (2, 4):
        cfg = dataclasses.replace(
            ModelConfig.from_hf_config(HF | {"num_key_value_heads": kv_heads, "hidden_size": 1024,
                                             "num_attention_heads": 8}),
            dtype="bfloat16",
        )  # fmt: skip
        mesh = _slice_mesh("v6e:2x2", data=2, tensor=2)
        engine = Engine(
            abstract_model(cfg),
            EngineConfig(
                max_concurrent_decodes=64,  # a cache of 24 MiB per device at one kv head
                max_prefill_length=128,
                max_decode_length=640,
                dtype="bfloat16",
            ),
            mesh=mesh,
        )
        spec = engine.ragged_spec
        assert spec is not None and spec.backend == "tpu" and spec.head_axes == "tensor"
        params = _abstract(engine.abstract_params, engine.param_shardings)
        state = _abstract(jax.eval_shape(engine.init_decode_state), engine.state_shardings())
        assert state.cache.k.dtype == jnp.bfloat16
        generate = engine._fn("generate", **engine.decode_statics())
        lowered = generate.lower(params, state, engine.eos_array)
        assert "tpu_custom_call" in lowered.as_text()
        with jax.default_device(mesh.devices.flat[0]):
            compiled = lowered.compile()
        assert cache_copies(Program(compiled, 0, 0, False), state.cache.k) == 0, kv_heads
        shard = state.cache.k.sharding.shard_shape(state.cache.k.shape)
        cache_bytes = 2 * math.prod(shard) * 2  # keys and values, bf16
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp < cache_bytes / 4, (kv_heads, temp, cache_bytes)
        print(f"{kv_heads} kv heads: temporaries {temp} B, cache {cache_bytes} B per device")
