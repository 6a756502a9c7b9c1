"""Chunked log-probs/entropy against NumPy and the unchunked path; memory bound; controller."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import token_logprobs_and_entropy_naive

from magic_jax.model.logprobs import token_logprobs_and_entropy
from magic_jax.update.entropy_control import (
    EntropyControlConfig,
    EntropyControlState,
    EntropyEstimator,
    entropy_coefficient,
    init_entropy_control,
    measure_entropy,
    update_entropy_control,
)


def _np_logp_entropy(h, w, tgt, temperature):
    z = (h.astype(np.float64) @ w.astype(np.float64)) / temperature
    z = z - z.max(-1, keepdims=True)
    logq = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p = np.exp(logq)
    return np.take_along_axis(logq, tgt[..., None], -1)[..., 0], -(p * logq).sum(-1)


def _case(b=2, t=13, d=8, v=50, seed=0):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(b, t, d)).astype(np.float32)
    w = (rng.normal(size=(d, v)) / 2).astype(np.float32)
    tgt = rng.integers(0, v, (b, t)).astype(np.int32)
    return h, w, tgt


@pytest.mark.parametrize("chunk, temperature", [(4, 1.0), (13, 0.6), (5, 1.3), (64, 1.0)])
def test_chunked_matches_numpy(chunk, temperature):
    h, w, tgt = _case()
    logp, ent = jax.jit(
        lambda h, w, t: token_logprobs_and_entropy(
            h, w, t, temperature=temperature, chunk_size=chunk
        )
    )(h, w, tgt)
    ref_logp, ref_ent = _np_logp_entropy(h, w, tgt, temperature)
    np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, rtol=1e-5, atol=1e-5)


# 4: six chunks, recomputed in the backward pass; 32: one chunk, its logits kept
@pytest.mark.parametrize("chunk", [4, 32])
def test_chunked_grads_equal_unchunked(chunk):
    h, w, tgt = _case(t=21, seed=1)
    rng = np.random.default_rng(2)
    a_BT, b_BT = rng.normal(size=(2, 2, 21)).astype(np.float32)

    def loss(fn, **kw):
        def f(h, w):
            logp, ent = fn(h, w, tgt, temperature=0.8, **kw)
            return jnp.sum(a_BT * logp + b_BT * ent)

        return jax.jit(jax.grad(f, argnums=(0, 1)))(h, w)

    chunked = loss(token_logprobs_and_entropy, chunk_size=chunk)
    naive = loss(token_logprobs_and_entropy_naive)
    assert float(jnp.abs(naive[1]).max()) > 1e-2
    for c, n in zip(chunked, naive):
        np.testing.assert_allclose(c, n, rtol=1e-5, atol=1e-6)


def test_bf16_compute_close_to_fp32():
    h, w, tgt = _case(t=16, d=32, v=64, seed=3)
    logp32, ent32 = token_logprobs_and_entropy(h, w, tgt, chunk_size=8)
    logp16, ent16 = token_logprobs_and_entropy(h, w, tgt, chunk_size=8, compute_dtype="bfloat16")
    assert logp16.dtype == jnp.float32 and ent16.dtype == jnp.float32
    # bf16 inputs carry ~3 significant digits; |logits| here are O(10)
    np.testing.assert_allclose(logp16, logp32, atol=0.15)
    np.testing.assert_allclose(ent16, ent32, atol=0.15)


def _peak_bytes(fn, *shapes):
    compiled = jax.jit(fn).lower(*shapes).compile()
    m = compiled.memory_analysis()
    return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes


def _grad_fn(impl, **kw):
    def loss(h, w, t):
        logp, ent = impl(h, w, t, **kw)
        return jnp.sum(logp) + 0.01 * jnp.sum(ent)

    return jax.grad(loss, argnums=(0, 1))


def test_7b_shape_at_32k_compiles_with_memory_bounded_by_the_chunk():
    """D 3584, V 152064, T 32768, forward+backward: compiled only, nothing allocated."""
    d, v, t, c = 3584, 152064, 32768, 1024
    h = jax.ShapeDtypeStruct((1, t, d), jnp.float32)
    w = jax.ShapeDtypeStruct((d, v), jnp.float32)
    tgt = jax.ShapeDtypeStruct((1, t), jnp.int32)
    m = jax.jit(_grad_fn(token_logprobs_and_entropy, chunk_size=c)).lower(h, w, tgt).compile()
    stats = m.memory_analysis()
    io = stats.argument_size_in_bytes + stats.output_size_in_bytes
    full_logits = t * v * 4
    chunk_logits = c * v * 4
    # the [D, V] gradient accumulator plus a few [C, V] fp32 buffers, far from one [T, V]
    assert stats.temp_size_in_bytes < d * v * 4 + 4 * chunk_logits, stats
    assert stats.temp_size_in_bytes < full_logits / 4, stats
    assert io < 2.5 * (d * v * 4 + t * d * 4) + t * 8 * 2, stats


def test_chunked_memory_does_not_grow_with_sequence_length():
    d, v, c = 64, 8192, 256
    temps = []
    for t in (2048, 8192):
        shapes = (
            jax.ShapeDtypeStruct((1, t, d), jnp.float32),
            jax.ShapeDtypeStruct((d, v), jnp.float32),
            jax.ShapeDtypeStruct((1, t), jnp.int32),
        )
        m = jax.jit(_grad_fn(token_logprobs_and_entropy, chunk_size=c)).lower(*shapes).compile()
        temps.append(m.memory_analysis().temp_size_in_bytes)
        naive = jax.jit(_grad_fn(token_logprobs_and_entropy_naive)).lower(*shapes).compile()
        assert naive.memory_analysis().temp_size_in_bytes > t * v * 4
    # the chunked temp grows only by O(T) per-token vectors, not O(T * V)
    assert temps[1] - temps[0] < (8192 - 2048) * v * 4 / 20, temps


# --------------------------------------------------------------------------- controller


def _reference_controller(entropies, target, delta, gate, max_coef=None):
    """SPEC item 5, written out: returns the alpha used at each step and the c after it."""
    c, alphas, coefs = 0.0, [], []
    for e in entropies:
        on = e <= target if gate == "<=" else e < target
        alphas.append(c if on else 0.0)
        if e < target:
            c += delta
        elif e > target:
            c -= delta
        c = max(c, 0.0)
        if max_coef is not None:
            c = min(c, max_coef)
        coefs.append(c)
    return np.array(alphas), np.array(coefs)


SCRIPT = [0.5, 0.3, 0.2, 0.15, 0.1, 0.12, 0.2, 0.25, 0.19, 0.18, 0.3, 0.4, 0.5, 0.05, 0.2]


@pytest.mark.parametrize(
    "cfg",
    [
        EntropyControlConfig(),
        EntropyControlConfig(gate="<"),
        EntropyControlConfig(delta=0.002, max_coef=0.005),
        # the public code's variant: delta 1e-4 clamped to [0, 5e-3], gate '<', sampled NLL
        EntropyControlConfig(
            delta=1e-4, max_coef=5e-3, gate="<", estimator=EntropyEstimator.SAMPLED_NLL
        ),
    ],
)
def test_controller_follows_spec_on_scripted_entropies(cfg):
    state = init_entropy_control(cfg)
    step = jax.jit(lambda s, e: (entropy_coefficient(s, e, cfg), update_entropy_control(s, e, cfg)))
    alphas, coefs = [], []
    for e in SCRIPT:
        a, state = step(state, jnp.float32(e))
        alphas.append(float(a))
        coefs.append(float(state.coef))
    ref_a, ref_c = _reference_controller(
        np.float32(SCRIPT), np.float32(cfg.target), cfg.delta, cfg.gate, cfg.max_coef
    )
    np.testing.assert_allclose(alphas, ref_a, atol=1e-7)
    np.testing.assert_allclose(coefs, ref_c, atol=1e-7)
    assert max(alphas) > 0
    assert int(state.num_updates) == len(SCRIPT)


def test_gate_at_exactly_the_target():
    cfg_le, cfg_lt = EntropyControlConfig(), EntropyControlConfig(gate="<")
    s = EntropyControlState(coef=jnp.float32(0.01), num_updates=jnp.int32(0))
    e = jnp.float32(cfg_le.target)
    assert float(entropy_coefficient(s, e, cfg_le)) == pytest.approx(0.01)
    assert float(entropy_coefficient(s, e, cfg_lt)) == 0.0
    assert float(update_entropy_control(s, e, cfg_le).coef) == pytest.approx(0.01)


def test_fixed_mode_is_constant():
    cfg = EntropyControlConfig(mode="fixed", init_coef=0.002)
    s = init_entropy_control(cfg)
    for e in (0.0, 1.0):
        assert float(entropy_coefficient(s, jnp.float32(e), cfg)) == pytest.approx(0.002)
        assert float(update_entropy_control(s, jnp.float32(e), cfg).coef) == pytest.approx(0.002)


def test_measure_entropy_estimators():
    ent = np.array([[0.5, 1.0, 9.0]], np.float32)
    logp = np.array([[-0.2, -0.4, -9.0]], np.float32)
    mask = np.array([[1, 1, 0]], np.float32)
    assert float(measure_entropy(ent, logp, mask, "full")) == pytest.approx(0.75)
    assert float(measure_entropy(ent, logp, mask, "sampled-nll")) == pytest.approx(0.3)


def test_controller_state_survives_orbax(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")  # the [model] extra; the core has none
    cfg = EntropyControlConfig()
    s = init_entropy_control(cfg)
    for e in (0.1, 0.1, 0.1):
        s = update_entropy_control(s, jnp.float32(e), cfg)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ctl", s)
    ckpt.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, s)
    restored = ckpt.restore(tmp_path / "ctl", abstract)
    assert isinstance(restored, EntropyControlState)
    assert float(restored.coef) == pytest.approx(0.015)
    assert int(restored.num_updates) == 3
    # carries on from where it stopped
    nxt = update_entropy_control(restored, jnp.float32(0.1), cfg)
    assert float(nxt.coef) == pytest.approx(0.02)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="gate"):
        EntropyControlConfig(gate="<<")
    with pytest.raises(ValueError, match="delta"):
        EntropyControlConfig(delta=-1.0)
    with pytest.raises(ValueError, match="max_coef"):
        EntropyControlConfig(init_coef=0.1, max_coef=0.01)


class _OriginalEntController:
    """Skywork-OR1's ``EntController`` (verl/trainer/ppo/core_algos.py of its verl fork,
    Apache License 2.0, Copyright the Skywork-OR1 authors), transcribed line for line with
    how its trainer uses it (ray_trainer.py): the actor trains step k with ``value`` and
    ``entropy_loss_enabled`` as they stand, then ``update(e_k)`` runs after the step."""

    def __init__(self, init_ent_coef, max_ent_coef, min_ent_coef, delta_ent_coef, target_ent):
        self.value = init_ent_coef
        self.max_value = max_ent_coef
        self.min_value = min_ent_coef
        self.delta_ent_coef = delta_ent_coef
        self.target_ent = target_ent
        self.entropy_loss_enabled = 1

    def update(self, current_ent):
        if current_ent < self.target_ent:
            self.value += self.delta_ent_coef
        else:
            self.value -= self.delta_ent_coef
        self.value = float(np.clip(self.value, self.min_value, self.max_value))
        self.entropy_loss_enabled = int(current_ent < self.target_ent)


# entropies around the target 0.25 (exact in float32 and float64) with ties, runs below the
# target long enough to reach the 5e-3 cap, and runs above it long enough to reach 0
_TIES = [0.25, 0.125, 0.25, 0.125, 0.125, 0.5, 0.25, 0.25] + [0.125] * 60 + [0.25, 0.375]
_TIES += [0.25] * 5 + [0.125, 0.25, 0.125] + [0.5] * 55 + [0.125, 0.25]


def test_reference_code_gate_reproduces_the_original_controller_with_ties():
    cfg = EntropyControlConfig(
        target=0.25, delta=1e-4, max_coef=5e-3, gate="reference-code", estimator="sampled-nll"
    )
    state = init_entropy_control(cfg)
    original = _OriginalEntController(0.0, 5e-3, 0.0, 1e-4, 0.25)
    ours, theirs, states = [], [], []
    for e in _TIES:
        # the bonus weight of step k, then the controller moves on e_k
        theirs.append(
            (original.value * original.entropy_loss_enabled, original.entropy_loss_enabled)
        )
        original.update(e)
        alpha = entropy_coefficient(state, jnp.float32(e), cfg)
        state = update_entropy_control(state, np.float32(e), cfg)
        states.append(state)
        ours.append((float(alpha), int(float(state.switch))))
        theirs[-1] += (original.value,)
        ours[-1] += (float(state.coef),)
    a_ours, a_theirs = np.array([o[0] for o in ours]), np.array([t[0] for t in theirs])
    c_ours, c_theirs = np.array([o[2] for o in ours]), np.array([t[2] for t in theirs])
    # the switch is the original's at every step (lagged one step, on at the first)
    np.testing.assert_array_equal([o[1] for o in ours], [int(e < 0.25) for e in _TIES])
    np.testing.assert_array_equal(a_ours > 0, a_theirs > 0)
    # the coefficient to the last bit: the float64 the original holds, and the float32 weight
    # a float32 loss multiplies by
    c64 = np.array([float(np.asarray(s.coef64).view(np.float64)[0]) for s in states])
    np.testing.assert_array_equal(c64, c_theirs)
    np.testing.assert_array_equal(c_ours, c_theirs.astype(np.float32))
    np.testing.assert_array_equal(a_ours, a_theirs.astype(np.float32))
    assert c_theirs.max() == 5e-3 and c_theirs.min() == 0.0  # cap and floor both hit
    # the differences from the default gate are real on this sequence
    default = EntropyControlConfig(target=0.25, delta=1e-4, max_coef=5e-3)
    s, alphas = init_entropy_control(default), []
    for e in _TIES:
        alphas.append(float(entropy_coefficient(s, jnp.float32(e), default)))
        s = update_entropy_control(s, jnp.float32(e), default)
    assert not np.allclose(alphas, a_theirs)


def test_reference_code_switch_lags_one_step_and_ties_lower_the_coefficient():
    cfg = EntropyControlConfig(target=0.25, delta=0.01, gate="reference-code", init_coef=0.02)
    s = init_entropy_control(cfg)
    assert float(s.switch) == 1.0
    # step 0: switch on from the start whatever e_0 is; e_0 above the target
    assert float(entropy_coefficient(s, jnp.float32(0.5), cfg)) == pytest.approx(0.02)
    s = update_entropy_control(s, jnp.float32(0.5), cfg)
    # step 1: switched off by e_0, though e_1 is below the target
    assert float(entropy_coefficient(s, jnp.float32(0.125), cfg)) == 0.0
    s = update_entropy_control(s, jnp.float32(0.125), cfg)
    assert float(s.coef) == pytest.approx(0.02) and float(s.switch) == 1.0
    # a tie lowers the coefficient and switches the bonus off for the next step
    s = update_entropy_control(s, jnp.float32(0.25), cfg)
    assert float(s.coef) == pytest.approx(0.01) and float(s.switch) == 0.0
    # other gates keep no switch, so their state (and checkpoints) are as before
    assert init_entropy_control(EntropyControlConfig()).switch is None
    with pytest.raises(ValueError, match="lagged switch"):
        entropy_coefficient(init_entropy_control(EntropyControlConfig()), jnp.float32(0.1), cfg)
    with pytest.raises(ValueError, match="gate"):
        EntropyControlConfig(gate="<<")


def test_reference_code_controller_state_survives_orbax(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    cfg = EntropyControlConfig(gate="reference-code")
    s = update_entropy_control(init_entropy_control(cfg), jnp.float32(0.5), cfg)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ctl", s)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "ctl", jax.tree.map(ocp.utils.to_shape_dtype_struct, s))
    assert float(restored.switch) == 0.0 and int(restored.num_updates) == 1
