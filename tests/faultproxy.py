"""A flaky Cloud Storage for the tests: an HTTP proxy in front of the GCS emulator that
fails a seeded share of the requests the way Cloud Storage does in production.

Every client of the library (gcsfs, the storage client of the run lock, tensorstore
under orbax) talks to the emulator through it when its ``env`` is set. Each request
draws its fate from ``rates`` (a probability per fault kind, the rest pass):

- ``429`` / ``503``: answered at once with Cloud Storage's error body (rate limit,
  backend unavailable); nothing reaches the emulator.
- ``reset``: the connection is reset before the request is forwarded.
- ``cut``: a request with a body is reset halfway through reading it (an upload cut
  mid-way); one without a body is reset as ``reset``.
- ``stall``: the request waits ``stall_s`` before it is forwarded (a slow backend).
- ``lost``: the request is forwarded and done (a write lands) but its reply is lost:
  the connection is reset instead.

The draw is a hash of (seed, method, path, the n-th time this method and path were
seen), not a shared random stream, so which request fails does not depend on how the
client's threads interleave: the same run against the same seed meets the same
faults, except where object names themselves vary (upload ids). ``counts`` has the
faults injected per kind; ``retries`` counts requests repeating one that failed.

Where the emulator differs from Cloud Storage in what a retry meets, the proxy
answers as Cloud Storage does: a request to a resumable upload session that has
completed gets the completed object (200) again, as the resumable-upload docs
describe for a status check after the last chunk; fake-gcs-server has forgotten
the session by then and answers 404, which no client can recover from.

Run as ``python tests/faultproxy.py UPSTREAM_URL --seed 0 --rate 503=0.05 ...`` it
serves until killed and prints its URL (for trying a flaky bucket by hand).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import http.client
import http.server
import json
import os
import socket
import socketserver
import struct
import threading
import time
import urllib.parse

KINDS = ("429", "503", "reset", "cut", "stall", "lost")
# hop-by-hop headers, never forwarded (RFC 9110 section 7.6.1)
_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
        "upgrade", "content-length"}  # fmt: skip
_STATUS = {
    "429": (429, "rateLimitExceeded", "The rate of change requests to the object is too high."),
    "503": (503, "backendError", "We encountered an internal error. Please try again."),
}


class _Reset(Exception):
    """The connection is to be reset (RST) without a reply."""


@contextlib.contextmanager
def clients_pointed_at(env: dict[str, str]):
    """This process (and those it starts) with ``env`` set for the block, gcsfs's cached
    clients dropped before and after (gcsfs keeps one per endpoint); the variables
    restored after it."""
    import fsspec

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    fs = fsspec.get_filesystem_class("gs")
    fs.clear_instance_cache()
    try:
        yield
    finally:
        fs.clear_instance_cache()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class FaultProxy:
    """A seeded flaky proxy in front of ``upstream`` (the emulator's ``http://host:port``).

    ``rates`` maps fault kinds (``KINDS``) to probabilities (their sum at most 1).
    ``url`` is the proxy's address; ``env`` points the library's clients at it.
    ``faulty`` switches the faults off and on (requests pass either way).
    """

    def __init__(self, upstream: str, *, seed: int = 0, rates: dict[str, float] | None = None,
                 stall_s: float = 2.0):  # fmt: skip
        rates = dict(rates or {})
        unknown = set(rates) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {KINDS}")
        if sum(rates.values()) > 1:
            raise ValueError(f"fault rates add up to more than 1: {rates}")
        self.upstream = upstream.rstrip("/")
        up = urllib.parse.urlsplit(self.upstream)
        self._up = (up.hostname, up.port)
        self.seed, self.rates, self.stall_s = int(seed), rates, float(stall_s)
        self.faulty = True
        self.requests = 0
        self.counts: collections.Counter[str] = collections.Counter()
        self.retries = 0
        self._seen: collections.Counter[tuple[str, str]] = collections.Counter()
        self._failed: set[tuple[str, str]] = set()
        self.trace: list[tuple[str, str, str | None, int | None]] = []  # what each request met
        self._completed: dict[str, tuple[int, list, bytes]] = {}  # upload_id -> reply
        self._lock = threading.Lock()
        self._once: list[tuple[str, str, str]] = []
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self.env = {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url}
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def once(self, kind: str, method: str, contains: str) -> None:
        """The next ``method`` request whose target contains ``contains`` meets ``kind``
        (whatever the rates draw): a fault placed where a test wants it."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {KINDS}")
        with self._lock:
            self._once.append((kind, method, contains))

    def in_env(self):
        """This process's clients pointed at the proxy for the block."""
        return clients_pointed_at(self.env)

    def fate(self, method: str, target: str) -> str | None:
        """The fault this request meets (None: it passes), and the tallies."""
        path = urllib.parse.urlsplit(target).path
        key = (method, path)
        with self._lock:
            self.requests += 1
            n = self._seen[key]
            self._seen[key] += 1
            if key in self._failed:
                self.retries += 1
            kind = None
            for i, (_, m, part) in enumerate(self._once):
                if m == method and part in target:
                    kind = self._once.pop(i)[0]
                    break
            if kind is None and self.faulty and self.rates:
                digest = hashlib.sha256(f"{self.seed}\0{method}\0{path}\0{n}".encode()).digest()
                u = int.from_bytes(digest[:8], "big") / 2**64
                for k in KINDS:
                    u -= self.rates.get(k, 0.0)
                    if u < 0:
                        kind = k
                        break
            if kind is not None:
                self.counts[kind] += 1
            self.trace.append((method, target, kind, None))
            if kind in (None, "stall"):
                self._failed.discard(key)
            else:
                self._failed.add(key)
            return kind

    def summary(self) -> dict[str, int]:
        with self._lock:
            return {"requests": self.requests, "faults": sum(self.counts.values()),
                    "retries": self.retries, **{k: self.counts[k] for k in KINDS}}  # fmt: skip

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address):  # a reset client is not an error
        pass


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FaultProxy

    def log_message(self, *args):  # quiet
        pass

    def _body(self, cut: bool) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                parts.append(self.rfile.read(size))
                self.rfile.readline()
                if cut:
                    raise _Reset
            return b"".join(parts)
        n = int(self.headers.get("Content-Length") or 0)
        if cut and n:
            self.rfile.read(n // 2)
            raise _Reset
        return self.rfile.read(n) if n else b""

    def _reset(self) -> None:
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass

    def _serve(self) -> None:
        kind = self.owner.fate(self.command, self.path)
        try:
            if kind in ("reset", "cut") and not (kind == "cut" and self._has_body()):
                raise _Reset
            body = self._body(cut=kind == "cut")
            if kind in _STATUS:
                code, reason, message = _STATUS[kind]
                errors = [{"reason": reason, "message": message}]
                payload = json.dumps(
                    {"error": {"code": code, "message": message, "errors": errors}}
                )
                self._reply(code, [("Content-Type", "application/json")], payload.encode())
                return
            if kind == "stall":
                time.sleep(self.owner.stall_s)
            query = urllib.parse.urlsplit(self.path).query
            upload = urllib.parse.parse_qs(query).get("upload_id")
            done = self.owner._completed.get(upload[0]) if upload else None
            if done is not None:
                status, headers, data = done
            else:
                status, headers, data = self._forward(body)
                if upload and status in (200, 201):
                    self.owner._completed[upload[0]] = (status, headers, data)
            self.owner.trace.append((self.command, self.path, "reply", status))
            if kind == "lost":
                raise _Reset
            self._reply(status, headers, data)
        except _Reset:
            self._reset()

    def _has_body(self) -> bool:
        return bool(int(self.headers.get("Content-Length") or 0)) or (
            self.headers.get("Transfer-Encoding", "").lower() == "chunked"
        )

    def _forward(self, body: bytes):
        conn = http.client.HTTPConnection(*self.owner._up, timeout=120)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            out = []
            for k, v in resp.getheaders():
                if k.lower() in _HOP:
                    continue
                if k.lower() == "location":  # resumable uploads continue through the proxy
                    v = v.replace(self.owner.upstream, self._me())
                out.append((k, v))
            return resp.status, out, data
        finally:
            conn.close()

    def _me(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def _reply(self, status: int, headers, data: bytes) -> None:
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _serve

    def finish(self):
        with contextlib.suppress(OSError):
            super().finish()


def _main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("upstream")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", action="append", default=[], metavar="KIND=P")
    p.add_argument("--stall-s", type=float, default=2.0)
    a = p.parse_args()
    rates = {k: float(v) for k, v in (r.split("=", 1) for r in a.rate)}
    proxy = FaultProxy(a.upstream, seed=a.seed, rates=rates, stall_s=a.stall_s)
    print(proxy.url, flush=True)
    try:
        while True:
            time.sleep(10)
            print(json.dumps(proxy.summary()), flush=True)
    except KeyboardInterrupt:
        proxy.stop()


if __name__ == "__main__":
    _main()
