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
from typing import Any

import numpy as np

from magic_jax.advantages import AdvantageConfig, group_advantages, group_keep_mask


@dataclasses.dataclass
class Group:
    """The G responses to one prompt and their rewards.

    Attributes:
      row: the prompt (a ``PromptRow``; anything for tests).
      samples: G sample records (``rollout.Sample`` or duck-typed alike).
      rewards: [G] float32.
      results: the verifier results (for status counts), or None.
    """

    row: Any
    samples: list[Any]
    rewards: np.ndarray
    results: list[Any] | None = None

    @property
    def truncated(self) -> np.ndarray:
        return np.asarray([bool(s.truncated) for s in self.samples])


@dataclasses.dataclass
class Collected:
    """What a step's rollouts produced.

    Attributes:
      groups: the D_R (or fewer) groups the buffer is packed from, mixed ones first.
      every: every group sampled in the step, in order (metrics, online filtering).
      rounds: refill rounds run beyond the first (0 without refill).
      extra_rollouts: responses sampled in those rounds.
      mixed: mixed-reward groups found over all rounds.
    """

    groups: list[Group]
    every: list[Group]
    rounds: int
    extra_rollouts: int
    mixed: int


def mixed_groups(groups: Sequence[Group], advantage: AdvantageConfig) -> np.ndarray:
    """[N] bool: the groups rejection sampling keeps (some non-zero advantage)."""
    if not groups:
        return np.zeros(0, bool)
    sizes = {len(g.samples) for g in groups}
    if len(sizes) == 1:
        r = np.stack([g.rewards for g in groups])
        t = np.stack([g.truncated for g in groups])
        adv = group_advantages(r, t, mask=advantage.mask, eps=advantage.eps, ddof=advantage.ddof)
        return np.asarray(group_keep_mask(adv))
    return np.concatenate([mixed_groups([g], advantage) for g in groups])


def collect_groups(
    sample_round: Callable[[int], list[Group]],
    *,
    num_groups: int,
    advantage: AdvantageConfig,
    refill: bool = False,
    max_rounds: int = 0,
) -> Collected:
    """Samples round 0, then (with ``refill``) more rounds until D_R groups are mixed.

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
    mixed = list(mixed_groups(every, advantage))
    rounds = extra = 0
    while refill and sum(mixed) < num_groups and rounds < max_rounds:
        rounds += 1
        more = list(sample_round(rounds))
        extra += sum(len(g.samples) for g in more)
        every += more
        mixed += list(mixed_groups(more, advantage))
    if not refill:
        return Collected(every[:num_groups], every, 0, 0, int(sum(mixed)))
    keep = [g for g, m in zip(every, mixed) if m][:num_groups]
    rest = [g for g, m in zip(every, mixed) if not m][: num_groups - len(keep)]
    return Collected(keep + rest, every, rounds, extra, int(sum(mixed)))


def flatten(groups: Sequence[Group]) -> tuple[list[Any], np.ndarray]:
    """The samples of ``groups`` renumbered so group i is prompt i, and their rewards."""
    samples, rewards = [], []
    for i, g in enumerate(groups):
        samples += [dataclasses.replace(s, prompt_index=i) for s in g.samples]
        rewards.append(np.asarray(g.rewards, np.float32))
    return samples, np.concatenate(rewards) if rewards else np.zeros(0, np.float32)


def rollout_groups(
    driver: Any,
    params: Any,
    rows: Sequence[Any],
    *,
    tokenizer: Any,
    pool: Any,
    group_size: int,
    max_prompt_length: int,
    seed: int,
    step: int,
    truncation: str = "no_eos",
    on_sample: Callable[[Any], None] | None = None,
    per_host: bool = False,
) -> tuple[list[Group], Any, float]:
    """G responses to each of ``rows``, each sent to the verifier pool as it ends.

    Args:
      driver: a ``RolloutDriver``; ``params`` its engine's weights.
      rows: the prompts (``PromptRow``).
      tokenizer: renders and decodes (``data.encode_prompts``; responses are
        decoded without special tokens for the verifier).
      pool: a ``VerifierPool``.
      group_size: G.
      max_prompt_length: longer prompts are left out (the trainer removed them at load).
      seed, step: the sampling keys' seed and step (``sampling.sample_key``).
      truncation: ``RolloutConfig.truncation``.
      on_sample: called with each finished sample after its submission.
      per_host: ``rows`` is this process's slice of the step's prompts in a
        multi-host run (``data.prompt_batches`` with the process index); see below.

    With ``per_host``, every process learns the whole step's prompts (their
    token ids and uids, gathered in process order, which is the one-host
    order), so all of them run the same decode programs on the same global
    batch; each process sends only the samples of its own prompts to its own
    verifier pool, and the rewards are then gathered, so every process returns
    the same groups as one host would. The groups of other hosts' prompts
    carry a ``RemotePrompt`` (their uid) as ``row``.

    Returns:
      (groups in prompt order, the driver's ``RolloutStats``, seconds spent
      waiting for the verifiers after decoding ended).

    Raises:
      ValueError: every prompt is longer than ``max_prompt_length``.
    """
    import time

    from magic_jax.data import encode_prompts
    from magic_jax.rewards import RewardItem

    ids, kept = encode_prompts(rows, tokenizer, max_prompt_length=max_prompt_length)
    rows = [rows[i] for i in kept]
    if not rows:
        raise ValueError(
            f"step {step}: every prompt is longer than data.max_prompt_length ({max_prompt_length})"
        )
    if per_host:
        return _rollout_groups_per_host(
            driver, params, rows, ids, tokenizer=tokenizer, pool=pool, group_size=group_size,
            seed=seed, step=step, truncation=truncation, on_sample=on_sample,
        )  # fmt: skip
    tickets: dict[tuple[int, int], int] = {}

    def submit(s: Any) -> None:
        text = tokenizer.decode(s.tokens, skip_special_tokens=True)
        item = RewardItem.from_row(rows[s.prompt_index].as_verl_row(), text)
        tickets[s.prompt_index, s.sample_index] = pool.submit(item)
        if on_sample is not None:
            on_sample(s)

    samples, stats = driver.run(
        params,
        ids,
        num_samples=group_size,
        seed=seed,
        step=step,
        truncation=truncation,
        on_sample=submit,
    )
    t0 = time.perf_counter()
    results = pool.collect([tickets[s.prompt_index, s.sample_index] for s in samples])
    wait = time.perf_counter() - t0
    by_prompt: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        by_prompt.setdefault(s.prompt_index, []).append(i)
    groups = [
        Group(
            rows[p],
            [samples[i] for i in idx],
            np.asarray([results[i].reward for i in idx], np.float32),
            [results[i] for i in idx],
        )
        for p, idx in sorted(by_prompt.items())
    ]
    return groups, stats, wait


@dataclasses.dataclass(frozen=True)
class RemotePrompt:
    """A prompt another host read: only its uid is known here (online filtering's key)."""

    uid: str


def _rollout_groups_per_host(
    driver, params, rows, ids, *, tokenizer, pool, group_size, seed, step, truncation, on_sample
) -> tuple[list[Group], Any, float]:
    """``rollout_groups`` of one process of a multi-host run (``per_host``)."""
    import time

    import jax

    from magic_jax import distributed
    from magic_jax.rewards import RewardItem, RewardResult, RewardStatus

    # Hosts hold contiguous slices: this host's prompt i is the step's prompt first + i.
    counts = [int(c[0]) for c in distributed.allgather_ragged([[len(ids)]], np.int32)]
    first = sum(counts[: jax.process_index()])
    all_ids = distributed.allgather_ragged(ids, np.int32)
    uids = distributed.allgather_strings([r.uid for r in rows])
    mine = range(first, first + len(rows))
    tickets: dict[tuple[int, int], int] = {}

    def submit(s: Any) -> None:
        if s.prompt_index in mine:  # the other hosts score theirs
            text = tokenizer.decode(s.tokens, skip_special_tokens=True)
            item = RewardItem.from_row(rows[s.prompt_index - first].as_verl_row(), text)
            tickets[s.prompt_index, s.sample_index] = pool.submit(item)
        if on_sample is not None:
            on_sample(s)

    samples, stats = driver.run(
        params, all_ids, num_samples=group_size, seed=seed, step=step, truncation=truncation,
        on_sample=submit,
    )  # fmt: skip
    t0 = time.perf_counter()
    local = [s for s in samples if s.prompt_index in mine]
    results = pool.collect([tickets[s.prompt_index, s.sample_index] for s in local])
    wait = time.perf_counter() - t0
    # Samples come in (prompt, sample) order and the hosts' prompts are contiguous, so
    # the statuses gathered in process order line up with ``samples``. A reward is
    # a function of its status; the verifier's detail stays on the host that scored it.
    statuses = list(RewardStatus)
    codes = np.asarray([statuses.index(r.status) for r in results], np.int32)
    gathered = np.concatenate(distributed.allgather_ragged([codes], np.int32))
    own = {(s.prompt_index, s.sample_index): r for s, r in zip(local, results)}
    every = [
        own.get((s.prompt_index, s.sample_index)) or RewardResult.of(statuses[int(c)])
        for s, c in zip(samples, gathered)
    ]
    by_prompt: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        by_prompt.setdefault(s.prompt_index, []).append(i)
    groups = [
        Group(
            rows[p - first] if p in mine else RemotePrompt(uids[p]),
            [samples[i] for i in idx],
            np.asarray([every[i].reward for i in idx], np.float32),
            [every[i] for i in idx],
        )
        for p, idx in sorted(by_prompt.items())
    ]
    return groups, stats, wait
