"""The run lock on Cloud Storage under faults, against a real GCS emulator (fake-gcs-server).

Each test ends with one owner of the lock and nothing written by the other
after its lease could have ended: a waiter whose wall clock runs ten minutes
ahead cannot take a live lock, and takes a silent one only after its holder
has stopped writing; a holder that cannot reach the bucket fences itself off
and exits 75; a renewal whose reply was lost (412 on the retry) keeps the
lock; and after a takeover the records, config and summary writes of the old
holder write nothing. Leases are 2 s, so the file takes about half a minute.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import requests
from conftest import GcsEmulator

from magic_jax import storage
from magic_jax.run import rundir, runlock
from magic_jax.run.monitor import Monitor, Records

# Timing is what these tests check (a 2 s lease, margins of tenths of a second): they run
# after the parallel part of the suite, not beside compiling tests.
pytestmark = pytest.mark.serial

LEASE = 2.0

# A run's lock holder, in a process of its own. "beats": it writes ``beat.txt`` after each
# ``check_fence``, printing a monotonic time for each beat written, and on the first
# refusal prints it and exits 75 as ``magic-jax train`` does; on "cut" from stdin its
# lease requests go to a dead endpoint while its beats still reach the bucket, so only
# the fence can stop them. "idle": it computes (sleeps) and writes nothing; its lease
# thread ends the process (status 75) when the lease is lost.
HOLDER = textwrap.dedent("""
    import sys, threading, time
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage as gcs
    from magic_jax import storage
    from magic_jax.run import runlock

    run, lease, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    cut = threading.Event()
    threading.Thread(target=lambda: sys.stdin.readline() and cut.set(), daemon=True).start()
    with runlock.GcsRunLock(run, lease_s=lease, exit_on_loss=mode == "idle") as lock:
        print("held", lock._owner, flush=True)
        n, was_cut = 0, False
        while True:
            if cut.is_set() and not was_cut:
                dead = gcs.Client(project="x", credentials=AnonymousCredentials(),
                                  client_options={"api_endpoint": "http://127.0.0.1:1"})
                bucket, key = storage.split(lock.uri)
                lock._blob = lambda: dead.bucket(bucket).blob(key)
                was_cut = True
                print("cut", time.monotonic(), flush=True)
            if mode == "beats":
                try:
                    runlock.check_fence("beat.txt")
                except runlock.LockLost as e:
                    print("fenced", time.monotonic(), flush=True)
                    print(e, file=sys.stderr, flush=True)
                    sys.exit(runlock.LOST_LOCK_EXIT)
                storage.write_text(run + "/beat.txt", str(n))
                print("beat", time.monotonic(), flush=True)
                n += 1
            time.sleep(0.05)
""")


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    # an emulator of this file's own: one test pauses it
    with GcsEmulator(tmp_path_factory.mktemp("gcs") / "emulator.log").in_env() as emulator:
        yield emulator


class Holder:
    """The ``HOLDER`` script in a process of its own; ``lines`` collects its stdout."""

    def __init__(self, run: str, mode: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, run, str(LEASE), mode],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ),
        )  # fmt: skip
        first = self.proc.stdout.readline().split()
        assert first[:1] == ["held"], self.proc.stderr.read() if self.proc.poll() else first
        self.owner = first[1]
        self.lines: list[list[str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.split())

    def times(self, tag: str) -> list[float]:
        return [float(w[1]) for w in list(self.lines) if w[0] == tag]

    def cut(self) -> None:
        self.proc.stdin.write("cut\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + 10
        while not self.times("cut"):
            assert time.monotonic() < deadline and self.proc.poll() is None
            time.sleep(0.01)

    def wait(self, timeout: float) -> tuple[int, str]:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return rc, self.proc.stderr.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _owner(run: str) -> str | None:
    return runlock.GcsRunLock(run)._read()[1].get("owner")


def _take(run: str) -> tuple[runlock.GcsRunLock, float]:
    """The lock of ``run`` taken over by this process, and when its last try began (a
    renewal sent before its holder went silent may still land once: a try refused)."""
    for _ in range(3):
        lock, start = runlock.GcsRunLock(run, lease_s=LEASE, exit_on_loss=False), time.monotonic()
        with contextlib.suppress(rundir.RunDirError):
            lock.acquire()
            return lock, start
    pytest.fail(f"{run}: never taken over")


def _generation(uri: str) -> int | None:
    bucket, key = storage.split(uri)
    blob = storage.client().bucket(bucket).get_blob(key)
    return None if blob is None else blob.generation


def test_a_waiter_whose_clock_runs_ahead_cannot_take_a_live_lock(gcs, monkeypatch):
    run = gcs.uri("skew")
    holder = Holder(run, "beats")
    try:
        # this process's wall clock runs 10 minutes ahead of the holder's
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 600)
        t0 = time.monotonic()
        with pytest.raises(rundir.RunDirError, match="renewed its lease while this one waited"):
            runlock.GcsRunLock(run, lease_s=LEASE, exit_on_loss=False).acquire()
        assert time.monotonic() - t0 < LEASE  # refused within a third of a lease or so
        assert _owner(run) == holder.owner and holder.proc.poll() is None

        # the holder stops renewing (cut off from the bucket) but keeps trying to write
        holder.cut()
        waiter, start = _take(run)
        took = time.monotonic()
        try:
            beat_at_takeover = _generation(run + "/beat.txt")
            assert took - start >= LEASE  # a whole lease without a new generation
            rc, err = holder.wait(timeout=20)
            assert rc == runlock.LOST_LOCK_EXIT, err
            assert "not writing beat.txt" in err and "could not renew the lease" in err, err
            (fenced,) = holder.times("fenced")
            beats = holder.times("beat")
            # it stopped writing before the waiter could have watched a lease go by ...
            assert beats and max(beats) < fenced < start + LEASE
            # ... so the beat the waiter found when it took over is the holder's last
            assert _generation(run + "/beat.txt") == beat_at_takeover
            assert _owner(run) == waiter._owner
            runlock.check_fence("anything", server=True)  # the waiter's own fence holds
        finally:
            waiter.release()
    finally:
        holder.kill()
    assert _owner(run) is None  # released


def test_a_holder_cut_off_from_the_bucket_stops_writing_and_exits_75(gcs):
    run, here = gcs.uri("paused"), gcs.uri("paused-here")
    holder = Holder(run, "idle")  # a run, in a process of its own
    lock = runlock.GcsRunLock(here, lease_s=LEASE, exit_on_loss=False)  # one in this process
    lock.acquire()
    try:
        time.sleep(LEASE / 2)  # a renewal or two go through
        runlock.check_fence("metrics.jsonl", server=True)
        stopped = time.monotonic()
        os.kill(gcs._proc.pid, signal.SIGSTOP)  # the bucket answers nothing, to anyone
        try:
            while True:  # the fence needs no answer from the bucket to close
                try:
                    runlock.check_fence("metrics.jsonl", server=True)
                except runlock.LockLost as e:
                    fenced = time.monotonic()
                    assert "could not renew the lease within" in str(e)
                    break
                assert time.monotonic() < stopped + 10
                time.sleep(0.01)
            rc, err = holder.wait(timeout=20)
            exited = time.monotonic()
        finally:
            os.kill(gcs._proc.pid, signal.SIGCONT)
        # the last renewals were sent before the pause: both stop writing a margin before
        # a lease from them ends, which is the earliest a waiter could take over; the run
        # is gone soon after (give or take one renewal request's time-out)
        assert fenced < stopped + LEASE * (1 - runlock.MARGIN) + 0.2
        assert rc == runlock.LOST_LOCK_EXIT, err
        assert "could not renew the lease" in err, err
        assert exited < stopped + LEASE + 0.5
    finally:
        holder.kill()
        lock.release()
    for uri, owner in ((run, holder.owner), (here, lock._owner)):
        assert _owner(uri) == owner  # nobody took it while nobody could reach it
    taker, start = _take(run)
    try:
        assert time.monotonic() - start >= LEASE
        assert _owner(run) == taker._owner
    finally:
        taker.release()


def test_a_renewal_whose_reply_was_lost_is_not_a_takeover(gcs, monkeypatch):
    run = gcs.uri("lost-reply")
    http = storage.client()._http
    real = http.request
    lost, answers = {"n": 0}, []

    def request(method, url, *args, **kw):
        # a lease write reaches the server; its reply does not reach us
        response = real(method, url, *args, **kw)
        if method == "POST" and "ifGenerationMatch=" in url:
            answers.append(response.status_code)
            if lost["n"] > 0:
                lost["n"] -= 1
                raise requests.exceptions.ConnectionError("connection reset (reply lost)")
        return response

    monkeypatch.setattr(http, "request", request)
    lock = runlock.GcsRunLock(run, lease_s=LEASE, exit_on_loss=False)
    lost["n"] = 1  # the creating write: the client's own retry gets 412
    lock.acquire()
    try:
        assert answers[:2] == [200, 412]
        assert _owner(run) == lock._owner and _generation(lock.uri) == lock._generation
        n = len(answers)
        lost["n"] = 1  # the next renewal: the lease thread retries it and gets 412
        deadline = time.monotonic() + 10
        while 412 not in answers[n:] or lock._generation != _generation(lock.uri):
            assert time.monotonic() < deadline, answers
            time.sleep(0.05)
        assert answers[n : n + 2] == [200, 412], answers
        time.sleep(LEASE)  # past the lease the lost reply's write began
        runlock.check_fence("metrics.jsonl", server=True)  # still ours
        assert lock._lost is None and _owner(run) == lock._owner
        with pytest.raises(rundir.RunDirError, match="renewed its lease while this one waited"):
            runlock.GcsRunLock(run, lease_s=LEASE, exit_on_loss=False).acquire()
    finally:
        lock.release()
    assert _owner(run) is None


def test_after_a_takeover_the_old_holders_writes_write_nothing(gcs):
    out = storage.path(rundir.claim_run_dir(gcs.uri("fenced"), what="output_dir"))
    # a long lease: no renewal notices the takeover during the test, only the fence
    lock = runlock.GcsRunLock(out, lease_s=60, exit_on_loss=False)
    lock.acquire()
    try:
        rundir.write_config(out, {"seed": 0})
        mon = Monitor(out, stage_steps=[4], tensorboard=False, bar=False, log=lambda s: None)
        mon.step({"step": 0, "stage": 0, "stage_step": 0, "rollout_tokens_per_s": 9.0}, "step 0")
        mon.flush()
        before = storage.listing(out)
        assert {rundir.CONFIG, rundir.METRICS} <= set(before)

        # another process judged the lease ended and took the run over
        taker = runlock.GcsRunLock(out, lease_s=60)
        gen, _ = taker._read()
        assert taker._write(gen)

        mon.step({"step": 1, "stage": 0, "stage_step": 1, "rollout_tokens_per_s": 9.0}, "step 1")
        with pytest.raises(runlock.LockLost, match=r"not writing metrics.jsonl.*another process"):
            mon.flush()
        with pytest.raises(runlock.LockLost, match="not writing config.yaml"):
            rundir.write_config(out, {"seed": 1})
        with pytest.raises(runlock.LockLost, match="not writing summary.json"):
            rundir.write_summary(out, {"steps": 2})
        records = Records(out / rundir.EVALS)
        records.append({"step": 1, "accuracy": 0.5})
        with pytest.raises(runlock.LockLost, match="not writing eval.jsonl"):
            records.flush()
        with pytest.raises(runlock.LockLost):
            runlock.check_fence("hf_final")  # lost for good, no need to ask again
        with pytest.raises(runlock.LockLost):
            mon.close()
        after = storage.listing(out)
        assert {k: v["generation"] for k, v in after.items() if k != rundir.LOCK} == {
            k: v["generation"] for k, v in before.items() if k != rundir.LOCK
        }
        assert json.loads(storage.path(lock.uri).read_text())["owner"] == taker._owner
    finally:
        lock.release()
    assert _owner(str(out)) == taker._owner  # the old holder deleted nothing of the new one's


def test_the_fence_is_free_without_a_lease(tmp_path, monkeypatch):
    def no_request(*a, **k):
        raise AssertionError("the fence asked Cloud Storage")

    monkeypatch.setattr(storage, "client", no_request)
    runlock.check_fence("metrics.jsonl", server=True)  # no lock: another process of a run
    with runlock.run_directory(tmp_path / "run") as out:  # a local flock
        runlock.check_fence("metrics.jsonl", server=True)
        rundir.write_summary(out, {"steps": 1})
    assert json.loads((tmp_path / "run" / rundir.SUMMARY).read_text()) == {"steps": 1}
