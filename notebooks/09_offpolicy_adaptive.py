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
# # 09. Adaptive entropy control added to a collapsing off-policy run (pre-registered)
#
# The report's Ablation 9: its off-policy run with N_SGD = 4 by mini-batches collapsed entropy
# fast and tested worse; adding adaptive entropy control (target 0.2) prevented the collapse
# and tested higher, though entropy stayed unstable at large N_SGD. In the carry world at its
# learning rate (3e-4, notebook 02) N_SGD 4 either broke the policy (reuse) or did not collapse
# faster than N_SGD 1 (mini-batches), so the setting here (the N_SGD-4 variant and a lower
# learning rate) was chosen by a pilot rule written before the pilots, in
# `notebooks/prereg/offpolicy-adaptive.yaml`, with the predictions, seeds (0-4) and tests.
#
# Arms: N_SGD 4 with no bonus; the same with the carry world's shipped controller (target
# 0.08, delta 0.01, no cap); N_SGD 1 with no bonus at the same learning rate. Held-out avg@4
# on the 256 held-out problems every 25 steps. This notebook reads the committed summaries in
# `results/runs/` and trains whatever is missing first (the arms wait, pending, until the
# pilots have set the setting). `MAGIC_JAX_NOTEBOOK_STEPS=1` runs one step per stage.

# %%
from magic_jax.experiments import ablation_report, ablations, figures

ABLATION = "offpolicy_adaptive"
results = ablations.ensure([ABLATION])  # trains only the (arm, seed) runs not done yet
runs = ablations.load_arm_runs(ABLATION, results)
print(f"results: {results}")
print({arm: len(r) for arm, r in runs.items()}, "seeds per arm")

# %% [markdown]
# Entropy, alpha, held-out accuracy, response length, truncated fraction and rollout reward
# against steps, per arm.

# %%
fig = ablation_report.ablation_figure(ABLATION, runs)
figures.show(fig, ABLATION, results)

# %% [markdown]
# Where each final model's entropy sits, by token class (`world.json`: 4 samples per held-out
# problem at T = 64): the choices (first token of each reasoning line), digits, format, and text
# after the answer, which the verifier ignores; with the carry columns it checks.

# %%
print(ablation_report.class_entropy_table(ABLATION, runs))

# %% [markdown]
# Each arm's outcomes, the pre-registered predictions one by one, and the verdict after Holm.

# %%
print(ablation_report.describe(ABLATION, runs))

# %% [markdown]
# ## What the committed runs show
#
# **Inconclusive, the estimate against the claim: the controller prevents the faster
# collapse, and the run ends lower.**
# The pilots (seed 100, `results/pilots/`) chose N_SGD 4 by mini-batches at 1e-4 by the rule
# written before them: final held-out 0.945 against 0.222 at step 0, late entropy 0.0118
# against N_SGD 1's 0.0304 at the same rate.
#
# The setting is what the report describes: with 5 seeds each, N_SGD 4 collapses entropy faster
# than N_SGD 1 (mean entropy 0.043 against 0.057 nats; late 0.011 against 0.033; exact
# Mann-Whitney p = 0.008 for the mean, 0.032 after Holm within the claim). Adding the shipped
# controller prevents the collapse (late entropy 0.088 against 0.011, p = 0.008, its
# construction; mean alpha 0.24). But the primary endpoint goes the other way: final held-out
# avg@4 75.4 +- 17.6% with the controller against 95.6 +- 0.7% without (p = 0.056, the
# estimate against the claim); the seeds split as in 00: three held at the target ended at
# 58-66%, two whose entropy rose above it late (alpha back to 0) at 93-96%. And the report's
# off-policy harm does not appear at this rate: N_SGD 4 ends above N_SGD 1 (95.6 against 90.4%,
# p = 0.008): four steps per batch at a smaller rate learn faster here, and the faster entropy
# collapse costs nothing, since the better strategy is already in every final model (carry
# columns checked: 99.7% at N_SGD 4, 98.4% at N_SGD 1; 94.3% with the controller).
#
# Where the held entropy went (the class table): in the three held seeds it sits on the
# choices (0.32-0.40 nats at the final model, against 0.01-0.07 without the controller), and
# they check 90-92% of the carry columns; in the two seeds that ended at 93-96% it went into
# text after the answer (0.51 and 0.63 nats there; 61% and 17% of their responses run to
# T = 64) and they check 99%. The same split as in 00: the bonus's entropy either spreads the
# decisions that matter or settles where it costs nothing.
#
# With 5 seeds an exact rank test's smallest two-sided p is 0.008, which no Holm correction
# across the whole table (about 60 tests) keeps under 0.05; the within-claim verdicts are the
# informative ones here.
