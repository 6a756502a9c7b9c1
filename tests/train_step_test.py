"""Rollout packing and the jitted update: NumPy golden values, invariances, skips, update loop."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import shard
from flax import nnx
from helpers import assert_fp32_close

from magic_jax.model.config import ModelConfig
from magic_jax.model.qwen2 import Qwen2
from magic_jax.model.sharding import TRAIN_RULES, MeshConfig, make_mesh
from magic_jax.testing import Sample
from magic_jax.update.advantages import AdvantageConfig
from magic_jax.update.buffer import pack_rollouts
from magic_jax.update.config import UpdateConfig
from magic_jax.update.entropy_control import EntropyControlConfig
from magic_jax.update.losses import LossConfig
from magic_jax.update.optim import OptimizerConfig
from magic_jax.update.state import TrainState, init_train_state
from magic_jax.update.step import StepSpec, live_first, loss_and_grads, train_step
from magic_jax.update.updater import PolicyUpdater

V, G = 64, 4
CFG = ModelConfig(
    vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2
)


def _samples(num_prompts=4, max_resp=10, seed=0, correct=None):
    """Random records with ragged prompts/responses; some truncated (length == max_resp)."""
    rng = np.random.default_rng(seed)
    out, rewards = [], []
    for p in range(num_prompts):
        prompt = rng.integers(3, V, rng.integers(2, 7)).astype(np.int32)
        for s in range(G):
            n = int(rng.integers(1, max_resp + 1))
            out.append(
                Sample(
                    prompt_index=10 + p,
                    sample_index=s,
                    prompt_tokens=prompt,
                    tokens=rng.integers(3, V, n).astype(np.int32),
                    logprobs=np.log(rng.uniform(0.05, 0.9, n)).astype(np.float32),
                    entropies=rng.uniform(0.0, 2.0, n).astype(np.float32),
                    truncated=n == max_resp,
                    length=n,
                )
            )
            ok = correct[p][s] if correct is not None else rng.random() < 0.5
            rewards.append(float(ok and n < max_resp))
    return out, np.array(rewards, np.float32)


@pytest.fixture(scope="module")
def model():
    return Qwen2(CFG, rngs=nnx.Rngs(0))


# One loss config shared by several tests so their jitted functions compile once.
L0 = LossConfig(eps_high=0.28, logit_chunk=8)


@functools.cache
def _jitted_loss_and_grads(graphdef, loss_cfg, micro=None):
    cfg = UpdateConfig(mini_batch_groups=4, micro_batch_size=micro, loss=loss_cfg)
    return jax.jit(lambda p, b, a: loss_and_grads(p, b, a, StepSpec(graphdef, cfg)))


@functools.cache
def _jitted_forward(graphdef):
    return jax.jit(
        lambda params, t, p, a: nnx.merge(graphdef, params)(t, positions=p, attention_mask=a)
    )


def _buffer(seed=0, mask="none", **kw):
    # groups 0-2 mixed, group 3 all wrong (dropped by rejection sampling)
    correct = [[1, 0, 1, 0], [0, 0, 0, 1], [1, 1, 1, 0], [0, 0, 0, 0]]
    samples, rewards = _samples(seed=seed, correct=correct)
    return (
        samples,
        rewards,
        pack_rollouts(
            samples,
            rewards,
            advantage=AdvantageConfig(mask=mask),
            prompt_bucket=8,
            response_bucket=8,
            **kw,
        ),
    )


# --------------------------------------------------------------------------- packing


def test_pack_layout_and_alignment():
    samples, rewards, buf = _buffer()
    assert buf.tokens.shape == (16, 8 + 16) and buf.response_mask.shape == (16, 16)
    assert buf.prompt_len == 8 and buf.group_size == G
    for i, s in enumerate(samples):  # already in (prompt, sample) order
        row = buf.tokens[i]
        p = len(s.prompt_tokens)
        np.testing.assert_array_equal(row[8 - p : 8], s.prompt_tokens)
        np.testing.assert_array_equal(row[8 : 8 + s.length], s.tokens)
        assert (row[: 8 - p] == 0).all() and (row[8 + s.length :] == 0).all()
        np.testing.assert_array_equal(
            buf.positions[i, 8 - p : 8 + s.length], np.arange(p + s.length)
        )
        np.testing.assert_array_equal(buf.old_logprobs[i, : s.length], s.logprobs)
        assert buf.response_mask[i].sum() == s.length and buf.truncated[i] == s.truncated
        assert buf.rewards[i] == rewards[i]
    assert buf.keep.tolist() == [True] * 12 + [False] * 4
    assert buf.group_ids.tolist() == [10 + p for p in range(4) for _ in range(G)]


def test_pack_pads_groups_and_orders_samples():
    samples, rewards = _samples(num_prompts=2, seed=1)
    order = [5, 0, 7, 2, 1, 6, 3]  # shuffled, one sample of prompt 11 missing
    buf = pack_rollouts(
        [samples[i] for i in order], rewards[order], group_size=G, num_groups=3, response_len=12
    )
    assert buf.tokens.shape[0] == 12 and buf.response_len == 12
    assert buf.valid.tolist() == [True] * 4 + [True] * 3 + [False] + [False] * 4
    np.testing.assert_array_equal(buf.tokens[1, -12:][: samples[1].length], samples[1].tokens)
    assert buf.advantages[7] == 0 and not buf.keep[8:].any()
    with pytest.raises(ValueError, match="rewards"):
        pack_rollouts(samples, rewards[:-1])
    with pytest.raises(ValueError, match="response_len"):
        pack_rollouts(samples, rewards, response_len=2)


# --------------------------------------------------------------------------- golden values


def _np_policy(model, buf, temperature):
    """Log-probs and entropies of the response tokens from full logits, in NumPy (float64)."""
    graphdef, params = nnx.split(model, nnx.Param)
    forward = _jitted_forward(graphdef)
    logits = forward(params, buf.tokens, buf.positions, buf.attention_mask)
    logits = np.asarray(logits, np.float64)
    z = logits / temperature
    z = z - z.max(-1, keepdims=True)
    logq = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p0, r = buf.prompt_len, buf.response_len
    logq = logq[:, p0 - 1 : p0 - 1 + r]  # position t predicts token t + 1
    logp = np.take_along_axis(logq, buf.tokens[:, p0:, None], -1)[..., 0]
    ent = -(np.exp(logq) * logq).sum(-1)
    return logp, ent


def _np_loss(buf, logp, ent, mask_mode, cfg: LossConfig, alpha):
    """SPEC items 1-4 written out per group, response and token."""
    rewards = buf.rewards.reshape(-1, G)
    trunc = buf.truncated.reshape(-1, G)
    terms, lens = [], []
    for g in range(rewards.shape[0]):
        r, t = rewards[g], trunc[g]
        stat = r[~t] if mask_mode == "before" else r
        if mask_mode == "before" and len(stat) <= 1:
            adv = np.zeros(G)
        else:
            adv = (r - stat.mean()) / (stat.std(ddof=1) + 1e-6)
            if mask_mode != "none":
                adv[t] = 0.0
        if not adv.any():
            continue  # rejection sampling
        for j in range(G):
            b = g * G + j
            n = int(buf.response_mask[b].sum())
            seq = 0.0
            for k in range(n):
                rho = np.exp(logp[b, k] - buf.old_logprobs[b, k])
                clipped = np.clip(rho, 1 - cfg.eps_low, 1 + cfg.eps_high)
                seq += -min(rho * adv[j], clipped * adv[j]) - alpha * ent[b, k]
            terms.append(seq)
            lens.append(n)
    if cfg.aggregation == "token-mean":
        return sum(terms) / sum(lens)
    if cfg.aggregation == "seq-mean-token-sum":
        return sum(terms) / len(terms)
    if cfg.aggregation == "seq-mean-token-mean":
        return sum(t / n for t, n in zip(terms, lens)) / len(terms)
    return sum(terms) / sum(lens) * len(terms) / buf.tokens.shape[0]


@pytest.mark.parametrize(
    "mask, clip, agg",
    [
        ("none", 0.2, "token-mean"),
        ("before", 0.28, "seq-mean-token-sum"),
        ("after", 0.25, "micro-token-mean"),
        pytest.param("after", 0.28, "token-mean", marks=pytest.mark.slow),
        pytest.param("none", 0.25, "seq-mean-token-mean", marks=pytest.mark.slow),
    ],
)
def test_loss_matches_numpy_end_to_end(model, mask, clip, agg):
    _, _, buf = _buffer(seed=2, mask=mask)
    logp, ent = _np_policy(model, buf, 0.7)
    # behaviour log-probs around the current policy so ratios straddle both clips
    rng = np.random.default_rng(3)
    old = logp + rng.uniform(-0.4, 0.4, logp.shape)
    buf = dataclasses.replace(buf, old_logprobs=np.where(buf.response_mask > 0, old, 0.0))
    buf = dataclasses.replace(buf, old_logprobs=buf.old_logprobs.astype(np.float32))
    lcfg = LossConfig(eps_high=clip, aggregation=agg, temperature=0.7, logit_chunk=5)
    graphdef, params = nnx.split(model, nnx.Param)
    loss, _, m = _jitted_loss_and_grads(graphdef, lcfg)(params, buf, 0.01)
    want = _np_loss(buf, logp, ent, mask, lcfg, 0.01)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5)
    assert float(m["clipfrac_low"]) > 0 and float(m["clipfrac_high"]) > 0


# --------------------------------------------------------------------------- invariances


@pytest.mark.parametrize(
    "agg, micro",
    [
        ("token-mean", 4),
        ("seq-mean-token-sum", 8),
        pytest.param("token-mean", 8, marks=pytest.mark.slow),
        pytest.param("seq-mean-token-mean", 4, marks=pytest.mark.slow),
    ],
)
def test_micro_batched_equals_full_batch(model, agg, micro):
    _, _, buf = _buffer(seed=4)
    graphdef, params = nnx.split(model, nnx.Param)
    lcfg = dataclasses.replace(L0, aggregation=agg)
    full_loss, full_g, full_m = _jitted_loss_and_grads(graphdef, lcfg)(params, buf, 0.01)
    loss, g, m = _jitted_loss_and_grads(graphdef, lcfg, micro)(params, buf, 0.01)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(full_g)) > 1e-3
    np.testing.assert_allclose(float(loss), float(full_loss), rtol=1e-5)
    # gradients and metrics sum over the buffer's 16 x 24 tokens, in another order
    assert_fp32_close(jax.tree.leaves(g), jax.tree.leaves(full_g), terms=16 * 24, rtol=1e-4)
    for k in ("entropy", "ratio_max", "clipfrac_high", "approx_kl"):
        assert_fp32_close(float(m[k]), float(full_m[k]), terms=16 * 24, err_msg=k)


@pytest.mark.heavy
def test_sharded_equals_unsharded():
    """One train_step on a (data 1, fsdp 2, tensor 4) CPU mesh equals the single-device step.

    Adam's eps = 1 makes the step lr * g / (|g| + 1), close to linear in the gradient,
    so comparing the new parameters compares the gradients (with eps = 1e-8 the first
    step is sign(g), which says little about g and is ill-conditioned where g ~ 0).
    """
    assert jax.device_count() == 8
    _, _, buf = _buffer(seed=5)
    cfg = UpdateConfig(
        mini_batch_groups=4,
        micro_batch_size=8,
        loss=LossConfig(eps_high=0.28, logit_chunk=8),
        optimizer=OptimizerConfig(learning_rate=1.0, eps=1.0, weight_decay=0.0),
    )
    results = []
    for mesh in (None, make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))):
        m = Qwen2(CFG, rngs=nnx.Rngs(0))
        if mesh is not None:
            m = shard(m, mesh, TRAIN_RULES)
        graphdef, params = nnx.split(m, nnx.Param)
        p_init = jax.device_get(params)
        updater = PolicyUpdater(graphdef, cfg, mesh=mesh)
        state0 = updater.init_state(params)
        if mesh is not None:  # Adam's moments are sharded like their parameters
            specs = [x.sharding.spec for x in jax.tree.leaves(params)]
            for name in ("mu", "nu"):
                moments = optax.tree_utils.tree_get(state0.opt_state, name)
                assert [x.sharding.spec for x in jax.tree.leaves(moments)] == specs, name
        state, metrics = updater.train_step(state0, buf, 0.005)
        if mesh is not None:
            kernel = state.params["layers"]["mlp"]["gate_proj"]["kernel"][...]  # [L, D, F]
            assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
            assert len(kernel.sharding.device_set) == 8
        delta = jax.tree.map(lambda a, b: a - b, jax.device_get(state.params), p_init)
        results.append((delta, jax.device_get(metrics)))
    (d0, m0), (d1, m1) = results
    for k in ("loss", "grad_norm", "entropy", "num_tokens", "ratio_max", "clipfrac_high"):
        np.testing.assert_allclose(float(m1[k]), float(m0[k]), rtol=1e-5)
    assert float(m0["grad_norm"]) > 0
    assert_fp32_close(jax.tree.leaves(d1), jax.tree.leaves(d0), terms=16 * 24, rtol=1e-4)


def test_on_policy_gradient_is_advantage_weighted_logprob_gradient(model):
    """rho == 1, alpha = 0: grad L == grad of -(1/T_k) sum_t A log pi (logits taken directly)."""
    _, _, buf = _buffer(seed=6)
    graphdef, params = nnx.split(model, nnx.Param)
    logp, _ = _np_policy(model, buf, 1.0)
    buf = dataclasses.replace(buf, old_logprobs=logp.astype(np.float32))
    _, grads, m = _jitted_loss_and_grads(graphdef, L0)(params, buf, 0.0)
    assert abs(float(m["ratio_max"]) - 1.0) < 1e-5 and float(m["clipfrac_high"]) == 0
    mask = jnp.asarray(buf.loss_mask())
    p0 = buf.prompt_len

    @jax.jit
    def pg_grad(p):
        def pg(p):
            logits = nnx.merge(graphdef, p)(
                jnp.asarray(buf.tokens),
                positions=jnp.asarray(buf.positions),
                attention_mask=jnp.asarray(buf.attention_mask),
            )
            logq = jax.nn.log_softmax(logits[:, p0 - 1 : -1], axis=-1)
            tgt = jnp.asarray(buf.tokens[:, p0:])[..., None]
            lp = jnp.take_along_axis(logq, tgt, -1)[..., 0]
            return -jnp.sum(jnp.asarray(buf.advantages)[:, None] * lp * mask) / mask.sum()

        return jax.grad(pg)(p)

    want = pg_grad(params)
    assert_fp32_close(jax.tree.leaves(grads), jax.tree.leaves(want), terms=16 * 24, rtol=1e-4)


def test_kl_to_reference_policy_matches_numpy(model):
    """kl_beta > 0: the reference forward runs and k3 = r - log r - 1, r = pi_ref / pi."""
    _, _, buf = _buffer(seed=9)
    ref_model = Qwen2(CFG, rngs=nnx.Rngs(5))
    logp, _ = _np_policy(model, buf, 1.0)
    ref_logp, _ = _np_policy(ref_model, buf, 1.0)
    buf = dataclasses.replace(buf, old_logprobs=logp.astype(np.float32))
    lcfg = dataclasses.replace(L0, kl_beta=0.1)
    cfg = UpdateConfig(mini_batch_groups=4, loss=lcfg)
    graphdef, params = nnx.split(model, nnx.Param)
    _, ref_params = nnx.split(ref_model, nnx.Param)
    loss, _, m = jax.jit(
        lambda p, r, b: loss_and_grads(p, b, 0.0, StepSpec(graphdef, cfg), ref_params=r)
    )(params, ref_params, buf)
    mask = buf.loss_mask() > 0
    log_r = (ref_logp - logp)[mask]
    k3 = np.exp(log_r) - log_r - 1
    # rho == 1: the surrogate is -A per token
    adv = np.broadcast_to(buf.advantages[:, None], mask.shape)[mask]
    np.testing.assert_allclose(float(m["ref_kl"]), k3.mean(), rtol=1e-4)
    np.testing.assert_allclose(float(loss), (-adv + 0.1 * k3).mean(), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="ref_params"):
        loss_and_grads(params, buf, 0.0, StepSpec(graphdef, cfg))


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_master_params():
    _, _, buf = _buffer(seed=10)
    losses = {}
    for dtype in ("float32", "bfloat16"):
        m = Qwen2(dataclasses.replace(CFG, dtype=dtype), rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(m, nnx.Param)
        cfg = UpdateConfig(mini_batch_groups=4, loss=L0)
        state = init_train_state(params, cfg)
        state, metrics = jax.jit(
            lambda s, b, g=graphdef, c=cfg: train_step(s, b, 0.0, StepSpec(g, c))
        )(state, buf)
        assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype("float32")}
        assert bool(metrics["applied"])
        losses[dtype] = float(metrics["loss"])
    # bf16 matmuls: ~3 significant digits on O(1) per-token terms
    assert abs(losses["bfloat16"] - losses["float32"]) < 2e-2 * max(1.0, abs(losses["float32"]))


# --------------------------------------------------------------------------- step and update


def test_adamw_step_and_nonfinite_skip(model):
    _, _, buf = _buffer(seed=7)
    graphdef, params = nnx.split(model, nnx.Param)
    # eps 1e-4: the first step g / (|g| + eps) stays smooth where g ~ 0
    opt = OptimizerConfig(learning_rate=1e-3, eps=1e-4, weight_decay=0.1, max_grad_norm=None)
    cfg = UpdateConfig(mini_batch_groups=4, loss=L0, optimizer=opt)
    step = jax.jit(lambda s, b: train_step(s, b, 0.0, StepSpec(graphdef, cfg)))
    _, grads, _ = _jitted_loss_and_grads(graphdef, L0)(params, buf, 0.0)
    p_before = jax.device_get(params)
    state, m = step(init_train_state(params, cfg), buf)
    assert int(state.step) == 1 and int(state.skipped) == 0 and bool(m["applied"])
    # first AdamW step: m_hat = g, v_hat = g^2
    for new, old, g in zip(*(jax.tree.leaves(t) for t in (state.params, p_before, grads))):
        g = np.asarray(g, np.float64)
        want = old - 1e-3 * (g / (np.abs(g) + 1e-4) + 0.1 * old)
        np.testing.assert_allclose(new, want, rtol=1e-5, atol=1e-8)

    bad = dataclasses.replace(buf, old_logprobs=buf.old_logprobs.copy())
    bad.old_logprobs[0, 0] = np.nan
    p_mid = jax.device_get(state.params)
    state, m = step(state, bad)
    assert int(state.skipped) == 1 and int(state.step) == 1 and not bool(m["applied"])
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(p_mid)):
        np.testing.assert_array_equal(a, b)


def test_update_runs_n_sgd_steps_and_advances_controller(model, tmp_path):
    samples, rewards = _samples(num_prompts=5, seed=8)
    rewards[:] = 0.0
    rewards[[0, 5, 9, 13]] = 1.0  # groups 0, 1, 2, 3 mixed; group 4 all wrong
    buf = pack_rollouts(samples, rewards, prompt_bucket=8, response_bucket=8)
    graphdef, params = nnx.split(Qwen2(CFG, rngs=nnx.Rngs(1)), nnx.Param)
    ent = EntropyControlConfig(target=5.0, delta=0.01)  # buffer entropy ~1 < target
    cfg = UpdateConfig(
        mini_batch_groups=3,
        mini_batch_split="fixed-size",
        num_reuse=2,
        micro_batch_size=4,
        entropy=ent,
        loss=LossConfig(logit_chunk=8),
    )
    updater = PolicyUpdater(graphdef, cfg)
    state = updater.init_state(params)
    e_want = (buf.entropies * buf.response_mask).sum() / buf.response_mask.sum()

    state, m = updater.update(state, buf, jax.random.key(0))
    assert m["num_sgd_steps"] == 2 * 2  # ceil(4 kept / 3) * 2 passes
    assert m["kept_group_fraction"] == pytest.approx(0.8)
    assert m["buffer_entropy"] == pytest.approx(e_want, rel=1e-6)
    assert m["alpha"] == 0.0  # c_0 = 0
    assert int(state.step) == 4 and float(state.entropy.coef) == pytest.approx(0.01)
    # the last mini-batch of each pass holds one real group out of three
    assert sorted(m["num_seqs"].tolist()) == [4, 4, 12, 12]

    state, m = updater.update(state, buf, jax.random.key(1))
    assert m["alpha"] == pytest.approx(0.01)  # c_1 = 0.01 and e_1 <= target
    assert float(state.entropy.coef) == pytest.approx(0.02)

    # nothing kept: no optimizer step, the controller still advances
    none = pack_rollouts(samples, np.zeros_like(rewards), prompt_bucket=8, response_bucket=8)
    state, m = updater.update(state, none, jax.random.key(2))
    assert m["num_sgd_steps"] == 0 and int(state.step) == 8
    assert float(state.entropy.coef) == pytest.approx(0.03)

    # the whole train state (controller included) round-trips through orbax
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "state", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(
        tmp_path / "state", jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    )
    assert isinstance(restored, TrainState)
    assert float(restored.entropy.coef) == pytest.approx(0.03) and int(restored.step) == 8
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)


def test_split_mini_batches_even_and_fixed_size():
    """The report's D_R / D_T equal mini-batches vs verl's ceil(kept / D_T)."""
    from magic_jax.update.buffer import split_mini_batches

    rng = np.random.default_rng(0)
    for d_r, d_t in ((8, 2), (12, 4), (16, 16), (256, 128)):
        for k in range(d_r + 1):
            order = rng.permutation(d_r)[:k]
            even = split_mini_batches(order, d_r, d_t, "even")
            fixed = split_mini_batches(order, d_r, d_t, "fixed-size")
            for parts in (even, fixed):
                assert all(0 < len(p) <= d_t for p in parts)
                np.testing.assert_array_equal(np.concatenate(parts or [order]), order)
            assert len(fixed) == -(-k // d_t)
            assert len(even) == min(d_r // d_t, k)
            if even:
                sizes = [len(p) for p in even]
                assert max(sizes) - min(sizes) <= 1
    # 7 kept of D_R 12, D_T 4: three steps of 3/2/2 groups, not 4 + 3 (verl's)
    order = np.arange(7)
    assert [len(p) for p in split_mini_batches(order, 12, 4, "even")] == [3, 2, 2]
    assert [len(p) for p in split_mini_batches(order, 12, 4, "fixed-size")] == [4, 3]
    # 5 kept of D_R 8, D_T 4: verl's last step trains on one group at full weight
    assert [len(p) for p in split_mini_batches(np.arange(5), 8, 4, "fixed-size")] == [4, 1]
    assert [len(p) for p in split_mini_batches(np.arange(5), 8, 4, "even")] == [3, 2]
    with pytest.raises(ValueError, match="multiple of D_T"):
        split_mini_batches(np.arange(3), 6, 4, "even")


def test_update_with_tis_against_the_sampled_distribution(model):
    """TIS over the truncated behaviour log-probs: the trainer's own pi_old in the ratio."""
    _, _, buf = _buffer(seed=11)
    rng = np.random.default_rng(11)
    # a truncated (top-p) distribution puts more mass on each drawn token than the full one
    sampled = buf.old_logprobs + rng.uniform(0.0, 1.0, buf.old_logprobs.shape)
    buf = dataclasses.replace(buf, sampling_logprobs=sampled.astype(np.float32))
    graphdef, params = nnx.split(model, nnx.Param)
    lcfg = dataclasses.replace(L0, tis_cap=1.5, behaviour_logprobs="sampled")
    updater = PolicyUpdater(graphdef, UpdateConfig(mini_batch_groups=2, loss=lcfg))
    want, _ = _np_policy(model, buf, 1.0)
    on = buf.response_mask > 0
    np.testing.assert_allclose(updater.logprobs(params, buf)[on], want[on], atol=2e-5)
    mask = buf.loss_mask() > 0
    state, m = updater.update(updater.init_state(params), buf, jax.random.key(0))
    assert m["num_sgd_steps"] == 2  # D_R 4 / D_T 2, three groups kept: 2 + 1
    # the first step's policy is the trainer's pi_old: PPO ratio 1
    assert float(m["ratio_mean"][0]) == pytest.approx(1.0, abs=1e-5)
    log_w = want - sampled
    w = np.minimum(np.exp(log_w), 1.5)
    # weights are constants of the buffer: their token sums over both mini-batches
    got = sum(float(x) * n for x, n in zip(m["tis_weight_mean"], m["num_tokens"]))
    assert got == pytest.approx(w[mask].sum(), rel=1e-4)
    assert 0 < float(m["sampler_ratio_max"][0]) <= np.exp(log_w[mask]).max() * (1 + 1e-4)
    assert float(m["sampler_ratio_mean"][0]) < 1  # the sampled tokens were more likely there
    assert int(state.step) == 2


# --------------------------------------------------------------------------- kept rows only


def test_live_first_puts_the_live_rows_in_the_first_micro_batches():
    order, n = live_first(num_rows=12, micro_rows=4, live_rows=6)
    assert n == 2
    # micro-batch i takes physical rows i, i + 3, i + 6, i + 9 (the strided split)
    micro = [order[i::3] for i in range(3)]
    assert [list(m) for m in micro] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_update_over_kept_rows_only_equals_the_whole_padded_batch():
    """The live-micro-batch loop gives the padded full batch's loss, gradients and metrics,
    and stopping it one micro-batch early changes them (the loop does skip work)."""
    _, _, buf = _buffer(seed=3)
    graphdef, params = nnx.split(Qwen2(CFG, rngs=nnx.Rngs(0)), nnx.Param)
    kept = np.flatnonzero(buf.group_keep())  # groups 0-2; group 3 dropped
    groups = np.concatenate([kept, [kept[0]]])
    batch = buf.take_groups(groups, np.arange(4) < len(kept))
    full_loss, full_g, full_m = _jitted_loss_and_grads(graphdef, L0)(params, batch, 0.01)
    order, n = live_first(batch.num_rows, G, len(kept) * G)
    assert n == 3
    packed = jax.tree.map(lambda x: x[order], batch)
    cfg = UpdateConfig(mini_batch_groups=4, loss=L0)

    @jax.jit
    def live(p, b, n):
        return loss_and_grads(p, b, 0.01, StepSpec(graphdef, cfg, micro_rows=G), live_micro=n)

    loss, g, m = live(params, packed, jnp.int32(n))
    assert_fp32_close(float(loss), float(full_loss), terms=16 * 24)
    assert_fp32_close(jax.tree.leaves(g), jax.tree.leaves(full_g), terms=16 * 24, rtol=1e-4)
    for k in ("entropy", "ratio_max", "clipfrac_high", "approx_kl", "pg_loss"):
        assert_fp32_close(float(m[k]), float(full_m[k]), terms=16 * 24, err_msg=k)
    short_loss, _, _ = live(params, packed, jnp.int32(n - 1))
    assert abs(float(short_loss) - float(full_loss)) > 1e-4


def test_on_policy_tis_takes_pi_old_from_the_same_forward():
    """With TIS and one optimizer step per buffer, pi_old comes from the step's own forward
    (stop-gradient): the same loss, gradients and new weights as a separate pi_old pass."""
    _, _, buf = _buffer(seed=5)
    buf = dataclasses.replace(buf, old_logprobs=buf.old_logprobs - 0.05)  # sampler numerics
    graphdef, params = nnx.split(Qwen2(CFG, rngs=nnx.Rngs(0)), nnx.Param)
    lcfg = LossConfig(eps_high=0.28, logit_chunk=8, tis_cap=2.0)
    cfg = UpdateConfig(mini_batch_groups=4, loss=lcfg)
    one_pass = PolicyUpdater(graphdef, cfg)
    fresh = one_pass.init_state(jax.tree.map(jnp.copy, params))  # donated by the update
    state_a, m_a = one_pass.update(fresh, buf, jax.random.key(0))
    assert list(one_pass._jitted) == [(True, 4)]  # no separate pi_old program ran
    assert one_pass._logprobs is None
    # the two-pass path: pi_old computed first, then the step against it
    two_pass = PolicyUpdater(graphdef, cfg)
    old = two_pass.logprobs(params, buf)
    prepared = dataclasses.replace(buf, old_logprobs=old, behaviour_logprobs=buf.old_logprobs)
    batch = prepared.take_groups([*np.flatnonzero(buf.group_keep()), 0], [1, 1, 1, 0])
    step = jax.jit(lambda s, b: train_step(s, b, 0.0, StepSpec(graphdef, cfg)))
    state_b, m_b = step(init_train_state(jax.tree.map(jnp.copy, params), cfg), batch)
    assert_fp32_close(float(m_a["loss"][0]), float(m_b["loss"]), terms=16 * 24)
    assert_fp32_close(float(m_a["grad_norm"][0]), float(m_b["grad_norm"]), terms=16 * 24)
    assert abs(float(m_a["tis_weight_mean"][0]) - 1.0) > 0.1  # the weights act
    assert_fp32_close(
        jax.tree.leaves(state_a.params), jax.tree.leaves(state_b.params), terms=16 * 24
    )
