"""The pod supervisor's decisions (``jobs/pod_decide.py``) as a function of the node's
state and health, its queued resource's state and the workers' heartbeats and answers;
the one restart list GKE and ``launch.sh`` share (``jobs/restarts.py``); and
that the supervisor imports no JAX."""

import subprocess
import sys
from pathlib import Path

import pytest

from magic_jax.jobs import gke, restarts
from magic_jax.jobs.pod_decide import (
    Action,
    Outcome,
    Slice,
    Worker,
    after_attempt,
    after_exit,
    decide,
)

ROOT = Path(__file__).resolve().parents[1]
READY = Slice(state="READY", health="HEALTHY")


def _workers(*statuses, silent=(), restarted=()):
    return [
        Worker(index=i, status=s, silent_s=600.0 if i in silent else 1.0, restarted=i in restarted)
        for i, s in enumerate(statuses)
    ]


def test_all_well_carries_on():
    assert decide(READY, _workers("running", "running"), lost_after_s=20).action is Action.CARRY_ON


@pytest.mark.parametrize(
    "node",
    [
        Slice(state="READY", health="UNHEALTHY_MAINTENANCE"),
        Slice(state="READY", health="TIMEOUT"),
        Slice(state="READY", health="UNHEALTHY_TENSORFLOW"),
        Slice(state="REPAIRING", health="UNHEALTHY_MAINTENANCE"),
        Slice(state="RESTARTING"),
        Slice(state="READY", health="HEALTHY", request="SUSPENDING"),
        Slice(state=""),  # the API could not be asked
    ],
)
def test_a_slice_not_ready_is_waited_for_whatever_the_silence(node):
    """Maintenance as Cloud TPU reports it (READY + UNHEALTHY_MAINTENANCE, every host
    silent for hours): wait; never a probe, never a lost host."""
    silent = _workers("running", "running", silent=(0, 1))
    d = decide(node, silent, lost_after_s=20)
    assert d.action is Action.WAIT and "waiting" in d.why
    d = decide(node, silent, lost_after_s=20, answers={})  # nobody answers: still a wait
    assert d.action is Action.WAIT


@pytest.mark.parametrize(
    "node, why",
    [
        (Slice(state="PREEMPTED"), "it is PREEMPTED"),
        (Slice(state="TERMINATED"), "it is TERMINATED"),
        (Slice(state="GONE"), "it is GONE"),
        (Slice(state="READY", request="SUSPENDED"), "queued resource is SUSPENDED"),
        (Slice(state="GONE", request="FAILED"), "queued resource is FAILED"),
    ],
)
def test_a_lost_slice_is_recreated(node, why):
    d = decide(node, _workers("running", "running"), lost_after_s=20)
    assert d.action is Action.RECREATE and why in d.why


def test_silent_workers_on_a_ready_slice_are_asked_then_judged():
    workers = _workers("running", "running", "running", silent=(1, 2))
    d = decide(READY, workers, lost_after_s=20)
    assert d.action is Action.PROBE and d.workers == (1, 2)
    # worker 2 does not answer: a host lost
    answers = {1: Worker(index=1, status="running")}
    d = decide(READY, workers, lost_after_s=20, answers=answers)
    assert d.action is Action.RECREATE and d.workers == (2,) and "a host lost" in d.why
    # both answer, running: their heartbeats do not reach the bucket
    answers[2] = Worker(index=2, status="running")
    d = decide(READY, workers, lost_after_s=20, answers=answers)
    assert d.action is Action.CARRY_ON and d.alive == (1, 2)
    # one answers that its host booted since: maintenance, rerun on this slice
    answers[2] = Worker(index=2, status="gone", restarted=True)
    d = decide(READY, workers, lost_after_s=20, answers=answers)
    assert d.action is Action.RERUN and d.workers == (2,)
    # its command gone from a host that did not restart: the job failed
    answers[2] = Worker(index=2, status="gone")
    d = decide(READY, workers, lost_after_s=20, answers=answers)
    assert (d.action, d.workers, d.status) == (Action.STOP, (2,), "gone")


def test_maintenance_over_then_the_restarted_hosts_rerun_on_the_same_slice():
    """The node back READY and healthy after hours: the workers' commands are gone from
    restarted hosts, a rerun on this slice (no recreate)."""
    workers = _workers("running", "running", silent=(0, 1))
    answers = {i: Worker(index=i, status="gone", restarted=True) for i in (0, 1)}
    d = decide(READY, workers, lost_after_s=20, answers=answers)
    assert d.action is Action.RERUN and d.workers == (0, 1)


@pytest.mark.parametrize("status", ["9", "86", "gone"])
def test_another_worker_failing_stops_the_job(status):
    d = decide(READY, _workers("running", status), lost_after_s=20)
    assert (d.action, d.workers, d.status) == (Action.STOP, (1,), status)


@pytest.mark.parametrize("status", ["0", "130", "143"])
def test_a_stop_or_success_elsewhere_is_left_to_worker_0(status):
    assert decide(READY, _workers("running", status), lost_after_s=20).action is Action.CARRY_ON


def test_worker_0_ending_is_never_a_failure_of_the_job():
    assert decide(READY, _workers("86", "running"), lost_after_s=20).action is Action.CARRY_ON


@pytest.mark.parametrize(
    "status, action",
    [
        ("0", Action.CARRY_ON),
        ("143", Action.RECREATE),
        ("86", Action.RERUN),
        ("124", Action.RERUN),
        ("137", Action.RERUN),
        ("69", Action.RERUN),
        ("1", Action.STOP),
        ("2", Action.STOP),
        ("gone", Action.STOP),
    ],
)
def test_after_worker_0_ends(status, action):
    assert after_exit(status) is action


def test_gke_and_launch_restart_on_the_same_exit_codes():
    """One list: GKE's JobSet restarts on exactly the statuses a pod run reruns on."""
    assert gke.RESTART_EXIT_CODES is restarts.RESTART_EXIT_CODES
    rerun = {c for c in range(256) if after_exit(str(c)) in (Action.RERUN, Action.RECREATE)}
    assert rerun == set(gke.RESTART_EXIT_CODES)
    assert {69, 86, 124, 137, 143} <= rerun and not {0, 1, 2, 3, 74, 75} & rerun


def test_the_supervisor_imports_no_jax():
    """launch.sh's supervisor runs on the launching machine: no JAX import."""
    code = "import sys, magic_jax.jobs.launch; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


def _after(outcome, attempt=1, retry=1):
    return after_attempt(outcome, attempt=attempt, retry=retry, name="t", logs="/l", grace_s="120")


@pytest.mark.parametrize(
    "outcome, action, code",
    [
        (Outcome(status="0"), Action.STOP, 0),  # done
        (Outcome(status="1"), Action.STOP, 1),  # a failure no rerun mends
        (Outcome(status="86"), Action.RERUN, 0),  # restarts: the same slice
        (Outcome(status="143"), Action.RECREATE, 143),  # stopped as a preemption stops
        (Outcome(status="143", lost="t is PREEMPTED"), Action.RECREATE, 143),
        (Outcome(status="0", restarted=(0, 1)), Action.RERUN, 0),  # maintenance
        (Outcome(status="0", failed=1, failed_status="9"), Action.STOP, 9),
        (Outcome(status="143", failed=1, failed_status="86"), Action.RERUN, 0),
        (Outcome(status="0", stopped=(1,)), Action.STOP, 1),
        (Outcome(status="7", stopped=(1,)), Action.STOP, 7),  # worker 0's status first
    ],
)
def test_after_an_attempt(outcome, action, code):
    """What follows an attempt, with a retry left: rerun on the same slice, recreate it,
    or exit with a code."""
    verdict = _after(outcome)
    assert (verdict.action, verdict.code) == (action, code)


@pytest.mark.parametrize(
    "outcome, code, line",
    [
        (
            Outcome(status="0", restarted=(0,)),
            143,
            "maintenance restarted the host of worker(s) 0 under the command (its boot id"
            " changed); attempt 2 of 2, no retries left (--retry 1), exiting with 143",
        ),
        (
            Outcome(status="124"),
            124,
            "worker 0 exited with 124; attempt 2 of 2, no retries left (--retry 1)",
        ),
        (
            Outcome(status="143", lost="t is PREEMPTED", kind="preempted"),
            143,
            "preempted (t is PREEMPTED; attempt 2 of 2); no retries left (--retry 1), exiting"
            " with 143",
        ),
    ],
)
def test_no_retry_left_exits_saying_so(outcome, code, line):
    verdict = _after(outcome, attempt=2)
    assert (verdict.action, verdict.code, verdict.line) == (Action.STOP, code, line)


def test_a_lost_slice_is_recreated_even_when_worker_0_said_a_status_that_restarts():
    """The slice lost: a new one, whatever status worker 0 left (the host is gone)."""
    verdict = _after(Outcome(status="86", lost="worker 1 stopped answering", kind="a host lost"))
    assert verdict.action is Action.RECREATE
    assert verdict.line == (
        "a host lost (worker 1 stopped answering; attempt 1 of 2); recreating the slice"
    )
