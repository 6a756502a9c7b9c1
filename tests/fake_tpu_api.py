"""A fake of Cloud TPU's REST API (v2, and v2alpha1 for best-effort requests): nodes and
queued resources with their states over a scaled clock, long-running operations, and
errors as the API returns them (a google.rpc.Status in ``{"error": ...}`` with its HTTP
status; an operation's ``error``, a queued resource's ``failedData``).

The real client talks to it: ``TpuClient(credentials=AnonymousCredentials(),
transport="rest", client_options={"api_endpoint": fake.url})`` (``jobs/tpu_api.py`` does,
given ``MAGIC_JAX_TPU_API_ENDPOINT=fake.url``). Time is the fake's: ``scale`` fake seconds
pass per real second, so an hour of maintenance can take a second of a test.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

# the HTTP status of each google.rpc status, as the REST API answers
HTTP = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "RESOURCE_EXHAUSTED": 429,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
}
CODES = {
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6,
    "PERMISSION_DENIED": 7,
    "RESOURCE_EXHAUSTED": 8,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
    "UNAUTHENTICATED": 16,
}


@dataclasses.dataclass(frozen=True)
class Error:
    """An error the API answers: a call's (``{"error": ...}`` with its HTTP status) or,
    with ``in_operation``, a create's operation's (``error`` of a done operation)."""

    status: str
    message: str
    reason: str = ""
    metadata: tuple[tuple[str, str], ...] = ()
    in_operation: bool = False

    def body(self) -> dict:
        error = {"code": HTTP[self.status], "message": self.message, "status": self.status}
        if self.reason:
            info = {
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": self.reason,
                "domain": "googleapis.com",
                "metadata": dict(self.metadata),
            }
            error["details"] = [info]
        return {"error": error}

    def status_json(self) -> dict:
        return {"code": CODES[self.status], "message": self.message}


ZONE_ = "us-east5-a"
# The errors of the scenarios, in the API's words
STOCKOUT = Error(  # no capacity: the create's operation ends with code 8
    "RESOURCE_EXHAUSTED",
    f'There is no more capacity in the zone "{ZONE_}"; you can try in another zone where '
    "Cloud TPU Nodes are offered (see https://cloud.google.com/tpu/docs/regions) "
    "[EID: 0x1bc8f9d790be9142]",
    in_operation=True,
)
INTERNAL = Error("INTERNAL", "An internal error has occurred.", in_operation=True)  # Spot
RATE_LIMIT = Error(
    "RESOURCE_EXHAUSTED",
    "Quota exceeded for quota metric 'Requests' and limit 'Requests per minute' of service "
    "'tpu.googleapis.com' for consumer 'project_number:123456789'.",
    reason="RATE_LIMIT_EXCEEDED",
    metadata=(
        ("quota_metric", "tpu.googleapis.com/default_requests"),
        ("quota_limit", "DefaultRequestsPerMinutePerProject"),
        ("service", "tpu.googleapis.com"),
        ("consumer", "projects/123456789"),
    ),
)
QUOTA = Error(
    "RESOURCE_EXHAUSTED",
    "Quota limit 'TPUV5pPreemptiblePodPerProjectPerZoneForTPUAPI' has been exceeded. "
    f"Limit: 0 in zone {ZONE_}.",
)
UNAUTHENTICATED = Error(
    "UNAUTHENTICATED",
    "Request had invalid authentication credentials. Expected OAuth 2 access token, login "
    "cookie or other valid authentication credential.",
)
PERMISSION = Error(
    "PERMISSION_DENIED",
    f"Permission 'tpu.nodes.create' denied on 'projects/p/locations/{ZONE_}/nodes/magic-jax'",
)


@dataclasses.dataclass
class Node:
    """A node: its state and health over the fake's time."""

    name: str
    body: dict
    ready_at: float
    state: str = "CREATING"
    gone_at: float | None = None  # a delete under way ends then
    maintenance: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    preempt_at: float | None = None


@dataclasses.dataclass
class Queued:
    """A queued resource: WAITING_FOR_RESOURCES until ``active_at`` (its node created
    then), or FAILED at ``fail_at`` with ``failed``; SUSPENDING from ``suspend_at`` for a
    while, then SUSPENDED."""

    name: str
    node_id: str
    node_body: dict
    created: float
    active_at: float | None
    state: str = "WAITING_FOR_RESOURCES"
    fail_at: float | None = None
    failed: dict | None = None
    suspend_at: float | None = None
    suspended_at: float | None = None


class FakeTpuApi:
    """The fake: start it, script it, point the client at ``url``.

    Args:
      scale: fake seconds per real second.
      create_s: how long a node's create takes (its operation, CREATING meanwhile).
      delete_s: how long a delete takes (DELETING meanwhile).
      hosts: the workers of every slice.
      calls_file: where each call is also appended, one ``VERB NAME`` a line (another
        process's tests read it).
    """

    def __init__(
        self,
        *,
        scale: float = 1.0,
        create_s: float = 0.0,
        delete_s: float = 0.0,
        hosts: int = 2,
        calls_file: Path | None = None,
    ) -> None:
        self.scale, self.create_s, self.delete_s, self.hosts = scale, create_s, delete_s, hosts
        self.calls_file = calls_file
        self.nodes: dict[str, Node] = {}
        self.queued: dict[str, Queued] = {}
        self.operations: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []
        self.errors: dict[str, list[Error | None]] = {}
        self.qr_wait_s = 0.0  # how long a request waits for capacity
        self.qr_fail: tuple[float, Error] | None = None  # a request FAILED after S
        self.stuck_delete_s = 0.0  # the next node delete: DELETING this long, its op not done
        self.lock = threading.RLock()
        self._ids = itertools.count(1)
        self._t0 = time.monotonic()
        self._server: ThreadingHTTPServer | None = None

    # ------------------------------------------------------------------ time, set-up
    def now(self) -> float:
        """The fake's time, in seconds since it started."""
        return (time.monotonic() - self._t0) * self.scale

    def start(self) -> str:
        """Serves on 127.0.0.1 in a thread; returns ``url``."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _answer(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}") if length else {}
                reason = self.headers.get("x-goog-request-reason", "")
                try:
                    status, out = fake.handle(method, self.path, body, reason)
                except Exception as e:  # the fake's own bug: said, not a dropped connection
                    status, out = 500, Error("INTERNAL", f"the fake failed: {e!r}").body()
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

            def do_DELETE(self):
                self._answer("DELETE")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        serve = lambda: self._server.serve_forever(poll_interval=0.02)
        threading.Thread(target=serve, daemon=True).start()
        return self.url

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the fake first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def advance(self, seconds: float) -> None:
        """Moves the fake's clock ``seconds`` (fake) ahead."""
        self._t0 -= seconds / self.scale

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def script(self, verb: str, *answers: Error | None) -> None:
        """The next answers to ``verb`` (``create-node``, ``get-node``, ``delete-node``,
        ``create-qr``, ``get-qr``, ``delete-qr``, ``list-qr``, ``get-op``): an error each,
        ``None`` for the call's own answer."""
        self.errors.setdefault(verb, []).extend(answers)

    def add_node(self, name: str, state: str = "READY") -> Node:
        """A node that exists already (made by an earlier launch)."""
        with self.lock:
            node = Node(name=name, body={"acceleratorType": "v5p-16"}, ready_at=0, state=state)
            self.nodes[name] = node
            return node

    def maintenance(self, name: str, at_s: float, for_s: float) -> None:
        """The node READY with health UNHEALTHY_MAINTENANCE from ``at_s`` for ``for_s``
        (fake seconds from now), as a maintenance event of the whole slice reports."""
        with self.lock:
            start = self.now() + at_s
            self.nodes[name].maintenance.append((start, start + for_s))

    def preempt(self, name: str, at_s: float = 0.0) -> None:
        """The node PREEMPTED ``at_s`` from now (with a queued resource: SUSPENDING, then
        SUSPENDED, the node gone)."""
        with self.lock:
            q = next((q for q in self.queued.values() if q.node_id == name), None)
            if q is not None:
                q.suspend_at = self.now() + at_s
            else:
                self.nodes[name].preempt_at = self.now() + at_s

    # ------------------------------------------------------------------ states
    def _node_json(self, node: Node) -> dict:
        t = self.now()
        if node.gone_at is not None and t >= node.gone_at:
            self.nodes.pop(node.name, None)
            return {}
        if node.preempt_at is not None and t >= node.preempt_at:
            node.state = "PREEMPTED"
        elif node.state == "CREATING" and t >= node.ready_at:
            node.state = "READY"
        health = "HEALTHY" if node.state == "READY" else ""
        out = {**node.body, "name": f"{self.parent}/nodes/{node.name}", "state": node.state}
        if any(a <= t < b for a, b in node.maintenance) and node.state == "READY":
            health = "UNHEALTHY_MAINTENANCE"
            out["healthDescription"] = "The TPU is undergoing maintenance."
        if health:
            out["health"] = health
        out["networkEndpoints"] = [{"ipAddress": f"10.0.0.{i + 1}"} for i in range(self.hosts)]
        return out

    def _qr_json(self, q: Queued) -> dict:
        t = self.now()
        if q.suspended_at is not None and t >= q.suspended_at:
            q.state = "SUSPENDED"
        elif q.suspend_at is not None and t >= q.suspend_at and q.state == "ACTIVE":
            q.state, q.suspended_at = "SUSPENDING", t + 30
            self.nodes.pop(q.node_id, None)
        elif q.state == "WAITING_FOR_RESOURCES" and q.fail_at is not None and t >= q.fail_at:
            q.state = "FAILED"
        elif q.state == "WAITING_FOR_RESOURCES" and q.active_at is not None and t >= q.active_at:
            q.state = "ACTIVE"
            self.nodes[q.node_id] = Node(name=q.node_id, body=q.node_body, ready_at=t)
        state: dict = {"state": q.state}
        if q.state == "FAILED":
            state["failedData"] = {"error": q.failed}
        return {"name": f"{self.parent}/queuedResources/{q.name}", "state": state}

    parent = f"projects/p/locations/{ZONE_}"

    # ------------------------------------------------------------------ requests
    def _op(self, done_at: float, response: dict, error: Error | None = None) -> dict:
        name = f"{self.parent}/operations/operation-{next(self._ids)}"
        self.operations[name] = {"done_at": done_at, "response": response, "error": error}
        return self._op_json(name)

    def _op_json(self, name: str) -> dict:
        op = self.operations[name]
        out: dict = {"name": name, "done": self.now() >= op["done_at"]}
        if out["done"] and op["error"] is not None:
            out["error"] = op["error"].status_json()
        elif out["done"]:
            out["response"] = op["response"]
        return out

    def _record(self, verb: str, name: str) -> None:
        self.calls.append((verb, name))
        if self.calls_file is not None:
            with self.calls_file.open("a") as f:
                f.write(f"{verb} {name}\n")

    def handle(self, method: str, path: str, body: dict, reason: str = "") -> tuple[int, dict]:
        """One request: its HTTP status and JSON answer (``reason``: its
        X-Goog-Request-Reason; a node asked by a status cycle is recorded ``poll-node``)."""
        url = urlsplit(path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        m = re.fullmatch(
            r"/(v2|v2alpha1)/projects/[^/]+/locations/[^/]+/(nodes|queuedResources|operations)"
            r"(?:/([^/:]+))?",
            url.path,
        )
        if m is None:
            return 404, Error("NOT_FOUND", f"no such path {url.path}").body()
        version, kind, name = m.groups()
        noun = {"nodes": "node", "queuedResources": "qr", "operations": "op"}[kind]
        verb = {"GET": "get" if name else "list", "POST": "create", "DELETE": "delete"}[method]
        verb = f"{verb}-{noun}"
        name = name or query.get("nodeId") or query.get("queuedResourceId") or ""
        with self.lock:
            self._record("poll-node" if verb == "get-node" and reason else verb, name)
            scripted = self.errors.get(verb)
            error = scripted.pop(0) if scripted else None
            if error is not None and not error.in_operation:
                return HTTP[error.status], error.body()
            return getattr(self, "_" + verb.replace("-", "_"))(name, body, error, version)

    def _missing(self, what: str, name: str) -> tuple[int, dict]:
        full = f"{self.parent}/{what}/{name}"
        return 404, Error("NOT_FOUND", f"Resource '{full}' was not found").body()

    def _get_node(self, name, body, error, version):
        node = self.nodes.get(name)
        out = self._node_json(node) if node else {}
        return (200, out) if out else self._missing("nodes", name)

    def _create_node(self, name, body, error, version):
        if name in self.nodes and self._node_json(self.nodes[name]):
            message = f"Resource '{self.parent}/nodes/{name}' already exists"
            return 409, Error("ALREADY_EXISTS", message).body()
        t = self.now()
        response = {"@type": f"type.googleapis.com/google.cloud.tpu.{version}.Node"}
        if error is None:
            self.nodes[name] = Node(name=name, body=body, ready_at=t + self.create_s)
        return 200, self._op(t + self.create_s, response, error)

    def _delete_node(self, name, body, error, version):
        node = self.nodes.get(name)
        if node is None or not self._node_json(node):
            return self._missing("nodes", name)
        t, stuck = self.now(), self.stuck_delete_s
        self.stuck_delete_s = 0.0
        node.state, node.gone_at = "DELETING", t + (stuck or self.delete_s)
        done_at = t + 10**9 if stuck else node.gone_at  # a stuck delete's op never ends
        return 200, self._op(done_at, {"@type": "type.googleapis.com/google.protobuf.Empty"})

    def _get_qr(self, name, body, error, version):
        q = self.queued.get(name)
        return (200, self._qr_json(q)) if q else self._missing("queuedResources", name)

    def _list_qr(self, name, body, error, version):
        return 200, {"queuedResources": [self._qr_json(q) for q in self.queued.values()]}

    def _create_qr(self, name, body, error, version):
        if name in self.queued:
            message = f"Resource '{self.parent}/queuedResources/{name}' already exists"
            return 409, Error("ALREADY_EXISTS", message).body()
        spec = body["tpu"]["nodeSpec"][0]
        t = self.now()
        q = Queued(name, spec["nodeId"], spec["node"], t, t + self.qr_wait_s)
        valid = body.get("queueingPolicy", {}).get("validUntilDuration")
        if self.qr_fail is not None:
            q.fail_at, q.failed = t + self.qr_fail[0], self.qr_fail[1].status_json()
        if valid and float(valid.rstrip("s")) < self.qr_wait_s:  # it lapses before capacity
            q.active_at = None
            q.fail_at = t + float(valid.rstrip("s"))
            lapsed = "The queued resource request lapsed: no capacity before its deadline."
            q.failed = {"code": 4, "message": lapsed}
        self.queued[name] = q
        response = {"@type": f"type.googleapis.com/google.cloud.tpu.{version}.QueuedResource"}
        return 200, self._op(t, response, error)

    def _delete_qr(self, name, body, error, version):
        q = self.queued.pop(name, None)
        if q is None:
            return self._missing("queuedResources", name)
        self.nodes.pop(q.node_id, None)
        response = {"@type": "type.googleapis.com/google.protobuf.Empty"}
        return 200, self._op(self.now() + self.delete_s, response)

    def _get_op(self, name, body, error, version):
        full = f"{self.parent}/operations/{name}"
        return 200, self._op_json(full)
