"""Overlap across hosts (``rollout.hosts``): the rollout on one process's devices, the update
on another's, each its own JAX runtime, the weights pulled across at each version.

Every process of the job runs the same ``magic-jax train`` command with the
``MAGIC_JAX_COORDINATOR`` / ``_NUM_PROCESSES`` / ``_PROCESS_ID`` variables. Process 0
generates (``serve``); the other updates (the trainer, with ``RemoteRollouts`` as its
source of rollouts). Neither starts ``jax.distributed`` across both: no program spans
the two sides, so no launch order of either side's programs can wait on the other's.
What crosses is

  control   one TCP connection (the rollout process listens at the coordinator's
            address): the trainer's ``hello`` (the config, its transfer address, the
            weights' layout), ``stage`` (which steps to generate), ``offer`` (a version
            ready to pull) and ``stop``; the rollout's ``want`` (a version), ``rollout``
            (a step's groups, pickled) and ``stopped`` / ``error``;
  weights   ``jax.experimental.transfer``: the trainer offers a version's copy
            (``TransferServer.await_pull``) when the rollout asks for it; the rollout
            pulls it in the trainer's layout onto its own devices, and its driver lays it
            out for the engine (``load_params``), as in a split within one process.
            Measured on CPU it is 3.2x faster than sending host bytes
            (``benchmarks/weight_publish.py``) and a dead peer fails a pull at once;
  groups    the run directory: the rollout keeps each finished group there
            (``rollout.partial``) as in one process, so a resume decodes only the rest.

The schedule is ``overlap``'s, unchanged: the rollout process runs the same
``RolloutPipeline`` with a ``PulledVersions`` in place of the in-process versions, so
step k still starts under version ``max(0, k - s)`` and, with ``publish_chunks``, moves
on by its chunk counts. A stop on either side stops both: a signal to the rollout
process is sent on as ``stopped`` (the trainer stops at its next step's rollout with a
checkpoint, as if signalled itself); the trainer's stop ends the rollout's current step
at its next decode chunk. A side that dies closes the connection and the other ends in
one line. The trainer's checkpoint keeps the lagged versions, so the same command resumes
both. One process per side for now.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import pickle
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from magic_jax import interrupt
from magic_jax.run.overlap import Cancelled, OverlapRollouts, overlap_metrics
from magic_jax.run.step_rollouts import StepRollout

if TYPE_CHECKING:
    from magic_jax.run.config import TrainConfig
    from magic_jax.run.stages import Stage

CONNECT_S = 600.0  # how long either side waits for the other to appear
POLL_S = 0.2  # how often a wait looks for a stop or a lost peer


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


def frame(kind: str, **body: Any) -> bytes:
    """One message as ``Channel`` sends it."""
    data = pickle.dumps((kind, body), protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack("!Q", len(data)) + data


def farewell(side: Side, error: BaseException | None) -> None:
    """Tells a rollout process this trainer never said hello to that the job ends: ``stop``
    (the run had finished) or ``error`` (the trainer failed first). Best effort, 10 s."""
    deadline = time.monotonic() + 10
    while True:
        try:
            sock = socket.create_connection((side.host, side.port), timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.5)
    msg = frame("stop", signum=0) if error is None else frame("error", text=_said(error))
    with contextlib.suppress(OSError), sock:
        sock.sendall(msg)


def _said(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class Channel:
    """Pickled messages ``(kind, body)`` over one TCP connection, length-prefixed; sent from
    any thread, read by a thread of its own into ``inbox`` (``("closed", {})`` at the end).
    Both ends are this project's processes of one job."""

    def __init__(self, sock: socket.socket, name: str):
        self.sock = sock
        self.inbox: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()

    def send(self, kind: str, **body: Any) -> None:
        with self._lock:
            self.sock.sendall(frame(kind, **body))

    def try_send(self, kind: str, **body: Any) -> bool:
        """``send``, False where the peer is gone."""
        try:
            self.send(kind, **body)
            return True
        except OSError:
            return False

    def get(self, timeout: float) -> tuple[str, dict[str, Any]] | None:
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def _exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if not k:
                raise ConnectionError("closed")
            got += k
        return bytes(buf)

    def _read(self) -> None:
        try:
            while True:
                size = struct.unpack("!Q", self._exact(8))[0]
                self.inbox.put(pickle.loads(self._exact(size)))
        except (OSError, ConnectionError, EOFError):
            pass
        finally:
            self.inbox.put(("closed", {}))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def transfer_server(local_ip: str) -> Any:
    from jax.experimental import transfer

    return transfer.start_transfer_server(
        jax.local_devices()[0].client, f"{local_ip}:0", [f"{local_ip}:0"]
    )


def layout(params: Any) -> tuple[list[tuple[Any, str, Any]], dict[str, int] | None]:
    """Each leaf's (shape, dtype, PartitionSpec or None on one device) and the mesh's axis
    sizes: what the rollout side needs to pull the trainer's arrays as they lie."""
    from jax.sharding import NamedSharding

    leaves, mesh = [], None
    for x in jax.tree.leaves(params):
        named = isinstance(x.sharding, NamedSharding)
        if named:
            mesh = dict(x.sharding.mesh.shape)
        leaves.append((tuple(x.shape), str(x.dtype), x.sharding.spec if named else None))
    return leaves, mesh


class RemoteRollouts(OverlapRollouts):
    """The trainer's ``StepRollouts`` when another process generates: ``OverlapRollouts``'
    versions and checkpoint item, its rollouts received from the rollout process."""

    def __init__(self, *args: Any, side: Side, config: dict[str, Any], **kw: Any):
        super().__init__(*args, **kw)
        self.side, self.config = side, config
        self.chan: Channel | None = None
        self._results: dict[tuple[int, int], dict[str, Any]] = {}
        self._cond = threading.Condition()
        self._epoch = 0
        self._peer: tuple[str, dict[str, Any]] | None = None  # how the rollout side ended
        self._wanted: queue.Queue[int | None] = queue.Queue()
        self._cancel = threading.Event()
        self._threads: list[threading.Thread] = []
        self.connected = False  # the hello was sent

    def resume(self, restored: Any, step: int) -> Any:
        state = super().resume(restored, step)
        self._connect(state.params)
        return state

    def _connect(self, params: Any) -> None:
        deadline = time.monotonic() + CONNECT_S
        while True:
            try:
                sock = socket.create_connection((self.side.host, self.side.port), timeout=10)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"[overlap] no rollout process at {self.side.host}:{self.side.port} "
                        f"after {CONNECT_S:.0f} s ({e})"
                    ) from None
                time.sleep(0.5)
        sock.settimeout(None)
        self.server = transfer_server(sock.getsockname()[0])
        self.chan = Channel(sock, "trainer")
        leaves, mesh = layout(params)
        self.chan.send(
            "hello", config=self.config, transfer=self.server.address(), leaves=leaves, mesh=mesh
        )
        self.connected = True
        self.log(f"[overlap] the rollout process at {self.side.host}:{self.side.port} generates")
        for target, name in ((self._dispatch, "dispatch"), (self._offer, "offer")):
            t = threading.Thread(target=target, name=f"overlap-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _dispatch(self) -> None:
        """Reads the rollout process's messages (never blocks on anything else)."""
        while True:
            kind, body = self.chan.inbox.get()
            if kind == "want":
                self._wanted.put(body["version"])
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
        """Offers each version asked for once the update has published it."""
        uuids = itertools.count(int.from_bytes(os.urandom(3), "big") << 20)
        while (version := self._wanted.get()) is not None:
            try:
                params = self.versions.get(version, self._cancel)
            except (Cancelled, KeyError) as e:
                self.chan.try_send("offer", version=version, uuid=None, error=str(e))
                continue
            uuid = next(uuids)
            self.server.await_pull(uuid, params)
            self.chan.try_send("offer", version=version, uuid=uuid, error=None)

    def rollout(
        self,
        stage: Stage,
        step: int,
        k: int,
        state: Any,
        collect: Any,
        store_at: Any,
        *,
        resumed: bool,
        end: int,
    ) -> StepRollout:
        """Step ``step``'s groups from the rollout process, which generates this stage's
        steps from ``step`` on once told (at the stage's first step taken)."""
        if self._stage is not stage:
            with self._cond:
                dropped = sorted(j for e, j in self._results if e == self._epoch)
                self._results.clear()
            if dropped:  # a stage that ended on an ``until`` rule: sampled for the old one
                self.log(f"[overlap] the stage changed: rollouts of steps {dropped} discarded")
            self._epoch += 1
            self._stage = stage
            self.chan.send(
                "stage",
                epoch=self._epoch,
                index=stage.index,
                excluded=list(stage.excluded),
                first=step,
                k=k,
                end=min(step - k + stage.config.steps, end),
            )
        t0 = time.perf_counter()
        body = self._wait(step)
        got = body["got"]
        metrics = overlap_metrics(
            got, step, time.perf_counter() - t0, body["start_wait_s"], body["seconds"]
        )
        if self.reprefill:
            metrics["reprefills"] = sum(st.reprefills for st in got.stats)
        pulled = body["pulled"]
        metrics["publish_bytes"] = sum(n for _, n, _ in pulled)
        metrics["t_publish_s"] = sum(s for _, _, s in pulled)
        return StepRollout(got, metrics, 0.0, False)

    def _wait(self, step: int) -> dict[str, Any]:
        key = (self._epoch, step)
        with self._cond:
            while key not in self._results:
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
                self._cond.wait(POLL_S)
                interrupt.check("rollout")  # a stop of this process, while it waits
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
    """The rollout process's ``overlap.Versions``: version v is asked of the trainer when
    first needed and pulled across (``jax.experimental.transfer``) in its layout."""

    def __init__(self, chan: Channel, conn: Any, treedef: Any, specs: list[Any], log: Callable):
        self.chan, self.conn, self.treedef, self.specs, self.log = chan, conn, treedef, specs, log
        self._offers: dict[int, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self.pulled: list[tuple[int, int, float]] = []  # (version, bytes, seconds), not yet sent

    def offered(self, body: dict[str, Any]) -> None:
        with self._cond:
            self._offers[body["version"]] = body
            self._cond.notify_all()

    def get(self, version: int, cancel: threading.Event | None = None) -> Any:
        self.chan.send("want", version=version)
        with self._cond:
            while version not in self._offers:
                if cancel is not None and cancel.is_set():
                    raise Cancelled(f"version {version} was not offered")
                self._cond.wait(POLL_S)
            offer = self._offers.pop(version)
        if offer["uuid"] is None:
            raise KeyError(f"policy version {version}: {offer['error']}")
        t0 = time.perf_counter()
        flat = jax.block_until_ready(self.conn.pull(offer["uuid"], self.specs))
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


def pull_specs(leaves: list[tuple[Any, str, Any]], mesh: Any) -> list[Any]:
    """``jax.ShapeDtypeStruct``s of ``layout``'s leaves on this process's ``mesh``."""
    from jax.sharding import NamedSharding, SingleDeviceSharding

    one = SingleDeviceSharding(jax.local_devices()[0])
    return [
        jax.ShapeDtypeStruct(s, d, sharding=one if p is None else NamedSharding(mesh, p))
        for s, d, p in leaves
    ]


def worker_meshes(mesh: Any) -> tuple[Any, Any]:
    """The rollout process's (trainer-layout mesh, engine mesh) over its devices: ``mesh``'s
    axes, and fsdp over every device with ``mesh.tensor`` (a split's rollout mesh)."""
    from magic_jax.model.sharding import make_mesh

    if mesh is None:
        return None, None
    return make_mesh(mesh), make_mesh(dataclasses.replace(mesh, data=1, fsdp=-1))
