"""The plan's printed lines for one stage (memory by phase, decode by rollout precision,
the decode step, the recommended slots) and for the run's roofline time bounds."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from magic_jax.jobs.roofline import (
    DecodeBound,
    DecodeOption,
    TimeBound,
    chip_hours,
    decode_bound,
    own_option,
    recommend_slots,
)
from magic_jax.jobs.stage_plan import StagePlan
from magic_jax.jobs.topology import GiB, resolve_topology

if TYPE_CHECKING:
    from magic_jax.jobs.plan import RunPlan


def stage_lines(
    plan: RunPlan, p: StagePlan, opts: list[DecodeOption], bw: float, peak: float
) -> tuple[list[str], int]:
    """Stage ``p``'s lines of the plan (its memory, decode by rollout precision, decode step,
    slots, and where it fits if not here) and its recommended decode slots (0: none fits);
    ``opts`` its ``roofline.decode_options``, ``bw`` and ``peak`` a device's HBM bandwidth
    (bytes/s) and bf16 flops/s."""
    lines = _stage_header(p, plan.hbm_bytes) + _option_lines(plan, p, opts)
    slot_lines, rec = _slot_lines(plan, p, bw, peak)
    lines += _decode_step_lines(p, bw, peak, opts[0].step_bytes) + slot_lines
    if p.peak() > plan.hbm_bytes:
        lines += _no_fit_lines(plan, p)
    return lines, rec


def _copies(n: int) -> str:
    if n == 0:
        return "the compiled step copies no cache"
    return f"the compiled step copies the cache {n} time(s): a relayout, more bytes than this"


def _ragged_lines(p: StagePlan, float32_step: float) -> list[str]:
    """What the ragged decode attention reads: the weights and each row's held slots."""
    if not p.ragged or not p.kv_cache:
        return ["  decode attention: dense (the whole attended cache every step)"]
    s = p.prompt_length + p.response_length
    step = p.engine_params + p.kv_cache * p.held_share
    return [
        "  decode attention: ragged (the TPU kernel, in the decode step above): rows hold "
        f"P + T/2 = {p.prompt_length + p.response_length // 2} of {s} slots on average, so a step "
        f"reads {step / 1e9:.2f} GB ({(p.engine_params + p.kv_cache) / step:.2f}x less than "
        f"the full cache, {float32_step / step:.2f}x less than float32's full step)"
    ]


def _gib(n: float) -> str:
    return f"{n / GiB:9.2f}"


def _int8_line(p: StagePlan, weights: float, hbm: float, kv_dtype: str | None) -> str:
    """The decode step compiled with an int8 cache: its sizes, or why there are none."""
    q = p.int8
    if q is None:
        why = "the run's own cache is int8: * above" if kv_dtype else "not asked for"
        return f"    int8 KV cache: not compiled separately ({why})"
    if q.error:
        return f"    int8 KV cache: the decode step did not compile: {q.error}"
    head = (
        f"    int8 KV cache, compiled (rollout.kv_dtype int8, bf16 weights): KV "
        f"{q.kv_cache / GiB:.2f} GiB, decode temporaries {q.temps / GiB:.2f} GiB"
    )
    if q.over_hbm:
        return head + " (XLA refused it: over HBM)"
    # with copies of the cache the temporaries grow with the slots: scaled with them
    per_slot = (q.kv_cache + (q.temps if q.cache_copies else 0)) / p.slots
    room = hbm - p.params - p.opt_state - weights - (0 if q.cache_copies else q.temps)
    fit = max(0, int(room // per_slot)) if per_slot > 0 else 0
    return (
        f"{head}, a step reads >= {q.step_bytes / 1e9:.2f} GB, "
        f"{_copies(q.cache_copies)}; slots that fit: {fit}"
    )


def _stage_header(p: StagePlan, hbm: float) -> list[str]:
    mesh = " x ".join(f"{k} {v}" for k, v in p.mesh.items())
    lines = [
        "",
        f"stage {p.stage}: T {p.response_length}, {p.steps} steps; mesh {mesh}; update: "
        f"{p.rows} rows in micro-batches of {p.micro_batch}, {p.sgd_steps} optimizer step(s) "
        "per step",
        f"  {'per device, GiB':<30}{'update':>9}{'rollout':>9}",
    ]
    for label, (u, r) in p.terms().items():
        lines.append(f"  {label:<30}{_gib(u)}{_gib(r)}".replace("     0.00", "        -"))
    verdict = "fits" if p.peak() <= hbm else "DOES NOT FIT"
    lines.append(
        f"  {'total':<30}{_gib(p.update_total)}{_gib(p.rollout_total)}"
        f"  of {hbm / GiB:.2f}: {verdict}"
    )
    if p.over_hbm:
        lines.append(
            f"  XLA refused the {' and '.join(p.over_hbm)} program(s) for this chip "
            "(over HBM); their temporaries above are the sizes XLA stated"
        )
    return lines


def _option_lines(plan: RunPlan, p: StagePlan, opts: list[DecodeOption]) -> list[str]:
    own = own_option(plan.rollout_dtype, plan.kv_dtype)
    lines = [
        f"  decode by rollout precision (sizes scaled from this plan's, * compiled; "
        f"{p.slots} slots at T {p.response_length}):"
    ]
    for o in opts:
        mark = "*" if o.label == own else " "
        lines.append(
            f"   {mark}{o.label:<15} weights {o.weights / GiB:6.2f} GiB, "
            f"KV {o.kv_cache / GiB:6.2f} GiB: {o.step_bytes / 1e9:6.2f} GB/step "
            f"({opts[0].step_bytes / o.step_bytes:.2f}x less than "
            f"float32), <= {o.tokens_per_s:,.0f} tokens/s; slots that fit: {o.slots_fit}"
        )
    lines.append("    (set by rollout.dtype and rollout.kv_dtype; the last is bfloat16 + int8)")
    return [*lines, _int8_line(p, opts[-1].weights, plan.hbm_bytes, plan.kv_dtype)]


def _bound_text(b: DecodeBound) -> str:
    return (
        f"{b.slots} slots >= {b.step_s * 1e3:.2f} ms/step, <= {b.tokens_per_s:,.0f} tokens/s, "
        f">= {b.rollout_s / 60:.1f} min"
    )


def _slot_lines(plan: RunPlan, p: StagePlan, bw: float, peak: float) -> tuple[list[str], int]:
    """The recommended decode slots and the decode bound there and as configured."""
    over = "decode" in p.over_hbm  # its temporaries are XLA's ask, not a fitting step's
    fit = (dataclasses.replace(p, decode_temps=0) if over else p).slots_fit(plan.hbm_bytes)
    shards = p.mesh.get("data", 1) * p.mesh.get("fsdp", 1)
    rec = recommend_slots(fit, p.samples, shards)
    precision = plan.rollout_dtype + (" + int8 KV" if plan.kv_dtype else "")
    why = (
        f"the largest power of two, a multiple of the {shards} slot shards, within the {fit} "
        f"slots that fit at {precision} and the {p.samples} samples per step"
    )
    if not rec:
        return [f"  recommended rollout.max_concurrent_decodes: none fits ({why})"], 0
    reads = "ragged reads" if p.ragged else "the whole cache"
    lines = [
        f"  recommended rollout.max_concurrent_decodes: {rec} ({why}; scaled from the "
        "compiled sizes, decode temporaries "
        + ("left out: the step was over HBM as configured)" if over else "as compiled)"),
        f"  decode roofline ({reads}, {p.samples} samples of T): configured "
        f"{_bound_text(decode_bound(p, p.slots, bw, peak))}; recommended "
        f"{_bound_text(decode_bound(p, rec, bw, peak))}",
    ]
    return lines, rec


def _decode_step_lines(p: StagePlan, bw: float, peak: float, base: float) -> list[str]:
    t_dec = max(p.decode_bytes / bw, p.decode_flops / peak)
    full = math.ceil(p.samples / p.slots) * p.response_length * t_dec
    return [
        f"  decode step over the full cache: {p.decode_bytes / 1e9:.2f} GB read "
        f"({_copies(p.decode_cache_copies)}), "
        f"{p.decode_flops / 1e9:.1f} GFLOP per device -> >= {t_dec * 1e3:.2f} ms, "
        f"<= {p.slots / t_dec:,.0f} tokens/s over {p.slots} slots; "
        f"{p.samples} samples all of length T: >= {full / 60:.1f} min",
        *_ragged_lines(p, base),
        f"  update mini-batch: {p.update_flops / 1e12:.1f} TFLOP per device (XLA, 0 if "
        f"not compiled; counted, every row at P + T with remat and the attention's scores: "
        f"{p.model_flops / 1e12:.1f}) -> >= "
        f"{max(p.update_flops, p.model_flops) / peak:.1f} s at the bf16 peak; "
        f"x {p.sgd_steps} per step",
    ]


def _no_fit_lines(plan: RunPlan, p: StagePlan) -> list[str]:
    c = plan.chip
    lines = [f"  largest term: {p.dominant()}"]
    if p.stage in plan.fits_on:
        fit = plan.fits_on[p.stage]
        if fit is None:
            lines.append(f"  no {c.name} slice up to {c.topologies[-1]} fits it")
        else:
            name, q = fit
            m = " x ".join(f"{k} {v}" for k, v in q.mesh.items())
            lines.append(
                f"  smallest {c.name} slice that fits: {resolve_topology(name)} (mesh {m}, "
                f"micro-batches of {q.micro_batch}): peak {q.peak() / GiB:.2f} GiB per device "
                "(compiled)"
            )
    return lines


def _dur(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _money(chip_h: float, price: float | None) -> str:
    return f"; at ${price:g} per chip-hour: >= ${chip_h * price:,.0f}" if price else ""


def time_lines(
    plan: RunPlan, bounds: list[TimeBound], at_rec: list[TimeBound], price: float | None
) -> list[str]:
    """The recipe's time, chip-hour and cost bounds (as configured and at the
    recommended slots)."""
    lines = [
        "",
        "time (roofline lower bounds: a decode step's bytes / HBM bandwidth, an update's "
        "flops / bf16 peak; every response run to T; prefill, the log-prob pass, "
        "collectives and host work left out: real steps are slower)",
    ]
    for b in bounds:
        lines.append(
            f"  stage {b.stage}: per step >= {_dur(b.step)} (rollout >= {_dur(b.rollout)} + "
            f"update >= {_dur(b.update)}) x {b.steps} steps: >= {b.total / 3600:.1f} h"
        )
    unfit = [p.stage for p in plan.stages if p.peak() > plan.hbm_bytes]
    for label, bs in (("as configured", bounds), ("at the recommended slots", at_rec)):
        if len(bs) < len(plan.stages):
            continue
        hours = sum(b.total for b in bs) / 3600
        ch = chip_hours(bs, plan.chips)
        lines.append(
            f"  stage(s) {' + '.join(b.stage for b in bs)} {label}: >= {hours:.1f} h on "
            f"{plan.chips} chips = >= {ch:,.0f} chip-hours{_money(ch, price)}"
        )
    if unfit:
        lines.append(f"  (stage(s) {', '.join(unfit)} do not fit this slice as configured)")
    return lines
