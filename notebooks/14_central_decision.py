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
# Not judged yet: the runs are under way (the cell above says how many seeds each arm has;
# a verdict needs all 16 of every arm, as registered).
