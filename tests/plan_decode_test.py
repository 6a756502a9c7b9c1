"""The planner's decode figures per rollout precision: arithmetic on a stage's compiled sizes."""

import pytest

from magic_jax.jobs.roofline import decode_options
from magic_jax.jobs.stage_plan import StagePlan
from magic_jax.jobs.topology import GiB


def _stage(**kw):
    base = dict(stage="T16K", response_length=16384, mesh={"data": 8}, rows=64, micro_batch=4,
                sgd_steps=1, params=4 * GiB, opt_state=8 * GiB, grads=4 * GiB, activations=GiB,
                batch=0, engine_params=8 * GiB, kv_cache=8 * GiB, decode_temps=2 * GiB,
                slots=64, decode_bytes=16 * GiB, decode_flops=1e9, samples=256)  # fmt: skip
    return StagePlan(**{**base, **kw})


def test_bf16_halves_and_int8_kv_quarters_the_cache_of_a_float32_plan():
    hbm, bw = 95 * GiB, 2.765e12
    f32, bf16, int8 = decode_options(_stage(), "float32", 128, hbm, bw)
    assert (f32.weights, f32.kv_cache) == (8 * GiB, 8 * GiB)
    assert (bf16.weights, bf16.kv_cache) == (4 * GiB, 4 * GiB)
    assert int8.weights == 4 * GiB
    assert int8.kv_cache == pytest.approx(8 * GiB * (1 + 4 / 128) / 4)  # + one f32 scale per head
    assert f32.step_bytes / bf16.step_bytes == pytest.approx(2.0)
    assert f32.step_bytes / int8.step_bytes > 2.5
    assert f32.tokens_per_s == pytest.approx(64 / (16 * GiB / bw))
    # slots: what is left beside train state, weights and temporaries, by KV bytes per slot
    assert f32.slots_fit == int((95 - 4 - 8 - 8 - 2) * GiB // (8 * GiB / 64))
    assert bf16.slots_fit > 2 * f32.slots_fit


def test_a_bf16_plan_scales_up_to_float32_and_nothing_fits_when_hbm_is_short():
    f32, bf16, _ = decode_options(_stage(), "bfloat16", 128, 95 * GiB, 1e12)
    assert f32.weights == 16 * GiB and bf16.weights == 8 * GiB
    tight = decode_options(_stage(), "float32", 128, 20 * GiB, 1e12)
    assert tight[0].slots_fit == 0 and tight[1].slots_fit > 0


def test_the_printed_plan_has_a_decode_line_per_precision():
    from magic_jax.jobs.plan import RunPlan, format_plan
    from magic_jax.jobs.topology import resolve_topology
    from magic_jax.model.config import ModelConfig

    s = resolve_topology("v5p:2x2x2")
    chip, chips = s.chip, s.chips
    mc = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=4, num_kv_heads=2)  # fmt: skip
    plan = RunPlan("v5p:2x2x2", chip, chips, chips, mc, [_stage()], {})  # the model's float32
    text = format_plan(plan, shapes=())
    assert "decode by rollout precision" in text
    lines = [x for x in text.splitlines() if "GB/step" in x]
    assert [x.split()[0] for x in lines] == ["*float32", "bfloat16", "bf16"]
    assert "(1.00x less than float32)" in lines[0] and "(2.00x less than float32)" in lines[1]


def test_a_plan_compiled_with_an_int8_cache_scales_from_its_int8_sizes():
    """rollout.kv_dtype=int8: the compiled cache is already 1 + 4/H bytes per element, so
    the options are the same as those of the bf16 plan of the same stage."""
    from magic_jax.jobs.roofline import own_option

    bf16_plan = decode_options(_stage(engine_params=4 * GiB, kv_cache=4 * GiB), "bfloat16",
                               128, 95 * GiB, 1e12)  # fmt: skip
    int8_kv = 4 * GiB * (1 + 4 / 128) / 2
    int8_plan = decode_options(_stage(engine_params=4 * GiB, kv_cache=int8_kv), "bfloat16",
                               128, 95 * GiB, 1e12, kv_dtype="int8")  # fmt: skip
    for a, b in zip(bf16_plan, int8_plan):
        assert a.kv_cache == pytest.approx(b.kv_cache) and a.slots_fit == b.slots_fit
    assert own_option("bfloat16", "int8") == "bf16 + int8 KV"
    assert own_option("float32", None) == "float32" and own_option("float32", "int8") is None


def test_the_update_counts_remat_s_forward_and_the_attention_s_square():
    from magic_jax.jobs.costs import attention_flops, matmul_params, update_row_flops
    from magic_jax.model.config import PRESETS

    mc = PRESETS["r1-distill-qwen-7b"]
    # the embedding is a lookup: 7.07B of the 7.62B parameters are multiplied
    assert matmul_params(mc) == mc.num_params() - 152064 * 3584
    assert 7.0e9 < matmul_params(mc) < 7.1e9
    n = 16384 + 2048
    forward = 2 * matmul_params(mc) * n + 4 * 28 * 28 * 128 * n * n  # q.k and p.v, all layers
    assert attention_flops(mc, n, n) == 4 * 28 * 28 * 128 * n * n
    none = update_row_flops(mc, n, "none", 0)
    assert none == pytest.approx(3 * forward)  # forward and backward
    assert update_row_flops(mc, n, "full", 0) - none == pytest.approx(forward)  # remat
    # the dense masked attention is half the matmuls' flops at 18K slots, and quadratic
    assert 0.5 < attention_flops(mc, n, n) / (2 * matmul_params(mc) * n) < 0.55
    attn = [update_row_flops(mc, x, "none", 0) - 6 * matmul_params(mc) * x for x in (n, 2 * n)]
    assert attn[1] == pytest.approx(4 * attn[0])
    # checkpointed query chunks run the attention's forward once more in the backward
    assert update_row_flops(mc, n, "full", 512) - update_row_flops(mc, n, "full", 0) == (
        pytest.approx(attention_flops(mc, n, n))
    )
    assert update_row_flops(mc, 256, "full", 512) == update_row_flops(mc, 256, "full", 0)


def test_the_splash_update_counts_the_causal_tiles_and_its_backward_s_recomputes():
    """``update.attention: splash``: the kernel's tiles on and below the diagonal of the
    18K row (36 x 37 / 2 tiles of 512^2, about half of L^2), with the backward's dq and
    dkv kernels each computing the scores and dp again (1.5 forwards more); no chunk."""
    from magic_jax.jobs.costs import attention_flops, matmul_params, update_row_flops
    from magic_jax.model.config import PRESETS

    mc = PRESETS["r1-distill-qwen-7b"]
    n = 16384 + 2048
    linear = 4 * 2 * matmul_params(mc) * n  # remat full: four forwards' worth
    dense = update_row_flops(mc, n, "full", 512) - linear
    splash = update_row_flops(mc, n, "full", 512, "splash") - linear
    assert dense == pytest.approx(5 * attention_flops(mc, n, n))
    assert splash == pytest.approx(5.5 * attention_flops(mc, 36 * 37 // 2 * 512**2, 1))
    assert 0.56 < splash / dense < 0.57
    assert update_row_flops(mc, n, "full", 0, "splash") - linear == pytest.approx(splash)


def test_a_decode_step_s_flops_are_its_rows_through_every_layer():
    from magic_jax.jobs.costs import decode_step_flops, matmul_params
    from magic_jax.model.config import PRESETS

    # the 7B at 256 slots on 64 devices: about 57 GFLOP a device in its matmuls, 86 with
    # the attention over a full 18K cache (XLA counts one scanned layer: 7.3)
    mc = PRESETS["r1-distill-qwen-7b"]
    per_device = decode_step_flops(mc, 256, 18432) / 64
    assert 85e9 < per_device < 87e9
    assert decode_step_flops(mc, 256, 0) == 256 * 2 * matmul_params(mc)
