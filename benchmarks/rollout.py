"""Rollout throughput: our engine + continuous batching vs transformers' generate, same run.

Qwen2-shaped model (V 32768, D 512, 8 layers, 8 / 2 heads, F 1536, fp32, random
weights), 64-token prompts, 32 decode slots (batches of 32 for the peer):

  W1: 32 requests, exactly 256 new tokens each.
  W2: RL-like, G = 8 samples for each of 16 prompts with long-tail lengths
      (per group 4 x 32, 3 x 128, 1 x 512 tokens, interleaved), forced by a
      per-sample length limit since random weights never emit EOS.

Useful tokens/s = response tokens that were asked for / wall time. The peer
runs ``generate`` (sampling, top_k=0) on batches of 32 in request order, each
to its longest member. W2's four peer batches have identical shapes (each
holds a 512-token sample), so by default one is timed and multiplied by four
(``--peer-batches 4`` times them all). ``ours CPU s``: this process's CPU seconds over
our timed run (steadier than wall time on a shared machine).

    .venv/bin/python benchmarks/rollout.py            # both workloads, with peer
    .venv/bin/python benchmarks/rollout.py --quick    # tiny smoke run
    .venv/bin/python benchmarks/rollout.py --workloads W1 --skip-peer --loop-layers
    .venv/bin/python benchmarks/rollout.py --lanes 1      # one decode lane (no threads)
    .venv/bin/python benchmarks/rollout.py --workloads W1 --skip-peer --decode-layers split

With several decode lanes (the CPU default, ``driver.default_lanes``) the slots are
split between them and ``ms/step`` is a lane's step; the decode, prefill and insert
times are summed over the lanes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from magic_jax.model.config import ModelConfig
from magic_jax.model.qwen2 import Qwen2
from magic_jax.rollout.driver import RolloutDriver, default_lanes
from magic_jax.rollout.engine import Engine, EngineConfig, default_layer_unroll
from magic_jax.rollout.sampling import SamplingConfig

W2_PATTERN = (32, 128, 32, 512, 32, 128, 32, 128)  # per group of 8, interleaved


def _workloads(quick: bool):
    if quick:
        return {"W1": (4, 1, np.full((4, 1), 16)), "W2": (2, 4, np.tile([4, 16, 4, 8], (2, 1)))}
    return {
        "W1": (32, 1, np.full((32, 1), 256)),
        "W2": (16, 8, np.tile(W2_PATTERN, (16, 1))),
    }


def _peer(model, prompts_np, limits, batch, peer_batches, threads):
    """transformers' generate: batches of ``batch`` requests in order, each to its max."""
    import torch
    from transformers import Qwen2ForCausalLM

    from magic_jax.model.convert import save_hf

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as d:
        save_hf(model, d, dtype=np.float32)
        hf = Qwen2ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    n_prompts, g = limits.shape
    requests = [(p, int(limits[p, j])) for p in range(n_prompts) for j in range(g)]
    batches = [requests[i : i + batch] for i in range(0, len(requests), batch)]
    timed = batches if peer_batches is None else batches[:peer_batches]
    warm = torch.as_tensor(prompts_np[:2], dtype=torch.long)
    with torch.no_grad():  # first-call initialisation is not throughput
        hf.generate(input_ids=warm, max_new_tokens=4, do_sample=True, top_k=0, pad_token_id=0)
    t0 = time.perf_counter()
    for b in timed:
        ids = torch.as_tensor(np.stack([prompts_np[p] for p, _ in b]), dtype=torch.long)
        n = max(n for _, n in b)
        with torch.no_grad():
            hf.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                top_k=0,
                temperature=1.0,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )
    per_batch = (time.perf_counter() - t0) / len(timed)
    return per_batch * len(batches), len(timed), len(batches)


def _unroll(text: str | None) -> int | bool | None:
    if text is None:
        return None
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="W1,W2")
    ap.add_argument("--quick", action="store_true", help="tiny model and lengths (smoke test)")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--peer-batches", type=int, default=1, help="W2 peer batches timed (max 4)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--cache-bucket", type=int, default=128)
    ap.add_argument("--no-compact", action="store_true")
    ap.add_argument(
        "--lanes", type=int, default=None, help="decode lanes (default: the platform's)"
    )
    ap.add_argument(
        "--layer-unroll",
        default=None,
        help="EngineConfig.layer_unroll: true, false or an int (default: the platform's)",
    )
    ap.add_argument(
        "--loop-layers", action="store_true", help="ModelConfig.scan_layers=False (Python loop)"
    )
    ap.add_argument(
        "--decode-layers",
        choices=("scan", "split"),
        default=None,
        help="EngineConfig.decode_layers (default: the engine's choice)",
    )
    args = ap.parse_args()

    if args.quick:
        cfg = ModelConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2,
        )  # fmt: skip
        prompt_len, slots = 8, 4
    else:
        cfg = ModelConfig(
            vocab_size=32768, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
            num_kv_heads=2,
        )  # fmt: skip
        prompt_len, slots = 64, 32
    cfg = dataclasses.replace(cfg, scan_layers=not args.loop_layers)
    model = Qwen2(cfg, rngs=nnx.Rngs(0))
    lanes = default_lanes(slots, num_params=cfg.num_params()) if args.lanes is None else args.lanes
    print(
        f"model: {cfg.num_params() / 1e6:.1f}M params, fp32, "
        f"{'scanned' if cfg.scan_layers else 'loop'} layers | jax {jax.__version__} "
        f"{jax.devices()[0].platform} | cpus {os.cpu_count()} | torch threads {args.threads} | "
        f"decode layer_unroll {_unroll(args.layer_unroll)} (None: {default_layer_unroll()}) | "
        f"lanes {lanes} of {slots // lanes} slots"
    )
    rows = []
    for name, (n_prompts, g, limits) in _workloads(args.quick).items():
        if name not in args.workloads.split(","):
            continue
        prompts = np.random.default_rng(1).integers(3, cfg.vocab_size, (n_prompts, prompt_len))
        config = EngineConfig(
            max_concurrent_decodes=slots // lanes,
            max_prefill_length=prompt_len,
            max_decode_length=int(limits.max()),
            decode_steps=args.decode_steps,
            cache_bucket=args.cache_bucket,
            compact_batch=not args.no_compact,
            sampling=SamplingConfig(temperature=1.0),
            eos_ids=(),
            layer_unroll=_unroll(args.layer_unroll),
            decode_layers=args.decode_layers,
        )
        engine = Engine(model, config)
        params = engine.load_params(model)
        driver = RolloutDriver(engine, lanes=lanes)
        kw = dict(num_samples=g, seed=0, max_new_tokens=limits)
        t0 = time.perf_counter()
        driver.run(params, list(prompts), step=0, **kw)  # compiles
        first = time.perf_counter() - t0
        cpu0 = time.process_time()
        _, st = driver.run(params, list(prompts), step=1, profile=True, **kw)
        cpu = time.process_time() - cpu0
        useful = int(limits.sum())
        assert st.tokens == useful, (st.tokens, useful)
        row = dict(
            name=name,
            useful=useful,
            ours=useful / st.wall_s,
            wall=st.wall_s,
            cpu=cpu,
            compile=first - st.wall_s,
            steps=st.steps,
            ms_step=1e3 * st.decode_s / max(st.steps, 1),
            # token 0 of each sample comes from its prefill, not a decode row
            fill=(useful - limits.size) / max(st.slot_steps, 1),
            host_ms=1e3 * st.host_s / max(st.chunks, 1),
            chunks=st.chunks,
            prefill=st.prefill_s,
            insert=st.insert_s,
            decode=st.decode_s,
            host=st.host_s - st.prefill_s - st.insert_s,
            by_batch=dict(sorted(st.by_batch.items(), reverse=True)),
            first=first,
        )
        if not args.skip_peer:
            peer_batches = args.peer_batches if name == "W2" else None
            peer_s, timed, total = _peer(model, prompts, limits, slots, peer_batches, args.threads)
            row.update(peer=useful / peer_s, peer_s=peer_s, peer_note=f"{timed}/{total}")
        rows.append(row)
        print(row, flush=True)

    print()
    print(
        "| workload | useful tok | ours tok/s | generate tok/s | ratio | ours s | ours CPU s "
        "| compile s | steps | ms/step | batch fill | host ms/chunk (chunks) | prefill s "
        "| insert s |"
    )
    print("|" + "---|" * 14)
    for r in rows:
        peer = f"{r['peer']:.0f} ({r['peer_note']} batches timed)" if "peer" in r else "-"
        ratio = f"{r['ours'] / r['peer']:.2f}x" if "peer" in r else "-"
        print(
            f"| {r['name']} | {r['useful']} | {r['ours']:.0f} | {peer} | {ratio} | "
            f"{r['wall']:.1f} | {r['cpu']:.1f} | {r['compile']:.1f} | {r['steps']} | "
            f"{r['ms_step']:.1f} | "
            f"{r['fill']:.0%} | {r['host_ms']:.1f} ({r['chunks']}) | {r['prefill']:.2f} | "
            f"{r['insert']:.2f} |"
        )
    if len(rows) == 2:
        print(f"\nW2 rate / W1 rate (ours): {rows[1]['ours'] / rows[0]['ours']:.0%}")
    print("\nWhere the time goes (ours, timed run; prefill and insert blocked on):")
    print("| workload | prefill s | insert s | decode s | host s | decode steps by batch size |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        split = ", ".join(
            f"{b}: {int(k)} x {1e3 * t / max(k, 1):.1f} ms" for b, (k, t) in r["by_batch"].items()
        )
        print(
            f"| {r['name']} | {r['prefill']:.2f} | {r['insert']:.2f} | {r['decode']:.2f} | "
            f"{r['host']:.2f} | {split} |"
        )


if __name__ == "__main__":
    main()
