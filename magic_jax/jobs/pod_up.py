"""A slice brought up for ``tpu_scripts/launch.sh``'s supervisor, through Cloud TPU's API
(``jobs/tpu_api.py``): reused, attached to (its queued resource), or created, then waited
for until READY and healthy. A create that fails is followed as ``jobs/pod_errors.py``'s
``after_create`` says (no capacity and rate limits tried again with backoff, a delete
under way waited for, the rest fatal); a queued resource is waited for as long as it
takes (or ``timeout``), one that ends FAILED (its failedData said), SUSPENDED or gone
requested again, never past its ``--valid-until-duration``; a node under maintenance
(READY with UNHEALTHY_* health) is waited for, never deleted.

Progress is said as launch.sh's ``[launch]`` lines; an end is ``Stop``, its exit status
and last line (2 for a wait past its time). LAUNCH_CLOCK=FILE (tests) makes waits advance
a clock kept in FILE instead.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from magic_jax.jobs import pod_decide, pod_errors, tpu_api
from magic_jax.jobs.pod_errors import Kind, Then, span


class Stop(Exception):
    """The launch ends: its exit status and last line (none when already said)."""

    def __init__(self, code: int, line: str = "") -> None:
        super().__init__(line)
        self.code, self.line = code, line


class Clock:
    """Seconds as launch.sh counts them: the wall clock, or a file's (``LAUNCH_CLOCK``)
    that each wait advances instead of sleeping."""

    def __init__(self, path: str = "") -> None:
        self.path = path

    def now(self) -> int:
        if not self.path:
            return int(time.time())
        try:
            return int(open(self.path).read().strip() or 0)
        except (OSError, ValueError):
            return 0

    def nap(self, seconds: float) -> None:
        if not self.path:
            time.sleep(seconds)
            return
        later = int(self.now() + seconds)  # (read before the file is truncated)
        with open(self.path, "w") as f:
            f.write(f"{later}\n")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """launch.sh's options for bringing a slice up."""

    name: str
    zone: str
    spec: tpu_api.Spec
    queued: bool = False
    tries: int = 12
    wait_s: int = 60
    max_wait_s: int = 1800
    timeout_s: int | None = None
    poll_s: float = 10.0
    valid: str = ""
    valid_s: int = 0
    delete_wait_s: float = 1800.0

    @property
    def qr(self) -> str:
        return f"{self.name}-qr"


class Up:
    """Bringing one slice up: the state launch.sh keeps (whether a slice may exist, was
    created by this launch, when it was requested)."""

    def __init__(
        self,
        tpu: tpu_api.Tpu,
        o: Options,
        clock: Clock,
        say: Callable[[str], None],
    ) -> None:
        self.tpu, self.o, self.clock, self.say = tpu, o, clock, say
        self.have_slice = self.created = False
        self.requested_at = 0  # (a request of an earlier launch: its age unknown)
        self.asked = ""  # the last question's error, said

    # ------------------------------------------------------------------ questions
    def _fatal(self, e: tpu_api.TpuApiError) -> None:
        self.asked = e.error.say()
        if e.error.kind in (Kind.AUTH, Kind.PERMISSION):
            raise Stop(1, f"asking Cloud TPU about {self.o.name} failed: {self.asked}") from e

    def node(self, fatal: bool = True) -> tpu_api.Node:
        """The node; ``UNKNOWN`` when the question failed (credentials or a missing role
        end the launch when ``fatal``)."""
        try:
            return self.tpu.node(self.o.name)
        except tpu_api.TpuApiError as e:
            if fatal:
                self._fatal(e)
            return tpu_api.Node(name=self.o.name, state="UNKNOWN")

    def request(self, fatal: bool = True) -> tpu_api.Request:
        """The queued resource; ``UNKNOWN`` when the question failed (as ``node``)."""
        try:
            return self.tpu.request(self.o.qr)
        except tpu_api.TpuApiError as e:
            if fatal:
                self._fatal(e)
            return tpu_api.Request(name=self.o.qr, state="UNKNOWN")

    def teardown(self, quiet: bool = False) -> bool:
        """Deletes the slice (its queued resource, with its node, when there is one; one
        SUSPENDING is left to finish first); False when that failed."""
        o = self.o
        try:
            if o.queued or self.request(fatal=False).state not in ("GONE", "UNKNOWN"):
                while self.request(fatal=False).state == "SUSPENDING":
                    self.clock.nap(o.poll_s)
                self.tpu.delete_request(o.qr, wait_s=o.delete_wait_s)
            else:
                self.tpu.delete_node(o.name, wait_s=o.delete_wait_s)
            return True
        except tpu_api.TpuApiError as e:
            if not quiet:
                self.say(f"deleting {o.name} failed: {e.error.say()}")
            return False

    # ------------------------------------------------------------------ steps
    def create(self) -> None:
        """Creates the node (or requests it), tries again as ``after_create`` says."""
        o = self.o
        try_, wait = 1, o.wait_s
        self.created, self.requested_at = True, self.clock.now()
        while True:
            self.have_slice = True
            try:
                if o.queued:
                    self.say(
                        f"requesting {o.name} ({o.spec.accelerator}) as queued resource {o.qr}"
                    )
                    self.tpu.create_request(o.qr, o.name, o.spec)
                else:
                    self.say(f"creating {o.name} ({o.spec.accelerator})")
                    self.tpu.create_node(o.name, o.spec, wait_s=o.timeout_s or 3600)
                return
            except tpu_api.TpuApiError as e:
                error = e.error
            c = pod_errors.Create(
                name=o.name,
                queued=o.qr if o.queued else "",
                accelerator=o.spec.accelerator,
                zone=o.zone,
                try_=try_,
                tries=o.tries,
                wait_s=wait,
                max_wait_s=o.max_wait_s,
            )
            f = pod_errors.after_create(error, c)
            if f.then is Then.ATTACH:
                self.say(f.line)
                return
            if f.then is Then.AWAIT_GONE:
                self.say(f.line)
                self.await_gone()
                continue
            # a failed create may leave the node (or the queued resource) behind
            if o.queued or self.node(fatal=False).state not in ("GONE", "UNKNOWN"):
                self.teardown(quiet=True)
            self.have_slice = False
            if f.then is not Then.RETRY:
                raise Stop(1, f.line or f"creating {o.name} failed")
            self.say(f.line)
            self.clock.nap(f.wait_s)
            wait, try_ = f.next_wait_s, try_ + 1

    def await_gone(self) -> None:
        """Waits for the node to be gone (a delete under way), ``timeout`` [3600] s."""
        limit = self.o.timeout_s or 3600
        end = self.clock.now() + limit
        while (state := self.node().state) != "GONE":
            if self.clock.now() >= end:
                raise Stop(2, f"{self.o.name} still there ({state}) {limit}s after it was deleted")
            self.clock.nap(self.o.poll_s)

    def request_failed(self) -> None:
        """A FAILED queued resource: its failedData said; the end once its
        ``--valid-until-duration`` lapsed, or when no new request mends its error."""
        o, r = self.o, self.request(fatal=False)
        error = r.failure() if r.state == "FAILED" else None
        line = error.say() if error else "no failedData"
        self.say(f"queued resource {o.qr} FAILED: {line}")
        if o.valid_s > 0 and self.clock.now() - self.requested_at >= o.valid_s:
            raise Stop(
                1,
                f"queued resource {o.qr} FAILED after its --valid-until-duration {o.valid} "
                f"lapsed: {line}; not requested again",
            )
        if error is None or not error.retried:
            raise Stop(1, f"queued resource {o.qr} FAILED: {line}")

    def await_queued(self) -> None:
        """Waits for the queued resource to be ACTIVE, as long as it takes (or
        ``timeout``); one that ends FAILED, SUSPENDED or gone is requested again, up to
        ``tries`` times."""
        o = self.o
        started, said, polls, ended, wait = self.clock.now(), "", 0, 0, o.wait_s
        while True:
            s = self.request().state
            if s == "ACTIVE":
                return
            if s in ("FAILED", "SUSPENDED", "GONE"):
                if s == "FAILED":
                    self.request_failed()
                ended += 1
                if ended >= o.tries:
                    times = f"{ended} times (--create-tries {o.tries})"
                    raise Stop(1, f"queued resource {o.qr} ended {s} {times}")
                again = f"requesting it again in {span(wait)} ({ended} of {o.tries})"
                self.say(f"queued resource {o.qr} is {s}; {again}")
                if s != "GONE":
                    self.teardown(quiet=True)
                self.clock.nap(wait)
                wait = min(wait * 2, o.max_wait_s)
                self.create()
                said = ""
                continue
            waited = self.clock.now() - started
            if o.timeout_s is not None and waited >= o.timeout_s:
                raise Stop(2, f"queued resource {o.qr} not ACTIVE after {o.timeout_s}s ({s})")
            if s != said or polls % 60 == 0:
                self.say(f"queued resource {o.qr}: {s} (waited {span(waited)})")
            said, polls = s, polls + 1
            self.clock.nap(o.poll_s)

    def wait_ready(self, bounded: bool) -> None:
        """Waits for the node to be READY and healthy: ``timeout`` [3600] s when
        ``bounded`` (a new node, or ``--timeout``), else as long as maintenance or a
        repair takes (hours, on every host). Its state is never a reason to delete it."""
        limit = self.o.timeout_s or 3600
        deadline = self.clock.now() + limit if bounded else None
        said = ""
        while True:
            n = self.node()
            s = "" if n.state in ("GONE", "UNKNOWN") else n.state
            node = pod_decide.Slice(state=s, health=n.health)
            if node.ready():
                return
            v = (node.lost() or node.describe()) if s else "not yet"
            if s and n.health_description:
                v += f": {n.health_description}"
            if deadline is not None and self.clock.now() >= deadline:
                why = f": it is {v}" if s else f" ({self.asked})"
                raise Stop(2, f"{self.o.name} not READY after {limit}s{why}")
            if v != said:
                self.say(f"{self.o.name}: {v}")
            said = v
            self.clock.nap(self.o.poll_s)

    def bring_up(self) -> tpu_api.Node:
        """The slice READY: reused, attached to, or created, then waited for."""
        o = self.o
        self.created = False
        if o.queued:
            s = self.request().state
            if s in ("GONE", "UNKNOWN"):
                self.create()
            elif s in ("FAILED", "SUSPENDED"):
                if s == "FAILED":
                    self.request_failed()
                self.say(f"queued resource {o.qr} is {s}; deleting it to request it again")
                if not self.teardown():
                    raise Stop(1)
                self.create()
            else:
                self.say(f"attaching to queued resource {o.qr} ({s})")
                self.have_slice = True
            self.await_queued()
        else:
            state = self.node().state
            state = "" if state in ("GONE", "UNKNOWN") else state
            if state == "DELETING":
                self.say(f"{o.name} is DELETING; waiting for it to go")
                self.await_gone()
                state = ""
            elif state and pod_decide.Slice(state=state).lost():
                self.say(f"{o.name} is {state}; deleting it")
                if not self.teardown():
                    raise Stop(1)
                state = ""
            if state:
                self.say(f"reusing {o.name} ({state})")
                self.have_slice = True
            else:
                self.create()
        self.wait_ready(bounded=o.timeout_s is not None or self.created)
        return self.node()
