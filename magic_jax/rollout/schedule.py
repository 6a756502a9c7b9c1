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
    if slots < 1 or decode_steps < 1:
        raise ValueError(f"slots and decode_steps must be >= 1, got {slots}, {decode_steps}")
    flat = np.asarray(lengths, np.int64)
    g = flat.shape[1] if flat.ndim == 2 else 0
    flat = flat.reshape(-1)
    qi, nq = 0, flat.size  # the queue: samples in prompt order from qi on
    left = np.full(slots, -1, np.int64)  # decode steps left; -1: an empty slot
    length = np.zeros(slots, np.int64)
    dec = pre = ins = host = rep = 0.0
    steps = chunks = slot_steps = tokens = done = published = 0
    marks: list[float] = []
    last_insert = None  # (t, slot_steps, tokens) when the queue emptied
    sizes = sorted(set(sizes) | {slots})

    def mark() -> None:
        while batch and done >= (len(marks) + 1) * batch:
            marks.append(pre + ins + dec + host + rep)

    while qi < nq or (left > 0).any():
        free, k = np.flatnonzero(left < 0), 0
        while qi < nq:
            n = g if (whole_groups or (qi % g == 0 and free.size - k >= g)) else 1
            if n > free.size - k:
                break
            if qi % g == 0:  # the prompt's first sample: its prefill
                pre += costs.prefill_s
            ins += costs.insert_s
            into = free[k : k + n]
            length[into] = flat[qi : qi + n]
            left[into] = np.maximum(flat[qi : qi + n] - 1, 0)  # the prefill gave one token
            k, qi = k + n, qi + n
        ended = left == 0  # one token, from the prefill: done at once
        done += int(ended.sum())
        left[ended] = -1
        mark()
        if qi >= nq and last_insert is None:
            last_insert = (pre + ins + dec + host + rep, slot_steps, tokens)
        live = np.flatnonzero(left > 0)
        if not live.size:
            if k == 0 and qi < nq:
                raise ValueError(f"a group of {g} samples does not fit {slots} slots")
            continue
        rows, min_live = slots, 0
        if compact and qi >= nq:
            rows = min(x for x in sizes if x >= live.size)
            min_live = max([x for x in sizes if x < rows], default=0)
        # the chunk ends after decode_steps, or once at most min_live rows have tokens left
        rem = left[live]
        done_by = np.partition(rem, rem.size - min_live - 1)[rem.size - min_live - 1]
        n = int(min(decode_steps, done_by))
        # whole chunks in which no response ends and nothing waits for a free slot change
        # nothing but the clock: run them at once (up to the next publish)
        k = 1
        if n == decode_steps and (qi >= nq or live.size == slots):
            k = max((int(rem.min()) - 1) // n, 1)
        if publish and published < publish.times:
            k = min(k, publish.every - chunks % publish.every)
        got = int(np.minimum(rem, n * k).sum())
        tokens += got
        left[live] = np.where(rem > n * k, rem - n * k, -1)
        done += int((rem <= n * k).sum())
        steps, chunks, slot_steps = steps + n * k, chunks + k, slot_steps + n * k * rows
        dec += n * k * costs.step(got / (n * k) if costs.by_live else rows)
        host += k * costs.chunk_s
        if publish and chunks % publish.every == 0 and published < publish.times:
            published += 1
            if publish.reprefill:  # the context of every response still in flight
                held = left > 0
                context = publish.prompt_length * int(held.sum())
                rep += (context + int((length - left)[held].sum())) * costs.reprefill_token_s
        mark()
    t = pre + ins + dec + host + rep
    t0, s0, k0 = last_insert if last_insert is not None else (t, slot_steps, tokens)
    return Schedule(
        total_s=t,
        decode_s=dec,
        prefill_s=pre,
        insert_s=ins,
        host_s=host,
        steps=steps,
        chunks=chunks,
        slot_steps=slot_steps,
        tokens=tokens,
        drain_s=t - t0,
        drain_slot_steps=slot_steps - s0,
        drain_tokens=tokens - k0,
        reprefill_s=rep,
        publishes=published,
        marks=tuple(marks),
    )


def carried(
    lengths: Sequence[Sequence[int]] | np.ndarray,
    *,
    batch: int,
    steps: int,
    warmup: int = 1,
    **kw: object,
) -> float:
    """Seconds per step of a carried rollout: each step ends at ``batch`` finished
    responses and the unfinished ones go on into the next, so the slots never drain. The
    mean time between the marks of steps ``warmup`` and ``warmup + steps`` of a replay of
    ``lengths`` (``simulate``'s other arguments in ``kw``), which must outlast them with
    the queue not yet empty."""
    s = simulate(lengths, batch=batch, **kw)  # type: ignore[arg-type]
    end = warmup + steps
    if len(s.marks) < end or s.marks[end - 1] > s.total_s - s.drain_s:
        raise ValueError(f"lengths too few for {steps} carried steps of {batch} after {warmup}")
    return (s.marks[end - 1] - s.marks[warmup - 1]) / steps
