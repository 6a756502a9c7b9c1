"""Run directories without a model: marker, lock, signals, resume config rules, records, summary."""

import json
import os
import signal
import subprocess
import sys

import pytest

from magic_jax.run import rundir
from magic_jax.run.rundir import RunDirError, claim_run_dir
from magic_jax.run.runlock import RunLock


def test_claim_creates_marks_and_accepts_its_own_directory(tmp_path):
    out = claim_run_dir(tmp_path / "a" / "b")
    assert (out / rundir.MARKER).exists()
    (out / "metrics.jsonl").write_text("{}\n")
    assert claim_run_dir(out) == out  # a run directory of ours, not empty: fine
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (claim_run_dir(empty) / rundir.MARKER).exists()


def test_claim_refuses_foreign_files_and_impossible_paths(tmp_path):
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    with pytest.raises(RunDirError, match=r"not empty \(thesis.tex\) and not a magic-jax run"):
        claim_run_dir(foreign, what="--workdir")
    assert (foreign / "thesis.tex").read_text() == "years of work"
    assert not (foreign / rundir.MARKER).exists()
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunDirError, match="exists and is not a directory"):
        claim_run_dir(tmp_path / "f")
    with pytest.raises(RunDirError, match="a parent of it is a file"):
        claim_run_dir(tmp_path / "f" / "run")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_claim_refuses_a_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(RunDirError, match="cannot write to it"):
            claim_run_dir(ro)
    finally:
        ro.chmod(0o755)


def _hold_lock(path):
    code = (
        "import sys, time\n"
        "from magic_jax.run.runlock import RunLock\n"
        f"RunLock({str(path)!r}).acquire()\n"
        "print('locked', flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_lock_refuses_a_second_run_and_frees_when_the_holder_dies(tmp_path):
    holder = _hold_lock(tmp_path)
    try:
        with pytest.raises(RunDirError) as e:
            RunLock(tmp_path).acquire()
        msg = str(e.value)
        assert "\n" not in msg and "another run is using this directory" in msg
        assert f"pid {holder.pid} on " in msg
    finally:
        holder.kill()  # SIGKILL: nothing runs in the holder to release the lock
        holder.wait()
    with RunLock(tmp_path) as lock:
        assert f"pid {os.getpid()}" in lock.path.read_text()
    assert lock.path.read_text() == ""  # released: no holder named


def test_stop_signals_set_a_flag_and_restore_the_handlers(capfd):
    from magic_jax import interrupt

    before = signal.getsignal(signal.SIGTERM)
    with rundir.StopSignals() as stop:
        assert not interrupt.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM
        # the decode loop and the updater see it at their next chunk / optimizer step
        assert interrupt.requested() == signal.SIGTERM
        with pytest.raises(interrupt.Interrupted, match="during rollout"):
            interrupt.check("rollout")
        with interrupt.deferred():  # work nothing would keep: the stop waits for it
            interrupt.check("update")
        with pytest.raises(interrupt.Interrupted, match="during update"):
            interrupt.check("update")
    assert signal.getsignal(signal.SIGTERM) is before
    assert not interrupt.requested()
    assert capfd.readouterr().err == (
        "[stop] SIGTERM: stopping at the next decode chunk or optimizer step; finished "
        "groups and the last checkpoint are kept (again: at once)\n"
    )


def test_kill_point_kills_only_at_its_point(tmp_path):
    code = "from magic_jax.interrupt import kill_point as k\nk('update', 2)\nk('update', 3)\n"
    env = dict(os.environ, MAGIC_JAX_KILL_AT="update:3")
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == -signal.SIGKILL
    env["MAGIC_JAX_KILL_AT"] = "update:4"
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


STAGES = [
    {"steps": 4, "max_response_length": 8, "prompts_per_step": 4, "group_size": 2},
    {"steps": 4, "max_response_length": 16, "prompts_per_step": 4, "group_size": 2},
]


def _cfg(**kw):
    raw = {
        "model": "/m",
        "seed": 0,
        "data": {"train": ["/d.jsonl"], "max_prompt_length": 64},
        "stages": json.loads(json.dumps(STAGES)),
        "eval": {"data": ["/e.jsonl"], "every": 2, "num_samples": 4},
        "checkpoint_every": 2,
    }
    for key, value in kw.items():
        node, *path = key.split(".")
        target = raw
        for part in [node, *path][:-1]:
            target = target[int(part)] if isinstance(target, list) else target[part]
        last = [node, *path][-1]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value
    return raw


def test_resume_config_allows_budgets_and_cadence():
    old = _cfg()
    new = _cfg(**{"eval.every": 5, "checkpoint_every": 1, "stages.1.steps": 10})
    new["stages"].append({"steps": 2, "max_response_length": 32, "prompts_per_step": 4})
    changes = check(old, new, 6)
    assert "eval.every: 2 -> 5" in changes and "stages[1].steps: 4 -> 10" in changes
    assert any(c.startswith("stages[2]") for c in changes)
    # a stage not yet begun may be reshaped; the one in progress may end sooner
    assert check(old, _cfg(**{"stages.1.group_size": 4}), 4)
    assert check(old, _cfg(**{"stages.1.steps": 2}), 6) == ["stages[1].steps: 4 -> 2"]


def check(old, new, done):
    return rundir.check_resume_config(old, new, done)


@pytest.mark.parametrize(
    ("change", "done", "named"),
    [
        ({"seed": 1}, 2, "seed"),
        ({"model": "/other"}, 2, "model"),
        ({"data.train": ["/x.jsonl"]}, 2, "data.train"),
        ({"stages.0.group_size": 8}, 2, "stages[0].group_size"),
        ({"stages.0.steps": 5}, 4, "stages[0].steps (the stage has finished)"),
        ({"stages.1.steps": 1}, 6, "stages[1].steps (the stage has done 2)"),
        ({"eval.num_samples": 8}, 2, "eval.num_samples"),
    ],
)
def test_resume_config_refuses_what_changes_the_experiment(change, done, named):
    with pytest.raises(RunDirError) as e:
        check(_cfg(), _cfg(**change), done)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_resume_config_reads_options_added_since_as_their_defaults():
    new = _cfg()
    new["sampling"] = {"temperature": 1.0, "method": None, "options": {}}
    old = _cfg()
    old["sampling"] = {"temperature": 1.0}  # stored before sampling methods had names
    assert check(old, new, 2) == []
    new["sampling"].update(method="min-p", options={"p": 0.1})
    with pytest.raises(RunDirError, match=r"sampling\.method"):
        check(old, new, 2)


def test_resume_config_places_stages_by_the_checkpoint_when_known():
    # stage 0 ended early on a rule at step 2: at step 3 the run is in stage 1
    with pytest.raises(RunDirError, match=r"stages\[1\]\.group_size"):
        rundir.check_resume_config(_cfg(), _cfg(**{"stages.1.group_size": 4}), 3, 1)
    with pytest.raises(RunDirError, match=r"stages\[0\]\.steps \(the stage has finished\)"):
        rundir.check_resume_config(_cfg(), _cfg(**{"stages.0.steps": 2}), 3, 1)
    # a run whose last stage ended (stage index 2 of 2) may be given another stage
    more = _cfg()
    more["stages"].append({"steps": 3, "max_response_length": 32, "prompts_per_step": 4})
    assert rundir.check_resume_config(_cfg(), more, 8, 2)
    # by step counts alone, stage 1 would not have begun at step 3
    check_stage = rundir.check_resume_config(_cfg(), _cfg(**{"stages.1.group_size": 4}), 3)
    assert check_stage == ["stages[1].group_size: 2 -> 4"]


def test_trim_records_drops_repeated_steps_and_torn_lines(tmp_path):
    rows = [{"step": s, "reward": s / 10} for s in range(5)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "rew')
    evals = tmp_path / "eval.jsonl"
    evals.write_text("".join(json.dumps({"step": s, "accuracy": 0.5}) + "\n" for s in (0, 2, 4)))
    assert rundir.trim_records(tmp_path, 2) == {"metrics.jsonl": 4, "eval.jsonl": 1}
    assert [r["step"] for r in rundir.read_records(metrics)] == [0, 1]
    assert [r["step"] for r in rundir.read_records(evals)] == [0, 2]  # eval 2 precedes ckpt 2
    # no checkpoint at all: everything is done again, the step-0 evaluation included
    assert rundir.trim_records(tmp_path, 0) == {"metrics.jsonl": 2, "eval.jsonl": 2}
    assert metrics.read_text() == "" and evals.read_text() == ""


def test_summary_comes_from_the_records(tmp_path):
    out = tmp_path
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(3)))
    (out / "eval.jsonl").write_text(
        "".join(json.dumps({"step": s, "accuracy": s / 4}) + "\n" for s in (0, 2))
    )
    s = rundir.build_summary(out, total_steps=3, entropy_coef=0.5)
    assert s["steps"] == 3 and s["finished"] and s["last"] == {"step": 2}
    assert s["evals"] == [{"step": 0, "accuracy": 0.0}, {"step": 2, "accuracy": 0.5}]
    rundir.write_summary(out, s)
    assert rundir.finished_summary(out, 3) == s
    assert rundir.finished_summary(out, 5) is None  # a longer schedule: not finished
    # a run whose last stage ended early on a rule, planned for 5 steps
    rundir.write_summary(out, rundir.build_summary(out, total_steps=3, planned_steps=5))
    assert rundir.finished_summary(out, 5)["steps"] == 3
    assert rundir.finished_summary(out, 6) is None
