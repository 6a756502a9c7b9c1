"""How a decode step's cache write compiles for a TPU slice, by cache layout.

A stand-alone decode step (attention of every layer over its cache, then each
slot's new key and value written into every layer) compiled (never run) for a
Cloud TPU slice through libtpu, with one KV head per device, in four forms:

* ``scatter``: the engine's earlier layout, layer-major [L, B, S, K, H], the write
  a scatter over slots (``jax.vmap`` of ``dynamic_update_slice``);
* ``select``: the same layout, the write a ``jnp.where`` over the whole cache;
* ``heads``: heads-major, [L, B, K, S, H], the write a scatter over slots;
* ``slots``: slot-major, [B, L, S, K, H] (the engine's next layout; it now
  stores [B, L, K, S, H], ``kv_cache.KVCache``), each slot's write a
  ``dynamic_update_slice``, each layer read with a dynamic index.

It prints XLA's bytes accessed and temporaries per device and the whole-cache
copies in the optimized HLO; ``scatter`` is the peer of the ratios.

    make test-tpu    # once: sets up .venv-tpu (jax[tpu] + libtpu)
    .venv-tpu/bin/python benchmarks/decode_cache_write.py
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from magic_jax.jobs.topology import topology_devices
from magic_jax.model.sharding import MeshConfig, make_mesh

LAYOUTS = {  # cache shape letters, mesh spec of the cache
    "scatter": ("LBSKH", P(None, "fsdp", None, "tensor", None)),
    "select": ("LBSKH", P(None, "fsdp", None, "tensor", None)),
    "heads": ("LBKSH", P(None, "fsdp", "tensor", None, None)),
    "slots": ("BLSKH", P("fsdp", None, None, "tensor", None)),
}


def step_fn(form: str, dims: dict[str, int]):
    """(k, v, q [B, K, G, H], at [B]) -> (k, v, sum of outputs): one decode step."""
    letters = LAYOUTS[form][0]
    kv = letters.replace("L", "").lower()  # a layer's cache, e.g. "bskh"
    s = dims["S"]

    def attend(q, kl, vl):
        scores = jnp.einsum(f"bkgh,{kv}->bkgs", q, kl)
        probs = jax.nn.softmax(scores.astype(jnp.float32), -1).astype(q.dtype)
        return jnp.einsum(f"bkgs,{kv}->bkgh", probs, vl)

    def step(k, v, q, at):
        def layer(total, i):
            axis = letters.index("L")
            kl, vl = (jax.lax.dynamic_index_in_dim(c, i, axis, keepdims=False) for c in (k, v))
            out = attend(q, kl, vl)
            return total + out.sum(), out[:, :, 0]  # one head's output as the new key

        total, new_LBKH = jax.lax.scan(layer, jnp.zeros((), q.dtype), jnp.arange(dims["L"]))
        new_LBKH = new_LBKH.astype(k.dtype)
        if form == "scatter":

            def write(c):
                def one_layer(c_BSKH, n_BKH):
                    return jax.vmap(
                        lambda cb, nb, a: jax.lax.dynamic_update_slice(cb, nb[None], (a, 0, 0))
                    )(c_BSKH, n_BKH, at)

                return jax.vmap(one_layer)(c, new_LBKH)
        elif form == "select":
            hit_BS = jnp.arange(s)[None, :] == at[:, None]

            def write(c):
                return jnp.where(hit_BS[None, :, :, None, None], new_LBKH[:, :, None], c)
        elif form == "heads":

            def write(c):
                def one_layer(c_BKSH, n_BKH):
                    return jax.vmap(
                        lambda cb, nb, a: jax.lax.dynamic_update_slice(cb, nb[:, None], (0, a, 0))
                    )(c_BKSH, n_BKH, at)

                return jax.vmap(one_layer)(c, new_LBKH)
        else:
            new_BLKH = new_LBKH.swapaxes(0, 1)

            def write(c):
                return jax.vmap(
                    lambda cb, nb, a: jax.lax.dynamic_update_slice(cb, nb[:, None], (0, a, 0, 0))
                )(c, new_BLKH, at)

        return write(k), write(v), total

    return step


def measure(form: str, mesh, dims: dict[str, int]) -> tuple[float, float, int]:
    """(GB accessed, GiB of temporaries, whole-cache copies) per device."""
    letters, spec = LAYOUTS[form]
    shape = tuple(dims[c] for c in letters)
    cache = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    q = jax.ShapeDtypeStruct(
        (dims["B"], dims["K"], dims["G"], dims["H"]),
        jnp.bfloat16,
        sharding=NamedSharding(mesh, P("fsdp", "tensor", None, None)),
    )
    at = jax.ShapeDtypeStruct((dims["B"],), jnp.int32, sharding=NamedSharding(mesh, P("fsdp")))
    out = (cache.sharding, cache.sharding, None)
    fn = jax.jit(step_fn(form, dims), donate_argnums=(0, 1), out_shardings=out)
    compiled = fn.lower(cache, cache, q, at).compile()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list | tuple) else ca
    copies = re.findall(rf"bf16\[[\d,]*{dims['S']}[\d,]*\]\{{[^}}]*\}} copy\(", compiled.as_text())
    temp = compiled.memory_analysis().temp_size_in_bytes
    return ca["bytes accessed"] / 1e9, temp / 2**30, len(copies)


def slice_setup(description: str) -> tuple[object, dict[str, int]]:
    """The command line's slice, mesh and cache shape (printed); (mesh, dims)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--topology", default="v6e:4x4")
    ap.add_argument("--fsdp", type=int, default=4)
    ap.add_argument("--tensor", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--length", type=int, default=18432)
    ap.add_argument("--kv-heads", type=int, default=4)
    args = ap.parse_args()
    mesh = make_mesh(
        MeshConfig(fsdp=args.fsdp, tensor=args.tensor), topology_devices(args.topology)
    )
    dims = dict(L=args.layers, B=args.slots, S=args.length, K=args.kv_heads, G=7, H=128)
    cache_gb = 2 * 2 * args.layers * args.slots * args.length * args.kv_heads * 128 / 1e9
    cache_gb /= args.fsdp * args.tensor
    print(
        f"{args.topology}, mesh {dict(mesh.shape)}; bf16 cache of {args.layers} layers, "
        f"{args.slots} slots of {args.length}, {args.kv_heads} KV heads: {cache_gb:.3f} GB "
        "per device (keys and values)"
    )
    return mesh, dims


def main() -> None:
    mesh, dims = slice_setup(__doc__.split("\n")[0])
    peer = None
    for form in LAYOUTS:
        gb, temp, copies = measure(form, mesh, dims)
        peer = peer or gb
        print(
            f"  {form:<8} {LAYOUTS[form][0]}: {gb:6.3f} GB accessed ({peer / gb:4.2f}x less "
            f"than scatter), temporaries {temp:5.3f} GiB, whole-cache copies {copies}",
            flush=True,
        )


if __name__ == "__main__":
    main()
