"""jobs/tpu_api.py through the real Cloud TPU client (REST, anonymous credentials)
against tests/fake_tpu_api.py: node state and health, creates and deletes with their
operations, queued resources with failedData, and each error as the API returns it."""

import pytest

pytest.importorskip("google.cloud.tpu_v2")

from fake_tpu_api import (
    INTERNAL,
    PERMISSION,
    QUOTA,
    RATE_LIMIT,
    STOCKOUT,
    UNAUTHENTICATED,
    FakeTpuApi,
)

from magic_jax.jobs import pod_errors, tpu_api
from magic_jax.jobs.pod_errors import Kind

SPEC = tpu_api.Spec(accelerator="v5p-16", runtime_version="v2-alpha-tpuv5")


@pytest.fixture
def fake():
    f = FakeTpuApi(scale=1000.0, create_s=120.0, delete_s=60.0)
    f.start()
    yield f
    f.stop()


@pytest.fixture
def tpu(fake):
    # deadlines on the fake's clock; polls of operations 0.02 s (20 fake seconds)
    return tpu_api.Tpu("p", "us-east5-a", endpoint=fake.url, poll_s=0.02, clock=fake.now)


def _error(call) -> pod_errors.TpuError:
    with pytest.raises(tpu_api.TpuApiError) as e:
        call()
    return e.value.error


def test_a_create_waits_for_its_operation_then_the_node_is_ready(fake, tpu):
    assert tpu.node("n").state == "GONE"
    spec = tpu_api.Spec(
        accelerator="v5p-16",
        runtime_version="v2-alpha-tpuv5",
        spot=True,
        service_account="sa@p.iam.gserviceaccount.com",
        network="net",
        subnetwork="sub",
        internal_ip=True,
    )
    tpu.create_node("n", spec)
    node = tpu.node("n")
    assert (node.state, node.health, node.runtime_version) == ("READY", "HEALTHY", "v2-alpha-tpuv5")
    assert node.endpoints == ("10.0.0.1", "10.0.0.2")
    body = fake.nodes["n"].body  # what reached the API, in its JSON names
    assert body["acceleratorType"] == "v5p-16" and body["schedulingConfig"] == {"spot": True}
    assert body["serviceAccount"] == {"email": "sa@p.iam.gserviceaccount.com"}
    assert body["networkConfig"] == {"network": "net", "subnetwork": "sub"}  # no external IPs
    assert [v for v, _ in fake.calls][:2] == ["get-node", "create-node"]
    assert "get-op" in [v for v, _ in fake.calls]  # the operation was asked until done


def test_maintenance_is_ready_with_unhealthy_health(fake, tpu):
    fake.add_node("n")
    fake.maintenance("n", at_s=0, for_s=7200)  # two hours, every host
    node = tpu.node("n")
    assert (node.state, node.health) == ("READY", "UNHEALTHY_MAINTENANCE")
    assert "maintenance" in node.health_description


def test_a_delete_waits_for_the_node_to_go(fake, tpu):
    fake.add_node("n")
    assert tpu.delete_node("n") is True
    assert tpu.node("n").state == "GONE"
    assert tpu.delete_node("n") is False  # NOT_FOUND: nothing to delete


def test_a_stuck_delete_times_out_and_the_next_create_says_it_exists(fake, tpu):
    fake.add_node("n")
    fake.stuck_delete_s = 600
    err = _error(lambda: tpu.delete_node("n", wait_s=100))
    assert err.kind is Kind.OTHER and "not done after 100s" in err.line
    assert tpu.node("n").state == "DELETING"
    err = _error(lambda: tpu.create_node("n", SPEC))
    assert err.kind is Kind.EXISTS and err.line.endswith("nodes/n' already exists")


@pytest.mark.parametrize(
    ("error", "kind", "retried"),
    [
        (STOCKOUT, Kind.CAPACITY, True),  # the operation's error: code 8
        (INTERNAL, Kind.CAPACITY, True),  # code 13, as Spot stockouts also come
        (RATE_LIMIT, Kind.RATE_LIMIT, True),  # HTTP 429, requests per minute
        (QUOTA, Kind.QUOTA, False),  # HTTP 429 too, a resource quota: fatal
        (UNAUTHENTICATED, Kind.AUTH, False),
        (PERMISSION, Kind.PERMISSION, False),
    ],
)
def test_each_create_error_is_told_apart_as_the_api_returns_it(fake, tpu, error, kind, retried):
    fake.script("create-node", error)
    err = _error(lambda: tpu.create_node("n", SPEC))
    assert (err.kind, err.retried) == (kind, retried), err
    # (a 401 makes the client refresh its credentials: google.auth's error comes instead)
    said = "cannot be refreshed" if error is UNAUTHENTICATED else error.message[:40]
    assert said in err.line and "http://" not in err.line
    assert tpu.node("n").state == "GONE"  # a create that failed leaves no node here


def test_auth_and_permission_errors_name_the_fix(fake, tpu):
    fake.script("get-node", UNAUTHENTICATED, PERMISSION)
    assert "gcloud auth application-default login" in _error(lambda: tpu.node("n")).say()
    err = _error(lambda: tpu.node("n"))
    assert "tpu.nodes.create" in err.say() and "roles/tpu.admin" in err.say()


def test_a_rate_limit_is_told_by_its_reason_too(fake, tpu):
    from fake_tpu_api import Error

    terse = Error("RESOURCE_EXHAUSTED", "Too many requests.", reason="RATE_LIMIT_EXCEEDED")
    fake.script("get-node", terse)
    assert _error(lambda: tpu.node("n")).kind is Kind.RATE_LIMIT


def test_a_queued_request_waits_then_is_active_with_its_node(fake, tpu):
    fake.qr_wait_s = 3600
    spec = tpu_api.Spec(accelerator="v5p-16", runtime_version="v2", spot=True, valid_until_s=7200)
    tpu.create_request("n-qr", "n", spec)
    body = fake.queued["n-qr"]
    assert body.node_body["acceleratorType"] == "v5p-16"
    assert tpu.request("n-qr").state == "WAITING_FOR_RESOURCES"
    assert tpu.node("n").state == "GONE"
    fake.advance(3700)  # an hour later
    assert [r.state for r in tpu.requests()] == ["ACTIVE"]
    assert tpu.node("n").state == "READY"
    assert tpu.delete_request("n-qr") is True  # with its node (force)
    assert tpu.node("n").state == "GONE" and tpu.request("n-qr").state == "GONE"


def test_a_failed_request_shows_its_failed_data(fake, tpu):
    fake.qr_wait_s, fake.qr_fail = 3600, (60, STOCKOUT)
    tpu.create_request("n-qr", "n", SPEC)
    fake.advance(100)
    r = tpu.request("n-qr")
    assert (r.state, r.failed_code) == ("FAILED", 8)
    assert r.failure().kind is Kind.CAPACITY and "no more capacity" in r.failure().line


def test_a_request_that_lapses_fails_with_its_deadline(fake, tpu):
    fake.qr_wait_s = 7200
    tpu.create_request("n-qr", "n", tpu_api.Spec(accelerator="v5p-16", runtime_version="v2",
                                                  valid_until_s=600))  # fmt: skip
    fake.advance(700)
    r = tpu.request("n-qr")
    assert r.state == "FAILED" and "lapsed" in r.failure().line


def test_a_request_already_queued_says_it_exists(fake, tpu):
    tpu.create_request("n-qr", "n", SPEC)
    assert _error(lambda: tpu.create_request("n-qr", "n", SPEC)).kind is Kind.EXISTS


def test_best_effort_needs_the_alpha_api_the_fake_does_not_serve(tpu):
    spec = tpu_api.Spec(accelerator="v5p-16", runtime_version="v2", best_effort=True)
    err = _error(lambda: tpu.create_request("n-qr", "n", spec))
    assert err.kind is Kind.OTHER and "v2alpha1" in err.line


def test_preempted_and_suspended(fake, tpu):
    fake.add_node("n")
    fake.preempt("n")
    assert tpu.node("n").state == "PREEMPTED"
    tpu.create_request("m-qr", "m", SPEC)
    assert tpu.request("m-qr").state == "ACTIVE"
    fake.preempt("m")
    assert tpu.request("m-qr").state == "SUSPENDING" and tpu.node("m").state == "GONE"
    fake.advance(50)
    assert tpu.request("m-qr").state == "SUSPENDED"


def test_an_unreachable_endpoint_is_an_error_not_a_crash():
    tpu = tpu_api.Tpu("p", "z", endpoint="http://127.0.0.1:9")
    err = _error(lambda: tpu.node("n"))
    assert err.kind in (Kind.CAPACITY, Kind.OTHER) and err.line
