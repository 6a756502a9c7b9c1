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
    out = format_plan(_plan(RolloutConfig(max_concurrent_decodes=256)), shapes=[
        parse_shape("tail"), LengthShape("full", 1.0, 1.0)])  # fmt: skip
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
