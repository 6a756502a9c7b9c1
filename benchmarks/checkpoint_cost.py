"""What checkpointing every step costs: the embedded default run with a checkpoint after
every step against one at the end only, in the same run, on this machine.

Each arm runs ``magic-jax train`` (``configs/default.yaml``, the shipped 0.74M model)
for ``--steps`` steps of stage 0 and one of stage 1, evaluation and export off, in a
fresh output directory, sharing one warm compilation cache (a first, untimed run fills
it). Arms alternate, ``--pairs`` times. A step's time is the wall time between two
consecutive metric lines (the update, its record and, for ``every``, the checkpoint's
blocking part: the state copied off the devices; orbax writes the files and the
manifest in a thread while the next step runs). Prints the median step of each arm
and their ratio (every / never; the goal is at most 1.05), and each arm's whole-run
wall time. With ``--rollouts`` off as well, the saved groups' writes are left out of
``every`` (``rollout.partial``: one file per group as it finishes).

    .venv/bin/python benchmarks/checkpoint_cost.py
    .venv/bin/python benchmarks/checkpoint_cost.py --steps 40 --pairs 3
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(out: Path, steps: int, every: int, cache: str) -> tuple[list[float], float]:
    """Per-step seconds (gaps between metric lines) and the run's wall time."""
    cmd = [
        sys.executable, "-u", "-m", "magic_jax.jobs.cli", "train",
        "--set", f"output_dir={out}", "--set", f"stages.0.steps={steps}",
        "--set", "stages.1.steps=1", "--set", "eval=null", "--set", "export_hf=false",
        "--set", f"checkpoint_every={every}", "--set", "keep_checkpoints=1",
    ]  # fmt: skip
    env = dict(os.environ, MAGIC_JAX_COMPILATION_CACHE=cache, MAGIC_JAX_PROGRESS="0")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    stamps = []
    for line in proc.stdout:
        if line.startswith("[step "):
            stamps.append(time.perf_counter())
    if proc.wait():
        raise SystemExit(f"{' '.join(cmd)} exited with {proc.returncode}")
    wall = time.perf_counter() - t0
    # steps 1 .. steps-1 of stage 0 (step 0's line follows its compiles)
    return [b - a for a, b in itertools.pairwise(stamps[:steps])], wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="steps of stage 0 per run")
    ap.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "cache")
        run(Path(tmp) / "warm", args.steps, 1, cache)  # fills the compilation cache
        steps: dict[str, list[float]] = {"every": [], "never": []}
        walls: dict[str, list[float]] = {"every": [], "never": []}
        for i in range(args.pairs):
            for arm, every in (("every", 1), ("never", 10**6)):
                s, w = run(Path(tmp) / f"{arm}{i}", args.steps, every, cache)
                steps[arm] += s
                walls[arm].append(w)
                print(f"pair {i} {arm:5s}: median step {statistics.median(s) * 1e3:.1f} ms, "
                      f"run {w:.1f} s", flush=True)  # fmt: skip
    med = {a: statistics.median(v) for a, v in steps.items()}
    print(f"\nload {os.getloadavg()[0]:.2f}; {args.pairs} pairs x {args.steps - 1} steps")
    print(f"median step: checkpoint every step {med['every'] * 1e3:.1f} ms, "
          f"never {med['never'] * 1e3:.1f} ms")  # fmt: skip
    print(f"ratio every / never: {med['every'] / med['never']:.3f} (goal <= 1.05)")
    print(
        "whole runs (s): " + ", ".join(f"{a} {statistics.median(w):.1f}" for a, w in walls.items())
    )


if __name__ == "__main__":
    main()
