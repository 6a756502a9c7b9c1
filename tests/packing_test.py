"""The packed update (``update.packing``): rows laid end to end in bins with segment ids give
the padded update's loss, gradients and metrics; the model's segment attention; the layout;
the option from the config to the trainer's records."""

import contextlib
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from magic_jax.model.config import ModelConfig
from magic_jax.model.qwen2 import Qwen2
from magic_jax.testing import Sample
from magic_jax.update.buffer import pack_rollouts
from magic_jax.update.config import UpdateConfig
from magic_jax.update.losses import LossConfig
from magic_jax.update.packing import micro_batches_of, pack_rows
from magic_jax.update.step import StepSpec, loss_and_grads
from magic_jax.update.updater import PolicyUpdater

V, G, T = 64, 4, 24
CFG = ModelConfig(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    dtype="float32",
)
RTOL = 1e-5
HEAVY = pytest.mark.heavy  # 10 s or more of compiles: `make test-slow` runs them


@functools.cache
def _policy():
    return nnx.split(Qwen2(CFG, rngs=nnx.Rngs(0)), nnx.Param)


@functools.cache
def _buffer(groups=4, seed=0):
    """Rollouts with responses of 1 to T tokens (one at T in every group, most short) and
    prompts of 2 to 9 tokens; some groups all-right or all-wrong (not kept); per-token staleness."""
    rng = np.random.default_rng(seed)
    samples, rewards = [], []
    for p in range(groups):
        prompt = rng.integers(3, V, int(rng.integers(2, 10))).astype(np.int32)
        for s in range(G):
            n = T if s == 0 else 1 + int((T - 1) * rng.uniform() ** 2)  # a long tail
            samples.append(
                Sample(
                    prompt_index=p,
                    sample_index=s,
                    prompt_tokens=prompt,
                    tokens=rng.integers(3, V, n).astype(np.int32),
                    logprobs=np.log(rng.uniform(0.05, 0.9, n)).astype(np.float32),
                    entropies=rng.uniform(0.0, 2.0, n).astype(np.float32),
                    truncated=n == T,
                    length=n,
                )
            )
            rewards.append(float(p % 3 == 2 or (p % 3 == 0 and rng.integers(0, 2))))
    buf = pack_rollouts(samples, np.array(rewards, np.float32), prompt_bucket=8, response_bucket=8)
    stale = rng.integers(0, 3, buf.response_mask.shape).astype(np.int32)
    ent_mask = (rng.uniform(size=buf.response_mask.shape) < 0.6).astype(np.float32)
    return dataclasses.replace(buf, staleness=stale, entropy_mask=ent_mask)


def _close(a, b, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(float(np.max(np.abs(a))), 1e-6)
    err = float(np.max(np.abs(a - b))) / scale
    assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL}"


def _compare(padded, packed):
    (l0, g0, m0), (l1, g1, m1) = padded, packed
    _close(l0, l1, "loss")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
        _close(a, b, f"grad {jax.tree_util.keystr(path)}")
    assert set(m0) == set(m1)
    for k in m0:
        _close(m0[k], m1[k], k)


def _run(cfg, buf, packed=None, n=None):
    graphdef, params = _policy()
    ref = jax.tree.map(lambda x: x * 1.5, params)  # a KL well above rounding
    spec = StepSpec(graphdef, cfg, nominal_rows=buf.num_rows)

    @jax.jit
    def fn(p, b, k, live):
        return loss_and_grads(p, b, 0.01, spec, ref_params=ref, packed=k, live_micro=live)

    return fn(params, buf, packed, None if n is None else jnp.int32(n))


@pytest.mark.parametrize("agg", ["token-mean", pytest.param("seq-mean-token-mean", marks=HEAVY)])
def test_packed_update_equals_padded_over_several_micro_batches(agg):
    """Token-balanced micro-batches (2 bins each) against padded ones of 4 rows: loss,
    every gradient and every metric (entropy, KL to the reference, clip fractions, ratios,
    per-staleness clips) to 1e-5 relative, with the entropy mask and KL on."""
    buf = _buffer()
    loss = LossConfig(logit_chunk=8, aggregation=agg, kl_beta=0.1, eps_high=0.28)
    cfg = UpdateConfig(mini_batch_groups=4, loss=loss, micro_batch_size=4)
    packed, n = pack_rows(buf, 2)
    assert 1 < n < buf.num_rows // 4 + 1  # several micro-batches, fewer than padded
    _compare(_run(cfg, buf), _run(cfg, buf, packed, n))


def test_micro_token_mean_with_the_same_rows_per_micro_batch():
    """``micro-token-mean`` depends on the split: with each packed micro-batch given the rows
    of the padded one (rows i, i + n, ... in micro-batch i), the values are the same."""
    buf = _buffer()
    size = 4
    cfg = UpdateConfig(
        mini_batch_groups=4,
        loss=LossConfig(logit_chunk=8, aggregation="micro-token-mean"),
        micro_batch_size=size,
    )
    n_micro = buf.num_rows // size
    packed, n = pack_rows(buf, size, micro_of_row=np.arange(buf.num_rows) % n_micro)
    assert n <= n_micro
    _compare(_run(cfg, buf), _run(cfg, buf, packed, n))


def test_pack_rows_layout():
    """Each counted row's real tokens once, in one bin, positions from 0, its own segment;
    nothing of uncounted rows; no bin over its length; micro-batches filled in order."""
    buf = _buffer()
    packed, n = pack_rows(buf, 2)
    tok, pos, seg = (np.asarray(x) for x in (packed.tokens, packed.positions, packed.segments))
    counted = np.asarray(buf.keep & buf.valid)
    assert tok.shape == (micro_batches_of(buf.num_rows, 2), 2, buf.tokens.shape[1])
    for r in range(buf.num_rows):
        where = seg == r + 1
        if not counted[r]:
            assert not where.any() and packed.row_micro[r] == -1
            continue
        real = buf.tokens[r][buf.attention_mask[r].astype(bool)]
        k, b = np.argwhere(where.any(-1))[0]
        assert where.sum() == len(real) and where[k, b].sum() == len(real)
        assert k == packed.row_micro[r]
        np.testing.assert_array_equal(tok[where], real)
        np.testing.assert_array_equal(pos[where], np.arange(len(real)))
        # the slot that predicts the first response token is the last prompt token's
        prompt = int(buf.attention_mask[r, : buf.prompt_len].sum())
        first = np.flatnonzero(where.reshape(where.shape[0], -1)[k])[0]
        assert packed.row_start[r] == first + prompt - 1
    assert n == int(packed.row_micro.max()) + 1
    assert (seg[n:] == 0).all() and (seg[: n - 1] > 0).any(-1).all()
    real_tokens = int(buf.attention_mask[counted].sum())
    assert n * 2 * tok.shape[-1] < counted.sum() * buf.tokens.shape[1]  # less than padded
    assert (seg > 0).sum() == real_tokens


def test_pack_rows_refuses_a_micro_batch_that_does_not_fit():
    buf = _buffer()
    with pytest.raises(ValueError, match="micro-batch 0 .* do not fit in 1 bins"):
        pack_rows(buf, 1, micro_of_row=np.zeros(buf.num_rows, int))
    with pytest.raises(ValueError, match="bins per micro-batch must be >= 1"):
        pack_rows(buf, 0)


def test_segment_attention_equals_each_sequence_alone():
    """Two sequences in one row with segment ids and restarted positions: each one's hidden
    states equal its own forward pass; without the segments they would not."""
    graphdef, params = _policy()
    model = nnx.merge(graphdef, params)
    a = jnp.arange(3, 10, dtype=jnp.int32)[None]
    b = jnp.arange(20, 25, dtype=jnp.int32)[None]
    packed = jnp.concatenate([a, b, jnp.zeros((1, 3), jnp.int32)], axis=1)
    seg = jnp.array([[1] * 7 + [2] * 5 + [0] * 3], jnp.int32)
    pos = jnp.array([list(range(7)) + list(range(5)) + [0] * 3], jnp.int32)
    out = model(packed, positions=pos, attention_mask=seg > 0, segment_ids=seg)
    np.testing.assert_allclose(out[:, :7], model(a), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[:, 7:12], model(b), rtol=1e-5, atol=1e-5)
    mixed = model(packed, positions=pos, attention_mask=seg > 0)
    assert np.abs(np.asarray(mixed[:, 7:12] - model(b))).max() > 1e-3


def _updater_run(packing, micro_batch_tokens=None, tis=False):
    graphdef, params = _policy()
    cfg = UpdateConfig(
        mini_batch_groups=2,
        loss=LossConfig(logit_chunk=8, eps_high=0.28, tis_cap=2.0 if tis else None),
        micro_batch_size=4,
        packing=packing,
        micro_batch_tokens=micro_batch_tokens,
    )
    updater = PolicyUpdater(graphdef, cfg)
    state = updater.init_state(jax.tree.map(jnp.copy, params))  # the step donates it
    buf = dataclasses.replace(_buffer(), staleness=None)
    state, metrics = updater.update(state, buf, jax.random.key(0))
    return state, metrics


@HEAVY
def test_updater_with_packing_takes_the_same_optimizer_steps():
    """``PolicyUpdater.update`` over two mini-batches: the parameters after both AdamW steps
    and every per-step metric equal the padded update's (as bins: rows, or a token budget)."""
    s0, m0 = _updater_run(False)
    for tokens in (None, 3 * T):
        s1, m1 = _updater_run(True, tokens)
        assert m0["num_sgd_steps"] == m1["num_sgd_steps"] == 2
        # the share of computed token positions that hold tokens: packing leaves less padding
        # (with micro-batches of 4 bins here as many as padded; with 2, fewer)
        assert 0 < m0["update_token_fill"] <= m1["update_token_fill"] <= 1
        if tokens is not None:
            assert m1["update_token_fill"] > m0["update_token_fill"]
        for a, b in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s1.params)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        for k in ("loss", "pg_loss", "entropy", "clipfrac_high", "clipfrac_low", "grad_norm"):
            np.testing.assert_allclose(m0[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=k)


@HEAVY
def test_recomputed_logprobs_and_tis_update_packed_equal_padded():
    """With TIS over two mini-batches the trainer recomputes pi_old of the whole buffer
    (``PolicyUpdater.logprobs``): packed, every valid row's log-probs (kept or not) equal
    the padded ones, and so do the update's steps."""
    graphdef, params = _policy()
    buf = dataclasses.replace(_buffer(), staleness=None)
    on = buf.response_mask > 0
    got = {}
    for packing in (False, True):
        cfg = UpdateConfig(mini_batch_groups=2, micro_batch_size=4, packing=packing)
        got[packing] = PolicyUpdater(graphdef, cfg).logprobs(params, buf)
    assert not buf.keep.all()  # rows of groups that are not kept are computed too
    np.testing.assert_allclose(got[True][on], got[False][on], rtol=1e-5, atol=1e-5)
    (s0, m0), (s1, m1) = _updater_run(False, tis=True), _updater_run(True, tis=True)
    for k in ("loss", "tis_weight_mean", "ratio_mean", "grad_norm"):
        np.testing.assert_allclose(m0[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=k)
    for a, b in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s1.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_packed_bins_per_micro_batch():
    graphdef, _ = _policy()
    cfg = UpdateConfig(mini_batch_groups=4, micro_batch_size=8, packing=True)
    assert PolicyUpdater(graphdef, cfg).packed_bins(G, 40) == 8
    tokens = dataclasses.replace(cfg, micro_batch_tokens=130)
    assert PolicyUpdater(graphdef, tokens).packed_bins(G, 40) == 3
    assert (
        PolicyUpdater(graphdef, dataclasses.replace(tokens, micro_batch_tokens=10)).packed_bins(
            G, 40
        )
        == 1
    )


def test_packing_option_from_the_command_line(tmp_path):
    from magic_jax.run.config import ConfigError, load_config
    from magic_jax.run.stages import update_config

    stage = dict(
        steps=1, max_response_length=8, prompts_per_step=2, mini_batch_groups=2, group_size=4
    )
    raw = {"model": "m", "output_dir": "out", "data": {"train": ["t.jsonl"]}, "stages": [stage]}
    cfg = load_config(raw=raw, overrides=["update.packing=true", "update.micro_batch_tokens=64"])
    u = update_config(cfg, 0)
    assert u.packing is True and u.micro_batch_tokens == 64
    assert update_config(load_config(raw=raw), 0).packing is False
    with pytest.raises(ConfigError, match="update.packing"):
        load_config(raw=raw, overrides=["update.packing=3"])
    with pytest.raises(ConfigError, match="update.micro_batch_tokens"):
        load_config(raw=raw, overrides=["update.micro_batch_tokens=0"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("packing"))


def _train(files, name, *sets):
    from magic_jax.jobs.cli import main

    with contextlib.chdir(files):
        args = ["train", "run.yaml", "--set", f"output_dir={name}", "--set", "export_dtype=float32"]
        for s in sets:
            args += ["--set", s]
        assert main(args) == 0
    rows = [json.loads(x) for x in (files / name / "metrics.jsonl").read_text().splitlines()]
    from safetensors.numpy import load_file

    return rows, load_file(str(files / name / "hf_final" / "model.safetensors"))


@HEAVY
def test_train_gives_the_same_records_and_weights_packed_and_padded(tiny):
    """``magic-jax train`` as typed, twice on the tiny run: with ``update.packing`` the
    records (losses, entropy, rewards, lengths) and the final weights equal the padded
    run's within float tolerance."""
    rows0, w0 = _train(tiny, "padded", "update.packing=false")
    rows1, w1 = _train(tiny, "packed", "update.packing=true")
    assert len(rows0) == len(rows1) == 4
    for r0, r1 in zip(rows0, rows1):
        for k, v in r0.items():
            if isinstance(v, float) and not k.startswith(("time", "wall")) and "_s" not in k:
                assert r1[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    # AdamW divides by the gradient's size: an entry whose gradient is near zero moves by
    # up to the learning rate (1e-2) whatever its rounding; a thousandth of it is allowed
    for k in w0:
        np.testing.assert_allclose(w0[k], w1[k], rtol=1e-4, atol=1e-5, err_msg=k)


@HEAVY
def test_packed_update_on_a_mesh_equals_the_padded_one_on_one_device():
    """``update.packing`` on a (data 2, fsdp 2, tensor 2) CPU mesh: the bins split over the
    four data shards, the parameters sharded; the AdamW step and its metrics equal the
    padded update's on one device."""
    from conftest import shard

    from magic_jax.model.sharding import TRAIN_RULES, MeshConfig, make_mesh
    from magic_jax.update.optim import OptimizerConfig

    assert jax.device_count() == 8
    buf = dataclasses.replace(_buffer(), staleness=None)
    results = []
    for mesh, packing in ((None, False), (make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)), True)):
        cfg = UpdateConfig(
            mini_batch_groups=4,
            micro_batch_size=4,
            packing=packing,
            loss=LossConfig(eps_high=0.28, logit_chunk=8),
            # Adam's eps = 1: the step is close to linear in the gradient (train_step_test)
            optimizer=OptimizerConfig(learning_rate=1.0, eps=1.0, weight_decay=0.0),
        )
        m = Qwen2(CFG, rngs=nnx.Rngs(0))
        if mesh is not None:
            m = shard(m, mesh, TRAIN_RULES)
        graphdef, params = nnx.split(m, nnx.Param)
        p_init = jax.device_get(params)
        updater = PolicyUpdater(graphdef, cfg, mesh=mesh)
        if packing:
            assert updater.packed_bins(G, buf.tokens.shape[1]) == 4  # a bin per data shard
        state, metrics = updater.update(updater.init_state(params), buf, jax.random.key(1))
        delta = jax.tree.map(lambda a, b: a - b, jax.device_get(state.params), p_init)
        results.append((delta, jax.device_get(metrics)))
    (d0, m0), (d1, m1) = results
    for k in ("loss", "grad_norm", "entropy", "num_tokens", "ratio_max", "clipfrac_high"):
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, err_msg=k)
    for a, b in zip(jax.tree.leaves(d0), jax.tree.leaves(d1)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
