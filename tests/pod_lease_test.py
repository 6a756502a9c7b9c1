"""jobs/pod_lease.py, the one supervisor of a slice across machines: a lease held by a
live supervisor elsewhere is refused, one unrenewed for its time (or whose owner is a
process of this host that is gone) is taken over, a renewal finds a takeover, and only
its owner drops it; a stop request (--delete) is left by renewals and acknowledged by
its owner; the supervisor's keeper renews it from a thread and tells the supervisor of
a takeover. Against a local file standing for the stage's object."""

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from magic_jax.jobs import pod_lease, pod_run

ROOT = Path(__file__).resolve().parents[1]


def _held(path: Path, host: str, pid: int, age_s: float, stale_s: float = 60) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    d = {"host": host, "pid": pid, "renewed": time.time() - age_s, "stale_s": stale_s}
    path.write_text(json.dumps(d) + "\n")


def test_a_live_supervisor_elsewhere_keeps_it_a_stale_one_loses_it(tmp_path):
    uri = str(tmp_path / "supervisors" / "z" / "n")
    _held(Path(uri), "other-machine", 4242, age_s=10)
    held = pod_lease.take(uri, os.getpid(), 60)
    assert held is not None and held.owner() == "other-machine pid 4242"
    assert held.stale_s == 60 and 9 <= time.time() - held.renewed <= 11
    _held(Path(uri), "other-machine", 4242, age_s=61)  # unrenewed for longer than its 60 s
    assert pod_lease.take(uri, os.getpid(), 60) is None  # taken
    mine = json.loads(Path(uri).read_text())
    assert (mine["host"], mine["pid"]) == (socket.gethostname(), os.getpid())
    assert pod_lease.renew(uri, os.getpid(), 60) is None  # ours: renewed
    _held(Path(uri), "other-machine", 4343, age_s=0)  # taken over meanwhile
    assert pod_lease.renew(uri, os.getpid(), 60).owner() == "other-machine pid 4343"
    assert not pod_lease.drop(uri, os.getpid())  # not ours
    assert Path(uri).exists()


def test_a_gone_process_of_this_host_holds_nothing(tmp_path):
    uri = str(tmp_path / "lease")
    gone = subprocess.Popen(["true"])
    gone.wait()
    _held(Path(uri), socket.gethostname(), gone.pid, age_s=0)
    assert pod_lease.take(uri, os.getpid(), 60) is None
    assert pod_lease.drop(uri, os.getpid()) and not Path(uri).exists()


def test_the_supervisors_keeper_renews_it_and_tells_of_a_takeover(tmp_path):
    """The supervisor's keeper renews the lease every second from its own thread; when
    another host took it over, it names the owner and sends SIGUSR1 to the supervisor."""
    uri = str(tmp_path / "lease")
    told = []
    signal.signal(signal.SIGUSR1, lambda *_: told.append(1))
    keeper = pod_run.Keeper()
    try:
        assert pod_lease.take(uri, os.getpid(), 60) is None
        keeper.keep(uri, os.getpid(), 60, 1)
        keeper.start()
        first = json.loads(Path(uri).read_text())["renewed"]
        for _ in range(50):
            if json.loads(Path(uri).read_text())["renewed"] > first:
                break
            time.sleep(0.1)
        assert json.loads(Path(uri).read_text())["renewed"] > first  # renewed, unasked
        _held(Path(uri), "other-machine", 4242, age_s=0)
        for _ in range(50):
            if told:
                break
            time.sleep(0.1)
        assert told and keeper.lost == "other-machine pid 4242"
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    keeper.drop()
    assert json.loads(Path(uri).read_text())["host"] == "other-machine"  # not dropped: not ours


def test_a_stop_request_is_written_seen_by_the_renewal_and_acknowledged(tmp_path, monkeypatch):
    """launch.sh --delete on another machine writes a stop request into a live lease; the
    owner's renewal finds it (and leaves it), its keeper reports it once, and its end
    acknowledges it by deleting the lease. A stale lease, or none, is asked nothing."""
    uri = str(tmp_path / "lease")
    assert pod_lease.take(uri, os.getpid(), 60) is None
    monkeypatch.setenv("MAGIC_JAX_LAUNCH_HOST", "deleting-machine")  # (the test hook)
    asked, me = pod_lease.ask_stop(uri, 777), os.getpid()
    assert asked is not None and asked.owner() == f"{socket.gethostname()} pid {me}"
    d = json.loads(Path(uri).read_text())
    assert d["stop"] and (d["stop_host"], d["stop_pid"], d["pid"]) == ("deleting-machine", 777, me)
    monkeypatch.delenv("MAGIC_JAX_LAUNCH_HOST")
    held = pod_lease.renew(uri, os.getpid(), 60)
    assert held is not None and held.stop_by == "deleting-machine pid 777"
    assert json.loads(Path(uri).read_text())["stop"]  # not overwritten by the renewal
    assert not pod_lease.acknowledge(uri, 4242)  # not its own
    keeper = pod_lease.Keeper()
    keeper.keep(uri, os.getpid(), 60, 0)
    assert keeper.tick().stop_by == "deleting-machine pid 777" and keeper.asked == uri
    assert keeper.tick() is None and Path(uri).exists()  # reported once; kept until the end
    keeper.acknowledge()
    assert not Path(uri).exists() and not keeper.asked
    assert pod_lease.ask_stop(uri, 777) is None  # none
    _held(Path(uri), "other-machine", 4242, age_s=61)
    assert pod_lease.ask_stop(uri, 777) is None  # stale: its owner asked nothing
    assert "stop" not in json.loads(Path(uri).read_text())


class FakeBucket:
    """The storage client's blobs of one bucket with generations and their preconditions
    (``if_generation_match``: 0 for an absent object), as Cloud Storage keeps them."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, int]] = {}
        self.generation = 0

    def bucket(self, name):
        assert name == "b"
        return self

    def get_blob(self, key, timeout):
        if key not in self.objects:
            return None
        return _Blob(self, key, self.objects[key][1])

    def blob(self, key):
        return _Blob(self, key, None)


class _Blob:
    def __init__(self, bucket, key, generation):
        self.bucket, self.key, self.generation = bucket, key, generation

    def _check(self, generation):
        from google.api_core import exceptions

        if self.bucket.objects.get(self.key, (b"", 0))[1] != generation:
            raise exceptions.PreconditionFailed("conditionNotMet")

    def download_as_bytes(self, if_generation_match):
        self._check(if_generation_match)
        return self.bucket.objects[self.key][0]

    def upload_from_string(self, text, if_generation_match, timeout):
        self._check(if_generation_match)
        self.bucket.generation += 1
        self.bucket.objects[self.key] = (text.encode(), self.bucket.generation)

    def delete(self, if_generation_match):
        self._check(if_generation_match)
        del self.bucket.objects[self.key]


def test_on_cloud_storage_a_write_that_lost_the_race_reads_the_winner(monkeypatch):
    from magic_jax import storage

    fake = FakeBucket()
    monkeypatch.setattr(storage, "client", lambda: fake)
    uri = "gs://b/stage/supervisors/z/n"
    assert pod_lease.take(uri, os.getpid(), 60) is None  # created: generation 0 matched
    assert json.loads(fake.objects["stage/supervisors/z/n"][0])["pid"] == os.getpid()
    assert not pod_lease.write_record(uri, "{}", 0)  # it exists: a create loses
    other = json.dumps({"host": "other-machine", "pid": 7, "renewed": time.time(), "stale_s": 60})
    real = pod_lease.read_record

    def raced(u):  # another machine writes between this one's read and its write
        text, generation = real(u)
        fake.objects["stage/supervisors/z/n"] = (other.encode(), generation + 100)
        return text, generation

    monkeypatch.setattr(pod_lease, "read_record", raced)
    held = pod_lease.renew(uri, os.getpid(), 60)
    assert held is not None and held.owner() == "other-machine pid 7"
    monkeypatch.setattr(pod_lease, "read_record", real)
    assert not pod_lease.drop(uri, os.getpid()) and "stage/supervisors/z/n" in fake.objects
