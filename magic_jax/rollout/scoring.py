"""Sampling and scoring: G responses per prompt, each sent to the verifiers as it ends.

This is the one path from prompts to rewarded responses. Training's rollouts
(``collect``) and evaluation (``evaluate``, ``magic-jax eval``, ``magic-jax
difficulty``) all call ``score_groups``: the driver decodes, every finished
response is decoded to text and submitted to the verifier pool at once, while
the others still decode, and the results come back grouped by prompt.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from magic_jax import interrupt

if TYPE_CHECKING:
    from magic_jax.data.rows import PromptRow
    from magic_jax.rewards import RewardItem, RewardResult
    from magic_jax.rollout.partial import RoundStore, SavedGroup
    from magic_jax.rollout.protocols import Driver, Params, Tokenizer, Verifiers
    from magic_jax.rollout.samples import RolloutStats, Sample, Truncation


@dataclasses.dataclass
class Group:
    """The G responses to one prompt and their rewards.

    Attributes:
      row: the prompt (a ``RemotePrompt`` for another host's prompt in a multi-host run).
      samples: G samples, in sample order.
      rewards: [G] float32.
      results: the verifier results (statuses, details), or None.
      texts: the decoded responses, when kept.
    """

    row: PromptRow | RemotePrompt
    samples: list[Sample]
    rewards: np.ndarray
    results: list[RewardResult] | None = None
    texts: list[str] | None = None

    @property
    def truncated(self) -> np.ndarray:
        return np.asarray([bool(s.truncated) for s in self.samples])


@dataclasses.dataclass(frozen=True)
class RemotePrompt:
    """A prompt another host read: only its uid is known here (online filtering's key)."""

    uid: str


class _InProcess:
    """The pool interface over ``compute_reward`` in the collecting thread (no worker
    processes).

    ``submit`` only queues the item: a driver with several decode lanes calls it from the
    lane that finished the sample, and Math-Verify's timeouts need the main thread (in any
    other thread ``math_reward`` answers ERROR). ``collect`` verifies, in the thread that
    called ``score_groups``.
    """

    def __init__(self):
        self._items: list[RewardItem] = []

    def submit(self, item: RewardItem) -> int:
        self._items.append(item)
        return len(self._items) - 1

    def collect(self, tickets: Sequence[int]) -> list[RewardResult]:
        from magic_jax.rewards import compute_reward

        return [compute_reward(self._items[t]) for t in tickets]


@dataclasses.dataclass(frozen=True)
class Scoring:
    """How sampled responses become scored groups: what ``score_groups`` and
    ``collect.collect_groups`` take beside the prompts (one definition).

    Attributes:
      tokenizer: decodes responses (``decode(ids, skip_special_tokens=True)``).
      pool: a ``VerifierPool``; None verifies in this thread (it must be the
        main thread: the verifiers' timeouts use SIGALRM).
      truncation: ``RolloutConfig.truncation``.
      per_host: the rows are this process's slice of the step's prompts in a
        multi-host run (see ``_gather``).
      keep_texts: keep the decoded responses in ``Group.texts``.
    """

    tokenizer: Tokenizer
    pool: Verifiers | None = None
    truncation: Truncation = "no_eos"
    per_host: bool = False
    keep_texts: bool = False


def score_groups(
    driver: Driver,
    params: Params,
    rows: Sequence[PromptRow],
    scoring: Scoring,
    *,
    num_samples: int,
    seed: int,
    step: int = 0,
    max_new_tokens: int | np.ndarray | None = None,
    store: RoundStore | None = None,
) -> tuple[list[Group], RolloutStats, float]:
    """Samples ``num_samples`` responses to each row and verifies them.

    Each finished sample passes ``interrupt.kill_point("rollout")`` once it is
    submitted (the crash tests' hook).

    Args:
      driver: a ``RolloutDriver`` (its engine's sampling settings apply);
        ``params`` its engine's weights.
      rows: the prompts, tokenised (``data.tokenize_rows`` set their ``token_ids``).
      scoring: the tokenizer, verifiers and the rest of ``Scoring``.
      num_samples: G.
      seed / step: sample j of prompt p draws token t with ``fold_in(seed, step, p, j, t)``.
      max_new_tokens: response limit (default: the engine's), or [rows, G] per sample.
      store: a ``partial.RoundStore``: the groups saved there are loaded instead of
        decoded (every host must find the same ones), and each group decoded here is
        written there once its G results are in (with a ``VerifierPool``; the
        in-thread verifier scores at the end, without saving).

    Returns:
      (one group per row, in order; the driver's ``RolloutStats``; seconds spent
      waiting for the verifiers after decoding ended).

    Raises:
      ValueError: a row without ``token_ids``.
    """
    missing = [r.uid for r in rows if getattr(r, "token_ids", None) is None]
    if missing:
        raise ValueError(
            f"score_groups: rows {missing[:3]} have no token_ids (tokenise them with "
            f"data.tokenize_rows)"
        )
    tokenizer, pool, per_host = scoring.tokenizer, scoring.pool, scoring.per_host
    keep_texts = scoring.keep_texts
    prompts = _prompts(rows, per_host)
    done = _load_saved(store, prompts, num_samples, per_host)
    todo = [p for p in range(len(prompts.ids)) if p not in done]
    pool = _InProcess() if pool is None else pool
    saver = _Saver(pool, store) if store is not None and not isinstance(pool, _InProcess) else None
    scorer = _Scorer(prompts, tokenizer, pool, num_samples, keep_texts, saver)
    limits = max_new_tokens
    if limits is not None and np.ndim(limits) == 2:
        limits = np.asarray(limits)[todo]
    try:
        samples, stats = driver.run(
            params,
            [prompts.ids[p] for p in todo],
            num_samples=num_samples,
            seed=seed,
            step=step,
            max_new_tokens=limits,
            truncation=scoring.truncation,
            on_sample=scorer.submit,
            prompt_indices=todo,
        )
    finally:
        if saver is not None:
            saver.close()  # the groups finished so far are written, even on a stop
    t0 = time.perf_counter()
    results = scorer.results(samples)
    wait = time.perf_counter() - t0
    if per_host:
        results = _share_results(samples, scorer.local(samples), results)
    texts = scorer.texts if keep_texts else None
    return _grouped(prompts, samples, results, done, texts), stats, wait


@dataclasses.dataclass
class _Prompts:
    """A step's prompts as this process decodes them (all hosts' in a multi-host run).

    Attributes:
      ids: every prompt's token ids.
      labels: every prompt's ``Group.row``: this host's rows, ``RemotePrompt`` for others'.
      rows: this host's rows: prompt ``first + i`` is ``rows[i]``.
      first: the index of this host's first prompt.
    """

    ids: list[np.ndarray]
    labels: list[PromptRow | RemotePrompt]
    rows: Sequence[PromptRow]
    first: int = 0

    @property
    def mine(self) -> range:
        return range(self.first, self.first + len(self.rows))


def _prompts(rows: Sequence[PromptRow], per_host: bool) -> _Prompts:
    ids = [np.asarray(r.token_ids, np.int32) for r in rows]
    if not per_host:
        return _Prompts(ids, list(rows), rows)
    all_ids, first, labels = _gather(rows, ids)
    return _Prompts(all_ids, labels, rows, first)


def _load_saved(
    store: RoundStore | None, prompts: _Prompts, num_samples: int, per_host: bool
) -> dict[int, SavedGroup]:
    """The groups an earlier attempt at this round saved, by prompt index (every host's
    the same)."""
    if store is None:
        return {}
    done = store.load([label.uid for label in prompts.labels], group_size=num_samples)
    return _agree(done, len(prompts.ids)) if per_host else done


class _Scorer:
    """Sends each finished sample of this host's prompts to the verifiers as the driver
    hands it over (``submit``, from any decode lane) and collects the results after."""

    def __init__(
        self,
        prompts: _Prompts,
        tokenizer: Tokenizer,
        pool: Verifiers,
        num_samples: int,
        keep_texts: bool,
        saver: _Saver | None,
    ):
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.pool = pool
        self.num_samples = num_samples
        self.keep_texts = keep_texts
        self.saver = saver
        self.tickets: dict[tuple[int, int], int] = {}
        self.texts: dict[tuple[int, int], str] = {}
        self._finished: dict[int, list[Sample]] = {}

    def submit(self, s: Sample) -> None:
        from magic_jax.rewards import RewardItem

        p = s.prompt_index
        if p in self.prompts.mine:  # in a multi-host run the other hosts score theirs
            text = self.tokenizer.decode(s.tokens, skip_special_tokens=True)
            row = self.prompts.rows[p - self.prompts.first]
            item = RewardItem.from_row(row.as_verl_row(), text, uid=row.uid)
            self.tickets[p, s.sample_index] = self.pool.submit(item)
            if self.keep_texts:
                self.texts[p, s.sample_index] = text
            if self.saver is not None:
                self._save_when_whole(self.saver, p, s)
        interrupt.kill_point("rollout")

    def _save_when_whole(self, saver: _Saver, p: int, s: Sample) -> None:
        group = self._finished.setdefault(p, [])
        group.append(s)
        if len(group) < self.num_samples:
            return
        group.sort(key=lambda x: x.sample_index)
        keys = [(p, x.sample_index) for x in group]
        texts = [self.texts[k] for k in keys] if self.keep_texts else None
        uid = self.prompts.labels[p].uid
        saver.add(p, uid, self._finished.pop(p), [self.tickets[k] for k in keys], texts)

    def local(self, samples: Sequence[Sample]) -> list[Sample]:
        return [s for s in samples if s.prompt_index in self.prompts.mine]

    def results(self, samples: Sequence[Sample]) -> list[RewardResult]:
        """The verifier results of this host's ``samples``, in order (those the saver
        collected, then the rest)."""
        keys = [(s.prompt_index, s.sample_index) for s in self.local(samples)]
        got = {} if self.saver is None else self.saver.results
        rest = [k for k in keys if k not in got]
        got.update(zip(rest, self.pool.collect([self.tickets[k] for k in rest])))
        return [got[k] for k in keys]


def _grouped(
    prompts: _Prompts,
    samples: list[Sample],
    results: list[RewardResult],
    done: dict[int, SavedGroup],
    texts: dict[tuple[int, int], str] | None,
) -> list[Group]:
    """The decoded and the saved samples with their results, one group per prompt in order."""
    for p, (old, old_results, old_texts) in done.items():
        samples = samples + old
        results = results + old_results
        if texts is not None and old_texts is not None:
            texts.update({(p, j): t for j, t in enumerate(old_texts)})
    order = sorted(
        range(len(samples)), key=lambda i: (samples[i].prompt_index, samples[i].sample_index)
    )
    samples, results = [samples[i] for i in order], [results[i] for i in order]
    by_prompt: dict[int, list[int]] = {}
    for i, s in enumerate(samples):  # samples come ordered by (prompt, sample)
        by_prompt.setdefault(s.prompt_index, []).append(i)
    groups = []
    for p, idx in sorted(by_prompt.items()):
        groups.append(
            Group(
                prompts.labels[p],
                [samples[i] for i in idx],
                np.asarray([results[i].reward for i in idx], np.float32),
                [results[i] for i in idx],
                [texts[p, samples[i].sample_index] for i in idx]
                if texts is not None and p in prompts.mine
                else None,
            )
        )
    return groups


class _Saver:
    """Writes each finished group to a ``RoundStore`` once its G results are in, from one
    thread of its own (it waits on the verifier pool, then writes); ``results`` keeps them
    for the caller, which collects only the rest."""

    def __init__(self, pool: Verifiers, store: RoundStore):
        self.pool = pool
        self.store = store
        self.results: dict[tuple[int, int], RewardResult] = {}
        self.errors: list[BaseException] = []
        self._queue: queue.Queue[_SaveItem | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="rollout-saver", daemon=True)
        self._thread.start()

    def add(
        self, p: int, uid: str, samples: list[Sample], tickets: list[int], texts: list[str] | None
    ) -> None:
        self._queue.put((p, uid, samples, tickets, texts))

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            p, uid, samples, tickets, texts = item
            try:
                results = self.pool.collect(tickets)
            except BaseException as e:  # the pool's own error: re-raised by close()
                self.errors.append(e)
                continue
            self.results.update({(p, s.sample_index): r for s, r in zip(samples, results)})
            self.store.put(p, uid, samples, results, texts)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.store.close()
        if self.errors:
            raise self.errors[0]


# what ``_Saver.add`` queues: (prompt index, uid, samples, tickets, texts)
_SaveItem = tuple[int, str, list["Sample"], list[int], list[str] | None]


def _agree(done: dict[int, SavedGroup], n: int) -> dict[int, SavedGroup]:
    """The saved groups every host found (a host that could not read one decodes it, so all
    must)."""
    from magic_jax import distributed

    mask = np.zeros(n, np.int32)
    mask[list(done)] = 1
    every = np.stack(distributed.allgather_ragged([mask], np.int32)).min(axis=0)
    return {p: g for p, g in done.items() if every[p]}


def _gather(
    rows: Sequence[PromptRow], ids: list[np.ndarray]
) -> tuple[list[np.ndarray], int, list[PromptRow | RemotePrompt]]:
    """A multi-host step's whole prompt list, as every process must decode it.

    Every process learns the whole step's prompts (their token ids and uids,
    gathered in process order, which is the one-host order), so all of them run
    the same decode programs on the same global batch; each sends only its own
    prompts' samples to its own verifier pool (``_share_results`` then gathers
    the rewards), so every process returns the groups one host would. Hosts
    hold contiguous slices: this host's prompt i is the step's prompt first + i.

    Returns:
      (every prompt's ids, the index of this host's first prompt, the groups'
      ``row`` labels: this host's rows, ``RemotePrompt`` for the others').
    """
    import jax

    from magic_jax import distributed

    counts = [int(c[0]) for c in distributed.allgather_ragged([np.asarray([len(ids)])], np.int32)]
    first = sum(counts[: jax.process_index()])
    all_ids = distributed.allgather_ragged(ids, np.int32)
    uids = distributed.allgather_strings([r.uid for r in rows])
    labels = [
        rows[p - first] if first <= p < first + len(rows) else RemotePrompt(uid)
        for p, uid in enumerate(uids)
    ]
    return all_ids, first, labels


def _share_results(
    samples: Sequence[Sample], local: Sequence[Sample], results: Sequence[RewardResult]
) -> list[RewardResult]:
    """Every sample's result on every host: the statuses and rewards, gathered in process
    order.

    Samples come in (prompt, sample) order and the hosts' prompts are contiguous,
    so the gathered statuses line up with ``samples``. The rewards travel as their
    float32 bits (a registered reward may give partial credit, which no status
    tells); the verifier's detail stays on the host that scored it.
    """
    from magic_jax import distributed
    from magic_jax.rewards import RewardResult, RewardStatus

    statuses = list(RewardStatus)
    codes = np.asarray([statuses.index(r.status) for r in results], np.int32)
    bits = np.asarray([r.reward for r in results], np.float32).view(np.int32)
    gathered = distributed.allgather_ragged([codes, bits], np.int32)
    codes = np.concatenate(gathered[0::2])
    rewards = np.concatenate(gathered[1::2]).view(np.float32)
    own = {(s.prompt_index, s.sample_index): r for s, r in zip(local, results)}
    return [
        own.get((s.prompt_index, s.sample_index))
        or RewardResult(reward=float(r), status=statuses[int(c)])
        for s, c, r in zip(samples, codes, rewards)
    ]
