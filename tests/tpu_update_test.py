"""The packed update's loss and gradients compiled for TPU chips (no TPU needed; libtpu,
``make test-tpu``): with ``update.attention: splash`` its attention is the splash kernel
(Mosaic calls, forward and backward) and no array of the compiled program holds a row's
[T, S] scores, which the dense masked product's program does."""

import functools
import math
import re

import jax
import pytest

from magic_jax.jobs.topology import libtpu_available

needs_libtpu = pytest.mark.skipif(
    not libtpu_available(), reason="libtpu not installed (make test-tpu runs these)"
)

S = 2048  # slots of a packed row (bin): P 256 + R 1792
# an instruction's result types and its opcode, in the compiled HLO text
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.-]+ = (.+?) ([a-z][\w-]*)\(", re.M)
_SHAPE = re.compile(r"\b[a-z]+\d*\[([\d,]+)\]")


def score_sized(hlo: str) -> list[str]:
    """The results in compiled ``hlo`` of S x S / 2 elements or more: a row's [T, S] scores
    (or mask) of one head. Nothing else of the tiny model is a quarter of that (a bin's
    activations, logits and MLP are [S, 256] per device)."""
    found = []
    for types, _ in _INSTRUCTION.findall(hlo):
        for dims in _SHAPE.findall(types):
            if math.prod(int(d) for d in dims.split(",")) >= S * S // 2:
                found.append(types)
                break
    return found


@functools.cache
def _compile(attention: str, remat: str = "full", topology: str = "v5e:2x2"):
    """The packed update's ``loss_and_grads`` (bf16, ``remat``, one layer scan, 2 micro-
    batches of 2 bins of ``S`` slots) for a 2-layer model with 4 query heads on 2 kv
    heads, over fsdp 2 x tensor 2 chips of ``topology``: (lowered text, compiled text)."""
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from magic_jax.jobs.stage_plan import _abstract, abstract_batch
    from magic_jax.jobs.topology import topology_devices
    from magic_jax.model.config import ModelConfig
    from magic_jax.model.qwen2 import abstract_model
    from magic_jax.model.sharding import (
        BATCH_AXES,
        TRAIN_RULES,
        MeshConfig,
        make_mesh,
        model_shardings,
    )
    from magic_jax.update.config import UpdateConfig
    from magic_jax.update.packing import PackedRows
    from magic_jax.update.step import StepSpec, loss_and_grads

    cfg = ModelConfig(
        vocab_size=256, hidden_size=256, intermediate_size=256, num_layers=2, num_heads=4,
        num_kv_heads=2, param_dtype="float32", dtype="bfloat16",
    )  # fmt: skip
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2), topology_devices(topology))
    graphdef, params = nnx.split(abstract_model(cfg), nnx.Param)
    params = _abstract(params, model_shardings(params, mesh, TRAIN_RULES))
    rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    batch = abstract_batch(256, 1792, 4, mesh)
    assert batch.tokens.shape == (4, S)
    bins = NamedSharding(mesh, PartitionSpec(None, BATCH_AXES))
    per_bin = jax.ShapeDtypeStruct((2, 2, S), jnp.int32, sharding=bins)
    per_row = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=rows)
    packed = PackedRows(per_bin, per_bin, per_bin, per_row, per_row)
    ucfg = UpdateConfig(
        mini_batch_groups=2, micro_batch_size=2, packing=True, attention=attention,
        remat=remat, compute_dtype="bfloat16", layer_unroll=1, mlp_kernel=False,
    )  # fmt: skip
    spec = StepSpec(graphdef, ucfg, batch_sharding=rows)
    fn = jax.jit(lambda p, b, k: loss_and_grads(p, b, 0.01, spec, packed=k))
    lowered = fn.lower(params, batch, packed)
    with jax.default_device(mesh.devices.flat[0]):
        compiled = lowered.compile()
    return lowered.as_text(), compiled.as_text()


@needs_libtpu
def test_the_packed_update_runs_the_splash_kernel_and_holds_no_score_array():
    lowered, hlo = _compile("splash")
    # the forward (with its residuals: the backward's log-sum-exp), dq and dkv kernels
    for kernel in ("splash_mha_fwd_segmented_residuals", "splash_mha_dq", "splash_mha_dkv"):
        assert kernel in lowered, kernel
    assert hlo.count('custom_call_target="tpu_custom_call"') >= 3
    assert score_sized(hlo) == []


@needs_libtpu
def test_the_dense_update_holds_score_arrays_so_the_check_sees_them():
    """The same step with ``update.attention: dense`` (no remat: a shorter compile): no
    Mosaic call, and its [G x T, S] scores per kv head (one query chunk: 2048 slots) are
    in the program."""
    lowered, hlo = _compile("dense", "none")
    assert "tpu_custom_call" not in hlo and "splash" not in lowered
    found = score_sized(hlo)
    assert any(f"{2 * S},{S}]" in t for t in found), found
