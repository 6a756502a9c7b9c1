"""The authenticated control channel of a ``rollout.hosts`` job: a per-run key in the run
directory, a challenge-response that proves both ends hold it, and a MAC on every message.

The trainer's process writes a fresh random key into the run directory (``KEY``, mode
0600 on a local disk; on Cloud Storage the bucket's permissions guard it, as they guard
the checkpoints) once it has claimed the directory, before it connects; the rollout
process reads it when a connection comes. Nothing more to type: both processes run the
same command with the same ``output_dir``.

  handshake  the listener sends ``MAGIC`` and a random nonce; the caller answers with
             its own nonce and ``HMAC(key, "trainer" | both nonces)`` (64 bytes, no
             length, no parsing); a wrong answer, or none within ``HANDSHAKE_S``, and
             the listener closes the connection at once, logging its address. The
             listener then proves itself the same way (``"rollout"``), so the trainer
             obeys no stranger either;
  messages   ``length | HMAC(session, direction | sequence | length | body) | body``,
             the session key derived from the key and both nonces; a message whose MAC
             fails closes the channel before its body is parsed. Bodies are pickles,
             loaded only once their MAC holds: only a holder of the run's key can make
             either process load one. A sequence number per direction stops a replay
             or a reordering, the direction a reflection.

The channel authenticates; it does not encrypt (the rollouts and the config cross in
the clear, as the weights do over ``jax.experimental.transfer``). ``docs/training.md``
(Overlap across hosts) has the threat model.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import pickle
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from magic_jax.storage import StoragePath

KEY = ".seam-key"  # in the run directory: the per-run secret of the two processes
MAGIC = b"MJSEAM01"
NONCE = 32
HANDSHAKE_S = 5.0  # how long a connection may take to prove itself
BEAT_S = 5.0  # each side says it is alive this often
SILENT_S = 300.0  # a peer silent this long (no message, no beat) is lost
MAX_BODY = 1 << 36  # a message larger than this is not read (a broken or hostile peer)
_HEAD = struct.Struct("!Q32s")


# A message's fields as they cross: pickled values of any kind (arrays, numbers, lists, the
# stage's options), read by name by the side that knows what each kind of message holds
Body = dict[str, Any]
# (its kind, its fields)
Message = tuple[str, Body]


class Refused(ConnectionError):
    """The other end did not prove it holds the run's key (or sent no proof in time)."""


def key_path(out: str | os.PathLike) -> StoragePath:
    from magic_jax import storage

    return storage.path(out) / KEY


def write_key(out: str | os.PathLike) -> bytes:
    """A fresh random key for this start of the run, written to ``out``'s ``KEY`` (0600
    locally, whole or not at all); returns it. The fence is asked first: a process that
    lost the run's lock writes nothing."""
    from magic_jax import storage
    from magic_jax.run.fence import check_fence

    key = os.urandom(32)
    check_fence(KEY)
    path = key_path(out)
    if storage.is_gcs(out):
        storage.write_text(path, key.hex())
        return key
    tmp = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex())
    os.replace(tmp, path)
    return key


def read_key(out: str | os.PathLike) -> bytes | None:
    """The run's key as its trainer wrote it, or None (none yet, or unreadable)."""
    try:
        return bytes.fromhex(key_path(out).read_text().strip())
    except (OSError, ValueError):
        return None


def remove_key(out: str | os.PathLike) -> None:
    """Deletes the key at the end of the trainer's run (best effort)."""
    from magic_jax.run.fence import check_fence

    with contextlib.suppress(Exception):
        check_fence(KEY)
        key_path(out).unlink()


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("closed")
        got += k
    return bytes(buf)


def accept_handshake(sock: socket.socket, key_of: Callable[[], bytes | None]) -> bytes:
    """The listener's side of the handshake on a fresh connection; returns the session key.
    ``key_of``: reads the run's key (after the caller's answer has arrived).

    Raises:
      Refused: a wrong or late answer, or no key to check it against.
    """
    mine = os.urandom(NONCE)
    sock.settimeout(HANDSHAKE_S)
    try:
        sock.sendall(MAGIC + mine)
        answer = _exact(sock, 2 * NONCE)
    except (OSError, ConnectionError) as e:
        raise Refused(f"no answer to the challenge ({type(e).__name__})") from None
    theirs, proof = answer[:NONCE], answer[NONCE:]
    key = key_of()
    if key is None:
        raise Refused("no run key in the run directory yet")
    if not hmac.compare_digest(proof, _mac(key, b"trainer", mine, theirs)):
        raise Refused("a wrong answer to the challenge")
    try:
        sock.sendall(_mac(key, b"rollout", theirs, mine))
    except OSError as e:
        raise Refused(f"gone after its answer ({type(e).__name__})") from None
    sock.settimeout(None)
    return _mac(key, b"session", mine, theirs)


def answer_handshake(sock: socket.socket, key: bytes) -> bytes:
    """The caller's side: answers the listener's challenge and checks its proof; returns
    the session key.

    Raises:
      Refused: the listener is not this job's rollout process (it does not hold the key).
      ConnectionError: the connection closed or timed out first (the listener refused us,
        or could not read the key yet).
    """
    sock.settimeout(HANDSHAKE_S * 2)
    head = _exact(sock, len(MAGIC) + NONCE)
    if head[: len(MAGIC)] != MAGIC:
        raise Refused("it does not speak this project's protocol")
    theirs, mine = head[len(MAGIC) :], os.urandom(NONCE)
    sock.sendall(mine + _mac(key, b"trainer", theirs, mine))
    proof = _exact(sock, 32)
    if not hmac.compare_digest(proof, _mac(key, b"rollout", mine, theirs)):
        raise Refused("it does not hold this run's key")
    sock.settimeout(None)
    return _mac(key, b"session", theirs, mine)


class Channel:
    """Messages ``(kind, body)`` over one authenticated TCP connection; sent from any
    thread, read by a thread of its own into ``inbox`` (``("closed", {"why": ...})`` at the
    end). A beat every ``BEAT_S`` lets each side tell a silent peer from a busy one
    (``silent_s``).

    Args:
      sock: the connection, its handshake done.
      session: the session key (``accept_handshake`` / ``answer_handshake``).
      trainer: this end is the trainer's (the directions differ).
      name: the threads' name.
    """

    def __init__(self, sock: socket.socket, session: bytes, *, trainer: bool, name: str):
        self.sock = sock
        self._session = session
        self._out, self._in = (b"T", b"R") if trainer else (b"R", b"T")
        self._sent = self._read_n = 0
        self.inbox: queue.Queue[Message] = queue.Queue()
        self.heard = time.monotonic()
        self.closed = threading.Event()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()
        self._beat = threading.Thread(target=self._beats, name=f"{name}-beat", daemon=True)
        self._beat.start()

    def pull_id(self, version: int) -> int:
        """The transfer id of ``version``'s weights in this session: both ends derive it,
        it never crosses, and no one without the session key can guess it."""
        return int.from_bytes(_mac(self._session, b"pull", struct.pack("!q", version))[:8], "big")

    def send(self, kind: str, **body: object) -> None:
        data = pickle.dumps((kind, body), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            seq, self._sent = self._sent, self._sent + 1
            mac = _mac(self._session, self._out, struct.pack("!QQ", seq, len(data)), data)
            self.sock.sendall(_HEAD.pack(len(data), mac) + data)

    def try_send(self, kind: str, **body: object) -> bool:
        """``send``, False where the peer is gone."""
        try:
            self.send(kind, **body)
            return True
        except OSError:
            return False

    def get(self, timeout: float) -> Message | None:
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def silent_s(self) -> float:
        """Seconds since the peer last said anything."""
        return time.monotonic() - self.heard

    def _read(self) -> None:
        why = "the peer closed the connection"
        try:
            while True:
                size, mac = _HEAD.unpack(_exact(self.sock, _HEAD.size))
                if size > MAX_BODY:
                    why = f"a message of {size} bytes announced: not read"
                    return
                data = _exact(self.sock, size)
                want = _mac(self._session, self._in, struct.pack("!QQ", self._read_n, size), data)
                if not hmac.compare_digest(mac, want):
                    why = "a message failed authentication: not read"
                    return
                self._read_n += 1
                self.heard = time.monotonic()
                kind, body = pickle.loads(data)  # authenticated: from the job's own process
                if kind != "beat":
                    self.inbox.put((kind, body))
        except (OSError, ConnectionError, EOFError):
            pass
        finally:
            self.closed.set()
            self.inbox.put(("closed", {"why": why}))

    def _beats(self) -> None:
        while not self.closed.wait(BEAT_S):
            if not self.try_send("beat"):
                return

    def close(self) -> None:
        self.closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class Listener:
    """The rollout process's listening socket at the coordinator's address: from its
    making on, a thread accepts connections and checks each one's proof on a thread of
    its own (a stranger that connects and says nothing delays no one), until one proves
    it holds the run's key; ``accept`` waits for that one.

    Args:
      host / port: the coordinator's address (its interface only; every interface when
        the name is not one of this machine's).
      key_of: reads the run's key (``read_key``).
      log: where each refused connection is said, in one line with its address.
    """

    def __init__(
        self, host: str, port: int, key_of: Callable[[], bytes | None], log: Callable[[str], None]
    ):
        self.key_of = key_of
        self.log = log
        try:
            self.sock = socket.create_server((host, port))
            self.where = f"{host}:{port}"
        except OSError as e:  # not an address of this machine (a name behind NAT, say)
            if not isinstance(e, socket.gaierror) and e.errno != errno.EADDRNOTAVAIL:
                raise
            log(f"[rollout] cannot listen at {host}:{port} ({e}); on every interface")
            self.sock = socket.create_server(("", port))
            self.where = f"*:{port}"
        self.sock.settimeout(0.2)
        self._done: queue.Queue[tuple[socket.socket, bytes]] = queue.Queue()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="rollout-listener", daemon=True).start()

    def accept(self, deadline_s: float, stopped: Callable[[], bool]) -> Channel | None:
        """The first connection that proves itself, as a ``Channel``; None when ``stopped()``
        turns true first.

        Raises:
          TimeoutError: none proved itself within ``deadline_s``.
        """
        deadline = time.monotonic() + deadline_s
        while True:
            with contextlib.suppress(queue.Empty):
                sock, session = self._done.get(timeout=0.2)
                return Channel(sock, session, trainer=False, name="rollout")
            if stopped():
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no trainer's process proved itself within {deadline_s:.0f} s")

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, addr = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            threading.Thread(target=self._prove, args=(sock, addr), daemon=True).start()

    def _prove(self, sock: socket.socket, addr: tuple[str, int]) -> None:
        try:
            session = accept_handshake(sock, self.key_of)
        except Refused as e:
            self.log(f"[rollout] refused a connection from {addr[0]}:{addr[1]}: {e}")
            with contextlib.suppress(OSError):
                sock.close()
            return
        if self._closed.is_set():  # a second caller after the first: not wanted
            sock.close()
            return
        self._done.put((sock, session))

    def close(self) -> None:
        self._closed.set()
        self.sock.close()
        while True:
            try:
                sock, _ = self._done.get_nowait()
            except queue.Empty:
                return
            sock.close()


def dial(
    host: str,
    port: int,
    key: bytes,
    *,
    deadline_s: float,
    stopped: Callable[[], bool],
    log: Callable[[str], None] = print,
) -> Channel | None:
    """The trainer's side: connects to the rollout process at ``host:port`` and proves
    itself, trying again while no one listens there; None when ``stopped()`` first.

    Raises:
      Refused: the process listening there does not hold this run's key.
      TimeoutError: no rollout process answered within ``deadline_s``.
    """
    deadline, said, last = time.monotonic() + deadline_s, False, "nothing listens there"
    while not stopped():
        try:
            sock = socket.create_connection((host, port), timeout=2)
        except OSError as e:
            last = f"{type(e).__name__}: {e}"
        else:
            try:
                session = answer_handshake(sock, key)
                return Channel(sock, session, trainer=True, name="trainer")
            except Refused as e:
                sock.close()
                raise Refused(f"the process at {host}:{port} is not this run's: {e}") from None
            except (OSError, ConnectionError) as e:  # it may not have read the key yet
                last = f"the connection closed in the handshake ({type(e).__name__})"
                sock.close()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"[overlap] waited {deadline_s:.0f} s for the rollout process at {host}:{port} "
                f"({last})"
            )
        if not said:
            log(f"[overlap] waiting for the rollout process at {host}:{port}")
            said = True
        time.sleep(0.25)
    return None
