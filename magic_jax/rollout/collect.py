"""One step's rollout groups: rejection sampling, optionally with DAPO's refill rounds.

Rejection sampling (SPEC item 2) keeps the groups whose rewards are mixed
(some advantage non-zero). Without refill, as in the report, the step trains on
what is left of its D_R groups. With refill (DAPO's dynamic sampling), the step
samples further rounds of D_R prompts while fewer than D_R mixed groups are in
hand, up to a cap of rounds, and trains on D_R mixed groups when it found them.
The buffer always holds exactly D_R groups (unmixed ones fill the places no
mixed group took, and are dropped by the keep mask as usual), so every jitted
shape stays the same whatever the rounds found.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from magic_jax.rollout.scoring import Group, Scoring, score_groups
from magic_jax.update.advantages import AdvantageConfig, estimate_advantages, group_keep_mask

if TYPE_CHECKING:
    from magic_jax.data.rows import PromptRow
    from magic_jax.rollout.partial import StepStore
    from magic_jax.rollout.protocols import Driver, Params
    from magic_jax.rollout.samples import RolloutStats, Sample


@dataclasses.dataclass
class Collected:
    """What a step's rollouts produced.

    Attributes:
      groups: the D_R (or fewer) groups the buffer is packed from, mixed ones first.
      advantages: [G] float32 per group of ``groups``: the group advantages,
        computed once here (rejection sampling decides by them and the buffer
        takes them as they are).
      every: every group sampled in the step, in order (metrics, online filtering).
      rounds: refill rounds run beyond the first (0 without refill).
      extra_rollouts: responses sampled in those rounds.
      mixed: mixed-reward groups found over all rounds.
      stats: the driver's ``RolloutStats`` of each round.
      wait_s: seconds spent waiting for the verifiers after decoding ended.
    """

    groups: list[Group]
    advantages: list[np.ndarray]
    every: list[Group]
    rounds: int
    extra_rollouts: int
    mixed: int
    stats: list[RolloutStats] = dataclasses.field(default_factory=list)
    wait_s: float = 0.0


def advantages_of(groups: Sequence[Group], advantage: AdvantageConfig) -> list[np.ndarray]:
    """Each group's [G] advantages (``advantages.estimate_advantages``: the config's
    estimator)."""
    sizes = {len(g.samples) for g in groups}
    if len(sizes) > 1:
        return [a for g in groups for a in advantages_of([g], advantage)]
    if not groups:
        return []
    r = np.stack([g.rewards for g in groups])
    t = np.stack([g.truncated for g in groups])
    return list(estimate_advantages(advantage, r, t))


def _mixed(advantages: Sequence[np.ndarray]) -> np.ndarray:
    """[N] bool: the groups rejection sampling keeps (some non-zero advantage)."""
    if not advantages:
        return np.zeros(0, bool)
    if len({len(a) for a in advantages}) > 1:
        return np.concatenate([_mixed([a]) for a in advantages])
    return np.asarray(group_keep_mask(np.stack(advantages)))


@dataclasses.dataclass(frozen=True)
class CollectSpec:
    """What a step's collection needs beside its prompts and weights (one definition):
    how responses are scored, and the stage's rejection sampling.

    Attributes:
      scoring: tokenizer, verifiers, truncation, per-host (``scoring.Scoring``).
      group_size: G.
      num_groups: D_R.
      advantage: the advantage options (they decide which groups are mixed).
      seed: the run's seed; refill round r draws with ``seed + 7919 * r``, apart from
        round 0's prompts of the same indices.
      refill: sample further rounds while fewer than D_R groups are mixed.
    """

    scoring: Scoring
    group_size: int
    num_groups: int
    advantage: AdvantageConfig
    seed: int
    refill: bool = False


def collect_groups(
    driver: Driver,
    params: Params,
    rounds: Sequence[Sequence[PromptRow]],
    spec: CollectSpec,
    *,
    step: int,
    saved: StepStore | None = None,
) -> Collected:
    """One step's rollouts: round 0, then (with ``refill``) further rounds until D_R
    groups are mixed, each sampled and scored by ``scoring.score_groups``.

    Args:
      driver / params: the rollout driver and its engine's weights.
      rounds: the prompts of each round (tokenised rows): ``rounds[0]`` the
        step's own, ``rounds[r]`` refill round r's (at most ``len(rounds) - 1``
        refill rounds run).
      spec: scoring, G, D_R, the advantage options, the seed and refill.
      step: the global step (the sampling keys).
      saved: a ``partial.StepStore``: each round loads the groups saved by an earlier
        attempt at this step and saves those it finishes (``score_groups``' store).

    Returns:
      ``select_groups``' result, with the driver's stats of every round and the
      seconds spent waiting for the verifiers after decoding.
    """
    stats, waits = [], []

    def sample_round(r: int) -> list[Group]:
        groups, st, wait = score_groups(
            driver,
            params,
            rounds[r],
            spec.scoring,
            num_samples=spec.group_size,
            seed=spec.seed + 7919 * r,
            step=step,
            store=None if saved is None else saved.round(r),
        )
        stats.append(st)
        waits.append(wait)
        return groups

    got = select_groups(
        sample_round,
        num_groups=spec.num_groups,
        advantage=spec.advantage,
        refill=spec.refill,
        max_rounds=len(rounds) - 1,
    )
    return dataclasses.replace(got, stats=stats, wait_s=sum(waits))


def select_groups(
    sample_round: Callable[[int], list[Group]],
    *,
    num_groups: int,
    advantage: AdvantageConfig,
    refill: bool = False,
    max_rounds: int = 0,
) -> Collected:
    """Rejection sampling with refill, over rounds of groups from ``sample_round``.

    Samples round 0, then (with ``refill``) more rounds until D_R groups are mixed.

    Args:
      sample_round: round r -> its groups (round 0 is the step's own D_R prompts;
        later rounds are further prompts, a function of the step and r).
      num_groups: D_R.
      advantage: the advantage options (they decide which groups are mixed).
      refill: sample further rounds while fewer than D_R groups are mixed.
      max_rounds: the cap of rounds beyond the first.

    Returns:
      The groups to pack (at most D_R: the first D_R mixed ones in sampling
      order, then unmixed ones of the earliest rounds) and the step's counts.
    """
    every = list(sample_round(0))
    adv = advantages_of(every, advantage)
    is_mixed = list(_mixed(adv))
    rounds = extra = 0
    while refill and sum(is_mixed) < num_groups and rounds < max_rounds:
        rounds += 1
        more = list(sample_round(rounds))
        extra += sum(len(g.samples) for g in more)
        every += more
        more_adv = advantages_of(more, advantage)
        adv += more_adv
        is_mixed += list(_mixed(more_adv))
    found = int(sum(is_mixed))
    if not refill:
        n = num_groups
        return Collected(every[:n], adv[:n], every, 0, 0, found)
    keep = [i for i, m in enumerate(is_mixed) if m][:num_groups]
    rest = [i for i, m in enumerate(is_mixed) if not m][: num_groups - len(keep)]
    chosen = keep + rest
    return Collected(
        [every[i] for i in chosen], [adv[i] for i in chosen], every, rounds, extra, found
    )


def flatten(groups: Sequence[Group]) -> tuple[list[Sample], np.ndarray]:
    """The samples of ``groups`` renumbered so group i is prompt i, and their rewards
    (``pack_rollouts``' input; ``np.concatenate(Collected.advantages)`` lines up with them)."""
    samples, rewards = [], []
    for i, g in enumerate(groups):
        samples += [dataclasses.replace(s, prompt_index=i) for s in g.samples]
        rewards.append(np.asarray(g.rewards, np.float32))
    return samples, np.concatenate(rewards) if rewards else np.zeros(0, np.float32)
