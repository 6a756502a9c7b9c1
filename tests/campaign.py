"""The fault campaign: the tiny trainer run on a flaky bucket, killed at random points,
resumed each time, and compared with an uninterrupted run.

``make campaign`` (or ``python tests/campaign.py --seeds 0-4 --kills 10``) starts the
GCS emulator behind ``faultproxy.FaultProxy`` (seeded faults on every request: 429,
503, resets, uploads cut halfway, stalls, lost replies), puts the tiny model on the
bucket, and for each seed runs ``magic-jax train`` with ``output_dir`` and ``model`` on
``gs://``. Each attempt but the last is ended by one kill drawn from the seed:

- ``point``: ``MAGIC_JAX_KILL_AT=point:step``, a SIGKILL at one of the run's named
  kill points (a step's end, a dispatched update, a checkpoint in flight, a finished
  rollout sample, a stage switch, the export between its weights and tokenizer, an
  upload between two files), at a step the run has not checkpointed yet;
- ``term``: ``MAGIC_JAX_STOP_AT=where:step:n``, a SIGTERM at the n-th decode chunk or
  optimizer step of a step (the graceful stop);
- ``wall``: SIGKILL or SIGTERM after a random number of seconds (anywhere: start-up,
  compile, the lock, evaluation, the summary).

The same command resumes after each kill. A run that finishes before its kill (a miss)
is checked, and a new run takes the kills left; after the last kill the run goes to its
end. Each finished run's directory on the bucket must equal the clean run's (``resume_test.
assert_same_run``: records, summary, bit-identical final weights), and every attempt
must have ended by its kill or finished (never an error). A failing seed prints its
schedule as JSON; ``--replay JSON`` runs exactly that schedule again (a ``wall`` kill
lands at the same second, not necessarily at the same instruction).

The figures (kills, faults injected per kind, requests retried, seconds lost per
kill) print per seed and in total; ``--json FILE`` writes them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

# The proxy's default mix: 5% of requests meet a fault (the "for example 5%")
RATES = {"429": 0.01, "503": 0.01, "reset": 0.005, "cut": 0.005, "lost": 0.01, "stall": 0.01}
POINTS = ("step", "update", "checkpoint", "rollout", "stage")  # per training step
LAST_POINTS = ("export", "upload")  # at the end, during the export
TERMS = ("rollout", "update")
ATTEMPT_TIMEOUT_S = 600


@dataclasses.dataclass
class Attempt:
    kill: dict  # {"kind": "point"|"term"|"wall", ...}; {} = run to the end
    rc: int | None = None
    wall_s: float = 0.0
    newest: int | None = None  # the newest checkpoint's step after it


class CampaignFailure(AssertionError):
    pass


def tiny_run(root: Path) -> Path:
    """The tiny sums model and the resume tests' run (``conftest.TINY_RUN``, evaluated every
    2 steps, exported in float32 for a bitwise comparison), in ``root``."""
    from conftest import write_tiny_run

    return write_tiny_run(root, eval={"data": ["train.jsonl"], "every": 2, "num_samples": 2},
                          export_dtype="float32")  # fmt: skip


STEPS = 4  # tiny_run's two stages of two steps


def _train(root: Path, out: str, model: str, env: dict, kill: dict) -> tuple[int, float]:
    """One attempt of ``magic-jax train`` (as a user types it), ended by ``kill``."""
    from magic_jax import interrupt

    env = dict(env)
    env.pop(interrupt.KILL_AT_ENV, None)
    env.pop(interrupt.STOP_AT_ENV, None)
    if kill.get("kind") == "point":
        env[interrupt.KILL_AT_ENV] = kill["at"]
    elif kill.get("kind") == "term":
        env[interrupt.STOP_AT_ENV] = kill["at"]
    cmd = [sys.executable, "-m", "magic_jax.jobs.cli", "train", "run.yaml",
           "--set", f"output_dir={out}", "--set", f"model={model}"]  # fmt: skip
    t0 = time.monotonic()
    log = open(root / "attempts.log", "a")  # noqa: SIM115
    log.write(f"\n===== {json.dumps(kill)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        if kill.get("kind") == "wall":
            try:
                proc.wait(timeout=kill["after_s"])
            except subprocess.TimeoutExpired:
                proc.send_signal(getattr(signal, "SIG" + kill["signal"]))
        rc = proc.wait(timeout=ATTEMPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = None
    finally:
        log.close()
    return rc, time.monotonic() - t0


def _newest(out: str) -> int | None:
    from magic_jax.run.checkpoint import step_dirs

    dirs = step_dirs(out)
    return dirs[-1][0] if dirs else None


def _draw(rng: random.Random, newest: int | None, est_s: float) -> dict:
    """One kill, at a point the run has still to pass (or after a random time).

    A run whose newest checkpoint is at step r resumes at step index r: it passes
    ``rollout:s`` / ``update:s`` for s in [r, STEPS - 1], ``step:s`` / ``checkpoint:s``
    (after s steps) for s in [r + 1, STEPS], ``stage:s`` at the stage ends (2, 4)
    above r, then the export. A wall-clock kill falls within the time left.
    """
    r = 0 if newest is None else newest
    left_s = 8.0 + est_s * (STEPS - r + 1) / (STEPS + 1)  # start-up, the steps left, the end
    kind = rng.choice(("point", "point", "term", "wall", "wall"))
    if kind == "term" and r < STEPS:
        step = rng.randint(r, STEPS - 1)
        return {"kind": "term", "at": f"{rng.choice(TERMS)}:{step}:{rng.randint(1, 2)}"}
    if kind in ("point", "term"):
        points = [f"{p}:{s}" for p in ("rollout", "update") for s in range(r, STEPS)]
        points += [f"{p}:{s}" for p in ("step", "checkpoint") for s in range(r + 1, STEPS + 1)]
        points += [f"stage:{s}" for s in (2, 4) if s > r]
        if r == STEPS or rng.random() < 0.15:
            points = [f"{p}:{STEPS - 1}" for p in LAST_POINTS]
        return {"kind": "point", "at": rng.choice(points)}
    return {"kind": "wall", "after_s": round(rng.uniform(1.0, left_s), 2),
            "signal": rng.choice(("KILL", "KILL", "TERM"))}  # fmt: skip


def _landed(kill: dict, rc: int | None) -> bool:
    """Whether the attempt ended by its kill (SIGKILL, or the graceful stop's status)."""
    if rc is None or rc == 0:
        return False
    sig = "KILL" if kill.get("kind") == "point" else kill.get("signal", "TERM")
    if sig == "KILL":
        return rc == -signal.SIGKILL
    # the graceful stop's status, or SIGTERM's own before the handler is installed
    return rc in (128 + signal.SIGTERM, -signal.SIGTERM)


def run_seed(seed, kills, *, emulator, root, model, reference, est_s, rates, stall_s,
             replay=None, log=print) -> dict:  # fmt: skip
    """One seed of the campaign: runs of the tiny config, each killed until it finishes
    and then compared with the clean run, until ``kills`` kills have landed (or the
    replayed schedule is spent); returns its figures (raises ``CampaignFailure``)."""
    from faultproxy import FaultProxy
    from resume_test import assert_same_run

    from magic_jax import storage
    from magic_jax.run import runlock

    rng = random.Random(seed)
    attempts: list[Attempt] = []
    schedule = {"seed": seed, "rates": rates, "stall_s": stall_s, "kills": []}
    planned = list(replay["kills"]) if replay else None
    landed = runs = 0
    with FaultProxy(emulator.url, seed=seed, rates=rates, stall_s=stall_s) as proxy:
        env = dict(os.environ, **proxy.env, **{runlock.LEASE_ENV: "4"})
        try:
            while True:
                out = emulator.uri(f"campaign-s{seed}-run{runs}")
                runs += 1
                while True:  # the attempts of one run, until it finishes
                    newest = _newest(out)
                    if planned is not None:
                        kill = planned.pop(0) if planned else {}
                    else:
                        kill = _draw(rng, newest, est_s) if landed < kills else {}
                    schedule["kills"].append(kill)
                    rc, wall = _train(root, out, model, env, kill)
                    attempts.append(Attempt(kill, rc, wall, _newest(out)))
                    log(
                        f"  seed {seed} run {runs} attempt {len(attempts)}: {json.dumps(kill)}"
                        f" -> rc {rc} ({wall:.1f} s, newest checkpoint {attempts[-1].newest})"
                    )
                    if rc == 0:
                        break  # finished (a kill it did not reach is a miss)
                    if not _landed(kill, rc):
                        raise CampaignFailure(
                            f"attempt {len(attempts)} ended with rc {rc}, not by its kill "
                            f"{kill} (see {root / 'attempts.log'})"
                        )
                    landed += 1
                    if len(attempts) > 4 * kills + 10:
                        raise CampaignFailure("the run does not finish")
                got = Path(tempfile.mkdtemp(prefix="campaign-", dir=root))
                fs = storage.gcs_fs()
                for rel in storage.listing(out):
                    (got / rel).parent.mkdir(parents=True, exist_ok=True)
                    fs.get_file(f"{out}/{rel}", str(got / rel))
                try:
                    assert_same_run(reference, got)
                except AssertionError as e:
                    raise CampaignFailure(
                        f"run {runs} differs from the clean run ({out}, copied to {got}): {e}"
                    ) from e
                if (planned is not None and not planned) or (planned is None and landed >= kills):
                    break
        except CampaignFailure as e:
            log(
                f"FAILED seed {seed}: {e}\nreplay with: python tests/campaign.py --replay "
                f"'{json.dumps(schedule)}'"
            )
            raise
        figures = proxy.summary()
    hit = [a for a in attempts if a.rc != 0]
    total = sum(a.wall_s for a in attempts)
    return {"seed": seed, "kills": landed, "runs": runs,
            "by_kind": {k: sum(a.kill["kind"] == k for a in hit)
                        for k in ("point", "term", "wall")},
            "attempts": len(attempts), "missed": sum(bool(a.kill) for a in attempts) - landed,
            "wall_s": round(total, 1), **figures}  # fmt: skip


def _seeds(text: str) -> list[int]:
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in text.split(",")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0-4", help="e.g. 0-4 or 3,7")
    p.add_argument("--kills", type=int, default=10, help="kills per seed")
    p.add_argument("--rate", action="append", default=[], metavar="KIND=P",
                   help=f"a fault rate (default {RATES})")  # fmt: skip
    p.add_argument("--stall-s", type=float, default=1.0)
    p.add_argument("--replay", help="a failing seed's schedule (JSON), run exactly")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--workdir", help="keep the runs here (default: a temporary directory)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="no uninterrupted run on the flaky bucket (no time per kill)")  # fmt: skip
    a = p.parse_args(argv)
    from conftest import GcsEmulator

    from magic_jax import compile_cache, storage

    replay = json.loads(a.replay) if a.replay else None
    rates = replay["rates"] if replay else (
        {k: float(v) for k, v in (r.split("=", 1) for r in a.rate)} or RATES)  # fmt: skip
    stall_s = replay["stall_s"] if replay else a.stall_s
    seeds = [replay["seed"]] if replay else _seeds(a.seeds)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="magic-jax-campaign-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault(compile_cache.ENV, str(work / "compile-cache"))
    os.environ[storage.CACHE_ENV] = str(work / "model-cache")
    root = tiny_run(work / "tiny")
    results, t0 = [], time.monotonic()
    with GcsEmulator(work / "emulator.log").in_env() as emulator:
        fs = storage.gcs_fs()
        model = emulator.uri("model")
        for f in sorted((root / "model").rglob("*")):
            if f.is_file():
                fs.put_file(str(f), f"{model}/{f.relative_to(root / 'model').as_posix()}")
        # the clean run: local, no faults, no kill (also warms the compilation cache)
        reference = root / "reference"
        shutil.rmtree(reference, ignore_errors=True)
        env = {k: v for k, v in os.environ.items() if k not in emulator.env}
        rc, clean_s = _train(root, str(reference), str(root / "model"), env, {})
        if rc != 0:
            raise SystemExit(f"the clean run failed (rc {rc}): {root / 'attempts.log'}")
        # an uninterrupted run on the flaky bucket: the time a kill is measured against
        flaky_s = None
        if a.baseline:
            from faultproxy import FaultProxy

            with FaultProxy(emulator.url, seed=10_000, rates=rates, stall_s=stall_s) as proxy:
                benv = dict(os.environ, **proxy.env)
                rc, flaky_s = _train(root, emulator.uri("uninterrupted"), model, benv, {})
                if rc != 0:
                    raise SystemExit(f"the uninterrupted flaky run failed (rc {rc})")
            print(f"uninterrupted run on the flaky bucket {flaky_s:.1f} s "
                  f"({proxy.summary()['faults']} faults)", flush=True)  # fmt: skip
        print(f"clean local run {clean_s:.1f} s", flush=True)
        failed = []
        for seed in seeds:
            try:
                r = run_seed(seed, a.kills, emulator=emulator, root=root, model=model,
                             reference=reference, est_s=flaky_s or 1.5 * clean_s, rates=rates,
                             stall_s=stall_s, replay=replay,
                             log=lambda s: print(s, flush=True))  # fmt: skip
            except CampaignFailure:
                failed.append(seed)
                continue
            if flaky_s is not None:
                r["lost_per_kill_s"] = round(
                    (r["wall_s"] - r["runs"] * flaky_s) / max(r["kills"], 1), 1
                )
            results.append(r)
            print(json.dumps(r), flush=True)
    total = {k: sum(r[k] for r in results) for k in
             ("kills", "runs", "attempts", "missed", "requests", "faults", "retries",
              "wall_s")}  # fmt: skip
    total["by_kind"] = {k: sum(r["by_kind"][k] for r in results) for k in ("point", "term", "wall")}
    if flaky_s is not None:  # the seconds a kill cost: all attempts, less the runs' own time
        total["lost_per_kill_s"] = round(
            sum(r["wall_s"] - r["runs"] * flaky_s for r in results) / max(total["kills"], 1), 1
        )
    summary = {"seeds": seeds, "failed": failed, "rates": rates, "stall_s": stall_s,
               "clean_s": round(clean_s, 1), "uninterrupted_flaky_s": flaky_s and round(flaky_s, 1),
               "total": total, "per_seed": results,
               "campaign_s": round(time.monotonic() - t0, 1)}  # fmt: skip
    print(json.dumps(summary["total"]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    if failed:
        print(f"FAILED seeds: {failed}", flush=True)
        return 1
    print(f"all {len(seeds)} seeds equal to the clean run after {total['kills']} kills", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
