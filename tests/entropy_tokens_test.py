"""``entropy.tokens``: the entropy bonus and e_k restricted to chosen token classes."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magic_jax.data.tasks import carry
from magic_jax.jobs import cli
from magic_jax.run.config import ConfigError, load_config
from magic_jax.run.policy import load_tokenizer
from magic_jax.testing import Sample
from magic_jax.update.buffer import pack_rollouts
from magic_jax.update.entropy_control import EntropyControlConfig, measure_entropy
from magic_jax.update.losses import LossConfig, policy_loss
from magic_jax.update.step import micro_batches
from magic_jax.update.token_classes import (
    TokenMask,
    get_token_classes,
    parse_token_selection,
    register_token_classes,
)
from magic_jax.update.updater import buffer_entropy

REPO = Path(__file__).resolve().parents[1]
CARRY = REPO / "configs" / "carry.yaml"
CARRY_MODEL = REPO / "magic_jax" / "assets" / "carry" / "model"
# checks the first column, hurries the second, checks the third; text after the answer
RESPONSE = "9+3=12\n2\n3+4+1=8\n</think>\n\\boxed{822} ok 7"


def _load(value):
    return load_config(CARRY, [f"entropy.tokens={value}"])


def test_the_option_is_checked_when_the_config_loads():
    assert load_config(CARRY).entropy.tokens is None  # default: every response token
    assert _load("carry:choice").entropy.tokens == "carry:choice"
    assert _load("carry:choice+digit").entropy.tokens == "carry:choice+digit"
    unknown = r"entropy\.tokens: unknown token classifier 'nope'; registered: carry"
    with pytest.raises(ConfigError, match=unknown):
        _load("nope:choice")
    wrong = (
        r"entropy\.tokens: unknown class 'choise' of token classifier 'carry'; "
        r"its classes: choice, digit, format, after_answer"
    )
    with pytest.raises(ConfigError, match=wrong):
        _load("carry:choise")
    with pytest.raises(ConfigError, match=r"entropy\.tokens: expected 'classifier:class"):
        _load("carry")
    assert parse_token_selection("carry:choice+after_answer") == (
        "carry",
        frozenset({"choice", "after_answer"}),
    )


def test_a_registered_classifier_can_be_named():
    def vowels(pieces):
        return ["vowel" if p in "aeiou" else "other" for p in pieces]

    register_token_classes("entropy-tokens-test", vowels, ("vowel", "other"))
    register_token_classes("entropy-tokens-test", vowels, ("vowel", "other"))  # same: fine
    assert get_token_classes("entropy-tokens-test") == (vowels, ("vowel", "other"))
    assert EntropyControlConfig(tokens="entropy-tokens-test:vowel").tokens
    with pytest.raises(ValueError, match="already registered"):
        register_token_classes("entropy-tokens-test", vowels, ("vowel",))
    for name, classes in (("carry", ("a",)), ("x:y", ("a",)), ("ok", ()), ("ok", ("a+b",))):
        with pytest.raises(ValueError):
            register_token_classes(name, vowels, classes)
    mask = TokenMask("entropy-tokens-test:vowel", decode=lambda ids: "xa"[ids[0]])
    assert mask(np.array([0, 1, 1, 0])).tolist() == [0, 1, 1, 0]


def test_the_mask_of_a_carry_response_is_its_choice_tokens():
    tok = load_tokenizer(CARRY_MODEL)
    ids = np.asarray(tok.encode(RESPONSE, add_special_tokens=False), np.int32)
    classes = carry.token_classes([tok.decode([i]) for i in ids])
    calls = []

    def decode(i):
        calls.append(i)
        return tok.decode(i)

    mask = TokenMask("carry:choice", decode)
    got = mask(ids)
    assert got.dtype == np.float32
    assert got.tolist() == [float(c == "choice") for c in classes]
    assert got.sum() == 3  # one choice per reasoning line
    assert len(calls) == len(set(ids.tolist()))  # each id decoded once
    mask(ids)
    assert len(calls) == len(set(ids.tolist()))
    both = TokenMask("carry:choice+after_answer", tok.decode)(ids)
    assert both.tolist() == [float(c in ("choice", "after_answer")) for c in classes]

    # packed with the buffer: the mask sits on the response slots, padding is 0, and
    # gathers and micro-batches carry it
    n = len(ids)
    samples = [
        Sample(
            prompt_index=p,
            sample_index=s,
            prompt_tokens=np.array([1, 2], np.int32),
            tokens=ids,
            logprobs=np.full(n, -0.5, np.float32),
            entropies=np.linspace(0.1, 1.0, n, dtype=np.float32),
            truncated=False,
            length=n - s,
        )
        for p in range(2)
        for s in range(2)
    ]
    buf = pack_rollouts(samples, [1, 0, 0, 1], response_bucket=8, entropy_tokens=mask)
    assert buf.entropy_mask.shape == buf.response_mask.shape
    assert buf.entropy_mask[0, :n].tolist() == got.tolist()
    assert buf.entropy_mask[1, : n - 1].tolist() == got[: n - 1].tolist()
    assert not buf.entropy_mask[:, n:].any() and not buf.entropy_mask[1, n - 1]
    assert pack_rollouts(samples, [1, 0, 0, 1], response_bucket=8).entropy_mask is None
    assert np.array_equal(buf.take_groups(np.array([1])).entropy_mask, buf.entropy_mask[2:])
    micro = micro_batches(jax.tree.map(jnp.asarray, buf), 2, None)
    assert micro.entropy_mask.shape == (2, 2, buf.response_len)


def _loss_inputs(seed=0, b=3, t=6):
    k = jax.random.split(jax.random.key(seed), 4)
    logp = -jax.random.uniform(k[0], (b, t), minval=0.1, maxval=2.0)
    old = logp + 0.1 * jax.random.normal(k[1], (b, t))
    adv = jax.random.normal(k[2], (b,))
    mask = (jnp.arange(t)[None, :] < jnp.array([[6], [4], [2]])).astype(jnp.float32)
    ent = jax.random.uniform(k[3], (b, t), minval=0.0, maxval=2.0)
    return logp, old, adv, mask, ent


def test_the_bonus_counts_only_the_selected_tokens():
    logp, old, adv, mask, ent = _loss_inputs()
    cfg = LossConfig(eps_high=0.28)

    def loss(ent_BT, sel_BT=None):
        n = mask.sum()
        kw = dict(alpha=0.3, config=cfg, num_tokens=n, entropy_mask_BT=sel_BT)
        return policy_loss(logp, old, adv, mask, ent_BT, **kw)[0]

    assert np.allclose(loss(ent), loss(ent, jnp.ones_like(ent)), rtol=0, atol=1e-7)
    sel = jnp.asarray(np.random.default_rng(0).random(ent.shape) < 0.5, jnp.float32)
    g = np.asarray(jax.grad(loss)(ent, sel))
    off = np.asarray(sel) == 0
    assert off.any() and np.all(g[off] == 0.0)
    on = (np.asarray(sel) == 1) & (np.asarray(mask) == 1)
    assert on.any() and np.allclose(g[on], -0.3 / float(mask.sum()))
    # the surrogate is untouched: with alpha 0 the mask changes nothing
    same = policy_loss(logp, old, adv, mask, ent, alpha=0.0, config=cfg, num_tokens=mask.sum())
    kw = dict(alpha=0.0, config=cfg, num_tokens=mask.sum(), entropy_mask_BT=sel)
    masked = policy_loss(logp, old, adv, mask, ent, **kw)
    assert float(same[0]) == float(masked[0])


def test_e_k_is_measured_over_the_selected_tokens_of_valid_rows():
    tok = load_tokenizer(CARRY_MODEL)
    ids = np.asarray(tok.encode(RESPONSE, add_special_tokens=False), np.int32)
    n = len(ids)
    ents = np.random.default_rng(1).uniform(0.0, 1.0, (3, n)).astype(np.float32)
    samples = [
        Sample(
            prompt_index=0,
            sample_index=s,
            prompt_tokens=np.array([1], np.int32),
            tokens=ids,
            logprobs=np.full(n, -1.0, np.float32),
            entropies=ents[s],
            truncated=False,
            length=n,
        )
        for s in range(3)
    ]
    mask = TokenMask("carry:choice", tok.decode)
    buf = pack_rollouts(samples, [1, 0, 1], group_size=4, response_bucket=8, entropy_tokens=mask)
    sel = mask(ids).astype(bool)
    default = EntropyControlConfig()
    e_all, figs = buffer_entropy(buf, default)
    assert figs == {"buffer_entropy": e_all}
    assert e_all == pytest.approx(float(ents.mean()))
    e_sel, figs = buffer_entropy(buf, EntropyControlConfig(tokens="carry:choice"))
    assert e_sel == pytest.approx(float(ents[:, sel].mean()))  # the padding row counts for nothing
    assert figs["buffer_entropy"] == e_all and figs["buffer_entropy_selected"] == e_sel
    assert figs["selected_token_fraction"] == pytest.approx(sel.mean())
    m = buf.response_mask * buf.valid[:, None] * buf.entropy_mask
    assert e_sel == pytest.approx(float(measure_entropy(buf.entropies, buf.old_logprobs, m)))
    bare = pack_rollouts(samples, [1, 0, 1], group_size=4, response_bucket=8)
    with pytest.raises(ValueError, match="entropy.tokens is 'carry:choice' but the rollout buffer"):
        buffer_entropy(bare, EntropyControlConfig(tokens="carry:choice"))


@pytest.mark.heavy
def test_a_carry_run_controls_and_records_the_choice_tokens_entropy(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    heldout = (REPO / "magic_jax" / "assets" / "carry" / "heldout.jsonl").read_text()
    (tmp_path / "eval.jsonl").write_text("\n".join(heldout.splitlines()[:4]) + "\n")
    out = tmp_path / "run"
    argv = [
        "train", "configs/carry.yaml",
        "--set", "entropy.tokens=carry:choice", "--set", "entropy.target=0.3",
        "--set", "stages.0.steps=1", "--set", "stages.1.steps=1",
        "--set", "stages.0.prompts_per_step=4", "--set", "stages.0.mini_batch_groups=4",
        "--set", "stages.1.prompts_per_step=4", "--set", "stages.1.mini_batch_groups=4",
        "--set", f"eval.data=[{tmp_path / 'eval.jsonl'}]", "--set", "eval.num_samples=1",
        "--set", "rewards.num_workers=1", "--set", "export_hf=false",
        "--set", f"output_dir={out}",
    ]  # fmt: skip
    assert cli.main(argv) == 0, capsys.readouterr().err[-2000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert 0 < r["selected_token_fraction"] < 1
        # the base's choice tokens hold about 0.5 nats, its tokens on average under 0.1: the
        # controller follows the choices' entropy (over target), so its coefficient stays 0
        assert r["entropy"] < 0.3 < r["entropy_selected"], r
        assert r["entropy_coef_next"] == 0.0 and r["alpha"] == 0.0
