"""The update's per-device temporaries on a TPU slice: activations pinned to their rows
against left to XLA, compiled (never run) for the slice through libtpu.

One micro-batch of the released 7B recipe's update (loss and gradients; remat full,
bf16 compute) is compiled for a Cloud TPU slice at a 7B shape cut to a few layers,
twice per depth: with the residual stream pinned to the rows' sharding (and, between
layers, its embed axis split over ``tensor``), as the trainer runs it, and without
(``batch_sharding=None``: XLA picks the activations' layout), which is how the update
compiled before. XLA's memory analysis gives the temporaries; two depths give the
per-layer slope, extrapolated to the full depth.

    make test-tpu    # once: sets up .venv-tpu (jax[tpu] + libtpu)
    .venv-tpu/bin/python benchmarks/update_activations.py                   # v6e:8x8, T 32768
    .venv-tpu/bin/python benchmarks/update_activations.py --response 16384 --chunk 2048
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from magic_jax.jobs.stage_plan import abstract_batch
from magic_jax.jobs.topology import topology_devices
from magic_jax.model.config import ModelConfig
from magic_jax.model.qwen2 import abstract_model
from magic_jax.model.sharding import BATCH_AXES, TRAIN_RULES, MeshConfig, make_mesh, model_shardings
from magic_jax.update.config import UpdateConfig
from magic_jax.update.losses import LossConfig
from magic_jax.update.step import StepSpec, loss_and_grads

GIB = 2**30
# DeepSeek-R1-Distill-Qwen-7B's shape; the depth is the benchmark's
SHAPE_7B = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_heads=28,
    num_kv_heads=4,
)


def temporaries(layers: int, pinned: bool, args: argparse.Namespace, mesh) -> float:
    """GiB of XLA temporaries per device of one micro-batch's loss and gradients."""
    model = ModelConfig(num_layers=layers, attention_chunk=args.chunk, **SHAPE_7B)
    graphdef, params = nnx.split(abstract_model(model), nnx.Param)
    shardings = model_shardings(params, mesh, TRAIN_RULES)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings
    )
    batch = abstract_batch(args.prompt, args.response, args.rows, mesh)
    cfg = UpdateConfig(
        mini_batch_groups=args.rows // 2,
        remat="full",
        compute_dtype="bfloat16",
        loss=LossConfig(),
    )
    rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES)) if pinned else None
    fn = jax.jit(
        functools.partial(loss_and_grads, spec=StepSpec(graphdef, cfg, batch_sharding=rows))
    )
    alpha = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    compiled = fn.lower(params, batch, alpha).compile()
    return compiled.memory_analysis().temp_size_in_bytes / GIB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topology", default="v6e:8x8")
    ap.add_argument("--tensor", type=int, default=4)
    ap.add_argument("--rows", type=int, default=16, help="rows per micro-batch")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--response", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=512, help="attention_chunk")
    ap.add_argument("--layers", type=int, nargs=2, default=(2, 4))
    ap.add_argument("--full-depth", type=int, default=28)
    args = ap.parse_args()
    mesh = make_mesh(MeshConfig(fsdp=-1, tensor=args.tensor), topology_devices(args.topology))
    print(
        f"{args.topology}, mesh {dict(mesh.shape)}; 7B shape, {args.rows} rows of "
        f"{args.prompt} + {args.response} tokens, attention_chunk {args.chunk}; "
        "XLA temporaries per device, GiB"
    )
    found = {}
    for pinned in (False, True):
        t0 = time.perf_counter()
        a, b = (temporaries(n, pinned, args, mesh) for n in args.layers)
        slope = (b - a) / (args.layers[1] - args.layers[0])
        full = a + slope * (args.full_depth - args.layers[0])
        found[pinned] = full
        name = "rows pinned (the trainer)" if pinned else "left to XLA (before)"
        print(
            f"  {name:<26} L={args.layers[0]}: {a:6.2f}  L={args.layers[1]}: {b:6.2f}  "
            f"per layer {slope:5.2f}  L={args.full_depth}: {full:6.2f}  "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    print(f"ratio at L={args.full_depth}: {found[False] / found[True]:.2f}x less with rows pinned")


if __name__ == "__main__":
    main()
