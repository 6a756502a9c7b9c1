"""RL rollouts: G samples per prompt with continuous batching over the engine's slots."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx

from magic_jax import interrupt, watchdog
from magic_jax.rollout.decode import DecodeState, Prefix
from magic_jax.rollout.engine import Engine
from magic_jax.rollout.engine_config import DECODE_LANES_DEFAULT as DECODE_LANES_DEFAULT
from magic_jax.rollout.engine_config import EngineConfig, EngineOptions, compacts
from magic_jax.rollout.engine_config import default_lanes as default_lanes
from magic_jax.rollout.protocols import VersionSchedule
from magic_jax.rollout.samples import RolloutStats, Sample, SlotBuffers, Truncation
from magic_jax.rollout.sampling import Draw, SamplingConfig

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from magic_jax.model.qwen2 import Qwen2


class _Pending:
    """A sample in a slot: its prompt, index and limit (its tokens are in ``SlotBuffers``)."""

    __slots__ = ("j", "limit", "p")

    def __init__(self, p: int, j: int, limit: int):
        self.p = p
        self.j = j
        self.limit = limit


@dataclasses.dataclass
class _Work:
    """A rollout's shared state: what is left to insert and what has finished.

    Lane i inserts ``queues[i]`` (prompt p's samples go to lane p % lanes: a lane's
    batches never depend on thread timing, and XLA's CPU products round a row with its
    batch) and uses ``prefixes`` under ``lock``; a finished sample is recorded (and
    ``on_sample`` called) under it too.
    """

    prompts: list[np.ndarray]
    num_samples: int
    limits: np.ndarray
    queues: list[collections.deque]
    on_sample: Callable[[Sample], None] | None
    ids: list[int] = dataclasses.field(default_factory=list)
    prefixes: dict[int, Prefix] = dataclasses.field(default_factory=dict)
    prefix_versions: dict[int, int] = dataclasses.field(default_factory=dict)
    done: list[Sample] = dataclasses.field(default_factory=list)
    errors: list[BaseException] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def finish(self, sample: Sample) -> None:
        with self.lock:
            self.done.append(sample)
            if self.on_sample is not None:
                self.on_sample(sample)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class _Lane:
    """One decode lane's loop over its slots (``run``): insert queued samples into the
    free slots, fetch their first tokens, decode a chunk, take the finished samples out;
    until its queue in ``work`` is empty and its slots are done (or another lane failed).

    The decode state stays on the device between chunks: the host reads only the first
    tokens of the samples inserted since the last chunk (one transfer) and the chunk's
    outputs.
    """

    def __init__(
        self,
        engine: Engine,
        queue: collections.deque[tuple[int, int]],
        params: nnx.State,
        state: DecodeState,
        unembed_VD: jax.Array | None,
        work: _Work,
        stats: RolloutStats,
        *,
        seed: int,
        step: int,
        truncation: Truncation,
        profile: bool,
        schedule: VersionSchedule | None = None,
    ):
        self.eng = engine
        self.cfg = engine.config
        self.schedule = schedule
        self.version = 0 if schedule is None else schedule.start
        self.reprefill = getattr(schedule, "reprefill", False)
        self.queue = queue
        self.params = params
        self.state = state
        self.unembed_VD = unembed_VD
        self.work = work
        self.stats = stats
        self.seed = seed
        self.step = step
        self.truncation = truncation
        self.profile = profile
        self.b_max = b_max = self.cfg.max_concurrent_decodes
        self.slot_of: list[_Pending | None] = [None] * b_max
        self.prompt_len = np.zeros(b_max, np.int64)
        limit = max(int(work.limits.max(initial=1)), 1)
        self.buffers = SlotBuffers(b_max, limit, versions=schedule is not None)
        # (samples, slots, first tokens, the version of their prompt's prefill)
        self.first_draws: list[tuple[list[_Pending], list[int], Draw, int]] = []
        self.eos = set(engine.eos_ids)
        self.sizes = engine.compact_sizes()
        self.whole_groups = engine.light_cpu_step and work.num_samples <= b_max
        self.compact = compacts(self.cfg)

    def run(self) -> DecodeState:
        """Decodes the lane's queue; returns the lane's decode state."""
        while (self.queue or any(s is not None for s in self.slot_of)) and not self.work.errors:
            self._switch_version()
            t0 = time.perf_counter()
            self._fill_free_slots()
            self._start_inserted()
            live = [s for s in range(self.b_max) if self.slot_of[s] is not None]
            if not live:
                self.stats.host_s += time.perf_counter() - t0
                continue
            rows, min_live, attend = self._chunk_shape(live)
            self.stats.host_s += time.perf_counter() - t0
            self._decode_chunk(rows, min_live, attend)
        return self.state

    def _switch_version(self) -> None:
        """Moves to the version the schedule names for this lane's chunk count (waiting
        until it is published): its weights decode from here on, into the same cache, or
        (``schedule.reprefill``) into caches prefilled again under it."""
        if self.schedule is None:
            return
        v = self.schedule.version_at(self.stats.chunks)
        if v != self.version:
            tw = time.perf_counter()
            self.params = self.schedule.params(v)
            self.unembed_VD = self.eng.decode_unembedding(self.params)
            self.version = v
            self.stats.version_wait_s += time.perf_counter() - tw
            if self.reprefill:
                self._reprefill_live()

    def _reprefill_live(self) -> None:
        """Each response in flight prefilled again under the lane's (new) weights."""
        tp = time.perf_counter()
        for slot, pend in enumerate(self.slot_of):
            if pend is not None:
                seq = self.buffers.sequence(slot, self.work.prompts[pend.p])
                self.state = self.eng.reprefill(self.params, self.state, slot, seq)
                self.stats.reprefills += 1
        self.stats.prefill_s += time.perf_counter() - tp

    def _fill_free_slots(self) -> None:
        free = collections.deque(s for s in range(self.b_max) if self.slot_of[s] is None)
        while free:
            with self.work.lock:
                taken = self._take(len(free))
            if taken is None:
                break
            entries, prefix = taken
            self._insert(entries, prefix, [free.popleft() for _ in entries])

    def _take(self, free: int) -> tuple[list[tuple[int, int]], Prefix] | None:
        """The next samples to insert (all of one prompt) and their prompt's prefix
        (prefilled once per prompt), or None when none fit (under ``work.lock``)."""
        queue, work, g = self.queue, self.work, self.work.num_samples
        if not queue:
            return None
        p, j = queue[0]
        # A whole group into free slots is one call, anything else one per sample (two
        # compiled shapes). For a light step, whole groups only where a group fits the
        # slots: the slots a group does not fill wait for the next to free (such a step's
        # cost hardly grows with its rows), and there is one compiled insert per cache shape.
        if self.whole_groups:
            n = g
            if free < n:
                return None
        else:
            n = g if j == 0 and free >= g else 1
            if n > 1 and (len(queue) < n or queue[n - 1] != (p, n - 1)):
                n = 1
        entries = [queue.popleft() for _ in range(n)]
        stale = self.reprefill and work.prefix_versions.get(p, self.version) != self.version
        if p not in work.prefixes or stale:  # a re-prefilling lane uses no older prefix
            tp = time.perf_counter()
            work.prefixes[p] = self.eng.prefill(self.params, work.prompts[p])
            work.prefix_versions[p] = self.version
            if self.profile:
                jax.block_until_ready(work.prefixes[p])
            self.stats.prefill_s += time.perf_counter() - tp
            self.stats.prefills += 1
        last = entries[-1][1] == g - 1
        return entries, work.prefixes.pop(p) if last else work.prefixes[p]

    def _insert(self, entries: list[tuple[int, int]], prefix: Prefix, slots: list[int]) -> None:
        work, p = self.work, entries[0][0]
        pends = [_Pending(p, jj, int(work.limits[p, jj])) for _, jj in entries]
        ti = time.perf_counter()
        self.state, first = self.eng.insert_group(
            prefix,
            self.state,
            slots,
            seed=self.seed,
            step=self.step,
            prompt=work.ids[p],
            samples=[jj for _, jj in entries],
            max_new_tokens=[x.limit for x in pends],
        )
        if self.profile:
            jax.block_until_ready(self.state)
        self.stats.insert_s += time.perf_counter() - ti
        for pend, slot in zip(pends, slots):
            self.slot_of[slot], self.prompt_len[slot] = pend, len(work.prompts[p])
        self.first_draws.append((pends, slots, first, work.prefix_versions.get(p, self.version)))

    def _start_inserted(self) -> None:
        """Token 0 of each sample inserted since the last chunk was sampled at insert;
        fetched here (one transfer for all), it may end the sample at once."""
        fetched = jax.device_get([d[2] for d in self.first_draws])
        for (pends, slots, _, v), f in zip(self.first_draws, fetched):
            draws = tuple(np.asarray(x).reshape(-1) for x in f)
            self.buffers.start(np.asarray(slots), draws, v)
            for i, (pend, slot) in enumerate(zip(pends, slots)):
                if int(f.tokens[i]) in self.eos or pend.limit <= 1:
                    self._finish(pend, slot)
        self.first_draws.clear()

    def _chunk_shape(self, live: list[int]) -> tuple[np.ndarray | None, int, int]:
        """(the rows the chunk computes, None for all; the live rows under which it stops;
        the cache positions it attends to)."""
        cfg, sizes, s_max = self.cfg, self.sizes, self.cfg.cache_length
        rows, min_live = None, 0
        if self.compact and not self.queue:
            b = min(x for x in sizes if x >= len(live))
            if b < self.b_max:
                spare = [s for s in range(self.b_max) if self.slot_of[s] is None]
                rows = np.asarray(live + spare[: b - len(live)], np.int32)
            # Stop the chunk once the live rows fit the next size down.
            min_live = max([x for x in sizes if x < b], default=0)
        # a row's cache holds its prompt and every response token but the newest
        longest = int((self.prompt_len[live] + self.buffers.length[live]).max()) - 1
        attend = s_max
        if cfg.cache_bucket:
            attend = min(s_max, _round_up(longest + 1, cfg.cache_bucket))
        return rows, min_live, attend

    def _decode_chunk(self, rows: np.ndarray | None, min_live: int, attend: int) -> None:
        """One chunk of decode steps; its tokens go to the slot buffers and the samples
        that ended leave their slots."""
        interrupt.check("rollout")
        watchdog.beat("decode chunk")
        stats, b_max = self.stats, self.b_max
        td = time.perf_counter()
        self.state, outs, steps_run = self.eng.generate_chunk(
            self.params,
            self.state,
            unembed_VD=self.unembed_VD,
            rows=rows,
            attend=attend,
            # refill once a whole group's slots are free (one insert call), or
            # what the queue still holds
            stop_on_free=min(len(self.queue), self.work.num_samples),
            min_live=min_live,
        )
        n = int(steps_run)
        outs = jax.tree.map(lambda x: np.asarray(x)[:n], outs)  # the steps run, on the host
        dt = time.perf_counter() - td
        stats.decode_s += dt
        at = stats.by_batch.setdefault(b_max if rows is None else len(rows), [0, 0.0])
        at[0] += n
        at[1] += dt

        t1 = time.perf_counter()
        cols = np.arange(b_max) if rows is None else rows
        stats.chunks += 1
        stats.steps += n
        stats.slot_steps += n * len(cols)
        self.buffers.add(cols, outs, self.version)  # only live rows produce valid tokens
        for c in np.flatnonzero(outs.done.any(axis=0)):
            slot = int(cols[c])
            if (pend := self.slot_of[slot]) is not None:
                self._finish(pend, slot)
        stats.host_s += time.perf_counter() - t1

    def _finish(self, pend: _Pending, slot: int) -> None:
        tokens, logp, ent, slp, versions = self.buffers.take(slot)
        hit_eos = len(tokens) > 0 and int(tokens[-1]) in self.eos
        length = len(tokens)
        truncated = not hit_eos if self.truncation == "no_eos" else length == pend.limit
        sample = Sample(
            prompt_index=self.work.ids[pend.p],
            sample_index=pend.j,
            prompt_tokens=self.work.prompts[pend.p],
            tokens=tokens,
            logprobs=logp,  # the slot buffers' float32 copies
            entropies=ent,
            sampling_logprobs=slp,
            truncated=bool(truncated),
            length=length,
            finish_reason="eos" if hit_eos else "length",
            versions=versions,
        )
        self.slot_of[slot] = None
        self.work.finish(sample)


class RolloutDriver:
    """Samples groups of responses with continuous batching over an ``Engine``.

    Each prompt is prefilled once and its G samples are inserted into slots as
    they free up; a slot is refilled as soon as its sequence ends (EOS or its
    limit), so long responses never idle the batch. Sample ``j`` of prompt ``p``
    draws token ``t`` with ``fold_in(seed, step, p, j, t)``, so results do not
    depend on slots or scheduling. The decode state (KV cache) is allocated once
    and reused across calls.
    """

    def __init__(self, engine: Engine, lanes: int = 1):
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        self.engine = engine
        self.lanes = lanes
        self._states: list[DecodeState | None] = [None] * lanes

    def with_sampling(self, sampling: SamplingConfig) -> RolloutDriver:
        """A driver that samples with ``sampling`` on this one's engine and decode state
        (its KV cache: an evaluation at several temperatures holds one). The two share
        the cache, so they must not run at once."""
        other = RolloutDriver(self.engine.with_sampling(sampling), lanes=self.lanes)
        other._states = self._states
        return other

    def load_params(self, model_or_params: Qwen2 | nnx.State) -> nnx.State:
        """The weights in the engine's layout, as ``run`` takes them (``Engine.load_params``)."""
        return self.engine.load_params(model_or_params)

    def _work(
        self,
        prompts: Sequence[np.ndarray],
        num_samples: int,
        max_new_tokens: int | np.ndarray | None,
        on_sample: Callable[[Sample], None] | None,
        prompt_indices: Sequence[int] | None,
    ) -> _Work:
        """A rollout's work: prompt p's samples queued on lane ``prompt_indices[p] % lanes``."""
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        limit = self.engine.config.max_decode_length if max_new_tokens is None else max_new_tokens
        limits = np.broadcast_to(np.asarray(limit, np.int64), (len(prompts), num_samples))
        ids = list(range(len(prompts))) if prompt_indices is None else list(prompt_indices)
        if len(ids) != len(prompts) or len(set(ids)) != len(ids):
            raise ValueError(
                f"prompt_indices: {len(prompts)} distinct indices needed, got {ids[:8]}..."
            )
        k, order = self.lanes, [(p, j) for p in range(len(prompts)) for j in range(num_samples)]
        return _Work(
            prompts=[np.asarray(p, np.int32).reshape(-1) for p in prompts],
            num_samples=num_samples,
            limits=limits,
            queues=[collections.deque(e for e in order if ids[e[0]] % k == i) for i in range(k)],
            on_sample=on_sample,
            ids=ids,
        )

    @property
    def max_concurrent_decodes(self) -> int:
        """Slots over all lanes."""
        return self.lanes * self.engine.config.max_concurrent_decodes

    def run(
        self,
        params: nnx.State,
        prompts: Sequence[np.ndarray],
        *,
        num_samples: int = 1,
        seed: int = 0,
        step: int = 0,
        max_new_tokens: int | np.ndarray | None = None,
        truncation: Truncation = "no_eos",
        profile: bool = False,
        on_sample: Callable[[Sample], None] | None = None,
        prompt_indices: Sequence[int] | None = None,
        schedule: VersionSchedule | None = None,
    ) -> tuple[list[Sample], RolloutStats]:
        """Generates ``num_samples`` responses for each prompt.

        Args:
          params: parameters in the engine's (sampling) layout.
          prompts: token id arrays, one per prompt.
          num_samples: G, samples per prompt.
          seed / step: randomness is ``fold_in(seed, step, prompt, sample, token)``.
          max_new_tokens: response limit T: an int, or [num_prompts, G] per sample;
            default the engine's ``max_decode_length``.
          truncation: how ``Sample.truncated`` is counted.
          profile: block after each prefill and insert so their time is exact.
          on_sample: called with each sample as soon as it ends, while the others
            still decode (e.g. to submit it to a ``VerifierPool``); with several
            lanes, from their threads, one call at a time. An exception it raises
            ends the rollout.
          prompt_indices: each prompt's index in the whole rollout it belongs to
            (default 0, 1, ...): its samples' keys and ``Sample.prompt_index``. A
            rollout resumed with only its unfinished groups passes their indices,
            so each group draws what it would have drawn among all of them.
          schedule: the policy versions each lane samples with, by its chunk count
            (``params`` is then version ``schedule.start``'s weights); each sample
            records its tokens' versions (``Sample.versions``).

        Raises:
          interrupt.Interrupted: a stop was asked (checked before each decode chunk).

        Returns:
          (samples ordered by (prompt, sample), stats; with several lanes the
          stats' times are summed over them, ``wall_s`` is the rollout's).
        """
        if truncation not in ("no_eos", "length"):
            raise ValueError(f"truncation must be 'no_eos' or 'length', got {truncation!r}")
        t_start = time.perf_counter()
        eng = self.engine
        work = self._work(prompts, num_samples, max_new_tokens, on_sample, prompt_indices)
        states = [s if s is not None else eng.init_decode_state() for s in self._states]
        self._states[:] = [None] * self.lanes  # donated below; restored at the end
        unembed_VD = eng.decode_unembedding(params)
        lane_stats = [RolloutStats() for _ in range(self.lanes)]

        def lane(i: int) -> None:
            try:
                states[i] = _Lane(
                    eng,
                    work.queues[i],
                    params,
                    states[i],
                    unembed_VD,
                    work,
                    lane_stats[i],
                    seed=seed,
                    step=step,
                    truncation=truncation,
                    profile=profile,
                    schedule=schedule,
                ).run()
            except BaseException as e:  # re-raised below, in the calling thread
                work.errors.append(e)

        # Each further lane decodes its own slots in its own thread: their compiled
        # programs run at once (XLA runs them without the GIL), and each lane inserts
        # its own prompts' groups as its slots free.
        threads = [
            threading.Thread(target=lane, args=(i,), name=f"rollout-lane-{i}")
            for i in range(1, self.lanes)
        ]
        for t in threads:
            t.start()
        lane(0)
        for t in threads:
            t.join()
        if work.errors:
            raise work.errors[0]
        self._states[:] = states
        stats = RolloutStats.merged(lane_stats)
        samples = sorted(work.done, key=lambda s: (s.prompt_index, s.sample_index))
        stats.tokens = sum(s.length for s in samples)
        stats.wall_s = time.perf_counter() - t_start
        return samples, stats


def make_driver(
    model: Qwen2,
    options: EngineOptions,
    *,
    max_prompt_length: int,
    max_response_length: int,
    sampling: SamplingConfig,
    mesh: Mesh | None = None,
) -> RolloutDriver:
    """A ``RolloutDriver`` over fresh engines with these options, shapes and sampling.

    Training (one per stage and one for its evaluations) and the evaluation
    commands all build their engines here.

    Args:
      model: the policy (``Qwen2``); its graph and shapes, not its weights, are used.
      options: the engine's options (a run's ``rollout`` section is one); its
        ``max_concurrent_decodes`` slots are split over ``options.lanes`` lanes
        (None: ``default_lanes``), each lane's share in its own thread (``RolloutDriver``).
      max_prompt_length / max_response_length: the engine's limits.
      sampling: the sampling strategy.
      mesh: the device mesh (None: one device).
    """
    lanes = options.lanes
    if lanes is None:
        lanes = default_lanes(options.max_concurrent_decodes, mesh, model.config.num_params())
    config = EngineConfig.of(
        options,
        max_concurrent_decodes=options.max_concurrent_decodes // lanes,
        lanes=1,
        max_prefill_length=max_prompt_length,
        max_decode_length=max_response_length,
        sampling=sampling,
    )
    return RolloutDriver(Engine(model, config, mesh=mesh), lanes=lanes)
