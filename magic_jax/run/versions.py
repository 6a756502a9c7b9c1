"""The policy versions an overlapped rollout samples under: the published versions and
the waits for them, a step's version schedule, and the lagged versions a checkpoint keeps
(``Checkpointed``). One process (``overlap``) and two (``remote``) share them."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, Unpack

import jax
import numpy as np

if TYPE_CHECKING:
    from magic_jax.model.qwen2 import Qwen2
    from magic_jax.rollout.driver import RolloutDriver
    from magic_jax.rollout.protocols import Params, RunOptions
    from magic_jax.rollout.samples import RolloutStats, Sample
    from magic_jax.update.entropy_control import EntropyControlState
    from magic_jax.update.state import TrainState

POLL_S = 0.2  # how often a wait that can end otherwise (a stop, a lost peer) looks


class Cancelled(Exception):
    """The pipeline was closed while the producer waited or decoded."""


def wait_for(
    cond: threading.Condition,
    ready: Callable[[], bool],
    *,
    cancel: threading.Event | None = None,
    what: str = "",
    check: Callable[[], None] | None = None,
) -> None:
    """Waits on ``cond`` (held by the caller) until ``ready()``: every wait for a version or
    a rollout, in one process and across two. ``check`` runs each ``POLL_S`` and raises
    to end the wait (a stop, a lost peer, a version no longer kept).

    Raises:
      Cancelled: ``cancel`` was set first (``what`` names the wait).
    """
    while not ready():
        if cancel is not None and cancel.is_set():
            raise Cancelled(what)
        if check is not None:
            check()
        cond.wait(POLL_S)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Checkpointed:
    """What an overlap checkpoint saves (one orbax tree): the train state's fields, top
    level as in a sync checkpoint (so ``checkpoint.load_model`` reads its ``params``),
    and the s versions before it (``lagged[i]`` is version ``max(0, step - s + i)``)."""

    params: Params
    opt_state: Any  # optax's state: a pytree optax does not type
    step: jax.Array
    skipped: jax.Array
    entropy: EntropyControlState
    lagged: tuple[Params, ...]

    @classmethod
    def of(cls, state: TrainState, lagged: tuple[Params, ...]) -> Checkpointed:
        return cls(
            **{f.name: getattr(state, f.name) for f in dataclasses.fields(state)}, lagged=lagged
        )

    def train_state(self) -> TrainState:
        from magic_jax.update.state import TrainState

        return TrainState(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TrainState)})


def copy_params(params: Params) -> Params:
    """A copy of ``params`` that no donating update can overwrite."""
    return jax.tree.map(lambda x: x.copy(), params)


class VersionSource(Protocol):
    """Where a rollout gets the policy versions it samples under: ``Versions`` in one
    process, ``remote.PulledVersions`` in the rollout process of two."""

    def get(self, version: int, cancel: threading.Event | None = None) -> Params:
        """Version ``version``'s weights (master layout), waiting until they are there.

        Raises:
          Cancelled: ``cancel`` was set first.
          KeyError: the version is no longer kept.
        """
        ...

    def wake(self) -> None:
        """Wakes the waiters (to see a cancel)."""
        ...


class Versions:
    """The published policy versions (master-layout copies), kept while a rollout still
    needs them: the newest and the ``keep`` before it."""

    def __init__(self, keep: int):
        self.keep = keep
        self._params: dict[int, Params] = {}
        self._cond = threading.Condition()

    def publish(self, version: int, params: Params) -> None:
        with self._cond:
            self._params[version] = params
            for v in [v for v in self._params if v < version - self.keep]:
                del self._params[v]
            self._cond.notify_all()

    def get(self, version: int, cancel: threading.Event | None = None) -> Params:
        """Version ``version``'s weights, waiting until it is published (or ``cancel``)."""

        def kept() -> None:
            if self._params and version < min(self._params):
                raise KeyError(f"policy version {version} is no longer kept")

        with self._cond:
            what = f"version {version} was not published"
            wait_for(
                self._cond, lambda: version in self._params, cancel=cancel, what=what, check=kept
            )
            return self._params[version]

    def lagged(self, step: int) -> tuple[Params, ...]:
        """The versions a checkpoint after ``step`` updates keeps (``Checkpointed``)."""
        return tuple(self.get(max(0, step - self.keep + i)) for i in range(self.keep))

    def wake(self) -> None:
        """Wakes the waiters (to see a cancel)."""
        with self._cond:
            self._cond.notify_all()


class StepVersionSchedule:
    """Step ``step``'s ``driver.VersionSchedule``: it starts under ``max(0, step - s)``
    and, with ``publish_chunks``, moves on one version per that many chunks, up to
    ``step`` (with ``reprefill``, the responses in flight prefilled again at each)."""

    def __init__(
        self,
        step: int,
        max_staleness: int,
        publish_chunks: int | None,
        engine_params: Callable[[int], Params],
        cancelled: threading.Event,
        reprefill: bool = False,
    ):
        self.start = max(0, step - max_staleness)
        self.step = step
        self.every = publish_chunks
        self.reprefill = reprefill
        self._engine_params = engine_params
        self._cancelled = cancelled

    def version_at(self, chunks: int) -> int:
        if self._cancelled.is_set():
            raise Cancelled(f"step {self.step}'s rollout")
        if self.every is None:
            return self.start
        return min(self.step, self.start + chunks // self.every)

    def params(self, version: int) -> Params:
        return self._engine_params(version)


class ScheduledDriver:
    """A driver whose ``run`` samples under ``schedule`` (what ``collect_groups`` calls)."""

    def __init__(self, driver: RolloutDriver, schedule: StepVersionSchedule):
        self.driver = driver
        self.schedule = schedule

    def load_params(self, model_or_params: Qwen2 | Params) -> Params:
        return self.driver.load_params(model_or_params)

    def run(
        self, params: Params, prompts: Sequence[np.ndarray], **options: Unpack[RunOptions]
    ) -> tuple[list[Sample], RolloutStats]:
        return self.driver.run(params, prompts, schedule=self.schedule, **options)
