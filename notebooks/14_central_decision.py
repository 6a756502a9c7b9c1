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
# # 14. The central claim where the choice is one token (decision world, pre-registered)
#
# In the lock-out world (08, 12) the bonus could not act on the choice that mattered: the
# choice to check a column was a digit, so entropy could be bought with wrong digits. Here
# each line opens with a token that only chooses, `<check>` or `<skip>`, and the bonus and
# the controller's measured entropy are on those tokens alone (`entropy.tokens:
# decision:decision`). Stage 1 (T 22) truncates any checked line, so a check costs the
# reward on the no-carry half; stage 2 (T 42) fits the full check, which alone solves a chain.
#
# The dose was calibrated before the registration by pilots declared as pilots
# (`notebooks/prereg/pilots/decision-d3-*.yaml`, tables in `results/pilots/decision-d3-*/`;
# their seeds, 100-102, are not the test's): no bonus is locked out within 25 steps
# (P(full check) <= 5e-5), the shipped controller's ramp from alpha 0 too; a bonus present
# from step 0 decides.
#
# Pre-registered in `notebooks/prereg/central-decision.yaml` (committed before any of its
# runs): arms no bonus, fixed, adaptive (both on the decision tokens) and the positive
# control (stage 1 at T 42: a check is never punished); seeds 0-15; the primary endpoint is
# final chain accuracy, adaptive > none; exact Mann-Whitney with ties, Holm within the claim
# and across the table.
#
# This notebook reads the committed summaries in `results/runs/` and trains whatever is missing
# first (about 3 min per run on 2 cores). `MAGIC_JAX_NOTEBOOK_STEPS=1` runs one step per stage.

# %%
from magic_jax.experiments import ablation_report, ablations, figures, lockout_report

ABLATION = "central_decision"
results = ablations.ensure([ABLATION])  # trains only the (arm, seed) runs not done yet
runs = ablations.load_arm_runs(ABLATION, results)
print(f"results: {results}")
print({arm: len(r) for arm, r in runs.items()}, "seeds per arm")

# %% [markdown]
# The decision probe at every evaluation, one line per seed coloured by arm: P(full check),
# the exact probability that a chain's every line opens with `<check>` (mean over the
# held-out chains; log scale) with the lock-out line (5e-5: about 0.3 full checks expected
# over stage 2's 100 steps of 64 chain samples) and the learnable line (1e-2: about 64);
# held-out chain accuracy; the decision tokens' entropy in the rollouts; alpha.

# %%
fig = lockout_report.decision_figure(runs)
figures.show(fig, f"{ABLATION}_probe", results)

# %% [markdown]
# Entropy, alpha, held-out accuracy, response length, truncated fraction and rollout reward
# against steps (thick line: mean over seeds; thin lines: each seed).

# %%
fig = ablation_report.ablation_figure(ABLATION, runs)
figures.show(fig, ABLATION, results)

# %% [markdown]
# Each arm's outcomes (mean +- standard deviation over seeds), the pre-registered predictions
# one by one, and the verdict after Holm.

# %%
print(ablation_report.describe(ABLATION, runs))

# %% [markdown]
# ## What the committed runs show
#
# **Reproduced, with a positive control that succeeds.** All 64 runs (16 seeds x 4 arms, at
# 85bfbcc, clean trees, after the registration in that commit). Final chain accuracy 0.298
# +- 0.222 (adaptive) against 0.000 (no bonus): exact Mann-Whitney p = 1.6e-5, 4.8e-5 after
# Holm within the claim, 0.0010 across the table. The positive control (stage 1 at T 42, no
# bonus) learns the chains, 0.941 +- 0.046 (every seed 0.83 or more), so the world can show a
# difference. The manipulation check holds: log10 P(full check) at step 100 is -3.7 +- 2.4
# (adaptive) against -9.9 +- 0.6 (no bonus). Adaptive also beats a fixed coefficient at 0.53,
# the pilots' mean alpha (0.002, p = 2.9e-5). Final accuracy over both halves is inconclusive,
# 0.586 +- 0.163 against 0.478 +- 0.010 (p = 0.071): the seeds that learn no chain end below
# the no-bonus arm.
#
# The mechanism, seed by seed: at step 100 the no-bonus and fixed arms are locked out in 16
# of 16 seeds (P <= 5e-5; medians 10^-9.9 and 10^-9.9); adaptive is learnable (P >= 1e-2) in 8,
# between the lines in 2 and locked out in 6. 11 of 16 adaptive seeds end above 0.1 chain
# accuracy (median 0.375, best 0.684), two of them from below the lock-out line (10^-5.1 and
# 10^-5.4 at step 100), revived by the bonus in stage 2. The 5 that learn no chain end at
# 0.33-0.38 accuracy, against 0.44-0.48 without a bonus: the held entropy costs answers
# there. No adaptive seed reaches the positive control's level: in stage 2 the controller holds
# the decision tokens' entropy near its target 0.6, so checks stay partly skipped.
#
# Why a fixed 0.53 fails where the controller does not: the controller's alpha is not 0.53
# early. It is off while the decision entropy is above its target (its coefficient falls
# from 0.5 to 0.2 over the first 6 steps), then climbs by 0.05 a step once the entropy has
# fallen below, to 1.3-2.75 (per seed) at steps 42-64: its mean is 0.85 over stage 1 and
# 0.63 over the run. The fixed arm's dose was matched to the pilots'
# mean, not to this peak, so "adaptive beats fixed" here means beats a fixed dose that is
# smaller when it matters; the pilots' fixed 1 held P (0.004-0.07) at the cost of the answers.
#
# Disclosed: while the runs went on, two seeds' outcomes (0 and 1) were looked at; nothing in
# the registration, the code or the runs changed after.
