"""A flaky bucket: the GCS emulator behind ``faultproxy.FaultProxy``.

The proxy itself (seeded, reproducible fates; each fault kind as clients meet it),
the fixes the fault campaign (``tests/campaign.py``, ``make campaign``) found, each
with the fault placed where it bit, and one seed of the campaign itself (slow).
"""

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from conftest import GcsEmulator
from faultproxy import FaultProxy

from magic_jax import storage


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    root = tmp_path_factory.mktemp("gcs-faults")
    with GcsEmulator(root / "emulator.log").in_env() as emu:
        yield emu


def _objects(emulator, prefix):
    return sorted(storage.listing(prefix)) if storage.gcs_fs().exists(prefix) else []


def _put(uri, names):
    fs = storage.gcs_fs()
    for name in names:
        fs.pipe_file(f"{uri}/{name}", name.encode())


def test_fates_are_seeded_and_independent_of_request_order(emulator):
    rates = {"503": 0.2, "lost": 0.1}
    targets = [("GET", f"/storage/v1/b/x/o/{i}") for i in range(200)] * 2
    a = FaultProxy(emulator.url, seed=3, rates=rates)
    b = FaultProxy(emulator.url, seed=3, rates=rates)
    c = FaultProxy(emulator.url, seed=4, rates=rates)
    try:
        fa = [a.fate(m, t) for m, t in targets]
        # the same requests in another interleaving (each path's repeats still in their
        # order, as a client's retries are) meet the same fates, request by request
        order = sorted(range(len(targets)), key=lambda i: (targets[i][1][::-1], i))
        fb = dict(zip(order, (b.fate(*targets[i]) for i in order), strict=True))
        assert fa == [fb[i] for i in range(len(targets))]
        assert fa != [c.fate(m, t) for m, t in targets]
        n = len(targets)
        assert 0.1 * n < sum(f == "503" for f in fa) < 0.3 * n  # 20% of 400: 80 +- 8
        assert a.summary()["faults"] == sum(f is not None for f in fa)
    finally:
        for p in (a, b, c):
            p.stop()


def test_each_fault_kind_as_a_client_meets_it(emulator):
    uri = emulator.uri("kinds")
    _put(uri, ["a"])
    bucket, key = storage.split(f"{uri}/a")
    url = f"/storage/v1/b/{bucket}/o/{urllib.request.quote(key, safe='')}?alt=media"
    with FaultProxy(emulator.url, seed=0, rates={}, stall_s=0.3) as proxy:
        for kind in ("429", "503"):
            proxy.once(kind, "GET", url)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(proxy.url + url, timeout=10)
            assert e.value.code == int(kind)
            assert json.loads(e.value.read())["error"]["code"] == int(kind)
        for kind in ("reset", "lost", "cut"):
            proxy.once(kind, "GET", url)
            with pytest.raises((ConnectionError, urllib.error.URLError, OSError)):
                urllib.request.urlopen(proxy.url + url, timeout=10).read()
        proxy.once("stall", "GET", url)
        assert urllib.request.urlopen(proxy.url + url, timeout=10).read() == b"a"
        assert proxy.summary() | {"requests": 0} == {
            "requests": 0, "faults": 6, "retries": 5, "429": 1, "503": 1, "reset": 1,
            "cut": 1, "stall": 1, "lost": 1,
        }  # fmt: skip


def test_moving_a_checkpoint_aside_survives_a_delete_whose_reply_was_lost(emulator):
    # A checkpoint that fails its check is moved to checkpoints_bad/; the delete of one
    # of its objects lands, its reply is lost, the retry finds it gone (404). gcsfs's
    # own mv raised FileNotFoundError there and the resume stopped.
    src, dest = emulator.uri("ckpt"), emulator.uri("bad")
    names = ["state/a", "state/b", "commit_success.txt"]
    _put(src, names)
    with FaultProxy(emulator.url, seed=0) as proxy, proxy.in_env():
        proxy.once("lost", "DELETE", "commit_success.txt")
        proxy.once("lost", "POST", "state%2Fb")  # a copy (rewrite) whose reply was lost
        storage.move_tree(src, dest)
        assert proxy.summary()["lost"] == 2
    assert _objects(emulator, dest) == sorted(names)
    assert _objects(emulator, src) == []
    assert storage.gcs_fs().cat_file(f"{dest}/state/b") == b"state/b"


@pytest.fixture
def no_backoff(monkeypatch):
    """gcsfs's retries without their sleeps (1 + 2 + 4 + 8 + 16 s between six tries)."""
    import asyncio
    import types

    import gcsfs.retry

    async def sleep(_s):
        await asyncio.sleep(0)

    shim = types.SimpleNamespace(**{k: getattr(asyncio, k) for k in dir(asyncio) if k[0] != "_"})
    shim.sleep = sleep
    monkeypatch.setattr(gcsfs.retry, "asyncio", shim)


@pytest.mark.parametrize("kind", ["503", "reset"])
def test_a_fault_that_outlasts_the_retries_is_one_line_naming_the_object(
    emulator, no_backoff, kind, capsys
):
    from magic_jax.jobs.cli import main
    from magic_jax.run import rundir

    run = emulator.uri("outlasted")
    _put(run, [rundir.MARKER])
    storage.path(f"{run}/metrics.jsonl").write_text('{"step": 0}\n')
    with FaultProxy(emulator.url, seed=0) as proxy, proxy.in_env():
        for _ in range(50):  # an outage of the object: more than any client's retries
            proxy.once(kind, "GET", "metrics.jsonl")
        rc = main(["status", run])
        assert rc == storage.UNAVAILABLE_EXIT, (proxy.summary(), proxy.trace[-12:])
        assert proxy.summary()[kind] >= 6
    lines = capsys.readouterr().err.strip().splitlines()
    want = f"magic-jax status: error: Cloud Storage failed on {run}/metrics.jsonl: "
    assert len(lines) == 1 and lines[0].startswith(want), lines
    fault = "503 We encountered an internal error" if kind == "503" else "Connection reset by peer"
    assert fault in lines[0]
    assert lines[0].endswith("after the client's retries")
    # the bucket answers again: the same command works, nothing was lost
    with FaultProxy(emulator.url, seed=0) as proxy, proxy.in_env():
        assert main(["status", run]) == 0


@pytest.mark.slow  # one seed, three kills: ~2.5 min on 2 cores (`make campaign` runs 5 x 10)
def test_one_seed_of_the_fault_campaign(tmp_path):
    got = subprocess.run(
        [sys.executable, "tests/campaign.py", "--seeds", "7", "--kills", "3",
         "--workdir", str(tmp_path), "--json", str(tmp_path / "figures.json"),
         "--no-baseline"],
        capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-4000:]
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["failed"] == [] and figures["total"]["kills"] == 3
    assert figures["total"]["faults"] > 0
