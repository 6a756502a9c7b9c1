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
from magic_jax.experiments import ablation_report, ablations, figures

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
figures.show(fig, ABLATION, results)

# %% [markdown]
# The lock-out probe at every evaluation, one line per seed coloured by arm: the mean log10
# probability of the full check on the held-out chains; the full checks the steps left are
# expected to sample (log scale: a seed under the dashed line at 1 is locked out); the share of
# the evaluation's chain samples that check every column; and the share of columns checked on
# chains (solid) and on no-carry problems (dashed), where hurrying is never punished.

# %%
from magic_jax.experiments import lockout_report

fig = lockout_report.probe_figure(runs)
figures.show(fig, f"{ABLATION}_probe", results)

# %% [markdown]
# Where the entropy sits. Top: the mean entropy of the per-column choice tokens (check or
# hurry: the strategy), of digits and of format tokens, one line per seed (log scale). Bottom:
# the entropy at each response position (seed mean) at the start, at the first step of stage 2
# and at the end; position 0 is the first column's choice, later ones mix choices and digits.

# %%
fig = lockout_report.entropy_class_figure(runs)
figures.show(fig, f"{ABLATION}_entropy_class", results)

# %% [markdown]
# The controller's path: alpha against the rollout entropy, one path per seed, each a moving
# mean over 10 steps (circle: its first step, square: its last); the dashed vertical line is the
# adaptive arm's target. An arm without a bonus stays on alpha = 0; the adaptive one climbs
# while its entropy is below the target.

# %%
fig = lockout_report.phase_figure(runs)
figures.show(fig, f"{ABLATION}_phase", results)

# %% [markdown]
# pass@k at the last evaluation (64 samples per problem) against k, on the chains (left) and
# the no-carry problems (right): thin lines each seed, thick the arm's mean. A locked-out
# policy stays low on chains even at k = 64: the full check is out of reach, not unlucky.

# %%
fig = lockout_report.pass_at_k_figure(runs)
figures.show(fig, f"{ABLATION}_pass_at_k", results)

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
# **Inconclusive, with no effect to find: the positive control failed.** All 32 runs (16 seeds
# x 2 arms, at deaa169, after the registration in 6ae9c93). Final chain accuracy is 0.000
# (adaptive) against 0.001 (no bonus) (exact Mann-Whitney p = 0.35, 0.70 after Holm within the
# claim; the estimate points against the prediction): neither arm learns a carry chain. The
# manipulation check is inconclusive too: log10 of the full check's probability at step 150
# is -6.1 +- 1.9 (adaptive) against -6.8 +- 1.9 (no bonus) (p = 0.38). Final accuracy 45.8
# +- 11.4% against 50.1 +- 1.6% (p = 0.052, against the prediction; one adaptive seed, 9,
# broke at 4.2%). Only late entropy moves, 0.087 against 0.062 nats (p < 0.001), which a
# controller does by construction.
#
# What the mask did, and the bonus did not: at step 150 the full check is still sampleable in
# 15 of 16 seeds of each arm (median 9.8 expected full checks over the 150 stage-2 steps
# without a bonus, 16.9 with; locked out, below 0.5 expected, 1 of 16 in each arm, the same at
# 1 and 2). In 08, where a truncated checked line is punished, the same probe stood at
# 10^-18.7 (no bonus) and 10^-16.1 (adaptive) and every seed was locked out. So not punishing
# truncation keeps the full check about twelve orders of magnitude more probable through
# stage 1; the bonus adds 0.7 orders, within noise. Then stage 2 does not learn it in either
# arm: by the last step its probability has fallen to 10^-21.7 (no bonus) and 10^-24.8
# (adaptive), though a full check of a chain is right at T = 52.
#
# For the central claim this means the lock-out world, at the shipped controller's strength,
# has no setting where the bonus's mechanism (keep a needed behaviour sampleable until it pays)
# shows: where stage 1 punishes checking (08) and where it only withholds reward (here) alike.
# A positive control that fails makes 08's negative uninformative about the mechanism; it says
# the world cannot show it, not that the mechanism is absent. A world where it could would need
# the kept behaviour to be learned once it is sampled, which this one's stage 2 does not do.
