"""Splash attention (``model/splash.py``, ``ModelConfig.attention``) in Pallas's interpreter
against the model's dense masked attention: outputs and gradients on packed and plain causal
rows with grouped-query heads, sharded over a mesh; the option's checks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_fp32_close
from jax.sharding import NamedSharding, PartitionSpec

from magic_jax.model.config import ModelConfig
from magic_jax.model.qwen2 import Qwen2, sequence_attention
from magic_jax.model.sharding import MeshConfig, make_mesh
from magic_jax.model.splash import causal_tiles, running_tiles, splash_attention
from magic_jax.run.config import ConfigError, load_config
from magic_jax.run.stages import update_config
from magic_jax.testing import Sample
from magic_jax.update.buffer import pack_rollouts
from magic_jax.update.config import UpdateConfig
from magic_jax.update.losses import LossConfig
from magic_jax.update.packing import pack_rows
from magic_jax.update.step import StepSpec, loss_and_grads

B, T, K, G, H = 2, 200, 2, 2, 64  # T pads to 256: two tiles of 128


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, K, G, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32) for _ in range(2))
    # row 0 packed: three sequences, the middle one across the tile edge, then padding (0);
    # row 1 one plain causal sequence (an unpacked row without padding: all ones)
    packed = np.repeat([1, 2, 3, 0], [70, 80, 30, 20])
    segments = jnp.asarray(np.stack([packed, np.ones(T, int)]), jnp.int32)
    weight = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    return (q, k, v), segments, weight


def _dense(q, k, v, segments):
    """The model's dense path over the same rows (one query block: ``chunk`` 0); padding
    (segment 0) is no key, as ``Qwen2`` marks it."""
    slots = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    keys = jnp.where(segments > 0, slots, -1)
    out, _ = sequence_attention(
        q, k, v, cache_kv=None, positions_BT=slots, q_slot_BT=slots, key_pos_BS=keys,
        write_at_B=jnp.zeros((B,), jnp.int32), window=None, chunk=0, segments_BT=segments,
    )  # fmt: skip
    return out


def _out_and_grads(fn, args, weight):
    """``fn(*args)`` and the gradients of q, k and v of ``sum(fn(*args) * weight)``."""

    def both(*a):
        out, vjp = jax.vjp(fn, *a)
        return out, vjp(weight)

    return jax.jit(both)(*args)


def test_splash_equals_the_dense_attention_and_its_gradients_on_packed_and_causal_rows():
    """Outputs, and the gradients of q, k and v, of the interpreted kernel (block 128, T
    padded from 200 to 256, two query heads per kv head) equal the dense masked product's:
    a packed row of three sequences and padding, and a plain causal row."""
    args, segments, weight = _inputs()
    out, grads = _out_and_grads(
        lambda *a: splash_attention(*a, segments, interpret=True, block=128), args, weight
    )
    dense, dense_grads = _out_and_grads(lambda *a: _dense(*a, segments), args, weight)
    assert out.shape == dense.shape and out.dtype == jnp.float32
    assert_fp32_close(out, dense, terms=T)
    # the second sequence sees none of the first: not what one causal sequence gives
    whole = _dense(*args, jnp.ones_like(segments))
    assert not np.allclose(np.asarray(out[0, 70:150]), np.asarray(whole[0, 70:150]), atol=1e-3)
    for name, a, d in zip("qkv", grads, dense_grads):
        assert float(jnp.abs(d).max()) > 1e-3, name
        assert_fp32_close(a, d, terms=T * G, err_msg=f"d{name}")


def test_splash_under_a_mesh_splits_rows_and_kv_heads_and_changes_no_number():
    """Rows over ``data`` x ``fsdp`` and kv heads over ``tensor`` (``shard_map``), as the
    update runs it: the same output as on one device."""
    args, segments, _ = _inputs(1)
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), jax.devices()[:4])
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    fn = jax.jit(lambda *a: splash_attention(*a, row_sharding=rows, interpret=True, block=128))
    text = fn.lower(*args, segments).as_text()
    assert "shard_map" in text or "sdy.manual_computation" in text
    assert_fp32_close(fn(*args, segments), _dense(*args, segments), terms=T)


def test_the_model_with_splash_attention_gives_the_dense_logits_on_packed_rows():
    """``Qwen2`` with ``attention: splash-interpret`` on a packed row and a left-padded
    unpacked one gives the dense model's logits at every real token."""
    cfg = ModelConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=4,
        num_kv_heads=2, attention_chunk=64,
    )  # fmt: skip
    model = Qwen2(cfg, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 160)), jnp.int32)
    seg = np.repeat([1, 2, 0], [100, 50, 10])
    positions = np.concatenate([np.arange(100), np.arange(50), np.zeros(10, int)])
    dense = model(
        ids[:1], positions=jnp.asarray(positions[None]), segment_ids=jnp.asarray(seg[None])
    )
    mask = jnp.asarray(np.arange(160) >= 30)[None]  # left padding
    dense_pad = model(ids[1:], attention_mask=mask)
    model.config = dataclasses.replace(cfg, attention="splash-interpret")
    splash = model(
        ids[:1], positions=jnp.asarray(positions[None]), segment_ids=jnp.asarray(seg[None])
    )
    splash_pad = model(ids[1:], attention_mask=mask)
    real = seg > 0
    assert_fp32_close(splash[0, real], dense[0, real], terms=160)
    assert_fp32_close(splash_pad[0, 30:], dense_pad[0, 30:], terms=160)


def test_the_attention_option_is_checked_and_reaches_the_update():
    base = {"model": "m", "output_dir": "o", "data": {"train": ["d"]}, "stages": [
        {"name": "s", "steps": 1, "max_response_length": 8, "prompts_per_step": 1,
         "mini_batch_groups": 1, "group_size": 2}]}  # fmt: skip
    cfg = load_config(raw=base | {"update": {"attention": "splash"}})
    assert update_config(cfg, 0).attention == "splash"
    assert update_config(load_config(raw=base), 0).attention is None
    with pytest.raises(ConfigError, match=r"update\.attention"):
        load_config(raw=base | {"update": {"attention": "flash"}})
    with pytest.raises(ValueError, match=r"ModelConfig\.attention"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=1, num_kv_heads=1, attention="flash")  # fmt: skip
    # sliding-window layers: refused, naming the option
    with pytest.raises(ValueError, match=r"update\.attention.*slide"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2,
                    num_heads=1, num_kv_heads=1, sliding_window=4, sliding_layers=(1,),
                    attention="splash")  # fmt: skip
    assert UpdateConfig(mini_batch_groups=1, attention="splash").attention == "splash"


def test_splash_off_tpu_is_refused_naming_the_option():
    cfg = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_layers=1,
                      num_heads=2, num_kv_heads=1, attention="splash")  # fmt: skip
    model = Qwen2(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"update\.attention.*'splash' runs a TPU kernel.*cpu"):
        model(jnp.zeros((1, 8), jnp.int32))


def test_the_kernel_runs_the_tiles_of_each_sequence_only():
    """Packed sequences of 300, 500 and 180 slots and 44 of padding in 8 tiles of 128: the
    tiles on and below the diagonal that hold a query and a key of one sequence run, the
    ones between two sequences and among the padding (each slot its own) do not. With one
    sequence, the causal tiles ``costs.py`` charges a splash row."""
    ids = np.repeat([1, 2, 3, 0], [300, 500, 180, 44])
    seg = jnp.asarray(np.where(ids > 0, ids, 2**30 + np.arange(1024)), jnp.int32)
    run = np.asarray(running_tiles(seg, 128))
    # tiles 0-2 hold sequence 1, 2-6 sequence 2, 6-7 sequence 3, 7 the padding too
    first, second, third = {0, 1, 2}, {2, 3, 4, 5, 6}, {6, 7}
    expect = np.array(
        [[j <= i and any({i, j} <= s for s in (first, second, third)) for j in range(8)]
         for i in range(8)]
    )  # fmt: skip
    np.testing.assert_array_equal(run, expect)
    assert run.sum() == 6 + 15 + 3 - 2 < 8 * 9 // 2  # (2, 2) and (6, 6) shared
    one = np.asarray(running_tiles(jnp.ones(1024, jnp.int32), 128))
    assert one.sum() * 128**2 == causal_tiles(1024, 128)
    assert causal_tiles(512) == 512 * 512
    assert causal_tiles(1024) == 3 * 512 * 512
    assert causal_tiles(200) == 256 * 256  # one tile of 256 (a multiple of 128)
    n = 18432 // 512
    assert causal_tiles(18432) == n * (n + 1) // 2 * 512**2
    assert 0.5 < causal_tiles(18432) / 18432**2 < 0.52


def _packed_update(attention):
    """The packed update's loss and gradients (2 bins of 2 micro-batches, KL on) with
    ``update.attention``."""
    cfg = ModelConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2,
    )  # fmt: skip
    graphdef, params = nnx.split(Qwen2(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(0)
    samples, rewards = [], []
    for p in range(2):
        prompt = rng.integers(3, 64, int(rng.integers(4, 30))).astype(np.int32)
        for s in range(4):
            n = int(rng.integers(1, 90))
            samples.append(
                Sample(prompt_index=p, sample_index=s, prompt_tokens=prompt,
                       tokens=rng.integers(3, 64, n).astype(np.int32),
                       logprobs=np.log(rng.uniform(0.05, 0.9, n)).astype(np.float32),
                       entropies=np.ones(n, np.float32), truncated=False, length=n)
            )  # fmt: skip
            rewards.append(float(s % 2))
    buf = pack_rollouts(
        samples, np.array(rewards, np.float32), prompt_bucket=32, response_bucket=96
    )
    packed, n = pack_rows(buf, 2)
    ucfg = UpdateConfig(
        mini_batch_groups=2, micro_batch_size=4, packing=True, attention=attention,
        loss=LossConfig(logit_chunk=32, kl_beta=0.1, eps_high=0.28),
    )  # fmt: skip
    ref = jax.tree.map(lambda x: x * 1.5, params)
    spec = StepSpec(graphdef, ucfg, nominal_rows=buf.num_rows)
    fn = jax.jit(lambda p, b, k: loss_and_grads(p, b, 0.01, spec, ref_params=ref, packed=k))
    return fn(params, buf, packed), buf.tokens.shape[1]


@pytest.mark.heavy
def test_the_packed_update_with_splash_equals_the_dense_one():
    """``update.attention: splash-interpret`` in the packed update (remat, layer scan,
    micro-batch loop, reference forward): loss, every gradient and the metrics of the dense
    update, rows of 128 slots holding several sequences."""
    ((loss_d, grads_d, m_d), length), ((loss_s, grads_s, m_s), _) = (
        _packed_update(a) for a in ("dense", "splash-interpret")
    )
    assert length == 128
    np.testing.assert_allclose(float(loss_s), float(loss_d), rtol=1e-5)
    assert_fp32_close(grads_s, grads_d, terms=2 * length * 2)
    for k in m_d:
        np.testing.assert_allclose(float(m_s[k]), float(m_d[k]), rtol=1e-5, atol=1e-6, err_msg=k)
