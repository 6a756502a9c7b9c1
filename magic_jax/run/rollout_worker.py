"""The rollout process of a ``rollout.hosts`` job: it generates what the trainer's process
asks, stage by stage, with each version pulled from it (``remote``'s other side).

``serve`` listens at the coordinator's address, loads the run's policy, tokenizer and
prompts as the trainer does, then waits until a connection proves it holds the run's key
(``channel.Listener``: strangers are refused and logged) and says ``hello``: the two
configs must be equal, and the weights' layout gives what to pull. Each ``stage``
message starts the stage's producer through ``OverlapRollouts.start`` (the same stage
change, producer and per-step store as in one process: its schedule, partial rollouts
and re-prefill) with a ``remote.PulledVersions``; a sender thread hands each finished
step to the trainer in order. Finished groups are kept in the run directory as they
finish (``rollout.partial``), so a resumed job decodes only the others, behind a fence
that follows the trainer's run lock (``remote.TrainerLease``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax

from magic_jax import interrupt, storage
from magic_jax.run import channel, fence, rundir
from magic_jax.run.overlap import OverlapRollouts
from magic_jax.run.remote import (
    CONNECT_S,
    Channel,
    PulledVersions,
    Side,
    TrainerLease,
    pull_specs,
    silence,
    transfer_server,
    worker_meshes,
)
from magic_jax.run.versions import POLL_S, Cancelled

if TYPE_CHECKING:
    from pathlib import Path

    from jax.sharding import Mesh

    from magic_jax.rollout.protocols import Params, Verifiers
    from magic_jax.run.config import TrainConfig
    from magic_jax.run.inputs import RunInputs
    from magic_jax.run.overlap import RolloutPipeline


def serve(
    config: TrainConfig,
    side: Side,
    load_inputs: Callable[..., tuple[RunInputs, Params]],
    *,
    log: Callable[[str], None] = print,
) -> dict:
    """Generates for the trainer's process until it says stop; returns the summary this
    process's exit status is read from (``stopped_by``: the stop's signal, also one that
    came while this process waited for the trainer's).
    ``load_inputs``: ``inputs.load_inputs`` (the run's policy, tokenizer and prompts).

    Raises:
      ConfigError: the trainer runs another config, or its weights another layout.
      RunDirError: the run directory is not this project's (the trainer refuses it too).
      RuntimeError: no trainer came, it went away without a stop, or a rollout failed.
    """
    with rundir.StopSignals():
        return _serve(config, side, load_inputs, log)


def _stopped() -> dict:
    return {"stopped_by": signal.Signals(interrupt.requested()).name}


def _serve(
    config: TrainConfig, side: Side, load_inputs: Callable, log: Callable[[str], None]
) -> dict:
    from magic_jax.rewards import VerifierPool

    out = storage.path(config.output_dir)
    listener = channel.Listener(side.host, side.port, lambda: channel.read_key(out), log)
    log(f"[rollout] this process generates; the trainer's process connects to {listener.where}")
    try:
        inputs, params = load_inputs(config, log=log, meshes=worker_meshes(config.mesh))
        treedef = jax.tree.structure(params)
        num_leaves = len(jax.tree.leaves(params))
        del params  # each version comes from the trainer
        log("[rollout] waiting for the trainer's process")
        refused = _RefusedDir(out)
        try:
            chan = listener.accept(
                CONNECT_S, lambda: bool(interrupt.requested()) or refused.check()
            )
        except TimeoutError as e:
            raise RuntimeError(f"[rollout] {e}") from None
    finally:
        listener.close()
    if chan is None:  # a stop while it waited
        return _stopped()
    asked_at = time.monotonic()
    got = _first(chan)
    if got is None:
        return _stopped()
    if got[0] in ("stop", "error"):
        chan.close()  # the trainer's ended before it began: a finished run, a stop, a failure
        if got[0] == "error":
            raise RuntimeError(f"[rollout] the trainer's process failed: {got[1]['text']}")
        if got[1]["signum"]:
            interrupt.request(got[1]["signum"])
            return _stopped()
        log("[rollout] the run has finished: nothing to generate")
        return {}
    if got[0] != "hello":
        chan.close()
        raise RuntimeError(f"[rollout] the trainer's process did not say hello (got {got[0]})")
    hello = got[1]
    _check_hello(config, hello, num_leaves, inputs.mesh)
    conn = transfer_server(chan.sock.getsockname()[0]).connect(hello["transfer"])
    specs = pull_specs(hello["leaves"], inputs.mesh)
    versions = PulledVersions(chan, conn, treedef, specs, log)
    lease = TrainerLease(chan, asked_at, hello["lease"], out)
    fence.hold(lease)  # this process writes into the run directory only while the trainer may
    try:
        with VerifierPool(config.rewards) as pool:
            return _Worker(config, inputs, chan, versions, lease, pool, log).run()
    finally:
        fence.release(lease)


def _first(chan: Channel) -> channel.Message | None:
    """The trainer's first message (``hello``, or ``stop`` / ``error`` when it ended
    before), or None on a stop of this process while it waited."""
    deadline = time.monotonic() + CONNECT_S
    while not interrupt.requested():
        got = chan.get(POLL_S)
        if got is not None:
            return got
        if time.monotonic() > deadline:
            chan.close()
            raise RuntimeError(
                f"[rollout] the trainer's process said no hello within {CONNECT_S:.0f} s"
            )
    chan.try_send("stopped", signum=interrupt.requested())  # it stops too
    chan.close()
    return None


class _RefusedDir:
    """Whether the run directory is one the trainer refuses (not empty, not this
    project's): it then fails before it has a key to say so with, so this process sees it
    for itself, looking every few seconds, twice in a row (a claim in progress is not a
    refusal)."""

    def __init__(self, out: Path):
        self.out = out
        self.seen = 0
        self.next = 0.0

    def check(self) -> bool:
        if time.monotonic() < self.next:
            return False
        self.next = time.monotonic() + 1.0
        try:
            if not self.out.exists() or (self.out / rundir.MARKER).exists():
                self.seen = 0
                return False
            gcs = storage.is_gcs(self.out)
            entries = sorted(storage.listing(self.out) if gcs else os.listdir(self.out))
        except (OSError, ValueError):
            return False
        self.seen = self.seen + 1 if entries else 0
        if self.seen >= 2:
            raise rundir.RunDirError(
                f"output_dir {self.out}: not empty ({', '.join(entries[:3])}) and not a "
                f"magic-jax run directory (no {rundir.MARKER}); the trainer's process refuses it"
            )
        return False


def _check_hello(config: TrainConfig, hello: dict, leaves: int, mesh: Mesh | None) -> None:
    from magic_jax.run.config import ConfigError
    from magic_jax.run.config_dict import to_dict

    mine = to_dict(config)
    if hello["config"] != mine:
        keys = sorted(
            k for k in set(mine) | set(hello["config"]) if mine.get(k) != hello["config"].get(k)
        )
        raise ConfigError(
            f"rollout.hosts: the trainer's process runs another config (differs in {keys}); "
            "every process runs the same command"
        )
    want = None if mesh is None else dict(mesh.shape)
    if len(hello["leaves"]) != leaves or hello["mesh"] != want:
        raise ConfigError(
            f"rollout.hosts: the trainer's weights ({len(hello['leaves'])} arrays on mesh "
            f"{hello['mesh']}) do not match this process's ({leaves} on {want}): each side "
            "needs as many devices"
        )


class _Worker:
    """The rollout process's loop: the trainer's messages, one stage's pipeline at a time
    (``OverlapRollouts.start``, as in one process, with the versions pulled across)."""

    def __init__(
        self,
        config: TrainConfig,
        inputs: RunInputs,
        chan: Channel,
        versions: PulledVersions,
        lease: TrainerLease,
        pool: Verifiers,
        log: Callable[[str], None],
    ):
        self.config = config
        self.inputs = inputs
        self.chan = chan
        self.versions = versions
        self.lease = lease
        from magic_jax.run.stages import StepSampler

        self.log = log
        out = storage.path(config.output_dir)
        # the step it generates is this process's step (its test hooks name it)
        self.sampler = StepSampler(config, inputs.tokenizer, pool, out, log, names_step=True)
        overlap = OverlapRollouts.of(config.rollout, log=log, source=versions)
        assert overlap is not None, "rollout.hosts needs rollout.mode: overlap"
        self.overlap = overlap
        self.sender: threading.Thread | None = None
        self.failed: BaseException | None = None
        self.told = False  # the trainer was told of this process's own stop

    def run(self) -> dict:
        stop = None
        try:
            while stop is None:
                if interrupt.requested() and not self.told:
                    self.told = True
                    self._close()
                    self.chan.try_send("stopped", signum=interrupt.requested())
                self.lease.ask()
                msg = self.chan.get(POLL_S)
                if msg is None:
                    silence(self.chan, "the trainer's process", "its next message")
                    continue
                kind, body = msg
                if kind == "stage" and not self.told:
                    self._stage(body)
                elif kind == "offer":
                    self.versions.offered(body)
                elif kind == "lease":
                    self.lease.answered(body)
                elif kind == "stop":
                    stop = body["signum"]
                elif kind == "error":
                    raise RuntimeError(f"[rollout] the trainer's process failed: {body['text']}")
                elif kind == "closed":
                    stop = -1
        finally:
            self._close()
            self.chan.close()
        if self.failed is not None:
            raise RuntimeError("[rollout] a rollout failed (the trainer was told)") from self.failed
        if stop == -1:
            raise RuntimeError(
                "[rollout] the trainer's process closed the connection without a stop (it "
                "ended or was killed); finished groups are kept in the run directory"
            )
        sig = stop or interrupt.requested()
        return {"stopped_by": signal.Signals(sig).name} if sig else {}

    def _stage(self, body: channel.Body) -> None:
        """Starts generating steps ``first`` to ``end - 1`` of stage ``index``."""
        from magic_jax.run.stages import build_stage

        self._close()
        stage = build_stage(self.config, body["index"], self.inputs, body["excluded"])
        first, end, epoch = body["first"], body["end"], body["epoch"]
        self.log(f"[rollout] {stage.describe()}: steps {first} to {end - 1}")
        self.overlap.start(stage, first, body["k"], end, self.sampler)
        self.sender = threading.Thread(
            target=self._send,
            args=(self.overlap.pipeline, epoch, first, end),
            name="rollout-sender",
        )
        self.sender.start()

    def _send(self, pipeline: RolloutPipeline, epoch: int, first: int, end: int) -> None:
        """Hands each step's rollout to the trainer, in order."""
        for j in range(first, end):
            try:
                out, _ = pipeline.take(j)
            except (Cancelled, interrupt.Interrupted):
                return  # a stop: ``run`` says it
            except BaseException as e:
                self.failed = e
                self.chan.try_send("error", text="".join(traceback.format_exception(e)))
                return
            self.chan.try_send(
                "rollout",
                epoch=epoch,
                step=j,
                got=out.got,
                seconds=out.seconds,
                start_wait_s=out.start_wait_s,
                pulled=self.versions.drain(),
            )

    def _close(self) -> None:
        self.overlap.close()
        if self.sender is not None:
            self.sender.join()
            self.sender = None
