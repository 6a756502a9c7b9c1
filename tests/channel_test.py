"""The control channel of a ``rollout.hosts`` job against strangers, over real sockets on
127.0.0.1: a stranger who connects first (a pickle that would create a file, garbage, a
well-formed ``stop`` frame of the unauthenticated protocol, silence) is refused and said
in one line with its address, nothing it sent is loaded, and the trainer then gets in; a
message whose MAC fails is not loaded; a listener without the run's key is not obeyed;
a version's weights are pulled by the job alone, once; and the rollout process writes
nothing into the run directory once the trainer's lock is lost."""

import contextlib
import os
import pickle
import socket
import stat
import struct
import threading
import time
import types

import pytest

from magic_jax.run import channel

KEY = os.urandom(32)


def channel_pair(key: bytes = KEY) -> tuple[channel.Channel, channel.Channel]:
    """(the trainer's end, the rollout's end) of one authenticated connection."""
    a, b = socket.socketpair()
    got = {}
    t = threading.Thread(
        target=lambda: got.setdefault("s", channel.accept_handshake(b, lambda: key))
    )
    t.start()
    mine = channel.answer_handshake(a, key)
    t.join()
    assert got["s"] == mine
    return (
        channel.Channel(a, mine, trainer=True, name="t"),
        channel.Channel(b, got["s"], trainer=False, name="r"),
    )


class _Opens:
    """Loading this pickle creates the file ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _old_frame(obj) -> bytes:  # a length-prefixed pickle: the unauthenticated protocol
    data = pickle.dumps(obj)
    return struct.pack("!Q", len(data)) + data


def _listen(tmp_path, lines):
    port = _free_port()
    lst = channel.Listener("127.0.0.1", port, lambda: channel.read_key(tmp_path), lines.append)
    return lst, port


def _heard(s: socket.socket) -> bytes:
    """All ``s`` receives until its peer closes it."""
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(4096):
            out += chunk
    return out


def _closed(s: socket.socket) -> bool:
    """The peer closed ``s`` (reset, where what we sent was left unread)."""
    try:
        return s.recv(4096) == b""
    except ConnectionResetError:
        return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_key_is_fresh_and_readable_by_its_owner_alone(tmp_path):
    k1 = channel.write_key(tmp_path)
    assert stat.S_IMODE(os.stat(tmp_path / channel.KEY).st_mode) == 0o600
    assert channel.read_key(tmp_path) == k1
    k2 = channel.write_key(tmp_path)
    assert k2 != k1 and channel.read_key(tmp_path) == k2
    channel.remove_key(tmp_path)
    assert channel.read_key(tmp_path) is None


def test_strangers_first_are_refused_and_said_then_the_trainer_gets_in(tmp_path):
    lines: list[str] = []
    key = channel.write_key(tmp_path)
    lst, port = _listen(tmp_path, lines)
    victim = tmp_path / "created_by_a_stranger"
    result = {}
    t = threading.Thread(
        target=lambda: result.setdefault("chan", lst.accept(30, lambda: False)), daemon=True
    )
    t.start()
    silent = socket.create_connection(("127.0.0.1", port))  # says nothing, holds on
    for payload in (
        _old_frame(_Opens(victim)),
        os.urandom(200),
        _old_frame(("stop", {"signum": 0})),
        channel.MAGIC + os.urandom(56),  # a replayed or forged answer: the nonce is new
    ):
        with socket.create_connection(("127.0.0.1", port)) as s:
            with contextlib.suppress(OSError):  # the listener may have closed it already
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)  # all it says
            s.settimeout(5)
            heard = _heard(s)  # the challenge at most, then the close: nothing more
            assert len(heard) <= len(channel.MAGIC) + channel.NONCE, heard
    time.sleep(0.3)
    assert not t.is_alive() or "chan" not in result  # no stranger got in
    trainer = channel.dial("127.0.0.1", port, key, deadline_s=10, stopped=lambda: False)
    t.join(10)
    rollout = result["chan"]
    trainer.send("hello", n=1)
    assert rollout.get(5) == ("hello", {"n": 1})
    rollout.send("want", version=0)
    assert trainer.get(5) == ("want", {"version": 0})
    assert not victim.exists()
    silent.close()
    time.sleep(0.3)
    refused = [x for x in lines if "refused a connection from 127.0.0.1:" in x]
    assert len(refused) == 5 == len(lines), lines  # the silent one too, once it left
    assert all("\n" not in x for x in refused)
    lst.close()
    trainer.close()
    rollout.close()


def test_a_stop_from_a_stranger_with_no_key_to_check_is_refused(tmp_path):
    lines: list[str] = []
    lst, port = _listen(tmp_path, lines)  # no key written yet: nothing proves itself
    failed = []

    def accept():
        with pytest.raises(TimeoutError):
            lst.accept(2.0, lambda: False)
        failed.append(True)

    t = threading.Thread(target=accept)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(_old_frame(("stop", {"signum": 0})) + b"\0" * 64)
        s.settimeout(5)
        assert s.recv(64).startswith(channel.MAGIC)
        assert _closed(s)
    t.join()
    lst.close()
    assert failed and len(lines) == 1 and "no run key" in lines[0], lines


def test_a_message_whose_mac_fails_is_not_loaded(tmp_path):
    trainer, rollout = channel_pair()
    victim = tmp_path / "created_by_an_injection"
    data = pickle.dumps(("stop", {"x": _Opens(victim)}))
    trainer.sock.sendall(struct.pack("!Q32s", len(data), b"\0" * 32) + data)
    kind, body = rollout.get(5)
    assert kind == "closed" and "failed authentication" in body["why"]
    assert not victim.exists()
    trainer.close()


def test_a_replayed_message_is_refused():
    trainer, rollout = channel_pair()
    sent, real = [], trainer.sock

    class Tap:  # records what the trainer sends, as one on the wire would
        def sendall(self, b):
            sent.append(b)
            real.sendall(b)

        def __getattr__(self, name):
            return getattr(real, name)

    trainer.sock = Tap()
    trainer.send("stop", signum=0)
    assert rollout.get(5) == ("stop", {"signum": 0})
    real.sendall(sent[-1])  # the same bytes again: its sequence number is spent
    kind, body = rollout.get(5)
    assert kind == "closed" and "failed authentication" in body["why"]
    trainer.close()


def test_the_trainer_obeys_no_listener_without_the_key():
    """A stranger holding the port speaks the protocol but cannot prove the key: the
    trainer refuses it (and reads none of the stop frame it sends after)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def stranger():
        conn, _ = srv.accept()
        with conn:
            conn.sendall(channel.MAGIC + os.urandom(channel.NONCE))
            channel._exact(conn, 2 * channel.NONCE)
            conn.sendall(os.urandom(32) + _old_frame(("stop", {"signum": 0})))
            time.sleep(1)

    threading.Thread(target=stranger, daemon=True).start()
    with pytest.raises(channel.Refused, match="not this run's"):
        channel.dial("127.0.0.1", port, KEY, deadline_s=10, stopped=lambda: False)
    srv.close()


def test_a_dial_ends_on_a_stop_and_at_its_deadline():
    port = _free_port()  # nothing listens
    t0 = time.monotonic()
    assert channel.dial("127.0.0.1", port, KEY, deadline_s=60, stopped=lambda: True) is None
    with pytest.raises(TimeoutError, match=f"rollout process at 127.0.0.1:{port}"):
        channel.dial("127.0.0.1", port, KEY, deadline_s=0.5, stopped=lambda: False)
    assert time.monotonic() - t0 < 5


def test_a_listener_ends_on_a_stop(tmp_path):
    lst, _ = _listen(tmp_path, [])
    t0 = time.monotonic()
    assert lst.accept(60, lambda: time.monotonic() - t0 > 0.5) is None
    assert time.monotonic() - t0 < 3
    lst.close()


def test_weights_are_pulled_by_the_job_alone_and_once():
    """The offer names the version alone; its transfer id is derived from the session on
    both sides. A stranger who reads every frame and pulls by what it saw (or by the
    version) gets nothing; the rollout process gets the weights; the id is served once."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from magic_jax.run.remote import PulledVersions, RemoteRollouts, Side, transfer_server

    trainer_end, rollout_end = channel_pair()
    rr = RemoteRollouts(0, None, side=Side(False, "127.0.0.1", 1), config={}, log=print)
    rr.chan = trainer_end
    rr.server = transfer_server("127.0.0.1")
    params = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4)}
    rr.versions.publish(0, params)
    for target in (rr._dispatch, rr._offer):
        threading.Thread(target=target, daemon=True).start()
    rollout_side = transfer_server("127.0.0.1")
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in
             jax.tree.leaves(params)]  # fmt: skip
    versions = PulledVersions(rollout_end, rollout_side.connect(rr.server.address()),
                              jax.tree.structure(params), specs, print)  # fmt: skip
    stranger = transfer_server("127.0.0.1").connect(rr.server.address())
    offers, stolen = [], []

    def feed():  # the worker's loop; a stranger on the wire pulls by all it sees first
        while (msg := rollout_end.get(10)) is not None and msg[0] != "closed":
            if msg[0] == "offer":
                offers.append(msg[1])
                seen = {0, *(v for v in msg[1].values() if isinstance(v, int))}
                stolen.extend(stranger.pull(g, specs) for g in seen)
                versions.offered(msg[1])

    threading.Thread(target=feed, daemon=True).start()
    got = versions.get(0)
    assert all(np.array_equal(got[k], params[k]) for k in params)
    assert offers and set(offers[0]) == {"version", "error"}, offers
    late = stranger.pull(rollout_end.pull_id(0), specs)  # learned afterwards: served once
    time.sleep(2)
    assert not any(x.is_ready() for t in (*stolen, late) for x in t)
    trainer_end.close()
    rollout_end.close()


def test_after_a_takeover_the_rollout_process_writes_nothing(tmp_path, monkeypatch):
    """The rollout process's store is the trainer's (``stages.StepSampler.store``, fenced), and
    its fence follows the trainer's lease as the trainer says it (asked over the channel,
    counted from the asking): once the lease is lost, or no answer confirms it in time,
    or the trainer's process is gone, no group is written into the run directory."""
    import numpy as np
    from stop_resume_test import _group

    from magic_jax.run import fence, remote, runlock
    from magic_jax.run.stages import StepSampler

    left = [2.0]  # the trainer's lease, as its runlock.lease_left says
    monkeypatch.setattr(runlock, "lease_left", lambda: left[0])
    trainer_end, rollout_end = channel_pair()
    rr = remote.RemoteRollouts(0, None, side=remote.Side(False, "h", 1), config={}, log=print)
    rr.chan = trainer_end
    threading.Thread(target=rr._dispatch, daemon=True).start()
    lease = remote.TrainerLease(rollout_end, time.monotonic(), left[0], tmp_path)
    rng, lines = np.random.default_rng(0), []
    # the rollout process's sampler (its store needs only the run directory and T)
    sampler = StepSampler(None, None, None, tmp_path, lines.append, names_step=True)
    stage = types.SimpleNamespace(config=types.SimpleNamespace(max_response_length=3))

    def put(step: int) -> bool:  # one finished group of ``step``, as the rollout keeps it
        store = sampler.store(step, stage).round(0)
        store.put(0, "u", *_group(0, [2, 3], rng))
        return store.path(0).exists()

    def answered():  # the worker's loop: ask when due, take the answer
        lease.ask()
        while (msg := rollout_end.get(2)) is not None and msg[0] != "lease":
            pass
        lease.answered(msg[1])

    fence.hold(lease)
    try:
        answered()
        assert put(1)
        time.sleep(2.2)  # past the first answer's lease: a new answer extends it
        assert lease.every <= 0.35
        answered()
        assert put(2)
        left[0] = 0.0  # taken over: the trainer's fence is closed
        time.sleep(lease.every)
        answered()
        assert not put(3) and not (tmp_path / "rollouts" / "step_00000003").exists()
        with pytest.raises(runlock.LockLost, match="no longer holds the run lock"):
            fence.check_fence("anything")
        # a lease never confirmed again ends by itself, as does the trainer's process
        quiet = remote.TrainerLease(rollout_end, time.monotonic(), 0.3, tmp_path)
        fence.hold(quiet)
        assert put(4)
        time.sleep(0.35)
        assert not put(5)
        local = remote.TrainerLease(rollout_end, time.monotonic(), None, tmp_path)
        fence.hold(local)
        assert put(6)
        trainer_end.close()
        rollout_end.closed.wait(5)
        assert not put(7)
    finally:
        fence.release(fence.held())
