"""jobs/pod_lease.py, the one supervisor of a slice across machines: a lease held by a
live supervisor elsewhere is refused, one unrenewed for its time (or whose owner is a
process of this host that is gone) is taken over, a renewal finds a takeover, and only
its owner drops it; the serving jobs/pod_api.py renews it and tells its supervisor of a
takeover. Against a local file standing for the stage's object."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_tpu_api import FakeTpuApi

from magic_jax.jobs import pod_api, pod_lease

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
    words = ["lease-take", uri, str(os.getpid()), "60"]
    kind, owner, age, stale = pod_api.answer(None, words).split("\t")[1:]
    assert (kind, owner, stale) == ("held", "other-machine pid 4242", "60") and 9 <= int(age) <= 11
    _held(Path(uri), "other-machine", 4242, age_s=61)  # unrenewed for longer than its 60 s
    assert pod_api.answer(None, words) == "ok\ttaken"
    mine = json.loads(Path(uri).read_text())
    assert (mine["host"], mine["pid"]) == (socket.gethostname(), os.getpid())
    assert pod_lease.renew(uri, os.getpid(), 60) is None  # ours: renewed
    _held(Path(uri), "other-machine", 4343, age_s=0)  # taken over meanwhile
    assert pod_lease.renew(uri, os.getpid(), 60).owner() == "other-machine pid 4343"
    assert pod_api.answer(None, ["lease-drop", uri, str(os.getpid())]) == "ok\t0"  # not ours
    assert Path(uri).exists()


def test_a_gone_process_of_this_host_holds_nothing(tmp_path):
    uri = str(tmp_path / "lease")
    gone = subprocess.Popen(["true"])
    gone.wait()
    _held(Path(uri), socket.gethostname(), gone.pid, age_s=0)
    assert pod_lease.take(uri, os.getpid(), 60) is None
    assert pod_lease.drop(uri, os.getpid()) and not Path(uri).exists()


def test_the_serving_process_renews_it_and_tells_of_a_takeover(tmp_path):
    """The serving process renews the lease every second; when another host took it over,
    it writes the owner to the LOST file and sends SIGUSR1 to the supervisor."""
    pytest.importorskip("google.cloud.tpu_v2")
    uri, lost = tmp_path / "lease", tmp_path / "lost"
    told = []
    signal.signal(signal.SIGUSR1, lambda *_: told.append(1))
    fake = FakeTpuApi()
    fake.start()
    env = dict(os.environ, PYTHONPATH=str(ROOT), MAGIC_JAX_TPU_API_ENDPOINT=fake.url)
    args = [sys.executable, "-m", "magic_jax.jobs.pod_api", "p", "z", "--serve", str(os.getpid())]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.stdin.write(f"lease-take\t{uri}\t{os.getpid()}\t60\t1\t{lost}\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "ok\ttaken\n"
        first = json.loads(uri.read_text())["renewed"]
        for _ in range(50):
            if json.loads(uri.read_text())["renewed"] > first:
                break
            time.sleep(0.1)
        assert json.loads(uri.read_text())["renewed"] > first  # renewed, unasked
        _held(uri, "other-machine", 4242, age_s=0)
        for _ in range(50):
            if told:
                break
            time.sleep(0.1)
        assert told and lost.read_text() == "other-machine pid 4242\n"
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        fake.stop()
    assert json.loads(uri.read_text())["host"] == "other-machine"  # not dropped: not ours


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
