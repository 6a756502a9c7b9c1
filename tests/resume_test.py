"""Resume you can trust, on the tiny trainer run: splits, kills, bad checkpoints, one-line errors.

Every interrupted run here is compared with one uninterrupted run of the same
config: metric and evaluation records (all but wall-clock fields), the
summary, and the final weights bit for bit. Kills are real signals to a
``python -m magic_jax.jobs.cli train`` subprocess; ``MAGIC_JAX_KILL_AT=point:step``
makes it SIGKILL itself at a named point, so each kill lands where it says.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from trainer_test import _config
from trainer_test import files as files  # a fixture, used by name

from magic_jax import interrupt
from magic_jax.jobs.cli import main
from magic_jax.run import rundir
from magic_jax.run.checkpoint import TRAINER_STATE, latest_good_checkpoint, step_dirs
from magic_jax.run.inputs import load_inputs
from magic_jax.run.rundir import RunDirError
from magic_jax.run.runlock import RunLock
from magic_jax.run.trainer import Trainer

# evaluation on the training prompts every 2 steps; fp32 export for bitwise comparison
OVERRIDES = (
    "eval={data: [train.jsonl], every: 2, num_samples: 2}",
    "export_dtype=float32",
)


def _cfg(root, out, *more):
    return _config(root, out, *OVERRIDES, *more)


def _clean(row):
    """A record without its wall-clock fields (they differ between any two runs)."""
    # publish_bytes (rollout.hosts): a resumed rollout pulls again the version it starts under
    skip = ("rollout_tokens_per_s", "publish_bytes")
    return {k: v for k, v in row.items() if not k.startswith("t_") and k not in skip}


def _records(out):
    return (
        [_clean(r) for r in rundir.read_records(out / "metrics.jsonl")],
        [_clean(r) for r in rundir.read_records(out / "eval.jsonl")],
    )


def _weights(out):
    from safetensors.numpy import load_file

    return load_file(str(out / "hf_final" / "model.safetensors"))


def _summary(out):
    s = json.loads((out / "summary.json").read_text())
    s.pop("hf_export", None)
    s["last"] = _clean(s["last"])
    return s


def assert_same_run(a, b):
    """Records (no line twice), summary and bit-identical final weights."""
    ma, ea = _records(a)
    mb, eb = _records(b)
    assert [r["step"] for r in mb] == list(range(len(mb))), "a metric line twice or missing"
    assert [r["step"] for r in eb] == sorted({r["step"] for r in eb}), "an eval line twice"
    assert ma == mb
    assert ea == eb
    assert _summary(a) == _summary(b)
    wa, wb = _weights(a), _weights(b)
    assert sorted(wa) == sorted(wb)
    for k in wa:
        assert np.array_equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def reference(files):
    """The uninterrupted run (evaluations at steps 0, 2, 4)."""
    Trainer(_cfg(files, "reference"), log=lambda s: None).run()
    return files / "reference"


def test_reference_run_records(reference):
    metrics, evals = _records(reference)
    assert [r["step"] for r in metrics] == [0, 1, 2, 3]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert (reference / rundir.MARKER).exists() and (reference / "hf_final").is_dir()
    s = json.loads((reference / "summary.json").read_text())
    assert s["finished"] and s["steps"] == 4 and [e["step"] for e in s["evals"]] == [0, 2, 4]


@pytest.mark.slow
def test_stage_boundary_split_equals_the_uninterrupted_run(files, reference):
    cfg = _cfg(files, "split")
    first = Trainer(cfg, log=lambda s: None).run(stop_after=2)  # stage 0's last step
    assert not first["finished"] and latest_good_checkpoint(files / "split").name.endswith("2")
    meta = json.loads(
        (files / "split" / "checkpoints" / "step_00000002" / TRAINER_STATE).read_text()
    )
    assert meta["next_step"] == 2 and meta["stage"] == 1  # the switch to stage 1 is saved
    logs = []
    Trainer(cfg, log=logs.append).run()
    assert any("continuing at step 2" in line for line in logs)
    assert_same_run(reference, files / "split")
    final = "checkpoints/step_00000004/" + TRAINER_STATE
    a, b = (json.loads((d / final).read_text()) for d in (reference, files / "split"))
    assert a["excluded"] == b["excluded"] and a["tracker"] == b["tracker"]


@pytest.mark.heavy
def test_resume_at_a_stage_boundary_applies_online_filtering(files, monkeypatch):
    """A prompt solved every time in stage 0 leaves stage 1's prompt set, whether the run
    goes straight on or resumes from the checkpoint written at stage 0's end."""
    from magic_jax.data.rows import AccuracyTracker

    # a random tiny policy solves nothing every time: let the first prompt count as solved
    monkeypatch.setattr(AccuracyTracker, "solved", lambda self: set(sorted(self.counts)[:1]))
    over = ("stages.0.steps=1", "stages.1.steps=1", "export_hf=false")
    logs = {}
    for name, splits in (("straight", [None]), ("at_boundary", [1, None])):
        cfg = _config(files, files / f"boundary_{name}", *over)
        logs[name] = []
        for stop in splits:
            Trainer(cfg, log=logs[name].append).run(stop_after=stop)
    assert any("continuing at step 1" in x for x in logs["at_boundary"])
    final = []
    for name in logs:
        out = files / f"boundary_{name}"
        assert any("[stage 1" in x and "(1 dropped by online filtering)" in x for x in logs[name])
        final.append(json.loads((out / "checkpoints/step_00000002" / TRAINER_STATE).read_text()))
    assert final[0]["excluded"] == final[1]["excluded"] and final[0]["excluded"]
    a, b = (_records(files / f"boundary_{n}")[0] for n in logs)
    assert a == b and [r["stage"] for r in a] == [0, 1]


@pytest.mark.slow
def test_damaged_newest_checkpoint_falls_back_with_identical_results(files, reference):
    out = files / "damaged"
    shutil.copytree(reference, out)
    # as if killed after the last checkpoint, before the export and summary
    shutil.rmtree(out / "hf_final")
    (out / "summary.json").unlink()
    newest = out / "checkpoints" / "step_00000004"
    data = max(
        (p for p in (newest / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    raw = bytearray(data.read_bytes())
    raw[: min(len(raw), 4096)] = os.urandom(min(len(raw), 4096))
    data.write_bytes(bytes(raw))
    logs = []
    Trainer(_cfg(files, out), log=logs.append).run()
    bad = [line for line in logs if "is not usable" in line]
    assert len(bad) == 1 and str(newest) in bad[0] and "does not match its checksum" in bad[0]
    assert data.name in bad[0]
    assert any("continuing at step 3" in line for line in logs)
    assert (out / "checkpoints_bad" / "step_00000004").is_dir()
    assert_same_run(reference, out)


def test_finished_run_started_again_changes_nothing(files, reference):
    def files_now():  # the lock file names each process that opens the run: not a record
        return {p: p.stat().st_mtime_ns for p in reference.rglob("*") if p.name != ".lock"}

    before = files_now()
    summary = (reference / "summary.json").read_bytes()
    logs = []
    got = Trainer(_cfg(files, reference), log=logs.append).run()
    assert got == json.loads(summary)
    assert len(logs) == 1 and "has finished (4 steps); nothing to do" in logs[0]
    assert files_now() == before  # no export, no summary, no config written again


def test_changed_config_on_resume(files, reference, capsys, monkeypatch):
    with pytest.raises(RunDirError, match=r"may not change on resume: seed") as e:
        Trainer(_cfg(files, reference, "seed=1"), log=lambda s: None).run()
    assert "\n" not in str(e.value)
    monkeypatch.chdir(files)
    args = [
        "train",
        "run.yaml",
        "--set",
        f"output_dir={reference}",
        *[x for o in OVERRIDES for x in ("--set", o)],
    ]
    assert (
        main([*args, "--set", "stages.0.group_size=4", "--set", "data.max_prompt_length=20"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "stages[0].group_size" in err and "data.max_prompt_length" in err
    # an allowed change is logged; the finished run stays finished
    logs = []
    Trainer(_cfg(files, reference, "eval.every=1"), log=logs.append).run()
    assert any("changed eval.every: 2 -> 1" in line for line in logs)


def test_second_run_in_a_locked_directory_is_refused(files, tmp_path):
    out = rundir.claim_run_dir(tmp_path / "busy")
    with (
        RunLock(out),
        pytest.raises(RunDirError, match=rf"another run is using.*pid {os.getpid()}"),
    ):
        Trainer(_cfg(files, out), log=lambda s: None).run()


def test_overlong_prompts_are_counted_at_load(files, tmp_path):
    rows = [json.loads(line) for line in (files / "train.jsonl").read_text().splitlines()]
    for r in rows[:3]:
        r["prompt"][0]["content"] += " " * 40
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    logs = []
    trainer = Trainer(_cfg(files, tmp_path / "x", f"data.train=[{data}]"), log=logs.append)
    inputs, _ = load_inputs(trainer.config, log=trainer.log)
    assert len(inputs.rows) == 9
    assert any(
        "3 of 12 prompts are longer than data.max_prompt_length (16 tokens)" in x for x in logs
    )


def test_one_line_errors_exit_2_and_lose_nothing(files, reference, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(files)

    def run(*argv):
        code = main(list(argv))
        err = capsys.readouterr().err.strip()
        assert code == 2 and err and "\n" not in err and "Traceback" not in err, (argv, err)
        return err

    (tmp_path / "file").write_text("x")
    assert "is a file" in run("convert", "model", str(tmp_path / "file" / "out"))
    assert "a parent of it is a file" in run(
        "train", "run.yaml", "--set", f"output_dir={tmp_path / 'file' / 'run'}"
    )
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert "not a magic-jax run directory" in run(
        "train", "run.yaml", "--set", f"output_dir={foreign}"
    )
    assert (foreign / "notes.txt").read_text() == "mine"
    (tmp_path / "list.yaml").write_text("- model: x\n")
    assert "top level must be a mapping" in run("train", str(tmp_path / "list.yaml"))
    for n in ("0", "-3"):
        assert "--stop-after" in run("train", "run.yaml", "--stop-after", n)
    (tmp_path / "empty.jsonl").write_text("")
    err = run(
        "train",
        "run.yaml",
        "--set",
        f"data.train=[{tmp_path / 'empty.jsonl'}]",
        "--set",
        f"output_dir={tmp_path / 'e'}",
    )
    assert "empty.jsonl: holds no rows" in err
    # export of a truncated training checkpoint names it; the checkpoint stays as it was
    bad = tmp_path / "bad_ckpt"
    shutil.copytree(reference / "checkpoints" / "step_00000004", bad)
    data = max(
        (p for p in (bad / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    data.write_bytes(data.read_bytes()[:100])
    snapshot = {p: p.read_bytes() for p in bad.rglob("*") if p.is_file()}
    assert "bad checkpoint" in run("export", str(bad), str(tmp_path / "hf"))
    assert snapshot == {p: p.read_bytes() for p in bad.rglob("*") if p.is_file()}
    assert not (tmp_path / "hf").exists()


def test_export_reads_a_training_checkpoint(reference, tmp_path):
    ckpt = reference / "checkpoints" / "step_00000004"
    assert main(["export", str(ckpt), str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    from safetensors.numpy import load_file

    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    want = _weights(reference)
    assert sorted(got) == sorted(want)
    for k in want:
        assert np.array_equal(got[k], want[k]), k
    # a run directory stands for its newest good checkpoint
    assert main(["export", str(reference), str(tmp_path / "hf2"), "--dtype", "float32"]) == 0


# --------------------------------------------------------------------------- real signals


def _train_cmd(out, *more):
    sets = [x for o in (*OVERRIDES, f"output_dir={out}", *more) for x in ("--set", o)]
    return [sys.executable, "-m", "magic_jax.jobs.cli", "train", "run.yaml", *sets]


def _kill_then_resume(files, out, point, *more):
    """Runs the command until it SIGKILLs itself at ``point``, then runs it again."""
    env = dict(os.environ, **{interrupt.KILL_AT_ENV: point})
    killed = subprocess.run(
        _train_cmd(out, *more), cwd=files, env=env, capture_output=True, text=True
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    env.pop(interrupt.KILL_AT_ENV)
    again = subprocess.run(
        _train_cmd(out, *more), cwd=files, env=env, capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr[-2000:]
    return again.stdout


@pytest.mark.slow  # ~8-21 s of compiles and a subprocess; the slow target runs it
def test_kill_while_a_checkpoint_is_written(files, reference):
    """SIGKILL after orbax committed step 2 but before its manifest: step 2 is set aside,
    the run resumes from step 1 and ends as the uninterrupted run did."""
    out = files / "kill_ckpt"
    log = _kill_then_resume(files, out, "checkpoint:2")
    assert "step_00000002 is not usable: no manifest.json" in log
    assert "continuing at step 1" in log
    assert_same_run(reference, out)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("point", "more", "resumes_at"),
    [
        ("rollout:0", (), None),  # before the first checkpoint, mid-rollout
        ("step:1", ("checkpoint_every=3",), None),  # a metric line written, no checkpoint yet
        ("update:2", (), 2),  # mid-update, right after a stage boundary
        ("rollout:3", (), 3),
        ("checkpoint:4", (), 3),  # the final checkpoint
        ("step:4", (), 3),  # after the last metric line, before evaluation and checkpoint
    ],
)
def test_kill_9_anywhere_then_the_same_command(files, reference, point, more, resumes_at):
    out = files / f"kill_{point.replace(':', '_')}"
    log = _kill_then_resume(files, out, point, *more)
    if resumes_at is None:
        assert "continuing at step" not in log
    else:
        # Checkpoints are written asynchronously: a kill that comes while the newest one
        # is still being written (orbax's temporary folder, or no manifest yet) resumes
        # from the one before, and ends the same.
        resumed = [at for at in (resumes_at, resumes_at - 1) if f"continuing at step {at}" in log]
        assert resumed, log[-2000:]
    assert_same_run(reference, out)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_checkpoints_and_resumes(files, reference, sig, tmp_path):
    import time

    out = files / f"stop_{sig.name}"
    log = tmp_path / "log"
    with open(log, "w") as f:
        cmd = _train_cmd(out, "checkpoint_every=10")
        proc = subprocess.Popen(cmd, cwd=files, stdout=f, stderr=subprocess.STDOUT)
        while not rundir.read_records(out / "metrics.jsonl") and proc.poll() is None:
            time.sleep(0.2)  # the signal comes once step 0 is recorded, mid-run
        proc.send_signal(sig)
        proc.wait(timeout=600)
    text = log.read_text()
    assert proc.returncode == rundir.STOP_EXIT_CODES[sig], text[-2000:]
    stop = [x for x in text.splitlines() if x.startswith(f"[stop] {sig.name}: stopped")]
    assert len(stop) == 1 and "run the same command to resume" in stop[0]
    assert "Traceback" not in text
    done = max(s for s, _ in step_dirs(out))
    assert (
        1 <= done < 4 and json.loads((out / "summary.json").read_text())["stopped_by"] == sig.name
    )
    again = subprocess.run(
        _train_cmd(out, "checkpoint_every=10"), cwd=files, capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"continuing at step {done}" in again.stdout
    assert_same_run(reference, out)


def test_a_run_directory_is_a_model_for_training_and_evaluation(reference):
    """One answer to "what kind of checkpoint is this" (checkpoint.checkpoint_kind): a run
    directory names its newest good checkpoint, for ``model:`` as for ``magic-jax eval``."""
    from flax import nnx

    from magic_jax.run.checkpoint import checkpoint_kind
    from magic_jax.run.policy import load_model_any, load_policy

    kind, ckpt = checkpoint_kind(reference)
    assert (kind, ckpt.name) == ("run", "step_00000004")
    assert checkpoint_kind(reference / "hf_final")[0] == "hf"
    want = _weights(reference)["model.embed_tokens.weight"]
    for model in (load_policy(reference, "float32", None), load_model_any(reference).model):
        got = nnx.state(model)["embed_tokens"]["embedding"][...]
        assert np.array_equal(np.asarray(got), want)
