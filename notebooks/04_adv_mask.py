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
# # 04. Advantage mask for truncated responses in a short-T stage
#
# The report: in a stage whose length limit T truncates many responses, leaving truncated
# responses out of the advantage ('before': out of the group statistics and A = 0) removes the
# pressure against running over T: the truncated fraction rises and overall accuracy falls. No
# mask (the default) or 'after' (A = 0 after normalising over all responses) are the
# alternatives.
#
# The default's first stage (T = 44) truncates the long worked solutions; the second stage
# (T = 64) does not.
#
# Every run is an ordinary `magic-jax train` run of the embedded default
# (`configs/default.yaml`, 15 + 15 steps here) made by `magic_jax.experiments.ablations`; this notebook
# only reads the committed summaries in `results/runs/` (and trains whatever is missing
# first). Set `MAGIC_JAX_NOTEBOOK_STEPS=1` for a smoke run of the whole notebook with one
# step per stage (its results go to `results/budget-1/`).

# %%
from magic_jax.experiments import ablation_report, ablations

ABLATION = "adv_mask"
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
# Not reproduced (2 seeds): with `before` the stage-1 truncated fraction is unchanged (46.5 vs
# 46.8%) and stage-1 accuracy is higher, not lower (94.7 vs 92.2%, +0.025 +- 0.010). Here a
# truncated response is a worked solution of a long problem, and all of that problem's worked
# samples are truncated: those groups score 0 and are dropped by rejection sampling whatever the
# mask. In the mixed groups left, an unmasked truncated response gets a negative advantage that
# pushes the first token toward the quick (wrong) style; masking removes that push. The report's
# mechanism, learning to write less to fit T, needs responses whose length the model can choose;
# in this task the problem sets it.
