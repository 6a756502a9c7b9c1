"""Cloud TPU's API through its maintained Python client (``google-cloud-tpu``, the
``[launch]`` extra): a node's state, health and endpoints, creating and deleting nodes and
queued resources (waiting on their long-running operations, with a deadline), and a
queued resource's state with its ``failedData``. Every error comes out as a
``TpuApiError`` carrying ``jobs/pod_errors.py``'s verdict (one classification for the API's
errors and gcloud's).

The client is imported on first use. ``MAGIC_JAX_TPU_API_ENDPOINT`` (a test or emulator
hook: ``http://127.0.0.1:PORT``) points it at another server, over REST with anonymous
credentials; otherwise it talks to ``tpu.googleapis.com`` with Application Default
Credentials (``gcloud auth application-default login``).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from magic_jax import extras
from magic_jax.jobs import pod_errors

ENDPOINT_ENV = "MAGIC_JAX_TPU_API_ENDPOINT"
# the HTTP status the REST API answers with each google.rpc code (api_core's exceptions
# carry it as ``code``, for errors of a call and of an operation alike)
HTTP_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


class TpuApiError(Exception):
    """A call to Cloud TPU that failed, told apart (``error.kind``) with its one line."""

    def __init__(self, error: pod_errors.TpuError) -> None:
        super().__init__(error.say())
        self.error = error


@dataclasses.dataclass(frozen=True, kw_only=True)
class Node:
    """What the API says of a node (``GONE``: it answered NOT_FOUND).

    Attributes:
      name: the node's short name.
      state: ``Node.State`` by name (``READY``, ``REPAIRING`` ...) or ``GONE``.
      health: ``Node.Health`` by name (``HEALTHY``, ``UNHEALTHY_MAINTENANCE`` ...).
      health_description: the API's words on its health, ``""`` without any.
      endpoints: the workers' internal IP addresses, worker 0 first.
      runtime_version: its runtime version.
    """

    name: str
    state: str
    health: str = ""
    health_description: str = ""
    endpoints: tuple[str, ...] = ()
    runtime_version: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """What the API says of a queued resource (``GONE``: NOT_FOUND).

    Attributes:
      name: its short name.
      state: ``QueuedResourceState.State`` by name (``WAITING_FOR_RESOURCES``, ``ACTIVE``,
        ``FAILED`` ...) or ``GONE``.
      failed_code: with ``FAILED``, its ``failedData.error.code`` (a google.rpc code).
      failed_message: with ``FAILED``, its ``failedData.error.message``.
    """

    name: str
    state: str
    failed_code: int = 0
    failed_message: str = ""

    def failure(self) -> pod_errors.TpuError:
        """Its ``failedData`` told apart (``OTHER`` with no failedData)."""
        status = pod_errors.RPC_CODES.get(self.failed_code, "UNKNOWN")
        return pod_errors.from_status(status, self.failed_message or "no failedData")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec:
    """A slice to create, as ``tpu_scripts/launch.sh``'s options describe it.

    Attributes:
      accelerator: the accelerator type (``v5p-64``).
      runtime_version: the runtime version.
      spot: Spot capacity.
      reserved: capacity from the project's reservations.
      best_effort: (a queued resource) best-effort capacity (the API's v2alpha1 only).
      reservation: (a queued resource) this reservation, by name or full path.
      valid_until_s: (a queued resource) it lapses after this many seconds; 0: never.
      service_account: the VMs' service account, ``""``: the default one.
      network: the VMs' VPC network.
      subnetwork: their subnetwork.
      internal_ip: VMs without external IP addresses.
    """

    accelerator: str
    runtime_version: str
    spot: bool = False
    reserved: bool = False
    best_effort: bool = False
    reservation: str = ""
    valid_until_s: int = 0
    service_account: str = ""
    network: str = ""
    subnetwork: str = ""
    internal_ip: bool = False

    def node(self) -> dict[str, Any]:
        """The node's body (``Node`` as a dict, the API's field names)."""
        body: dict[str, Any] = {
            "accelerator_type": self.accelerator,
            "runtime_version": self.runtime_version,
            "network_config": {"enable_external_ips": not self.internal_ip},
        }
        net = body["network_config"]
        if self.network:
            net["network"] = self.network
        if self.subnetwork:
            net["subnetwork"] = self.subnetwork
        if self.service_account:
            body["service_account"] = {"email": self.service_account}
        if self.spot or self.reserved:
            body["scheduling_config"] = {"spot": self.spot, "reserved": self.reserved}
        return body


def api_error(exc: BaseException) -> pod_errors.TpuError:
    """An exception of the client (google.api_core's, or google.auth's) told apart."""
    from google.api_core import exceptions as core
    from google.auth import exceptions as auth

    if isinstance(exc, auth.GoogleAuthError):
        return pod_errors.from_status("UNAUTHENTICATED", str(exc).splitlines()[0])
    if isinstance(exc, core.GoogleAPICallError):
        status = HTTP_STATUS.get(int(exc.code or 0), "UNKNOWN")
        # (over REST the message starts with the request: "POST https://...: ")
        message = re.sub(r"^[A-Z]+ \S+: ", "", exc.message or str(exc))
        if exc.reason and exc.reason not in message:  # ErrorInfo's: RATE_LIMIT_EXCEEDED
            message += f" [{exc.reason}]"
        return pod_errors.from_status(status, message)
    if isinstance(exc, (core.RetryError, TimeoutError, ConnectionError, OSError)):
        return pod_errors.from_status("UNAVAILABLE", str(exc) or type(exc).__name__)
    return pod_errors.from_status("UNKNOWN", f"{type(exc).__name__}: {exc}")


@contextmanager
def _told_apart() -> Iterator[None]:
    try:
        yield
    except TpuApiError:
        raise
    except ImportError as exc:
        # whatever part is missing (google itself, or only google.cloud.tpu_v2), the extra
        # that brings it is [launch]
        hint = extras.message("google.cloud.tpu_v2", __name__)
        raise SystemExit(f"tpu_api.py: Cloud TPU's client is missing: {hint}") from exc
    except Exception as exc:  # every error of a call reaches the caller told apart
        raise TpuApiError(api_error(exc)) from exc


def _client(version: str, endpoint: str) -> Any:
    module = importlib.import_module(f"google.cloud.tpu_{version}")  # (the [launch] extra's)
    if not endpoint:
        return module.TpuClient()
    if version == "v2alpha1":  # (its client speaks gRPC only)
        line = f"best-effort capacity needs the API's v2alpha1, which {endpoint} does not serve"
        raise TpuApiError(pod_errors.from_status("UNIMPLEMENTED", line))
    from google.auth.credentials import AnonymousCredentials

    options = {"api_endpoint": endpoint}
    return module.TpuClient(
        credentials=AnonymousCredentials(), transport="rest", client_options=options
    )


class Tpu:
    """Nodes and queued resources of one zone.

    Args:
      project: the project's id.
      zone: the zone.
      endpoint: another server than ``tpu.googleapis.com`` (``http://127.0.0.1:PORT``:
        REST, anonymous credentials); default ``$MAGIC_JAX_TPU_API_ENDPOINT``.
      poll_s: the wait between two questions about a long-running operation.
      clock: the clock deadlines are measured with (tests scale it).
      sleep: how a wait is waited.
    """

    def __init__(
        self,
        project: str,
        zone: str,
        *,
        endpoint: str | None = None,
        poll_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not project or not zone:
            raise ValueError(f"tpu_api.Tpu needs a project and a zone, got {project!r}, {zone!r}")
        self.parent = f"projects/{project}/locations/{zone}"
        self.endpoint = os.environ.get(ENDPOINT_ENV, "") if endpoint is None else endpoint
        self.poll_s, self.clock, self.sleep = poll_s, clock, sleep
        self._clients: dict[str, Any] = {}

    def client(self, version: str = "v2") -> Any:
        """The client of API version ``version`` (``v2``; ``v2alpha1`` for best-effort)."""
        if version not in self._clients:
            with _told_apart():
                self._clients[version] = _client(version, self.endpoint)
        return self._clients[version]

    def _name(self, kind: str, name: str) -> str:
        return f"{self.parent}/{kind}/{name}"

    def node(self, name: str, *, reason: str = "") -> Node:
        """The node ``name``; its state ``GONE`` when the API answers NOT_FOUND.

        Args:
          name: the node's short name.
          reason: why it is asked (``X-Goog-Request-Reason``: audit logs show it).
        """
        metadata = [("x-goog-request-reason", reason)] if reason else []
        try:
            with _told_apart():
                n = self.client().get_node(name=self._name("nodes", name), metadata=metadata)
        except TpuApiError as e:
            if e.error.kind is pod_errors.Kind.NOT_FOUND:
                return Node(name=name, state="GONE")
            raise
        return Node(
            name=name,
            state=n.state.name,
            health=n.health.name,
            health_description=n.health_description,
            endpoints=tuple(e.ip_address for e in n.network_endpoints),
            runtime_version=n.runtime_version,
        )

    def create_node(self, name: str, spec: Spec, *, wait_s: float = 3600) -> None:
        """Creates the node ``name`` and waits (at most ``wait_s``) for its operation.

        Raises:
          TpuApiError: the call, or its operation, failed (no capacity, quota ...).
        """
        with _told_apart():
            op = self.client().create_node(parent=self.parent, node_id=name, node=spec.node())
        self._wait(op, wait_s, f"creating {name}")

    def delete_node(self, name: str, *, wait_s: float = 3600) -> bool:
        """Deletes the node ``name``, waiting (at most ``wait_s``) for its operation.

        Returns:
          False when there was no such node.
        """
        return self._delete(lambda c: c.delete_node(name=self._name("nodes", name)), name, wait_s)

    def request(self, name: str) -> Request:
        """The queued resource ``name``; its state ``GONE`` on NOT_FOUND."""
        try:
            with _told_apart():
                q = self.client().get_queued_resource(name=self._name("queuedResources", name))
        except TpuApiError as e:
            if e.error.kind is pod_errors.Kind.NOT_FOUND:
                return Request(name=name, state="GONE")
            raise
        return _request(name, q)

    def requests(self) -> list[Request]:
        """Every queued resource of the zone."""
        with _told_apart():
            found = list(self.client().list_queued_resources(parent=self.parent))
        return [_request(q.name.rsplit("/", 1)[-1], q) for q in found]

    def create_request(self, name: str, node_id: str, spec: Spec) -> None:
        """Requests the node ``node_id`` as the queued resource ``name``; waits for the
        request to be accepted (not for its slice: see ``request``)."""
        body: dict[str, Any] = {
            "tpu": {"node_spec": [{"parent": self.parent, "node_id": node_id, "node": spec.node()}]}
        }
        if spec.best_effort:
            body["best_effort"] = {}
        elif spec.spot:  # the request's tier says it, not its node
            body["spot"] = {}
            body["tpu"]["node_spec"][0]["node"].pop("scheduling_config")
        if spec.reservation:
            r = spec.reservation
            body["reservation_name"] = r if "/" in r else f"{self.parent}/reservations/{r}"
        if spec.valid_until_s:
            body["queueing_policy"] = {"valid_until_duration": {"seconds": spec.valid_until_s}}
        version = "v2alpha1" if spec.best_effort else "v2"
        with _told_apart():
            op = self.client(version).create_queued_resource(
                parent=self.parent, queued_resource_id=name, queued_resource=body
            )
        self._wait(op, 600, f"requesting {name}")

    def delete_request(self, name: str, *, wait_s: float = 3600) -> bool:
        """Deletes the queued resource ``name`` and its node (``force``), waiting (at most
        ``wait_s``) for its operation.

        Returns:
          False when there was no such request.
        """
        full = self._name("queuedResources", name)
        return self._delete(
            lambda c: c.delete_queued_resource(request={"name": full, "force": True}), name, wait_s
        )

    def _delete(self, call: Callable[[Any], Any], name: str, wait_s: float) -> bool:
        try:
            with _told_apart():
                op = call(self.client())
        except TpuApiError as e:
            if e.error.kind is pod_errors.Kind.NOT_FOUND:
                return False
            raise
        self._wait(op, wait_s, f"deleting {name}")
        return True

    def _wait(self, op: Any, wait_s: float, what: str) -> None:
        """Waits for a long-running operation: done, or ``TpuApiError`` (its error, or
        ``DEADLINE_EXCEEDED`` after ``wait_s``)."""
        end = self.clock() + wait_s
        while True:
            with _told_apart():
                if op.done():
                    op.result(timeout=0)
                    return
            if self.clock() >= end:
                line = f"{what}: its operation {op.operation.name} not done after {wait_s:.0f}s"
                raise TpuApiError(pod_errors.from_status("DEADLINE_EXCEEDED", line))
            self.sleep(self.poll_s)


def _request(name: str, q: Any) -> Request:
    state = q.state.state.name
    error = q.state.failed_data.error if state == "FAILED" else None
    return Request(
        name=name,
        state=state,
        failed_code=int(error.code) if error is not None else 0,
        failed_message=error.message if error is not None else "",
    )
