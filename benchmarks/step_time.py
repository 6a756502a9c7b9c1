"""Step time of the embedded default run, split by stage, against an earlier commit of this project.

Runs ``magic-jax train`` on the default config (``configs/default.yaml``, the shipped
0.74M model) twice in this run, one after the other: once with this checkout and
once with an earlier commit checked out into a temporary git worktree (same venv,
same machine, each with a fresh compilation cache of its own). From each run's
``metrics.jsonl`` it prints the median of the step's parts (rollout t_R, update t_T,
other t_O: reward waits and bookkeeping) and of the whole step, the ratio earlier /
now, first-run compile time and executables, the held-out curve, and the
arithmetic floor of a step at this machine's measured fp32 GEMM rate:

  update: 6 x parameters x the tokens of the kept rows (forward + backward);
  rollout: 2 x parameters x the tokens sampled (decode) and prefilled.

    .venv/bin/python benchmarks/step_time.py                      # full default run, both
    .venv/bin/python benchmarks/step_time.py --steps 10           # 10 + 10 steps each
    .venv/bin/python benchmarks/step_time.py --baseline none      # this checkout only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The commit before the step-time work (main as of 2026-11-24).
BASELINE = "bef71fb"
PARTS = ("t_rollout_s", "t_update_s", "t_other_s")


def gemm_rate(n: int = 1024, reps: int = 10) -> float:
    """fp32 GEMM FLOP/s of this machine (a jitted n^3 matmul, best of ``reps``)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def run_train(src: Path, out: Path, cache: Path, overrides: list[str]) -> tuple[float, str]:
    """``magic-jax train`` with the package at ``src``; returns (wall seconds, last line)."""
    # the command's module in that tree (it moved into magic_jax/jobs/ on 2026-11-25)
    cli = "magic_jax.jobs.cli" if (src / "magic_jax/jobs/cli.py").exists() else "magic_jax.cli"
    code = f"import sys; from {cli} import main; sys.exit(main())"
    cmd = [sys.executable, "-c", code, "train", "--set", f"output_dir={out}"]
    for o in overrides:
        cmd += ["--set", o]
    env = dict(os.environ, PYTHONPATH=str(src), MAGIC_JAX_COMPILATION_CACHE=str(cache))
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(f"{src}: train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    done = [x for x in proc.stdout.splitlines() if x.startswith("[done]")]
    return wall, done[-1] if done else proc.stdout.splitlines()[-1]


def summarize(out: Path, params: int, rate: float) -> dict:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    med = {k: statistics.median(r[k] for r in rows) for k in PARTS}
    med["step"] = statistics.median(sum(r[k] for k in PARTS) for r in rows)
    floors = []
    for r in rows:
        sampled = r["prompts"] * r["response_length_mean"] * 8  # G = 8 in the default
        kept_rows = r["kept_group_fraction"] * r["prompts"] * 8
        trained = kept_rows * (16 + r["response_length_mean"])  # prompt slots + response
        flops = 6 * params * trained + 2 * params * (sampled + r["prompts"] * 16)
        floors.append(flops / rate)
    return dict(
        median=med,
        floor=statistics.median(floors),
        steps=len(rows),
        evals=[round(e["accuracy"], 3) for e in evals],
        eval_s=statistics.median(e["t_eval_s"] for e in evals[1:] or evals),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=BASELINE, help="earlier commit, or 'none'")
    ap.add_argument("--steps", type=int, default=None, help="steps per stage (default: config)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import jax

    overrides = [f"seed={args.seed}"]
    if args.steps:
        overrides += [f"stages.0.steps={args.steps}", f"stages.1.steps={args.steps}"]
    rate = gemm_rate()
    params = 743_168  # the shipped model (magic_jax/assets/default/model)
    load = os.getloadavg()[0]
    print(
        f"jax {jax.__version__} {jax.default_backend()} | cpus {os.cpu_count()} | load "
        f"{load:.2f} | fp32 GEMM {rate / 1e9:.0f} GFLOP/s | overrides {overrides}",
        flush=True,
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sources = {"now": ROOT}
        if args.baseline != "none":
            tree = tmp / "baseline"
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.baseline],
                check=True,
                capture_output=True,
            )
            sources[args.baseline] = tree
        try:
            for name, src in sources.items():
                out = tmp / f"run-{name}"
                wall, done = run_train(src, out, tmp / f"cache-{name}", overrides)
                m = re.search(r"([\d.]+)s compiling (\d+) executables", done)
                results[name] = summarize(out, params, rate) | dict(
                    wall=wall,
                    compile_s=float(m.group(1)) if m else None,
                    executables=int(m.group(2)) if m else None,
                )
                print(name, json.dumps(results[name]), flush=True)
        finally:
            if args.baseline != "none":
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                    capture_output=True,
                )
    print()
    print(
        "| code | median step s | rollout s | update s | other s | floor s | first-run compile "
        "s (executables) | eval s | whole run s | held-out avg@8 |"
    )
    print("|" + "---|" * 10)
    for name, r in results.items():
        m = r["median"]
        print(
            f"| {name} | {m['step']:.3f} | {m['t_rollout_s']:.3f} | {m['t_update_s']:.3f} | "
            f"{m['t_other_s']:.3f} | {r['floor']:.3f} | {r['compile_s']} ({r['executables']}) | "
            f"{r['eval_s']:.1f} | {r['wall']:.0f} | {', '.join(map(str, r['evals']))} |"
        )
    if len(results) == 2:
        now, old = results["now"]["median"], results[args.baseline]["median"]
        print(
            f"\nmedian step: {old['step'] / now['step']:.2f}x faster than {args.baseline}; "
            f"rollout {old['t_rollout_s'] / now['t_rollout_s']:.2f}x, "
            f"update {old['t_update_s'] / now['t_update_s']:.2f}x; "
            f"now {now['step'] / results['now']['floor']:.1f}x the arithmetic floor"
        )


if __name__ == "__main__":
    main()
