"""The products' floor: XLA:CPU's matrix products against PyTorch's at the shapes of the
rollout and update benchmarks, in the same run.

``benchmarks/rollout.py`` (W1: 32 rows of a 57.7M Qwen2-shaped model, D 512, F 1536,
V 32768, 8 layers, 8 / 2 heads of 64) and ``benchmarks/loss_memory.py`` (8 x 512 tokens of
the same model) are measured against transformers on PyTorch. A decode step and an update
step are mostly matrix products, so their ratio against the peer cannot beat the ratio of the
two libraries' products by much. This prints, for each shape, the time of one float32 product
in XLA (jitted) and in PyTorch (same threads), and the time of all of one decode step's
products (q, k, v, o, gate, up, down of every layer and the unembedding; no attention, no
sampling) in XLA as a Python loop over per-layer weights, as a ``lax.scan`` over stacked
weights (the model's layout), and in PyTorch.

    .venv/bin/python benchmarks/product_floor.py
    .venv/bin/python benchmarks/product_floor.py --rows 64 --threads 2
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

D, F, V, LAYERS, HEADS, KV_HEADS, HEAD = 512, 1536, 32768, 8, 8, 2, 64


def _time(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def _weights(rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    def mk(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    shapes = dict(
        q=(D, HEADS * HEAD), k=(D, KV_HEADS * HEAD), v=(D, KV_HEADS * HEAD),
        o=(HEADS * HEAD, D), gate=(D, F), up=(D, F), down=(F, D),
    )  # fmt: skip
    return [{n: mk(*s) for n, s in shapes.items()} for _ in range(LAYERS)]


def _layer(x, w, silu, tile):
    """One layer's products with the cheapest glue that keeps each product's shape."""
    q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
    x = x + (q + tile(k + v)) @ w["o"]
    return x + (silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"]


LOOP, SCAN = "XLA, loop over layers", "XLA, scan (the model's layout)"


def decode_products(rows: int, threads: int, reps: int) -> dict[str, float]:
    """Seconds of one decode step's products: XLA loop, XLA scan, PyTorch."""
    import torch

    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    ws, unembed = _weights(rng), (rng.standard_normal((D, V)) * 0.02).astype(np.float32)
    x = (rng.standard_normal((rows, D)) * 0.02).astype(np.float32)
    reps_kv = HEADS // KV_HEADS

    def xla_tile(a):
        return jnp.tile(a, (1, reps_kv))

    @jax.jit
    def loop(x, ws, u):
        for w in ws:
            x = _layer(x, w, jax.nn.silu, xla_tile)
        return x @ u

    @jax.jit
    def scan(x, stacked, u):
        x, _ = jax.lax.scan(lambda x, w: (_layer(x, w, jax.nn.silu, xla_tile), None), x, stacked)
        return x @ u

    jx, jws, ju = jnp.asarray(x), jax.tree.map(jnp.asarray, ws), jnp.asarray(unembed)
    stacked = {n: jnp.stack([w[n] for w in jws]) for n in jws[0]}
    tws = [{n: torch.from_numpy(a) for n, a in w.items()} for w in ws]
    tx, tu = torch.from_numpy(x), torch.from_numpy(unembed)

    def peer():
        with torch.no_grad():
            h = tx
            for w in tws:
                h = _layer(h, w, torch.nn.functional.silu, lambda a: a.repeat(1, reps_kv))
            return h @ tu

    return {
        LOOP: _time(lambda: loop(jx, jws, ju).block_until_ready(), reps),
        SCAN: _time(lambda: scan(jx, stacked, ju).block_until_ready(), reps),
        "PyTorch": _time(peer, reps),
    }


def product(m: int, k: int, n: int, threads: int, reps: int) -> tuple[float, float]:
    """Seconds of one [m, k] x [k, n] float32 product: XLA, PyTorch."""
    import torch

    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    mm = jax.jit(jnp.matmul)
    return _time(lambda: mm(ja, jb).block_until_ready(), reps), _time(lambda: ta @ tb, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32, help="decode rows (W1: 32)")
    ap.add_argument("--tokens", type=int, default=4096, help="update tokens (8 x 512)")
    ap.add_argument("--threads", type=int, default=2, help="PyTorch threads")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.default_backend()}; float32\n")
    print("| product | XLA ms | PyTorch ms | XLA GFLOP/s | PyTorch / XLA speed |")
    print("|---|---|---|---|---|")
    r, t = args.rows, args.tokens
    for m, k, n in [(r, D, F), (r, F, D), (r, D, V), (t, D, F), (t, F, D), (t, D, V)]:
        reps = args.reps if m * n * k < 1e9 else max(3, args.reps // 10)
        xla, peer = product(m, k, n, args.threads, reps)
        gflops = 2 * m * k * n / 1e9
        print(
            f"| [{m}, {k}] x [{k}, {n}] | {1e3 * xla:.2f} | {1e3 * peer:.2f} | "
            f"{gflops / xla:.0f} | {xla / peer:.2f}x |"
        )
    res = decode_products(r, args.threads, args.reps)
    flops = 2 * r * (LAYERS * (D * HEADS * HEAD * 2 + 2 * D * KV_HEADS * HEAD + 3 * D * F) + D * V)
    print(f"\nOne decode step's products, {r} rows ({flops / 1e9:.2f} GFLOP):")
    for name, s in res.items():
        print(f"  {name:32s} {1e3 * s:6.1f} ms")
    peer = res["PyTorch"]
    print(f"  PyTorch / XLA speed: {res[LOOP] / peer:.2f}x (loop), {res[SCAN] / peer:.2f}x (scan)")


if __name__ == "__main__":
    main()
