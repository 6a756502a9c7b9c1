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
slots idle while the longest responses finish, the time partial rollouts recover.
"""

from __future__ import annotations

import collections
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
    """

    step_s: Mapping[int, float]
    prefill_s: float = 0.0
    insert_s: float = 0.0
    chunk_s: float = 0.0

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
class Schedule:
    """A replayed rollout.

    Attributes:
      total_s: its time; ``decode_s``, ``prefill_s``, ``insert_s``, ``host_s`` its parts.
      steps / chunks: decode steps and chunks.
      slot_steps: rows computed (steps x batch size); ``tokens`` the useful ones (decode
        steps' tokens: a response's first comes from its prefill).
      drain_s: time from the last insert to the end; ``drain_slot_steps`` the rows
        computed then and ``drain_tokens`` the useful ones.
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

    @property
    def drain_share(self) -> float:
        """The drain's share of the rollout's time."""
        return self.drain_s / self.total_s if self.total_s else 0.0

    @property
    def idle_share(self) -> float:
        """Rows computed for no token (finished or empty slots), of all rows computed."""
        return 1.0 - self.tokens / self.slot_steps if self.slot_steps else 0.0


def simulate(
    lengths: Sequence[Sequence[int]],
    *,
    slots: int,
    decode_steps: int,
    costs: Costs,
    sizes: Sequence[int] = (),
    compact: bool = False,
    whole_groups: bool = False,
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
    """
    if slots < 1 or decode_steps < 1:
        raise ValueError(f"slots and decode_steps must be >= 1, got {slots}, {decode_steps}")
    g = len(lengths[0]) if lengths else 0
    queue = collections.deque((p, j) for p in range(len(lengths)) for j in range(g))
    left: list[int | None] = [None] * slots
    prefilled: set[int] = set()
    dec = pre = ins = host = 0.0
    steps = chunks = slot_steps = tokens = 0
    last_insert = None  # (t, slot_steps, tokens) when the queue emptied
    sizes = sorted(set(sizes) | {slots})
    while queue or any(x is not None for x in left):
        free = [s for s in range(slots) if left[s] is None]
        while free and queue:
            p, j = queue[0]
            n = g if (whole_groups or (j == 0 and len(free) >= g)) else 1
            if n > len(free):
                break
            entries = [queue.popleft() for _ in range(n)]
            if p not in prefilled:
                prefilled.add(p)
                pre += costs.prefill_s
            ins += costs.insert_s
            for q, k in entries:  # the prefill gave each its first token
                left[free.pop(0)] = max(int(lengths[q][k]) - 1, 0)
        for s in range(slots):  # one token, from the prefill: done at once
            if left[s] == 0:
                left[s] = None
        if not queue and last_insert is None:
            last_insert = (pre + ins + dec + host, slot_steps, tokens)
        live = [s for s in range(slots) if left[s] is not None]
        if not live:
            continue
        rows, min_live = slots, 0
        if compact and not queue:
            rows = min(x for x in sizes if x >= len(live))
            min_live = max([x for x in sizes if x < rows], default=0)
        # the chunk ends after decode_steps, or once at most min_live rows have tokens left
        rem = np.asarray([left[s] for s in live], np.int64)
        done_by = np.sort(rem)[len(rem) - min_live - 1]
        n = int(min(decode_steps, done_by))
        tokens += int(np.minimum(rem, n).sum())
        for s, r in zip(live, rem - n):
            left[s] = int(r) if r > 0 else None
        steps, chunks, slot_steps = steps + n, chunks + 1, slot_steps + n * rows
        dec += n * costs.step(rows)
        host += costs.chunk_s
    t = pre + ins + dec + host
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
    )
