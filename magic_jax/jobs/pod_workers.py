"""The workers of a slice as ``tpu_scripts/launch.sh``'s supervisor reaches them: ``gcloud
compute tpus tpu-vm ssh`` and ``scp`` (the Cloud TPU API has no equivalent), each ssh
giving up connecting after ``connect_s``, a question to one worker after ``ask_s`` in all
(gcloud's own ssh tries a gone host for about 20 minutes), questions to many workers
``fanout`` at a time, and a process given up on killed with its descendants (gcloud and
its ssh). A dry run prints each command (as bash's ``printf %q`` quotes it) instead.

The supervisor ignores SIGHUP (``jobs/launch.py``), and so does every child it starts (an
ignored signal stays ignored over fork and exec): a lost terminal stops no gcloud call.
No child is started through ``preexec_fn`` (not safe with the supervisor's threads).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

TPU = ("gcloud", "compute", "tpus", "tpu-vm")


def bash_quote(words: Sequence[str]) -> list[str]:
    """Each word as bash's ``printf %q`` writes it (what the workers' shell reads back)."""
    if not words:
        return []
    out = subprocess.run(
        ["bash", "-c", 'printf "%q\\0" "$@"', "bash", *words],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split("\0")[:-1]


def printed(words: Sequence[str]) -> str:
    """A command as a dry run prints it (bash's ``printf '%q '``)."""
    return "".join(f"{w} " for w in bash_quote(words))


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s children (``pgrep -P``)."""
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    except OSError:
        return []
    return [int(x) for x in out.stdout.split() if x.isdigit()]


def kill_tree(pid: int, sig: int = signal.SIGTERM) -> None:
    """Kills a process and its descendants (a backgrounded gcloud and its ssh)."""
    for child in children(pid):
        kill_tree(child, sig)
    with contextlib.suppress(OSError):
        os.kill(pid, sig)


def status(proc: subprocess.Popen[Any]) -> int:
    """A finished process's exit status as a shell says it (128+N for signal N)."""
    rc = proc.returncode
    return 128 - rc if rc is not None and rc < 0 else int(rc or 0)


@dataclasses.dataclass(kw_only=True)
class Workers:
    """ssh and scp to the workers of node ``name``.

    Attributes:
      name, where: the node and its ``--zone Z [--project P]`` flags.
      via: ``--internal-ip`` (or nothing).
      connect_s: an ssh gives up connecting after this many seconds.
      ask_s: a question to one worker gives up after this many seconds in all.
      fanout: how many workers are asked at once.
      dry: print each command instead of running it.
    """

    name: str
    where: tuple[str, ...]
    via: tuple[str, ...] = ()
    connect_s: str = "10"
    ask_s: float = 120.0
    fanout: int = 16
    dry: bool = False

    def ssh(self, worker: int | str, command: str, *flags: str) -> list[str]:
        """The gcloud command that runs ``command`` on ``worker`` (a number or ``all``)."""
        return [
            *TPU,
            "ssh",
            self.name,
            *self.where,
            *self.via,
            f"--worker={worker}",
            *flags,
            f"--ssh-flag=-oConnectTimeout={self.connect_s}",
            "--command",
            command,
        ]

    def show(self, argv: Sequence[str]) -> None:
        """A dry run's line for ``argv``, on stdout."""
        print(printed(argv), flush=True)

    def run(self, argv: Sequence[str], **kw: Any) -> int:
        """Runs ``argv`` (a dry run prints it: 0); its exit status."""
        if self.dry:
            self.show(argv)
            return 0
        proc = subprocess.Popen(list(argv), **kw)
        try:
            proc.wait()
        finally:
            if proc.returncode is None:
                kill_tree(proc.pid)
        return status(proc)

    def on(self, worker: int | str, command: str, **kw: Any) -> int:
        """Runs ``command`` on ``worker`` (``ssh_on``)."""
        return self.run(self.ssh(worker, command), **kw)

    def spawn(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Starts ``argv`` in the background."""
        return subprocess.Popen(list(argv), **kw)

    def ask(self, worker: int, command: str, out: IO[Any] | None = None) -> tuple[int, str]:
        """Asks one worker, within ``ask_s``: its exit status (124 past the time) and its
        output (none when ``out`` takes it). A dry run prints the command: (0, "")."""
        if self.dry:
            self.show(self.ssh(worker, command))
            return 0, ""
        proc = self.spawn(
            self.ssh(worker, command),
            stdout=out if out is not None else subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        try:
            said, _ = proc.communicate(timeout=self.ask_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=5)
            kill_tree(proc.pid, signal.SIGKILL)
            proc.wait()
            return 124, ""
        finally:
            if proc.returncode is None:
                kill_tree(proc.pid, signal.SIGKILL)
        return status(proc), said or ""

    def within(self, command: str, seconds: float) -> str:
        """Every worker asked at once (one ssh, ``--worker=all``), given ``seconds`` to
        answer: what they said by then."""
        proc = self.spawn(
            self.ssh("all", command),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        said = ""
        try:
            said, _ = proc.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            try:
                said, _ = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:  # (an orphan holds its output: none then)
                kill_tree(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    said, _ = proc.communicate(timeout=5)
        return said or ""

    def fetch(self, workers: Sequence[int], command: str, into: Callable[[int], Path]) -> None:
        """``command``'s output of each of ``workers`` into the file ``into(w)``, the first
        worker alone, then ``fanout`` at a time; a worker that does not answer within
        ``ask_s`` leaves its file empty. When worker 0 is among them and answers nothing
        (a slice gone answers no ssh) the others are not asked."""

        def one(w: int) -> None:
            with into(w).open("w") as out:
                self.ask(w, command, out)

        rest = [w for w in workers if w != 0]
        if 0 in workers:
            one(0)
            if not into(0).stat().st_size:
                return
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, self.fanout)) as pool:
            for done in [pool.submit(one, w) for w in rest]:
                done.result()


def tee(proc: subprocess.Popen[str], *outs: IO[str]) -> str:
    """Copies a process's output (its stdout, a pipe) to ``outs`` line by line as it
    comes; returns all of it once the process ended."""
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        for out in outs:
            with contextlib.suppress(OSError, ValueError):
                out.write(line)
                out.flush()
    proc.wait()
    return "".join(lines)


def wait_for(proc: subprocess.Popen[Any], seconds: float) -> bool:
    """Waits at most ``seconds`` for ``proc`` to end; whether it did."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def stderr_line(line: str) -> None:
    """One line to stderr, unbuffered (a signal's handler says lines too); a write that
    fails (a terminal gone) is dropped."""
    data = f"{line}\n".encode()
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(2, data) :]
