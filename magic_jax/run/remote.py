"""Overlap across hosts (``rollout.hosts``): the rollout on one process's devices, the update
on another's, each its own JAX runtime, the weights pulled across at each version.

Every process of the job runs the same ``magic-jax train`` command with the
``MAGIC_JAX_COORDINATOR`` / ``_NUM_PROCESSES`` / ``_PROCESS_ID`` variables. Process 0
generates (``serve``); the other updates (the trainer, with ``RemoteRollouts`` as its
source of rollouts). Neither starts ``jax.distributed`` across both: no program spans
the two sides, so no launch order of either side's programs can wait on the other's.
What crosses is

  control   one TCP connection (the rollout process listens at the coordinator's
            address), authenticated by the run's key (``channel``: a challenge-response,
            then a MAC on every message; a stranger is refused before anything it sent is
            parsed): the trainer's ``hello`` (the config, its transfer address, the
            weights' layout, its run lock's lease), ``stage`` (which steps to generate),
            ``offer`` (a version ready to pull), ``lease`` and ``stop``; the rollout's
            ``want`` (a version), ``rollout`` (a step's groups), ``lease?`` and
            ``stopped`` / ``error``; a beat each way, so a wait ends on a silent peer;
  weights   ``jax.experimental.transfer``: the trainer offers a version's copy
            (``TransferServer.await_pull``) when the rollout asks for it, under an id
            both sides derive from the session (never sent; the server serves it once);
            the rollout pulls it in the trainer's layout onto its own devices, and its
            driver lays it out for the engine (``load_params``), as in a split within one
            process. Measured on CPU it is 3.2x faster than sending host bytes
            (``benchmarks/weight_publish.py``) and a dead peer fails a pull at once;
  groups    the run directory: the rollout keeps each finished group there
            (``rollout.partial``) as in one process, so a resume decodes only the rest.

The schedule is ``overlap``'s, unchanged: the rollout process runs the same
``RolloutPipeline`` with a ``PulledVersions`` in place of the in-process versions, so
step k still starts under version ``max(0, k - s)`` and, with ``publish_chunks``, moves
on by its chunk counts. A stop on either side stops both: a signal to the rollout
process is sent on as ``stopped`` (the trainer stops at its next step's rollout with a
checkpoint, as if signalled itself); the trainer's stop ends the rollout's current step
at its next decode chunk; a stop while either waits for the other ends it at once. A side
that dies closes the connection and the other ends in one line. The rollout process
writes into the run directory only while the trainer's process holds its lock
(``TrainerLease``). The trainer's checkpoint keeps the lagged versions, so the same command resumes
both. One process per side for now.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax

from magic_jax import interrupt
from magic_jax.run.channel import BEAT_S, SILENT_S, Channel
from magic_jax.run.overlap import OverlapRollouts
from magic_jax.run.versions import Cancelled, wait_for

if TYPE_CHECKING:
    from pathlib import Path

    from jax.experimental.transfer import TransferConnection, TransferServer
    from jax.sharding import Mesh, PartitionSpec
    from jax.tree_util import PyTreeDef

    from magic_jax.model.sharding import MeshConfig
    from magic_jax.rollout.collect import Collected
    from magic_jax.rollout.protocols import Params
    from magic_jax.run.channel import Body, Message
    from magic_jax.run.config import TrainConfig
    from magic_jax.run.rundir import JSON
    from magic_jax.run.stages import Stage, StepSampler
    from magic_jax.run.versions import Checkpointed, VersionSource
    from magic_jax.update.state import TrainState

# one array of the policy as it lies: (shape, dtype, PartitionSpec or None on one device)
Leaf = tuple[tuple[int, ...], str, "PartitionSpec | None"]

CONNECT_S = 600.0  # how long either side waits for the other to appear


@dataclasses.dataclass(frozen=True)
class Side:
    """This process's place in a ``rollout.hosts`` job: ``generates`` (process 0) or not,
    and the control address (the coordinator's: the rollout process listens there)."""

    generates: bool
    host: str
    port: int


def side_of(config: TrainConfig) -> Side:
    """This process's side, from the ``MAGIC_JAX_*`` variables.

    Raises:
      ConfigError: the variables are missing, or the job is not one process per side.
    """
    from magic_jax.model.sharding import explicit_distributed_args
    from magic_jax.run.config import ConfigError

    args = explicit_distributed_args()
    hosts = config.rollout.hosts
    if args is None:
        raise ConfigError(
            "rollout.hosts: set MAGIC_JAX_COORDINATOR (host:port, where process 0 listens), "
            "MAGIC_JAX_NUM_PROCESSES and MAGIC_JAX_PROCESS_ID on every process"
        )
    if hosts != 1 or args["num_processes"] != 2:
        raise ConfigError(
            f"rollout.hosts: {hosts} with MAGIC_JAX_NUM_PROCESSES {args['num_processes']}: "
            "one generating and one updating process only, for now (rollout.hosts: 1, 2 "
            "processes)"
        )
    host, _, port = args["coordinator_address"].rpartition(":")
    return Side(args["process_id"] < hosts, host, int(port))


def farewell(side: Side, key: bytes | None, error: BaseException | None, signum: int = 0) -> None:
    """Tells a rollout process this trainer never said hello to that the job ends: ``stop``
    (the run had finished, or ``signum`` stopped this process while it waited) or ``error``
    (the trainer failed first), over an authenticated channel. Best effort, a few seconds;
    nothing without the run's key (the trainer failed before writing it)."""
    from magic_jax.run import channel

    if key is None:
        return
    try:  # a stop must end this process in seconds; else the other may still be starting
        chan = channel.dial(
            side.host,
            side.port,
            key,
            deadline_s=3 if signum else 10,
            stopped=lambda: False,
            log=lambda _: None,
        )
    except (OSError, TimeoutError):
        return
    if chan is None:
        return
    if error is None:
        chan.try_send("stop", signum=signum)
    else:
        chan.try_send("error", text=_said(error))
    time.sleep(0.1)  # let the frame leave before the close
    chan.close()


def _said(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def silence(chan: Channel, who: str, what: str) -> None:
    """Raises when ``chan``'s peer (``who``) has said nothing for ``channel.SILENT_S``:
    the deadline of every wait between the processes, naming what it waited for."""
    if chan.silent_s() > SILENT_S:
        raise RuntimeError(
            f"[overlap] no word from {who} for {SILENT_S:.0f} s while waiting for {what}"
        )


def transfer_server(local_ip: str) -> TransferServer:
    from jax.experimental import transfer

    return transfer.start_transfer_server(
        jax.local_devices()[0].client, f"{local_ip}:0", [f"{local_ip}:0"]
    )


def layout(params: Params) -> tuple[list[Leaf], dict[str, int] | None]:
    """Each leaf's (shape, dtype, PartitionSpec or None on one device) and the mesh's axis
    sizes: what the rollout side needs to pull the trainer's arrays as they lie."""
    from jax.sharding import NamedSharding

    leaves: list[Leaf] = []
    mesh = None
    for x in jax.tree.leaves(params):
        named = isinstance(x.sharding, NamedSharding)
        if named:
            mesh = dict(x.sharding.mesh.shape)
        leaves.append((tuple(x.shape), str(x.dtype), x.sharding.spec if named else None))
    return leaves, mesh


class RemoteRollouts(OverlapRollouts):
    """The trainer's ``RolloutSource`` when another process generates: ``OverlapRollouts``'
    versions, checkpoint item and stage change, its rollouts received from the rollout
    process. ``key``: the run's key (``channel.write_key``)."""

    def __init__(
        self,
        max_staleness: int,
        publish_chunks: int | None,
        *,
        side: Side,
        config: JSON,
        key: bytes | None = None,
        reprefill: bool = False,
        log: Callable[[str], None] = print,
        source: VersionSource | None = None,
    ):
        super().__init__(max_staleness, publish_chunks, reprefill=reprefill, log=log, source=source)
        self.side = side
        self.config = config
        self.key = key
        self.chan: Channel | None = None
        self._results: dict[tuple[int, int], Body] = {}
        self._cond = threading.Condition()
        self._epoch = 0
        self._peer: Message | None = None  # how the rollout side ended
        self._wanted: queue.Queue[int | None] = queue.Queue()
        self._cancel = threading.Event()
        self._threads: list[threading.Thread] = []
        self.connected = False  # the hello was sent

    def resume(self, restored: TrainState | Checkpointed, step: int) -> TrainState:
        state = super().resume(restored, step)
        self._connect(state.params)
        return state

    def _connect(self, params: Params) -> None:
        """Connects to the rollout process and says hello.

        Raises:
          interrupt.Interrupted: a stop came while it waited for the rollout process.
        """
        from magic_jax.run import channel, runlock

        host, port = self.side.host, self.side.port
        chan = channel.dial(
            host,
            port,
            self.key or b"",
            deadline_s=CONNECT_S,
            stopped=lambda: bool(interrupt.requested()),
            log=self.log,
        )
        if chan is None:
            raise interrupt.Interrupted(interrupt.requested(), "the wait for the rollout process")
        self.chan = chan
        self.server = transfer_server(chan.sock.getsockname()[0])
        leaves, mesh = layout(params)
        self.chan.send(
            "hello",
            config=self.config,
            transfer=self.server.address(),
            leaves=leaves,
            mesh=mesh,
            lease=runlock.lease_left(),
        )
        self.connected = True
        self.log(f"[overlap] the rollout process at {host}:{port} generates")
        for target, name in ((self._dispatch, "dispatch"), (self._offer, "offer")):
            t = threading.Thread(target=target, name=f"overlap-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _channel(self) -> Channel:
        assert self.chan is not None, "connected on resume, before any stage"
        return self.chan

    def _dispatch(self) -> None:
        """Reads the rollout process's messages (never blocks on anything else)."""
        from magic_jax.run import runlock

        chan = self._channel()
        while True:
            kind, body = chan.inbox.get()
            if kind == "want":
                self._wanted.put(body["version"])
            elif kind == "lease?":  # how long this process's run lock holds, from now
                chan.try_send("lease", n=body["n"], left=runlock.lease_left())
            elif kind == "rollout":
                with self._cond:
                    self._results[body["epoch"], body["step"]] = body
                    self._cond.notify_all()
            else:  # stopped, error or closed: the rollout side has ended
                if kind == "stopped":
                    interrupt.request(body["signum"])  # a stop of both sides
                with self._cond:
                    self._peer = self._peer or (kind, body)
                    self._cond.notify_all()
                if kind == "closed":
                    self._wanted.put(None)
                    return

    def _offer(self) -> None:
        """Offers each version asked for once the update has published it, under the id
        both sides derive from the session (``Channel.pull_id``): the offer names only
        the version, and the transfer server serves an id once."""
        chan = self._channel()
        while (version := self._wanted.get()) is not None:
            try:
                params = self.versions.get(version, self._cancel)
            except (Cancelled, KeyError) as e:
                chan.try_send("offer", version=version, error=str(e))
                continue
            self.server.await_pull(chan.pull_id(version), params)
            chan.try_send("offer", version=version, error=None)

    def _end_stage(self) -> list[int]:
        with self._cond:
            dropped = sorted(j for e, j in self._results if e == self._epoch)
            self._results.clear()
        return dropped

    def _begin(
        self,
        stage: Stage,
        step: int,
        k: int,
        end: int,
        sampler: StepSampler,
    ) -> None:
        """Tells the rollout process to generate this stage's steps from ``step`` on."""
        self._epoch += 1
        self._channel().send(
            "stage",
            epoch=self._epoch,
            index=stage.index,
            excluded=list(stage.excluded),
            first=step,
            k=k,
            end=end,
        )

    def _take(self, step: int) -> tuple[Collected, JSON]:
        t0 = time.perf_counter()
        body = self._wait(step)
        got = body["got"]
        wait = time.perf_counter() - t0
        metrics = self._metrics(got, step, wait, body["start_wait_s"], body["seconds"])
        pulled = body["pulled"]
        metrics["publish_bytes"] = sum(n for _, n, _ in pulled)
        metrics["t_publish_s"] = sum(s for _, _, s in pulled)
        return got, metrics

    def _wait(self, step: int) -> Body:
        key = (self._epoch, step)

        def ended() -> None:
            if self._peer is not None:
                kind, body = self._peer
                if kind == "stopped":
                    raise interrupt.Interrupted(body["signum"], "the rollout process")
                if kind == "error":
                    raise RuntimeError(f"the rollout process failed:\n{body['text']}")
                raise RuntimeError(
                    f"the rollout process closed the connection during step {step}'s "
                    "rollout (it ended or was killed); its finished groups are kept"
                )
            silence(self._channel(), "the rollout process", f"step {step}'s rollout")
            interrupt.check("rollout")  # a stop of this process, while it waits

        with self._cond:
            wait_for(self._cond, lambda: key in self._results, check=ended)
            return self._results.pop(key)

    def close(self) -> list[int]:
        """Tells the rollout process to stop, with this process's stop signal (0: none), or
        that this process failed (when called as an error propagates)."""
        import sys

        self._stage = None
        if self.chan is not None:
            error = sys.exc_info()[1]
            if error is None or isinstance(error, interrupt.Interrupted):
                self.chan.try_send("stop", signum=interrupt.requested())
            else:
                self.chan.try_send("error", text=_said(error))
            self._cancel.set()
            self.versions.wake()
            self._wanted.put(None)
            for t in self._threads:
                t.join(timeout=10)
            self.chan.close()
            self.chan = None
        return []


class PulledVersions:
    """The rollout process's ``versions.VersionSource``: version v is asked of the trainer when
    first needed and pulled across (``jax.experimental.transfer``) in its layout."""

    def __init__(
        self,
        chan: Channel,
        conn: TransferConnection,
        treedef: PyTreeDef,
        specs: list[jax.ShapeDtypeStruct],
        log: Callable[[str], None],
    ):
        self.chan = chan
        self.conn = conn
        self.treedef = treedef
        self.specs = specs
        self.log = log
        self._offers: dict[int, Body] = {}
        self._cond = threading.Condition()
        self.pulled: list[tuple[int, int, float]] = []  # (version, bytes, seconds), not yet sent

    def offered(self, body: Body) -> None:
        with self._cond:
            self._offers[body["version"]] = body
            self._cond.notify_all()

    def get(self, version: int, cancel: threading.Event | None = None) -> Params:
        self.chan.send("want", version=version)

        def lost() -> None:
            if self.chan.closed.is_set():  # the worker's loop says how the trainer ended
                raise Cancelled(f"version {version} was not offered")
            silence(self.chan, "the trainer's process", f"the offer of version {version}")

        with self._cond:
            wait_for(self._cond, lambda: version in self._offers, cancel=cancel, check=lost)
            offer = self._offers.pop(version)
        if offer["error"] is not None:
            raise KeyError(f"policy version {version}: {offer['error']}")
        t0 = time.perf_counter()
        flat = jax.block_until_ready(self.conn.pull(self.chan.pull_id(version), self.specs))
        secs = time.perf_counter() - t0
        nbytes = sum(x.nbytes for x in flat)
        self.pulled.append((version, nbytes, secs))
        self.log(f"[rollout] version {version}: {nbytes / 2**20:.2f} MiB pulled in {secs:.3f} s")
        return self.treedef.unflatten(flat)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def drain(self) -> list[tuple[int, int, float]]:
        out, self.pulled = self.pulled, []
        return out


class TrainerLease:
    """The rollout process's write fence (``fence.hold``): it writes into the run directory
    only while the trainer's process holds the run's lock. The lock is the trainer's; this
    process asks it, every few seconds, how long its lease holds, and counts that from
    when it asked (before the answer was made), so its own deadline never passes the
    trainer's. A local lock (an ``flock``) holds while the trainer's process lives: here,
    while the channel does.

    Args:
      chan: the channel to the trainer's process.
      asked_at: the monotonic time the handshake began (before the hello's ``lease``).
      left: the hello's ``lease`` (``runlock.lease_left``: None for a local lock).
      out: the run directory (for the message).
    """

    def __init__(self, chan: Channel, asked_at: float, left: float | None, out: Path):
        self.chan = chan
        self.out = out
        self.leased = left is not None
        self.deadline = math.inf if left is None else asked_at + left
        self.every = BEAT_S if left is None else min(BEAT_S, max(0.05, left / 6))
        self.lost: str | None = None if left is None or left > 0 else "it had lost it"
        self._asked: dict[int, float] = {}
        self._next = time.monotonic()

    def check(self, what: str, *, server: bool = False) -> None:
        """``check_fence`` in the rollout process."""
        from magic_jax.run.runlock import LOST_LOCK_EXIT, LockLost

        if self.lost is None and self.chan.closed.is_set():
            self.lost = "the trainer's process is gone"
        if self.lost is None and time.monotonic() >= self.deadline:
            self.lost = "its lease was not confirmed in time"
        if self.lost is not None:
            raise LockLost(
                f"{self.out}: not writing {what}: the trainer's process no longer holds the "
                f"run lock ({self.lost}); stopping (exit status {LOST_LOCK_EXIT})"
            )

    def ask(self) -> None:
        """Asks the trainer's lease again when due (the worker's loop calls it)."""
        now = time.monotonic()
        if not self.leased or now < self._next:
            return
        self._next = now + self.every
        n = len(self._asked) + int(now * 1e6)
        self._asked[n] = now
        self.chan.try_send("lease?", n=n)

    def answered(self, body: Body) -> None:
        asked = self._asked.pop(body["n"], None)
        if asked is None or body["left"] is None:
            return
        if body["left"] <= 0:
            self.lost = "another process took the run over, or its lease ran out"
        else:
            self.deadline = max(self.deadline, asked + body["left"])


def pull_specs(leaves: list[Leaf], mesh: Mesh | None) -> list[jax.ShapeDtypeStruct]:
    """``jax.ShapeDtypeStruct``s of ``layout``'s leaves on this process's ``mesh``."""
    from jax.sharding import NamedSharding, Sharding, SingleDeviceSharding

    specs = []
    for shape, dtype, spec in leaves:
        if spec is None:
            sharding: Sharding = SingleDeviceSharding(jax.local_devices()[0])
        else:
            assert mesh is not None, "the hello's mesh matched this process's (_check_hello)"
            sharding = NamedSharding(mesh, spec)
        specs.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
    return specs


def worker_meshes(mesh: MeshConfig | None) -> tuple[Mesh | None, Mesh | None]:
    """The rollout process's (trainer-layout mesh, engine mesh) over its devices: ``mesh``'s
    axes, and fsdp over every device with ``mesh.tensor`` (a split's rollout mesh)."""
    from magic_jax.model.sharding import make_mesh

    if mesh is None:
        return None, None
    return make_mesh(mesh), make_mesh(dataclasses.replace(mesh, data=1, fsdp=-1))
