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
# against steps (thick line: mean over seeds; thin lines: each seed).

# %%
fig = ablation_report.ablation_figure(ABLATION, runs)
fig

# %% [markdown]
# The lock-out probe at every evaluation, one line per seed coloured by arm: the mean log10
# probability of the full check on the held-out chains; the full checks the steps left are
# expected to sample (log scale: a seed under the dashed line at 1 is locked out); the share of
# the evaluation's chain samples that check every column; and the share of columns checked on
# chains (solid) and on no-carry problems (dashed), where hurrying is never punished.

# %%
from magic_jax.experiments import lockout_report

fig = lockout_report.probe_figure(runs)
fig

# %% [markdown]
# Where the entropy sits. Top: the mean entropy of the per-column choice tokens (check or
# hurry: the strategy), of digits and of format tokens, one line per seed (log scale). Bottom:
# the entropy at each response position (seed mean) at the start, at the first step of stage 2
# and at the end; position 0 is the first column's choice, later ones mix choices and digits.

# %%
fig = lockout_report.entropy_class_figure(runs)
fig

# %% [markdown]
# The controller's path: alpha against the rollout entropy, one path per seed, each a moving
# mean over 10 steps (circle: its first step, square: its last); the dashed vertical line is the
# adaptive arm's target. An arm without a bonus stays on alpha = 0; the adaptive one climbs
# while its entropy is below the target.

# %%
fig = lockout_report.phase_figure(runs)
fig

# %% [markdown]
# pass@k at the last evaluation (64 samples per problem) against k, on the chains (left) and
# the no-carry problems (right): thin lines each seed, thick the arm's mean. A locked-out
# policy stays low on chains even at k = 64: the full check is out of reach, not unlucky.

# %%
fig = lockout_report.pass_at_k_figure(runs)
fig

# %% [markdown]
# One row per seed: the full checks its 150 stage-2 steps are expected to sample (the probe's
# expected per step at step 150, times 150) and whether that is below one (locked out), the
# log10 probability of the full check there and at the end, final accuracy overall and on
# chains, chain pass@k at the largest k, and the final share of full checks; then each arm's
# count of locked-out seeds.

# %%
print(lockout_report.lockout_table(runs))

# %% [markdown]
# What the final policies write: sample responses from each arm's last evaluation (a chain and
# a no-carry problem from each of the first seeds), one line each, with their reward.

# %%
print(lockout_report.examples_text(runs))

# %% [markdown]
# Each arm's outcomes (mean +- standard deviation over seeds), the pre-registered predictions
# one by one, and the verdict after Holm.

# %%
print(ablation_report.describe(ABLATION, runs))

# %% [markdown]
# ## What the committed runs show
#
# The runs are under way; this section is written once every arm's 8 seeds are in.
