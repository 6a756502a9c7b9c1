"""``tpu_scripts/launch.sh``'s calls to Cloud TPU (``jobs/tpu_api.py``), one request a
line of tab-separated words, one answer a line: ``ok`` and the fields, or
``jobs/pod_errors.py``'s ``told`` line (``tpu-api-error``, kind, line, fix) that
``python3 -m magic_jax.jobs.pod error|create`` reads as it is.

  python -m magic_jax.jobs.pod_api PROJECT ZONE REQUEST...   one request, its answer
  python -m magic_jax.jobs.pod_api PROJECT ZONE --serve PID   ``ready``, then requests on
                                                              stdin, answers on stdout,
                                                              while PID is its parent

  node NAME                         -> ok STATE HEALTH HEALTH_DESCRIPTION IPS RUNTIME
  poll NAME                         -> the same, asked by a status cycle (its reason)
  create NAME KEY=VALUE...          -> ok              (waits for its operation)
  delete NAME [wait-s=S]            -> ok 1|0          (0: there was none)
  request QR                        -> ok STATE KIND LINE   (KIND, LINE: its failedData)
  request-create QR NODE KEY=VALUE  -> ok
  request-delete QR [wait-s=S]      -> ok 1|0
  beats PREFIX                      -> ok LINE...   (every worker's heartbeat under the
                                                     stage's PREFIX: jobs/pod_stage.py)
  logs PREFIX DIR SUFFIX W...       -> ok N     (PREFIX/worker-W.log to DIR/worker-W
                                                 SUFFIX.log where DIR has none: N copied)
  lease-take URI PID STALE_S [EVERY_S LOST]  -> ok taken | ok held OWNER AGE_S STALE_S
  lease-drop URI PID                -> ok 1|0

A lease (``jobs/pod_lease.py``) taken by the serving process is renewed by it every EVERY_S
until dropped or its parent ends; when another supervisor took it over, the owner is
written to the file LOST and PID gets SIGUSR1.

A node NOT_FOUND is ``GONE``; IPS are the workers' addresses, ``;``-separated. The keys
of a create are ``tpu_api.Spec``'s fields, dashed: ``accelerator``, ``runtime-version``,
``spot``, ``reserved``, ``best-effort``, ``reservation``, ``valid-until-s``,
``service-account``, ``network``, ``subnetwork``, ``internal-ip`` (booleans ``1``), and
``wait-s``, the longest wait for the operation. Empty fields are ``-``.
"""

from __future__ import annotations

import dataclasses
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterable

from magic_jax.jobs import pod_errors, pod_lease, pod_stage, tpu_api

_FLAGS = ("spot", "reserved", "best_effort", "internal_ip")


def spec(words: Iterable[str]) -> tuple[tpu_api.Spec, float]:
    """A create's ``KEY=VALUE`` words as the slice's spec and the longest wait."""
    given = dict(w.partition("=")[::2] for w in words)
    fields = {f.name for f in dataclasses.fields(tpu_api.Spec)}
    values: dict[str, object] = {}
    for key, value in given.items():
        name = key.replace("-", "_")
        if name == "wait_s":
            continue
        if name not in fields:
            raise ValueError(f"pod_api.py: unknown key {key!r} of a create (see its docstring)")
        values[name] = value == "1" if name in _FLAGS else value
    if "valid_until_s" in values:
        values["valid_until_s"] = int(str(values["valid_until_s"]) or 0)
    return tpu_api.Spec(**values), _wait_s(words)  # type: ignore[arg-type]


def _wait_s(words: Iterable[str]) -> float:
    """The ``wait-s=S`` of a request's words (3600 without one)."""
    given = dict(w.partition("=")[::2] for w in words)
    return float(given.get("wait-s") or 3600)


def _fields(*values: object) -> str:
    return "\t".join(("ok", *(str(v).replace("\t", " ").replace("\n", " ") or "-" for v in values)))


def answer(tpu: tpu_api.Tpu, words: list[str], keeper: Keeper | None = None) -> str:
    """The answer line to one request (the module's docstring); ``keeper``: the serving
    process's, which renews a lease it took."""
    verb, *args = words
    try:
        if verb.startswith("lease-"):
            return _lease(verb, args, keeper)
        if verb in ("node", "poll"):
            n = tpu.node(args[0], reason="status cycle" if verb == "poll" else "")
            ips = ";".join(n.endpoints)
            return _fields(n.state, n.health, n.health_description, ips, n.runtime_version)
        if verb == "create":
            s, wait_s = spec(args[1:])
            tpu.create_node(args[0], s, wait_s=wait_s)
            return "ok"
        if verb == "delete":
            return _fields(int(tpu.delete_node(args[0], wait_s=_wait_s(args[1:]))))
        if verb == "request":
            r = tpu.request(args[0])
            failure = r.failure() if r.state == "FAILED" else None
            kind, line = (failure.kind.value, failure.say()) if failure else ("", "")
            return _fields(r.state, kind, line)
        if verb == "request-create":
            s, _ = spec(args[2:])
            tpu.create_request(args[0], args[1], s)
            return "ok"
        if verb == "request-delete":
            return _fields(int(tpu.delete_request(args[0], wait_s=_wait_s(args[1:]))))
        if verb == "beats":
            return _fields(*pod_stage.beats(args[0]))
        if verb == "logs":
            return _fields(pod_stage.keep_logs(args[0], args[1], args[2], map(int, args[3:])))
    except (tpu_api.TpuApiError, pod_stage.StageError) as e:
        return pod_errors.told(e.error)
    except pod_lease.LeaseError as e:
        return pod_errors.told(pod_stage.unreadable(e.__cause__ or e, args[0]))
    except (IndexError, ValueError, TypeError) as e:
        return pod_errors.told(pod_errors.TpuError(pod_errors.Kind.OTHER, f"{words}: {e}"))
    line = f"pod_api.py: unknown request {verb!r} (see its docstring)"
    return pod_errors.told(pod_errors.TpuError(pod_errors.Kind.OTHER, line))


class Keeper(pod_lease.Keeper):
    """A lease renewed by the serving process, in a thread of its own (a request of
    minutes, a delete waited for, does not hold it up); a takeover written to ``lost``
    and told to the supervisor by SIGUSR1."""

    lost = ""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def start(self) -> None:
        """Renews from now on, checking twice a second whether it is due."""
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            with self.lock:
                self.watch()

    def watch(self) -> None:
        """Renews when due; on a takeover, tells the supervisor."""
        other = self.tick()
        if other is not None and self.lost:
            with open(self.lost, "w") as out:
                out.write(other.owner() + "\n")
            os.kill(self.pid, signal.SIGUSR1)


def _lease(verb: str, args: list[str], keeper: Keeper | None) -> str:
    uri, pid = args[0], int(args[1])
    if verb == "lease-drop":
        if keeper is not None:
            with keeper.lock:
                keeper.uri = "" if keeper.uri == uri else keeper.uri
        try:
            return _fields(int(pod_lease.drop(uri, pid)))
        except Exception as e:  # every failure of the bucket is a line launch.sh shows
            raise pod_lease.LeaseError(uri) from e
    if verb != "lease-take":
        raise ValueError(f"unknown request {verb!r}")
    stale_s = float(args[2])
    try:
        held = pod_lease.take(uri, pid, stale_s)
    except Exception as e:  # every failure of the bucket is a line launch.sh shows
        raise pod_lease.LeaseError(uri) from e
    if held is not None:
        return _fields("held", held.owner(), int(time.time() - held.renewed), int(held.stale_s))
    if keeper is not None and len(args) > 4:
        with keeper.lock:
            keeper.keep(uri, pid, stale_s, float(args[3]))
            keeper.lost = args[4]
    return _fields("taken")


def serve(tpu: tpu_api.Tpu, parent: int) -> None:
    """Says ``ready`` once the client is made (credentials found), else the error's
    ``told`` line; then answers requests from stdin until it ends or the process
    ``parent`` is no longer its parent (it ended)."""
    try:
        tpu.client()
    except tpu_api.TpuApiError as e:
        print(pod_errors.told(e.error), flush=True)
        return
    print("ready", flush=True)
    keeper = Keeper()
    keeper.start()
    try:
        while True:
            ready, _, _ = select.select([sys.stdin], [], [], 1.0)
            if not ready:
                if os.getppid() != parent:  # (reparented: its parent ended, a zombie or gone)
                    return
                continue
            line = sys.stdin.readline()
            if not line:
                return
            words = line.rstrip("\n").split("\t")
            out = answer(tpu, words, keeper) if words[0] else pod_errors.told(_empty())
            print(out, flush=True)
    finally:
        with keeper.lock:
            keeper.release()  # (its supervisor ended)


def _empty() -> pod_errors.TpuError:
    return pod_errors.TpuError(pod_errors.Kind.OTHER, "pod_api.py: an empty request")


def main(argv: list[str]) -> int:
    """Runs the command line (the module's docstring); 1 when the answer is an error."""
    if len(argv) < 3:
        raise SystemExit(__doc__)
    tpu = tpu_api.Tpu(argv[0], argv[1], poll_s=float(os.environ.get("LAUNCH_API_POLL_S", 5)))
    if argv[2] == "--serve":
        serve(tpu, int(argv[3]))
        return 0
    out = answer(tpu, argv[2:])
    print(out)
    return 0 if out.startswith("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
