"""Extending from outside the package (docs/extending.md): a fractional reward, an
advantage estimator, a decode attention and a sampling method, registered by name and
named in a short training run's config, each seen at work there.

Only public names are imported. The module's top level stays free of JAX: the verifier
workers import the reward from it (``extension_test:digit_share``).
"""

import contextlib
import dataclasses
import json

import numpy as np
import pytest
import yaml

import magic_jax

# --------------------------------------------------------------------------- the extensions


def digit_share(response: str, ground_truth) -> float:
    """Partial credit: the share of the response's characters that are the gold digit."""
    gold = str(ground_truth).strip()
    return response.count(gold) / len(response) if response else 0.0


def slow_score(response: str, ground_truth) -> float:
    import time

    time.sleep(60)
    return 1.0


def nan_score(response: str, ground_truth) -> float:
    return float("nan")


def too_much(response: str, ground_truth) -> float:
    return 1.5


RLOO_CALLS: list[tuple[np.ndarray, np.ndarray]] = []


def rloo(rewards_NG, truncated_NG, valid_NG, config):
    """REINFORCE leave-one-out: each reward minus the mean of the others in its group."""
    g = rewards_NG.shape[1]
    adv_NG = rewards_NG - (rewards_NG.sum(axis=1, keepdims=True) - rewards_NG) / (g - 1)
    RLOO_CALLS.append((np.array(rewards_NG), np.array(adv_NG)))
    return adv_NG


NAIVE_TRACES: list[tuple] = []


def naive_attention(q_BKGH, k_BSKH, v_BSKH, allowed_BS):
    """Every score in float32, masked, softmaxed: the textbook decode attention."""
    import jax
    import jax.numpy as jnp

    NAIVE_TRACES.append(q_BKGH.shape)  # once per trace of the decode programs
    f32 = jnp.float32
    s_BKGS = jnp.einsum("bkgh,bskh->bkgs", q_BKGH.astype(f32), k_BSKH.astype(f32))
    s_BKGS = s_BKGS / jnp.sqrt(f32(q_BKGH.shape[-1]))
    s_BKGS = jnp.where(allowed_BS[:, None, None, :], s_BKGS, -jnp.inf)
    return jnp.einsum("bkgs,bskh->bkgh", jax.nn.softmax(s_BKGS, axis=-1), v_BSKH.astype(f32))


MINP_TRACES: list[tuple] = []
RUN_LOG: list[str] = []  # the fixture run's log lines


@dataclasses.dataclass(frozen=True)
class MinP:
    """min-p sampling: keeps the tokens at least ``p`` times as probable as the likeliest."""

    p: float = 0.1

    def __post_init__(self):
        if not 0 <= self.p <= 1:
            raise ValueError(f"p must be in [0, 1], got {self.p}")

    def restrict(self, z_BV):
        import jax.numpy as jnp

        MINP_TRACES.append(z_BV.shape)  # once per trace of the decode programs
        floor_B1 = jnp.max(z_BV, axis=-1, keepdims=True) + jnp.log(self.p)
        return jnp.where(z_BV >= floor_B1, z_BV, -jnp.inf)


@pytest.fixture(scope="module")
def registered():
    magic_jax.register_reward("digit-share", digit_share, deadline_s=20.0)
    magic_jax.register_reward("slow", slow_score, deadline_s=1.0)
    magic_jax.register_reward("nan-score", nan_score)
    magic_jax.register_reward("too-much", too_much)
    magic_jax.register_advantage("rloo", rloo)
    magic_jax.register_attention("naive", naive_attention)
    magic_jax.register_sampling("min-p", MinP)


# --------------------------------------------------------------------------- rewards


def _item(ability, response="1+1=2", gold="2", uid="sums:7"):
    from magic_jax.rewards import RewardItem

    return RewardItem(response=response, ground_truth=gold, ability=ability, uid=uid)


def test_a_fractional_reward_scores_in_this_process_and_in_the_workers(registered):
    from magic_jax.rewards import RewardsConfig, RewardStatus, VerifierPool, compute_reward

    local = compute_reward(_item("digit-share", "2 2 1"))
    assert (local.reward, local.status) == (pytest.approx(0.4), RewardStatus.WRONG)
    assert compute_reward(_item("digit-share", "2")).status is RewardStatus.CORRECT
    # a worker process imports the reward by reference; the slow one meets its own
    # deadline (1 s, not the pool's 30 s math deadline) and its worker is replaced
    config = RewardsConfig(num_workers=1, abilities={"math": "digit-share"})
    assert config.deadline_for("slow") == 1.0 and config.deadline_for("math") == 30.0
    with VerifierPool(config) as pool:
        share, slow, routed, again = pool.map(
            [
                _item("digit-share", "2 2 1"),
                _item("slow"),
                _item("math", "2 3"),
                _item("DIGIT-share"),
            ]
        )
        stats = pool.stats()
    assert share.reward == pytest.approx(0.4) and share.status is RewardStatus.WRONG
    assert slow.status is RewardStatus.TIMEOUT and stats["killed_at_deadline"] == 1
    assert routed.reward == pytest.approx(1 / 3)  # math rows scored by digit-share
    assert again.reward == pytest.approx(0.2)  # "1+1=2": case-insensitive, a fresh worker


@pytest.mark.parametrize(("name", "shown"), [("nan-score", "nan"), ("too-much", "1.5")])
def test_a_score_outside_0_1_is_an_error_naming_the_reward_and_the_row(registered, name, shown):
    from magic_jax.rewards import RewardStatus, compute_reward

    result = compute_reward(_item(name))
    assert result.status is RewardStatus.ERROR and result.reward == 0.0
    assert result.detail == (
        f"reward {name!r} scored row 'sums:7' {shown}: a score must be a finite number in [0, 1]"
    )


def test_registration_refuses_what_workers_cannot_import_and_names_clash(registered):
    with pytest.raises(ValueError, match="lambda, closure or partial"):
        magic_jax.register_reward("anon", lambda r, g: 1.0)
    with pytest.raises(ValueError, match="'math' is built in"):
        magic_jax.register_reward("math", digit_share)
    with pytest.raises(ValueError, match="'digit-share' is already registered"):
        magic_jax.register_reward("digit-share", slow_score)
    with pytest.raises(ValueError, match="'rloo' is already registered"):
        magic_jax.register_advantage("rloo", digit_share)
    with pytest.raises(ValueError, match="'naive' is already registered"):
        magic_jax.register_attention("naive", digit_share)
    with pytest.raises(ValueError, match="'min-p' is already registered"):
        magic_jax.register_sampling(
            "min-p",
            dataclasses.make_dataclass(
                "P", [], frozen=True, namespace={"restrict": lambda self, z: z}
            ),
        )


def flat(rewards_NG, truncated_NG, valid_NG, config):
    return rewards_NG.ravel()


def exploding(rewards_NG, truncated_NG, valid_NG, config):
    return rewards_NG / 0.0


def test_an_estimator_is_checked_and_padding_gets_zero(registered):
    from magic_jax.update.advantages import AdvantageConfig, estimate_advantages

    rewards_NG = np.array([[1.0, 0.5, 0.0, 0.25]], np.float32)
    valid_NG = np.array([[True, True, True, False]])
    adv_NG = estimate_advantages(
        AdvantageConfig(estimator="rloo"), rewards_NG, rewards_NG < 0, valid_NG
    )
    # the padding slot's advantage is 0 whatever the estimator gives it
    np.testing.assert_allclose(adv_NG, [[1 - 0.75 / 3, 0.5 - 1.25 / 3, -1.75 / 3, 0.0]], rtol=1e-6)
    magic_jax.register_advantage("flat", flat, replace=True)
    magic_jax.register_advantage("exploding", exploding, replace=True)
    with pytest.raises(ValueError, match=r"'flat' returned shape \(4,\), expected \(1, 4\)"):
        estimate_advantages(AdvantageConfig(estimator="flat"), rewards_NG, rewards_NG < 0)
    with pytest.raises(ValueError, match="'exploding' returned NaN or infinite"):
        estimate_advantages(AdvantageConfig(estimator="exploding"), rewards_NG, rewards_NG < 0)


def test_a_sampling_method_draws_only_what_it_keeps(registered):
    import jax
    import jax.numpy as jnp

    from magic_jax import SamplingConfig
    from magic_jax.rollout.sampling import draw

    probs = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    n = 4000
    logits_BV = jnp.asarray(np.tile(np.log(probs), (n, 1)), jnp.float32)
    keys_B = jax.random.split(jax.random.key(7), n)
    out = draw(logits_BV, keys_B, SamplingConfig(method="min-p", options={"p": 0.3}))
    counts = np.bincount(np.asarray(out.tokens), minlength=5)
    # kept: p >= 0.3 * 0.4 = 0.12 -> the first three, renormalised to 0.4/0.85, 0.3/0.85, ...
    assert counts[3:].sum() == 0
    kept = probs[:3] / probs[:3].sum()
    assert np.abs(counts[:3] / n - kept).max() < 4 * np.sqrt(kept * (1 - kept) / n).max()
    np.testing.assert_allclose(out.sampling_logprobs, np.log(kept)[out.tokens], rtol=1e-5)
    np.testing.assert_allclose(out.logprobs, np.log(probs)[out.tokens], rtol=1e-5)
    with pytest.raises(ValueError, match=r"options: sampling method 'min-p': p must be in"):
        SamplingConfig(method="min-p", options={"p": 2})


def test_partial_credit_through_the_metrics():
    from magic_jax.data.rows import AccuracyTracker
    from magic_jax.rewards import RewardResult, RewardStatus
    from magic_jax.rollout.evaluate import ProblemResult, summarize

    assert RewardResult.scored(0.25).status is RewardStatus.WRONG
    with pytest.raises(ValueError, match="finite number in"):
        RewardResult(reward=float("nan"), status=RewardStatus.WRONG)
    with pytest.raises(ValueError, match="does not match status=timeout"):
        RewardResult(reward=0.5, status=RewardStatus.TIMEOUT)

    def problem(i, rewards):
        n = len(rewards)
        return ProblemResult(
            index=i,
            uid=str(i),
            data_source="s",
            rewards=rewards,
            statuses=("wrong",) * n,
            lengths=(1,) * n,
            truncated=(False,) * n,
        )

    table = summarize([problem(0, (0.5, 1.0, 0.25, 0.25)), problem(1, (0.5, 0.5, 0.5, 0.5))])
    assert table["accuracy"] == pytest.approx(0.5)  # avg@n: the mean score
    # pass@k counts full-credit samples only: one of four in problem 0, none in problem 1
    assert table["pass_at_k"]["1"] == pytest.approx(0.125)
    tracker = AccuracyTracker()
    tracker.record("half", [0.5, 0.5])
    tracker.record("full", [1.0, 1.0])
    assert tracker.solved() == {"full"}


# --------------------------------------------------------------------------- a training run


@pytest.fixture(scope="module")
def run(tmp_path_factory, registered):
    from conftest import write_sums_run

    from magic_jax.run.config import load_config
    from magic_jax.run.trainer import Trainer

    root = write_sums_run(tmp_path_factory.mktemp("extension"))
    raw = {
        "model": "model",
        "output_dir": "run",
        "data": {"train": ["train.jsonl"], "max_prompt_length": 16},
        "stages": [
            {
                "steps": 2,
                "max_response_length": 4,
                "prompts_per_step": 4,
                "mini_batch_groups": 2,
                "group_size": 4,
            },
        ],
        "rollout": {"max_concurrent_decodes": 8, "decode_steps": 8, "decode_attention": "naive"},
        "advantage": {"estimator": "rloo"},
        "sampling": {"method": "min-p", "options": {"p": 0.3}},
        "rewards": {"num_workers": 1, "abilities": {"math": "digit-share"}},
        "optimizer": {"learning_rate": 1e-2},
        "checkpoint_every": 10,
        "export_hf": False,
    }
    (root / "run.yaml").write_text(yaml.safe_dump(raw))
    RLOO_CALLS.clear()
    NAIVE_TRACES.clear()
    MINP_TRACES.clear()
    with contextlib.chdir(root):
        cfg = load_config("run.yaml")
        RUN_LOG.clear()
        Trainer(cfg, log=RUN_LOG.append).run()
    lines = (root / "run" / "metrics.jsonl").read_text().splitlines()
    return root, cfg, [json.loads(line) for line in lines]


def test_the_run_uses_all_four(run):
    root, cfg, rows = run
    assert cfg.rollout.decode_attention == "naive" and cfg.advantage.estimator == "rloo"
    assert cfg.sampling.strategy == MinP(0.3)
    assert [r["step"] for r in rows] == [0, 1]
    # the decode programs were traced with the naive attention and the min-p method, and
    # the run's recorded config names it (a resume rebuilds the same method)
    assert NAIVE_TRACES and MINP_TRACES
    saved = yaml.safe_load((root / "run" / "config.yaml").read_text())["sampling"]
    assert (saved["method"], saved["options"]) == ("min-p", {"p": 0.3})
    # the method in use is named in the run's first log line and in every metrics row
    assert RUN_LOG[0] == "[sampling] min-p (p=0.3) at temperature 1"
    assert {r["sampling"] for r in rows} == {"min-p"}
    # and it attends correctly: the trainer's recomputed log-probs match the sampler's
    trained = [r for r in rows if r["sgd_steps"] > 0]
    assert trained and all(abs(r["sampler_ratio_mean"] - 1) < 1e-3 for r in trained)
    # RLOO ran once per step, on the step's rewards, and gave its formula's advantages
    assert len(RLOO_CALLS) == len(rows)
    for row, (r_NG, adv_NG) in zip(rows, RLOO_CALLS):
        assert r_NG.shape == (4, 4)
        assert row["reward"] == pytest.approx(float(r_NG.mean()))
        others_NG = (r_NG.sum(axis=1, keepdims=True) - r_NG) / 3
        np.testing.assert_allclose(adv_NG, r_NG - others_NG, rtol=1e-6, atol=1e-7)
    # the rewards are digit-share's partial credit (the math verifier gives 0 or 1 only)
    rewards = np.concatenate([r.ravel() for r, _ in RLOO_CALLS])
    assert ((rewards > 0) & (rewards < 1)).any() and ((rewards >= 0) & (rewards <= 1)).all()
    assert sum(rows[0]["reward_status"].values()) == 16


def test_unknown_names_are_one_line_errors(run):
    from magic_jax.run.config import ConfigError, load_config

    root, _, _ = run
    # other tests in the same process may have registered more names: the listed ones
    # must include the built-in and this test's own
    cases = {
        "advantage.estimator=gae": (
            "advantage.estimator: unknown advantage estimator 'gae'",
            {"grpo", "rloo"},
        ),
        "rollout.decode_attention=paged": (
            "rollout.decode_attention: unknown decode attention 'paged'",
            {"dense", "ragged", "naive"},
        ),
        "sampling.method=top-a": (
            "sampling.method: unknown sampling method 'top-a'",
            {"full", "greedy", "top-k-top-p", "min-p"},
        ),
        "rewards.abilities.math=exact": (
            "rewards.abilities[math]: unknown reward 'exact'",
            {"math", "code", "digit-share"},
        ),
        "extensions=[no_such_module]": ("extensions[0]: cannot import 'no_such_module'", None),
    }
    for override, (message, names) in cases.items():
        with contextlib.chdir(root), pytest.raises(ConfigError) as e:
            load_config("run.yaml", [override])
        text = str(e.value)
        assert message in text and "\n" not in text, text
        if names is not None:
            listed = text.split("registered: ", 1)[1].split(", ")
            assert names <= set(listed), text


def test_a_config_imports_its_extensions_for_the_command_line(run):
    from magic_jax.rewards import VerifierPool
    from magic_jax.run.config import load_config

    root, _, _ = run
    (root / "exact_digit.py").write_text(
        "import magic_jax\n\n\n"
        "def exact(response, ground_truth):\n"
        "    return float(response.strip() == str(ground_truth))\n\n\n"
        'magic_jax.register_reward("exact-digit", exact, deadline_s=5.0)\n'
    )
    # a module of the working directory, as `magic-jax train run.yaml` would find it
    overrides = ["extensions=[exact_digit]", "rewards.abilities.math=exact-digit"]
    with contextlib.chdir(root):
        cfg = load_config("run.yaml", overrides)
    assert cfg.extensions == ("exact_digit",) and cfg.rewards.abilities == {"math": "exact-digit"}
    with VerifierPool(cfg.rewards) as pool:
        right, wrong = pool.map([_item("math", " 2 "), _item("math", "22")])
    assert (right.reward, wrong.reward) == (1.0, 0.0)


def test_an_extension_next_to_its_config_is_found_from_any_working_directory(tmp_path):
    """`extensions` names a module beside the config file: the same command works from
    another directory (the config's folder is searched before the working directory)."""
    import sys

    from magic_jax.run.config import load_config
    from magic_jax.run.config_dict import ConfigError

    here = tmp_path / "project"
    here.mkdir()
    (here / "near_config_ext.py").write_text(
        "import magic_jax\n\n\n"
        "def est(rewards_NG, truncated_NG, valid_NG, config):\n"
        "    return rewards_NG - rewards_NG.mean(-1, keepdims=True)\n\n\n"
        'magic_jax.register_advantage("near-config", est)\n'
    )
    (here / "run.yaml").write_text(
        "model: model\noutput_dir: run\ndata: {train: [train.jsonl]}\n"
        "stages: [{steps: 1, max_response_length: 4, prompts_per_step: 2, mini_batch_groups: 2,"
        " group_size: 2}]\n"
        "extensions: [near_config_ext]\nadvantage: {estimator: near-config}\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    try:
        with contextlib.chdir(elsewhere):
            cfg = load_config(here / "run.yaml")
        assert cfg.advantage.estimator == "near-config"
        assert str(here.resolve()) in sys.path
    finally:
        sys.path[:] = [p for p in sys.path if p != str(here.resolve())]
        sys.modules.pop("near_config_ext", None)
    with contextlib.chdir(elsewhere), pytest.raises(ConfigError, match="looked on sys.path and in"):
        load_config(None, ["extensions=[not_anywhere_ext]"])
