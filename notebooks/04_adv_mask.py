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
# # 04. Advantage mask for truncated responses in a short-T stage (carry world)
#
# The report: in a stage whose length limit T truncates many responses, leaving truncated
# responses out of the advantage ('before': out of the group statistics and A = 0) removes the
# pressure against running over T: the truncated fraction rises and overall training accuracy
# falls while accuracy on the responses that fit rises (reward hacking). 'After' (A = 0 for
# truncated responses after normalising over all of them, a truncated one counting as 0)
# also keeps responses longer, but training accuracy keeps rising as without a mask, and the
# accuracy of the responses that fit falls early as without one. The report keeps no mask.
#
# Measured as the report measures it: over the short-T stage's own steps, the truncated
# fraction, the rollout reward (training accuracy at T, a truncated response scoring 0) and
# the accuracy of the responses not truncated.
#
# The world is the carry world (`configs/carry.yaml`, docs/carry-world.md), where response
# length is the policy's choice: checking a column adds a line, and stage 1's T = 32 truncates
# responses that check most columns of a long problem (all solutions fit stage 2's T = 64).
# No arm has an entropy bonus (only the mask differs), so the reference arm is the central
# claim's no-bonus arm (notebook 00). 5 paired seeds per arm, 150 + 150 steps.
#
# Every run is an ordinary `magic-jax train configs/carry.yaml` run made by
# `magic_jax.experiments.ablations`; this notebook only reads the committed summaries in
# `results/runs/` (and trains whatever is missing first). Set `MAGIC_JAX_NOTEBOOK_STEPS=1` for
# a smoke run of the whole notebook with one step per stage (its results go to
# `results/budget-1/`).

# %%
from magic_jax.experiments import ablation_report, ablations, figures

ABLATION = "adv_mask"
results = ablations.ensure([ABLATION])  # trains only the (arm, seed) runs not done yet
runs = ablations.load_arm_runs(ABLATION, results)
print(f"results: {results}")
print({arm: len(r) for arm, r in runs.items()}, "seeds per arm")

# %% [markdown]
# Entropy (log scale; dashed: each adaptive arm's target), the entropy coefficient alpha,
# held-out avg@4, response length, truncated fraction and rollout reward against steps: the
# thick line is the mean over seeds, each thin line one seed.

# %%
fig = ablation_report.ablation_figure(ABLATION, runs)
figures.show(fig, ABLATION, results)

# %% [markdown]
# Each arm's outcomes (mean +- standard deviation over seeds), the report's predictions
# checked one by one (Welch's t, raw p; the verdict after Holm within the claim), and one
# command per arm to
# re-run it.

# %%
print(ablation_report.describe(ABLATION, runs))

# %% [markdown]
# ## What the committed runs show
#
# Reproduced, all six checks at p <= 0.01 (5 paired seeds each, Welch's t). Over stage 1
# (T = 32), masking 'before' doubles the truncated fraction (56.4 vs 29.0% of rollouts,
# p < 0.001), lowers the rollout reward, the training accuracy at T (16.8 vs 20.9%, p = 0.005),
# and raises the accuracy of the responses that fit (41.7 vs 29.2%, p < 0.001): the report's
# reward-hacking signature. The mechanism is visible here because length is the policy's
# choice: without the negative advantage on truncated responses, checking spreads to long
# problems whose checked solutions do not fit T = 32, so more responses run over. Masking
# 'after' sits between, as in the report: more truncated than no mask (40.7 vs 29.0%,
# p < 0.001) and the same training accuracy at T (20.7 vs 20.9%); against it, 'before' has the
# lower reward (16.8 vs 20.7%, p = 0.007) and the higher accuracy on what fits (41.7 vs 34.8%,
# p = 0.01). 'After' ends at 87.4% held-out (no mask 89.4%, 'before' 89.6%).
#
# What the report's measure leaves out: on held-out problems at T = 64 (where nothing is
# truncated) the masked arm is ahead through stage 1 and early stage 2 (mean held-out
# accuracy over the run 61.6 vs 43.7%, p = 0.006; 86.5 vs 47.1% at step 200), because the
# checking it learns at T = 32 is what the long stage needs; both end at the same accuracy
# (89.6 vs 89.4%, p = 0.96) and the masked arm checks almost every column (99.4% of the
# columns without a carry, against 79.0%), so it samples 10% more tokens (p = 0.007). In this
# world the report's reason to drop the mask (worse training accuracy in the short stage) holds,
# but the short stage's cost to the final result does not show.
