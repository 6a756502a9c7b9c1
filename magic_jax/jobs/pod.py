"""What ``tpu_scripts/launch.sh`` asks of Python, one question a call, answers on one line
of tab-separated fields: ``jobs/pod_decide.py``'s decisions (while the command runs, and
once an attempt of it ended), ``jobs/pod_errors.py``'s verdict on an error. Standard
library only: it runs with the launching machine's ``python3`` and this checkout on
``PYTHONPATH``. (Creates and their retries are ``jobs/pod_up.py``'s.)

  python3 -m magic_jax.jobs.pod node STATE HEALTH [REQUEST]  -> ready|wait|lost, why
  python3 -m magic_jax.jobs.pod decide LOST_AFTER_S < lines  -> action, workers, status,
                                                                alive, why
  python3 -m magic_jax.jobs.pod attempt < lines              -> rerun|recreate|stop,
                                                                code, line
  python3 -m magic_jax.jobs.pod error FILE                   -> kind, line

``decide`` reads ``node STATE HEALTH REQUEST``, then ``worker N STATUS SILENT_S
RESTARTED`` for each worker, then (once the silent ones were asked) ``asked`` and
``answer N STATUS RESTARTED`` for each that answered; ``-`` stands for an empty field,
RESTARTED is 1 or 0. ``attempt`` reads ``KEY VALUE`` lines: ``status``, ``restarted``
and ``stopped`` (worker numbers), ``failed N STATUS``, ``lost WHY``, ``kind KIND``,
``budget ATTEMPT RETRY``, ``name``, ``logs`` and ``grace`` (``jobs/pod_decide.py``'s
``after_attempt``); a key left out is its default. ``error`` reads an error's text from
FILE: gcloud's, or the line ``jobs/pod_api.py`` told it in.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

from magic_jax.jobs import pod_decide, pod_errors


def _field(value: str) -> str:
    return "" if value == "-" else value


def _node(words: list[str]) -> pod_decide.Slice:
    state, health, request = ([*map(_field, words), "", "", ""])[:3]
    return pod_decide.Slice(state=state, health=health, request=request)


def decide(lines: Iterable[str], lost_after_s: float) -> pod_decide.Decision:
    """The decision for ``decide``'s input lines (the module's docstring)."""
    node = pod_decide.Slice(state="")
    workers: list[pod_decide.Worker] = []
    answers: dict[int, pod_decide.Worker] | None = None
    for line in lines:
        kind, *words = line.split() or [""]
        if kind == "node":
            node = _node(words)
        elif kind == "asked":
            answers = {}
        elif kind in ("worker", "answer") and len(words) >= 3:
            index, status = int(words[0]), _field(words[1])
            silent = float(words[2]) if kind == "worker" else 0.0
            w = pod_decide.Worker(
                index=index, status=status, silent_s=silent, restarted=words[-1] == "1"
            )
            if kind == "worker":
                workers.append(w)
            elif answers is not None:
                answers[index] = w
    return pod_decide.decide(node, workers, lost_after_s=lost_after_s, answers=answers)


def _given(lines: Iterable[str]) -> dict[str, str]:
    given: dict[str, str] = {}
    for line in lines:
        key, _, value = line.rstrip("\n").partition(" ")
        given[key] = value
    return given


def attempt(lines: Iterable[str]) -> pod_decide.Next:
    """The verdict for ``attempt``'s input lines (the module's docstring)."""
    given = _given(lines)
    failed = given.get("failed", "").split()
    outcome = pod_decide.Outcome(
        status=given.get("status", "0") or "0",
        restarted=tuple(map(int, given.get("restarted", "").split())),
        failed=int(failed[0]) if failed else None,
        failed_status=failed[1] if len(failed) > 1 else "",
        stopped=tuple(map(int, given.get("stopped", "").split())),
        lost=given.get("lost", ""),
        kind=given.get("kind", "") or "preempted",
    )
    number, retry = (int(x) for x in given.get("budget", "1 0").split())
    return pod_decide.after_attempt(
        outcome,
        attempt=number,
        retry=retry,
        name=given.get("name", ""),
        logs=given.get("logs", ""),
        grace_s=given.get("grace", ""),
    )


def answer(argv: list[str], stdin: Iterable[str] = ()) -> str:
    """The one line ``launch.sh`` reads for ``argv`` (the module's docstring)."""
    command, *args = argv
    if command == "node":
        node = _node(args)
        verdict = "lost" if node.lost() else "ready" if node.ready() else "wait"
        return f"{verdict}\t{node.lost() or node.describe()}"
    if command == "decide":
        d = decide(stdin, float(args[0]))
        fields = (" ".join(map(str, d.workers)), d.status, " ".join(map(str, d.alive)))
        return "\t".join((d.action.value, *(f or "-" for f in fields), d.why or "-"))
    if command == "error":
        error = pod_errors.classify(Path(args[0]).read_text(errors="replace"))
        return f"{error.kind.value}\t{error.say()}"
    if command == "attempt":
        n = attempt(stdin)
        return f"{n.action.value}\t{n.code}\t{n.line}"
    raise SystemExit(f"pod.py: unknown question {command!r} (see its docstring)")


if __name__ == "__main__":
    print(
        answer(
            sys.argv[1:],
            sys.stdin if sys.argv[1:2] in (["decide"], ["attempt"]) else (),
        )
    )
