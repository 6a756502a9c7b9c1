"""magic-jax plan's ``[schedule]`` lines: length shapes, and the modes of a hand-built plan
(no TPU)."""

import dataclasses
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from overlap_plan_test import _plan

from magic_jax.jobs.plan import format_plan
from magic_jax.jobs.schedule_plan import LengthShape, parse_shape, stage_schedule
from magic_jax.run.config import RolloutConfig


@pytest.mark.parametrize("name", ["tail", "early"])
def test_a_named_shape_draws_its_mean_and_its_share_at_t(name):
    shape = parse_shape(name)
    x = shape.draw(400_000, 16384, seed=3)
    assert abs(x.mean() / 16384 - shape.mean) < 0.005
    assert abs((x == 16384).mean() - shape.clipped) < 0.005
    assert x.min() >= 1 and x.max() == 16384
    assert (parse_shape("full").draw(5, 100) == 100).all()


def test_bad_shapes_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="not a length shape"):
        parse_shape("long")
    with pytest.raises(ValueError, match="expected lognormal:MEAN,CLIP"):
        parse_shape("lognormal:0.3")
    with pytest.raises(ValueError, match=r"share at T \(0.5\) < mean \(0.3\)"):
        parse_shape("lognormal:0.3,0.5")
    with pytest.raises(ValueError, match="no .*metrics.jsonl"):
        parse_shape(f"run:{tmp_path}")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n')
    with pytest.raises(ValueError, match="metrics.jsonl line 2"):
        parse_shape(f"run:{tmp_path}")


def test_a_run_shape_is_fitted_to_its_last_steps(tmp_path):
    rows = [dict(step=i, response_length_mean=100.0, max_response_length=1000,
                 truncated_fraction=0.5) for i in range(5)]  # fmt: skip
    rows += [dict(step=5 + i, response_length_mean=400.0, max_response_length=1000,
                  truncated_fraction=0.1) for i in range(20)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shape = parse_shape(f"run:{tmp_path}")
    assert (shape.mean, shape.clipped) == pytest.approx((0.4, 0.1))
    assert "its last 20 steps" in shape.describe()
    # a committed ablation run's records are compressed; none truncated is taken as 0.1%
    packed = tmp_path / "packed"
    packed.mkdir()
    rows = [dict(r, truncated_fraction=0.0) for r in rows]
    (packed / "metrics.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode())
    )
    shape = parse_shape(f"run:{packed}")
    assert (shape.mean, shape.clipped) == pytest.approx((0.4, 0.001))
    assert "0.1% reach T" in shape.describe() and "0.00% at T taken as 0.1%" in shape.describe()


def test_the_drain_costs_what_a_carried_rollout_saves_and_nothing_when_all_end_together():
    plan = _plan(RolloutConfig(max_concurrent_decodes=256))
    p = plan.stages[0]  # 4096 samples of T 16k, ragged; 4096 slots: one wave
    chip = (plan.hbm_bytes, 2765e9 / 2, 459e12 / 2)
    args = (120.0, 4096, chip, 64, plan.engine, plan.model.num_params())
    full = stage_schedule(p, parse_shape("full"), *args)
    assert full.sync.drain_s == 0.0 and full.carried.rollout_s == pytest.approx(
        full.sync.rollout_s, rel=0.01
    )
    tail = stage_schedule(p, parse_shape("tail"), *args)
    assert tail.sync.rollout_s < full.sync.rollout_s
    assert tail.sync.drain_s > 0.05 * tail.sync.step_s
    # what the drain costs is what a carried rollout saves, within a tenth of it
    saved = tail.sync.rollout_s - tail.carried.rollout_s
    assert saved == pytest.approx(tail.sync.drain_s, rel=0.1)
    # a split generates on fewer devices and updates on the rest
    assert tail.split is not None and tail.split.update_s > 120.0
    assert tail.publishes == 1 and tail.reprefill_s > 0
    # the dense kernel reads every slot's cache: ending early saves nothing in a wave
    dense = stage_schedule(dataclasses.replace(p, ragged=False), parse_shape("tail"), *args)
    assert dense.sync.rollout_s > tail.sync.rollout_s


def test_the_formatted_plan_has_a_schedule_line_per_stage_shape_and_mode():
    plan = _plan(RolloutConfig(max_concurrent_decodes=256))
    plan.stages = [dataclasses.replace(p, samples=512, rows=512) for p in plan.stages]
    out = format_plan(plan, shapes=[parse_shape("tail"), LengthShape("full", 1.0, 1.0)],
                      floors_ms=())  # fmt: skip
    lines = [x for x in out.splitlines() if x.startswith("[schedule]")]
    assert "[schedule] lengths: tail: lognormal, mean 0.35 T, 3% reach T" in lines[1]
    for stage in ("16k", "32k"):
        for shape in ("tail", "full"):
            head = f"[schedule]   stage {stage}, {shape}"
            assert sum(x.startswith(head) for x in lines) == 4, (stage, shape)
            assert any(x.startswith(head) and "% of the step" in x for x in lines)
    assert sum(x.startswith("[schedule] run, ") for x in lines) == 2


def test_plan_refuses_a_bad_lengths_option_in_one_line():
    got = subprocess.run(
        [str(Path(sys.executable).parent / "magic-jax"), "plan", "configs/skywork-or1-7b.yaml",
         "--topology", "v5p-128", "--lengths", "lognormal:2,0.1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert got.returncode == 2
    assert got.stderr.strip().splitlines() == [
        "magic-jax plan: error: --lengths lognormal:2,0.1: a lognormal needs 0 < share at T "
        "(0.1) < mean (2) < 1"
    ]


def _small_stage():
    """The 7B plan's 16K stage with a step of 32 prompts x 16 samples (fast to replay)."""
    plan = _plan(RolloutConfig(max_concurrent_decodes=256))
    p = dataclasses.replace(plan.stages[0], samples=512, rows=512, group_size=16,
                            row_length=2048 + 16384, bins=16)  # fmt: skip
    return plan, p, (plan.hbm_bytes, 2765e9, 459e12)


def test_packing_charges_the_update_for_its_tokens_and_a_step_floor_for_each_step():
    plan, p, chip = _small_stage()
    args = (100.0, 512, chip, 64, plan.engine, plan.model.num_params())
    cache = {}
    padded = stage_schedule(p, parse_shape("tail"), *args, partial=False, cache=cache)
    packed = stage_schedule(p, parse_shape("tail"), *args, partial=False, cache=cache,
                            packing=True)  # fmt: skip
    assert padded.packed is None and padded.sync.update_s == 100.0
    # the packed update runs the bins its rows' tokens fill (first-fit-decreasing wastes
    # little): at tail lengths (mean 0.35 T) about 0.44 of the padded rows' slots
    lengths = parse_shape("tail").draw(512, 16384, group=16)
    tokens = (2048 + lengths).sum() / (512 * (2048 + 16384))
    assert tokens < packed.packed < tokens * 1.05 + 16 / 512 and packed.packed < 0.5
    assert packed.sync.update_s == pytest.approx(100.0 * packed.packed)
    assert packed.sync.rollout_s == padded.sync.rollout_s  # the same rollout
    # a split's update side slows as N / (N - r) from the packed update
    r = packed.split.rollout_devices
    assert packed.split.update_s == pytest.approx(100.0 * packed.packed * 64 / (64 - r))
    # every row at T: nothing to pack
    full = stage_schedule(p, parse_shape("full"), *args, partial=False, packing=True)
    assert full.packed == 1.0
    # a decode step's fixed cost is paid once a step: sync's rollout grows linearly in it,
    # and the modes that keep the slots busy (a split, carried) gain from it
    slow = stage_schedule(p, parse_shape("tail"), *args, partial=False, floor_s=0.008)
    slower = stage_schedule(p, parse_shape("tail"), *args, partial=False, floor_s=0.016)
    grow = slow.sync.rollout_s - padded.sync.rollout_s
    assert grow > 0 and slower.sync.rollout_s - slow.sync.rollout_s == pytest.approx(grow)
    assert slow.sync.update_s == padded.sync.update_s
    for mode in ("split", "carried", "carried_split"):
        gain = padded.sync.step_s / getattr(padded, mode).step_s
        assert slow.sync.step_s / getattr(slow, mode).step_s > gain, mode


def test_a_split_runs_the_slots_its_own_memory_holds_and_carried_its_own_split():
    plan, p, chip = _small_stage()
    from magic_jax.jobs.overlap_plan import stage_inputs

    # at the 4096 slots sync runs (beside the train state), the cache alone would need 48
    # of 64 devices if a split kept them all; with no train state 16 devices hold 1480
    full = dataclasses.replace(p, samples=4096, rows=4096)
    _, memory = stage_inputs(full, 4096, chip, 64)
    kept = full.kv_cache * 4096 / full.slots * 64 / 16 + memory.rollout_fixed
    assert kept > plan.hbm_bytes and memory.holds(16, 64)
    fit = (plan.hbm_bytes - memory.rollout_fixed) / (full.kv_cache / full.slots * 64 / 16)
    assert memory.slots(16, 64) == int(fit) // 4 * 4 == 1480  # over the 4 data groups
    args = (100.0, 512, chip, 64, plan.engine, plan.model.num_params())
    s = stage_schedule(p, parse_shape("tail"), *args, partial=False)
    _, memory = stage_inputs(p, 512, chip, 64)  # at most the step's 512 samples
    assert s.split.slots == memory.slots(s.split.rollout_devices, 64)
    # carried rollouts need fewer devices than the drained rollout: their own split
    cs = s.carried_split
    assert cs.rollout_devices < s.split.rollout_devices and cs.step_s < s.split.step_s
    assert cs.slots == memory.slots(cs.rollout_devices, 64)


def test_the_best_split_is_found_where_rollout_and_update_cross():
    from magic_jax.jobs.schedule_plan import Mode, _best

    held = list(range(4, 64, 4))
    for cross in (0.5, 7.0, 30.0, 1e3):

        def mode(r, cross=cross):
            return Mode(cross * 64 / r, 10.0 * 64 / (64 - r), rollout_devices=r, shared=False)

        def update(r):
            return 10.0 * 64 / (64 - r)

        brute = min((mode(r) for r in held), key=lambda m: m.step_s)
        assert _best(mode, held, update).step_s == pytest.approx(brute.step_s), cross
    assert _best(mode, [], update) is None


def test_a_grouped_shape_keeps_each_response_s_lengths_and_draws_a_group_s_together():
    """A group's responses sharing half their log-variance: the same mean and share at T,
    the groups' means and maxima spread further apart, each group's responses closer."""
    t, g = 16384, 16
    for name in ("tail", "early"):
        one = parse_shape(name).draw(g * 20000, t, seed=3, group=g).reshape(-1, g) / t
        grouped = parse_shape(f"{name}-grouped")
        both = grouped.draw(g * 20000, t, seed=3, group=g).reshape(-1, g) / t
        assert abs(both.mean() - grouped.mean) < 0.01 and grouped.mean == one.mean().round(2)
        assert abs((both == 1).mean() - grouped.clipped) < 0.005
        assert both.mean(1).std() > 2 * one.mean(1).std()
        assert both.max(1).std() > one.max(1).std() + 0.05
        assert both.std(1).mean() < 0.75 * one.std(1).mean()
    # an independent draw is as before; a grouped one in groups only
    assert (parse_shape("tail").draw(64, t, group=16) == parse_shape("tail").draw(64, t)).all()
    assert "a group sharing 50% of the log-variance" in grouped.describe()
    assert parse_shape("lognormal:0.3,0.05,0.25").shared == 0.25
    with pytest.raises(ValueError, match=r"RHO \(2\) must be in \[0, 1\]"):
        parse_shape("lognormal:0.3,0.05,2")


def test_the_plan_prints_the_run_s_hours_by_update_kv_cache_and_step_floor():
    plan, p, _ = _small_stage()
    plan.stages = [p]
    out = format_plan(plan, shapes=[parse_shape("tail"), parse_shape("full")],
                      floors_ms=(0, 8))  # fmt: skip
    lines = [x for x in out.splitlines() if x.startswith("[schedule] run, tail, ")]
    labels = ["padded, float32 KV (as configured)", "packed, float32 KV",
              "padded, int8-ragged KV", "packed, int8-ragged KV"]  # fmt: skip
    assert [x.split(", F ")[0] for x in lines] == [
        f"[schedule] run, tail, {a}" for a in labels for _ in (0, 8)
    ]
    assert [x.split(", F ")[1].split(":")[0] for x in lines] == ["0 ms", "8 ms"] * 4
    assert all("sync " in x and "; split " in x and "; carried split " in x for x in lines)
    assert not any(x.startswith("[schedule] run, full, ") for x in lines)  # nothing to pack
    hours = [float(x.split("sync ")[1].split(" h")[0]) for x in lines]
    assert hours[2] < hours[0] and hours[4] < hours[0] and hours[6] < min(hours[2], hours[4])
    assert hours[1] > hours[0]  # a fixed cost per decode step


def test_a_negative_step_floor_is_refused_before_compiling():
    import argparse

    from magic_jax.jobs.plan import plan_command

    args = argparse.Namespace(
        config="configs/skywork-or1-7b.yaml", topology="v5p-128", price_per_chip_hour=None,
        set=None, lengths=None, step_floor_ms=[4.0, -1.0], mesh=None, stage=None, quiet=True,
        preset=None, no_search=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"--step-floor-ms -1: expected milliseconds >= 0"):
        plan_command(args)


def test_the_plan_command_takes_step_floors_to_the_planner(monkeypatch, capsys):
    from magic_jax.jobs import plan
    from magic_jax.jobs.cli import build_parser, main

    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--help"])
    assert "--step-floor-ms MS" in capsys.readouterr().out
    seen = {}
    monkeypatch.setattr(plan, "plan_run", lambda config, topology, **kw: "planned")
    monkeypatch.setattr(plan, "format_plan", lambda result, **kw: seen.update(kw) or "")
    argv = ["plan", "configs/skywork-or1-7b.yaml", "--topology", "v5p-128", "-q"]
    assert main([*argv, "--step-floor-ms", "2", "--step-floor-ms", "6.5"]) == 0
    assert seen["floors_ms"] == [2.0, 6.5]
    assert "--step-floor-ms 2 --step-floor-ms 6.5" in capsys.readouterr().out
    assert main(argv) == 0  # none given: the default floors
    assert seen["floors_ms"] == plan.STEP_FLOORS_MS
