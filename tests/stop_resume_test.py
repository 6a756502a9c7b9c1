"""A stop in the middle of a step costs seconds and loses no finished group.

SIGTERM during a rollout or an update, sent by the run to itself at a named
decode chunk or optimizer step (``MAGIC_JAX_STOP_AT=where:step:n``, a real
signal through the real handler): the process exits with 143 within 20 s of
the signal; the same command then decodes only the groups that had not
finished (and says how many it loaded), and the run's records and final
weights equal an uninterrupted run's bit for bit, locally and on the GCS
emulator. ``rollout.compact_batch: false`` in both runs: with compaction XLA's
CPU products round a row with its batch size, so a step resumed with fewer
groups would differ in the last bits (``rollout.partial``).
"""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from resume_test import OVERRIDES, _cfg, assert_same_run
from trainer_test import files as files  # a fixture, used by name

from magic_jax import interrupt
from magic_jax.rewards import RewardResult, RewardStatus
from magic_jax.rollout import partial
from magic_jax.rollout.samples import Sample
from magic_jax.run import rundir

EXACT = "rollout.compact_batch=false"


@pytest.fixture(scope="module")
def exact_reference(files):
    from magic_jax.run.trainer import Trainer

    Trainer(_cfg(files, "exact_reference", EXACT), log=lambda s: None).run()
    return files / "exact_reference"


def _cmd(out, *more):
    sets = [x for o in (*OVERRIDES, EXACT, f"output_dir={out}", *more) for x in ("--set", o)]
    return [sys.executable, "-m", "magic_jax.jobs.cli", "train", "run.yaml", *sets]


def _status(files, out):
    """``magic-jax status OUT`` as a user types it."""
    got = subprocess.run(
        [sys.executable, "-m", "magic_jax.jobs.cli", "status", str(out)],
        cwd=files,
        capture_output=True,
        text=True,
    )
    assert got.returncode == 0, got.stderr
    return got.stdout


def _stop_then_resume(files, out, at, *more, resume=()):
    """Runs until the SIGTERM sent at ``at``, then again (with ``resume``'s arguments);
    returns (seconds from signal to exit, the stopped run's output, ``magic-jax status``
    between the two, the resumed run's output)."""
    env = dict(os.environ, **{interrupt.STOP_AT_ENV: at})
    stopped = subprocess.run(_cmd(out, *more), cwd=files, env=env, capture_output=True, text=True)
    ended = time.time()
    assert stopped.returncode == rundir.STOP_EXIT_CODES[signal.SIGTERM], stopped.stderr[-3000:]
    sent = float(re.search(r"\[test\] SIGTERM at ([\d.]+)", stopped.stderr).group(1))
    assert "Traceback" not in stopped.stdout + stopped.stderr
    print(f"[measured] {at}: exit {ended - sent:.2f} s after the SIGTERM")
    status = _status(files, out)
    env.pop(interrupt.STOP_AT_ENV)
    again = subprocess.run(
        [*_cmd(out, *more), *resume], cwd=files, env=env, capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr[-3000:]
    return ended - sent, stopped.stdout, status, again.stdout


@pytest.mark.slow  # two subprocess runs (~15 s each cold)
@pytest.mark.serial  # a signal or heartbeat timed against the clock
def test_sigterm_mid_rollout_resumes_with_only_the_unfinished_groups(files, exact_reference):
    out = files / "stop_rollout"
    # step 2 (stage 1): 8 slots hold one group of 8, so the second chunk's check comes
    # after group 0 finished
    took, first, status, log = _stop_then_resume(files, out, "rollout:2:2")
    assert took < 20, took
    assert "step 2 is redone on resume" in first
    assert "stopped by SIGTERM" in status and "resumes at step 2 from" in status
    assert "step 2: finished groups saved (round_0: 1), not decoded again" in status
    assert "continuing at step 2" in log
    assert re.search(
        r"step_00000002/round_0: 1 of 4 groups finished before; decoding the other 3", log
    )
    assert_same_run(exact_reference, out)
    assert not (out / partial.ROLLOUTS / "step_00000001").exists()  # pruned as the run went on


@pytest.mark.slow
@pytest.mark.serial  # a signal or heartbeat timed against the clock
def test_sigterm_in_overlap_mode_keeps_the_groups_the_rollouts_in_flight_finished(files):
    """rollout.mode overlap, staleness 1: the stop comes while the producer generates
    ahead of the update; the groups its rollouts finished are on disk, the resumed run
    decodes only the others, and it equals the uninterrupted run.

    The handler runs in the main thread once its compiled update returns, so the stop
    is seen there either by the update's next optimizer-step check (the step is redone)
    or at the step's end (a clean stop after it): which one turns on the machine's load,
    and both keep the producer's finished groups."""
    from magic_jax.run.trainer import Trainer

    more = ("rollout.mode=overlap", "rollout.max_staleness=1")
    Trainer(_cfg(files, "exact_overlap", EXACT, *more), log=lambda s: None).run()
    out = files / "stop_overlap"
    took, first, _, log = _stop_then_resume(files, out, "rollout:2:2", *more)
    assert took < 20, took
    assert re.search(r"\[stop\] .*(is redone on resume|SIGTERM: stopped at step [23])", first)
    assert re.search(r"step_0000000[23]/round_0: [1-4] of 4 groups finished before", log), log
    assert_same_run(files / "exact_overlap", out)


@pytest.mark.slow
@pytest.mark.serial  # a signal or heartbeat timed against the clock
def test_sigterm_mid_update_redoes_only_the_update(files, exact_reference):
    metrics = rundir.read_records(exact_reference / "metrics.jsonl")
    step = next(r["step"] for r in metrics if r["step"] >= 1 and r["sgd_steps"] >= 1)
    out = files / "stop_update"
    # the resumed run traces the step it redoes (--profile-steps may change on resume)
    took, _, status, log = _stop_then_resume(
        files, out, f"update:{step}:1", resume=("--profile-steps", f"{step}:{step + 1}")
    )
    assert took < 20, took
    assert "finished groups saved (round_0: 4)" in status
    assert f"continuing at step {step}" in log
    assert "4 of 4 groups finished before; decoding the other 0" in log
    assert_same_run(exact_reference, out)
    assert list((out / "profile").rglob("*.xplane.pb")), log[-2000:]


@pytest.mark.slow
@pytest.mark.serial  # a signal or heartbeat timed against the clock
def test_sigterm_mid_rollout_and_mid_update_on_the_bucket(files, exact_reference, tmp_path):
    from conftest import GcsEmulator
    from gcs_test import _download, _upload

    from magic_jax import storage
    from magic_jax.run import runlock

    metrics = rundir.read_records(exact_reference / "metrics.jsonl")
    step = next(r["step"] for r in metrics if r["step"] >= 1 and r["sgd_steps"] >= 1)
    extra = {storage.CACHE_ENV: str(tmp_path / "cache"), runlock.LEASE_ENV: "4"}
    with GcsEmulator(tmp_path / "emulator.log").in_env(**extra) as emulator:
        model = emulator.uri("model")
        _upload(files / "model", model)
        cases = (("rollout:3:2", 3, 1), (f"update:{step}:1", step, 4))
        for i, (at, resumes, saved) in enumerate(cases):
            out = emulator.uri(f"stopped{i}")
            took, _, status, log = _stop_then_resume(files, out, at, f"model={model}")
            assert f"resumes at step {resumes}" in status and f"(round_0: {saved})" in status
            assert took < 20, took
            assert f"{saved} of 4 groups finished before; decoding the other {4 - saved}" in log
            assert_same_run(exact_reference, _download(out, tmp_path / f"run{i}"))


# --------------------------------------------------------------------------- the store


def _group(p, lengths, rng):
    def one(j, n):
        f = rng.standard_normal((3, n)).astype(np.float32)
        return Sample(
            prompt_index=p,
            sample_index=j,
            prompt_tokens=np.asarray([5, 6, p], np.int32),
            tokens=rng.integers(0, 50, n).astype(np.int32),
            logprobs=f[0],
            entropies=f[1],
            sampling_logprobs=f[2],
            truncated=bool(j % 2),
            length=n,
            finish_reason="eos" if j % 2 else "length",
        )

    samples = [one(j, n) for j, n in enumerate(lengths)]
    results = [
        RewardResult.of(RewardStatus.CORRECT if j % 2 else RewardStatus.WRONG, "d", 0.5)
        for j in range(len(lengths))
    ]
    # partial credit (a registered reward's) is kept too
    results[0] = RewardResult(reward=0.25, status=RewardStatus.WRONG, detail="d", elapsed_s=0.5)
    return samples, results


def test_a_saved_group_reads_back_exactly_and_a_foreign_one_is_decoded_again(tmp_path):
    rng = np.random.default_rng(0)
    store = partial.StepStore(tmp_path, 7, limit=9, log=lambda s: None).round(0)
    samples, results = _group(3, [4, 0, 9], rng)
    store.put(3, "uid-3", samples, results)
    store.put(1, "uid-1", *_group(1, [2, 2, 2], rng))
    store.close()
    lines = []
    again = partial.StepStore(tmp_path, 7, limit=9, log=lines.append).round(0)
    found = again.load(["uid-0", "other", "uid-2", "uid-3"], group_size=3)
    assert list(found) == [3]  # prompt 1's file names another prompt: decoded again
    assert any("holds ('uid-1', 3, 9)" in x for x in lines)
    got, got_results, _ = found[3]
    for a, b in zip(samples, got):
        assert a.prompt_index == b.prompt_index and a.sample_index == b.sample_index
        assert a.length == b.length and a.truncated == b.truncated
        for f in ("tokens", "logprobs", "entropies", "sampling_logprobs", "prompt_tokens"):
            assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert got_results == results
    other_limit = partial.StepStore(tmp_path, 7, limit=5, log=lines.append).round(0)
    assert other_limit.load(["uid-0", "uid-1", "uid-2", "uid-3"], group_size=3) == {}
    (tmp_path / partial.ROLLOUTS / "step_00000007" / "round_0" / "group_000003.npz").write_bytes(
        b"not npz"
    )
    assert again.load(["uid-0", "other", "uid-2", "uid-3"], group_size=3) == {}
    assert any("unreadable" in x for x in lines)
    partial.StepStore(tmp_path, 8, limit=9).round(0).put(0, "u", *_group(0, [1], rng))
    assert partial.prune(tmp_path, keep=(8,)) == [7]
