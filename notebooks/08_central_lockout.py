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
# # 08. The central claim where collapse can lock a strategy out (pre-registered)
#
# The report: adaptive entropy control keeps exploration alive, so learning continues and the
# run ends higher than one whose entropy collapses. The carry world could not test it (00): a
# single one-token choice that stops being sampled stops being pushed down, so it is delayed,
# never locked out. The lock-out world (`configs/lockout.yaml`, docs/lockout-world.md) makes
# the better strategy a conjunction: a 4-digit addition with a full carry chain is right only
# when all four columns are checked, so its probability is the product of four choices. Half
# the problems are chains, half have no carry (always right). Stage 1 (150 steps, T = 23)
# truncates any checked line, so hurrying is rewarded on the plain half while chain groups are
# all wrong and give no gradient; stage 2 (150 steps, T = 52) fits the full check. The base
# (shipped, `magic-jax build-world --world lockout --seed 0`) checks each column half the time:
# 54.4% held-out, 8.6% on chains.
#
# The lock-out probe (`eval.probe: lockout`) computes at every evaluation, by teacher forcing,
# the exact probability of the full check on each held-out chain problem, and the expected
# number of full checks a training step samples. A seed is called locked out (descriptive, as
# pre-registered) when its 150 stage-2 steps are expected to sample fewer than one.
#
# Pre-registered in `notebooks/prereg/central-lockout.yaml` (committed before any arm ran):
# arms adaptive (the config as shipped: target 0.09, delta 0.01, no cap), none, long-T (no
# bonus, T = 52 for all 300 steps: the learnability control) and fixed-mean (a fixed
# coefficient equal to the adaptive arm's mean alpha, set after those runs); seeds 0-7; the
# primary endpoint is final held-out accuracy, adaptive > none, exact Mann-Whitney, Holm over
# the file's 7 predictions and across the whole table.
#
# This notebook reads the committed summaries in `results/runs/` and trains whatever is missing
# first (about 4 min per run on 2 cores). `MAGIC_JAX_NOTEBOOK_STEPS=1` runs one step per stage.

# %%
from magic_jax.experiments import ablation_report, ablations

ABLATION = "central_lockout"
results = ablations.ensure([ABLATION])  # trains only the (arm, seed) runs not done yet
runs = ablations.load_arm_runs(ABLATION, results)
print(f"results: {results}")
print({arm: len(r) for arm, r in runs.items()}, "seeds per arm")

# %% [markdown]
# Entropy, alpha, held-out accuracy, response length, truncated fraction and rollout reward
# against steps (mean over seeds; band: minimum to maximum).

# %%
fig = ablation_report.ablation_figure(ABLATION, runs)
fig

# %% [markdown]
# Each arm's outcomes (mean +- standard deviation over seeds), the pre-registered predictions
# one by one, and the verdict after Holm.

# %%
print(ablation_report.describe(ABLATION, runs))

# %% [markdown]
# ## What the committed runs show
#
# The runs are under way; this section is written once every arm's 8 seeds are in.
