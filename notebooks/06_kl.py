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
# # 06. KL to the reference in a second stage: beta 1e-3 vs 0
#
# The report: adding a KL term (beta 1e-3) in a later stage pulls the policy back toward the
# reference policy and learning stalls; MAGIC trains without KL.
#
# Arms: the default (beta 0) and beta 1e-3 in stage 2 only (`stages.1.kl_beta`), the reference
# being the initial weights (the shipped base model), and beta 0.1 in stage 2, 100 times the
# report's, to see whether the pull shows at all at this scale.
#
# Every run is an ordinary `magic-jax train` run of the embedded default
# (`configs/default.yaml`, 15 + 15 steps here) made by `magic_jax.experiments.ablations`; this notebook
# only reads the committed summaries in `results/runs/` (and trains whatever is missing
# first). Set `MAGIC_JAX_NOTEBOOK_STEPS=1` for a smoke run of the whole notebook with one
# step per stage (its results go to `results/budget-1/`).

# %%
from magic_jax.experiments import ablation_report, ablations

ABLATION = "kl"
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
# checked one by one (Welch's t: reproduced only at p < 0.05), and one command per arm to
# re-run it.

# %%
print(ablation_report.describe(ABLATION, runs))

# %% [markdown]
# ## What the committed runs show
#
# Inconclusive (2 seeds, Welch's t). At beta 1e-3, final accuracy is 96.4 vs 96.3% (p = 0.97)
# and the KL to the initial policy does not fall over stage 2 (drift +0.012, p = 0.89). beta x
# KL is about 1e-4, one to two orders of magnitude below the surrogate loss: the term is too
# small to pull. At beta 0.1 the KL to the reference over stage 2 is lower, 0.070 vs 0.083 nats,
# but not at p < 0.05 with 2 seeds (p = 0.12), and accuracy is unchanged (96.4%). At this scale
# the reward gradient is far stronger than the KL's.
