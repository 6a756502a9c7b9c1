"""Runs on Cloud Storage, against a real GCS emulator (fake-gcs-server on localhost).

The tiny trainer run with ``model`` and ``output_dir`` on ``gs://``: its records,
summary, checkpoints and export land in the bucket and equal a local run's; a
corrupted object in the newest checkpoint falls back to the previous one; the
run lock is a lease a second run cannot take and a dead run cannot keep; and
a bucket that cannot be used is one line naming the path, with nothing written
locally. The kill-and-resume and two-process runs on the bucket are slow tests.
The bucket is flaky throughout (``faultproxy.FaultProxy``, ``FAULTS``): about 3% of
requests meet a 429, a 503, a reset or a lost reply, which the clients must absorb.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import GcsEmulator
from faultproxy import FaultProxy
from resume_test import OVERRIDES, _cfg, assert_same_run
from resume_test import reference as reference  # a fixture, used by name
from trainer_test import files as files  # a fixture, used by name

from magic_jax import interrupt, storage
from magic_jax.run import rundir, runlock
from magic_jax.run.checkpoint import latest_good_checkpoint, step_dirs

# The bucket is flaky: every request through the proxy may meet a seeded fault (the
# clients' retries must absorb them); the one-line-error tests point past it.
FAULTS = {"429": 0.01, "503": 0.01, "reset": 0.005, "lost": 0.01}


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gcs")
    cache = {storage.CACHE_ENV: str(root / "cache")}  # gs:// models copied here
    with (
        GcsEmulator(root / "emulator.log").in_env(**cache) as emulator,
        FaultProxy(emulator.url, seed=0, rates=FAULTS) as proxy,
        proxy.in_env(),
    ):
        emulator.proxy = proxy
        yield emulator


def _upload(local, uri):
    fs = storage.gcs_fs()
    for f in sorted(local.rglob("*")):
        if f.is_file():
            fs.put_file(str(f), f"{uri}/{f.relative_to(local).as_posix()}")


def _download(uri, local):
    """A local copy of a gs:// run directory (to compare it with a local run)."""
    fs = storage.gcs_fs()
    for rel in storage.listing(uri):
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(f"{uri}/{rel}", str(local / rel))
    return local


@pytest.fixture(scope="module")
def bucket_model(gcs, files):
    uri = gcs.uri("model")
    _upload(files / "model", uri)
    return uri


def _cli(args, cwd, env_over=None, **kw):
    env = dict(os.environ, **(env_over or {}))
    return subprocess.run(
        [sys.executable, "-m", "magic_jax.jobs.cli", *args], cwd=cwd, env=env, capture_output=True,
        text=True, **kw,
    )  # fmt: skip


# --------------------------------------------------------------------------- the run


@pytest.fixture(scope="module")
def bucket_run(gcs, files, bucket_model, tmp_path_factory):
    """The resume tests' reference run, with its model and run directory on gs://."""
    from magic_jax.run.trainer import Trainer

    out = gcs.uri("run")
    Trainer(_cfg(files, out, f"model={bucket_model}"), log=lambda s: None).run()
    return out


@pytest.mark.slow  # a whole run on the bucket (~35 s cold, shared by three tests)
def test_a_run_on_the_bucket_equals_the_local_run(bucket_run, reference, tmp_path):
    names = set(storage.listing(bucket_run))
    for want in (rundir.MARKER, "config.yaml", "metrics.jsonl", "eval.jsonl", "summary.json",
                 "hf_final/model.safetensors", "hf_final/config.json",
                 "hf_final/tokenizer.json"):  # fmt: skip
        assert want in names, want
    assert any(n.startswith("events.out.tfevents") for n in names)  # TensorBoard, in the bucket
    assert not any(n == rundir.LOCK for n in names)  # released at the end
    got = _download(bucket_run, tmp_path / "run")
    # the model was read from gs:// (an HF checkpoint: copied once to the local cache)
    assert_same_run(reference, got)


@pytest.mark.slow  # a whole run on the bucket (~35 s cold, shared by three tests)
def test_the_newest_checkpoint_with_a_corrupted_object_falls_back(bucket_run, gcs):
    fs = storage.gcs_fs()
    run = gcs.uri("damaged")
    fs.copy(bucket_run, run, recursive=True)
    newest, previous = [p for _, p in step_dirs(run)][::-1][:2]
    # the largest array object of the newest checkpoint: same size, other bytes
    objects = storage.listing(str(newest))
    rel = max((r for r in objects if "/state/" in f"/{r}" and "manifest" not in r),
              key=lambda r: objects[r]["size"])  # fmt: skip
    data = bytearray(fs.cat_file(f"{newest}/{rel}"))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(f"{newest}/{rel}", bytes(data))
    lines = []
    found = latest_good_checkpoint(run, log=lines.append, set_aside=True)
    assert str(found) == str(previous)
    assert len(lines) == 1 and f"{rel} does not match its checksum" in lines[0], lines
    assert "moved to gs://" in lines[0]
    assert [p.name for _, p in step_dirs(run)][-1] == previous.name
    assert storage.listing(f"{run}/checkpoints_bad/{newest.name}")


def test_records_on_the_bucket_are_rewritten_whole_and_trimmed_on_resume(gcs):
    from magic_jax.run.monitor import Records

    path = storage.path(gcs.uri("records")) / "metrics.jsonl"
    rec = Records(path)
    for s in range(5):
        rec.append({"step": s, "loss": 0.1 * s})
    assert not path.exists()  # kept until a flush (a checkpoint, or every GCS_FLUSH_S)
    rec.flush()
    assert [r["step"] for r in rundir.read_records(path)] == [0, 1, 2, 3, 4]
    # a resume at step 3 drops what it computes again; a reopened file keeps the rest
    rundir.trim_records(path.parent, 3)
    rec = Records(path)
    rec.append({"step": 3, "loss": 0.3})
    rec.flush()
    assert [r["step"] for r in rundir.read_records(path)] == [0, 1, 2, 3]


@pytest.mark.slow  # ~50 s: four commands, each compiling
def test_export_convert_report_and_eval_read_and_write_the_bucket(bucket_run, reference, gcs,
                                                                   files, tmp_path):  # fmt: skip
    from safetensors.numpy import load_file

    from magic_jax.jobs.cli import main

    hf = gcs.uri("hf")
    assert main(["export", bucket_run, hf, "--dtype", "float32"]) == 0  # its newest checkpoint
    got = load_file(str(_download(hf, tmp_path / "hf") / "model.safetensors"))
    want = load_file(str(reference / "hf_final" / "model.safetensors"))
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    # an export holds the weights alone: convert takes the tokenizer from beside them
    for name in ("tokenizer.json", "tokenizer_config.json"):
        storage.path(f"{hf}/{name}").write_bytes((files / "model" / name).read_bytes())
    orbax = gcs.uri("orbax")
    assert main(["convert", hf, orbax, "--dtype", "float32"]) == 0  # gs:// in, gs:// out
    assert storage.path(orbax + "/model_config.json").exists()
    assert json.loads(storage.path(orbax + "/source.json").read_text())["path"] == hf
    page = gcs.uri("report") + "/report.html"
    assert main(["report", bucket_run, "-o", page]) == 0
    assert "<h1>Training report</h1>" in storage.path(page).read_text()
    assert storage.listing(page.removesuffix(".html") + "_png")
    data = gcs.uri("data") + "/sums.jsonl"
    storage.path(data).write_text("".join((files / "train.jsonl").read_text().splitlines(True)[:3]))
    out = gcs.uri("eval")
    # the converted model's own tokenizer (no --tokenizer)
    assert main(["eval", orbax, data, "--n", "2", "--max-response-length", "3",
                 "--max-prompt-length", "16", "--out", out]) == 0  # fmt: skip
    summary = json.loads(storage.path(out + "/summary.json").read_text())
    assert summary["sums"]["problems"] == 3 and summary["sums"]["num_samples"] == 2
    # the per-problem log, rewritten whole at each chunk on gs://
    lines = storage.path(out + "/sums.jsonl").read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(x)["n"] == 2 for x in lines)
    assert json.loads(storage.path(out + "/eval.json").read_text())["model"] == orbax


def test_prompt_data_reads_from_the_bucket_in_every_format(gcs, files, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from magic_jax.data.rows import DataError
    from magic_jax.data.sources import prepare_dataset, read_rows

    rows = [json.loads(x) for x in (files / "train.jsonl").read_text().splitlines()]
    want = read_rows(files / "train.jsonl")
    root = gcs.uri("data")
    storage.path(root + "/a.jsonl").write_text((files / "train.jsonl").read_text())
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "b.parquet")
    storage.gcs_fs().put_file(str(tmp_path / "b.parquet"), root + "/b.parquet")
    prepare_dataset(files / "train.jsonl", tmp_path / "ar")
    _upload(tmp_path / "ar", gcs.uri("array_record"))
    ar = f"gs://{gcs.BUCKET}/array_record-{gcs._n}"
    assert [r.uid for r in read_rows(root + "/a.jsonl")] == [r.uid for r in want]
    assert [r.messages for r in read_rows(root + "/b.parquet")] == [r.messages for r in want]
    # a directory: its files in name order; the same rows twice are refused, naming both
    twice = f"{root}/b.parquet: row 1: uid .* repeats {root}/a.jsonl:1"
    with pytest.raises(DataError, match=twice):
        read_rows(root)
    assert [r.messages for r in read_rows(ar)] == [r.messages for r in want]


# --------------------------------------------------------------------------- the lock


@pytest.mark.slow  # a whole run on the bucket (~35 s cold, shared by three tests)
def test_a_second_run_on_the_same_bucket_path_is_refused(gcs, files, bucket_run):
    # the finished run's directory, held by a live run (this process renews the lease)
    with runlock.GcsRunLock(storage.path(bucket_run), lease_s=3):
        t0 = time.monotonic()
        got = _cli(["train", "run.yaml", *(x for o in OVERRIDES for x in ("--set", o)),
                    "--set", f"output_dir={bucket_run}"], files,
                   {runlock.LEASE_ENV: "3"})  # fmt: skip
        waited = time.monotonic() - t0
    assert got.returncode == 2, got.stderr[-2000:]
    err = got.stderr.strip().splitlines()[-1]
    assert f"{bucket_run}: another run is using this directory (pid {os.getpid()}" in err, err
    assert waited < 60


def test_a_lapsed_lease_is_taken_over_and_its_old_owner_stops(gcs, tmp_path):
    run = gcs.uri("lease")
    # a run killed with its lock held: a lease nobody renews
    dead = runlock.GcsRunLock(run, lease_s=1)
    assert dead._write(0)
    t0 = time.monotonic()
    with runlock.GcsRunLock(run, lease_s=1) as lock:
        assert time.monotonic() - t0 < 10
        holder = json.loads(lock._blob().download_as_bytes())
        assert holder["owner"] == lock._owner
    # an owner whose lease another process took stops at its next renewal (exit 75)
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import time
            from magic_jax.run import runlock
            with runlock.GcsRunLock({run!r}, lease_s=1.5):
                print("held", flush=True)
                time.sleep(30)
            """)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
    )  # fmt: skip
    assert child.stdout.readline().strip() == "held"
    taker = runlock.GcsRunLock(run, lease_s=60)
    gen, _ = taker._read()
    assert taker._write(gen)  # as if its lease had lapsed
    assert child.wait(timeout=20) == runlock.LOST_LOCK_EXIT
    assert "another process took over this run" in child.stderr.read()


# --------------------------------------------------------------------------- one-line errors


@pytest.mark.parametrize(
    "case",
    ["no_bucket", "unreachable", "no_credentials", "not_ours"],
)
def test_a_bucket_that_cannot_be_used_is_one_line_and_nothing_is_written(
    gcs, files, case, tmp_path
):
    env, out = {}, f"gs://{gcs.BUCKET}-missing/run"
    want = f"output_dir {out}: the bucket {gcs.BUCKET}-missing does not exist"
    if case == "unreachable":
        with __import__("socket").socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
               storage.CHECK_TIMEOUT_ENV: "1"}  # fmt: skip
        out = f"gs://{gcs.BUCKET}/run"
        want = f"output_dir {out}: cannot reach Cloud Storage at http://127.0.0.1:{port}"
    elif case == "no_credentials":
        env = {"STORAGE_EMULATOR_HOST": "", "CLOUDSDK_CONFIG": str(tmp_path),
               "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "none")}  # fmt: skip
        out = f"gs://{gcs.BUCKET}/run"
        want = f"output_dir {out}: no Google Cloud credentials"
    elif case == "not_ours":
        out = gcs.uri("someone-elses")
        storage.path(out + "/notes.txt").write_text("not a run")
        want = f"output_dir {out}: not empty (notes.txt) and not a magic-jax run directory"
    work = tmp_path / "cwd"
    work.mkdir()
    (work / "run.yaml").write_text((files / "run.yaml").read_text().replace(
        "model: model", f"model: {files / 'model'}").replace(
        "train.jsonl", str(files / "train.jsonl")))  # fmt: skip
    got = _cli(["train", "run.yaml", "--set", f"output_dir={out}"], work, env, timeout=120)
    assert got.returncode == 2, got.stderr[-2000:]
    lines = [x for x in got.stderr.splitlines() if x.startswith("magic-jax train: error:")]
    assert len(lines) == 1 and want in lines[0], got.stderr[-2000:]
    assert sorted(p.name for p in work.iterdir()) == ["run.yaml"]  # no local "gs:" directory


# --------------------------------------------------------------------------- slow: real kills


@pytest.mark.slow
def test_kill_9_after_a_checkpoint_then_resume_from_the_bucket(gcs, files, bucket_model,
                                                               reference, tmp_path):  # fmt: skip
    out = gcs.uri("killed")
    cmd = ["train", "run.yaml", *(x for o in OVERRIDES for x in ("--set", o)),
           "--set", f"output_dir={out}", "--set", f"model={bucket_model}"]  # fmt: skip
    env = {interrupt.KILL_AT_ENV: "step:3", runlock.LEASE_ENV: "4"}
    killed = _cli(cmd, files, env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    # step 2's checkpoint is written asynchronously: a kill before it reaches the bucket
    # leaves step 1's as the newest (seen in CI), and the resume starts from there
    assert [p.name for _, p in step_dirs(out)][-1] in ("step_00000001", "step_00000002")
    assert storage.path(out + "/" + rundir.LOCK).exists()  # the dead run's lease
    env.pop(interrupt.KILL_AT_ENV)
    again = _cli(cmd, files, env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "[resume]" in again.stdout
    assert any(f"continuing at step {s}" in again.stdout for s in (1, 2)), again.stdout[-2000:]
    assert_same_run(reference, _download(out, tmp_path / "run"))
