"""Cloud TPU's API as tests/launch_test.py's scenarios script it: tests/fake_tpu_api.py's
REST fake with its state in the stub's files ($STUB_DIR: ``created``, ``qr``, ``polls``
...), which the stub `gcloud`'s ssh and storage read and write too, and its knobs the
stub's ($STUB_*, in this process's environment).

launch.sh runs it as its Python (LAUNCH_API_PYTHON): ``python launch_api.py -m
magic_jax.jobs.launch ARGS`` starts the fake in this process, points
MAGIC_JAX_TPU_API_ENDPOINT at it and runs the supervisor (jobs/launch.py), which talks to
it through the real client over HTTP. Every call is recorded in $STUB_DIR/calls as
``api VERB NAME``.
"""

from __future__ import annotations

import fcntl
import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import fake_tpu_api as f

RUNTIME = "v2-alpha-tpuv5"
# the errors STUB_CREATE_ERRORS names, as the API returns them
NAMED = {
    "internal": f.INTERNAL,
    "rate": f.RATE_LIMIT,
    "quota": f.QUOTA,
    "no_capacity": f.STOCKOUT,
    "reauth": f.UNAUTHENTICATED,
}


def _ms() -> int:
    return int(time.time() * 1000)


class StubApi(f.FakeTpuApi):
    """The fake, its nodes and requests in $STUB_DIR's files."""

    def __init__(self, state: Path, env: dict[str, str]) -> None:
        super().__init__(hosts=int(env.get("STUB_WORKERS", "2")))
        self.dir, self.env = state, env

    # ------------------------------------------------------------------ files
    def _p(self, name: str) -> Path:
        return self.dir / name

    def _read(self, name: str) -> str:
        try:
            return self._p(name).read_text().strip()
        except FileNotFoundError:
            return ""

    def _lines(self, name: str) -> int:
        try:
            return self._p(name).read_text().count("\n")
        except FileNotFoundError:
            return 0

    def _add_line(self, name: str) -> int:
        with self._p(name).open("a") as out:
            out.write("\n")
        return self._lines(name)

    def _countdown(self, name: str) -> int:
        left = int(self._read(name) or 0) - 1
        self._p(name).write_text(f"{left}\n")
        return left

    def _hook(self, what: str) -> None:  # the stub's own: VMs stopped, new disks
        subprocess.run(["gcloud", "__hook", what], env=self.env, check=False)

    def _record(self, verb: str, name: str) -> None:
        self.calls.append((verb, name))
        if verb == "get-op":  # (an operation asked until done: no call of launch.sh's)
            return
        with (self.dir / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            with self._p("calls").open("a") as out:
                out.write("\x1f".join(("api", verb, name)) + "\x1f\x1e")
            with self._p("times").open("a") as out:
                out.write(f"{_ms()}\n")

    def _in_maint(self) -> bool:
        until = self._read("maint-until")
        return bool(until) and _ms() < int(until)

    def _env(self, key: str) -> str:
        return self.env.get(key, "")

    # ------------------------------------------------------------------ the API
    def handle(self, method, path, body, reason=""):
        if method == "POST":  # what reached the API: its path (zone, id) and body
            with self._p("posts").open("a") as out:
                out.write(json.dumps({"path": path, "body": body}) + "\n")
        if self._p("auth-expired").exists():
            self._record("denied", path.rsplit("/", 1)[-1])
            return 401, f.UNAUTHENTICATED.body()
        return super().handle(method, path, body, reason)

    def _node_out(self, name: str, state: str, health: str) -> dict:
        out = {
            "name": f"{self.parent}/nodes/{name}",
            "state": state,
            "health": health,
            "runtimeVersion": RUNTIME,
            "acceleratorType": "v5p-64",
            "networkEndpoints": [{"ipAddress": f"10.0.0.{i + 1}"} for i in range(self.hosts)],
        }
        if health != "HEALTHY":
            out["healthDescription"] = "The TPU is undergoing maintenance."
        return out

    def _get_node(self, name, body, error, version):
        if not self._p("created").exists():
            return self._missing("nodes", name)
        polled = self.calls[-1][0] == "poll-node"
        k = self._add_line("polls") if polled else self._lines("polls")
        auth_at = self._env("STUB_AUTH_AT")
        if auth_at and k >= int(auth_at):
            self._p("auth-expired").touch()
            return 401, f.UNAUTHENTICATED.body()
        maint_at = self._env("STUB_MAINT_AT")
        if maint_at and not self._p("maint-until").exists() and k >= int(maint_at):
            self._p("maint-until").write_text(f"{_ms() + int(self._env('STUB_MAINT_MS'))}\n")
            self._p("maint-seq").write_text(f"{k}\n")
        if self._read("created") == "DELETING" and self._countdown("deleting") <= 0:
            self._p("created").unlink()
            return self._missing("nodes", name)
        if self._read("created") == "REPAIRING" and self._countdown("repair") <= 0:
            self._p("created").write_text("")
        state = self._read("created") or "READY"
        health = "HEALTHY"
        if state == "REPAIRING" or self._in_maint():
            health = "UNHEALTHY_MAINTENANCE"
        if self._read("unhealthy"):
            health = "UNHEALTHY_MAINTENANCE"
            if self._countdown("unhealthy") <= 0:
                self._p("unhealthy").unlink()
        return 200, self._node_out(name, state, health)

    def _create_error(self) -> f.Error | None:
        """The error create K (from 1) meets, if any, as the stub's knobs say."""
        k = self._add_line("creates")
        if self._p("silent-at").exists():  # a new slice after a host was lost: all answer
            for p in self.dir.glob("silent-[0-9]*"):
                p.unlink()
            self._p("down").touch()
        if self._env("STUB_QUOTA"):
            return f.QUOTA
        named = self._env("STUB_CREATE_ERRORS").split()
        if len(named) >= k and named[k - 1] != "ok":
            if named[k - 1] == "exists":
                message = f"Resource '{self.parent}/nodes/magic-jax' already exists"
                return f.Error("ALREADY_EXISTS", message)
            return NAMED[named[k - 1]]
        no_capacity = f" {self._env('STUB_NO_CAPACITY')} "
        if f" {k} " in no_capacity or " all " in no_capacity:
            return f.STOCKOUT
        if self._env("STUB_CREATE_ERROR"):
            status, _, message = self._env("STUB_CREATE_ERROR").partition(": ")
            return f.Error(status if status in f.HTTP else "INVALID_ARGUMENT", message)
        return None

    def _created(self, version: str) -> tuple[int, dict]:
        """The node made (READY once its create's STUB_CREATE_S seconds passed)."""
        self._p("created").write_text("")
        if self._env("STUB_FAITHFUL"):
            self._hook("new_disks")
        took = float(self._env("STUB_CREATE_S") or 0)
        if took:  # (the create's operation takes that long: $STUB_DIR/creating meanwhile)
            self._p("creating").touch()
        response = {"@type": f"type.googleapis.com/google.cloud.tpu.{version}.Node"}
        return 200, self._op(self.now() + took, response)

    def _fail(self, error: f.Error, version: str) -> tuple[int, dict]:
        if not error.in_operation:
            return f.HTTP[error.status], error.body()
        response = {"@type": f"type.googleapis.com/google.cloud.tpu.{version}.Node"}
        return 200, self._op(self.now(), response, error)

    def _create_node(self, name, body, error, version):
        if self._p("created").exists():  # a delete still under way
            message = f"Resource '{self.parent}/nodes/{name}' already exists"
            return 409, f.Error("ALREADY_EXISTS", message).body()
        error = self._create_error()
        return self._fail(error, version) if error else self._created(version)

    def _create_qr(self, name, body, error, version):
        if self._p("qr").exists():
            message = f"Resource '{self.parent}/queuedResources/{name}' already exists"
            return 409, f.Error("ALREADY_EXISTS", message).body()
        error = self._create_error()
        if error:
            return self._fail(error, version)
        if self._env("STUB_QR_WAIT"):  # waits STUB_QR_WAIT polls for capacity
            self._p("qr").write_text("WAITING_FOR_RESOURCES\n")
            response = {"@type": f"type.googleapis.com/google.cloud.tpu.{version}.QueuedResource"}
            return 200, self._op(self.now(), response)
        self._p("qr").write_text("ACTIVE\n")
        self._created(version)
        response = {"@type": f"type.googleapis.com/google.cloud.tpu.{version}.QueuedResource"}
        return 200, self._op(self.now(), response)

    def _get_qr(self, name, body, error, version):
        if not self._p("qr").exists():
            return self._missing("queuedResources", name)
        if self._read("qr") == "SUSPENDING" and self._countdown("suspending") <= 0:
            self._p("qr").write_text("SUSPENDED\n")
        if self._read("qr") == "WAITING_FOR_RESOURCES":
            k = self._add_line("qr-polls")
            if str(k) == self._env("STUB_QR_AUTH_AT"):
                self._p("auth-expired").touch()
                return 401, f.UNAUTHENTICATED.body()
            if str(k) == self._env("STUB_QR_FAIL_AT"):
                self._p("qr").write_text("FAILED\n")
            elif str(k) == self._env("STUB_QR_HANG_AT"):
                self._p("qr-hang").touch()
                time.sleep(60)
            elif k >= int(self._env("STUB_QR_WAIT") or 0):
                self._p("qr").write_text("ACTIVE\n")
                self._p("created").write_text("")
        state: dict = {"state": self._read("qr")}
        if state["state"] == "FAILED":
            code = int(self._env("STUB_QR_FAILED_CODE") or 8)
            why = self._env("STUB_QR_FAILED_WHY") or f.STOCKOUT.message
            state["failedData"] = {"error": {"code": code, "message": why}}
        return 200, {"name": f"{self.parent}/queuedResources/{name}", "state": state}

    def _delete_node(self, name, body, error, version):
        if not self._p("created").exists():
            return self._missing("nodes", name)
        self._hook("stop_vms")
        empty = {"@type": "type.googleapis.com/google.protobuf.Empty"}
        if self._env("STUB_STUCK_DELETE") and not self._p("stuck").exists():
            # the delete's operation never ends; the node says DELETING for a while
            self._p("stuck").touch()
            self._p("created").write_text("DELETING\n")
            self._p("deleting").write_text(self._env("STUB_STUCK_DELETE") + "\n")
            return 200, self._op(self.now() + 10**9, empty)
        self._p("created").unlink()
        self._p("qr").unlink(missing_ok=True)
        return 200, self._op(self.now(), empty)

    def _delete_qr(self, name, body, error, version):
        if not self._p("qr").exists():
            return self._missing("queuedResources", name)
        self._hook("stop_vms")
        if self._read("qr") == "SUSPENDING":  # a force-delete mid-suspend
            self._p("forced").touch()
        self._p("created").unlink(missing_ok=True)
        self._p("qr").unlink()
        return 200, self._op(self.now(), {"@type": "type.googleapis.com/google.protobuf.Empty"})

    def _get_op(self, name, body, error, version):
        out = super()._get_op(name, body, error, version)
        if out[1].get("done"):
            self._p("creating").unlink(missing_ok=True)
        return out


# what the bucket answers a caller without the role to list it (the JSON API's words)
DENIED = (
    "run@p.iam.gserviceaccount.com does not have storage.objects.list access to the Google"
    " Cloud Storage bucket. Permission 'storage.objects.list' denied on resource (or it may"
    " not exist)."
)


def stage_on_disk(fake: StubApi) -> None:
    """The stage as the stub keeps it: jobs/pod_stage.py's reads of ``gs://B/K`` read the
    directory ``$STUB_DIR/gcs/B/K`` (its local branch), each recorded as ``api read-beats``
    or ``api read-logs``. The recording stub's heartbeats are written first (its hook
    ``beats``); with $STUB_BEATS_DENIED the bucket refuses, as the client raises it."""
    from google.api_core import exceptions

    from magic_jax.jobs import pod_lease, pod_stage

    local, env = pod_stage.objects, fake.env

    def objects(prefix, pick=bool):
        what = "read-logs" if "/logs/" in prefix else "read-beats"
        fake._record(what, prefix.rsplit("/", 1)[-1])
        if what == "read-beats" and env.get("STUB_BEATS_DENIED"):
            url = f"https://storage.googleapis.com/storage/v1/b/b/o?prefix={prefix}"
            raise exceptions.Forbidden(f"GET {url}: {DENIED}")
        if what == "read-beats" and not env.get("STUB_FAITHFUL"):
            subprocess.run(["gcloud", "__hook", "beats", prefix], env=env, check=False)
        return local(on_disk(prefix), pick)

    pod_stage.objects = objects
    for name in ("read_record", "write_record", "drop_record"):  # the supervisors' leases
        real = getattr(pod_lease, name)
        setattr(pod_lease, name, lambda uri, *a, _real=real: _real(on_disk(uri), *a))


def on_disk(uri: str) -> str:
    """Where the stub keeps ``gs://B/K``: ``$STUB_DIR/gcs/B/K`` (a local path as it is)."""
    if not uri.startswith("gs://"):
        return uri
    return str(Path(os.environ["STUB_DIR"]) / "gcs" / uri.removeprefix("gs://"))


def main() -> None:
    """``launch_api.py -m MODULE ARGS``: the fake up, the stage on disk, then MODULE run as
    ``__main__``; ``-c CODE`` (launch.sh's check of the Python's version) runs CODE."""
    if sys.argv[1] == "-c":
        exec(sys.argv[2], {"__name__": "__main__"})
        return
    assert sys.argv[1] == "-m", sys.argv
    module, args = sys.argv[2], sys.argv[3:]
    fake = StubApi(Path(os.environ["STUB_DIR"]), dict(os.environ))
    stage_on_disk(fake)
    os.environ["MAGIC_JAX_TPU_API_ENDPOINT"] = fake.start()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
