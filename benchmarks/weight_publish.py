"""Publishing new weights from the trainer's devices to the rollout's, three ways, same run:
bytes and seconds per version.

Overlap across hosts needs each version's weights moved from the updating devices to the
generating ones. Two processes of 4 CPU devices each stand for the two sides (no
``jax.distributed``: neither side waits on the other's programs); the weights are a
Qwen2-shaped tree of ``--mib`` MiB, sharded over the trainer's 4 devices (``fsdp``) and
wanted replicated on the rollout's (the engine's layout on one tensor shard):

  transfer: ``jax.experimental.transfer``: the trainer offers each version
            (``TransferServer.await_pull``) and goes on; the rollout pulls it in the
            trainer's layout, then lays it out as its engine wants (a local copy);
  host:     the trainer copies it to host memory, sends its bytes over a TCP socket when
            the rollout asks, and the rollout puts them on its devices;
  seam:     the job's own path (``run/remote.py``): the rollout asks for v over the
            authenticated channel, the trainer offers it under the session's id for v,
            the rollout pulls it (``PulledVersions``): transfer plus the ask and offer;
  in-process (the peer): the same move between two halves of one process's 8 devices,
            what a split in one process costs (``rollout.devices``).

The time per version is the rollout's: from asking for version v to having it on its
devices (the trainer having published v before). The first version (connection set-up,
compilation) is reported apart.

    .venv/bin/python benchmarks/weight_publish.py                # 256 MiB, 5 versions
    .venv/bin/python benchmarks/weight_publish.py --mib 64 --versions 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

DEVICES = 4


def tree_shapes(mib: int, hidden: int = 1024) -> dict[str, tuple[int, int]]:
    """A Qwen2-like layer list of float32 matrices, ``mib`` MiB in all."""
    per_layer = {"q": (hidden, hidden), "k": (hidden, hidden // 4), "v": (hidden, hidden // 4),
                 "o": (hidden, hidden), "up": (hidden, 3 * hidden), "gate": (hidden, 3 * hidden),
                 "down": (3 * hidden, hidden)}  # fmt: skip
    layer_bytes = 4 * sum(a * b for a, b in per_layer.values())
    layers = max(1, round(mib * 2**20 / layer_bytes))
    return {f"{i}.{k}": v for i in range(layers) for k, v in per_layer.items()}


def _setup(devices):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((len(devices),), ("fsdp",), devices=devices)
    return jax, jnp, NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())


def _params(jax, jnp, shapes, sharding, version):
    return {k: jax.device_put(jnp.full(s, version, jnp.float32), sharding) for k, s in
            shapes.items()}  # fmt: skip


def _send(sock, data: bytes) -> None:
    sock.sendall(struct.pack("!Q", len(data)) + data)


def _recv(sock) -> bytes:
    size = struct.unpack("!Q", _exact(sock, 8))[0]
    return _exact(sock, size)


def _exact(sock, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("the peer closed the connection")
        got += k
    return bytes(buf)


def trainer(args) -> None:
    import numpy as np

    jax, jnp, fsdp, _ = _setup(jax_devices())
    from jax.experimental import transfer

    shapes = tree_shapes(args.mib)
    server = transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    versions = [_params(jax, jnp, shapes, fsdp, v) for v in range(args.versions)]
    jax.block_until_ready(versions)
    for v, params in enumerate(versions):  # offered at once: the trainer does not wait
        server.await_pull(v, params)
    lst, seam = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    ports = [lst.getsockname()[1], seam.getsockname()[1]]
    Path(args.rendezvous).write_text(json.dumps([server.address(), *ports]))
    conn, _ = lst.accept()
    with conn:
        while (ask := _recv(conn)) != b"done":
            v = int(ask)
            host = jax.device_get(versions[v])
            _send(conn, b"".join(np.ascontiguousarray(host[k]).tobytes() for k in shapes))
    conn, _ = seam.accept()
    chan = _seam_channel(conn, bytes.fromhex(args.key), trainer=True)
    from magic_jax.run.remote import RemoteRollouts

    rr = RemoteRollouts(args.versions, None, side=None, config={}, log=lambda _: None)
    rr.chan, rr.server = chan, server
    for v, params in enumerate(versions):
        rr.versions.publish(v, params)
    rr._threads = [threading.Thread(target=t, daemon=True) for t in (rr._dispatch, rr._offer)]
    for t in rr._threads:  # the trainer's threads of a job
        t.start()
    chan.closed.wait()
    rr.close()  # as the trainer ends: its threads joined


def _seam_channel(sock, key: bytes, *, trainer: bool):
    """The job's authenticated channel over ``sock`` (``run/channel.py``)."""
    from magic_jax.run import channel

    if trainer:
        session = channel.answer_handshake(sock, key)
    else:
        session = channel.accept_handshake(sock, lambda: key)
    return channel.Channel(sock, session, trainer=trainer, name="bench")


def rollout(args) -> None:
    import numpy as np

    jax, jnp, fsdp, replicated = _setup(jax_devices())
    from jax.experimental import transfer

    shapes = tree_shapes(args.mib)
    while not Path(args.rendezvous).exists() or not Path(args.rendezvous).read_text():
        time.sleep(0.05)
    address, port, seam_port = json.loads(Path(args.rendezvous).read_text())
    server = transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    pull = server.connect(address)
    specs = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=fsdp) for k, s in shapes.items()}
    relayout = jax.jit(lambda t: t, out_shardings=replicated)
    out = {"transfer": [], "host": [], "seam": []}
    for v in range(args.versions):
        t0 = time.perf_counter()
        got = jax.block_until_ready(relayout(pull.pull(v, specs)))
        out["transfer"].append(time.perf_counter() - t0)
        assert float(np.asarray(got["0.q"])[0, 0]) == v
    sock = socket.create_connection(("127.0.0.1", port))
    with sock:
        for v in range(args.versions):
            t0 = time.perf_counter()
            _send(sock, str(v).encode())
            data, at, got = _recv(sock), 0, {}
            for k, s in shapes.items():
                n = s[0] * s[1] * 4
                arr = np.frombuffer(data, np.float32, n // 4, at).reshape(s)
                got[k], at = jax.device_put(arr, replicated), at + n
            jax.block_until_ready(got)
            out["host"].append(time.perf_counter() - t0)
            assert float(np.asarray(got["0.q"])[0, 0]) == v
        _send(sock, b"done")
    from magic_jax.run.remote import PulledVersions

    sock = socket.create_connection(("127.0.0.1", seam_port))
    chan = _seam_channel(sock, bytes.fromhex(args.key), trainer=False)
    flat = jax.tree.leaves(specs)
    pulled = PulledVersions(chan, pull, jax.tree.structure(specs), flat, log=lambda _: None)

    def offers():  # the rollout process's loop hands each offer on
        while (msg := chan.get(60)) is not None and msg[0] != "closed":
            if msg[0] == "offer":
                pulled.offered(msg[1])

    threading.Thread(target=offers, daemon=True).start()
    for v in range(args.versions):
        t0 = time.perf_counter()
        got = jax.block_until_ready(relayout(pulled.get(v)))
        out["seam"].append(time.perf_counter() - t0)
        assert float(np.asarray(got["0.q"])[0, 0]) == v
    chan.close()
    print(json.dumps(out))


def in_process(args) -> list[float]:
    """The same move inside one process of 8 devices: its first 4 to its last 4."""
    import numpy as np

    jax = __import__("jax")
    devs = jax.devices()
    _, jnp, fsdp, _ = _setup(devs[DEVICES:])
    _, _, _, replicated = _setup(devs[:DEVICES])
    shapes = tree_shapes(args.mib)
    versions = [_params(jax, jnp, shapes, fsdp, v) for v in range(args.versions)]
    jax.block_until_ready(versions)
    times = []
    for v, params in enumerate(versions):
        t0 = time.perf_counter()
        got = jax.block_until_ready(jax.device_put(params, replicated))
        times.append(time.perf_counter() - t0)
        assert float(np.asarray(got["0.q"])[0, 0]) == v
    return times


def jax_devices():
    import jax

    return jax.devices()


def _line(name: str, secs: list[float], nbytes: int) -> str:
    import statistics

    rest = secs[1:] or secs
    med = statistics.median(rest)
    return (f"  {name:10s} first {secs[0]:6.3f} s; then median {med:6.3f} s (min {min(rest):.3f}, "
            f"max {max(rest):.3f}), {nbytes / med / 1e9:5.2f} GB/s")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="weights per version, MiB")
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--role", choices=["trainer", "rollout", "in-process"], help=argparse.SUPPRESS)
    ap.add_argument("--rendezvous", help=argparse.SUPPRESS)
    ap.add_argument("--key", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "trainer":
        return trainer(args)
    if args.role == "rollout":
        return rollout(args)
    if args.role == "in-process":
        return print(json.dumps(in_process(args)))
    shapes = tree_shapes(args.mib)
    nbytes = sum(a * b * 4 for a, b in shapes.values())
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    me = [sys.executable, __file__, "--mib", str(args.mib), "--versions", str(args.versions)]
    key = os.urandom(32).hex()  # the run's key, as both processes of a job read it
    with tempfile.TemporaryDirectory() as tmp:
        rdv = str(Path(tmp) / "rendezvous.json")
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
        side = [
            subprocess.Popen(
                [*me, "--role", r, "--rendezvous", rdv, "--key", key],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in ("trainer", "rollout")
        ]
        outs = [p.communicate(timeout=1200)[0] for p in side]
        if any(p.returncode for p in side):
            sys.exit(f"a side failed: exit {[p.returncode for p in side]}")
        two = json.loads(outs[1].strip().splitlines()[-1])
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={2 * DEVICES}"
    one = subprocess.run([*me, "--role", "in-process"], env=env, capture_output=True, text=True,
                         check=True, timeout=1200)  # fmt: skip
    peer = json.loads(one.stdout.strip().splitlines()[-1])
    print(f"weights: {len(shapes)} float32 matrices, {nbytes / 2**20:.0f} MiB per version, "
          f"{args.versions} versions; {DEVICES} devices per side (fsdp -> replicated); "
          f"{os.cpu_count()} CPU cores")  # fmt: skip
    print(_line("transfer", two["transfer"], nbytes))
    print(_line("host", two["host"], nbytes))
    print(_line("seam", two["seam"], nbytes))
    print(_line("in-process", peer, nbytes))
    med = {k: sorted(v[1:] or v)[len(v[1:] or v) // 2] for k, v in
           (("transfer", two["transfer"]), ("host", two["host"]), ("peer", peer),
            ("seam", two["seam"]))}  # fmt: skip
    print(f"transfer / host: {med['host'] / med['transfer']:.2f}x faster; "
          f"transfer / in-process: {med['peer'] / med['transfer']:.2f}x; "
          f"seam / transfer: {med['seam'] / med['transfer']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
