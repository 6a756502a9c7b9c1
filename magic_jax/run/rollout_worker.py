"""The rollout process of a ``rollout.hosts`` job: it generates what the trainer's process
asks, stage by stage, with each version pulled from it (``remote``'s other side).

``serve`` listens at the coordinator's port, loads the run's policy, tokenizer and
prompts as the trainer does, then waits for the trainer's ``hello``: the two configs must
be equal, and the weights' layout gives what to pull. Each ``stage`` message starts the
stage's ``overlap.RolloutPipeline`` (the same producer as in one process: its schedule,
partial rollouts and re-prefill) with a ``remote.PulledVersions``; a sender thread hands
each finished step to the trainer in order. Finished groups are kept in the run
directory as they finish (``rollout.partial``), so a resumed job decodes only the others.
"""

from __future__ import annotations

import signal
import socket
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from magic_jax import interrupt, storage
from magic_jax.run.overlap import Cancelled, RolloutPipeline
from magic_jax.run.remote import (
    CONNECT_S,
    POLL_S,
    Channel,
    PulledVersions,
    Side,
    pull_specs,
    transfer_server,
    worker_meshes,
)

if TYPE_CHECKING:
    from magic_jax.rollout.protocols import Verifiers
    from magic_jax.run.config import TrainConfig
    from magic_jax.run.trainer import RunInputs


def serve(
    config: TrainConfig,
    side: Side,
    load_inputs: Callable[..., tuple[RunInputs, Any]],
    *,
    log: Callable[[str], None] = print,
) -> dict:
    """Generates for the trainer's process until it says stop; returns the summary this
    process's exit status is read from (``stopped_by``: the stop's signal).
    ``load_inputs``: ``trainer.load_inputs`` (the run's policy, tokenizer and prompts).

    Raises:
      ConfigError: the trainer runs another config, or its weights another layout.
      RuntimeError: no trainer came, it went away without a stop, or a rollout failed.
    """
    from magic_jax.rewards import VerifierPool
    from magic_jax.run import rundir

    listener = socket.create_server(("", side.port))
    log(f"[rollout] this process generates; the trainer's process connects to port {side.port}")
    inputs, params = load_inputs(config, log=log, meshes=worker_meshes(config.mesh))
    treedef = jax.tree.structure(params)
    del params  # each version comes from the trainer
    listener.settimeout(CONNECT_S)
    try:
        sock, _ = listener.accept()
    except TimeoutError:
        raise RuntimeError(f"[rollout] no trainer connected within {CONNECT_S:.0f} s") from None
    finally:
        listener.close()
    sock.settimeout(None)
    chan = Channel(sock, "rollout")
    got = chan.get(CONNECT_S)
    if got is not None and got[0] in ("stop", "error"):
        chan.close()  # the trainer's ended before it began: a finished run, or a failure
        if got[0] == "stop":
            log("[rollout] the run has finished: nothing to generate")
            return {}
        raise RuntimeError(f"[rollout] the trainer's process failed: {got[1]['text']}")
    if got is None or got[0] != "hello":
        chan.close()
        raise RuntimeError(f"[rollout] the trainer's process did not say hello (got {got})")
    hello = got[1]
    _check_hello(config, hello, treedef.num_leaves, inputs.mesh)
    conn = transfer_server(sock.getsockname()[0]).connect(hello["transfer"])
    specs = pull_specs(hello["leaves"], inputs.mesh)
    versions = PulledVersions(chan, conn, treedef, specs, log)
    with rundir.StopSignals(), VerifierPool(config.rewards) as pool:
        return _Worker(config, inputs, chan, versions, pool, log).run()


def _check_hello(config: TrainConfig, hello: dict, leaves: int, mesh: Any) -> None:
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
    """The rollout process's loop: the trainer's messages, one stage's pipeline at a time."""

    def __init__(
        self,
        config: TrainConfig,
        inputs: RunInputs,
        chan: Channel,
        versions: PulledVersions,
        pool: Verifiers,
        log: Callable[[str], None],
    ):
        self.config, self.inputs, self.chan, self.versions = config, inputs, chan, versions
        self.pool, self.log = pool, log
        self.pipeline: RolloutPipeline | None = None
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
                msg = self.chan.get(POLL_S)
                if msg is None:
                    continue
                kind, body = msg
                if kind == "stage" and not self.told:
                    self._stage(body)
                elif kind == "offer":
                    self.versions.offered(body)
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

    def _stage(self, body: dict[str, Any]) -> None:
        """Starts generating steps ``first`` to ``end - 1`` of stage ``index``."""
        from magic_jax.rollout.partial import StepStore
        from magic_jax.run.stages import build_stage, collect_step

        self._close()
        cfg, i, ro = self.config, self.inputs, self.config.rollout
        stage = build_stage(
            cfg,
            body["index"],
            i.rows,
            body["excluded"],
            policy=i.model,
            graphdef=i.graphdef,
            mesh=i.mesh,
            rollout_mesh=i.rollout_mesh,
        )
        first, k0, end, epoch = body["first"], body["k"], body["end"], body["epoch"]
        self.log(f"[rollout] {stage.describe()}: steps {first} to {end - 1}")
        out, limit = storage.path(cfg.output_dir), stage.config.max_response_length

        def one(j: int, driver: Any, params: Any) -> Any:
            interrupt.at(j)  # the step the test hooks name
            store = None if ro.publish_chunks else StepStore(out, j, limit=limit, log=self.log)
            tok = i.tokenizer
            return collect_step(
                cfg, stage, j, j - first + k0, driver, params, tok, self.pool, store
            )

        self.pipeline = RolloutPipeline(
            one,
            stage.driver,
            self.versions,
            first=first,
            end=end,
            max_staleness=ro.max_staleness,
            publish_chunks=ro.publish_chunks,
            reprefill=ro.publish_cache == "reprefill",
        )
        self.sender = threading.Thread(
            target=self._send, args=(self.pipeline, epoch, first, end), name="rollout-sender"
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
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        if self.sender is not None:
            self.sender.join()
            self.sender = None
