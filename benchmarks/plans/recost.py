"""A committed plan's compiled sizes with today's costs, without compiling again: the
sharded terms (parameters, optimizer state, cache, weights) come from ``plan_stage``
with ``compile=False``; the compiled temporaries and XLA's update count are read from
the committed plan's text (GiB to two decimals); then ``format_plan`` prints it.

  .venv-tpu/bin/python benchmarks/plans/recost.py configs/skywork-or1-32b.yaml v6e-128 \
      benchmarks/plans/32b-v6e-128.txt > benchmarks/plans/32b-v6e-128-recosted.txt
"""

import re
import sys
from pathlib import Path

from magic_jax.jobs.plan import RunPlan, format_plan
from magic_jax.jobs.stage_plan import (
    Int8Decode,
    decode_step_flops,
    plan_stage,
    resolve_model,
    update_row_flops,
)
from magic_jax.jobs.topology import GiB, resolve_topology, topology_devices
from magic_jax.model.sharding import MeshConfig, make_mesh
from magic_jax.run.config import load_config


def _compiled(text: str) -> list[dict[str, float]]:
    """Per stage of a plan's text: its compiled activations and decode temporaries (GiB),
    XLA's update flops and the int8 decode step's cache, temporaries and bytes."""
    out = []
    for block in text.split("\nstage ")[1:]:
        act = re.search(r"activations/temporaries\s+([\d.]+)", block)
        temps = re.search(r"decode/prefill temporaries\s+-\s+([\d.]+)", block)
        xla = re.search(r"update mini-batch: ([\d.]+) TFLOP", block)
        i8 = re.search(
            r"KV ([\d.]+) GiB, decode temporaries ([\d.]+) GiB, a step reads >= ([\d.]+) GB, "
            r"the compiled step copies (?:the cache (\d+)|no)",
            block,
        )
        out.append(dict(
            act=float(act[1]), temps=float(temps[1]), xla=float(xla[1]) * 1e12,
            i8=(float(i8[1]), float(i8[2]), float(i8[3]) * 1e9, int(i8[4] or 0)),
        ))  # fmt: skip
    return out


def main(config_path: str, topology: str, committed: str) -> None:
    old = _compiled(Path(committed).read_text())
    config = load_config(config_path, ())
    slice_ = resolve_topology(topology)
    devices = topology_devices(topology)
    mesh = make_mesh(config.mesh or MeshConfig(), devices)
    mc = resolve_model(config.model, config.param_dtype)
    plan = RunPlan(topology, slice_.chip, len(devices), slice_.chips, mc, [], {})
    plan.remat = config.update.remat or mc.remat
    plan.compute_dtype = config.update.compute_dtype or mc.dtype
    plan.engine = config.rollout
    chunk = config.update.attention_chunk
    chunk = mc.attention_chunk if chunk is None else chunk
    for i, c in enumerate(old):
        p = plan_stage(config, i, mc, mesh, compile=False)
        p.activations, p.decode_temps = int(c["act"] * GiB), int(c["temps"] * GiB)
        p.update_flops = c["xla"]
        p.model_flops = update_row_flops(mc, p.row_length, plan.remat, chunk) * p.rows / mesh.size
        p.decode_bytes = p.engine_params + p.kv_cache
        cache = p.prompt_length + p.response_length
        p.decode_flops = decode_step_flops(mc, p.slots, cache) / mesh.size
        kv, temps, step, copies = c["i8"]
        p.int8 = Int8Decode(int(kv * GiB), int(temps * GiB), step, copies)
        plan.stages.append(p)
    print(
        f"# {committed}'s compiled sizes with today's costs, not compiled again "
        f"(benchmarks/plans/recost.py {config_path} {topology} {committed})"
    )
    print(format_plan(plan))


if __name__ == "__main__":
    main(*sys.argv[1:4])
