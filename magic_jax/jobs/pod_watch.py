"""The supervisor's status cycle while a command runs on a slice, and its watch: every
``LAUNCH_POLL_S`` two questions at any host count, the node's state and health (Cloud
TPU's API) and every worker's heartbeat (one listing of the stage; without a stage, one
ssh to all workers), then ``jobs/pod_decide.py``'s decision. A worker is silent when its
heartbeat (or answer) has not changed for ``LAUNCH_LOST_S``; on a READY, healthy node the
silent ones are asked once (``LAUNCH_PROBE_S`` to answer). A cycle with nothing to decide
(READY, HEALTHY, every worker running and heard) decides nothing.

``Cycle`` keeps the bookkeeping (what each worker last said, since when) and takes its
questions as functions, so it runs without gcloud or Cloud TPU: ``node()`` the node's
state and health, ``beats()`` the heartbeat lines (or ``BeatsUnreadable``), ``probe()``
every worker's answer lines, ``now_ms()`` the clock.
"""

from __future__ import annotations

import dataclasses
import subprocess
import time
from collections.abc import Callable

from magic_jax.jobs import pod_decide, pod_errors, pod_stage, pod_state, pod_workers, tpu_api
from magic_jax.jobs.pod_decide import Action
from magic_jax.jobs.pod_errors import span
from magic_jax.jobs.pod_up import Stop

ENDED_WELL = ("running", *sorted(pod_decide.ENDED_WELL))


class BeatsUnreadable(Exception):
    """The heartbeats cannot be read; its message says why."""


@dataclasses.dataclass
class Verdict:
    """What a cycle concluded: ``""`` (carry on), ``lost``, ``failed`` or ``restarted``,
    with the workers and why."""

    what: str = ""
    workers: tuple[int, ...] = ()
    status: str = ""
    lost: str = ""
    kind: str = ""


class Cycle:
    """The status cycles of one attempt (launch.sh's ``cycle``).

    Args:
      workers: how many workers the slice has.
      name: the node's name (for the lines said).
      node: ``(state, health)`` of the node, asked for a status cycle.
      beats: every heartbeat line ``N SEQ STATUS BOOT`` under ``where``; ``None`` when
        there is no stage (then ``probe`` is the cycle's question).
      probe: every worker's answer lines ``N STATUS BOOT`` (those that answer in time).
      now_ms: the clock, in ms.
      say: a line for the user.
      lost_ms, probe_ms: silence after which a worker is asked; the time it has to answer.
      where: the heartbeats' prefix (for the lines said).
    """

    def __init__(
        self,
        *,
        workers: int,
        name: str,
        node: Callable[[], tuple[str, str]],
        beats: Callable[[], list[str]] | None,
        probe: Callable[[], list[str]],
        now_ms: Callable[[], int],
        say: Callable[[str], None],
        lost_ms: int,
        probe_ms: int,
        where: str = "",
    ) -> None:
        self.n, self.name, self.node, self.beats, self.probe = workers, name, node, beats, probe
        self.now_ms, self.say, self.lost_ms, self.probe_ms = now_ms, say, lost_ms, probe_ms
        self.where = where
        t = now_ms()
        self.seq_of: dict[int, str] = {}
        self.seen_at = dict.fromkeys(range(workers), t)
        self.ended: set[int] = set()
        self.status_of: dict[int, str] = {}
        self.boot_of: dict[int, str] = {}
        self.said = self.beats_said = ""

    def heard(self, lines: list[str], t: int, answers: bool) -> None:
        """Takes in heartbeat lines (``answers``: answer lines, themselves signs of life)."""
        for line in lines:
            words = line.split()
            if not words or not words[0].isdigit() or int(words[0]) >= self.n:
                continue
            w = int(words[0])
            if answers:
                seq, st, boot = str(t), *([*words[1:3], "", ""])[:2]
            else:
                seq, st, boot = ([*words[1:4], "", "", ""])[:3]
            if self.seq_of.get(w) != seq:
                self.seq_of[w], self.seen_at[w] = seq, t
            st = st.removeprefix("exit-")
            if st[:1].isdigit():
                self.ended.add(w)  # its last heartbeat: silent from now on
            self.status_of[w], self.boot_of[w] = st, boot

    def quiet(self, t: int) -> bool:
        """Nothing to decide: every worker running (or ended well) and heard."""
        for w in range(self.n):
            if w not in self.ended and t - self.seen_at[w] >= self.lost_ms:
                return False
            if self.status_of.get(w, "running") not in ENDED_WELL:
                return False
        return True

    def decide(self, state: str, health: str, t: int) -> pod_decide.Decision:
        node = pod_decide.Slice(state=state, health=health)
        workers = [
            pod_decide.Worker(
                index=w,
                status=self.status_of.get(w, "running"),
                silent_s=(t - self.seen_at[w]) / 1000,
                restarted=self.boot_of.get(w) == "restarted",
            )
            for w in range(self.n)
        ]
        lost_after_s = self.lost_ms / 1000
        d = pod_decide.decide(node, workers, lost_after_s=lost_after_s)
        if d.action is Action.PROBE:  # ask every worker once: what became of the silent ones?
            answers = {}
            for line in self.probe():
                words = line.split()
                if len(words) >= 2 and words[0].isdigit():
                    answers[int(words[0])] = pod_decide.Worker(
                        index=int(words[0]),
                        status=words[1],
                        restarted=words[2:3] == ["restarted"],
                    )
            d = pod_decide.decide(node, workers, lost_after_s=lost_after_s, answers=answers)
        return d

    def cycle(self) -> Verdict:
        """One status cycle; its verdict."""
        state, health = self.node()
        quiet = state == "READY" and health in ("", "HEALTHY")
        t = self.now_ms()
        why = ""
        if self.beats is None:
            self.heard(self.probe(), t, answers=True)
        else:
            try:
                self.heard(self.beats(), t, answers=False)
            except BeatsUnreadable as e:
                why = str(e)
        if quiet and self.quiet(t):
            return Verdict()
        d = self.decide(state, health, t)
        if d.action is Action.WAIT:
            node = f"{state} {health}"
            if self.said != node:
                self.say(
                    f"{self.name} is {state}{f' ({health})' if health else ''}: waiting for it"
                )
            self.said = node
        elif d.action is Action.RECREATE:
            if not d.workers:
                return Verdict("lost", lost=f"{self.name} is {state}")
            w = d.workers[0]
            silent = (t - self.seen_at[w]) // 1000
            lost = f"worker {w} stopped answering (no heartbeat for {silent}s, no answer in "
            lost += f"{self.probe_ms // 1000}s; {self.name} is {state})"
            return Verdict("lost", workers=d.workers, lost=lost, kind="a host lost")
        elif d.action is Action.RERUN:
            return Verdict("restarted", workers=d.workers)
        elif d.action is Action.STOP:
            return Verdict("failed", workers=d.workers, status=d.status)
        elif d.action is Action.CARRY_ON and d.alive:
            self.carry_on(d.alive, t, why)
        return Verdict()

    def carry_on(self, alive: tuple[int, ...], t: int, why: str) -> None:
        """Silent workers that answer: heard now, and the line why (said once when the
        heartbeats cannot be read)."""
        for w in alive:
            self.seen_at[w] = t  # its heartbeat does not reach the bucket
        ws = " ".join(map(str, alive))
        if why:
            if why != self.beats_said:
                self.say(
                    f"worker(s) {ws} answer, but their heartbeats in {self.where} cannot "
                    f"be read: {why}"
                )
            self.beats_said = why
        else:
            self.say(
                f"worker(s) {ws} answer, but their heartbeats are {self.lost_ms // 1000}s "
                f"old or more: are they reaching {self.where}?"
            )


# ---------------------------------------------------------------------- the supervisor's
def ms() -> int:
    return int(time.time() * 1000)


def node_poll(r: pod_state.Run) -> tuple[str, str]:
    """The node's state and health, asked for a status cycle (``UNKNOWN`` when the
    question failed; credentials or a missing role end the launch)."""
    try:
        n = r.tpu.node(r.a.name, reason="status cycle")
    except tpu_api.TpuApiError as e:
        if e.error.kind in (pod_errors.Kind.AUTH, pod_errors.Kind.PERMISSION):
            raise Stop(1, f"asking Cloud TPU about {r.a.name} failed: {e.error.say()}") from e
        return "UNKNOWN", ""
    return n.state, n.health


def status_cmd(r: pod_state.Run) -> str:
    return f"bash {r.run_dir}/tpu_scripts/worker_run.sh --status {r.log}"


def probe(r: pod_state.Run) -> list[str]:
    """Every worker's ``N STATUS BOOT`` in one ssh, given ``LAUNCH_PROBE_S`` to answer."""
    return r.ssh.within(status_cmd(r), r.probe_ms / 1000).splitlines()


def cycles(r: pod_state.Run) -> Cycle:
    """The status cycles of the attempt under way."""

    def beats() -> list[str]:
        try:
            return pod_stage.beats(r.beats)
        except pod_stage.StageError as e:
            raise BeatsUnreadable(e.error.say()) from e

    return Cycle(
        workers=r.workers,
        name=r.a.name,
        node=lambda: node_poll(r),
        beats=beats if r.beats else None,
        probe=lambda: probe(r),
        now_ms=ms,
        say=r.say,
        lost_ms=r.lost_ms,
        probe_ms=r.probe_ms,
        where=r.beats,
    )


def bring_down(r: pod_state.Run, quiet: bool = False) -> None:
    """Stops the command on every worker: SIGTERM, then SIGKILL to what is left
    ``LAUNCH_KILL_S`` later. Each worker still records its command's exit status."""
    if not quiet:
        r.say("stopping the command on every worker")
    p = f"{r.log}.pid"
    command = (
        f"p=$(cat {p} 2>/dev/null) || exit 0; pkill -TERM -P $p; "
        f"for i in $(seq {r.kill_s}); do pgrep -P $p >/dev/null || exit 0; sleep 1; done; "
        "pkill -KILL -P $p; exit 0"
    )
    r.ssh.on(
        "all", command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL if quiet else None
    )


def end_stream(r: pod_state.Run) -> None:
    if r.stream is not None and r.stream.poll() is None:
        pod_workers.kill_tree(r.stream.pid)


def watch(r: pod_state.Run, c: Cycle, until_ms: int | None = None) -> str:
    """Status cycles every ``LAUNCH_POLL_S`` while the stream runs (or, with none, until
    ``until_ms``), until one gives a verdict: a lost slice ends the stream, a failure
    stops the job first. Returns the verdict (and sets what it found on ``r``)."""
    if r.a.dry:
        return ""
    poll_ms = int(r.poll_s * 1000)
    tick = 1.0 if poll_ms >= 1000 else 0.2
    s = r.stream if until_ms is None else None
    due = ms() + poll_ms
    while True:
        if s is not None and s.poll() is not None:
            return ""
        if until_ms is not None and ms() >= until_ms:
            return ""
        if s is not None:
            pod_workers.wait_for(s, tick)
        else:
            time.sleep(tick)
        if ms() < due or (s is not None and s.poll() is not None):
            continue
        v = c.cycle()
        due = ms() + poll_ms
        if v.what == "lost":
            if v.workers:
                r.kind, r.lost, r.gone_hosts = v.kind, v.lost, set(v.workers)
            elif not r.slice_lost():
                r.lost = v.lost
        elif v.what == "restarted":
            r.restarted = list(v.workers)
        elif v.what == "failed":
            failed(r, v)
            return "failed"
        if v.what:
            end_stream(r)
            return v.what


def failed(r: pod_state.Run, v: Verdict) -> None:
    """Another worker's command failed while worker 0's still ran: the job stopped."""
    r.failed, st = v.workers[0], v.status
    if st == "gone":
        st, v.status = "no exit status (its command is gone)", "1"
    r.failed_status = v.status
    r.note(f"worker {r.failed} ended with {st} while worker 0's command still ran: the job failed")
    bring_down(r)
    if r.stream is not None and not pod_workers.wait_for(r.stream, r.kill_s + 30):
        end_stream(r)


def pause(r: pod_state.Run, c: Cycle, seconds: int) -> str:
    """Waits ``seconds`` between reconnects: status cycles meanwhile (a fake clock in
    tests)."""
    if r.clock.path:
        r.clock.nap(seconds)
        return ""
    r.stream = None
    return watch(r, c, ms() + seconds * 1000)


def stream_argv(r: pod_state.Run, start: str) -> list[str]:
    log = r.log
    command = (
        f"tail -n {start} -f {log}.log & t=$!;       while [ ! -e {log}.exit ] && "
        f"kill -0 $(cat {log}.pid) 2>/dev/null; do sleep {r.tick}; done;       "
        f"sleep {r.flush}; kill $t; [ -e {log}.exit ] || exit 3"
    )
    return [
        *pod_workers.TPU,
        "ssh",
        r.a.name,
        *r.ssh.where,
        *r.ssh.via,
        "--worker=0",
        "--ssh-flag=-oServerAliveInterval=30",
        "--ssh-flag=-oServerAliveCountMax=6",
        "--command",
        command,
    ]


CODES = {"lost": 1, "failed": 2, "restarted": 4}


def await_end(r: pod_state.Run) -> int:
    """Streams worker 0's log until its command ends, with status cycles meanwhile. 0: it
    ended; 1: the slice is lost (``r.lost``); 2: another worker's command failed first
    (the job is stopped); 4: maintenance restarted hosts under the command. An ssh that
    fails on a slice that is not lost is retried, after ``LAUNCH_SSH_BACKOFF_S``, twice as
    long each time up to ``LAUNCH_SSH_BACKOFF_MAX_S``, with no limit."""
    r.created = False  # the slice was READY: a wait for it from now on is maintenance's
    c = cycles(r)
    start, fails, wait, down = "+1", 0, r.ssh_wait_s, None
    while True:
        t0 = r.clock.now()
        argv = stream_argv(r, start)
        if r.a.dry:
            r.ssh.show(argv)
            return 0
        r.stream = r.ssh.spawn(argv, stdin=subprocess.DEVNULL)
        verdict = watch(r, c)
        r.stream.wait()
        rc = pod_workers.status(r.stream)
        r.stream = None
        if verdict:
            return CODES[verdict]
        if rc == 0:
            return 0
        if r.slice_lost():
            return 1
        if rc == 3:  # gone without an exit status: was its host restarted?
            r.slice_up("wait-ready")  # (a host under maintenance answers once READY)
            if status_of(r, 0) == "restarted":
                r.restarted = [0]
                return 4
            raise Stop(
                1,
                "worker 0's command ended without an exit status, its host not "
                f"restarted ({r.a.name} is {r.state}): killed?",
            )
        if r.clock.now() - t0 >= r.ssh_max_s:  # a stream up for a while dropped: a new outage
            fails, wait, down = 0, r.ssh_wait_s, None
        fails += 1
        down = r.clock.now() if down is None else down
        r.say(
            f"ssh to worker 0 failed ({rc}; {r.a.name} is {r.state or 'UNKNOWN'}); "
            f"reconnecting in {span(wait)} (failure {fails}; unreachable for "
            f"{span(r.clock.now() - down)}; the command goes on)"
        )
        verdict = pause(r, c, wait)
        if verdict:
            return CODES[verdict]
        wait, start = min(wait * 2, r.ssh_max_s), "0"


def status_of(r: pod_state.Run, w: int) -> str:
    """Worker ``w``'s command: its exit status, ``running``, ``gone`` or ``restarted``
    (gone, its host booted since); ``""`` when the worker does not answer."""
    _, said = r.ssh.ask(w, status_cmd(r))
    words = (said.splitlines() or [""])[0].split()
    s, b = ([*words[1:3], "", ""])[:2]
    if b == "restarted" and s == "gone":
        s = "restarted"
    return "".join(ch for ch in s if ch in "abcdefghijklmnopqrstuvwxyz0123456789")
