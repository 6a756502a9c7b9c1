"""What ``tpu_scripts/launch.sh``'s supervisor knows of its launch: the options it was
given (``Args``), its knobs (``LAUNCH_*``) and what it learnt since (``Run``: the slice,
its workers, the attempt and how it ended), with its questions to Cloud TPU through
``jobs/pod_up.py``'s ``Up`` (the client of ``jobs/tpu_api.py``, in this process) and the
lines it says. A dry run asks nothing: it prints each request as ``tpu-api VERB ...``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path
from typing import Any

from magic_jax.jobs import pod_decide, pod_up, pod_workers, tpu_api
from magic_jax.jobs.pod_up import Stop


def env_float(key: str, default: float) -> float:
    return float(os.environ.get(key) or default)


@dataclasses.dataclass(kw_only=True)
class Args:
    """launch.sh's options (its ``--help``), checked."""

    name: str = "magic-jax"
    zone: str = "us-east5-a"
    project: str = ""
    accelerator: str = "v5p-64"
    version: str = ""
    queued: bool = False
    stage: str = ""
    setup: bool = True
    logs: str = ""
    attach: bool = False
    retry: int = 0
    retry_given: bool = False
    valid: str = ""
    valid_s: int = 0
    delete_on_exit: bool = False
    delete_only: bool = False
    timeout: str = ""
    dry: bool = False
    capacity: list[str] = dataclasses.field(default_factory=list)
    vm: list[str] = dataclasses.field(default_factory=list)
    internal_ip: bool = False
    envs: list[str] = dataclasses.field(default_factory=list)
    create_tries: int = 12
    create_max_s: int = 1800
    command: list[str] = dataclasses.field(default_factory=list)
    # options as given, before they are checked as numbers
    raw: dict[str, str] = dataclasses.field(default_factory=dict)

    def spec(self) -> tpu_api.Spec:
        """The slice as Cloud TPU's API is asked for it."""
        values: dict[str, Any] = {"accelerator": self.accelerator, "runtime_version": self.version}
        for c in (*self.capacity, *self.vm):
            key, _, value = c.removeprefix("--").partition("=")
            key = key.replace("-", "_")
            if key in ("spot", "reserved", "best_effort"):
                values[key] = True
            elif key == "valid_until_duration":
                values["valid_until_s"] = self.valid_s
            else:
                values[key] = value
        if self.internal_ip:
            values["internal_ip"] = True
        return tpu_api.Spec(**values)

    def spec_words(self) -> list[str]:
        """The spec as a dry run prints it (``KEY=VALUE``)."""
        words = [f"accelerator={self.accelerator}", f"runtime-version={self.version}"]
        for c in self.capacity:
            if c in ("--spot", "--reserved", "--best-effort"):
                words.append(f"{c[2:]}=1")
            elif c.startswith("--reservation="):
                words.append(f"reservation={c.partition('=')[2]}")
            elif c.startswith("--valid-until-duration="):
                words.append(f"valid-until-s={self.valid_s}")
        words += [c[2:] for c in self.vm]
        return words + (["internal-ip=1"] if self.internal_ip else [])


class Run:
    """One launch's supervisor state (launch.sh's globals) and its questions to Cloud TPU.

    Besides the knobs launch.sh's header documents: ``LAUNCH_DELETE_WAIT_S`` [1800], the
    longest wait for a delete; ``LAUNCH_CREATE_BACKOFF_S`` [60], the first wait after a
    create that found no capacity; ``LAUNCH_LEASE_CYCLES`` [6], the status cycles after
    which an unrenewed lease is stale (at least 60 s); ``LAUNCH_API_POLL_S`` [5], the wait
    between questions about an operation; ``LAUNCH_CLOCK`` (tests), a file whose clock
    the waits between retries advance instead of sleeping.
    """

    def __init__(self, a: Args, repo: Path, project: str) -> None:
        self.a, self.repo, self.project = a, repo, project
        self.poll_s = env_float("LAUNCH_POLL_S", 10)
        self.grace_s = os.environ.get("LAUNCH_GRACE_S") or "120"
        self.kill_s = int(env_float("LAUNCH_KILL_S", 30))
        self.ssh_wait_s = int(env_float("LAUNCH_SSH_BACKOFF_S", 30))
        self.ssh_max_s = int(env_float("LAUNCH_SSH_BACKOFF_MAX_S", 300))
        self.lost_ms = int(env_float("LAUNCH_LOST_S", 20) * 1000)
        self.probe_ms = int(env_float("LAUNCH_PROBE_S", 15) * 1000)
        self.beat_s = os.environ.get("LAUNCH_HEARTBEAT_S") or "10"
        self.delete_wait_s = env_float("LAUNCH_DELETE_WAIT_S", 1800)
        slow = int(self.poll_s) >= 5  # worker-side waits of the log stream
        self.tick, self.flush = ("5", "2") if slow else ("0.2", "0.5")
        self.clock = pod_up.Clock(os.environ.get("LAUNCH_CLOCK", ""))
        self.ssh = pod_workers.Workers(
            name=a.name,
            where=("--zone", a.zone, *(("--project", a.project) if a.project else ())),
            via=("--internal-ip",) if a.internal_ip else (),
            connect_s=os.environ.get("LAUNCH_SSH_CONNECT_S") or "10",
            ask_s=env_float("LAUNCH_SSH_DEADLINE_S", 120),
            fanout=int(env_float("LAUNCH_SSH_FANOUT", 16)),
            dry=a.dry,
        )
        api_poll = env_float("LAUNCH_API_POLL_S", 5)
        self.tpu = tpu_api.Tpu(project or "PROJECT", a.zone, poll_s=api_poll)
        self.up = pod_up.Up(self.tpu, self.options(), self.clock, self.say)
        # the launch
        self.stage, self.retry, self.attempt = a.stage, a.retry, 1
        self.attempts = a.retry + 1
        self.workers, self.ips, self.runtime = 0, "", ""
        self.created = self.running = False
        self.commit = self.dir = self.run_dir = self.run_id = self.logs = self.body = ""
        self.log = self.beats = self.said_to = self.lease = self.setup_err = ""
        self.stream: subprocess.Popen[Any] | None = None
        self.new_attempt()

    def options(self) -> pod_up.Options:
        a = self.a
        return pod_up.Options(
            name=a.name,
            zone=a.zone,
            spec=a.spec(),
            queued=a.queued,
            tries=a.create_tries,
            wait_s=int(env_float("LAUNCH_CREATE_BACKOFF_S", 60)),
            max_wait_s=a.create_max_s,
            timeout_s=int(a.timeout) if a.timeout else None,
            poll_s=self.poll_s,
            valid=a.valid,
            valid_s=a.valid_s,
            delete_wait_s=self.delete_wait_s,
        )

    def new_attempt(self) -> None:
        """How an attempt ended, not known yet."""
        self.lost = self.state = self.failed_status = self.beats_said = ""
        self.status = "0"
        self.failed: int | None = None
        self.stopped: list[int] = []
        self.restarted: list[int] = []
        self.gone_hosts: set[int] = set()
        self.kind = "preempted"

    # ------------------------------------------------------------------ lines
    @staticmethod
    def say(line: str) -> None:
        pod_workers.stderr_line(f"[launch] {line}")

    @staticmethod
    def note(line: str) -> None:
        pod_workers.stderr_line(f"launch.sh: {line}")

    def api_line(self, *words: str) -> None:
        """A dry run's request, ``tpu-api VERB ...``."""
        print("tpu-api" + "".join(f" {w}" for w in pod_workers.bash_quote(words)), flush=True)

    @property
    def qr(self) -> str:
        return f"{self.a.name}-qr"

    @property
    def have_slice(self) -> bool:
        return self.up.have_slice

    @have_slice.setter
    def have_slice(self, value: bool) -> None:
        self.up.have_slice = value

    # ------------------------------------------------------------------ Cloud TPU
    def slice_lost(self) -> bool:
        """Whether the slice is lost: preempted, terminated or gone, or its queued
        resource suspended or failed (one SUSPENDING is not yet). Sets ``lost`` to why, or
        ``state`` to the node's state; credentials or a missing role end the launch."""
        self.lost = self.state = ""
        if self.a.dry:
            return False
        request = ""
        if self.a.queued:
            request = self.up.request().state
            if pod_decide.Slice(state="", request=request).lost():
                self.lost = f"queued resource {self.qr} is {request}"
                return True
        state = self.up.node().state
        if state != "READY" and pod_decide.Slice(state=state, request=request).lost():
            self.lost = f"{self.a.name} is {state}"
            return True
        self.state = state
        return False

    def slice_up(self, verb: str = "up") -> None:
        """The slice READY (``wait-ready``: only waited for), its workers counted."""
        up = self.up
        if verb == "wait-ready":
            up.wait_ready(bounded=self.a.timeout != "")
            node = up.node()
        else:
            up.have_slice = True  # (a create in flight: --delete-on-exit deletes it)
            node = up.bring_up()
            self.created = up.created
        self.ips = ";".join(node.endpoints)
        self.runtime = node.runtime_version

    def bring_up(self) -> None:
        """The slice READY (a dry run prints its requests), its workers counted."""
        self.created = False
        a = self.a
        if a.dry:
            if a.queued:
                self.api_line("request", self.qr)
                self.api_line("request-create", self.qr, a.name, *a.spec_words())
            else:
                self.api_line("node", a.name)
                self.api_line("create", a.name, *a.spec_words())
            self.api_line("node", a.name)
            self.have_slice, self.created = True, True
            self.ips, self.runtime = "10.0.0.1", a.version
        else:
            self.slice_up()
        self.workers = len([x for x in self.ips.replace(",", ";").split(";") if x.strip()])
        self.say(f"{a.name}: {self.workers} worker(s), runtime version {self.runtime or 'unknown'}")

    def teardown(self) -> bool:
        """Deletes the slice (its queued resource with its node, else the node)."""
        a = self.a
        if a.dry:
            if not a.queued:
                self.api_line("request", self.qr)
            self.api_line(
                *(("request-delete", self.qr) if a.queued else ("delete", a.name)),
                f"wait-s={self.delete_wait_s:g}",
            )
            return True
        return self.up.teardown()


__all__ = ["Args", "Run", "Stop"]
