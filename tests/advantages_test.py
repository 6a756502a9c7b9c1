"""Group advantages, truncation masks and rejection sampling against a NumPy reference."""

import jax
import numpy as np
import pytest

from magic_jax.update.advantages import (
    TruncationMask,
    count_loss_tokens,
    group_advantages,
    group_keep_mask,
)


def _reference(rewards, truncated, mode, eps=1e-6):
    """Loop-per-group NumPy version of SPEC items 1 and 3."""
    n, g = rewards.shape
    out = np.zeros((n, g))
    for i in range(n):
        stat = [j for j in range(g) if not (mode == "before" and truncated[i, j])]
        if mode == "before" and len(stat) <= 1:
            continue
        vals = rewards[i, stat].astype(np.float64)
        if len(vals) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = vals.mean(), vals.std(ddof=1)
        for j in range(g):
            if mode != "none" and truncated[i, j]:
                continue
            out[i, j] = (rewards[i, j] - mean) / (std + eps)
    return out


@pytest.mark.parametrize(
    "k, pos, neg",
    [(1, 3.749985, -0.249999), (4, 1.677047, -0.559016), (8, 0.968244, -0.968244)],
)
def test_spec_reference_values_group_of_16(k, pos, neg):
    r = np.zeros((1, 16), np.float32)
    r[0, :k] = 1
    adv = np.asarray(group_advantages(r))
    np.testing.assert_allclose(adv[0, :k], pos, atol=2e-6)
    np.testing.assert_allclose(adv[0, k:], neg, atol=2e-6)


def test_group_of_one_uses_mean_zero_std_one():
    adv = np.asarray(group_advantages(np.array([[1.0], [0.0]], np.float32)))
    np.testing.assert_allclose(adv[:, 0], [1.0 / (1.0 + 1e-6), 0.0], rtol=1e-7)


@pytest.mark.parametrize("mode", ["none", "before", "after"])
def test_random_groups_match_reference(mode):
    rng = np.random.default_rng(0)
    r = (rng.random((64, 8)) < 0.4).astype(np.float32)
    trunc = rng.random((64, 8)) < 0.3
    r[trunc] = 0.0  # truncated responses have no answer
    # a few crafted groups: all truncated, one untruncated, all correct
    trunc[0] = True
    trunc[1] = [True] * 7 + [False]
    r[1, 7] = 1.0
    r[2], trunc[2] = 1.0, False
    got = np.asarray(group_advantages(r, trunc, mask=mode))
    np.testing.assert_allclose(got, _reference(r, trunc, mode), rtol=1e-6, atol=1e-6)


def test_masks_differ_as_specified():
    r = np.array([[1, 0, 0, 0]], np.float32)
    trunc = np.array([[False, False, True, True]])
    none = np.asarray(group_advantages(r, trunc, mask="none"))
    before = np.asarray(group_advantages(r, trunc, mask="before"))
    after = np.asarray(group_advantages(r, trunc, mask="after"))
    assert none[0, 2] < 0 and before[0, 2] == 0 and after[0, 2] == 0
    # before: statistics of {1, 0} only; after: of {1, 0, 0, 0}
    np.testing.assert_allclose(
        before[0, :2], [0.5 / (np.std([1, 0], ddof=1) + 1e-6)] * np.array([1, -1]), rtol=1e-6
    )
    np.testing.assert_allclose(after[0, 0], 0.75 / (np.std([1, 0, 0, 0], ddof=1) + 1e-6), rtol=1e-6)


def test_padding_slots_are_left_out():
    r = np.array([[1, 0, 0, 5]], np.float32)
    valid = np.array([[True, True, True, False]])
    got = np.asarray(group_advantages(r, valid_NG=valid))
    np.testing.assert_allclose(
        got[:, :3], _reference(r[:, :3], np.zeros((1, 3), bool), "none"), rtol=1e-6
    )
    assert got[0, 3] == 0


def test_keep_mask_drops_all_zero_groups():
    r = np.array([[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]], np.float32)
    trunc = np.array([[False] * 4, [False] * 4, [False] * 4, [False, True, True, True]])
    keep = np.asarray(group_keep_mask(group_advantages(r, trunc, mask="none")))
    assert keep.tolist() == [False, False, True, True]
    # before: group 3 has one untruncated response -> A = 0 -> dropped
    keep = np.asarray(group_keep_mask(group_advantages(r, trunc, mask="before")))
    assert keep.tolist() == [False, False, True, False]


def test_jit_static_shapes_and_token_count():
    f = jax.jit(group_advantages, static_argnames=("mask", "eps", "ddof"))
    r = np.array([[1, 0], [1, 1]], np.float32)
    adv = f(r, np.zeros_like(r, bool), mask=TruncationMask.AFTER)
    keep_N = group_keep_mask(adv)
    assert adv.shape == (2, 2) and keep_N.shape == (2,)
    resp_BR = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]], np.float32)
    keep_B = np.repeat(np.asarray(keep_N), 2)
    assert float(count_loss_tokens(resp_BR, keep_B)) == 3.0
