# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Sweep: the adaptive entropy controller's target and delta
#
# The adaptive controller (`magic_jax/update/entropy_control.py`, config section
# `entropy: {mode: adaptive, target, delta, init_coef, max_coef}`) keeps a coefficient c_k,
# starting at `init_coef` (0). At each training step it measures e_k, the mean token entropy
# of the step's rollouts, and:
#
# - adds the entropy bonus alpha_k = c_k to the loss only while e_k <= target (alpha_k = 0
#   above it);
# - then moves the coefficient: c_{k+1} = c_k + delta if e_k < target, c_k - delta if
#   e_k > target, kept in [0, max_coef] (no cap when `max_coef` is null).
#
# So `target` says where entropy should sit and `delta` how fast the coefficient reacts: a
# small delta takes many steps below the target before the bonus is large enough to move
# entropy, a large one can overshoot it.
#
# This notebook runs a small grid of (target, delta), each point one short ordinary
# `magic-jax train` run of the lock-out world (`configs/lockout.yaml`, docs/lockout-world.md:
# a 0.74M-parameter model shipped in the package; its base's held-out token entropy is 0.099
# nats), each stage shortened to `STEPS` steps, held-out avg@1 before the first step, after
# the first stage and after the last, without the lock-out probe.
# `magic_jax.experiments.sweep` makes the runs (`python -m magic_jax.experiments.sweep` does
# the same from a shell): finished points are skipped, so re-running the notebook after
# changing the grid trains only the new points, and a point killed half-way resumes. Runs go to
# `results/sweeps/lockout/steps<STEPS>/` (not committed).
#
# What to change: `TARGETS`, `DELTAS` and `STEPS` at the top of the next cell (and `WORLD`:
# `"carry"` for the carry world, `configs/carry.yaml`). The default, 2 targets x 2 deltas at
# 30 steps per stage, is sized for about 5 minutes on 2 CPU cores (an estimate from one
# timed point; the module's docstring says how it was timed). Set `MAGIC_JAX_NOTEBOOK_STEPS=1`
# for a smoke run with one step per stage.

# %%
from magic_jax.experiments import figures, sweep

TARGETS = [0.06, 0.09]  # entropy targets, nats
DELTAS = [0.003, 0.03]  # coefficient step per training step
STEPS = 30  # steps per stage (two stages: T 23, then T 52)
WORLD = "lockout"

runs = sweep.run_sweep(TARGETS, DELTAS, world=WORLD, steps_per_stage=STEPS)
print(f"{len(runs)} points:", ", ".join(runs))

# %% [markdown]
# One row per (target, delta): held-out avg@1 at the last evaluation (all problems, and the
# carry-chain half, the problems only the full check gets right), the rollouts' token entropy
# averaged over the last third of the steps, alpha_k averaged over every step, and the share
# of steps whose bonus was on (alpha_k > 0).

# %%
print(sweep.sweep_table(runs))

# %% [markdown]
# Left: rollout entropy against steps, one colour per point, each target dashed, the stage
# change dotted. Middle: alpha_k. Right: final held-out accuracy over (target, delta).

# %%
fig = sweep.sweep_figure(runs)
# saved beside the sweep's runs (results/sweeps/<world>/steps<N>/figures/, not committed)
where = sweep.sweep_dir(None, WORLD, sweep.step_budget() or STEPS)
figures.show(fig, "target_delta", where)

# %% [markdown]
# ## How to read it
#
# - The bonus only acts at or below the target: a point whose entropy stays above its target
#   has alpha_k = 0 throughout (share 0%) and trains as if without a bonus.
# - Below the target, alpha climbs by delta per step until entropy comes back up: with a
#   small delta it may not get there within a short run (alpha rising steadily, entropy still
#   below the dashed line); with a large delta entropy may cross the target and alpha fall
#   back to 0, so that both curves oscillate.
# - Halfway, T goes from 23 to 52 and the responses that check columns fit: compare the
#   curves within a stage rather than across the change.
# - Each point is one seed and avg@1 on 256 problems (a standard error of about 3 points at
#   50%): differences of a few points between cells are noise. Add seeds with
#   `seed=[0, 1, 2]` in `run_sweep` before reading more into a cell.
# - These runs are a few percent of the world's 300 steps: they show how the controller
#   reacts, not where a full run ends.
