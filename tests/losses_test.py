"""The clipped token-level objective against an independent NumPy reference."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_fp32_close

from magic_jax.model.logprobs import token_logprobs_and_entropy
from magic_jax.update.losses import Aggregation, LossConfig, policy_loss

B, T = 6, 12
NOMINAL = 8


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    logp = np.log(rng.uniform(0.05, 0.95, (B, T)))
    # ratios spread over ~[0.5, 2] so every clip branch is taken somewhere
    old = logp - rng.uniform(-0.7, 0.7, (B, T))
    adv = np.array([1.3, -0.8, 0.0, 2.1, -1.7, 0.4])
    mask = (rng.random((B, T)) < 0.7).astype(np.float64)
    mask[2] = 0.0  # a sequence with no counted token
    ent = rng.uniform(0.0, 3.0, (B, T))
    ref = logp - rng.uniform(-0.5, 0.5, (B, T))
    return logp, old, adv, mask, ent, ref


def _ref_terms(logp, old, adv, mask, ent, ref, alpha, cfg):
    """Per-token loss and its derivatives d/dlogp, d/dent, in float64 loops."""
    term = np.zeros_like(logp)
    dlogp = np.zeros_like(logp)
    dent = np.zeros_like(logp)
    for b in range(logp.shape[0]):
        a = adv[b]
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            rho = np.exp(logp[b, t] - old[b, t])
            clipped = min(max(rho, 1 - cfg.eps_low), 1 + cfg.eps_high)
            s, ds = (rho * a, rho * a) if rho * a <= clipped * a else (clipped * a, 0.0)
            if cfg.dual_clip is not None and a < 0 and cfg.dual_clip * a > s:
                s, ds = cfg.dual_clip * a, 0.0
            term[b, t] = -s - alpha * ent[b, t]
            dlogp[b, t] = -ds
            dent[b, t] = -alpha
            if cfg.kl_beta > 0:
                lr = ref[b, t] - logp[b, t]
                term[b, t] += cfg.kl_beta * (np.exp(lr) - lr - 1)
                dlogp[b, t] += cfg.kl_beta * (1 - np.exp(lr))
    return term, dlogp, dent


def _ref_weights(mask, mode):
    """d loss / d term per token for each aggregation, one micro-batch = the batch."""
    n_tok = mask.sum()
    n_seq = (mask.sum(1) > 0).sum()
    if mode == "token-mean":
        return mask / n_tok
    if mode == "seq-mean-token-sum":
        return mask / n_seq
    if mode == "seq-mean-token-mean":
        return mask / np.maximum(mask.sum(1, keepdims=True), 1) / n_seq
    return mask / n_tok * n_seq / NOMINAL


def _run(
    cfg, logp, old, adv, mask, ent, ref, alpha, rows=slice(None), counts_from=None, behaviour=None
):
    counts_from = mask if counts_from is None else counts_from
    num_tokens = counts_from.sum()
    num_seqs = (counts_from.sum(1) > 0).sum()

    def f(lp, e):
        return policy_loss(
            lp,
            jnp.asarray(old[rows], jnp.float32),
            jnp.asarray(adv[rows], jnp.float32),
            jnp.asarray(mask[rows], jnp.float32),
            e,
            alpha=alpha,
            config=cfg,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            nominal_seqs=NOMINAL,
            ref_logp_BT=jnp.asarray(ref[rows], jnp.float32) if cfg.kl_beta else None,
            behaviour_logp_BT=None if behaviour is None else jnp.asarray(behaviour[rows]),
        )

    (loss, metrics), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(
        jnp.asarray(logp[rows], jnp.float32), jnp.asarray(ent[rows], jnp.float32)
    )
    return float(loss), metrics, [np.asarray(g, np.float64) for g in grads]


CLIPS = {
    "symmetric": dict(eps_low=0.2, eps_high=0.2),
    "clip-higher": dict(eps_low=0.2, eps_high=0.28),
    "dual-clip": dict(eps_low=0.2, eps_high=0.28, dual_clip=1.5),
    "kl": dict(eps_low=0.2, eps_high=0.25, kl_beta=0.1),
}


@pytest.mark.parametrize(
    "clip, mode", list(itertools.product(CLIPS, [m.value for m in Aggregation]))
)
def test_loss_and_grads_match_numpy(clip, mode):
    logp, old, adv, mask, ent, ref = _inputs()
    cfg = LossConfig(aggregation=mode, **CLIPS[clip])
    alpha = 0.003
    loss, _, (g_logp, g_ent) = _run(cfg, logp, old, adv, mask, ent, ref, alpha)
    term, dlogp, dent = _ref_terms(logp, old, adv, mask, ent, ref, alpha, cfg)
    w = _ref_weights(mask, mode)
    np.testing.assert_allclose(loss, (term * w).sum(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g_logp, dlogp * w, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(g_ent, dent * w, rtol=1e-5, atol=1e-10)


@pytest.mark.parametrize("cap", [1.5, 4.0])
def test_truncated_importance_weights_match_numpy(cap):
    """TIS: the surrogate of each token times min(pi_old / pi_behaviour, cap), a constant."""
    logp, old, adv, mask, ent, ref = _inputs(4)
    rng = np.random.default_rng(4)
    behaviour = old - rng.uniform(-1.0, 1.0, old.shape)  # sampler numerics / truncation
    cfg = LossConfig(eps_high=0.28, tis_cap=cap)
    loss, m, (g_logp, _) = _run(cfg, logp, old, adv, mask, ent, ref, 0.0, behaviour=behaviour)
    plain = LossConfig(eps_high=0.28)
    term, dlogp, _ = _ref_terms(logp, old, adv, mask, ent, ref, 0.0, plain)
    w_tis = np.minimum(np.exp(old - behaviour), cap)
    w = _ref_weights(mask, "token-mean")
    np.testing.assert_allclose(loss, (term * w_tis * w).sum(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g_logp, dlogp * w_tis * w, rtol=1e-5, atol=1e-8)
    on = mask > 0
    np.testing.assert_allclose(float(m["tis_weight_mean"]), w_tis[on].mean(), rtol=1e-5)
    capped = (np.exp(old - behaviour) > cap)[on].mean()
    np.testing.assert_allclose(float(m["tis_capped"]), capped, rtol=1e-6)
    assert (0 < capped < 1) if cap == 1.5 else True
    # rollout/trainer mismatch: pi_theta / pi_behaviour
    s_ratio = np.exp(logp - behaviour)[on]
    np.testing.assert_allclose(float(m["sampler_ratio_mean"]), s_ratio.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["sampler_ratio_max"]), s_ratio.max(), rtol=1e-5)
    k3 = s_ratio - 1 - np.log(s_ratio)
    np.testing.assert_allclose(float(m["sampler_kl"]), k3.mean(), rtol=1e-4)
    # without TIS the behaviour log-probs are the ratio's: the mismatch is the PPO ratio
    _, m0, _ = _run(plain, logp, old, adv, mask, ent, ref, 0.0)
    assert float(m0["sampler_ratio_mean"]) == pytest.approx(float(m0["ratio_mean"]))
    with pytest.raises(ValueError, match="behaviour_logp_BT"):
        _run(cfg, logp, old, adv, mask, ent, ref, 0.0)


def test_masking_rule_drops_tokens_past_the_cap_and_keeps_the_others_weight():
    """``tis_rule: mask`` (AReaL's): w = pi_old / pi_behaviour where w <= cap, 0 above."""
    logp, old, adv, mask, ent, ref = _inputs(5)
    rng = np.random.default_rng(5)
    behaviour = old - rng.uniform(-1.5, 1.5, old.shape)
    cap = 2.0
    cfg = LossConfig(eps_high=0.28, tis_cap=cap, tis_rule="mask")
    loss, m, (g_logp, _) = _run(cfg, logp, old, adv, mask, ent, ref, 0.0, behaviour=behaviour)
    term, dlogp, _ = _ref_terms(logp, old, adv, mask, ent, ref, 0.0, LossConfig(eps_high=0.28))
    raw = np.exp(old - behaviour)
    w_mask = np.where(raw > cap, 0.0, raw)
    w = _ref_weights(mask, "token-mean")
    np.testing.assert_allclose(loss, (term * w_mask * w).sum(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g_logp, dlogp * w_mask * w, rtol=1e-5, atol=1e-8)
    on = mask > 0
    assert 0 < (raw > cap)[on].mean() < 1  # some dropped, some kept
    np.testing.assert_allclose(float(m["tis_capped"]), (raw > cap)[on].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(m["tis_weight_mean"]), w_mask[on].mean(), rtol=1e-5)


def test_behaviour_clip_is_a_trust_region_at_one_optimizer_step():
    """At N_SGD 1 the proximal policy is the current one (old == logp): decoupled PPO's
    clip never binds and every token has gradient w * A. ``behaviour_clip`` keeps naive
    PPO's clip against the sampler: tokens whose pi_theta / pi_behaviour is past the
    range in their advantage's direction get none; the others keep decoupled's."""
    logp, _, adv, mask, ent, _ = _inputs(6)
    rng = np.random.default_rng(6)
    behaviour = logp - rng.uniform(-0.6, 0.6, logp.shape)  # a stale sampler
    old = logp.copy()  # the proximal policy: the weights being updated, at their first step
    staleness = rng.integers(0, 6, logp.shape)
    base = dict(eps_low=0.2, eps_high=0.28, tis_cap=2.0)

    def run(cfg):
        def f(lp):
            return policy_loss(lp, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32),
                               jnp.asarray(mask, jnp.float32), jnp.asarray(ent, jnp.float32),
                               alpha=0.0, config=cfg, num_tokens=mask.sum(),
                               behaviour_logp_BT=jnp.asarray(behaviour, jnp.float32),
                               staleness_BT=jnp.asarray(staleness))  # fmt: skip

        (loss, m), g = jax.jit(jax.value_and_grad(f, has_aux=True))(jnp.asarray(logp, jnp.float32))
        return float(loss), m, np.asarray(g, np.float64)

    loss0, m0, g0 = run(LossConfig(**base))
    loss1, m1, g1 = run(LossConfig(**base, behaviour_clip=True))
    on = mask > 0
    a = np.broadcast_to(adv[:, None], logp.shape)
    s = np.exp(logp - behaviour)
    past = on & (((a > 0) & (s > 1.28)) | ((a < 0) & (s < 0.8)))
    assert 0 < past.sum() < on.sum()
    w_tis = np.minimum(np.exp(old - behaviour), 2.0)
    np.testing.assert_allclose(g0[on], (-a * w_tis / mask.sum())[on], rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(g1[past], 0.0, atol=1e-12)  # no gradient past the sampler's clip
    np.testing.assert_allclose(g1[on & ~past], g0[on & ~past], rtol=1e-6, atol=1e-10)
    assert loss1 == pytest.approx(loss0)  # the value is decoupled's; only gradients differ
    assert float(m0["clipfrac_high"]) == float(m0["clipfrac_low"]) == 0.0  # never binds
    np.testing.assert_allclose(float(m1["behaviour_clipfrac"]), past.sum() / on.sum(), rtol=1e-6)
    # by staleness: the clip that binds, the behaviour weight, the share past the cap
    bucket = np.minimum(staleness, 4)
    for k in range(5):
        sel = on & (bucket == k)
        n = float(m1["stale_tokens"][k]) * mask.sum()
        assert n == pytest.approx(sel.sum())
        clipped = float(m1["stale_clipped"][k]) * mask.sum()
        assert clipped == pytest.approx(past[sel].sum()) and float(m0["stale_clipped"][k]) == 0
        weight = float(m1["stale_weight"][k]) * mask.sum()
        assert weight == pytest.approx(w_tis[sel].sum(), rel=1e-5)
        capped = float(m1["stale_capped"][k]) * mask.sum()
        assert capped == pytest.approx((np.exp(old - behaviour) > 2.0)[sel].sum())


def test_dual_clip_bounds_negative_advantage_loss():
    logp, old, adv, mask, ent, ref = _inputs(1)
    old[:] = logp - np.log(5.0)  # ratio 5 everywhere
    plain = LossConfig()
    dual = LossConfig(dual_clip=3.0)
    l_plain, m_plain, _ = _run(plain, logp, old, adv, mask, ent, ref, 0.0)
    l_dual, m_dual, _ = _run(dual, logp, old, adv, mask, ent, ref, 0.0)
    assert l_dual < l_plain
    neg_tokens = (mask * (adv < 0)[:, None]).sum() / mask.sum()
    np.testing.assert_allclose(float(m_dual["clipfrac_dual"]), neg_tokens, rtol=1e-6)
    assert float(m_plain["clipfrac_dual"]) == 0.0


def test_metrics_match_numpy():
    logp, old, adv, mask, ent, ref = _inputs(2)
    cfg = LossConfig(eps_low=0.2, eps_high=0.28)
    _, m, _ = _run(cfg, logp, old, adv, mask, ent, ref, 0.0)
    rho = np.exp(logp - old)
    on = mask > 0
    a = np.broadcast_to(adv[:, None], rho.shape)
    np.testing.assert_allclose(
        float(m["clipfrac_low"]), ((a < 0) & (rho < 0.8))[on].mean(), rtol=1e-6
    )
    np.testing.assert_allclose(
        float(m["clipfrac_high"]), ((a > 0) & (rho > 1.28))[on].mean(), rtol=1e-6
    )
    np.testing.assert_allclose(float(m["ratio_mean"]), rho[on].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["ratio_max"]), rho[on].max(), rtol=1e-5)
    np.testing.assert_allclose(float(m["entropy"]), ent[on].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["approx_kl"]), (rho - 1 - np.log(rho))[on].mean(), rtol=1e-4)


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "micro-token-mean"]
)
def test_micro_batches_sum_to_full_batch(mode):
    logp, old, adv, mask, ent, ref = _inputs(3)
    cfg = LossConfig(aggregation=mode, eps_high=0.28, kl_beta=0.05)
    full, _, g_full = _run(cfg, logp, old, adv, mask, ent, ref, 0.01)
    parts = [
        _run(cfg, logp, old, adv, mask, ent, ref, 0.01, rows=slice(i, i + 2), counts_from=mask)
        for i in (0, 2, 4)
    ]
    micro = sum(p[0] for p in parts)
    g_micro = [np.concatenate([p[2][k] for p in parts]) for k in range(2)]
    if mode == "micro-token-mean":
        # the reference code's normalisation depends on the split: check its own formula
        want = 0.0
        for i in (0, 2, 4):
            term, _, _ = _ref_terms(
                logp[i : i + 2],
                old[i : i + 2],
                adv[i : i + 2],
                mask[i : i + 2],
                ent[i : i + 2],
                ref[i : i + 2],
                0.01,
                cfg,
            )
            m = mask[i : i + 2]
            want += (term * m).sum() / max(m.sum(), 1) * (m.sum(1) > 0).sum() / NOMINAL
        np.testing.assert_allclose(micro, want, rtol=1e-5)
        assert abs(micro - full) > 1e-4
        return
    assert_fp32_close(micro, full, terms=B * T)
    for gm, gf in zip(g_micro, g_full):
        assert_fp32_close(gm, gf, terms=B * T)


def test_on_policy_gradient_is_advantage_weighted_logprob_gradient():
    """rho == 1, no clipping: grad L == grad of -(1/T_k) sum A logp (hidden and unembedding)."""
    rng = np.random.default_rng(4)
    d, v = 16, 40
    h = jnp.asarray(rng.normal(size=(B, T, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)) / 4, jnp.float32)
    tgt = jnp.asarray(rng.integers(0, v, (B, T)))
    adv = jnp.asarray(rng.normal(size=B), jnp.float32)
    mask = jnp.asarray(rng.random((B, T)) < 0.8, jnp.float32)
    n = mask.sum()
    cfg = LossConfig()

    def magic(h, w):
        logp, ent = token_logprobs_and_entropy(h, w, tgt, chunk_size=5)
        old = jax.lax.stop_gradient(logp)
        return policy_loss(logp, old, adv, mask, ent, alpha=0.0, config=cfg, num_tokens=n)[0]

    def pg(h, w):
        logp, _ = token_logprobs_and_entropy(h, w, tgt, chunk_size=5)
        return -jnp.sum(adv[:, None] * logp * mask) / n

    g1 = jax.grad(magic, argnums=(0, 1))(h, w)
    g2 = jax.grad(pg, argnums=(0, 1))(h, w)
    assert float(jnp.abs(g2[1]).max()) > 1e-3
    # the two losses reach the same gradient through other sums (B x T tokens, V logits)
    assert_fp32_close(list(g1), list(g2), terms=B * T * v)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="eps_low"):
        LossConfig(eps_low=1.5)
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=0.5)
    with pytest.raises(ValueError):
        LossConfig(aggregation="per-token")
    with pytest.raises(ValueError, match="tis_rule"):
        LossConfig(tis_cap=2.0, tis_rule="drop")
    with pytest.raises(ValueError, match="behaviour_clip needs tis_cap"):
        LossConfig(behaviour_clip=True)
    with pytest.raises(ValueError, match="ref_logp_BT"):
        z = jnp.zeros((1, 2))
        policy_loss(
            z, z, jnp.zeros(1), z, z, alpha=0.0, config=LossConfig(kl_beta=0.1), num_tokens=1.0
        )


@pytest.mark.parametrize("scale", [1.0, 140.0, 1000.0])
def test_entropy_and_logprobs_stay_accurate_for_large_logits(scale):
    """H and log p against float64, to fp32's rounding of the logits' size (a log-softmax's
    precision): taken as logsumexp(z) - E_p[z], H was off by 4e-3 nats at |z| ~ 140 (8e-2
    at 1000), which this bound catches."""
    from magic_jax.model.logprobs import logprob_entropy_lse

    rng = np.random.default_rng(0)
    z = (rng.standard_normal((16, 4096)) * scale / 4 + scale).astype(np.float32)
    z[:, 0] += scale / 10  # one logit well ahead: a low-entropy row, as a trained policy has
    t = rng.integers(0, 4096, 16)
    logp, ent, lse = jax.jit(logprob_entropy_lse)(jnp.asarray(z), jnp.asarray(t))
    u = z.astype(np.float64) - z.max(-1, keepdims=True)
    log_s = np.log(np.exp(u).sum(-1))
    logq = u - log_s[:, None]
    tol = 2e-6 + 1.2e-7 * float(np.abs(z).max())  # half an ulp of lse, and some
    np.testing.assert_allclose(np.asarray(ent), -(np.exp(logq) * logq).sum(-1), atol=tol)
    np.testing.assert_allclose(np.asarray(logp), logq[np.arange(16), t], atol=tol)
    np.testing.assert_allclose(np.asarray(lse), z.max(-1) + log_s, rtol=1e-6)


def test_kl_clamp_bounds_each_tokens_k3_as_the_reference_code():
    from magic_jax.update.losses import k3_kl

    logp = jnp.asarray([0.0, -1.0, -20.0], jnp.float32)
    ref = jnp.asarray([0.0, -0.5, 0.0], jnp.float32)
    free = np.asarray(k3_kl(logp, ref))
    clamped = np.asarray(k3_kl(logp, ref, 10.0))
    assert free[2] > 1e8 and clamped[2] == 10.0
    np.testing.assert_array_equal(clamped[:2], free[:2])
    g = jax.grad(lambda lp: k3_kl(lp, ref, 10.0).sum())(logp)
    assert float(g[2]) == 0.0 and float(g[1]) != 0.0
    with pytest.raises(ValueError, match="kl_clamp"):
        LossConfig(kl_clamp=0.0)
