"""Mesh construction, logical-axis rules, and sharded == unsharded on a forced 8-device CPU mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import shard
from flax import nnx
from jax.sharding import PartitionSpec as P

from magic_jax.model.config import ModelConfig
from magic_jax.model.convert import load_hf
from magic_jax.model.qwen2 import Qwen2
from magic_jax.model.sharding import (
    SAMPLE_RULES,
    TRAIN_RULES,
    MeshConfig,
    batch_sharding,
    logical_to_spec,
    make_mesh,
)
from magic_jax.testing import make_hf_model, save_hf_model

# What each parameter must look like on a (fsdp=2, tensor=4) mesh, written out by hand.
TRAIN_TABLE = {
    "embed_tokens.embedding": P("tensor", "fsdp"),  # [V, D]: vocab over tensor
    "lm_head.kernel": P("fsdp", "tensor"),  # [D, V]: vocab over tensor
    "self_attn.q_proj.kernel": P("fsdp", "tensor"),  # (input, output)
    "self_attn.k_proj.kernel": P("fsdp", "tensor"),
    "self_attn.v_proj.kernel": P("fsdp", "tensor"),
    "mlp.gate_proj.kernel": P("fsdp", "tensor"),
    "mlp.up_proj.kernel": P("fsdp", "tensor"),
    "self_attn.o_proj.kernel": P("tensor", "fsdp"),
    "mlp.down_proj.kernel": P("tensor", "fsdp"),
    "self_attn.q_proj.bias": P("tensor"),  # follows its output dim
    "self_attn.k_proj.bias": P("tensor"),
    "self_attn.v_proj.bias": P("tensor"),
    "input_layernorm.scale": P(None),  # replicated
    "post_attention_layernorm.scale": P(None),
    "norm.scale": P(None),
}
SAMPLE_TABLE = {k: P(*(None if a == "fsdp" else a for a in v)) for k, v in TRAIN_TABLE.items()}

CFG = ModelConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4
)


def _specs(model):
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key = ".".join(str(p) for p in path if not isinstance(p, int) and p != "layers")
        spec = tuple(var.get_value().sharding.spec)
        if path[0] == "layers" and not isinstance(path[1], int):
            # stacked [L, ...] parameters: the layer axis is never split
            assert spec[0] is None, (key, spec)
            spec = spec[1:]
        out.setdefault(key, set()).add(P(*spec))
    return out


@pytest.mark.parametrize(
    ("rules", "table"), [(TRAIN_RULES, TRAIN_TABLE), (SAMPLE_RULES, SAMPLE_TABLE)]
)
@pytest.mark.parametrize("scan_layers", [True, False])
def test_parameters_land_with_the_table_specs(rules, table, scan_layers):
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=4))
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 4}
    cfg = dataclasses.replace(CFG, scan_layers=scan_layers)
    model = shard(Qwen2(cfg, rngs=nnx.Rngs(0)), mesh, rules)
    specs = _specs(model)
    assert set(specs) == set(table)
    for name, want in table.items():
        got = specs[name]
        assert len(got) == 1, (name, got)
        assert next(iter(got)) == P(*want) or tuple(next(iter(got))) == tuple(want), (name, got)


def test_sharded_forward_equals_unsharded(tmp_path):
    hf = make_hf_model(
        seed=7,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    path = save_hf_model(hf, tmp_path)
    ids = np.random.RandomState(0).randint(3, 256, (8, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[::2, :5] = 0
    plain = load_hf(path)
    ref = np.asarray(nnx.jit(lambda m, x, a: m(x, attention_mask=a))(plain, ids, mask))

    mesh = make_mesh(MeshConfig(fsdp=2, tensor=4))
    sharded = load_hf(path, mesh=mesh)  # streamed straight into the shardings
    q = sharded.layers.self_attn.q_proj.kernel[...]  # [L, D, N*H]: the layer axis is not split
    assert q.sharding.spec == P(None, "fsdp", "tensor") and len(q.addressable_shards) == 8
    graphdef, state = nnx.split(sharded)
    fwd = jax.jit(lambda s, x, a: nnx.merge(graphdef, s)(x, attention_mask=a))
    out = fwd(
        state, jax.device_put(ids, batch_sharding(mesh)), jax.device_put(mask, batch_sharding(mesh))
    )
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_update_keeps_activations_row_sharded():
    """Weights split their embed axis over fsdp, rows are split over fsdp too: left alone,
    XLA contracts over the split embed axis and every device holds every row's
    activations. The update pins the residual stream to the rows' sharding (and, between
    layers, the embed axis to tensor), so each device holds its own rows only."""
    import re
    import types

    from magic_jax.model.sharding import model_shardings
    from magic_jax.update.buffer import pack_rollouts
    from magic_jax.update.config import UpdateConfig
    from magic_jax.update.losses import LossConfig
    from magic_jax.update.step import StepSpec, loss_and_grads

    cfg = dataclasses.replace(CFG, intermediate_size=256)
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    graphdef, params = nnx.split(Qwen2(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    params = jax.device_put(params, model_shardings(params, mesh, TRAIN_RULES))
    rng = np.random.default_rng(0)
    samples = [
        types.SimpleNamespace(
            prompt_index=i // 2,
            sample_index=i % 2,
            prompt_tokens=np.arange(3, 19, dtype=np.int32) + i // 2,
            tokens=rng.integers(3, 256, 48).astype(np.int32),
            logprobs=np.full(48, -1.0, np.float32),
            entropies=np.ones(48, np.float32),
            truncated=False,
            length=48,
        )
        for i in range(8)
    ]
    rewards = np.arange(8, dtype=np.float32) % 2
    buf = pack_rollouts(samples, rewards, prompt_bucket=16, response_bucket=48)
    rows = batch_sharding(mesh)
    buf = jax.device_put(buf, rows)
    ucfg = UpdateConfig(mini_batch_groups=4, loss=LossConfig(), remat="full")
    out = {}
    for name, sh in (("free", None), ("pinned", rows)):
        fn = jax.jit(
            lambda p, b, sh=sh: loss_and_grads(
                p, b, 0.0, StepSpec(graphdef, ucfg, batch_sharding=sh)
            )
        )
        c = fn.lower(params, buf).compile()
        # the MLP's [rows, 64 tokens, 256 / tensor] activations as each device holds them
        mlp_rows = {int(r) for r in re.findall(r"f32\[(\d+),64,128\]", c.as_text())}
        out[name] = (c.memory_analysis().temp_size_in_bytes, mlp_rows, fn(params, buf))
    assert 8 in out["free"][1]  # the failure this guards against: all 8 rows on a device
    assert max(out["pinned"][1]) == 2, out["pinned"][1]  # 8 rows / fsdp 4
    assert out["pinned"][0] < 0.6 * out["free"][0], (out["pinned"][0], out["free"][0])
    (loss_f, grads_f, _), (loss_p, grads_p, _) = out["free"][2], out["pinned"][2]
    np.testing.assert_allclose(float(loss_p), float(loss_f), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_f)):
        scale = float(jnp.abs(b).max()) + 1e-12
        np.testing.assert_allclose(np.asarray(a) / scale, np.asarray(b) / scale, atol=1e-4)


def test_logical_to_spec_rules():
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=4))
    assert logical_to_spec(("batch", None), TRAIN_RULES) == P(("data", "fsdp"), None)
    assert logical_to_spec(None, TRAIN_RULES) == P()
    # a dim that does not divide over its axes is replicated, not an error
    assert logical_to_spec(("embed", "vocab"), TRAIN_RULES, mesh, (64, 250)) == P("fsdp", None)
    with pytest.raises(KeyError, match="nonexistent"):
        logical_to_spec(("nonexistent",), TRAIN_RULES)


def test_mesh_config_validation():
    assert MeshConfig(tensor=2).resolve(8) == (1, 4, 2)
    assert MeshConfig(data=2, fsdp=2, tensor=2).resolve(8) == (2, 2, 2)
    with pytest.raises(ValueError, match="at most one axis"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="tensor"):
        MeshConfig(tensor=0)
    with pytest.raises(ValueError, match="devices"):
        MeshConfig(data=3, fsdp=1, tensor=1).resolve(8)
    single = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    assert single.devices.size == 1
    x = jax.device_put(jnp.ones((4, 2)), batch_sharding(single))
    assert x.sharding.spec == P(("data", "fsdp"))
