"""Tests for magic_jax.rollout.sampling against NumPy references and sampled frequencies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from magic_jax.rollout import sampling
from magic_jax.rollout.sampling import SamplingConfig


def _np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _np_keep(z, top_k, top_p):
    """Reference truncation by sorting (top-k, then top-p on the renormalised rest)."""
    keep = np.ones_like(z, bool)
    for b in range(z.shape[0]):
        order = np.argsort(-z[b], kind="stable")
        if top_k:
            keep[b, order[top_k:]] = False
        p = np.where(keep[b], np.exp(z[b] - z[b].max()), 0.0)
        p = p / p.sum()
        before = np.cumsum(p[order]) - p[order]  # mass strictly more probable
        drop = before >= top_p
        keep[b, order[drop]] = False
    return keep


def _frequencies(logits_V, config, n, seed=0):
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(jnp.arange(n))
    logits = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (n, len(logits_V)))
    out = jax.jit(sampling.draw, static_argnums=2)(logits, keys, config)
    return out, np.bincount(np.asarray(out.tokens), minlength=len(logits_V))


def test_logprobs_and_entropy_match_numpy():
    z = np.random.default_rng(0).normal(size=(4, 1000)).astype(np.float32) * 3
    tok = np.array([0, 5, 999, 17])
    logp, ent = sampling.logprobs_and_entropy(jnp.asarray(z), jnp.asarray(tok), 0.7)
    ls = _np_log_softmax(z.astype(np.float64) / 0.7)
    np.testing.assert_allclose(logp, ls[np.arange(4), tok], atol=1e-5)
    np.testing.assert_allclose(ent, -(np.exp(ls) * ls).sum(-1), atol=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_frequencies_match_distribution(temperature):
    logits = np.log(np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02]))
    n = 40_000
    out, counts = _frequencies(logits, SamplingConfig(temperature=temperature), n)
    p = np.exp(_np_log_softmax(logits / temperature))
    assert stats.chisquare(counts, n * p).pvalue > 1e-3
    np.testing.assert_allclose(out.logprobs, np.log(p)[np.asarray(out.tokens)], atol=1e-5)
    np.testing.assert_allclose(out.entropies, -(p * np.log(p)).sum(), atol=1e-5)
    np.testing.assert_array_equal(out.sampling_logprobs, out.logprobs)


def test_biased_sampler_would_fail_chi_square():
    # The statistical test has power: frequencies of a slightly different
    # distribution are rejected at the same sample size.
    logits = np.log(np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02]))
    n = 40_000
    _, counts = _frequencies(logits, SamplingConfig(), n)
    q = np.array([0.28, 0.22, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    assert stats.chisquare(counts, n * q).pvalue < 1e-3


def test_top_p_truncates_and_renormalises():
    p = np.array([0.4, 0.3, 0.2, 0.1])
    n = 30_000
    out, counts = _frequencies(np.log(p), SamplingConfig(top_p=0.75), n)
    assert counts[3] == 0  # 0.4 + 0.3 + 0.2 >= 0.75 is reached before the last token
    q = p[:3] / p[:3].sum()
    assert stats.chisquare(counts[:3], n * q).pvalue > 1e-3
    tok = np.asarray(out.tokens)
    np.testing.assert_allclose(out.logprobs, np.log(p)[tok], atol=1e-5)
    np.testing.assert_allclose(out.sampling_logprobs, np.log(q)[tok], atol=1e-5)


def test_top_k_truncates():
    p = np.array([0.1, 0.4, 0.2, 0.3])
    _, counts = _frequencies(np.log(p), SamplingConfig(top_k=2), 20_000)
    assert counts[0] == 0 and counts[2] == 0
    assert stats.chisquare(counts[[1, 3]], 20_000 * np.array([4, 3]) / 7).pvalue > 1e-3


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (0, 0.3), (50, 1.0), (20, 0.8), (1, 1.0)])
def test_truncate_matches_sorting_reference(top_k, top_p):
    z = np.random.default_rng(1).normal(size=(6, 1000)).astype(np.float32) * 2
    got = np.isfinite(np.asarray(sampling.truncate(jnp.asarray(z), top_k=top_k, top_p=top_p)))
    np.testing.assert_array_equal(got, _np_keep(z, top_k, top_p))


def test_greedy_is_argmax_and_ignores_keys():
    z = np.random.default_rng(2).normal(size=(5, 300)).astype(np.float32)
    keys = jax.random.split(jax.random.key(0), 5)
    out = sampling.draw(jnp.asarray(z), keys, SamplingConfig(greedy=True, temperature=0.5))
    np.testing.assert_array_equal(out.tokens, z.argmax(-1))
    ls = _np_log_softmax(z / 0.5)
    np.testing.assert_allclose(out.logprobs, ls[np.arange(5), z.argmax(-1)], atol=1e-5)


def test_sample_key_is_fold_in_chain():
    a = sampling.sample_key(3, 1, 2, 4)
    b = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(jax.random.key(3), 1), 2), 4)
    np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))


@pytest.mark.parametrize(
    "kwargs,field",
    [({"temperature": 0.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -1}, "top_k")],
)
def test_config_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**kwargs)


def test_shorthand_resolves_to_the_builtin_methods():
    assert SamplingConfig().strategy == sampling.Full()
    assert SamplingConfig(greedy=True, top_p=0.5).strategy == sampling.Greedy()
    assert SamplingConfig(top_k=5, top_p=0.9).strategy == sampling.TopKTopP(5, 0.9)
    assert SamplingConfig(method="top-k-top-p", options={"top_k": 5}).strategy == (
        sampling.TopKTopP(5, 1.0)
    )
    # equal configs hash equal (a static argument of the decode step), options included
    a = SamplingConfig(method="top-k-top-p", options={"top_k": 5})
    b = SamplingConfig(method="top-k-top-p", options={"top_k": 5})
    c = SamplingConfig(method="top-k-top-p", options={"top_k": 6})
    assert a == b and hash(a) == hash(b) and a != c
    assert all(isinstance(m(), sampling.SamplingMethod) for m in (sampling.Full, sampling.Greedy))


def test_greedy_restriction_is_the_fast_paths_token():
    z = np.random.default_rng(4).normal(size=(4, 300)).astype(np.float32)
    z[0, 7] = z[0, 9] = z[0].max() + 1  # a tie: the first
    kept = np.asarray(sampling.Greedy().restrict(jnp.asarray(z)))
    assert (np.isfinite(kept).sum(-1) == 1).all()
    np.testing.assert_array_equal(np.isfinite(kept).argmax(-1), z.argmax(-1))
    assert z.argmax(-1)[0] == 7


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"method": "min-q"}, r"method: unknown sampling method 'min-q'; registered: full, "),
        ({"method": "top-k-top-p", "top_p": 0.9}, r"method: 'top-k-top-p' is named, so greedy"),
        ({"method": "top-k-top-p", "options": {"k": 3}}, r"options: sampling method 'top-k-top"),
        ({"method": "top-k-top-p", "options": {"top_p": 2.0}}, r"options: .*top_p must be in"),
        ({"options": {"p": 0.1}}, r"options: \{'p': 0.1\} given but no sampling method named"),
    ],
)
def test_a_bad_method_or_options_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_registering_a_method_checks_its_name_and_shape():
    with pytest.raises(ValueError, match="'greedy' is empty or built in"):
        sampling.register_sampling("greedy", sampling.Full)
    with pytest.raises(ValueError, match="not a class with restrict"):
        sampling.register_sampling("x-none", object)

    class Loose:  # not frozen: unhashable
        __hash__ = None

        def restrict(self, z_BV):
            return z_BV[:, :3]

    sampling.register_sampling("x-loose", Loose, replace=True)
    with pytest.raises(ValueError, match="method: 'x-loose' builds an unhashable Loose"):
        SamplingConfig(method="x-loose")
    Loose.__hash__ = object.__hash__
    bad = SamplingConfig(method="x-loose")
    keys = jax.random.split(jax.random.key(0), 2)
    with pytest.raises(ValueError, match=r"sampling method Loose: restrict gave \(2, 3\), not"):
        sampling.draw(jnp.zeros((2, 10)), keys, bad)
