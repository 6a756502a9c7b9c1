"""The supervisor's life (``tpu_scripts/launch.sh``): its attempts of the command (the
slice brought up, set up, the command started or attached to, watched, its statuses and
logs collected, then ``jobs/pod_decide.py``'s ``after_attempt``: rerun, recreate or
stop), its signals (Ctrl-C 130, SIGTERM 143, SIGHUP ignored), the relays of its output
at a terminal (into ``LOGS/launch.log`` too, outliving the terminal), its entry on this
machine (``runs/launch/.NAME.supervisor``) and its lease across machines
(``jobs/pod_lease.py``, renewed from a thread whatever the supervisor does), and
``--delete``, which stops the slice's supervisor first (here by SIGTERM, elsewhere through
its lease).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from magic_jax.jobs import (
    pod_collect,
    pod_decide,
    pod_lease,
    pod_setup,
    pod_stage,
    pod_state,
    tpu_api,
)
from magic_jax.jobs.pod_decide import Action
from magic_jax.jobs.pod_up import Stop
from magic_jax.jobs.pod_watch import await_end, bring_down, end_stream


class Relays:
    """At a terminal, what the supervisor and its gcloud calls print passes through relays
    (``tee``, deaf to SIGHUP and Ctrl-C) that go on after the terminal is gone, when
    writing to it fails: the messages also into ``LOGS/launch.log``, worker 0's log to the
    terminal only. Never a write to a lost terminal, so no gcloud call fails on one."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, logs: str) -> str:
        """The relays started where stdout or stderr is a terminal; the launch.log."""
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # no gcloud reads the terminal
        os.close(null)
        said_to = ""
        if os.isatty(2):
            Path(logs).mkdir(parents=True, exist_ok=True)
            said_to = f"{logs}/launch.log"
            self.relay(2, ["tee", "-a", said_to])
        if os.isatty(1):
            self.relay(1, ["tee", "/dev/null"])
        return said_to

    def relay(self, fd: int, argv: list[str]) -> None:
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        # deaf to Ctrl-C and SIGTERM (and to SIGHUP, as the supervisor is)
        deaf = ["sh", "-c", 'trap "" INT TERM HUP; exec "$@"', "relay", *argv]
        p = subprocess.Popen(deaf, stdin=subprocess.PIPE, stdout=fd)
        assert p.stdin is not None
        os.dup2(p.stdin.fileno(), fd)
        p.stdin.close()
        self.procs.append(p)

    def end(self) -> None:
        """The relays drain what is left (for at most 5 s: an orphan may hold a pipe)."""
        if not self.procs:
            return
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)
        end = time.monotonic() + 5
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, end - time.monotonic()))


def supervisor(entry: Path) -> tuple[int, str] | None:
    """This machine's supervisor of the slice (its entry), if one lives: its pid and its
    launch.log."""
    try:
        pid, _, said = entry.read_text().rstrip("\n").partition("\t")
    except OSError:
        return None
    if not pid.isdigit() or int(pid) == os.getpid():
        return None
    ps = subprocess.run(["ps", "-ww", "-p", pid, "-o", "command="], capture_output=True, text=True)
    if "magic_jax.jobs.launch" not in ps.stdout and "launch.sh" not in ps.stdout:
        return None
    return int(pid), said


def entry_of(r: pod_state.Run) -> Path:
    return r.repo / "runs" / "launch" / f".{r.a.name}.supervisor"


class Keeper(pod_lease.Keeper):
    """The lease, renewed from a thread of its own twice a second when due (a wait of
    hours for the slice, a delete waited for, does not hold it up); a takeover told to
    the supervisor by SIGUSR1, the new owner in ``lost``, or a stop request (``launch.sh
    --delete``), who asks in ``deleting``."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.lost = self.deleting = ""

    def start(self) -> None:
        threading.Thread(target=self.run, daemon=True).start()

    def run(self) -> None:
        while True:
            time.sleep(0.5)
            with self.lock:
                other = self.tick()
                asked = bool(self.asked)
            if other is not None:
                if asked:
                    self.deleting = other.stop_by
                else:
                    self.lost = other.owner()
                os.kill(os.getpid(), signal.SIGUSR1)

    def drop(self) -> None:
        with self.lock:
            self.release()
            self.acknowledge()


class Supervisor:
    """One launch's supervision (launch.sh's main part)."""

    def __init__(self, r: pod_state.Run) -> None:
        self.r = r
        self.relays = Relays()
        self.keeper = Keeper()
        self.entry: Path | None = None
        every = max(1, int(r.poll_s))
        self.lease_every = every
        self.lease_s = max(60, every * int(os.environ.get("LAUNCH_LEASE_CYCLES") or 6))

    # ------------------------------------------------------------------ signals, the end
    def on_signal(self, code: int) -> None:
        """Ctrl-C or SIGTERM: while the command runs, with --delete-on-exit it is stopped
        on every worker and the logs collected (the end deletes the slice); without, it
        goes on, detached. A second one exits at once."""
        r = self.r

        def again(signum: int, frame: FrameType | None) -> None:
            r.note("interrupted again: exiting now")
            raise SystemExit(code)

        signal.signal(signal.SIGINT, again)
        signal.signal(signal.SIGTERM, again)
        end_stream(r)
        if r.running and not r.a.dry:
            if r.a.delete_on_exit:
                r.note(
                    "interrupted: stopping the command on every worker, collecting the logs, "
                    f"then deleting {r.a.name} (interrupt again to delete it at once)"
                )
                with contextlib.suppress(Exception):
                    bring_down(r, quiet=True)
                with contextlib.suppress(Exception):
                    pod_collect.salvage_logs(r)
            else:
                r.note(
                    f"interrupted: the command goes on running on {r.a.name}, detached "
                    f"(tpu_scripts/launch.sh --name {r.a.name} --zone {r.a.zone} --delete "
                    "stops it with the slice)"
                )
        raise SystemExit(code)

    def lease_lost(self) -> None:
        """Taken over, or asked to stop by --delete (which deletes the slice once this
        supervisor's end acknowledged): it stops, neither recreating nor deleting, exit 1."""
        r = self.r
        r.lease, r.a.delete_on_exit = "", False
        if self.keeper.deleting:
            r.note(
                f"{r.a.name} is being deleted by {self.keeper.deleting} (launch.sh --delete): "
                "this supervisor stops"
            )
            raise SystemExit(1)
        by = self.keeper.lost or "another supervisor"
        r.note(
            f"the supervision of {r.a.name} was taken over by {by} "
            "(this one's lease went stale): this supervisor stops, leaving the run and the "
            "slice to it"
        )
        raise SystemExit(1)

    def traps(self) -> None:
        signal.signal(signal.SIGINT, lambda s, f: self.on_signal(130))
        signal.signal(signal.SIGTERM, lambda s, f: self.on_signal(143))
        signal.signal(signal.SIGUSR1, lambda s, f: self.lease_lost())

    def on_exit(self) -> None:
        """The end, however it came: no ssh left behind, the slice deleted with
        --delete-on-exit, the lease dropped (or a stop request in it acknowledged), this
        supervisor's entry removed."""
        r = self.r
        end_stream(r)
        if r.a.delete_on_exit and r.have_slice:
            r.say(f"deleting {r.a.name}")
            with contextlib.suppress(Exception):
                r.teardown()
        self.keeper.drop()  # (nothing when there is none)
        e = self.entry
        with contextlib.suppress(OSError):
            if e is not None and e.read_text().partition("\t")[0] == str(os.getpid()):
                e.unlink()  # (its own, not one a later launch wrote after a kill -9 of this one)
        self.relays.end()

    # ------------------------------------------------------------------ one per slice
    def alone(self) -> None:
        """One supervisor per slice on this machine: a second launch while it lives says
        so instead of racing it."""
        r = self.r
        if r.a.dry:
            return
        found = supervisor(entry_of(r))
        if found:
            pid, said = found
            said = f"; its messages in {said}" if said else ""
            raise Stop(
                1,
                f"a supervisor of {r.a.name} runs on this machine already (pid {pid}"
                f"{said}): let it be, or stop it with `kill -KILL {pid}` (the run goes on) "
                "and run this again to take it over",
            )

    def lease_take(self) -> None:
        """The lease of the slice across machines (with a stage)."""
        r = self.r
        if r.a.dry or not r.stage:
            return
        uri = f"{r.stage}/supervisors/{r.a.zone}/{r.a.name}"
        pid = os.getpid()
        try:
            held = pod_lease.take(uri, pid, self.lease_s)
        except Exception as e:  # every failure of the bucket is a line said
            why = pod_stage.unreadable(e, uri).say()
            r.say(
                f"no supervisor lease in {uri} ({why}): a launch on another machine is not kept out"
            )
            return
        if held is not None:
            r.a.delete_on_exit = False  # (the slice is the other supervisor's)
            age, stale = int(time.time() - held.renewed), int(held.stale_s)
            raise Stop(
                1,
                f"a supervisor of {r.a.name} runs on {held.owner()} (its lease {uri} "
                f"renewed {age}s ago): let it be, or stop it there; once its lease is "
                f"stale ({stale}s unrenewed) this command or --attach {r.a.name} takes "
                "the run over",
            )
        with self.keeper.lock:
            self.keeper.keep(uri, pid, self.lease_s, self.lease_every)
        r.lease = uri

    def begin(self) -> None:
        """Before the first attempt: alone here, relays, the entry, the client, the lease."""
        r = self.r
        self.alone()
        if not r.a.dry:
            r.said_to = self.relays.start(r.logs)
            self.entry = entry_of(r)
            self.entry.parent.mkdir(parents=True, exist_ok=True)
            self.entry.write_text(f"{os.getpid()}\t{r.said_to}\n")
            start_client(r)
            self.keeper.start()
        self.lease_take()

    # ------------------------------------------------------------------ the attempts
    def attempt(self) -> None:
        """One attempt: the slice up, set up, the command started (or attached to),
        watched, and what it left collected."""
        r = self.r
        r.bring_up()
        pod_setup.attempt_files(r)
        r.new_attempt()
        attached = False
        if r.attempt == 1 and pod_setup.running_job(r):
            attached = r.running = True
            if not r.lease:
                self.lease_take()  # (the stage it names: --attach alone knows none before)
        elif (r.a.setup or r.attempt > 1) and not pod_setup.setup(r) and not r.slice_lost():
            raise Stop(1, r.setup_err)
        if not r.lost and not attached:
            r.running = True
            pod_setup.start(r)
        if r.lost:
            return
        ctl = (
            f"stops it and deletes {r.a.name}"
            if r.a.delete_on_exit
            else "detaches (the command goes on)"
        )
        kept = f", its messages in {r.said_to}" if r.said_to else ""
        r.say(
            f"running on {r.workers} worker(s) of {r.a.name}; worker 0's log follows (closing "
            f"the terminal leaves this supervisor running{kept}; Ctrl-C {ctl})"
        )
        rc = await_end(r)
        if rc == 1:
            pod_collect.salvage_logs(r)
        elif rc == 4:
            bring_down(r, quiet=True)
            pod_collect.salvage_logs(r)
        elif not pod_collect.collect(r):
            pod_collect.salvage_logs(r)

    def supervise(self) -> int:
        """The attempts, until one ends the launch; its exit status."""
        r = self.r
        self.traps()
        self.begin()
        while True:
            self.attempt()
            r.running = False
            if r.status == "0" and not (r.restarted or r.failed is not None or r.stopped or r.lost):
                break
            o = pod_decide.Outcome(
                status=r.status,
                restarted=tuple(r.restarted),
                failed=r.failed,
                failed_status=r.failed_status,
                stopped=tuple(r.stopped),
                lost=r.lost,
                kind=r.kind,
            )
            n = pod_decide.after_attempt(
                o, attempt=r.attempt, retry=r.retry, name=r.a.name, logs=r.logs, grace_s=r.grace_s
            )
            if n.action is Action.RERUN:
                r.note(n.line)
                r.attempt += 1
            elif n.action is Action.RECREATE:
                r.status = str(n.code)
                r.note(n.line)
                if not r.teardown():
                    r.say(f"deleting {r.a.name} failed; creating it anyway")
                r.have_slice, r.attempt = False, r.attempt + 1
            else:
                r.status = str(n.code)
                if n.line:
                    raise Stop(n.code, n.line)
                break
        if r.attempt > 1:
            r.note(
                "resumed run finished" if r.status == "0" else f"resumed run exited with {r.status}"
            )
        return int(r.status)


def start_client(r: pod_state.Run) -> None:
    """Cloud TPU's client made (its credentials found), else the launch ends saying why."""
    api = os.environ.get("LAUNCH_API_PYTHON") or "python3"
    try:
        r.tpu.client()
    except SystemExit as e:  # (the client is not installed: the line names the extra)
        raise Stop(1, f"Cloud TPU's API ({api}) did not start: {e.code}") from e
    except tpu_api.TpuApiError as e:  # (credentials)
        raise Stop(1, f"Cloud TPU's API ({api}) did not start: {e.error.say()}") from e


def lease_uri(r: pod_state.Run) -> str:
    return f"{r.stage}/supervisors/{r.a.zone}/{r.a.name}"


def stop_elsewhere(r: pod_state.Run) -> None:
    """--delete with a stage: a live supervisor of the slice elsewhere (its lease) asked
    to stop, and waited for until it acknowledged (its lease deleted) or had the time to
    (its lease's stale_s and 15 s: dead or cut off)."""
    uri = lease_uri(r)
    try:
        held = pod_lease.ask_stop(uri, os.getpid())
    except Exception as e:  # every failure of the bucket is a line said
        why = pod_stage.unreadable(e, uri).say()
        r.say(f"no supervisor lease in {uri} ({why}): a supervisor elsewhere is not stopped")
        return
    if held is None:
        return
    r.say(
        f"asking the supervisor of {r.a.name} on {held.owner()} to stop first (its lease in {uri})"
    )
    wait_s = int(held.stale_s) + 15
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        time.sleep(1)
        with contextlib.suppress(Exception):  # (the bucket briefly away: read again)
            if pod_lease.read_record(uri)[0] is None:
                return
    r.say(
        f"the supervisor of {r.a.name} on {held.owner()} did not stop within {wait_s}s "
        f"(dead or cut off): deleting {r.a.name} anyway"
    )


def delete(r: pod_state.Run) -> int:
    """--delete: the slice's supervisor stopped first (on this machine by SIGTERM,
    elsewhere through its lease in the stage), so that it does not take the deletion for
    a preemption; then the slice deleted."""
    stopped = False
    if not r.a.dry:
        found = supervisor(entry_of(r))
        if found:
            pid = found[0]
            r.say(f"stopping the supervisor of {r.a.name} on this machine (pid {pid}) first")
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
            for _ in range(600):
                if supervisor(entry_of(r)) is None:
                    break
                time.sleep(0.2)
            stopped = True
        if r.stage:
            stop_elsewhere(r)
        start_client(r)
    # (one with --delete-on-exit deleted the slice itself)
    return 0 if r.teardown() or stopped else 1
