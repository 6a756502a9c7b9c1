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
# # 12. The central claim's positive control (lock-out world, pre-registered)
#
# In 08 every entropy arm was locked out: stage 1 (T = 23) truncates each checked line, a
# truncated response gets reward 0 and, in a mixed group, a negative advantage, so checking
# is pushed down directly and the full check of a carry chain falls 10^7-fold within 25
# steps, with or without a bonus. That asks whether a bonus can beat an adverse advantage,
# not whether it keeps a strategy alive while the policy sharpens on what is rewarded, the
# report's mechanism. This is the positive control: the same world with
# `advantage.mask: after` (the group's mean and std count a truncated response as wrong, then
# its advantage is set to 0), so a checked line in stage 1 is not punished, only not rewarded.
#
# Pre-registered in `notebooks/prereg/lockout-control.yaml` (committed before any of its
# runs): arms adaptive (the shipped controller: target 0.09, delta 0.01, no cap) and no
# bonus, both masked; seeds 0-15; the primary endpoint is final chain accuracy, adaptive >
# none; the manipulation check the probe at step 150 (log10 of the full check's probability);
# final accuracy and late entropy as well; exact Mann-Whitney with ties, Holm over the file's
# 4 predictions and across the whole table. Descriptive: seeds locked out at thresholds of
# 0.5, 1 and 2 expected full checks over stage 2, and the probe beside 08's arms.
#
# This notebook reads the committed summaries in `results/runs/` and trains whatever is missing
# first (about 6 min per run on 2 cores). `MAGIC_JAX_NOTEBOOK_STEPS=1` runs one step per stage.

# %%
from magic_jax.experiments import ablation_report, ablations

ABLATION = "lockout_control"
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
# **No verdict yet: the runs are being made.** The 32 runs (16 seeds x 2 arms, at deaa169)
# were started after the registration; the claim joins the table in `notebooks/README.md`, and
# this section gets its verdict, when all of them are in. The figures, tables and checks above
# show the seeds that have finished so far, and a check without enough seeds says so; nothing
# here is a result until every seed is in. Whatever the primary endpoint shows, this section
# will say what it means for the central claim, with the probe at step 150 per arm and seed.
