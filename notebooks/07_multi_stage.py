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
# # 07. Multi-stage short -> long T vs one long stage, equal steps (carry world)
#
# The report: training first with a short length limit and then a longer one reaches the same
# final accuracy as training at the long limit throughout, while sampling fewer tokens.
#
# Arms: the carry config's stages (150 steps at T = 32, then 150 at T = 64) and 300 steps at
# T = 64. "The same" is judged with a 2-point tolerance: it holds when the 95% interval of the
# difference in final held-out accuracy lies within +-2 points.
#
# The world is the carry world (`configs/carry.yaml`, docs/carry-world.md), where response
# length is the policy's choice (checking a column adds a line) and T = 32 truncates solutions
# that check most columns of a long problem; all solutions fit T = 64. Neither arm has an
# entropy bonus (only the schedule differs), so the reference is the central claim's no-bonus
# arm (notebook 00). 5 paired seeds per arm, held-out avg@4 every 25 steps.
#
# Every run is an ordinary `magic-jax train configs/carry.yaml` run made by
# `magic_jax.experiments.ablations`; this notebook only reads the committed summaries in
# `results/runs/` (and trains whatever is missing first). Set `MAGIC_JAX_NOTEBOOK_STEPS=1` for
# a smoke run of the whole notebook with one step per stage (its results go to
# `results/budget-1/`).

# %%
from magic_jax.experiments import ablation_report, ablations, figures

ABLATION = "multi_stage"
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
# Inconclusive on the primary endpoint, the same final accuracy (5 seeds per arm; verdicts after
# Holm in `notebooks/README.md`). The short first stage saves tokens:
# 1.30 M response tokens per run against 1.68 M at T = 64 throughout (-23%, p < 0.001). But
# "the same final accuracy" is not established: 89.4 +- 7.7% against 92.5 +- 2.8% (difference
# -3.1 points, 95% interval [-12.5, +6.3], wider than the 2-point tolerance; p = 0.44).
#
# In this world the short stage costs time, not just tokens. At T = 32 the checked solutions
# of long problems are truncated (29% of stage-1 rollouts, mean length 28 tokens against 42),
# so the policy cannot learn to check where it matters until T = 64: held-out accuracy is
# 25.7% at step 150 against 91.1% for the single stage, which is at 86.9% by step 100. The
# two-stage runs catch up over stage 2 and end 3 points lower on average. The report's first
# stage (8K tokens for a 7B model) truncates a minority of long responses while most of the
# learning happens inside it; this world's T = 32 blocks the better strategy itself, which is
# what makes it the truncation mask's testbed (notebook 04).
