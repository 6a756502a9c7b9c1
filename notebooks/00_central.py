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
# # 00. The central claim: adaptive entropy control vs a small fixed coefficient vs none
#
# The report: adaptive entropy control keeps exploration alive, so learning continues instead
# of collapsing early, and the run ends higher than one whose entropy collapses.
#
# The world is the carry world (`configs/carry.yaml`, docs/carry-world.md): 2-5 digit addition
# where a response works the columns right to left and checks each one (`x+y+1=s`, the carry
# passed on) or hurries it (one digit, carries dropped). An answer is right exactly when every
# column in a carry is checked, so the better strategy is longer and the base model (shipped,
# built by `magic-jax build-world --seed 0`) uses it rarely: it checks a quarter of the
# columns and is right on 22.9% of the held-out problems (99% with no carry, 0-9% with one or
# more). Stage 1 (150 steps, T = 32) truncates the responses that check most columns of a long
# problem, which pushes the policy toward hurrying; stage 2 (150 steps, T = 64) fits every
# solution.
#
# Arms, 5 paired seeds each (seed k of every arm draws the same first prompts): no entropy
# bonus; a fixed coefficient of 0.005; the adaptive controller with target 0.05 nats (0.6 x the
# base's measured 0.086, below it as the report requires) and delta 0.001 per step, no cap
# (the first shipped `configs/carry.yaml`); the same controller with target 0.07 (0.8 x the
# base's entropy), added after seeds 0-2 of the first three showed the collapse happening in
# stage 1, before entropy reaches 0.05; and target 0.08 with delta 0.01 (`configs/carry.yaml`
# as shipped now), added after both slow controllers climbed to 0.13-0.24 without lifting late
# entropy: pilots of seed 0 showed this model's entropy moving only at coefficients of 0.2-0.8.
# Held-out avg@4 on the 256 held-out problems every 25 steps (temperature 1, T = 64); after
# each run, the final model's strategy shares (`world.json`: `world_statistics` on the same
# problems, 4 samples each).
#
# Every run is an ordinary `magic-jax train configs/carry.yaml` run made by
# `magic_jax.experiments.ablations`; this notebook only reads the committed summaries in
# `results/runs/` (and trains whatever is missing first: about 3.5 min per run on 2 cores).
# Set `MAGIC_JAX_NOTEBOOK_STEPS=1` for a smoke run with one step per stage.

# %%
import json

from magic_jax.experiments import ablation_report, ablations, figures
from magic_jax.jobs.carry_world import CARRY_BUILD

ABLATION = "central"
results = ablations.ensure([ABLATION])  # trains only the (arm, seed) runs not done yet
runs = ablations.load_arm_runs(ABLATION, results)
base = json.loads(CARRY_BUILD.read_text())["statistics"]
print(f"results: {results}")
print({arm: len(r) for arm, r in runs.items()}, "seeds per arm")

# %% [markdown]
# Entropy (log scale; dashed: the adaptive arm's target), alpha, held-out avg@4, response length
# (checking a column makes it longer: the better strategy's share over the run), truncated
# fraction and rollout reward against steps: the thick line is the mean over seeds, each thin
# line one seed.

# %%
fig = ablation_report.ablation_figure(ABLATION, runs)
figures.show(fig, ABLATION, results)

# %% [markdown]
# The final models' strategies: how often they check the columns in a carry (all of which a
# right answer needs) and the others (which cost length and buy nothing), token entropy of
# correct and wrong responses, and accuracy per number of carries; the base model first.

# %%
print(ablation_report.world_table(ABLATION, runs, base=base))

# %% [markdown]
# The supervised baseline: for each seed of the shipped controller's run (target 0.08, delta
# 0.01), and for seeds 0-2 of the first shipped config's (target 0.05), supervised training
# continued from the same base for the same seconds of training steps, on fresh solutions at
# the base's own habit (`magic_jax.jobs.carry_world.sft_continuation`; made once and kept in
# `results/sft/`).

# %%
sft = ablations.ensure_sft(ABLATION, "carry-adaptive-0.08", results=results)
print(ablation_report.sft_comparison("carry-adaptive-0.08", runs, sft, "adaptive 0.08"))
sft_05 = ablations.ensure_sft(ABLATION, "carry-adaptive", seeds=(0, 1, 2), results=results)
print(ablation_report.sft_comparison("carry-adaptive", runs, sft_05, "adaptive 0.05"))

# %% [markdown]
# The controller: the share of steps where alpha is strictly inside its bounds (above 0; there
# is no cap), and late entropy (last third of the steps) against the target.

# %%
print(ablation_report.format_table(
    ["arm", "seeds", "alpha off its bounds", "late entropy", "late |entropy - target|",
     "mean accuracy (all evaluations)"],
    ablation_report.outcome_table(ABLATION, runs, ["alpha off its bounds", "late entropy",
                                                   "late |entropy - target|", "mean accuracy"]),
))  # fmt: skip

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
# **Not reproduced as claimed** (verdicts: `notebooks/README.md`). The controller that acts
# (target 0.08, delta 0.01, shipped) keeps entropy alive: late entropy 0.091 +- 0.016 nats
# against 0.020 without a bonus (p < 0.001), within 50% of its target in every seed (+0% to
# +48%), with the coefficient on from step 12-30 and alpha strictly above 0 in 53% of the
# steps (47-58% per seed: it falls to 0 whenever entropy rises above the target, and back);
# the controller's state c_k, which alpha takes while entropy is at or under the target, is
# above 0 in 91-94% of the steps and never pinned (no cap). But learning is
# slower, not longer-lived: final held-out avg@4 0.657 +- 0.198 against 0.894 +- 0.077 without
# a bonus (p = 0.053) and 0.915 +- 0.035 with fixed 0.005 (p = 0.042, the opposite of the
# report's sign). The seeds split in two: where entropy escaped above the target late and
# alpha fell to 0 (seeds 0 and 3) the runs ended at 0.888 and 0.858; where the controller held
# entropy at the target to the end (alpha 0.35-0.39 over the last third, seeds 1, 2, 4) they
# ended at 0.491-0.528, still 26-30 points above the base.
#
# Where the held entropy goes. The final models of the held seeds check fewer of the columns a
# right answer needs (0.82-0.85 against 0.99 without a bonus): the bonus spreads the per-column
# choice the policy has to get right. And every final model of this arm writes on after its
# answer (33% of the responses of seed 0 run to T = 64, text after the `\boxed{}` that the
# verifier ignores): the entropy of those tokens is free, so the bonus's entropy settles there.
# (`world.json` first read this arm's accuracy at half the evaluation's: the statistics scored
# the second decode lane's samples as errors. Fixed and measured again: 0.50-0.89, as the
# evaluation.)
#
# The slower controllers (delta 0.001) change nothing at p < 0.05: no bonus 0.894, fixed 0.005
# 0.915, target 0.05 0.886, target 0.07 0.910 (every p >= 0.3). Every one of those runs ends
# with the better strategy (the final models check 98.9-99.6% of the columns a right answer
# needs; the base: 26.5%), so no run was locked out and there was nothing for entropy control
# to rescue: the first stage (T = 32) pushes checking down but not out, because checked
# solutions of short problems still fit. Their alpha climbs almost steadily once entropy
# crosses the target (to 0.13-0.15 with target 0.05, 0.21-0.24 with 0.07) without lifting late
# entropy above the no-bonus arm's (0.021 and 0.018 against 0.020).
#
# What the bonus did do at small coefficients: the runs spread less. The no-bonus arm's final
# accuracy varies by 7.7 points across seeds (one seed learned about 75 steps late), fixed
# 0.005 by 3.5 and adaptive 0.07 by 2.1.
#
# Against supervised training: in the same seconds of training steps as each run of the
# shipped controller (136-186 s; 324-933 steps, fewer where the supervised run shared the two
# cores with another run, as the RL runs did), supervised training continued from the base at
# its own habit moves held-out accuracy from 22.4-23.5% to 21.7-23.5%: the base is at its
# supervised plateau. The shipped runs end 43 points above it (65.7 vs 22.4%, 95% interval
# [+18.7, +67.9], p = 0.008), the worst seed (0.491) 27 points above its own baseline; and 43
# points above the base, past the 15. The first controller's runs (target 0.05, seeds
# 0-2, against 20.7-23.0%) end 63 points above it (85.5 vs 22.1%, p < 0.001).
#
# What the claim needs that this world lacks: a collapse that removes the better strategy from
# the samples (here short problems keep it alive at every T), and entropy a bonus can hold up
# only where it is exploration: here the tokens with the most room for it are the per-column
# choices that decide correctness and the text after the answer that decides nothing.
# docs/carry-world.md lists the variants tried.
