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
# # 10. The central claim in the carry world, entropy control on the choice tokens only (pre-registered; not the report's recipe)
#
# In 00 the entropy bonus raised entropy where it was cheapest: on the per-column choices a
# right answer depends on, and on text written after the answer, which the verifier ignores.
# Here the bonus and the controller's entropy e_k cover only the choice tokens
# (`entropy.tokens: carry:choice`; the first token of each reasoning line, where a response
# checks or hurries a column), which is not the report's recipe: it asks whether adaptive
# control of the entropy of the decisions themselves keeps learning going.
#
# Pre-registered in `notebooks/prereg/central-choice.yaml` before any run: arms adaptive on
# the choice tokens (target 0.44 = 0.93 x the base's choice-token entropy 0.478, delta 0.01, no
# cap) and no bonus (recording the choice tokens' entropy), seeds 0-4; primary endpoint final
# held-out accuracy, adaptive > none, exact Mann-Whitney, Holm within the claim and across the
# table. This notebook reads the committed summaries in `results/runs/` and trains whatever is
# missing first (about 3.5 min per run on 2 cores). `MAGIC_JAX_NOTEBOOK_STEPS=1` runs one
# step per stage.

# %%
from magic_jax.experiments import ablation_report, ablations

ABLATION = "central_choice"
results = ablations.ensure([ABLATION])  # trains only the (arm, seed) runs not done yet
runs = ablations.load_arm_runs(ABLATION, results)
print(f"results: {results}")
print({arm: len(r) for arm, r in runs.items()}, "seeds per arm")

# %% [markdown]
# Entropy (all tokens), alpha, held-out accuracy, response length, truncated fraction and
# rollout reward against steps (thick line: mean over seeds; thin lines: each seed).

# %%
fig = ablation_report.ablation_figure(ABLATION, runs)
fig

# %% [markdown]
# Each arm's outcomes, the pre-registered predictions one by one, and the verdict after Holm.

# %%
print(ablation_report.describe(ABLATION, runs))

# %% [markdown]
# ## What the committed runs show
#
# The runs are under way; this section is written once both arms' 5 seeds are in.
