"""Overlap mode (``rollout.mode: overlap``) on the tiny trainer run: staleness 0 is sync
bit for bit, a seed gives the same run twice, and a kill -9 mid-rollout resumes to the
uninterrupted run. Records are compared without their wall-clock fields."""

import numpy as np
import pytest
from resume_test import _cfg, _kill_then_resume, _records, _weights, assert_same_run
from trainer_test import files as files  # a fixture, used by name

from magic_jax.run import rundir
from magic_jax.run.trainer import Trainer

# what only an overlap run records (its staleness and its two threads' waits)
OVERLAP_KEYS = (
    "staleness_tokens",
    "entropy_by_staleness",
    "tokens_per_version",
    "staleness_mean",
    "clipfrac_by_staleness",
)


def _run(files, name, *more):
    Trainer(_cfg(files, name, *more), log=lambda s: None).run()
    return files / name


def _overlap(s, *more):
    return ("rollout.mode=overlap", f"rollout.max_staleness={s}", *more)


@pytest.fixture(scope="module")
def sync_run(files):
    return _run(files, "ov_sync")


@pytest.fixture(scope="module")
def stale1(files):
    return _run(files, "ov_s1", *_overlap(1))


def test_staleness_0_equals_sync_bit_for_bit(files, sync_run):
    out = _run(files, "ov_s0", *_overlap(0))
    ms, es = _records(sync_run)
    mo, eo = _records(out)
    for r in mo:
        assert set(r.pop("staleness_tokens")) == {"0"}
        for k in OVERLAP_KEYS[1:]:
            r.pop(k, None)  # no clip fractions in a step that trained on no group
    assert ms == mo and es == eo
    ws, wo = _weights(sync_run), _weights(out)
    assert all(np.array_equal(ws[k], wo[k]) for k in ws)


def _staleness(out):
    return [r["staleness_tokens"] for r in rundir.read_records(out / "metrics.jsonl")]


@pytest.mark.slow
def test_staleness_1_twice_is_the_same_run_and_bounded(files, stale1, sync_run):
    again = _run(files, "ov_s1_again", *_overlap(1))
    assert_same_run(stale1, again)
    hist = _staleness(stale1)
    # step 0 starts under version 0 (on-policy); each later step's tokens are 1 stale
    # except at a stage's first step, which starts under the previous step's version too
    assert hist[0] == {"0": sum(hist[0].values())}
    assert all(set(h) == {"1"} for h in hist[1:])
    rows = rundir.read_records(stale1 / "metrics.jsonl")
    clip = [r["clipfrac_by_staleness"] for r in rows[1:] if "clipfrac_by_staleness" in r]
    assert clip and all(set(c) == {"1"} and 0 <= c["1"] <= 1 for c in clip)
    assert _records(stale1)[0] != _records(sync_run)[0]  # it did train on stale samples


@pytest.mark.slow
def test_partial_rollouts_staleness_2_twice_the_same(files):
    more = _overlap(2, "rollout.publish_chunks=1", "rollout.decode_steps=1")
    a, b = _run(files, "ov_s2p", *more), _run(files, "ov_s2p_again", *more)
    assert_same_run(a, b)
    hist = _staleness(a)
    assert all(0 <= int(s) <= 2 for h in hist for s in h)
    # the responses in flight moved to newer versions mid-rollout: mixed staleness
    assert any(len(h) > 1 for h in hist), hist


@pytest.mark.heavy
def test_partial_rollouts_reprefill_at_each_version(files):
    """``publish_cache: reprefill``: the responses in flight are prefilled again under
    each new version (the driver's test checks each token is its version's exactly)."""
    more = _overlap(2, "rollout.publish_chunks=1", "rollout.decode_steps=1")
    out = _run(files, "ov_s2r", *more, "rollout.publish_cache=reprefill")
    rows = rundir.read_records(out / "metrics.jsonl")
    assert sum(r["reprefills"] for r in rows) > 0
    assert any(len(r["staleness_tokens"]) > 1 for r in rows)
    assert all(np.isfinite(r["grad_norm"]) for r in rows)


@pytest.mark.slow
def test_kill_9_mid_rollout_in_overlap_mode_resumes_to_the_same_run(files):
    # the groups the rollouts in flight finished are reused and the others decoded in a
    # smaller batch: without compaction, bit for bit (stop_resume_test.py's reason)
    more = (*_overlap(1), "rollout.compact_batch=false")
    reference = _run(files, "ov_s1_exact", *more)
    out = files / "ov_kill"
    log = _kill_then_resume(files, out, "rollout:3", *more)
    assert "continuing at step" in log
    assert_same_run(reference, out)


@pytest.mark.slow
def test_disaggregated_devices_generate_apart_from_the_update(files):
    """rollout.devices=4 of the 8 virtual devices: two disjoint meshes; the weights move
    to the rollout's at each published version, and the run trains as usual."""
    more = (*_overlap(1), "mesh={data: 1, fsdp: -1, tensor: 1}", "rollout.devices=4")
    logs = []
    trainer = Trainer(_cfg(files, "ov_split", *more), log=logs.append)
    trainer.run()
    i = trainer.inputs
    gen, upd = set(i.rollout_mesh.devices.flat), set(i.mesh.devices.flat)
    assert len(gen) == len(upd) == 4 and not gen & upd
    assert any("4 device(s) generate, 4 update" in line for line in logs)
    rows = rundir.read_records(files / "ov_split" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(np.isfinite(r["grad_norm"]) for r in rows)
    assert all(set(r["staleness_tokens"]) == {"1"} for r in rows[1:])


def test_overlap_options_are_checked(files):
    from magic_jax.run.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match="publish_chunks"):
        _cfg(files, "bad", "rollout.publish_chunks=2")  # partial rollouts need overlap
    with pytest.raises((ConfigError, ValueError), match="max_staleness"):
        _cfg(files, "bad", *_overlap(-1))
    with pytest.raises((ConfigError, ValueError), match="reprefill needs publish_chunks"):
        _cfg(files, "bad", *_overlap(1), "rollout.publish_cache=reprefill")
    with pytest.raises((ConfigError, ValueError), match="rollout.publish_cache"):
        _cfg(files, "bad", *_overlap(1), "rollout.publish_chunks=1", "rollout.publish_cache=x")
    with pytest.raises((ConfigError, ValueError), match="rollout.devices"):
        _cfg(files, "bad", *_overlap(1), "rollout.devices=2")  # no mesh


def test_decoupled_ppo_under_staleness_logs_what_the_ablation_measured():
    from magic_jax.run.config import RolloutConfig
    from magic_jax.run.overlap import OverlapRollouts

    def lines(tis_cap, **rollout):
        out = []
        ov = OverlapRollouts.of(RolloutConfig(**rollout), tis_cap, log=out.append)
        return ov, out

    assert lines(2.0) == (None, [])  # sync: no overlap, nothing said
    for s, cap, said in ((1, 2.0, True), (4, 3.0, True), (0, 2.0, False), (2, None, False)):
        ov, out = lines(cap, mode="overlap", max_staleness=s)
        assert ov is not None and ov.max_staleness == s
        assert bool(out) == said, (s, cap, out)
        if said:
            assert f"tis_cap {cap}" in out[0] and f"staleness {s} without" in out[0]
            assert "section 13" in out[0] and "behaviour_clip" in out[0]


@pytest.mark.slow
def test_an_overlap_run_directory_loads_as_a_policy(stale1):
    """Its checkpoints hold the s lagged versions beside the state, and the policy's
    parameters where a sync checkpoint has them (``magic-jax eval`` / ``export`` read them)."""
    import dataclasses

    import jax
    from flax import nnx

    from magic_jax.run.policy import load_policy
    from magic_jax.run.versions import Checkpointed
    from magic_jax.update.state import TrainState

    names = {f.name for f in dataclasses.fields(Checkpointed)}
    assert {f.name for f in dataclasses.fields(TrainState)} | {"lagged"} == names
    model = load_policy(stale1, "float32", None)
    embed = _weights(stale1)["model.embed_tokens.weight"]
    leaves = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert any(x.shape == embed.shape and np.array_equal(x, embed) for x in leaves)


@pytest.mark.slow
def test_decoupled_ppo_with_the_behaviour_clip_records_its_metrics_by_staleness(files):
    """Decoupled PPO at staleness 1 with ``loss.behaviour_clip`` (and AReaL's masking rule):
    each step past the first records the behaviour weight and the share past the cap by
    staleness, the behaviour clip's fraction, and a clip fraction by staleness that counts
    the behaviour clip (the proximal one cannot bind at N_SGD 1)."""
    more = ("loss.tis_cap=5", "loss.tis_rule=mask", "loss.behaviour_clip=true")
    out = _run(files, "ov_s1_trust", *_overlap(1), *more)
    rows = [
        r for r in rundir.read_records(out / "metrics.jsonl")[1:] if "clipfrac_by_staleness" in r
    ]
    assert rows
    for r in rows:
        assert set(r["behaviour_weight_by_staleness"]) == set(r["capped_by_staleness"]) == {"1"}
        assert r["behaviour_weight_by_staleness"]["1"] > 0
        assert 0 <= r["capped_by_staleness"]["1"] <= 1 and 0 <= r["behaviour_clipfrac"] <= 1
        assert r["clipfrac_by_staleness"]["1"] == pytest.approx(r["behaviour_clipfrac"], abs=1e-6)
