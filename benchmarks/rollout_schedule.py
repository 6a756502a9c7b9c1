"""The rollout schedule model (``magic_jax.rollout.schedule``) against the engine, same run:
predicted vs measured rollout time, and the drain's share.

For each shipped world (carry, default: their configs' model, slots, decode steps and
first stage's T, D_R and G; one decode lane) the engine runs rollouts of real prompts
whose responses are held to a length shape by per-sample limits (the trained models end
some earlier: the lengths used are the ones produced):

  near-T:    every limit T (carry's shape: responses of nearly equal length);
  long-tail: limits lognormal, median T / 4, clipped to [2, T] (the report's: mean well
             under T, a few near it).

The costs come from six calibration rollouts (both shapes, their own seeds): seconds
per decode step at each batch size (``RolloutStats.by_batch``), per prefill and per
insert, and per chunk the wall time those parts leave (host work the device does not
hide). Each shape is then run on other seeds and replayed by ``schedule.simulate`` from
the lengths it produced; the error is (predicted - measured) / measured.

    .venv/bin/python benchmarks/rollout_schedule.py            # both worlds, 3 seeds
    .venv/bin/python benchmarks/rollout_schedule.py --worlds carry --seeds 1 --parts
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORLDS = {"carry": "configs/carry.yaml", "default": "configs/default.yaml"}


def limits(shape: str, t: int, p: int, g: int, seed: int) -> np.ndarray:
    """[P, G] response limits of a length shape."""
    if shape == "near-T":
        return np.full((p, g), t, np.int32)
    rng = np.random.default_rng(seed)
    drawn = np.exp(rng.normal(np.log(t / 4), 0.8, (p, g)))
    return np.clip(np.round(drawn), 2, t).astype(np.int32)


def rollout(driver, params, prompts, lim, seed):
    """(wall seconds, stats, produced lengths [P][G]) of one rollout."""
    g = lim.shape[1]
    t0 = time.perf_counter()
    samples, stats = driver.run(
        params, prompts, num_samples=g, seed=seed, max_new_tokens=lim, profile=True
    )
    wall = time.perf_counter() - t0
    lengths = [[0] * g for _ in prompts]
    for s in samples:
        lengths[s.prompt_index][s.sample_index] = int(s.length)
    return wall, stats, lengths


def costs_of(runs):
    """Costs from calibration rollouts [(wall, stats)]: each batch size's seconds per step,
    per prefill and per insert pooled over them; per chunk, the wall time the parts do not
    account for (the host's work the device does not hide)."""
    from magic_jax.rollout.schedule import Costs

    steps, secs = {}, {}
    for _, st in runs:
        for b, (n, sec) in st.by_batch.items():
            steps[int(b)] = steps.get(int(b), 0) + n
            secs[int(b)] = secs.get(int(b), 0.0) + sec
    total = {
        k: sum(getattr(st, k) for _, st in runs) for k in ("prefill_s", "insert_s", "decode_s")
    }
    n = {k: sum(getattr(st, k) for _, st in runs) for k in ("prefills", "chunks")}
    exposed = sum(wall for wall, _ in runs) - sum(total.values())
    return Costs(
        step_s={b: secs[b] / steps[b] for b in steps if steps[b]},
        prefill_s=total["prefill_s"] / max(n["prefills"], 1),
        insert_s=total["insert_s"] / max(n["prefills"], 1),
        chunk_s=max(exposed, 0.0) / max(n["chunks"], 1),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="carry,default")
    ap.add_argument("--seeds", type=int, default=3, help="measured rollouts per shape")
    ap.add_argument("--parts", action="store_true", help="each rollout's parts, both sides")
    args = ap.parse_args()

    from magic_jax.data.rows import tokenize_rows
    from magic_jax.data.sources import read_rows
    from magic_jax.rollout.driver import make_driver
    from magic_jax.rollout.engine_config import compacts
    from magic_jax.rollout.schedule import simulate
    from magic_jax.run.config import load_config
    from magic_jax.run.policy import load_model_any, load_tokenizer

    errors = []
    for world in args.worlds.split(","):
        cfg = load_config(ROOT / WORLDS[world])
        stage = cfg.stages[0]
        t, p, g = stage.max_response_length, stage.prompts_per_step, stage.group_size
        loaded = load_model_any(cfg.model)
        tok = load_tokenizer(cfg.tokenizer or loaded.tokenizer_dir)
        rows = read_rows(cfg.eval.data[0] if cfg.eval.data else cfg.data.train[0])[:p]
        encoded, _ = tokenize_rows(rows, tok, max_prompt_length=cfg.data.max_prompt_length)
        prompts = [np.asarray(r.token_ids, np.int32) for r in encoded][:p]
        options = dataclasses.replace(cfg.rollout, lanes=1)
        driver = make_driver(loaded.model, options, max_prompt_length=cfg.data.max_prompt_length,
                             max_response_length=t, sampling=cfg.sampling)  # fmt: skip
        params = driver.engine.load_params(loaded.model)
        eng = driver.engine
        shape = dict(slots=eng.config.max_concurrent_decodes, decode_steps=eng.config.decode_steps,
                     sizes=eng.compact_sizes(), compact=compacts(eng.config))  # fmt: skip
        rollout(driver, params, prompts, limits("long-tail", t, p, g, 99), 99)  # compile
        calib = [rollout(driver, params, prompts, limits(shape_, t, p, g, 100 + i), 100 + i)[:2]
                 for i, shape_ in enumerate(("long-tail", "near-T") * 3)]  # fmt: skip
        costs = costs_of(calib)
        whole = g <= shape["slots"] and eng.light_cpu_step
        print(f"\n{world} ({WORLDS[world]}): T {t}, {p} prompts x {g}, {shape['slots']} slots, "
              f"decode_steps {shape['decode_steps']}, compact {shape['compact']}; step ms by "
              f"batch {({b: round(s * 1e3, 2) for b, s in sorted(costs.step_s.items())})}, "
              f"prefill {costs.prefill_s * 1e3:.1f} ms")  # fmt: skip
        for name in ("near-T", "long-tail"):
            for seed in range(args.seeds):
                wall, st, lengths = rollout(driver, params, prompts, limits(name, t, p, g, seed),
                                            seed)  # fmt: skip
                s = simulate(lengths, costs=costs, whole_groups=whole, **shape)
                err = (s.total_s - wall) / wall
                errors.append(err)
                if args.parts:  # the engine's parts against the model's
                    keys = ("decode_s", "prefill_s", "insert_s", "host_s")
                    got = " ".join(f"{k[:-2]} {getattr(st, k) * 1e3:.1f}" for k in keys)
                    want = " ".join(f"{k[:-2]} {getattr(s, k) * 1e3:.1f}" for k in keys)
                    print(f"    engine: {got} ms, {st.steps} steps, {st.slot_steps} rows | "
                          f"model: {want} ms, {s.steps} steps, {s.slot_steps} rows")  # fmt: skip
                mean = np.mean(lengths)
                print(f"  {name:9s} seed {seed}: lengths mean {mean:5.1f} max {np.max(lengths):3d} "
                      f"| measured {wall * 1e3:7.1f} ms, predicted {s.total_s * 1e3:7.1f} ms "
                      f"({err:+.1%}) | drain {s.drain_share:.0%} of the time, "
                      f"{s.idle_share:.0%} of rows idle")  # fmt: skip
    worst = max(abs(e) for e in errors)
    print(f"\nlargest error {worst:.1%} over {len(errors)} rollouts "
          f"({'within' if worst <= 0.2 else 'outside'} 20%)")  # fmt: skip


if __name__ == "__main__":
    main()
