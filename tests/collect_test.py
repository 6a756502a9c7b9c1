"""Rejection sampling with refill on scripted rewards, and the stage schedule's until rules."""

import dataclasses

import numpy as np
import pytest

from magic_jax.rollout.collect import advantages_of, flatten, select_groups
from magic_jax.rollout.scoring import Group, RemotePrompt
from magic_jax.run.config import (
    ConfigError,
    DataConfig,
    EvalConfig,
    StageConfig,
    TrainConfig,
    UntilConfig,
    load_config,
)
from magic_jax.run.stages import StageProgress
from magic_jax.testing import Sample
from magic_jax.update.advantages import AdvantageConfig, group_keep_mask
from magic_jax.update.buffer import pack_rollouts

G, D_R = 4, 4


def _group(uid, rewards):
    samples = [
        Sample(
            0,
            j,
            np.array([1, 2], np.int32),
            np.array([3, 4], np.int32),
            np.full(2, -1.0, np.float32),
            np.ones(2, np.float32),
            False,
            2,
        )
        for j in range(G)
    ]
    return Group(RemotePrompt(uid), samples, np.asarray(rewards, np.float32))


def mixed_groups(groups, advantage):
    """[N] bool: the groups rejection sampling keeps (some non-zero advantage)."""
    return np.asarray(group_keep_mask(np.stack(advantages_of(groups, advantage))))


def _script(rounds):
    """sample_round from a table: round r -> one reward list per prompt; records calls."""
    calls = []

    def sample_round(r):
        calls.append(r)
        return [_group(f"r{r}p{i}", rw) for i, rw in enumerate(rounds[r])]

    return sample_round, calls


MIXED, ALL_WRONG, ALL_RIGHT = [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]


def test_refill_fills_the_batch_with_mixed_groups():
    table = [
        [MIXED, ALL_WRONG, ALL_RIGHT, ALL_WRONG],  # 1 mixed
        [ALL_WRONG, MIXED, MIXED, ALL_WRONG],  # 3
        [MIXED, ALL_RIGHT, MIXED, MIXED],  # 6 >= D_R: stop here
        [MIXED] * 4,
    ]
    sample_round, calls = _script(table)
    got = select_groups(
        sample_round, num_groups=D_R, advantage=AdvantageConfig(), refill=True, max_rounds=5
    )
    assert calls == [0, 1, 2]
    assert got.rounds == 2 and got.extra_rollouts == 2 * D_R * G and got.mixed == 6
    assert [g.row.uid for g in got.groups] == ["r0p0", "r1p1", "r1p2", "r2p0"]
    assert len(got.every) == 3 * D_R
    samples, rewards = flatten(got.groups)
    buf = pack_rollouts(samples, rewards, group_size=G, num_groups=D_R, response_bucket=8)
    assert buf.num_groups == D_R and buf.group_keep().all()


def test_refill_stops_at_the_cap_and_fills_with_unmixed_groups():
    table = [[ALL_WRONG, MIXED, ALL_RIGHT, ALL_WRONG]] + [[ALL_WRONG] * 4] * 5
    sample_round, calls = _script(table)
    got = select_groups(
        sample_round, num_groups=D_R, advantage=AdvantageConfig(), refill=True, max_rounds=3
    )
    assert calls == [0, 1, 2, 3] and got.rounds == 3 and got.mixed == 1
    # the one mixed group first, then round 0's others: always D_R groups (static shapes)
    assert [g.row.uid for g in got.groups] == ["r0p1", "r0p0", "r0p2", "r0p3"]
    samples, rewards = flatten(got.groups)
    buf = pack_rollouts(samples, rewards, group_size=G, num_groups=D_R, response_bucket=8)
    assert buf.group_keep().tolist() == [True, False, False, False]


@pytest.mark.parametrize("mask", ["none", "before", "after"])
def test_the_collected_advantages_are_the_buffers(mask):
    """The advantages computed once at collection are those the buffer would compute."""
    table = [[MIXED, [1, 1, 0, 0], ALL_RIGHT, [0, 1, 1, 1]]]
    sample_round, _ = _script(table)

    def with_truncation(r):  # the last response of each group hits the limit
        groups = sample_round(r)
        for g in groups:
            g.samples[-1] = dataclasses.replace(g.samples[-1], truncated=True)
        return groups

    adv = AdvantageConfig(mask=mask)
    got = select_groups(with_truncation, num_groups=D_R, advantage=adv)
    samples, rewards = flatten(got.groups)
    kw = dict(group_size=G, num_groups=D_R, response_bucket=8)
    given = pack_rollouts(samples, rewards, advantages=np.concatenate(got.advantages), **kw)
    computed = pack_rollouts(samples, rewards, advantage=adv, **kw)
    np.testing.assert_allclose(given.advantages, computed.advantages, rtol=1e-6, atol=1e-6)
    assert given.keep.tolist() == computed.keep.tolist()
    assert got.mixed == int(computed.group_keep().sum())


def test_without_refill_the_step_keeps_its_own_groups():
    sample_round, calls = _script([[ALL_WRONG, MIXED, ALL_RIGHT, ALL_WRONG], [MIXED] * 4])
    got = select_groups(sample_round, num_groups=D_R, advantage=AdvantageConfig())
    assert calls == [0] and got.rounds == 0 and got.extra_rollouts == 0
    assert [g.row.uid for g in got.groups] == ["r0p0", "r0p1", "r0p2", "r0p3"]


def test_mixed_follows_the_truncation_mask():
    g = _group("x", [1, 0, 0, 0])
    g.samples[1:] = [dataclasses.replace(s, truncated=True) for s in g.samples[1:]]
    assert mixed_groups([g], AdvantageConfig()).tolist() == [True]
    # "before": one untruncated response left, nothing to compare against
    assert mixed_groups([g], AdvantageConfig(mask="before")).tolist() == [False]


def _run_config(**stage0):
    st = dict(steps=5, max_response_length=8, prompts_per_step=4, mini_batch_groups=2, group_size=4)
    return TrainConfig(
        model="m",
        output_dir="o",
        data=DataConfig(train=("t",)),
        stages=(StageConfig(**st, **stage0), StageConfig(**st)),
        eval=EvalConfig(data=("e",)),
    )


def test_schedule_truncation_rule_budget_and_state_round_trip():
    cfg = _run_config(until=UntilConfig(truncated_below=0.1, truncated_steps=2))
    s = StageProgress()
    assert s.after_step(cfg, 1, 0.05) is None  # one low step
    assert s.after_step(cfg, 2, 0.5) is None  # the run of low steps restarts
    assert s.after_step(cfg, 3, 0.0) is None
    reason = s.after_step(cfg, 4, 0.09)
    assert reason is not None and "under 0.1 for 2" in reason
    s.advance(4, reason)
    assert s.index == 1 and s.stage_step(4) == 0 and s.switches[0]["step"] == 4
    back = StageProgress.from_state_dict(s.state_dict())
    assert back == s
    # stage 1 has no rules: its budget of 5 steps ends it
    assert [back.after_step(cfg, n, 0.0) for n in range(5, 9)] == [None] * 4
    assert "budget" in back.after_step(cfg, 9, 0.0)
    back.advance(9, "budget")
    assert back.finished(cfg)


def test_schedule_eval_rule():
    cfg = _run_config(until=UntilConfig(eval_patience=2, eval_min_gain=0.01))
    s = StageProgress()
    assert s.after_eval(cfg, 0.30) is None  # the baseline
    assert s.after_eval(cfg, 0.35) is None  # a gain
    assert s.after_eval(cfg, 0.355) is None  # under min gain: 1
    reason = s.after_eval(cfg, 0.20)  # 2
    assert reason is not None and "no eval gain for 2" in reason
    s.advance(7, reason)
    assert s.best_eval is None and s.evals_without_gain == 0
    assert s.after_eval(cfg, 0.1) is None  # stage 1 has no eval rule


@pytest.mark.parametrize(
    "override, message",
    [
        ("stages.0.until={truncated_steps: 2}", r"stages\[0\]\.until: set truncated_below"),
        ("stages.0.until={truncated_below: 1.5}", r"stages\[0\]\.until: truncated_below must"),
        ("stages.0.until={eval_patience: 2}", r"stages\[0\]\.until\.eval_patience needs an eval"),
        ("stages.0.until={eval_patiense: 2}", r"stages\[0\]\.until\.eval_patiense: unknown"),
        ("stages.1.kl_beta=-1", r"stages\[1\]: kl_beta must be >= 0"),
        ("rollout.refill=3", r"rollout\.refill: expected true or false"),
        ("rollout.refill_max_rounds=0", r"rollout\.refill_max_rounds: must be >= 1"),
        ("loss.tis_cap=0.5", r"loss: LossConfig\.tis_cap must be >= 1"),
        ("loss.behaviour_logprobs=top_p", r"loss\.behaviour_logprobs: expected one of"),
        ("update.mini_batch_split=half", r"update\.mini_batch_split: expected one of"),
        ("stages.0.mini_batch_groups=3", r"stages\[0\]: prompts_per_step \(4\) must be a multiple"),
    ],
)
def test_new_options_are_checked_at_load(override, message):
    raw = {
        "model": "m",
        "output_dir": "o",
        "data": {"train": ["t"]},
        "stages": [
            {
                "steps": 2,
                "max_response_length": 8,
                "prompts_per_step": 4,
                "mini_batch_groups": 2,
                "group_size": 4,
            }
            for _ in range(2)
        ],
    }
    with pytest.raises(ConfigError, match=message):
        load_config(raw=raw, overrides=[override])


# --------------------------------------------------------------------------- score_groups


class _Driver:
    """Scripted responses: sample j of prompt p is the digit (p + j) % 3; finishes last first."""

    def run(self, params, prompts, *, num_samples, seed, step, truncation, on_sample, **kw):
        out = [
            Sample(
                p,
                j,
                np.asarray(x, np.int32),
                np.asarray([(p + j) % 3], np.int32),
                np.zeros(1, np.float32),
                np.zeros(1, np.float32),
                False,
                1,
            )
            for p, x in enumerate(prompts)
            for j in range(num_samples)
        ]
        for s in reversed(out):
            on_sample(s)
        return out, "stats"


class _Tokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 50 for c in text]

    def decode(self, tokens, skip_special_tokens=True):
        return str(int(tokens[0]))


class _Pool:
    """Rewards 1 where the response is the gold answer ("0" has no answer); keeps what it got."""

    def __init__(self):
        self.items = []

    def submit(self, item):
        self.items.append(item)
        return len(self.items) - 1

    def collect(self, tickets):
        from magic_jax.rewards import RewardResult, RewardStatus

        def status(item):
            if item.response == str(item.ground_truth):
                return RewardStatus.CORRECT
            return RewardStatus.NO_ANSWER if item.response == "0" else RewardStatus.WRONG

        return [RewardResult.of(status(self.items[t])) for t in tickets]


def test_score_groups_per_host_in_one_process_equals_the_plain_path():
    """The multi-host path (gathers, own-prompt scoring, gathered verdicts) with one host:
    the same groups, every sample scored once. tests/multihost_test.py runs it on two."""
    from helpers import sums_rows

    from magic_jax.data.rows import parse_row, tokenize_rows
    from magic_jax.rollout.scoring import Scoring, score_groups

    rows = [parse_row(r, f"rows:{i}", f"rows:{i}") for i, r in enumerate(sums_rows(5, seed=1))]
    rows, _ = tokenize_rows(rows, _Tokenizer(), max_prompt_length=64)
    got = {}
    for per_host in (False, True):
        pool = _Pool()
        groups, stats, _ = score_groups(
            _Driver(),
            None,
            rows,
            Scoring(_Tokenizer(), pool, per_host=per_host),
            num_samples=3,
            seed=0,
            step=0,
        )
        assert stats == "stats" and len(pool.items) == 15
        got[per_host] = [
            (
                g.row.uid,
                [int(s.tokens[0]) for s in g.samples],
                g.rewards.tolist(),
                [r.status for r in g.results],
            )
            for g in groups
        ]
    assert got[True] == got[False]
    assert [uid for uid, *_ in got[True]] == [r.uid for r in rows]
    assert 0 < sum(sum(r) for _, _, r, _ in got[True]) < 15  # some right, some wrong


class _LaneDriver(_Driver):
    """As ``_Driver``, but every sample finishes in another thread (a second decode lane)."""

    def run(self, params, prompts, *, num_samples, seed, step, truncation, on_sample, **kw):
        import threading

        calls = []
        out, stats = super().run(
            params,
            prompts,
            num_samples=num_samples,
            seed=seed,
            step=step,
            truncation=truncation,
            on_sample=calls.append,
        )
        lane = threading.Thread(target=lambda: [on_sample(s) for s in calls], name="lane-1")
        lane.start()
        lane.join()
        return out, stats


def test_score_groups_without_a_pool_verifies_lane_samples_in_the_calling_thread():
    """Without a pool the verdicts are computed in the thread that called score_groups:
    samples a decode lane finished in another thread are verified like the others (Math-Verify
    answers ERROR outside the main thread)."""
    from helpers import sums_rows

    from magic_jax.data.rows import parse_row, tokenize_rows
    from magic_jax.rewards import RewardItem, RewardStatus, compute_reward
    from magic_jax.rollout.scoring import Scoring, score_groups

    raw = sums_rows(4, seed=2)
    rows = [parse_row(r, f"rows:{i}", f"rows:{i}") for i, r in enumerate(raw)]
    rows, _ = tokenize_rows(rows, _Tokenizer(), max_prompt_length=64)
    groups, _, _ = score_groups(
        _LaneDriver(),
        None,
        rows,
        Scoring(_Tokenizer(), keep_texts=True),
        num_samples=3,
        seed=0,
        step=0,
    )
    got = [r.status for g in groups for r in g.results]
    assert RewardStatus.ERROR not in got
    want = [
        compute_reward(RewardItem.from_row(row.as_verl_row(), text)).status
        for row, g in zip(rows, groups)
        for text in g.texts
    ]
    assert got == want
