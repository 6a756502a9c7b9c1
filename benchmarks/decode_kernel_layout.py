"""Whether the ragged decode kernel's step copies the KV cache on a TPU slice, by layout.

A stand-alone decode step (the ragged attention kernel over every layer of the
cache, then each slot's new key and value written into every layer) compiled
(never run) for a Cloud TPU slice through libtpu, with one KV head per device, in
two forms:

* ``layer-major``: the peer, a layer-major cache [L, B, K, S, H], each layer's
  [B, K, S, H] slice handed to the kernel, the write a scatter over slots;
* ``engine``: the engine's own code: the cache [B, L, K, S, H] read whole by
  ``ragged_attention.past_attention`` at the layer's index, the write
  ``kv_cache.write_token`` (a ``dynamic_update_slice`` per slot), as
  ``decode.decode_forward``.

It prints the temporaries per device and the whole-cache copies in the optimized
HLO. The kernel's declared cost is the attended cache whatever the layout, so
XLA's bytes accessed are left out (``decode_cache_write.py`` counts them for the
dense product).

    make test-tpu    # once: sets up .venv-tpu (jax[tpu] + libtpu)
    .venv-tpu/bin/python benchmarks/decode_kernel_layout.py
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
from decode_cache_write import slice_setup  # benchmarks/, the script's own folder
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from magic_jax.model.kv_cache import write_slot, write_token
from magic_jax.rollout import ragged_attention as ra

FORMS = {  # cache letters, the cache's mesh spec
    "layer-major": ("LBKSH", P(None, "fsdp", "tensor")),
    "engine": ("BLKSH", P("fsdp", None, "tensor")),
}


def step_fn(form: str, mesh, dims: dict[str, int]):
    """(k, v, q [B, K, G, H], at [B]) -> (k, v, sum of outputs): one decode step."""
    spec = ra.RaggedSpec("tpu", mesh, "fsdp", "tensor")

    def attend(q, k, v, i, at):
        if form == "engine":
            return ra.past_attention(q, k, v, i, at, spec)[0]
        # the layer's slice, seen by the kernel as a one-layer cache
        kl, vl = (jax.lax.dynamic_index_in_dim(c, i, 0, keepdims=False)[:, None] for c in (k, v))
        return ra.past_attention(q, kl, vl, 0, at, spec)[0]

    def step(k, v, q, at):
        def layer(total, i):
            out = attend(q, k, v, i, at)
            return total + out.sum(), out[:, :, 0].astype(k.dtype)  # one head as the new key

        total, new_LBKH = jax.lax.scan(layer, jnp.zeros(()), jnp.arange(dims["L"]))
        if form == "engine":
            return write_token(k, new_LBKH, at), write_token(v, new_LBKH, at), total
        # the write of a layer-major cache: a scatter over slots
        scatter = jax.vmap(functools.partial(write_slot, axis=2), in_axes=(0, 0, None))
        return scatter(k, new_LBKH, at), scatter(v, new_LBKH, at), total

    return step


def measure(form: str, mesh, dims: dict[str, int]) -> tuple[float, int]:
    """(GiB of temporaries, whole-cache copies) per device."""
    letters, spec = FORMS[form]
    sh = NamedSharding(mesh, spec)
    cache = jax.ShapeDtypeStruct(tuple(dims[c] for c in letters), jnp.bfloat16, sharding=sh)
    q = jax.ShapeDtypeStruct(
        (dims["B"], dims["K"], dims["G"], dims["H"]),
        jnp.bfloat16,
        sharding=NamedSharding(mesh, P("fsdp", "tensor")),
    )
    at = jax.ShapeDtypeStruct((dims["B"],), jnp.int32, sharding=NamedSharding(mesh, P("fsdp")))
    # Mosaic reads the chip generation from the default device
    with jax.default_device(mesh.devices.flat[0]):
        fn = jax.jit(step_fn(form, mesh, dims), donate_argnums=(0, 1), out_shardings=(sh, sh, None))
        compiled = fn.lower(cache, cache, q, at).compile()
    copies = re.findall(rf"bf16\[[\d,]*{dims['S']}[\d,]*\]\{{[^}}]*\}} copy\(", compiled.as_text())
    return compiled.memory_analysis().temp_size_in_bytes / 2**30, len(copies)


def main() -> None:
    mesh, dims = slice_setup(__doc__.split("\n")[0])
    peer = None
    for form in FORMS:
        temp, copies = measure(form, mesh, dims)
        peer = temp if peer is None else peer
        small = temp < 2**-10  # under 1 MiB: no cache-sized buffer
        ratio = "under 1 MiB" if small else f"{peer / temp:4.2f}x less than layer-major"
        print(
            f"  {form:<12} {FORMS[form][0]}: temporaries {temp:5.3f} GiB ({ratio}), "
            f"whole-cache copies {copies}",
            flush=True,
        )


if __name__ == "__main__":
    main()
