"""Rollout and update overlapped (``rollout.mode: overlap``), on a counted schedule.

Version v of the policy is the weights after v updates. With ``max_staleness`` s,
step k's rollout starts under version ``max(0, k - s)``; a second thread (the
producer) generates the rollouts in step order while the main thread updates,
so step k's rollout runs during the updates of steps ``k - s`` to ``k - 1``. The
update of step k always starts from version k: a token sampled by version v is
``k - v`` versions stale, at most s. Admission, not discarding, bounds it: a
rollout waits for its start version to be published and nothing generated is
thrown away (AReaL's rule, counted in steps).

With ``publish_chunks`` n (partial rollouts), every n decode chunks of a lane the
responses in flight move to the next version, up to version k, keeping their KV
cache (PipelineRL's choice) or, with ``publish_cache: reprefill``, prefilling it again
under the new version (AReaL's); each token records its version
(``Sample.versions``). Which version samples which token is a function of the
step and the lane's chunk count, never of thread timing, so a seed gives the
same run twice, and s = 0 is sync's computation in the overlap code.

Nothing is lost at a stop: a checkpoint after step c holds, beside the state
(version c), the s versions ``c - s .. c - 1`` that the rollouts of steps
``c .. c + s - 1`` start from (``Checkpointed``), so a resumed run regenerates
exactly what the stopped one had in flight. As in sync mode, the groups those
rollouts finished are on disk (``rollout.partial``; the trainer keeps every step's
from the newest checkpoint's on) and are not decoded again. With ``publish_chunks``
a rollout is redone whole: its tokens' versions follow its lanes' chunk counts,
which a rollout of fewer groups would not repeat.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from magic_jax.rollout.collect import Collected
from magic_jax.run.step_rollouts import RolloutSource, StepAt, StepRollout
from magic_jax.run.versions import (
    Checkpointed,
    ScheduledDriver,
    StepVersionSchedule,
    Versions,
    VersionSource,
    copy_params,
    wait_for,
)
from magic_jax.update.losses import STALENESS_BUCKETS

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from magic_jax.model.sharding import MeshConfig
    from magic_jax.rollout.driver import RolloutDriver
    from magic_jax.rollout.protocols import Driver, Params
    from magic_jax.rollout.scoring import Group
    from magic_jax.run.config import RolloutConfig
    from magic_jax.run.rundir import JSON
    from magic_jax.run.stages import Stage, StepSampler
    from magic_jax.update.buffer import RolloutBuffer
    from magic_jax.update.state import TrainState
    from magic_jax.update.updater import Metrics


@dataclasses.dataclass
class Produced:
    """One step's rollout from the producer: what ``collect_groups`` gave (or raised)
    and when."""

    step: int
    got: Collected | None = None
    error: BaseException | None = None
    seconds: float = 0.0  # generating and scoring
    start_wait_s: float = 0.0  # waiting for its start version before it began


class RolloutPipeline:
    """The producer thread of one stage: the rollouts of steps ``first`` to ``end - 1``
    in order, each started once its version is published.

    Args:
      rollout: (step, driver) -> ``Collected``: one step's ``collect_groups`` with
        the given driver (a ``ScheduledDriver``) and its start version's weights.
      driver: the stage's rollout driver.
      versions: the policy versions (in one process, the main thread publishes one after
        each update).
      first / end: the steps to generate.
      max_staleness / publish_chunks: ``rollout`` options.
      reprefill: ``rollout.publish_cache`` is ``reprefill``.
    """

    def __init__(
        self,
        rollout: Callable[[int, Driver, Params], Collected],
        driver: RolloutDriver,
        versions: VersionSource,
        *,
        first: int,
        end: int,
        max_staleness: int,
        publish_chunks: int | None,
        reprefill: bool = False,
    ):
        self.rollout = rollout
        self.driver = driver
        self.versions = versions
        self.first = first
        self.end = end
        self.max_staleness = max_staleness
        self.every = publish_chunks
        self.reprefill = reprefill
        self._done: dict[int, Produced] = {}
        self._cond = threading.Condition()
        self._cancel = threading.Event()
        self._engine: dict[int, Params] = {}  # version -> engine-layout weights
        self._thread = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)
        self._thread.start()

    def engine_params(self, version: int) -> Params:
        """Version ``version`` in the engine's layout (made once, from the producer)."""
        if version not in self._engine:
            self._engine = {
                v: p for v, p in self._engine.items() if v >= version - self.max_staleness
            }
            master = self.versions.get(version, self._cancel)
            self._engine[version] = self.driver.load_params(master)
        return self._engine[version]

    def _produce(self) -> None:
        for step in range(self.first, self.end):
            out = Produced(step)
            try:
                sched = StepVersionSchedule(
                    step,
                    self.max_staleness,
                    self.every,
                    self.engine_params,
                    self._cancel,
                    self.reprefill,
                )
                t0 = time.perf_counter()
                params = self.engine_params(sched.start)
                t1 = time.perf_counter()
                out.got = self.rollout(step, ScheduledDriver(self.driver, sched), params)
                out.seconds, out.start_wait_s = time.perf_counter() - t1, t1 - t0
            except BaseException as e:  # handed to the main thread by ``take``
                out.error = e
            with self._cond:
                self._done[step] = out
                self._cond.notify_all()
            if out.error is not None:
                return

    def take(self, step: int) -> tuple[Produced, float]:
        """Step ``step``'s rollout and the seconds the caller waited for it; raises what
        the rollout raised."""
        if not self.first <= step < self.end:
            raise ValueError(f"step {step} is outside this pipeline's [{self.first}, {self.end})")
        t0 = time.perf_counter()
        with self._cond:
            wait_for(self._cond, lambda: step in self._done)
            out = self._done.pop(step)
        if out.error is not None:
            raise out.error
        return out, time.perf_counter() - t0

    def close(self) -> list[int]:
        """Stops the producer (a rollout in flight stops at its next chunk); returns the
        steps generated but not taken (discarded)."""
        self._cancel.set()
        self.versions.wake()
        self._thread.join()
        with self._cond:
            return sorted(s for s, p in self._done.items() if p.got is not None)


def staleness_metrics(groups: Sequence[Group], step: int) -> JSON:
    """The step's tokens by staleness (``step`` minus the version that sampled each),
    their mean entropy per staleness, and tokens per version."""
    by_s: dict[int, list[float]] = {}
    by_v: dict[int, int] = {}
    for g in groups:
        for smp in g.samples:
            if smp.versions is None or not smp.length:
                continue
            v = np.asarray(smp.versions)
            for ver in np.unique(v):
                on = v == ver
                acc = by_s.setdefault(step - int(ver), [0.0, 0.0])
                acc[0] += int(on.sum())
                acc[1] += float(np.asarray(smp.entropies, np.float64)[on].sum())
                by_v[int(ver)] = by_v.get(int(ver), 0) + int(on.sum())
    return {
        "staleness_tokens": {str(s): int(n) for s, (n, _) in sorted(by_s.items())},
        "entropy_by_staleness": {str(s): e / n for s, (n, e) in sorted(by_s.items()) if n},
        "tokens_per_version": {str(v): n for v, n in sorted(by_v.items())},
        "staleness_mean": sum(s * n for s, (n, _) in by_s.items())
        / max(sum(n for n, _ in by_s.values()), 1),
    }


def overlap_metrics(
    got: Collected, step: int, wait_s: float, start_wait_s: float, seconds: float
) -> JSON:
    """Step ``step``'s overlap metrics: ``staleness_metrics`` and the waits (the trainer's
    for the rollout, the rollout's for its versions) and the rollout's own time."""
    out = staleness_metrics(got.groups, step)
    version_wait = start_wait_s + sum(st.version_wait_s for st in got.stats)
    out.update(t_wait_rollout_s=wait_s, t_wait_version_s=version_wait, t_produce_s=seconds)
    return out


class OverlapRollouts(RolloutSource):
    """Overlap mode's ``step_rollouts.RolloutSource``: the published versions, one
    producer per stage, the checkpoint item and each step's overlap metrics.

    Example (the trainer's step, in outline):
      ov = OverlapRollouts.of(cfg.rollout)
      state = ov.resume(ckpts.restore(ov.checkpoint_template(state), path), step)
      r = ov.rollout(StepAt(stage, step, k, end, resumed=False), state, sampler)
      state = update(state, with_staleness(pack(r.got), r.got.groups, step))
      ov.updated(step + 1, state.params)
      ckpts.save(step + 1, ov.checkpoint_item(state, step + 1), ...)
    """

    keeps_ahead = True  # the producer generates the steps ahead of the update

    def __init__(
        self,
        max_staleness: int,
        publish_chunks: int | None,
        *,
        reprefill: bool = False,
        log: Callable[[str], None] = print,
        source: VersionSource | None = None,
    ):
        self.max_staleness = max_staleness
        self.every = publish_chunks
        self.log = log
        self.reprefill = reprefill
        # the versions this process publishes; the producer samples under ``source``, these
        # unless given (the rollout process of two pulls them from the trainer's)
        self.versions = Versions(keep=max_staleness)
        self.source: VersionSource = self.versions if source is None else source
        self.pipeline: RolloutPipeline | None = None
        self._stage: Stage | None = None

    @classmethod
    def of(
        cls,
        rollout: RolloutConfig,
        tis_cap: float | None = None,
        *,
        behaviour_clip: bool = False,
        log: Callable[[str], None] = print,
        **kw: Any,
    ) -> OverlapRollouts | None:
        """The overlap of a run's ``rollout`` options; None in sync mode. With ``tis_cap``
        (decoupled PPO), a staleness and no ``behaviour_clip``, logs what the staleness
        ablation measured."""
        if rollout.mode != "overlap":
            return None
        if tis_cap is not None and rollout.max_staleness > 0 and not behaviour_clip:
            log(
                f"[overlap] decoupled PPO (loss.tis_cap {tis_cap}) at staleness "
                f"{rollout.max_staleness} without loss.behaviour_clip: at one optimizer step "
                "per batch it has no trust region against the sampler; what that cost in the "
                "carry world: notebooks/README.md, section 13"
            )
        reprefill = rollout.publish_cache == "reprefill"
        return cls(
            rollout.max_staleness, rollout.publish_chunks, reprefill=reprefill, log=log, **kw
        )

    def checkpoint_template(self, state: TrainState) -> TrainState | Checkpointed:
        """What a checkpoint of this run holds, shaped like ``state`` (to restore into)."""
        return (
            state
            if self.max_staleness == 0
            else Checkpointed.of(state, (state.params,) * self.max_staleness)
        )

    def resume(self, restored: TrainState | Checkpointed, step: int) -> TrainState:
        """Publishes the versions a run resumed (or started) at ``step`` needs; returns
        the train state of ``restored`` (``checkpoint_template``'s shape)."""
        lagged: tuple[Params, ...] = ()
        if isinstance(restored, Checkpointed):  # max_staleness > 0
            state, lagged = restored.train_state(), restored.lagged
        else:
            state = restored
        for i, params in enumerate(lagged):
            v = max(0, step - self.max_staleness + i)
            if v < step:
                self.versions.publish(v, copy_params(params))
        self.versions.publish(step, copy_params(state.params))
        return state

    def checkpoint_item(self, state: TrainState, step: int) -> TrainState | Checkpointed:
        """What the checkpoint after ``step`` updates saves."""
        return (
            state if self.max_staleness == 0 else Checkpointed.of(state, self.versions.lagged(step))
        )

    def updated(self, version: int, params: Params) -> None:
        """The main thread's update made ``version``: the producer may use it."""
        self.versions.publish(version, copy_params(params))

    def annotate(self, buffer: RolloutBuffer, groups: Sequence[Group], step: int) -> RolloutBuffer:
        """Each token's staleness: the loss counts clipping per staleness."""
        return with_staleness(buffer, groups, step)

    def rollout(self, at: StepAt, state: TrainState, sampler: StepSampler) -> StepRollout:
        """Step ``at.step``'s groups, generated during the last updates, and its overlap
        metrics. Groups are kept as they finish unless ``publish_chunks`` is set (a
        partial rollout is redone whole: its tokens' versions follow its chunk counts)."""
        stage, step, k = at.stage, at.step, at.k
        if self._stage is not stage:
            self.start(stage, step, k, min(step - k + stage.config.steps, at.end), sampler)
        got, metrics = self._take(step)
        # t_rollout_s is the wait for the producer
        return StepRollout(got, metrics, 0.0, False)

    def start(
        self,
        stage: Stage,
        step: int,
        k: int,
        end: int,
        sampler: StepSampler,
    ) -> None:
        """The stage change, at the stage's first step taken (stage step ``k``): the old
        stage's rollouts not taken are dropped, and steps ``step`` to ``end - 1`` are
        generated from now on. The same in one process and across two: the rollout
        process calls it with the steps the trainer's ``_begin`` names."""
        dropped = self._end_stage()
        if dropped:  # a stage that ended on an ``until`` rule: sampled for the old one
            self.log(f"[overlap] the stage changed: rollouts of steps {dropped} discarded")
        self._stage = stage
        self._begin(stage, step, k, end, sampler)

    def _begin(
        self,
        stage: Stage,
        step: int,
        k: int,
        end: int,
        sampler: StepSampler,
    ) -> None:
        """Starts this stage's producer."""

        def one(j: int, driver: Driver, params: Params) -> Collected:
            saved = sampler.store(j, stage) if self.every is None else None
            return sampler.collect(stage, j, j - step + k, driver, params, saved)

        self.pipeline = RolloutPipeline(
            one,
            stage.driver,
            self.source,
            first=step,
            end=end,
            max_staleness=self.max_staleness,
            publish_chunks=self.every,
            reprefill=self.reprefill,
        )

    def _take(self, step: int) -> tuple[Collected, JSON]:
        """Step ``step``'s rollout from this stage's producer, and its overlap metrics."""
        assert self.pipeline is not None, "the stage's producer runs (``start``)"
        out, wait = self.pipeline.take(step)
        assert out.got is not None, "take raises what the rollout raised"
        return out.got, self._metrics(out.got, step, wait, out.start_wait_s, out.seconds)

    def _metrics(
        self, got: Collected, step: int, wait: float, start_wait_s: float, seconds: float
    ) -> JSON:
        extra = overlap_metrics(got, step, wait, start_wait_s, seconds)
        if self.reprefill:
            extra["reprefills"] = sum(st.reprefills for st in got.stats)
        return extra

    def _end_stage(self) -> list[int]:
        """Stops this stage's producer; returns the steps it generated that were not taken."""
        pipeline, self.pipeline = self.pipeline, None
        return [] if pipeline is None else pipeline.close()

    def close(self) -> list[int]:
        """Stops the producer; returns the steps it generated that were not taken."""
        self._stage = None
        return self._end_stage()


def split_meshes(
    mesh: MeshConfig | None,
    rollout_devices: int | None,
    *,
    overlap: bool = False,
    log: Callable[[str], None] = print,
) -> tuple[Mesh | None, Mesh | None]:
    """(the update's mesh, the rollout's mesh or None) for ``mesh`` (a ``MeshConfig`` or
    None) and ``rollout.devices``: the first ``rollout_devices`` devices generate (fsdp
    over them, ``mesh.tensor`` kept), the rest update with ``mesh``'s axes. ``overlap``:
    the run is in overlap mode (one process only, for now).

    Raises:
      ConfigError: the split leaves one side without devices or does not fit the axes.
    """
    from magic_jax.model.sharding import make_mesh
    from magic_jax.run.config import ConfigError

    if jax.process_count() > 1 and (rollout_devices is not None or overlap):
        raise ConfigError(
            "rollout.mode: overlap runs its two threads in one process (their collectives "
            "would have to run in the same order on every host); across hosts, "
            "rollout.hosts gives each side its own process"
        )
    if mesh is None:
        return None, None
    if rollout_devices is None:
        return make_mesh(mesh), None
    devices = jax.devices()
    if not 0 < rollout_devices < len(devices):
        raise ConfigError(
            f"rollout.devices: {rollout_devices} of {len(devices)} devices leaves a side with none"
        )
    try:
        rollout = make_mesh(dataclasses.replace(mesh, data=1, fsdp=-1), devices[:rollout_devices])
        update = make_mesh(mesh, devices[rollout_devices:])
    except ValueError as e:
        raise ConfigError(f"rollout.devices: {e}") from None
    log(f"[overlap] {rollout_devices} device(s) generate, {len(devices) - rollout_devices} update")
    return update, rollout


def with_staleness(buffer: RolloutBuffer, groups: Sequence[Group], step: int) -> RolloutBuffer:
    """``buffer`` (packed from ``groups``: group i's sample j in row i * G + j) with its
    ``staleness``: ``step`` minus the version of each response token (0 on padding)."""
    g, r_len = buffer.group_size, buffer.response_len
    stale = np.zeros((buffer.num_rows, r_len), np.int32)
    for i, grp in enumerate(groups):
        for smp in grp.samples:
            if smp.versions is not None:
                row, n = i * g + smp.sample_index, min(len(smp.versions), r_len)
                stale[row, :n] = step - np.asarray(smp.versions[:n], np.int32)
    return dataclasses.replace(buffer, staleness=stale)


def clip_by_staleness(metrics: Metrics) -> dict[str, dict[str, float]]:
    """The update's clip fraction per token staleness (``losses.STALENESS_BUCKETS``; the
    last bucket counts that many or more), over its optimizer steps, and with
    ``loss.tis_cap`` the mean behaviour weight and the share of tokens past the cap per
    staleness; {} without them."""
    if "stale_tokens" not in metrics or not np.size(metrics["stale_tokens"]):
        return {}

    def summed(key):
        return np.asarray(metrics[key], np.float64).reshape(-1, STALENESS_BUCKETS).sum(0)

    t = summed("stale_tokens")
    out = {}
    names = {
        "stale_clipped": "clipfrac_by_staleness",
        "stale_weight": "behaviour_weight_by_staleness",
        "stale_capped": "capped_by_staleness",
    }
    for key, name in names.items():
        if key in metrics:
            c = summed(key)
            out[name] = {str(s): float(c[s] / t[s]) for s in np.flatnonzero(t)}
    return out
