"""The token log-prob and entropy formula (``model.logprobs.logprob_entropy_lse``) against the
one it replaced, same run, interleaved: what accuracy for large logits costs.

The shipped formula takes H = (lse - m) - E_p[z - m], m the row's largest logit, whose
terms are of H's size; the old one took H = lse - E_p[z], which loses H to fp32 rounding
when the logits are large. Both read the logits in the same passes (a max, a sum of
exponentials, a weighted sum); sharing exp(z - m) between two sums, or masking -inf
logits inside the last sum, made XLA's CPU code 2-2.5x slower at the update's shape.
Shapes: the sampler's [32, V] rows per decode step and one update chunk [4, 512, V],
V = 32768 (the benchmark model's).

    python benchmarks/entropy_formula.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from magic_jax.model.logprobs import logprob_entropy_lse


def old_formula(z_NV, targets_N):
    lse_N = jax.nn.logsumexp(z_NV, axis=-1)
    tgt_N = jnp.take_along_axis(z_NV, targets_N[..., None], axis=-1)[..., 0]
    ent_N = lse_N - jnp.sum(jnp.exp(z_NV - lse_N[..., None]) * z_NV, axis=-1)
    return tgt_N - lse_N, ent_N, lse_N


def _time(fn, z, t, inner: int) -> float:
    jax.block_until_ready(fn(z, t))
    t0 = time.perf_counter()
    for _ in range(inner):
        out = fn(z, t)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / inner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--vocab", type=int, default=32768)
    args = ap.parse_args()
    v = args.vocab
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} {jax.devices()[0].platform}, V {v}, {args.repeats} repeats")
    cols = "old ms | new ms | old / new (median, min-max) | max |H err| old / new"
    print(f"| shape | logit scale | {cols} |")
    print("|---|---|---|---|---|---|")
    for shape, inner in (((32, v), 50), ((4, 512, v), 3)):
        for scale in (3.0, 140.0):
            z = jnp.asarray((rng.standard_normal(shape) * scale / 4).astype(np.float32))
            t = jnp.asarray(rng.integers(0, v, shape[:-1]))
            new, old = jax.jit(logprob_entropy_lse), jax.jit(old_formula)
            ratios, t_old, t_new = [], [], []
            for _ in range(args.repeats):  # interleaved: drift hits both
                a, b = _time(old, z, t, inner), _time(new, z, t, inner)
                t_old.append(a)
                t_new.append(b)
                ratios.append(a / b)
            zr = np.asarray(z, np.float64)[..., :]
            u = zr - zr.max(-1, keepdims=True)
            logq = u - np.log(np.exp(u).sum(-1, keepdims=True))
            h = -(np.exp(logq) * logq).sum(-1)
            err_old = float(np.abs(np.asarray(old(z, t)[1]) - h).max())
            err_new = float(np.abs(np.asarray(new(z, t)[1]) - h).max())
            print(
                f"| {list(shape)} | {scale:g} | {1e3 * statistics.median(t_old):.2f} | "
                f"{1e3 * statistics.median(t_new):.2f} | {statistics.median(ratios):.3f}x "
                f"({min(ratios):.3f}-{max(ratios):.3f}) | {err_old:.1e} / {err_new:.1e} |"
            )


if __name__ == "__main__":
    main()
