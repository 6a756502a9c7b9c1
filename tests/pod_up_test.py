"""jobs/pod_up.py, a slice brought up for launch.sh, against tests/fake_tpu_api.py through
the real client; the fake's clock is the one waited on (a wait advances it at once), so
hours of maintenance or backoff take no time: what it says, creates and deletes, and how
long each wait was, as functions of what Cloud TPU reports."""

import pytest

pytest.importorskip("google.cloud.tpu_v2")

from fake_tpu_api import INTERNAL, QUOTA, RATE_LIMIT, STOCKOUT, UNAUTHENTICATED, FakeTpuApi

from magic_jax.jobs import pod_up, tpu_api

SPEC = tpu_api.Spec(accelerator="v5p-16", runtime_version="v2-alpha-tpuv5", spot=True)


class FakeClock(pod_up.Clock):
    """The fake's time: a wait advances it (and is counted) instead of sleeping."""

    def __init__(self, fake):
        super().__init__()
        self.fake, self.naps = fake, []

    def now(self):
        return int(self.fake.now())

    def nap(self, seconds):
        self.naps.append(seconds)
        self.fake.advance(seconds)


@pytest.fixture
def fake():
    f = FakeTpuApi(scale=1.0, create_s=120.0, delete_s=60.0, hosts=4)
    f.start()
    yield f
    f.stop()


def _up(fake, **given):
    tpu = tpu_api.Tpu("p", "us-east5-a", endpoint=fake.url, poll_s=30, clock=fake.now,
                      sleep=fake.advance)  # fmt: skip
    said: list[str] = []
    given.setdefault("poll_s", 10)
    o = pod_up.Options(name="n", zone="us-east5-a", spec=SPEC, **given)
    return pod_up.Up(tpu, o, FakeClock(fake), said.append), said


def _verbs(fake):
    return [v for v, _ in fake.calls if v != "get-op"]


def test_code_13_and_a_rate_limit_are_tried_again_with_backoff_then_it_is_ready(fake):
    fake.script("create-node", INTERNAL, RATE_LIMIT)
    up, said = _up(fake)
    node = up.bring_up()
    assert node.state == "READY" and len(node.endpoints) == 4
    assert up.clock.naps == [60, 120]  # the backoff, doubling
    assert said[1] == (
        "no capacity for v5p-16 in us-east5-a (try 1 of 12): An internal error has occurred.;"
        " trying again in 1m00s"
    )
    assert said[3].startswith("rate-limited (try 2 of 12): Quota exceeded for quota metric")
    assert up.have_slice and up.created
    assert _verbs(fake).count("create-node") == 3 and "delete-node" not in _verbs(fake)


def test_no_capacity_gives_up_after_its_tries_in_one_line(fake):
    fake.script("create-node", STOCKOUT, STOCKOUT, STOCKOUT)
    up, _ = _up(fake, tries=3)
    with pytest.raises(pod_up.Stop) as stop:
        up.bring_up()
    assert stop.value.code == 1
    assert stop.value.line.startswith("no capacity for v5p-16 in us-east5-a after 3 tries")
    assert up.clock.naps == [60, 120] and not up.have_slice


def test_quota_ends_at_once_with_the_apis_message(fake):
    fake.script("create-node", QUOTA)
    up, _ = _up(fake)
    with pytest.raises(pod_up.Stop) as stop:
        up.bring_up()
    assert "out of quota, which no retry can fix: Quota limit 'TPUV5p" in stop.value.line
    assert up.clock.naps == []


def test_maintenance_of_two_hours_on_a_reused_slice_is_waited_for_never_deleted(fake):
    fake.add_node("n").body["runtimeVersion"] = "v2-alpha-tpuv5"
    fake.maintenance("n", at_s=0, for_s=7200)
    up, said = _up(fake, poll_s=60)
    node = up.bring_up()
    assert (node.state, node.health) == ("READY", "HEALTHY")
    assert said == [
        "reusing n (READY)",
        "n: READY (UNHEALTHY_MAINTENANCE): The TPU is undergoing maintenance.",
    ]
    assert sum(up.clock.naps) >= 7200 and not up.created  # no time limit on maintenance
    assert "delete-node" not in _verbs(fake) and "create-node" not in _verbs(fake)


def test_a_new_slice_not_ready_within_the_timeout_ends_the_launch_with_2(fake):
    fake.create_s = 0
    fake.add_node("n", state="REPAIRING").ready_at = 10**9  # (found REPAIRING: waited)
    up, _ = _up(fake, timeout_s=600)
    with pytest.raises(pod_up.Stop) as stop:
        up.bring_up()
    assert stop.value.code == 2 and stop.value.line == "n not READY after 600s: it is REPAIRING"


def test_a_node_still_deleting_is_waited_for_then_created(fake):
    node = fake.add_node("n")
    node.state, node.gone_at = "DELETING", fake.now() + 300
    up, said = _up(fake)
    up.bring_up()
    assert said[0] == "n is DELETING; waiting for it to go" and said[1] == "creating n (v5p-16)"
    assert 300 <= sum(up.clock.naps) < 600 and up.created


def test_a_queued_request_waits_for_capacity_then_is_active(fake):
    fake.qr_wait_s = 3600
    up, said = _up(fake, queued=True)
    node = up.bring_up()
    assert node.state == "READY"
    assert said[:2] == [
        "requesting n (v5p-16) as queued resource n-qr",
        "queued resource n-qr: WAITING_FOR_RESOURCES (waited 0s)",
    ]
    assert "queued resource n-qr: WAITING_FOR_RESOURCES (waited 10m00s)" in said  # every 60


def test_a_failed_request_past_its_valid_until_duration_is_not_requested_again(fake):
    fake.qr_wait_s = 7200
    spec = tpu_api.Spec(accelerator="v5p-16", runtime_version="v2", valid_until_s=600)
    tpu = tpu_api.Tpu("p", "us-east5-a", endpoint=fake.url, clock=fake.now, sleep=fake.advance)
    o = pod_up.Options(name="n", zone="z", spec=spec, queued=True, valid="10m", valid_s=600)
    said: list[str] = []
    up = pod_up.Up(tpu, o, FakeClock(fake), said.append)
    with pytest.raises(pod_up.Stop) as stop:
        up.bring_up()
    assert "FAILED after its --valid-until-duration 10m lapsed" in stop.value.line
    assert stop.value.line.endswith("; not requested again")
    assert [v for v, _ in fake.calls].count("create-qr") == 1


def test_credentials_that_lapse_in_a_wait_end_it_in_one_line(fake):
    fake.qr_wait_s = 10**6
    fake.script("get-qr", None, None, UNAUTHENTICATED)
    up, _ = _up(fake, queued=True)
    with pytest.raises(pod_up.Stop) as stop:
        up.bring_up()
    assert stop.value.line.startswith("asking Cloud TPU about n failed: ")
    assert "gcloud auth application-default login" in stop.value.line


def test_launch_clock_a_file_each_wait_advances(tmp_path):
    clock = pod_up.Clock(str(tmp_path / "clock"))
    assert clock.now() == 0  # (no file yet)
    clock.nap(60)
    clock.nap(120)
    assert clock.now() == 180 and (tmp_path / "clock").read_text() == "180\n"
