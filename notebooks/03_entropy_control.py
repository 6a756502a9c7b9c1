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
# # 03. Fixed entropy coefficients vs adaptive control (carry world)
#
# The report: a fixed entropy-bonus coefficient either is too small to stop the collapse or
# large enough to make the entropy explode; the adaptive controller (raise alpha by delta while
# the entropy is below the target) holds the entropy near its target.
#
# The carry base's rollout entropy is 0.086 nats; the shipped controller's target is 0.08, just
# below it, as the report requires, with delta 0.01 per step and no cap on alpha
# (`configs/carry.yaml`). Arms: that controller; fixed alpha 0.005 (the report's small
# coefficient); fixed alpha 2, the coefficient that makes the entropy explode here (a pilot,
# seed 0: entropy from 0.089 to 0.37 and rollout reward to 0 by step 25).
#
# The world is the carry world (docs/carry-world.md), where entropy is real diversity (check
# a column or hurry it). The adaptive and fixed-0.005 arms are the central claim's runs
# (notebook 00). 5 paired seeds per arm, 150 + 150 steps, held-out avg@4 every 25 steps.
#
# Every run is an ordinary `magic-jax train configs/carry.yaml` run made by
# `magic_jax.experiments.ablations`; this notebook only reads the committed summaries in
# `results/runs/` (and trains whatever is missing first). Set `MAGIC_JAX_NOTEBOOK_STEPS=1` for
# a smoke run of the whole notebook with one step per stage (its results go to
# `results/budget-1/`).

# %%
from magic_jax.experiments import ablation_report, ablations

ABLATION = "entropy_control"
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
# The report's direction, mostly reproduced at p < 0.05, with a caveat that matters. Base-model
# entropy 0.33 nats, target 0.1. Fixed 0.005 collapses like no bonus (late entropy 0.008 vs 0.014
# at fixed 0.5, p < 0.001); fixed 5 explodes (late entropy 0.53, p = 0.044; held-out accuracy
# 0.1%); the adaptive controller with delta 0.2 holds late entropy at 0.133, 0.037 from the
# target against 0.092 for fixed 0.005 (p = 0.027) and 0.425 for fixed 5 (p = 0.072, inconclusive:
# fixed 5's seeds spread widely), 3 seeds each. But that arm's accuracy collapses as well
# (4.4%): after the style switch this model's only uncertainty is which digit to write, so
# entropy held at 0.1 nats is wrong digits. The default controller (delta 0.002, cap 0.02)
# never reaches a coefficient that moves entropy here: fixed 0.5 only lifts late entropy to
# 0.014. The window where the bonus acts, about 0.5 to 5, is narrow, and a controller stepping
# by 0.2 crosses it within a few steps. Notebook 00 runs the claim that matters, better
# accuracy, in the carry world.
