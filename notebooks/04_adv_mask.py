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
# falls while accuracy on the responses that fit rises (reward hacking). No mask (the report's
# choice) or 'after' (A = 0 after normalising over all responses) are the alternatives.
#
# Measured as the report measures it: over the short-T stage's own steps, the truncated
# fraction, the rollout reward (training accuracy at T, a truncated response scoring 0) and
# the accuracy of the responses not truncated.
#
# The world is the carry world (`configs/carry.yaml`, docs/carry-world.md), where response
# length is the policy's choice: checking a column adds a line, and stage 1's T = 32 truncates
# responses that check most columns of a long problem (all solutions fit stage 2's T = 64).
# Neither arm has an entropy bonus (only the mask differs), so the reference arm is the central
# claim's no-bonus arm (notebook 00). 5 paired seeds per arm, 150 + 150 steps. 'after' is not
# run here (`advantage.mask=after` is an option of every config).
#
# Every run is an ordinary `magic-jax train configs/carry.yaml` run made by
# `magic_jax.experiments.ablations`; this notebook only reads the committed summaries in
# `results/runs/` (and trains whatever is missing first). Set `MAGIC_JAX_NOTEBOOK_STEPS=1` for
# a smoke run of the whole notebook with one step per stage (its results go to
# `results/budget-1/`).

# %%
from magic_jax.experiments import ablation_report, ablations

ABLATION = "adv_mask"
results = ablations.ensure([ABLATION])  # trains only the (arm, seed) runs not done yet
runs = ablations.load_arm_runs(ABLATION, results)
print(f"results: {results}")
print({arm: len(r) for arm, r in runs.items()}, "seeds per arm")

# %% [markdown]
# Entropy (log scale; dashed: each adaptive arm's target), the entropy coefficient alpha,
# held-out avg@4, response length, truncated fraction and rollout reward against steps: the
# line is the mean over seeds, the band their minimum to maximum.

# %%
fig = ablation_report.ablation_figure(ABLATION, runs)
fig

# %% [markdown]
# Each arm's outcomes (mean +- standard deviation over seeds), the report's predictions
# checked one by one (Welch's t: reproduced only at p < 0.05), and one command per arm to
# re-run it.

# %%
print(ablation_report.describe(ABLATION, runs))

# %% [markdown]
# ## What the committed runs show
#
# (Filled in from the committed runs.)
