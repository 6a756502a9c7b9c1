"""What the supervisor collects once worker 0's command ended (or the slice was lost):
every worker's exit status, then every worker's log (``worker-N.log``,
``worker-N.attempt-K.log`` on a retry), fetched ``LAUNCH_SSH_FANOUT`` at a time, never
from a host known gone; a log that did not come so is the copy its worker kept in the
stage (``STAGE/logs/RUN/worker-N.log``), a preempted slice's too.

A command still running ``LAUNCH_GRACE_S`` after worker 0's ended is stopped (SIGTERM,
SIGKILL ``LAUNCH_KILL_S`` later). A worker that does not answer is asked again: worker 0
for as long as the slice is not lost, another one 3 times.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from magic_jax.jobs import pod_stage, pod_state
from magic_jax.jobs.pod_errors import span
from magic_jax.jobs.pod_watch import bring_down, status_of

DIGITS = "0123456789"


class Grace:
    """The time other workers' commands have after worker 0's ended (``deadline``, on
    ``clock``), and the workers stopped past it."""

    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.deadline = clock() + grace_s
        self.stopped: list[int] = []


def exit_of(r: pod_state.Run, w: int, grace: Grace) -> str:
    """Worker ``w``'s command's exit status once it ended (``""``: none known)."""
    tries, wait = 0, r.ssh_wait_s
    while True:
        _, said = r.ssh.ask(w, f"cat {r.log}.exit 2>/dev/null || echo none")
        s = "".join(ch for ch in said if ch in "abcdefghijklmnopqrstuvwxyz" + DIGITS)
        if s == "none":
            s = status_of(r, w)
        if s[:1] in tuple(DIGITS) and s:
            return s
        if s == "gone":
            return ""
        if s == "running":
            if grace.clock() >= grace.deadline:
                r.note(
                    f"worker {w}'s command still ran {r.grace_s}s after worker 0's ended: "
                    "stopping it"
                )
                grace.stopped.append(w)
                bring_down(r)
                grace.deadline = grace.clock() + r.kill_s + 30
            else:
                time.sleep(1 if r.poll_s < 5 else 5)
            continue
        tries += 1
        if w != 0 and tries >= 3:
            r.say(f"worker {w} did not answer ({tries} tries): its exit status is unknown")
            return ""
        if r.slice_lost():
            return ""
        r.say(
            f"ssh to worker {w} failed ({r.a.name} is {r.state or 'UNKNOWN'}); asking again "
            f"in {span(wait)}"
        )
        r.clock.nap(wait)
        wait = min(wait * 2, r.ssh_max_s)


def suffix(r: pod_state.Run) -> str:
    return "" if r.attempt == 1 else f".attempt-{r.attempt}"


def kept_prefix(beats: str) -> str:
    """Where the workers keep their logs in the stage, from their heartbeats' prefix
    (``STAGE/beats/RUN`` -> ``STAGE/logs/RUN``)."""
    root, _, run = beats.rpartition("/")
    return f"{root.rpartition('/beats')[0]}/logs/{run}"


def fetch_logs(r: pod_state.Run) -> int:
    """Copies every worker's log here; a host known gone is not asked, nor is any when
    worker 0 does not answer; what did not come so is read from the stage. Returns how
    many came."""
    end = suffix(r)
    logs = Path(r.logs)
    logs.mkdir(parents=True, exist_ok=True)

    def part(w: int) -> Path:
        return logs / f"worker-{w}{end}.log.part"

    asked = [w for w in range(r.workers) if w not in r.gone_hosts]
    r.ssh.fetch(asked, f"cat {r.log}.log", part)
    missing = []
    for w in range(r.workers):
        f = logs / f"worker-{w}{end}.log"
        p = part(w)
        if p.exists() and p.stat().st_size:
            p.replace(f)
        else:
            p.unlink(missing_ok=True)
        if not (f.exists() and f.stat().st_size):
            missing.append(w)
    if r.beats and missing:
        try:
            pod_stage.keep_logs(kept_prefix(r.beats), logs, end, missing)
        except pod_stage.StageError as e:
            r.say(f"the logs kept in the stage cannot be read: {e.error.say()}")
    return sum(
        1
        for w in range(r.workers)
        if (f := logs / f"worker-{w}{end}.log").exists() and f.stat().st_size
    )


def collect(r: pod_state.Run) -> bool:
    """Every worker's exit status, then every log: ``r.status`` is worker 0's. False when
    the slice is lost (``r.lost`` says why)."""
    if r.a.dry:
        for w in range(r.workers):
            r.ssh.on(w, f"cat {r.log}.log")
        return True
    r.status = "0"
    grace = Grace(float(r.grace_s))
    codes = []
    for w in range(r.workers):
        code = exit_of(r, w, grace)  # first: a log is whole once its command ended
        codes.append(code)
        if not code and w == 0 and r.slice_lost():
            r.stopped = grace.stopped
            return False
    r.stopped = grace.stopped
    fetch_logs(r)
    for w, code in enumerate(codes):
        code = code or "1"
        if w == 0:
            r.status = code
        if code != "0":
            r.say(f"worker {w} exited with {code} (log: {r.logs}/worker-{w}{suffix(r)}.log)")
    r.say(f"logs of {r.workers} worker(s) in {r.logs}")
    return True


def salvage_logs(r: pod_state.Run) -> None:
    """The log of every worker that still answers (a preemption, an interrupt)."""
    if r.a.dry:
        return
    fetched = fetch_logs(r)
    r.say(
        f"logs of {fetched} of {r.workers} worker(s) in {r.logs}{f' ({r.lost})' if r.lost else ''}"
    )
