"""What a pod run's supervisor does next, from what Cloud TPU says of the slice (the
node's state and health, its queued resource's state) and what the workers say (their
heartbeats, and their answers when asked): carry on, wait, ask the silent workers,
rerun on the same slice, recreate it, or stop the job. Pure: ``tpu_scripts/launch.sh``'s
supervisor (``jobs/pod_watch.py``, ``jobs/pod_run.py``) feeds it.

Health is part of the state: a READY node whose health is UNHEALTHY_* (maintenance,
the in-guest stack) or TIMEOUT is not ready. Maintenance covers every VM of a slice and
may last hours; its hosts neither beat nor answer meanwhile, and nothing is concluded
from that: the supervisor waits, asks no worker, deletes nothing, and once the node is
READY and healthy again a command gone from a restarted host is rerun on the same slice.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence

from magic_jax.jobs.restarts import PREEMPTED_EXIT_CODE, restarts

# Node.State (google.cloud.tpu_v2): a slice in one of these is gone for good; GONE is
# the API's NOT_FOUND. DELETING: someone deletes it. Every other state but READY (CREATING,
# RESTARTING, REIMAGING, REPAIRING, STOPPING, STOPPED, STARTING, HIDING, HIDDEN,
# UNHIDING, UNKNOWN, STATE_UNSPECIFIED) is waited for.
LOST_NODE_STATES = frozenset({"PREEMPTED", "TERMINATED", "DELETING", "GONE"})
# Node.Health: what is not one of these is not ready (TIMEOUT, UNHEALTHY_TENSORFLOW,
# UNHEALTHY_MAINTENANCE); an unset health says nothing against a READY node.
HEALTHY = frozenset({"HEALTHY", "HEALTH_UNSPECIFIED", ""})
# QueuedResourceState.State: the slice of a request in one of these is gone; SUSPENDING
# (its VMs being deleted) is waited for until it is SUSPENDED.
LOST_REQUEST_STATES = frozenset({"FAILED", "SUSPENDED", "GONE"})
# a worker's command stopped by the user or on SIGTERM: left to worker 0's status
ENDED_WELL = frozenset({"0", "130", "143"})


class Action(enum.Enum):
    """What the supervisor does next."""

    CARRY_ON = "carry-on"  # all well: poll again
    WAIT = "wait"  # the slice is not ready (maintenance, repair): poll again, ask no worker
    PROBE = "probe"  # ask the silent workers (``Decision.workers``) once
    RERUN = "rerun"  # hosts restarted under the command: run it again on this slice
    RECREATE = "recreate"  # the slice is lost: a new one
    STOP = "stop"  # a worker failed while worker 0 ran: stop the job


@dataclasses.dataclass(frozen=True, kw_only=True)
class Slice:
    """What Cloud TPU says of the slice.

    Attributes:
      state: the node's ``state`` (``READY``, ``REPAIRING`` ...), ``GONE`` when the API
        answers NOT_FOUND, ``""`` when it could not be asked.
      health: the node's ``health`` (``HEALTHY``, ``UNHEALTHY_MAINTENANCE`` ...).
      request: the queued resource's ``state.state``, ``""`` without one.
    """

    state: str
    health: str = ""
    request: str = ""

    def lost(self) -> str:
        """Why the slice is gone for good, or ``""``."""
        if self.request in LOST_REQUEST_STATES:
            return f"its queued resource is {self.request}"
        if self.state in LOST_NODE_STATES:
            return f"it is {self.state}"
        return ""

    def ready(self) -> bool:
        """READY and healthy: its workers can be asked, their silence means something."""
        ready = self.state == "READY" and self.health in HEALTHY
        return ready and self.request in ("", "ACTIVE")

    def describe(self) -> str:
        """``READY (UNHEALTHY_MAINTENANCE)``, with the request's state when there is one."""
        text = self.state or "not known"
        if self.health not in HEALTHY:
            text += f" ({self.health})"
        if self.request:
            text += f", queued resource {self.request}"
        return text


@dataclasses.dataclass(frozen=True, kw_only=True)
class Worker:
    """What one worker says of its command, by heartbeat or by answer.

    Attributes:
      index: the worker number.
      status: ``running``, its exit status (``"0"``, ``"86"``), ``gone`` (no status, no
        process) or ``""`` (nothing heard).
      silent_s: seconds since its heartbeat last changed; 0 once its command ended.
      restarted: its host booted since the command started.
    """

    index: int
    status: str
    silent_s: float = 0.0
    restarted: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
    """The next step and why.

    Attributes:
      action: what to do.
      why: one line for the user.
      workers: the workers it is about (those to ask, restarted, failed, or lost).
      status: with ``STOP``, the failed worker's exit status (``gone``: none).
      alive: after a probe, workers that answer though their heartbeats are old.
    """

    action: Action
    why: str = ""
    workers: tuple[int, ...] = ()
    status: str = ""
    alive: tuple[int, ...] = ()


def _from_status(workers: Sequence[Worker]) -> Decision | None:
    """A verdict from the workers' own statuses: a restarted host, or a failure."""
    restarted = tuple(w.index for w in workers if w.status == "gone" and w.restarted)
    if restarted:
        why = "maintenance restarted the host of worker(s) " + " ".join(map(str, restarted))
        return Decision(action=Action.RERUN, why=why, workers=restarted)
    for w in workers:
        if w.index != 0 and w.status not in ("running", "", *ENDED_WELL):
            why = f"worker {w.index} ended with {w.status} while worker 0's command still ran"
            return Decision(action=Action.STOP, why=why, workers=(w.index,), status=w.status)
    return None


def decide(
    node: Slice,
    workers: Sequence[Worker],
    *,
    lost_after_s: float,
    answers: Mapping[int, Worker] | None = None,
) -> Decision:
    """The supervisor's next step while the command runs.

    Args:
      node: what Cloud TPU says of the slice.
      workers: every worker's heartbeat (or answer), as seen this cycle.
      lost_after_s: a worker silent this long, on a ready slice, is asked.
      answers: the answers of the workers asked (``PROBE``), by index; ``None`` when
        none was asked this cycle. A silent worker without an answer is a host lost.

    Returns:
      The decision; ``RECREATE`` for a lost slice or host, ``WAIT`` for a slice that is
      not ready (never a probe, never a verdict from silence then).
    """
    lost = node.lost()
    if lost:
        return Decision(action=Action.RECREATE, why=f"the slice is lost: {lost}")
    heard = _from_status(workers)
    if heard:
        return heard
    if not node.ready():
        return Decision(action=Action.WAIT, why=f"the slice is {node.describe()}: waiting for it")
    silent = tuple(w.index for w in workers if w.status == "running" and w.silent_s >= lost_after_s)
    if not silent:
        return Decision(action=Action.CARRY_ON)
    if answers is None:
        return Decision(action=Action.PROBE, why="silent worker(s)", workers=silent)
    for w in silent:
        if w not in answers:
            quiet = next(x.silent_s for x in workers if x.index == w)
            why = f"a host lost: worker {w} stopped answering (no heartbeat for {quiet:.0f}s)"
            return Decision(action=Action.RECREATE, why=why, workers=(w,))
    heard = _from_status([answers[w] for w in silent])
    if heard:
        return heard
    return Decision(action=Action.CARRY_ON, alive=silent)


def after_exit(status: str) -> Action:
    """What follows worker 0's command ending (or a failed job stopped) with ``status``.

    Args:
      status: the exit status; ``gone``/``""`` when there is none.

    Returns:
      ``CARRY_ON`` (done: 0), ``RECREATE`` (143: stopped on SIGTERM, as a preemption
      does), ``RERUN`` (another status of ``jobs/restarts.py``'s list, on the same
      slice, as a GKE JobSet restarts its pods on the same node pool) or ``STOP``.
    """
    if status == "0":
        return Action.CARRY_ON
    if status == str(PREEMPTED_EXIT_CODE):
        return Action.RECREATE
    return Action.RERUN if restarts(status) else Action.STOP


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outcome:
    """How one attempt of the command ended, as the supervisor saw it.

    Attributes:
      status: worker 0's exit status (``"0"``, ``"143"`` ...).
      restarted: workers whose host maintenance restarted under the command.
      failed: the worker whose failure stopped the job while worker 0's ran, or ``None``.
      failed_status: that worker's exit status.
      stopped: workers still running the grace period after worker 0's ended, stopped.
      lost: why the slice was lost (preempted, gone, a host lost), ``""`` if it was not.
      kind: what the loss is called (``preempted``, ``a host lost``).
    """

    status: str = "0"
    restarted: tuple[int, ...] = ()
    failed: int | None = None
    failed_status: str = ""
    stopped: tuple[int, ...] = ()
    lost: str = ""
    kind: str = "preempted"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Next:
    """What follows an attempt: ``RERUN`` (on the same slice), ``RECREATE`` (a new
    slice), or ``STOP`` (exit with ``code``; ``line`` is the last word, none when the
    command simply ended)."""

    action: Action
    code: int = 0
    line: str = ""


def _workers(ws: tuple[int, ...]) -> str:
    return "".join(f" {w}" for w in ws)


def after_attempt(
    o: Outcome, *, attempt: int, retry: int, name: str, logs: str, grace_s: str
) -> Next:
    """The supervisor's verdict once an attempt of the command ended.

    Maintenance reruns on the same slice; so does a status of ``jobs/restarts.py``'s
    list (as a GKE JobSet restarts); a failure elsewhere stops the job; a lost slice (or
    worker 0 stopped with 143, as a preemption stops it) is recreated. A rerun or a new
    slice needs a retry left (``retry``, counted over attempts).

    Args:
      o: how the attempt ended.
      attempt: its number, from 1.
      retry: the ``--retry`` budget.
      name: the slice's name.
      logs: where the logs were collected.
      grace_s: how long other workers may run after worker 0's command ended.

    Returns:
      The verdict, with the line the user sees (none when the command simply ended).
    """
    attempts = retry + 1
    left = attempt < attempts
    at = f"attempt {attempt} of {attempts}"
    none_left = f"no retries left (--retry {retry})"
    if o.restarted:
        why = f"maintenance restarted the host of worker(s){_workers(o.restarted)} under the"
        why += " command (its boot id changed)"
        if not left:
            return Next(
                action=Action.STOP, code=143, line=f"{why}; {at}, {none_left}, exiting with 143"
            )
        return Next(action=Action.RERUN, line=f"{why}; rerunning it on {name} once READY ({at})")
    why, status = f"worker 0 exited with {o.status}", o.status
    if o.failed is not None:
        why = f"worker {o.failed} failed (exit {o.failed_status}) while worker 0 still ran; the"
        why += f" command was stopped on every worker (logs: {logs})"
        status = o.failed_status
    code = int(status) if status.isdigit() else 1
    if not o.lost and after_exit(status) is Action.RERUN:
        if not left:
            return Next(action=Action.STOP, code=code, line=f"{why}; {at}, {none_left}")
        line = f"{why}, a status that restarts; rerunning it on {name} ({at})"
        return Next(action=Action.RERUN, line=line)
    if o.failed is not None:  # a failure, not a preemption: no retry
        return Next(action=Action.STOP, code=code, line=why)
    if o.stopped and o.status == "0":
        line = f"worker(s){_workers(o.stopped)} still ran {grace_s}s after worker 0 ended;"
        return Next(action=Action.STOP, code=1, line=f"{line} stopped (logs: {logs})")
    lost = o.lost or ("worker 0 stopped with 143" if o.status == str(PREEMPTED_EXIT_CODE) else "")
    if not lost:
        return Next(action=Action.STOP, code=code)
    if not left:
        line = f"{o.kind} ({lost}; {at}); {none_left}, exiting with 143"
        return Next(action=Action.STOP, code=143, line=line)
    return Next(
        action=Action.RECREATE, code=143, line=f"{o.kind} ({lost}; {at}); recreating the slice"
    )
