"""A rollout's time from its responses' lengths: the driver's continuous batching replayed
step by step with measured costs (a model for planning; ``benchmarks/rollout_schedule.py``
checks it against the engine).

One lane of ``RolloutDriver`` is replayed as it runs: free slots are filled from the
queue (a prompt's samples in order; a whole group in one insert where it fits, with the
prompt prefilled once), then one chunk of up to ``decode_steps`` steps runs over every
slot, or, with compaction once the queue is empty, over the smallest batch size that holds
the live rows, stopping early once they fit the next size down. A response that ends
inside a chunk leaves its slot idle until the chunk ends. Each step costs what a step at
its batch size measured; the end of the rollout, from the last insert on, is its drain:
slots idle while the longest responses finish.

Two variants of a rollout are replayed beside it: partial rollouts (``publish_chunks``),
whose responses in flight move to a new version every n chunks, at the cost of
prefilling their context again with ``publish_cache: reprefill``; and a carried
rollout (``carried``), which ends a step at its batch of finished samples and carries
the unfinished ones into the next step, so that slots never drain (not what the
engine does: the drain it would recover).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Costs:
    """Measured costs, in seconds.

    Attributes:
      step_s: one decode step at each batch size (rows computed); other sizes are
        interpolated linearly (extrapolated from the nearest two).
      prefill_s: one prompt's prefill.
      insert_s: one insert (a group, or one sample).
      chunk_s: the host's work around each decode chunk that the device's does not hide.
      reprefill_token_s: one token of context prefilled again at a publish.
      by_live: a step costs what its live rows cost (the ragged kernel reads only their
        caches; a chunk is charged at its mean live rows), not its computed rows.
    """

    step_s: Mapping[int, float]
    prefill_s: float = 0.0
    insert_s: float = 0.0
    chunk_s: float = 0.0
    reprefill_token_s: float = 0.0
    by_live: bool = False

    def step(self, rows: int) -> float:
        """Seconds of one decode step over ``rows`` rows."""
        if rows in self.step_s:
            return float(self.step_s[rows])
        sizes = sorted(self.step_s)
        if len(sizes) == 1:
            return float(self.step_s[sizes[0]]) * rows / sizes[0]
        lo = max([s for s in sizes if s < rows], default=sizes[0])
        hi = min([s for s in sizes if s > rows], default=sizes[-1])
        if lo == hi:  # outside the measured sizes: the nearest two
            lo, hi = (sizes[0], sizes[1]) if rows < sizes[0] else (sizes[-2], sizes[-1])
        a, b = self.step_s[lo], self.step_s[hi]
        return float(a + (b - a) * (rows - lo) / (hi - lo))


@dataclasses.dataclass(frozen=True)
class Publish:
    """Partial rollouts: every ``every`` chunks the responses in flight move to the next
    version, at most ``times`` times a rollout (its staleness); with ``reprefill`` their
    context (``prompt_length`` + tokens so far) is prefilled again each time."""

    every: int
    times: int
    reprefill: bool = False
    prompt_length: int = 0


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A replayed rollout.

    Attributes:
      total_s: its time; ``decode_s``, ``prefill_s``, ``insert_s``, ``host_s`` and
        ``reprefill_s`` its parts.
      steps / chunks: decode steps and chunks; ``publishes`` the versions moved to.
      slot_steps: rows computed (steps x batch size); ``tokens`` the useful ones (decode
        steps' tokens: a response's first comes from its prefill).
      drain_s: time from the last insert to the end; ``drain_slot_steps`` the rows
        computed then and ``drain_tokens`` the useful ones.
      marks: with ``batch``, the time at which the finished responses first reached each
        multiple of it.
    """

    total_s: float
    decode_s: float
    prefill_s: float
    insert_s: float
    host_s: float
    steps: int
    chunks: int
    slot_steps: int
    tokens: int
    drain_s: float
    drain_slot_steps: int
    drain_tokens: int
    reprefill_s: float = 0.0
    publishes: int = 0
    marks: tuple[float, ...] = ()

    @property
    def drain_share(self) -> float:
        """The drain's share of the rollout's time."""
        return self.drain_s / self.total_s if self.total_s else 0.0

    @property
    def idle_share(self) -> float:
        """Rows computed for no token (finished or empty slots), of all rows computed."""
        return 1.0 - self.tokens / self.slot_steps if self.slot_steps else 0.0


class _Lane:
    """The state of one replayed lane (``simulate``'s arguments)."""

    def __init__(
        self, lengths, slots, decode_steps, costs, sizes, compact, whole_groups, publish, batch
    ):
        if slots < 1 or decode_steps < 1:
            raise ValueError(f"slots and decode_steps must be >= 1, got {slots}, {decode_steps}")
        flat = np.asarray(lengths, np.int64)
        self.g = flat.shape[1] if flat.ndim == 2 else 0
        self.flat = flat.reshape(-1)
        self.qi = 0  # the queue: samples in prompt order from qi on
        self.left = np.full(slots, -1, np.int64)  # decode steps left; -1: an empty slot
        self.length = np.zeros(slots, np.int64)
        self.slots = slots
        self.decode_steps = decode_steps
        self.costs = costs
        self.sizes = sorted(set(sizes) | {slots})
        self.compact, self.whole_groups, self.publish, self.batch = (
            compact,
            whole_groups,
            publish,
            batch,
        )
        self.dec = self.pre = self.ins = self.host = self.rep = 0.0
        self.steps = self.chunks = self.slot_steps = self.tokens = 0
        self.done = self.published = 0
        self.marks: list[float] = []
        self.last_insert: tuple[float, int, int] | None = None  # when the queue emptied

    @property
    def t(self) -> float:
        return self.pre + self.ins + self.dec + self.host + self.rep

    @property
    def queued(self) -> bool:
        return self.qi < self.flat.size

    def mark(self) -> None:
        while self.batch and self.done >= (len(self.marks) + 1) * self.batch:
            self.marks.append(self.t)

    def fill(self) -> int:
        """Inserts from the queue into the free slots; returns how many went in."""
        free, k, g, c = np.flatnonzero(self.left < 0), 0, self.g, self.costs
        if not self.whole_groups and self.queued and free.size:
            # in order, one sample a slot: whole groups where they fit, single samples
            # before a group's boundary and once fewer than g slots are left
            k = min(free.size, self.flat.size - self.qi)
            head = min(k, -self.qi % g)
            groups, rest = divmod(k - head, g)
            self.pre += c.prefill_s * -(-(k - head) // g)
            self.ins += c.insert_s * (head + groups + rest)
            into, got = free[:k], self.flat[self.qi : self.qi + k]
            self.length[into] = got
            self.left[into] = np.maximum(got - 1, 0)  # the prefill gave one token
            self.qi += k
        while self.queued and self.whole_groups:
            n = g if (self.whole_groups or (self.qi % g == 0 and free.size - k >= g)) else 1
            if n > free.size - k:
                break
            if self.qi % g == 0:  # the prompt's first sample: its prefill
                self.pre += c.prefill_s
            self.ins += c.insert_s
            into, got = free[k : k + n], self.flat[self.qi : self.qi + n]
            self.length[into] = got
            self.left[into] = np.maximum(got - 1, 0)  # the prefill gave one token
            k, self.qi = k + n, self.qi + n
        ended = self.left == 0  # one token, from the prefill: done at once
        self.done += int(ended.sum())
        self.left[ended] = -1
        self.mark()
        if not self.queued and self.last_insert is None:
            self.last_insert = (self.t, self.slot_steps, self.tokens)
        return k

    def chunk(self, live: np.ndarray) -> None:
        """Decodes one chunk over the ``live`` slots (or several in which nothing ends)."""
        rows, min_live, pub = self.slots, 0, self.publish
        if self.compact and not self.queued:
            rows = min(x for x in self.sizes if x >= live.size)
            min_live = max([x for x in self.sizes if x < rows], default=0)
        # the chunk ends after decode_steps, or once at most min_live rows have tokens left
        rem = self.left[live]
        done_by = np.partition(rem, rem.size - min_live - 1)[rem.size - min_live - 1]
        n = int(min(self.decode_steps, done_by))
        # whole chunks in which no response ends and nothing waits for a free slot change
        # nothing but the clock: run them at once (up to the next publish)
        k = 1
        if n == self.decode_steps and (not self.queued or live.size == self.slots):
            k = max((int(rem.min()) - 1) // n, 1)
        if pub and self.published < pub.times:
            k = min(k, pub.every - self.chunks % pub.every)
        got = int(np.minimum(rem, n * k).sum())
        self.tokens += got
        self.left[live] = np.where(rem > n * k, rem - n * k, -1)
        self.done += int((rem <= n * k).sum())
        self.steps, self.chunks = self.steps + n * k, self.chunks + k
        self.slot_steps += n * k * rows
        self.dec += n * k * self.costs.step(got / (n * k) if self.costs.by_live else rows)
        self.host += k * self.costs.chunk_s
        if pub and self.chunks % pub.every == 0 and self.published < pub.times:
            self.published += 1
            if pub.reprefill:  # the context of every response still in flight
                held = self.left > 0
                context = pub.prompt_length * int(held.sum())
                context += int((self.length - self.left)[held].sum())
                self.rep += context * self.costs.reprefill_token_s
        self.mark()

    def schedule(self) -> Schedule:
        t = self.t
        t0, s0, k0 = self.last_insert or (t, self.slot_steps, self.tokens)
        return Schedule(
            total_s=t,
            decode_s=self.dec,
            prefill_s=self.pre,
            insert_s=self.ins,
            host_s=self.host,
            steps=self.steps,
            chunks=self.chunks,
            slot_steps=self.slot_steps,
            tokens=self.tokens,
            drain_s=t - t0,
            drain_slot_steps=self.slot_steps - s0,
            drain_tokens=self.tokens - k0,
            reprefill_s=self.rep,
            publishes=self.published,
            marks=tuple(self.marks),
        )


def simulate(
    lengths: Sequence[Sequence[int]] | np.ndarray,
    *,
    slots: int,
    decode_steps: int,
    costs: Costs,
    sizes: Sequence[int] = (),
    compact: bool = False,
    whole_groups: bool = False,
    publish: Publish | None = None,
    batch: int | None = None,
) -> Schedule:
    """Replays one lane decoding ``lengths[p][j]`` tokens for sample j of prompt p.

    Args:
      lengths: each prompt's samples' response lengths (every prompt has G samples); a
        response of L tokens takes L - 1 decode steps (the prefill gives the first).
      slots: the lane's decode slots.
      decode_steps: steps per chunk.
      costs: measured costs.
      sizes: the batch sizes compaction computes (``Engine.compact_sizes``).
      compact: compaction on (``rollout.compact_batch``).
      whole_groups: inserts take whole groups only (``RolloutDriver``'s light steps).
      publish: partial rollouts (None: off).
      batch: record ``marks`` every this many finished responses.
    """
    lane = _Lane(lengths, slots, decode_steps, costs, sizes, compact, whole_groups, publish, batch)
    while lane.queued or (lane.left > 0).any():
        inserted = lane.fill()
        live = np.flatnonzero(lane.left > 0)
        if live.size:
            lane.chunk(live)
        elif not inserted and lane.queued:
            raise ValueError(f"a group of {lane.g} samples does not fit {slots} slots")
    return lane.schedule()


def carried(
    lengths: Sequence[Sequence[int]] | np.ndarray,
    *,
    batch: int,
    steps: int,
    slots: int,
    decode_steps: int,
    costs: Costs,
    warmup: int = 1,
) -> float:
    """Seconds per step of a carried rollout: each step ends at ``batch`` finished
    responses and the unfinished ones go on into the next, so the slots never drain. The
    mean time between the marks of steps ``warmup`` and ``warmup + steps`` of a replay of
    ``lengths`` (``slots``, ``decode_steps``, ``costs``: ``simulate``'s), which must outlast
    them with the queue not yet empty."""
    s = simulate(lengths, batch=batch, slots=slots, decode_steps=decode_steps, costs=costs)
    end = warmup + steps
    if len(s.marks) < end or s.marks[end - 1] > s.total_s - s.drain_s:
        raise ValueError(f"lengths too few for {steps} carried steps of {batch} after {warmup}")
    return (s.marks[end - 1] - s.marks[warmup - 1]) / steps
