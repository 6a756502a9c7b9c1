"""The run's ``update`` options (``remat``, ``compute_dtype``, ``attention_chunk``,
``layer_unroll``, ``mlp_kernel``): config checks, and what the update runs."""

import collections
import dataclasses
import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_fp32_close

from magic_jax.model.config import ModelConfig
from magic_jax.model.qwen2 import Qwen2
from magic_jax.run.config import ConfigError, load_config
from magic_jax.run.stages import update_config
from magic_jax.update.buffer import pack_rollouts
from magic_jax.update.config import UpdateConfig
from magic_jax.update.losses import LossConfig
from magic_jax.update.step import (
    StepSpec,
    compute_logprobs,
    default_update_layer_unroll,
    default_update_mlp_kernel,
    loss_and_grads,
    update_graphdef,
)
from magic_jax.update.updater import PolicyUpdater

V, G = 64, 4
CFG = ModelConfig(
    vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2
)
LOSS = LossConfig(logit_chunk=8)


@functools.cache
def _policy():
    return nnx.split(Qwen2(CFG, rngs=nnx.Rngs(0)), nnx.Param)


@functools.cache
def _buffer():
    rng = np.random.default_rng(0)
    samples, rewards = [], []
    for p in range(2):
        prompt = rng.integers(3, V, 5).astype(np.int32)
        for s in range(G):
            n = int(rng.integers(3, 9))
            samples.append(
                types.SimpleNamespace(
                    prompt_index=p,
                    sample_index=s,
                    prompt_tokens=prompt,
                    tokens=rng.integers(3, V, n).astype(np.int32),
                    logprobs=np.log(rng.uniform(0.05, 0.9, n)).astype(np.float32),
                    entropies=rng.uniform(0.0, 2.0, n).astype(np.float32),
                    truncated=False,
                    length=n,
                )
            )
            rewards.append(float(s % 2))
    return pack_rollouts(samples, np.array(rewards, np.float32), prompt_bucket=8, response_bucket=8)


@functools.cache
def _update(remat="none", compute_dtype=None) -> tuple[collections.Counter, str, tuple]:
    """The update's loss and grads on ``_buffer()`` with these options: (primitive name ->
    count in the traced program, the program's text, (loss, grads, metrics))."""
    graphdef, params = _policy()
    cfg = UpdateConfig(mini_batch_groups=2, loss=LOSS, remat=remat, compute_dtype=compute_dtype)
    fn = jax.jit(lambda p, b: loss_and_grads(p, b, 0.01, StepSpec(graphdef, cfg)))
    traced = fn.trace(params, _buffer())
    text = str(traced.jaxpr)
    counts = collections.Counter(re.findall(r"= ([a-z_0-9]+)\[", text))
    return counts, text, traced.lower().compile()(params, _buffer())


def _remats(counts: collections.Counter) -> int:
    return sum(n for k, n in counts.items() if "remat" in k or "checkpoint" in k)


def _raw(**update):
    """A run config with these ``update`` options."""
    return {
        "model": "m",
        "output_dir": "out",
        "data": {"train": ["train.jsonl"]},
        "stages": [
            {
                "steps": 1,
                "max_response_length": 8,
                "prompts_per_step": 2,
                "mini_batch_groups": 2,
                "group_size": 4,
            }
        ],
    } | ({"update": update} if update else {})


def test_config_options_reach_the_update_config():
    cfg = load_config(raw=_raw(remat="full", compute_dtype="bfloat16"))
    u = update_config(cfg, 0)
    assert (u.remat, u.compute_dtype) == ("full", "bfloat16")
    u = update_config(load_config(raw=_raw()), 0)
    assert (u.remat, u.compute_dtype) == ("none", None)  # the model's own dtype
    u = update_config(load_config(raw=_raw(), overrides=["update.remat=dots_saveable"]), 0)
    assert u.remat == "dots_saveable"


@pytest.mark.parametrize(
    "over, message",
    [
        (
            {"remat": "everything"},
            "update.remat: expected one of ['none', 'full', 'dots_saveable']",
        ),
        ({"remat": "dots-saveable"}, "update.remat: expected one of"),
        ({"compute_dtype": "float16"}, "update.compute_dtype: "),
        ({"compute_dtype": 16}, "update.compute_dtype: "),
    ],
)
def test_bad_values_name_the_option(over, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(raw=_raw(**over))
    with pytest.raises(ValueError, match=f"{next(iter(over))}: must be one of"):
        UpdateConfig(mini_batch_groups=1, **{k: "x" for k in over})


def test_update_graphdef_sets_the_models_options():
    graphdef, params = _policy()
    scan = UpdateConfig(mini_batch_groups=1, layer_unroll=1, mlp_kernel=False)
    assert update_graphdef(graphdef, params, scan) is graphdef
    same = dataclasses.replace(scan, remat="none", compute_dtype="float32")
    assert update_graphdef(graphdef, params, same) is graphdef
    opt = UpdateConfig(
        mini_batch_groups=1, remat="full", compute_dtype="bfloat16", layer_unroll=2, mlp_kernel=True
    )
    model = nnx.merge(update_graphdef(graphdef, params, opt), params)
    assert model.config == dataclasses.replace(
        CFG, remat="full", dtype="bfloat16", layer_unroll=2, mlp_kernel=True
    )
    assert model.layers.mlp.up_proj.dtype == jnp.bfloat16  # every module, not just the top
    # None takes the platform's measured default (every layer inlined on CPU)
    default = nnx.merge(
        update_graphdef(graphdef, params, UpdateConfig(mini_batch_groups=1)), params
    )
    expected = dataclasses.replace(CFG, layer_unroll=default_update_layer_unroll())
    assert default.config.layer_unroll == expected.layer_unroll
    assert dataclasses.replace(CFG, layer_unroll=True).layer_unroll == CFG.num_layers
    assert default_update_layer_unroll("cpu") is True and default_update_layer_unroll("tpu") == 1
    assert default.config.mlp_kernel == default_update_mlp_kernel()
    assert default_update_mlp_kernel("cpu") and not default_update_mlp_kernel("tpu")


def test_update_mlp_kernel_option_reaches_the_update_and_changes_no_number():
    assert update_config(load_config(raw=_raw(mlp_kernel=True)), 0).mlp_kernel is True
    assert update_config(load_config(raw=_raw()), 0).mlp_kernel is None
    for bad in ("yes", 1):
        with pytest.raises(ConfigError, match=r"update\.mlp_kernel"):
            load_config(raw=_raw(mlp_kernel=bad))
    graphdef, params = _policy()
    out, batch = [], _buffer()
    for kernel in (False, True):
        cfg = UpdateConfig(mini_batch_groups=2, loss=LOSS, mlp_kernel=kernel)
        model = update_graphdef(graphdef, params, cfg)
        forward = jax.make_jaxpr(lambda p, g=model: compute_logprobs(g, p, batch, LOSS))(params)
        fn = jax.jit(lambda p, b, c=cfg: loss_and_grads(p, b, 0.01, StepSpec(graphdef, c)))
        out.append((str(forward).count("custom_vjp_call"), fn(params, batch)))
    # the layers' MLP (under the layer scan) runs as the kernel: one custom-VJP call more
    assert out[1][0] == out[0][0] + 1, (out[0][0], out[1][0])
    (loss_a, grads_a, _), (loss_k, grads_k, _) = out[0][1], out[1][1]
    np.testing.assert_allclose(float(loss_k), float(loss_a), rtol=1e-6)
    tokens = int(np.asarray(_buffer().attention_mask).size)
    assert_fp32_close(jax.tree.leaves(grads_k), jax.tree.leaves(grads_a), terms=tokens)


def test_update_layer_unroll_option_reaches_the_update_and_changes_no_number():
    cfg = load_config(raw=_raw(layer_unroll=2))
    assert update_config(cfg, 0).layer_unroll == 2
    assert update_config(load_config(raw=_raw()), 0).layer_unroll is None
    with pytest.raises(ConfigError, match=r"update: layer_unroll must be"):
        load_config(raw=_raw(layer_unroll=0))
    graphdef, params = _policy()
    out = []
    for unroll in (1, True):
        cfg = UpdateConfig(mini_batch_groups=2, loss=LOSS, layer_unroll=unroll)
        fn = jax.jit(lambda p, b, c=cfg: loss_and_grads(p, b, 0.01, StepSpec(graphdef, c)))
        text = str(fn.trace(params, _buffer()).jaxpr)
        out.append((re.findall(r"unroll=(\w+)", text), fn(params, _buffer())))
    # the layer scans (forward, backward) run unrolled over both layers when inlined
    assert "2" not in out[0][0] and out[1][0].count("2") >= 2, (out[0][0], out[1][0])
    (loss_s, grads_s, _), (loss_u, grads_u, _) = out[0][1], out[1][1]
    np.testing.assert_allclose(float(loss_u), float(loss_s), rtol=1e-6)
    tokens = int(np.asarray(_buffer().attention_mask).size)
    assert_fp32_close(jax.tree.leaves(grads_u), jax.tree.leaves(grads_s), terms=tokens)


def test_attention_chunk_option_reaches_the_update_and_changes_no_number():
    assert update_config(load_config(raw=_raw(attention_chunk=512)), 0).attention_chunk == 512
    assert update_config(load_config(raw=_raw()), 0).attention_chunk is None
    for bad in (0, -4, True):
        with pytest.raises(ConfigError, match=r"update\.attention_chunk"):
            load_config(raw=_raw(attention_chunk=bad))
    graphdef, params = _policy()
    out = []
    for chunk in (None, 4):  # rows of 16 tokens: one block, or four
        cfg = UpdateConfig(mini_batch_groups=2, loss=LOSS, attention_chunk=chunk)
        model = nnx.merge(update_graphdef(graphdef, params, cfg), params)
        assert model.config.attention_chunk == (chunk or CFG.attention_chunk)
        fn = jax.jit(lambda p, b, c=cfg: loss_and_grads(p, b, 0.01, StepSpec(graphdef, c)))
        text = str(fn.trace(params, _buffer()).jaxpr)
        counts = collections.Counter(re.findall(r"= ([a-z_0-9]+)\[", text))
        out.append((_remats(counts), fn(params, _buffer())))
    assert out[1][0] > out[0][0]  # the blocks run under lax.map, rematerialised
    (loss_a, grads_a, _), (loss_b, grads_b, _) = out[0][1], out[1][1]
    np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-6)
    tokens = int(np.asarray(_buffer().attention_mask).size)
    assert_fp32_close(jax.tree.leaves(grads_b), jax.tree.leaves(grads_a), terms=tokens)


@pytest.mark.parametrize("policy", ["full", pytest.param("dots_saveable", marks=pytest.mark.slow)])
def test_remat_is_in_the_update_program_and_changes_no_number(policy):
    plain_ops, _, (loss, grads, m) = _update("none")
    assert _remats(plain_ops) == 0
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-4
    ops, _, (loss_r, grads_r, m_r) = _update(policy)
    assert _remats(ops) > 0  # the scanned layer is rematerialised
    if policy == "full":  # the backward runs the layer's matmuls again
        assert ops["dot_general"] > plain_ops["dot_general"]
    np.testing.assert_allclose(float(loss_r), float(loss), rtol=1e-6)
    # the rematerialised forward may fuse and sum in another order
    tokens = int(np.asarray(_buffer().attention_mask).size)
    assert_fp32_close(jax.tree.leaves(grads_r), jax.tree.leaves(grads), terms=tokens)
    np.testing.assert_allclose(float(m_r["entropy"]), float(m["entropy"]), rtol=1e-6)


def test_bf16_compute_runs_in_bf16_with_fp32_grads():
    _, _, (loss, grads, _) = _update("none")
    ops, text, (loss16, grads16, _) = _update("full", "bfloat16")
    assert "bf16[" in text and _remats(ops)
    # master weights stay fp32, so do their gradients; the numbers are bf16-close
    assert {g.dtype for g in jax.tree.leaves(grads16)} == {jnp.dtype("float32")}
    assert np.isfinite(float(loss16)) and float(loss16) != float(loss)
    np.testing.assert_allclose(float(loss16), float(loss), rtol=0.05, atol=2e-3)
    flat = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])
    flat16 = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads16)])
    assert np.corrcoef(flat, flat16)[0, 1] > 0.99


def test_updater_logprobs_use_the_updates_numerics():
    graphdef, params = _policy()
    buf = _buffer()
    lp32 = PolicyUpdater(graphdef, UpdateConfig(mini_batch_groups=2, loss=LOSS)).logprobs(
        params, buf
    )
    cfg16 = UpdateConfig(mini_batch_groups=2, loss=LOSS, compute_dtype="bfloat16")
    lp16 = PolicyUpdater(graphdef, cfg16).logprobs(params, buf)
    mask = buf.response_mask > 0
    assert not np.array_equal(lp16[mask], lp32[mask])
    np.testing.assert_allclose(lp16[mask], lp32[mask], atol=0.05)
    # micro_batch_size rows at a time (memory of one micro-batch), in the buffer's row order
    for micro in (2, 4):
        cfg = UpdateConfig(mini_batch_groups=2, loss=LOSS, micro_batch_size=micro)
        lp_micro = PolicyUpdater(graphdef, cfg).logprobs(params, buf)
        np.testing.assert_allclose(lp_micro[mask], lp32[mask], rtol=1e-5, atol=1e-5)


def test_every_update_option_reaches_each_stages_update_config():
    """The ``update`` section is the stage's ``UpdateConfig`` base: no option is dropped
    or renamed on the way (``UpdateConfig.of``)."""
    from magic_jax.update.config import UpdateOptions

    values = {
        "mini_batch_split": "fixed-size",
        "micro_batch_size": 4,
        "packing": True,
        "micro_batch_tokens": 512,
        "num_reuse": 2,
        "remat": "full",
        "compute_dtype": "bfloat16",
        "attention_chunk": 64,
        "attention": "splash",
        "layer_unroll": 2,
        "mlp_kernel": False,
    }
    assert set(values) == {f.name for f in dataclasses.fields(UpdateOptions)}
    u = update_config(load_config(raw=_raw(**values)), 0)
    assert {k: getattr(u, k) for k in values} == values
    assert isinstance(u, UpdateOptions) and u.mini_batch_groups == 2
