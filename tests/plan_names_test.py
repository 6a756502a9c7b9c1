"""magic-jax plan without libtpu: gcloud's slice names and their chip counts, the time,
chip-hour and cost bounds, and the recommended decode slots (arithmetic on a stage's sizes)."""

import math

import pytest

from magic_jax.jobs.cli import main
from magic_jax.jobs.plan import RunPlan, format_plan
from magic_jax.jobs.roofline import (
    TimeBound,
    chip_hours,
    decode_bound,
    recommend_slots,
    update_bound,
)
from magic_jax.jobs.stage_plan import Int8Decode, StagePlan
from magic_jax.jobs.topology import (
    ACCELERATOR_TYPES,
    CHIPS,
    GiB,
    PlanError,
    gcloud_name,
    libtpu_available,
    resolve_topology,
)
from magic_jax.model.config import ModelConfig
from magic_jax.rollout.engine_config import EngineOptions


@pytest.mark.parametrize(
    "name, shape, chips",
    [
        ("v5p-128", "v5p:4x4x4", 64),  # v5p-N counts TensorCores, 2 per chip
        ("v5p-8", "v5p:2x2x1", 4),
        ("v5p-256", "v5p:4x4x8", 128),
        ("v4-32", "v4:2x2x4", 16),  # v4-N too
        ("v5litepod-64", "v5e:8x8", 64),  # v5litepod-N and v6e-N count chips
        ("v5litepod-256", "v5e:16x16", 256),
        ("v6e-64", "v6e:8x8", 64),
        ("v6e-1", "v6e:1x1", 1),
    ],
)
def test_gcloud_accelerator_types_name_a_shape_and_its_chips(name, shape, chips):
    s = resolve_topology(name)
    assert (s.shape, s.chips, s.gcloud) == (shape, chips, name)
    assert str(s) == f"{name} ({shape})"
    # the GEN:SHAPE name finds the same slice, by both names
    t = resolve_topology(shape)
    assert (t.chip, t.chips, t.gcloud) == (s.chip, chips, name)


def test_every_listed_size_is_its_shape_s_chips_and_a_searched_shape():
    for prefix, (gen, cores_per_chip, sizes) in ACCELERATOR_TYPES.items():
        for n, shape in sizes.items():
            chips = math.prod(int(d) for d in shape.split("x"))
            assert n == chips * cores_per_chip, (prefix, n, shape)
            assert gcloud_name(gen, shape) == f"{prefix}-{n}"
            if chips <= 4096:  # the smallest-fit search walks the chip's shapes
                assert shape in CHIPS[gen].topologies, (gen, shape)
    assert gcloud_name("v5e", "3x3") is None and str(resolve_topology("v5e:3x3")) == "v5e:3x3"


@pytest.mark.parametrize(
    "name, message",
    [
        ("v5p-3", "N (TensorCores, 2 per chip) is one of 8, 16, 32, 64, 128, 256"),
        ("v6e-48", "N (chips) is one of 1, 4, 8, 16, 32, 64, 128, 256"),
        ("v5e-64", "v5e's is v5litepod-64"),  # not a gcloud name: it says which is
        ("tpu-16", "unknown accelerator type 'tpu'"),
        ("v9:2x2", "unknown TPU generation 'v9'"),
        ("v5p", "expected a gcloud accelerator type"),
    ],
)
def test_unknown_or_impossible_names_say_what_is_valid(name, message):
    with pytest.raises(PlanError) as e:
        resolve_topology(name)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(libtpu_available(), reason="this environment would compile the plan")
def test_the_cli_parses_the_name_then_asks_for_libtpu(capsys):
    cfg = "configs/skywork-or1-7b.yaml"
    assert main(["plan", cfg, "--topology", "v5p-3"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "v5p-3" in err and "8, 16, 32" in err
    assert main(["plan", cfg, "--topology", "v5p-128"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "needs libtpu" in err and "jax[tpu]" in err
    args = ["plan", cfg, "--topology", "v5p-128", "--price-per-chip-hour", "-1"]
    assert main(args) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "--price-per-chip-hour -1" in err


def test_recommended_slots_are_a_power_of_two_of_the_shards_within_fit_and_samples():
    assert recommend_slots(1753, 4096, 16) == 1024
    assert recommend_slots(1753, 512, 16) == 512  # no more slots than samples
    assert recommend_slots(3401, 5120, 16) == 2048
    assert recommend_slots(15, 4096, 16) == 0  # not one slot per shard fits
    assert recommend_slots(100, 4096, 6) == 96  # no power of two splits over 6 shards
    assert recommend_slots(1, 1, 1) == 1


def _stage(**kw):
    base = dict(stage="16k", response_length=16384, mesh={"data": 1, "fsdp": 8, "tensor": 2},
                rows=64, micro_batch=8, sgd_steps=2, params=4 * GiB, opt_state=8 * GiB,
                grads=4 * GiB, activations=GiB, batch=0, engine_params=8 * GiB,
                kv_cache=8 * GiB, decode_temps=2 * GiB, slots=64, decode_bytes=16 * GiB,
                decode_flops=1e9, samples=256, steps=100, update_flops=3e15,
                model_flops=2e15, prompt_length=2048)  # fmt: skip
    return StagePlan(**{**base, **kw})


def test_slots_that_fit_and_the_ragged_share():
    p = _stage()
    # 95 - 4 - 8 - 8 - 2 GiB of room, 8 GiB / 64 slots each
    assert p.slots_fit(95 * GiB) == 73 * 8 and p.held_share == 1.0
    r = _stage(ragged=True)
    assert r.held_share == pytest.approx((2048 + 8192) / (2048 + 16384))


def test_decode_and_update_bounds_are_rooflines_scaled_by_slots():
    bw, peak = 1e12, 1e14
    p = _stage()
    b = decode_bound(p, 64, bw, peak)
    assert b.step_s == pytest.approx(16 * GiB / bw)  # weights + whole cache, read once
    assert b.tokens_per_s == pytest.approx(64 / b.step_s)
    assert b.rollout_s == pytest.approx(4 * 16384 * b.step_s)  # 256 samples over 64 slots
    # 4x the slots: 4x the cache per step, a quarter of the rounds
    b4 = decode_bound(p, 256, bw, peak)
    assert b4.step_s == pytest.approx((8 + 32) * GiB / bw)
    assert b4.rollout_s == pytest.approx(16384 * b4.step_s)
    # the ragged kernel reads P + T/2 of the P + T cached positions
    r = decode_bound(_stage(ragged=True), 64, bw, peak)
    assert r.step_s == pytest.approx((8 + 8 * 10240 / 18432) * GiB / bw)
    # a flops-bound step: flops / peak
    assert decode_bound(_stage(decode_flops=1e13), 64, bw, peak).step_s == pytest.approx(0.1)
    # XLA's flops (or 6 N D when larger) / peak, per optimizer step
    assert update_bound(p, peak) == pytest.approx(2 * 3e15 / peak)
    assert update_bound(_stage(update_flops=0), peak) == pytest.approx(2 * 2e15 / peak)


def test_stage_and_recipe_totals_chip_hours_and_cost():
    a = TimeBound("16k", 660, rollout=600.0, update=60.0)
    b = TimeBound("32k", 660, rollout=1800.0, update=120.0)
    assert a.step == 660 and a.total == 660 * 660
    hours = (660 * 660 + 660 * 1920) / 3600
    assert chip_hours([a, b], 64) == pytest.approx(64 * hours)


def _plan(stages, kv_dtype=None, **kw):
    chip = CHIPS["v5p"]
    mc = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=4, num_kv_heads=2)  # fmt: skip
    engine = EngineOptions(dtype="bfloat16", kv_dtype=kv_dtype)
    return RunPlan("v5p-32", chip, 16, 16, mc, stages, {}, engine=engine, **kw)


def test_the_printed_plan_ends_with_time_chip_hours_and_cost():
    plan = _plan([_stage(), _stage(stage="32k", response_length=32768, steps=50)])
    text = format_plan(plan, price=2.5, shapes=())
    assert "slice: v5p-32 (v5p:2x2x4), 16 chips, 16 devices" in text
    assert "lower bounds" in text and "real steps are slower" in text
    bw, peak = 2765e9, 459e12
    bounds = [
        TimeBound(p.stage, p.steps, decode_bound(p, 64, bw, peak).rollout_s, update_bound(p, peak))
        for p in plan.stages
    ]
    total = chip_hours(bounds, 16)
    hours = sum(b.total for b in bounds) / 3600
    line = next(x for x in text.splitlines() if "as configured" in x)
    assert line == (
        f"  stage(s) 16k + 32k as configured: >= {hours:.1f} h on 16 chips = >= {total:,.0f} "
        f"chip-hours; at $2.5 per chip-hour: >= ${total * 2.5:,.0f}"
    )
    # (95 - 4 - 8 - 8 - 2) GiB / (8 GiB / 64): 584 slots at bfloat16; 256 samples per step
    assert "recommended rollout.max_concurrent_decodes: 256 " in text
    rec = next(x for x in text.splitlines() if "at the recommended slots" in x)
    assert "chip-hours; at $2.5" in rec
    assert "$" not in format_plan(plan, shapes=()).split("\ntime (")[1]  # no price, no cost


def test_a_stage_with_no_room_for_a_slot_gets_no_recommendation():
    # 10 GiB a slot: 7 fit in the 73 GiB left, not one for each of the 8 slot shards
    text = format_plan(_plan([_stage(kv_cache=640 * GiB)]), shapes=())
    assert "recommended rollout.max_concurrent_decodes: none fits" in text
    assert "at the recommended slots" not in text


def test_a_decode_step_over_hbm_is_recommended_slots_without_xla_s_stated_temporaries():
    # XLA refused the step: its 80 GiB of temporaries are what it asked, not a fitting
    # step's; the room beside the train state and the weights, 75 GiB, by 1/8 GiB a slot
    p = _stage(decode_temps=80 * GiB, over_hbm=("decode",))
    assert p.slots_fit(95 * GiB) == 0
    text = format_plan(
        _plan([_stage(samples=4096, decode_temps=80 * GiB, over_hbm=("decode",))]), shapes=()
    )
    assert "within the 600 slots that fit" in text
    assert "max_concurrent_decodes: 512 (" in text and "left out: the step was over HBM" in text


def test_the_int8_decode_line_gives_the_compiled_sizes_or_why_not():
    ok = Int8Decode(kv_cache=2 * GiB, temps=GiB // 2, step_bytes=6e9, cache_copies=0)
    text = format_plan(_plan([_stage(int8=ok)]), shapes=())
    (line,) = [x for x in text.splitlines() if "int8 KV cache" in x]
    assert "compiled (rollout.kv_dtype int8, bf16 weights): KV 2.00 GiB" in line
    assert "the compiled step copies no cache" in line
    # the room beside the train state, the bf16 weights and its temporaries, by 2 GiB / 64
    assert line.endswith(f"slots that fit: {int((95 - 4 - 8 - 8 - 0.5) * 32)}")
    bad = Int8Decode(error="JaxRuntimeError: INTERNAL: Mosaic failed")
    text = format_plan(_plan([_stage(int8=bad)]), shapes=())
    assert "int8 KV cache: the decode step did not compile: JaxRuntimeError" in text
    assert "not asked for" in format_plan(_plan([_stage()]), shapes=())
    assert "the run's own cache is int8" in format_plan(
        _plan([_stage()], kv_dtype="int8"), shapes=()
    )
