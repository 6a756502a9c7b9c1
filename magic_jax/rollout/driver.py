"""RL rollouts: G samples per prompt with continuous batching over the engine's slots."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx

from magic_jax import interrupt, watchdog
from magic_jax.rollout.decode import DecodeState, Prefix, StepOutput
from magic_jax.rollout.engine import Engine
from magic_jax.rollout.engine_config import DECODE_LANES_DEFAULT as DECODE_LANES_DEFAULT
from magic_jax.rollout.engine_config import default_lanes as default_lanes
from magic_jax.rollout.sampling import SamplingConfig

Truncation = Literal["no_eos", "length"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """One response of the policy to one prompt.

    Attributes:
      prompt_index: index of the prompt in the rollout's prompt list.
      sample_index: index of this sample in its group, in [0, G).
      prompt_tokens: [P] int32 prompt ids.
      tokens: [L] int32 response ids, EOS included when the response has one.
      logprobs: [L] float32 behaviour log-prob of each response token under the
        temperature-scaled full distribution (what the trainer recomputes).
      entropies: [L] float32 entropy of that distribution at each token.
      sampling_logprobs: [L] float32 log-prob under the distribution sampled from
        (after top-k / top-p; equal to ``logprobs`` when they are off).
      truncated: see ``Truncation``: no EOS within the limit (``"no_eos"``) or
        length equal to the limit, EOS counted (``"length"``, the reference code).
      length: L, exact.
      finish_reason: ``"eos"`` or ``"length"``.
    """

    prompt_index: int
    sample_index: int
    prompt_tokens: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    entropies: np.ndarray
    sampling_logprobs: np.ndarray
    truncated: bool
    length: int
    finish_reason: Literal["eos", "length"]


@dataclasses.dataclass
class RolloutStats:
    """Where a rollout's time went (seconds) and how full the decode batch was.

    ``prefill_s`` / ``insert_s`` are exact only with ``profile=True`` (else the
    work is asynchronous and lands in ``decode_s``). ``slot_steps`` counts rows
    computed per device step (the batch run), ``tokens`` the useful ones;
    ``by_batch`` maps a decode batch size to [steps, seconds] spent at it.
    """

    tokens: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    insert_s: float = 0.0
    decode_s: float = 0.0
    host_s: float = 0.0
    chunks: int = 0
    steps: int = 0
    slot_steps: int = 0
    prefills: int = 0
    by_batch: dict[int, list[float]] = dataclasses.field(default_factory=dict)


class _Pending:
    """A sample in a slot: its prompt, index and limit (its tokens are in ``_SlotBuffers``)."""

    __slots__ = ("j", "limit", "p")

    def __init__(self, p: int, j: int, limit: int):
        self.p, self.j, self.limit = p, j, limit


class _SlotBuffers:
    """The responses growing in the slots, on the host: [slots, T] per field.

    A chunk's outputs land in one scatter per field (no per-slot Python work),
    and a finished sample is one slice per field.
    """

    def __init__(self, slots: int, limit: int):
        self.length = np.zeros(slots, np.int64)
        self.fields = (
            np.zeros((slots, limit), np.int32),  # tokens
            np.zeros((slots, limit), np.float32),  # logprobs
            np.zeros((slots, limit), np.float32),  # entropies
            np.zeros((slots, limit), np.float32),  # sampling_logprobs
        )

    def start(self, slots: np.ndarray, draws: tuple[np.ndarray, ...]) -> None:
        """The first token of each of ``slots`` (sampled at insert)."""
        for buf, x in zip(self.fields, draws):
            buf[slots, 0] = x
        self.length[slots] = 1

    def add(self, slots: np.ndarray, outs: StepOutput) -> None:
        """A chunk's tokens [n, b] for the slots of its columns."""
        valid = outs.valid
        step, col = np.nonzero(valid)
        at = self.length[slots[col]] + (np.cumsum(valid, axis=0)[step, col] - 1)
        for buf, x in zip(self.fields, outs[:4]):
            buf[slots[col], at] = x[step, col]
        self.length[slots] += valid.sum(axis=0)

    def take(self, slot: int) -> tuple[np.ndarray, ...]:
        n = int(self.length[slot])
        return tuple(buf[slot, :n].copy() for buf in self.fields)


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
    done: list[Sample] = dataclasses.field(default_factory=list)
    errors: list[BaseException] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def finish(self, sample: Sample) -> None:
        with self.lock:
            self.done.append(sample)
            if self.on_sample is not None:
                self.on_sample(sample)


def _merge(parts: list[RolloutStats]) -> RolloutStats:
    """The lanes' stats in one (counts and times summed, ``by_batch`` per batch size)."""
    out = RolloutStats()
    for st in parts:
        for f in dataclasses.fields(RolloutStats):
            if f.name == "by_batch":
                for b, (n, t) in st.by_batch.items():
                    at = out.by_batch.setdefault(b, [0, 0.0])
                    at[0] += n
                    at[1] += t
            else:
                setattr(out, f.name, getattr(out, f.name) + getattr(st, f.name))
    return out


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


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

        Raises:
          interrupt.Interrupted: a stop was asked (checked before each decode chunk).

        Returns:
          (samples ordered by (prompt, sample), stats; with several lanes the
          stats' times are summed over them, ``wall_s`` is the rollout's).
        """
        if truncation not in ("no_eos", "length"):
            raise ValueError(f"truncation must be 'no_eos' or 'length', got {truncation!r}")
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        eng, cfg = self.engine, self.engine.config
        limits = np.broadcast_to(
            np.asarray(
                cfg.max_decode_length if max_new_tokens is None else max_new_tokens, np.int64
            ),
            (len(prompts), num_samples),
        )
        t_start = time.perf_counter()
        ids = list(range(len(prompts))) if prompt_indices is None else list(prompt_indices)
        if len(ids) != len(prompts) or len(set(ids)) != len(ids):
            raise ValueError(
                f"prompt_indices: {len(prompts)} distinct indices needed, got {ids[:8]}..."
            )
        k, order = self.lanes, [(p, j) for p in range(len(prompts)) for j in range(num_samples)]
        work = _Work(
            prompts=[np.asarray(p, np.int32).reshape(-1) for p in prompts],
            num_samples=num_samples,
            limits=limits,
            queues=[collections.deque(e for e in order if ids[e[0]] % k == i) for i in range(k)],
            on_sample=on_sample,
            ids=ids,
        )
        states = [s if s is not None else eng.init_decode_state() for s in self._states]
        self._states = [None] * self.lanes  # donated below; restored at the end
        unembed_VD = eng.decode_unembedding(params)
        lane_stats = [RolloutStats() for _ in range(self.lanes)]

        def lane(i: int) -> None:
            try:
                states[i] = self._lane(
                    i, params, states[i], unembed_VD, work, lane_stats[i],
                    seed=seed, step=step, truncation=truncation, profile=profile,
                )  # fmt: skip
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
        self._states = states
        stats = _merge(lane_stats)
        samples = sorted(work.done, key=lambda s: (s.prompt_index, s.sample_index))
        stats.tokens = sum(s.length for s in samples)
        stats.wall_s = time.perf_counter() - t_start
        return samples, stats

    def _lane(
        self,
        index: int,
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
    ) -> DecodeState:
        """Lane ``index``'s decode loop over its slots until its queue in ``work`` is empty
        and its slots are done (or another lane failed). Returns the lane's state."""
        eng, cfg = self.engine, self.engine.config
        b_max, s_max = cfg.max_concurrent_decodes, cfg.cache_length
        prompts, num_samples, queue = work.prompts, work.num_samples, work.queues[index]
        slot_of: list[_Pending | None] = [None] * b_max
        prompt_len = np.zeros(b_max, np.int64)
        buffers = _SlotBuffers(b_max, max(int(work.limits.max(initial=1)), 1))
        first_draws: list[tuple[list[_Pending], list[int], object]] = []
        eos = set(eng.eos_ids)
        sizes = eng.compact_sizes()
        whole_groups = eng.light_cpu_step and num_samples <= b_max

        def finish(pend: _Pending, slot: int):
            parts = buffers.take(slot)
            sample = self._to_sample(pend, parts, prompts, eos, truncation, work.ids[pend.p])
            slot_of[slot] = None
            work.finish(sample)

        while (queue or any(s is not None for s in slot_of)) and not work.errors:
            t0 = time.perf_counter()
            free = collections.deque(s for s in range(b_max) if slot_of[s] is None)
            while free:
                with work.lock:
                    if not queue:
                        break
                    p, j = queue[0]
                    # A whole group into free slots is one call, anything else one per
                    # sample (two compiled shapes). For a light step, whole groups only
                    # where a group fits the slots: the slots a group does not fill wait
                    # for the next to free (such a step's cost hardly grows with its
                    # rows), and there is one compiled insert per cache shape.
                    if whole_groups:
                        n = num_samples
                        if len(free) < n:
                            break
                    else:
                        n = num_samples if j == 0 and len(free) >= num_samples else 1
                        if n > 1 and (len(queue) < n or queue[n - 1] != (p, n - 1)):
                            n = 1
                    entries = [queue.popleft() for _ in range(n)]
                    if p not in work.prefixes:
                        tp = time.perf_counter()
                        work.prefixes[p] = eng.prefill(params, prompts[p])
                        if profile:
                            jax.block_until_ready(work.prefixes[p])
                        stats.prefill_s += time.perf_counter() - tp
                        stats.prefills += 1
                    last = entries[-1][1] == num_samples - 1
                    prefix = work.prefixes.pop(p) if last else work.prefixes[p]
                slots = [free.popleft() for _ in range(n)]
                pends = [_Pending(p, jj, int(work.limits[p, jj])) for _, jj in entries]
                ti = time.perf_counter()
                state, first = eng.insert_group(
                    prefix,
                    state,
                    slots,
                    seed=seed,
                    step=step,
                    prompt=work.ids[p],
                    samples=[jj for _, jj in entries],
                    max_new_tokens=[x.limit for x in pends],
                )
                if profile:
                    jax.block_until_ready(state)
                stats.insert_s += time.perf_counter() - ti
                for pend, slot in zip(pends, slots):
                    slot_of[slot], prompt_len[slot] = pend, len(prompts[p])
                first_draws.append((pends, slots, first))
            # Token 0 was sampled at insert; fetch those now (one transfer for all).
            fetched = jax.device_get([f for _, _, f in first_draws])
            for (pends, slots, _), f in zip(first_draws, fetched):
                buffers.start(np.asarray(slots), tuple(np.asarray(x).reshape(-1) for x in f))
                for i, (pend, slot) in enumerate(zip(pends, slots)):
                    if int(f.tokens[i]) in eos or pend.limit <= 1:
                        finish(pend, slot)
            first_draws.clear()
            live = [s for s in range(b_max) if slot_of[s] is not None]
            if not live:
                stats.host_s += time.perf_counter() - t0
                continue

            rows, min_live = None, 0
            if cfg.compact_batch and not queue:
                b = min(x for x in sizes if x >= len(live))
                if b < b_max:
                    spare = [s for s in range(b_max) if slot_of[s] is None]
                    rows = np.asarray(live + spare[: b - len(live)], np.int32)
                # Stop the chunk once the live rows fit the next size down.
                min_live = max([x for x in sizes if x < b], default=0)
            # a row's cache holds its prompt and every response token but the newest
            longest = int((prompt_len[live] + buffers.length[live]).max()) - 1
            attend = s_max
            if cfg.cache_bucket:
                attend = min(s_max, _round_up(longest + 1, cfg.cache_bucket))
            stats.host_s += time.perf_counter() - t0

            interrupt.check("rollout")
            watchdog.beat("decode chunk")
            td = time.perf_counter()
            state, outs, n = eng.generate_chunk(
                params,
                state,
                unembed_VD=unembed_VD,
                rows=rows,
                attend=attend,
                # refill once a whole group's slots are free (one insert call), or
                # what the queue still holds
                stop_on_free=min(len(queue), num_samples),
                min_live=min_live,
            )
            n = int(n)
            outs = StepOutput(*(np.asarray(x)[:n] for x in outs))
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
            buffers.add(cols, outs)  # only live rows produce valid tokens
            for c in np.flatnonzero(outs.done.any(axis=0)):
                slot = int(cols[c])
                if slot_of[slot] is not None:
                    finish(slot_of[slot], slot)
            stats.host_s += time.perf_counter() - t1
        return state

    @staticmethod
    def _to_sample(
        pend: _Pending,
        parts: tuple[np.ndarray, ...],
        prompts,
        eos: set[int],
        truncation: Truncation,
        index: int,
    ) -> Sample:
        tokens, logp, ent, slp = parts
        hit_eos = len(tokens) > 0 and int(tokens[-1]) in eos
        length = len(tokens)
        truncated = not hit_eos if truncation == "no_eos" else length == pend.limit
        return Sample(
            prompt_index=index,
            sample_index=pend.j,
            prompt_tokens=prompts[pend.p],
            tokens=tokens,
            logprobs=logp,  # the slot buffers' float32 copies
            entropies=ent,
            sampling_logprobs=slp,
            truncated=bool(truncated),
            length=length,
            finish_reason="eos" if hit_eos else "length",
        )


def make_driver(
    model: Any,
    *,
    max_prompt_length: int,
    max_response_length: int,
    sampling: SamplingConfig,
    max_concurrent_decodes: int = 32,
    decode_steps: int = 64,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    decode_attention: str | None = None,
    decode_layers: str | None = None,
    mesh: Any = None,
    lanes: int | None = None,
    compact_batch: bool = True,
) -> RolloutDriver:
    """A ``RolloutDriver`` over a fresh engine with these shapes, sampling and dtype.

    Training (one per stage and one for its evaluations) and the evaluation
    commands all build their engines here.

    Args:
      model: the policy (``Qwen2``); its graph and shapes, not its weights, are used.
      max_prompt_length / max_response_length: the engine's limits.
      sampling: the sampling strategy.
      max_concurrent_decodes / decode_steps: see ``EngineConfig``.
      dtype: ``EngineConfig.dtype`` (None: the model's).
      kv_dtype: ``EngineConfig.kv_dtype`` (None: the cache in ``dtype``).
      decode_attention: ``EngineConfig.decode_attention`` (None: the platform's).
      decode_layers: ``EngineConfig.decode_layers`` (None: by the step's weight).
      mesh: the device mesh (None: one device).
      lanes: decode lanes, each ``max_concurrent_decodes / lanes`` slots in its own
        thread (``RolloutDriver``); None: ``default_lanes``.
      compact_batch: ``EngineConfig.compact_batch``.
    """
    from magic_jax.rollout.engine import EngineConfig

    if lanes is None:
        lanes = default_lanes(max_concurrent_decodes, mesh, model.config.num_params())
    if lanes < 1 or max_concurrent_decodes % lanes:
        raise ValueError(
            f"lanes ({lanes}) must be >= 1 and divide max_concurrent_decodes "
            f"({max_concurrent_decodes})"
        )
    config = EngineConfig(
        max_concurrent_decodes=max_concurrent_decodes // lanes,
        max_prefill_length=max_prompt_length,
        max_decode_length=max_response_length,
        decode_steps=decode_steps,
        sampling=sampling,
        dtype=dtype,
        kv_dtype=kv_dtype,
        decode_attention=decode_attention,
        decode_layers=decode_layers,
        compact_batch=compact_batch,
    )
    return RolloutDriver(Engine(model, config, mesh=mesh), lanes=lanes)
