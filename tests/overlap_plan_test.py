"""magic-jax plan's rollout/update overlap prediction (no TPU: a hand-built plan)."""

import dataclasses

import pytest

from magic_jax.jobs.overlap_plan import RolloutCost, SplitMemory, predict_overlap, split_time
from magic_jax.jobs.plan import RunPlan, format_plan
from magic_jax.jobs.stage_plan import StagePlan
from magic_jax.jobs.topology import CHIPS
from magic_jax.model.config import PRESETS
from magic_jax.run.config import RolloutConfig

# HBM to spare: a split's generating side runs the slots a step needs (8), as many as
# split over its r data groups
ROOMY = SplitMemory(rollout_fixed=1.0, slot_bytes=1e-9, update=1.0, hbm=1e9, samples=8)
# bytes-bound (1 byte/s, no flop limit): a step on d devices with s live slots reads the
# weights (1 byte, on every device whatever d) and 0.8 x s / d bytes of cache
COST = RolloutCost(
    weights=1.0, slot_bytes=0.8, slot_flops=0.0, slots=8, samples=32, response_length=100,
    tensor=1, bandwidth=1.0, peak=1.0,
)  # fmt: skip


def test_the_rollout_is_the_larger_of_throughput_and_tail():
    # throughput on 8: 32 x 100 / 8 = 400 steps of 1 + 0.8 x 8 / 8 = 1.8 s; tail: 100
    # steps at one slot per device, 1 + 0.8 = 1.8 s, whatever d
    assert COST.rollout(8) == pytest.approx((720.0, "throughput"))
    assert COST.tail_s(8) == COST.tail_s(2) == pytest.approx(180.0)
    assert COST.tail_at(8) == pytest.approx(0.25)  # 180 of 720 at L = T
    short = dataclasses.replace(COST, mean_length=10.0)  # 40 steps of 1.8 s: 72 < 180
    assert short.rollout(8) == pytest.approx((180.0, "tail"))
    assert short.rollout(2) == pytest.approx((180.0, "tail"))  # 40 x (1 + 3.2) = 168
    assert short.rollout(1) == pytest.approx((296.0, "throughput"))  # 40 x 7.4
    # the flop roofline when it is slower: 10 flops per slot at 1 flop/s
    flops = dataclasses.replace(COST, slot_flops=10.0)
    assert flops.step_s(8, 8) == pytest.approx(10.0) and flops.step_s(1, 8) == 1.25


def test_a_tail_bound_rollout_gives_devices_to_the_update():
    # tail-bound on all 8: 180 s on 2 to 8 devices; U 40 s on 8 -> 320 / (8 - r)
    short = dataclasses.replace(COST, mean_length=10.0)
    o = predict_overlap("s", 10, short, 40.0, 8, ROOMY)
    assert o.regime == "tail" and o.sync_s == pytest.approx(220.0) and o.candidates == 7
    assert o.best.rollout_devices == 2 and o.best.regime == "tail"
    assert (o.best.rollout_s, o.best.update_s) == pytest.approx((180.0, 320 / 6))
    assert o.speedup(o.best) == pytest.approx(220 / 180) and o.speedup(o.best) > 1


def test_a_throughput_bound_rollout_gains_only_the_weight_reads():
    # throughput-bound: 3200 / S steps of 1 + 0.8 S / r on r devices with S slots; sync
    # 720 + 40; r 7 runs 7 slots (one per device): 5760 / 7 = 822.9 > 760
    o = predict_overlap("s", 10, COST, 40.0, 8, ROOMY)
    assert o.regime == "throughput" and o.sync_s == pytest.approx(760.0)
    assert o.best.rollout_devices == 7 and o.best.regime == "throughput"
    assert o.best.step_s == pytest.approx(3200 / 7 * (1 + 0.8))
    assert o.speedup(o.best) < 1
    # with no weights the rollout scales as N / r: a split at best matches sync
    cache = dataclasses.replace(COST, weights=0.0)  # 400 x 6.4 / r
    o = predict_overlap("s", 10, cache, 40.0, 8, ROOMY)
    steps = {r: max(split_time(cache, 40.0, 8, r)) for r in range(1, 8)}
    assert o.best.step_s == pytest.approx(min(steps.values()))
    assert all(s >= o.sync_s - 1e-9 for s in steps.values())


def test_a_split_that_cannot_hold_the_model_is_refused():
    # a slot's cache, 1/8 byte a device on all 8, takes 1 / r bytes a device on r: short of
    # a byte beside the weights, no data group holds a slot; with one, each holds one
    tight = SplitMemory(rollout_fixed=1.0, slot_bytes=1 / 8, update=0.0, hbm=1.99, samples=8)
    o = predict_overlap("s", 10, COST, 40.0, 8, tight, configured=6)
    assert o.candidates == 0 and o.best is None
    assert o.configured.rollout_devices == 6 and not o.configured.holds
    assert o.configured.step_s == pytest.approx(400 * (1 + 6.4 / 6))  # as planned, reported
    roomier = dataclasses.replace(tight, hbm=2.0)
    assert [roomier.slots(r, 8) for r in (1, 2, 3, 7)] == [1, 2, 3, 7]
    o = predict_overlap("s", 10, COST, 40.0, 8, roomier, configured=6)
    assert o.candidates == 7 and o.configured.holds
    assert o.configured.step_s == pytest.approx(3200 / 6 * (1 + 0.8))  # 6 slots on 6
    # the updating side's memory: the update total x 8 / (8 - r) over 2 bytes: r <= 4
    upd = SplitMemory(rollout_fixed=0.0, slot_bytes=0.0, update=1.0, hbm=2.0, samples=8)
    assert predict_overlap("s", 1, COST, 40.0, 8, upd).best.rollout_devices == 4
    # both sides multiples of the tensor axis (a data group's devices)
    wide = dataclasses.replace(COST, tensor=4)
    o = predict_overlap("s", 1, wide, 40.0, 8, ROOMY)
    assert o.candidates == 1 and o.best.rollout_devices == 4
    none = SplitMemory(rollout_fixed=2.0, slot_bytes=0.0, update=0.0, hbm=1.0)
    assert predict_overlap("s", 1, COST, 40.0, 8, none).best is None
    assert not SplitMemory(0.0, 0.0, 0.0, 1.0).holds(8, 8)  # a side with no device
    o = predict_overlap("s", 1, COST, 40.0, 8, ROOMY, configured=8)
    assert not o.configured.holds and o.configured.step_s == float("inf")


def test_max_staleness_does_not_enter_the_time():
    a, b = (predict_overlap("s", 3, COST, 40.0, 8, ROOMY, max_staleness=s) for s in (0, 4))
    assert a.best == b.best and a.sync_s == b.sync_s and b.max_staleness == 4


def _plan(engine: RolloutConfig) -> RunPlan:
    """A two-stage 7B plan on v5p-128 from hand-set sizes (what plan_stage would compile)."""
    g = 2**30

    def stage(name: str, t: int, kv: float) -> StagePlan:
        p, o, gr, a, b, w, k, d = (int(x * g) for x in (0.44, 0.89, 0.44, 5, 0.1, 3.55, kv, 0.25))
        return StagePlan(
            name, t, {"data": 1, "fsdp": 16, "tensor": 4}, 4096, 16, 1, p, o, gr, a, b, w, k, d,
            update_flops=5.9e16, model_flops=5.4e16, decode_bytes=8e9, decode_flops=7e9,
            slots=256, samples=4096, prompt_length=2048, ragged=True, steps=100,
        )  # fmt: skip

    model = dataclasses.replace(PRESETS["r1-distill-qwen-7b"], param_dtype="float32")
    stages = [stage("16k", 16384, 3.94), stage("32k", 32768, 7.44)]
    return RunPlan("v5p-128", CHIPS["v5p"], 64, 64, model, stages, {}, engine=engine)


def test_the_formatted_plan_has_the_overlap_lines():
    out = format_plan(_plan(RolloutConfig(max_concurrent_decodes=256)), shapes=())
    lines = [line for line in out.splitlines() if "overlap" in line]
    assert lines and all(line.startswith("[overlap]") for line in lines), lines
    assert "a roofline model" in lines[0]
    assert "[overlap] this run: rollout.mode sync, max_staleness 1, publish_chunks null" in out
    for stage in ("16k", "32k"):
        assert f"[overlap]   stage {stage}: sync: step >= " in out
        assert "throughput-bound, + update" in out  # every response run to T
        assert f"[overlap]   stage {stage}: overlap, shared devices: step >= " in out
        assert f"[overlap]   stage {stage}: overlap, best split " in out
    assert "[overlap] run, sync (and overlap on shared devices): >= " in out
    assert "[overlap] run, overlap at the best splits: >= " in out
    assert "rollout.devices 32:" not in out
    engine = RolloutConfig(max_concurrent_decodes=256, mode="overlap", devices=32)
    out = format_plan(_plan(engine), shapes=())
    assert "[overlap]   stage 16k: rollout.devices 32: 32 generate / 32 update: step >= " in out
    assert "update: step >= max(rollout " in out and "-bound), update " in out
    assert "[overlap] run, overlap at rollout.devices 32: >= " in out
