"""Rollout/update overlap against sync, same machine, same run: step time and what bounds it.

Runs ``magic-jax train`` (as a user types it) on two shipped worlds, in both modes,
alternating, with one shared compilation cache warmed first:

  carry:   configs/carry.yaml, stage 1 (T 32; responses of nearly equal length);
  default: configs/default.yaml, stage 1 (T 44; short guesses beside long worked
           solutions: a two-humped, long-tailed length mix).

Modes: ``sync``; ``overlap`` (``rollout.mode=overlap``, ``max_staleness`` 1: step k is
generated while update k-1 runs, both threads on every device); and with
``--split`` a device split too (two virtual CPU devices, ``mesh`` fsdp 1,
``rollout.devices=1``). Evaluations and checkpoints are off, so a step's main-thread
time (``t_rollout_s + t_update_s + t_other_s``: in overlap mode t_rollout_s is the
wait for the producer) is the step. It prints per world and mode the median step,
its parts, the CPU seconds per wall second of its steps (``t_cpu_s``: cores busy; 2
cores cannot give more than 2, so sync's figure bounds what overlap can gain from idle
cores), the ideal overlap ``max(rollout, update) + other`` from the sync
parts, and the ratio sync / overlap with a 95% interval from a block bootstrap (blocks
of 5 consecutive steps, within runs; "no measured gain" when it includes 1).
Last, the planner's TPU prediction for the 7B recipe (``[overlap]`` lines of
``magic-jax plan``: the committed output, or with ``--plan`` the command run now,
which needs ``jax[tpu]``, libtpu, to compile for the slice).

    .venv/bin/python benchmarks/overlap.py                 # 24 steps a run, 2 repeats
    .venv/bin/python benchmarks/overlap.py --steps 8 --repeats 1 --worlds carry  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("t_rollout_s", "t_update_s", "t_other_s")
WORLDS = {"carry": "configs/carry.yaml", "default": "configs/default.yaml"}
MODES = {
    "sync": [],
    "overlap": ["rollout.mode=overlap", "rollout.max_staleness=1"],
    "split": [
        "rollout.mode=overlap",
        "rollout.max_staleness=1",
        "rollout.devices=1",
        "mesh={data: 1, fsdp: 1, tensor: 1}",
    ],
}
SKIP = 3  # first steps: compiles (cache warm or not) and the producer's start


EXTRA: list[str] = []  # --set options given to every run


def train(config: str, out: Path, cache: Path, steps: int, mode: str) -> tuple[float, float]:
    """One run of ``magic-jax train``; returns (wall seconds, CPU seconds of the process)."""
    sets = [
        f"output_dir={out}",
        f"stages.0.steps={steps}",
        "stages.1.steps=1",
        "eval=null",
        "export_hf=false",
        "checkpoint_every=100000",
        *MODES[mode],
        *EXTRA,
    ]
    cmd = [sys.executable, "-m", "magic_jax.jobs.cli", "train", config]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, MAGIC_JAX_COMPILATION_CACHE=str(cache))
    if mode == "split":
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{mode}: train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def steps_of(out: Path, steps: int) -> dict[str, np.ndarray]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if SKIP <= r["step"] < steps]
    cols = {k: np.asarray([r[k] for r in rows]) for k in PARTS}
    cols["step"] = sum(cols[k] for k in PARTS)
    cols["produce"] = np.asarray([r.get("t_produce_s", np.nan) for r in rows])
    cols["cpu"] = np.asarray([r["t_cpu_s"] for r in rows])
    cols["len_mean"] = np.asarray([r["response_length_mean"] for r in rows])
    cols["len_max"] = np.asarray([r["response_length_max"] for r in rows])
    return cols


BLOCK = 5  # consecutive steps resampled together: a step's time follows its neighbours'


def blocks(runs: list[np.ndarray], size: int = BLOCK) -> list[np.ndarray]:
    """Each run's step times cut into consecutive blocks of ``size`` (the last may be
    shorter); blocks never span two runs."""
    return [r[i : i + size] for r in runs for i in range(0, len(r), size)]


def ratio_ci(a: list[np.ndarray], b: list[np.ndarray], n: int = 2000) -> tuple[float, float, float]:
    """Median(a) / median(b) over all steps of the runs ``a`` and ``b``, and a 95%
    block-bootstrap interval: blocks of ``BLOCK`` consecutive steps resampled (steps are
    autocorrelated: resampling single steps would give too narrow an interval)."""
    rng = np.random.default_rng(0)
    ba, bb = blocks(a), blocks(b)

    def resample(bs):
        return np.concatenate([bs[i] for i in rng.integers(0, len(bs), len(bs))])

    boots = [np.median(resample(ba)) / np.median(resample(bb)) for _ in range(n)]
    point = np.median(np.concatenate(a)) / np.median(np.concatenate(b))
    return float(point), *np.percentile(boots, [2.5, 97.5])


def planner_lines(live: bool) -> list[str]:
    """The planner's ``[overlap]`` lines for the 7B recipe on a v5p-128: the committed plan
    (benchmarks/plans/7b-v5p-128.txt, the command's output), or with ``live`` the command
    itself in ``.venv-tpu`` (jax[tpu]: ``make test-tpu``; about 9 min on 2 cores)."""
    if not live:
        text = (ROOT / "benchmarks/plans/7b-v5p-128.txt").read_text()
    else:
        python = ROOT / ".venv-tpu/bin/python"
        cmd = [str(python), "-m", "magic_jax.jobs.cli", "plan", "configs/skywork-or1-7b.yaml"]
        proc = subprocess.run(
            [*cmd, "--topology", "v5p-128"], cwd=ROOT, capture_output=True, text=True
        )
        text = proc.stdout or proc.stderr
    lines = [x for x in text.splitlines() if x.lstrip().startswith("[overlap]")]
    return lines or [f"(no prediction: {(text.strip().splitlines() or ['no output'])[-1][:200]})"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24, help="stage-1 steps per run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--worlds", default="carry,default")
    ap.add_argument("--split", action="store_true", help="also the two-device split")
    ap.add_argument("--plan", action="store_true", help="run the 7B plan now (.venv-tpu)")
    ap.add_argument("--set", action="append", default=[], help="an option for every run")
    args = ap.parse_args()
    EXTRA[:] = args.set
    import jax

    modes = ["sync", "overlap", *(["split"] if args.split else [])]
    print(
        f"jax {jax.__version__} {jax.default_backend()} | cpus {os.cpu_count()} | load "
        f"{os.getloadavg()[0]:.2f} | {args.steps} steps a run ({SKIP} skipped), "
        f"{args.repeats} repeat(s), modes {modes}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for world in args.worlds.split(","):
            config = WORLDS[world]
            cache = tmp / f"cache-{world}"
            for mode in modes:  # warm the compilation cache (not timed)
                train(config, tmp / f"warm-{world}-{mode}", cache, SKIP + 1, mode)
            got = {m: [] for m in modes}
            cores = {m: [] for m in modes}
            for r in range(args.repeats):
                for mode in modes if r % 2 == 0 else modes[::-1]:
                    out = tmp / f"{world}-{mode}-{r}"
                    wall, cpu = train(config, out, cache, args.steps, mode)
                    got[mode].append(steps_of(out, args.steps))
                    cores[mode].append(cpu / wall)
            report(world, config, got, cores)
    print("\nplanner, 7B recipe on v5p-128 (roofline, from the compiled programs):")
    for line in planner_lines(args.plan):
        print("  " + line)


def report(world: str, config: str, got: dict, cores: dict) -> None:
    cat = {m: {k: np.concatenate([g[k] for g in gs]) for k in gs[0]} for m, gs in got.items()}
    s = cat["sync"]
    print(
        f"\n{world} ({config}): response length mean {np.mean(s['len_mean']):.1f}, "
        f"max {int(np.max(s['len_max']))}"
    )
    for mode, c in cat.items():
        med = {k: statistics.median(c[k]) for k in (*PARTS, "step")}
        extra = ""
        if mode != "sync":
            extra = f" | producer's rollout {np.nanmedian(c['produce']) * 1e3:.0f} ms"
        print(
            f"  {mode:8s} step {med['step'] * 1e3:7.1f} ms = wait/rollout "
            f"{med['t_rollout_s'] * 1e3:6.1f} + update {med['t_update_s'] * 1e3:6.1f} + other "
            f"{med['t_other_s'] * 1e3:5.1f} | cores busy {c['cpu'].sum() / c['step'].sum():.2f} "
            f"in steps ({statistics.mean(cores[mode]):.2f} whole run){extra}"
        )
    ideal = max(np.median(s["t_rollout_s"]), np.median(s["t_update_s"]))
    ideal += np.median(s["t_other_s"])
    print(
        f"  ideal overlap from the sync parts: {ideal * 1e3:.1f} ms "
        f"({np.median(s['step']) / ideal:.2f}x), if neither phase slowed the other"
    )
    busy = s["cpu"].sum() / s["step"].sum()
    print(
        f"  bound from idle cores: sync's steps keep {busy:.2f} of {os.cpu_count()} cores busy, "
        f"so overlap can gain at most {os.cpu_count() / busy:.2f}x from cores sync leaves idle"
    )
    for mode in cat:
        if mode != "sync":
            r, lo, hi = ratio_ci([g["step"] for g in got["sync"]], [g["step"] for g in got[mode]])
            verdict = "no measured gain" if lo <= 1 <= hi else ("gain" if lo > 1 else "loss")
            print(
                f"  sync / {mode}: {r:.2f}x (95% interval {lo:.2f}-{hi:.2f}, blocks of {BLOCK} "
                f"steps): {verdict}"
            )


if __name__ == "__main__":
    main()
