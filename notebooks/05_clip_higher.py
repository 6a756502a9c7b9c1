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
# # 05. Clip-higher: eps_high 0.2 / 0.25 / 0.28
#
# The report: a higher upper clip eps_high lets low-probability tokens gain probability, which
# slows the entropy collapse; too high a value is unstable.
#
# Arms: eps_high 0.2 (symmetric clipping), 0.25, 0.28 (the default); eps_low 0.2 throughout.
# With the default's single on-policy update per batch the ratio is exactly 1 when the
# gradient is taken, so no clip can bind and eps_high cannot matter (seed 0 at eps_high 0.2
# and 0.25 reproduced the default run's metrics bit for bit). The arms therefore update
# off-policy, N_SGD = 4 by mini-batches (D_T = 4 groups), as in notebook 02.
#
# Every run is an ordinary `magic-jax train` run of the embedded default
# (`configs/default.yaml`, 15 + 15 steps here) made by `magic_jax.experiments.ablations`; this notebook
# only reads the committed summaries in `results/runs/` (and trains whatever is missing
# first). Set `MAGIC_JAX_NOTEBOOK_STEPS=1` for a smoke run of the whole notebook with one
# step per stage (its results go to `results/budget-1/`).

# %%
from magic_jax.experiments import ablation_report, ablations

ABLATION = "clip_higher"
results = ablations.ensure([ABLATION])  # trains only the (arm, seed) runs not done yet
runs = ablations.load_arm_runs(ABLATION, results)
print(f"results: {results}")
print({arm: len(r) for arm, r in runs.items()}, "seeds per arm")

# %% [markdown]
# Entropy (log scale; dashed: each adaptive arm's target), the entropy coefficient alpha,
# held-out avg@2, response length, truncated fraction and rollout reward against steps: the
# line is the mean over seeds, the band their minimum to maximum.

# %%
fig = ablation_report.ablation_figure(ABLATION, runs)
fig

# %% [markdown]
# Each arm's outcomes (mean +- standard deviation over seeds), the report's predictions
# checked one by one (a difference counts when it is more than twice its standard error), and
# one command per arm to re-run it.

# %%
print(ablation_report.describe(ABLATION, runs))

# %% [markdown]
# ## What the committed runs show
#
# Inconclusive (3 seeds each, off-policy). Mean entropy is 0.031 / 0.030 / 0.029 nats for
# eps_high 0.2 / 0.25 / 0.28 (differences within the seeds' spread), final accuracy 85.8 / 83.1 /
# 83.1%, and no arm was unstable (largest gradient norms alike). The upper clip binds on about
# 0.1% of tokens at every eps_high: once the style is chosen, few tokens still gain probability
# fast enough to reach it, so where the clip sits hardly matters.
