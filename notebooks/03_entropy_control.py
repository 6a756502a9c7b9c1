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
from magic_jax.experiments import ablation_report, ablations, figures

ABLATION = "entropy_control"
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
# Reproduced, every check at p < 0.01 (5 paired seeds per arm, Welch's t). Fixed 0.005 lets
# entropy collapse: late entropy (last third of the steps) 0.018 nats against 0.091 for the
# controller (p < 0.001), 77% below the target. Fixed 2 explodes it: late entropy 0.390
# (p < 0.001); the rollout reward first reaches 0 at step 8-15 and held-out accuracy ends at 0
# in every seed, the responses no longer well formed. The controller's late entropy is 0.015
# from its target on average (its seeds +0% to +48% of the target), against 0.062 for fixed
# 0.005 (p = 0.002) and 0.310 for fixed 2 (p < 0.001), all measured against the shipped
# target (0.08).
#
# What the controller holds is not what the report's claim implies it buys: the arm that holds
# entropy at its target ends at 65.7 +- 19.8% held-out, fixed 0.005 at 91.5 +- 3.5% (the central
# claim, notebook 00, has why: the held entropy goes into the per-column choices and into text
# after the boxed answer).
