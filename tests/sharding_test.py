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
