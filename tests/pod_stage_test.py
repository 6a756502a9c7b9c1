"""jobs/pod_stage.py, what launch.sh reads back from its stage: the workers' heartbeats in
one listing, the logs they kept, a local directory standing for the bucket, a
``gs://`` stage through the storage client (a fake of it here), and a bucket that
refuses told apart with its fix, the line the supervisor says."""

from types import SimpleNamespace

import pytest
from google.api_core import exceptions

from magic_jax import storage
from magic_jax.jobs import pod_stage

DENIED = (
    "GET https://storage.googleapis.com/storage/v1/b/b/o?prefix=s/beats/r-1/: "
    "run@p.iam.gserviceaccount.com does not have storage.objects.list access to the Google"
    " Cloud Storage bucket. Permission 'storage.objects.list' denied on resource (or it may"
    " not exist)."
)


class FakeClient:
    """The storage client's listing and reads over a dict of object names, counted."""

    def __init__(self, blobs: dict[str, bytes], error: Exception | None = None) -> None:
        self.blobs, self.error, self.listings, self.reads = blobs, error, [], 0

    def list_blobs(self, bucket, prefix, timeout, retry):
        self.listings.append((bucket, prefix))
        if self.error:
            raise self.error
        return [self._blob(n) for n in sorted(self.blobs) if n.startswith(prefix)]

    def _blob(self, name):
        def read(timeout, retry):
            self.reads += 1
            return self.blobs[name]

        return SimpleNamespace(name=name, download_as_bytes=read)


def test_the_heartbeats_of_a_local_stage_one_line_a_worker(tmp_path):
    beats = tmp_path / "beats" / "r-1"
    assert pod_stage.beats(str(beats)) == []  # none written yet
    beats.mkdir(parents=True)
    (beats / "worker-0").write_text("0 7 running boot-a\n")
    (beats / "worker-1").write_text("1 end exit-0 boot-b\n")
    (beats / "worker-x.part").write_text("garbage\n")  # not a heartbeat
    assert pod_stage.beats(str(beats)) == ["0 7 running boot-a", "1 end exit-0 boot-b"]


def test_a_gcs_stage_is_one_listing_then_its_heartbeats(monkeypatch):
    client = FakeClient(
        {
            "s/beats/r-1/worker-0": b"0 3 running b0\n",
            "s/beats/r-1/worker-1": b"1 3 running b1\n",
            "s/beats/r-1/old/worker-2": b"2 1 running b2\n",  # not right under it
            "s/beats/r-10/worker-0": b"0 9 running b9\n",  # another run
        }
    )
    monkeypatch.setattr(storage, "client", lambda: client)
    assert pod_stage.beats("gs://b/s/beats/r-1") == ["0 3 running b0", "1 3 running b1"]
    assert client.listings == [("b", "s/beats/r-1/")] and client.reads == 2


def test_a_bucket_that_refuses_is_one_line_with_the_role_to_grant(monkeypatch):
    client = FakeClient({}, exceptions.Forbidden(DENIED))
    monkeypatch.setattr(storage, "client", lambda: client)
    with pytest.raises(pod_stage.StageError) as e:
        pod_stage.beats("gs://b/s/beats/r-1")
    assert e.value.error.kind.value == "permission"
    assert e.value.error.line.startswith("403 run@p.iam.gserviceaccount.com does not have")
    assert e.value.error.fix == (
        "the permission storage.objects.list is missing: grant the caller roles/storage.objectUser"
    )
    assert e.value.error.say().endswith("grant the caller roles/storage.objectUser)")


def test_no_client_library_names_the_extra():
    error = pod_stage.unreadable(ImportError("No module named 'google.cloud.storage'"), "gs://b/s")
    assert error.kind.value == "other" and "pip install 'magic-jax[launch]'" in error.line


def test_kept_logs_fill_in_only_the_workers_whose_log_did_not_come(tmp_path):
    kept = tmp_path / "stage" / "logs" / "r-1"
    kept.mkdir(parents=True)
    for w in range(3):
        (kept / f"worker-{w}.log").write_text(f"kept log of worker {w}\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "worker-0.attempt-2.log").write_text("fetched by ssh\n")
    # 0 came by ssh, 3 kept nothing
    assert pod_stage.keep_logs(str(kept), logs, ".attempt-2", [0, 1, 2, 3]) == 2
    assert (logs / "worker-0.attempt-2.log").read_text() == "fetched by ssh\n"
    for w in (1, 2):
        assert (logs / f"worker-{w}.attempt-2.log").read_text() == f"kept log of worker {w}\n"
    assert not (logs / "worker-3.attempt-2.log").exists()
    assert pod_stage.keep_logs(str(kept), logs, ".attempt-2", [0, 1, 2]) == 0  # all here
