"""Whether the ragged decode kernel's step copies the KV cache on a TPU slice, by layout.

A stand-alone decode step (the ragged attention kernel over every layer of the
cache, then each slot's new key and value written into every layer) compiled
(never run) for a Cloud TPU slice through libtpu, with one KV head per device, in
five forms:

* ``engine``: the engine today: cache [L, B, S, K, H], each layer's [B, S, K, H]
  slice handed to ``ragged_attention.past_attention``, the write a scatter over
  slots (as ``decode.decode_forward``);
* ``stacked``: the same cache handed whole to the kernel, which reads the layer at
  a traced index (scalar-prefetched), no slice;
* ``stacked-1``: as ``stacked``, a device's single KV head squeezed out of the
  kernel's operand ([L, B, S, H] per device);
* ``slots``: a slot-major cache [B, L, S, K, H], read whole at the layer's index,
  each slot's write a ``dynamic_update_slice``;
* ``slots-1``: as ``slots``, the single KV head squeezed.

It prints the whole-cache copies in the optimized HLO and the temporaries per
device; ``engine`` is the peer. The kernel declares no cost here, so XLA's bytes
accessed are left out.

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

from magic_jax.rollout import ragged_attention as ra

FORMS = {  # cache letters, the kernel reads the whole cache, one KV head squeezed
    "engine": ("LBSKH", False, False),
    "stacked": ("LBSKH", True, False),
    "stacked-1": ("LBSKH", True, True),
    "slots": ("BLSKH", True, False),
    "slots-1": ("BLSKH", True, True),
}


class _OneHead:
    """A [bs, H] block ref read as the [bs, 1, H] ref the kernel indexes (``[:, 0, :]``)."""

    def __init__(self, ref):
        self.ref, self.dtype = ref, ref.dtype

    def __getitem__(self, index):
        return self.ref[...]


def _stacked_kernel(q, k, v, layer, lengths, *, letters: str, squeeze: bool, bs: int):
    """The kernel over a whole stacked cache at ``layer`` (one device's rows and heads)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    b, kh, g, h = q.shape
    s = k.shape[2]
    squeeze = squeeze and kh == 1
    if squeeze:
        k, v = k[..., 0, :], v[..., 0, :]

    def kv_block(i, j, lay, lens):
        jj = jnp.minimum(j, jnp.maximum(lens[i] - 1, 0) // bs)
        at = (i, lay[0], jj, 0, 0) if letters == "BLSKH" else (lay[0], i, jj, 0, 0)
        return at[:4] if squeeze else at

    def row(i, j, lay, lens):
        return (i, 0, 0, 0)

    def kernel(lay_ref, len_ref, q_ref, k_ref, v_ref, *rest):
        if squeeze:
            k_ref, v_ref = _OneHead(k_ref), _OneHead(v_ref)
        ra._tpu_kernel(len_ref, q_ref, k_ref, v_ref, *rest, bs=bs, k_heads=kh)

    block = (None, None, bs, h) if squeeze else (None, None, bs, kh, h)
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, s // bs),
        in_specs=[pl.BlockSpec((None, kh, g, h), row), *[pl.BlockSpec(block, kv_block)] * 2],
        out_specs=[pl.BlockSpec((None, kh, g, h), row), pl.BlockSpec((None, kh, g, 1), row)],
        scratch_shapes=[
            pltpu.VMEM((kh, g, 1), jnp.float32),
            pltpu.VMEM((kh, g, 1), jnp.float32),
            pltpu.VMEM((kh, g, h), jnp.float32),
        ],
    )
    out, _ = pl.pallas_call(
        kernel,
        grid_spec=grid,
        out_shape=[
            jax.ShapeDtypeStruct((b, kh, g, h), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, g, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    )(jnp.reshape(layer, (1,)), lengths, q, k, v)
    return out


def step_fn(form: str, mesh, dims: dict[str, int]):
    """(k, v, q [B, K, G, H], at [B]) -> (k, v, sum of outputs): one decode step."""
    letters, whole, squeeze = FORMS[form]
    rows = ("fsdp", None) if letters == "BLSKH" else (None, "fsdp")
    spec = P(*rows, None, "tensor")
    kernel = functools.partial(_stacked_kernel, letters=letters, squeeze=squeeze, bs=128)

    def attend(q, k, v, i, at):
        if not whole:  # the engine: the layer's slice to the library's kernel
            kl, vl = (jax.lax.dynamic_index_in_dim(c, i, 0, keepdims=False) for c in (k, v))
            out, _ = ra.past_attention(q, kl, vl, at, ra.RaggedSpec("tpu", mesh, "fsdp", "tensor"))
            return out
        return jax.shard_map(
            kernel,
            mesh=mesh,
            in_specs=(P("fsdp", "tensor"), spec, spec, P(), P("fsdp")),
            out_specs=P("fsdp", "tensor"),
            check_vma=False,
        )(q, k, v, i, at)

    def step(k, v, q, at):
        def layer(total, i):
            out = attend(q, k, v, i, at)
            return total + out.sum(), out[:, :, 0].astype(k.dtype)  # one head as the new key

        total, new_LBKH = jax.lax.scan(layer, jnp.zeros(()), jnp.arange(dims["L"]))
        if letters == "BLSKH":
            new_BLKH = new_LBKH.swapaxes(0, 1)

            def write(c):
                return jax.vmap(
                    lambda cb, nb, a: jax.lax.dynamic_update_slice(cb, nb[:, None], (0, a, 0, 0))
                )(c, new_BLKH, at)
        else:

            def write(c):
                def one_layer(c_BSKH, n_BKH):
                    return jax.vmap(
                        lambda cb, nb, a: jax.lax.dynamic_update_slice(cb, nb[None], (a, 0, 0))
                    )(c_BSKH, n_BKH, at)

                return jax.vmap(one_layer)(c, new_LBKH)

        return write(k), write(v), total

    return step, spec


def measure(form: str, mesh, dims: dict[str, int]) -> tuple[float, int]:
    """(GiB of temporaries, whole-cache copies) per device."""
    step, spec = step_fn(form, mesh, dims)
    shape = tuple(dims[c] for c in FORMS[form][0])
    sh = NamedSharding(mesh, spec)
    cache = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sh)
    q = jax.ShapeDtypeStruct(
        (dims["B"], dims["K"], dims["G"], dims["H"]),
        jnp.bfloat16,
        sharding=NamedSharding(mesh, P("fsdp", "tensor")),
    )
    at = jax.ShapeDtypeStruct((dims["B"],), jnp.int32, sharding=NamedSharding(mesh, P("fsdp")))
    # Mosaic reads the chip generation from the default device
    with jax.default_device(mesh.devices.flat[0]):
        fn = jax.jit(step, donate_argnums=(0, 1), out_shardings=(sh, sh, None))
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
        ratio = "under 1 MiB" if small else f"{peer / temp:4.2f}x less than engine"
        print(
            f"  {form:<10} {FORMS[form][0]}: temporaries {temp:5.3f} GiB ({ratio}), "
            f"whole-cache copies {copies}",
            flush=True,
        )


if __name__ == "__main__":
    main()
