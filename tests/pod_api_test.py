"""jobs/pod_api.py, launch.sh's requests to Cloud TPU's API, against tests/fake_tpu_api.py:
one answer line each (``ok`` and its fields, or an error launch.sh's ``pod error`` reads
as it is), a create's options, and the process that answers a launch's requests."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("google.cloud.tpu_v2")

from fake_tpu_api import INTERNAL, QUOTA, FakeTpuApi

from magic_jax.jobs import pod, pod_api, tpu_api

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake():
    f = FakeTpuApi(scale=1000.0)
    f.start()
    yield f
    f.stop()


@pytest.fixture
def tpu(fake):
    return tpu_api.Tpu("p", "us-east5-a", endpoint=fake.url, poll_s=0.01, clock=fake.now)


def test_a_create_a_node_and_its_delete_answer_one_line_each(fake, tpu):
    words = ["create", "n", "accelerator=v5p-16", "runtime-version=v2", "spot=1", "network=vpc"]
    assert pod_api.answer(tpu, words) == "ok"
    assert fake.nodes["n"].body["schedulingConfig"] == {"spot": True}
    assert pod_api.answer(tpu, ["node", "n"]) == "ok\tREADY\tHEALTHY\t-\t10.0.0.1;10.0.0.2\tv2"
    fake.maintenance("n", at_s=0, for_s=60)
    state, health, why = pod_api.answer(tpu, ["poll", "n"]).split("\t")[1:4]
    assert (state, health) == ("READY", "UNHEALTHY_MAINTENANCE") and "maintenance" in why
    assert fake.calls[-1] == ("poll-node", "n")  # a status cycle's question, by its reason
    assert pod_api.answer(tpu, ["delete", "n", "wait-s=60"]) == "ok\t1"
    assert pod_api.answer(tpu, ["delete", "n"]) == "ok\t0"
    assert pod_api.answer(tpu, ["node", "n"]).split("\t")[1] == "GONE"


def test_an_error_is_the_line_launch_sh_reads_as_it_is(fake, tpu, tmp_path):
    fake.script("create-node", INTERNAL, QUOTA)
    words = ["create", "n", "accelerator=v5p-16", "runtime-version=v2"]
    for kind in ("capacity", "quota"):
        out = pod_api.answer(tpu, words)
        assert out.startswith(f"tpu-api-error\t{kind}\t")
        (tmp_path / "err").write_text(out + "\n")
        assert pod.answer(["error", str(tmp_path / "err")]).split("\t")[0] == kind
    assert pod_api.answer(tpu, ["create", "n", "color=red"]).startswith("tpu-api-error\tother\t")
    assert "unknown request" in pod_api.answer(tpu, ["resize", "n"])


def test_a_queued_request_and_its_failed_data(fake, tpu):
    fake.qr_wait_s, fake.qr_fail = 600, (60, INTERNAL)
    words = ["request-create", "n-qr", "n", "accelerator=v5p-16", "runtime-version=v2"]
    assert pod_api.answer(tpu, [*words, "valid-until-s=3600", "reservation=r"]) == "ok"
    assert pod_api.answer(tpu, ["request", "n-qr"]) == "ok\tWAITING_FOR_RESOURCES\t-\t-"
    fake.advance(60)
    assert pod_api.answer(tpu, ["request", "n-qr"]).split("\t") == [
        "ok",
        "FAILED",
        "capacity",
        "An internal error has occurred.",
    ]
    assert pod_api.answer(tpu, ["request-delete", "n-qr"]) == "ok\t1"


def test_the_serving_process_says_ready_then_answers_each_line(fake):
    env = dict(os.environ, MAGIC_JAX_TPU_API_ENDPOINT=fake.url, PYTHONPATH=str(ROOT))
    args = [sys.executable, "-m", "magic_jax.jobs.pod_api", "p", "z", "--serve", str(os.getpid())]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    out, _ = proc.communicate("node\tn\n\nnode\tn\n", timeout=60)
    ready, first, empty, second = out.splitlines()
    assert ready == "ready" and first == second and first.startswith("ok\tGONE")
    assert empty.startswith("tpu-api-error\tother\t")
