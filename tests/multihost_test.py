"""Multi-host for real on one machine: 2 processes x 4 CPU devices under jax.distributed.

The same programs run as one process over 8 CPU devices give the reference.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
WORKER = HERE / "multihost_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv_of, num_processes: int, devices: int, timeout: float = 600, env=None):
    """Starts ``num_processes`` processes (argv_of(i)) with ``devices`` CPU devices each;
    returns their outputs, failing with every process's log if one fails."""
    base = dict(os.environ if env is None else env)
    base["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    base["JAX_PLATFORMS"] = "cpu"
    procs = [
        subprocess.Popen(
            argv_of(i),
            env=base,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=HERE.parent,
        )
        for i in range(num_processes)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        logs = "\n".join(f"--- process {i} (exit {p.returncode})\n{o[-3000:]}" for i, (p, o) in
                         enumerate(zip(procs, outs)))  # fmt: skip
        pytest.fail(f"a process failed:\n{logs}")
    return outs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from magic_jax.testing import make_hf_model, save_hf_model

    path = tmp_path_factory.mktemp("multihost") / "model"
    hf = make_hf_model(
        seed=0,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    save_hf_model(hf, path)
    return path


def _worker(out, model_dir, n):
    port = free_port()
    return lambda i: [sys.executable, str(WORKER), str(out), str(model_dir), str(n), str(i),
                      str(port)]  # fmt: skip


@pytest.mark.slow
def test_update_and_reshard_on_two_hosts_equal_one_host(model_dir, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    launch(_worker(one, model_dir, 1), 1, 8)
    launch(_worker(two, model_dir, 2), 2, 4)
    ref, got = np.load(one / "result.npz"), np.load(two / "result.npz")
    assert int(got["process_count"]) == 2 and int(ref["process_count"]) == 1
    assert bool(got["same_layout"]) and bool(ref["same_layout"])
    assert set(ref.files) == set(got.files)
    assert float(ref["metric/grad_norm"][0]) > 0 and int(ref["metric/num_sgd_steps"]) == 2
    for k in (f for f in ref.files if f.split("/")[0] in ("param", "engine", "metric")):
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-7, err_msg=k)
    # magic_jax.distributed's host-side agreements, with unequal lists on the two hosts
    assert list(got["ragged_sizes"]) == [1, 1, 2] and list(ref["ragged_sizes"]) == [1]
    assert list(got["ragged"]) == [0, 0, 0, 2] and list(ref["ragged"]) == [0]
    assert list(got["strings"]) == ["", "p0", "é", "p1"] and list(ref["strings"]) == ["", "p0"]
    assert int(got["max_int"]) == 7 and int(got["on_primary"]) == 11
    # The engine's copy holds exactly the trained weights.
    for k in (f for f in got.files if f.startswith("param/")):
        np.testing.assert_array_equal(got["engine/" + k.removeprefix("param/")], got[k])


# --------------------------------------------------------------------------- magic-jax train


@pytest.fixture(scope="module")
def train_files(tmp_path_factory):
    """The tiny sums run of the trainer tests on a (fsdp 4, tensor 2) mesh: 2 steps."""

    import yaml
    from conftest import write_sums_run

    root = write_sums_run(tmp_path_factory.mktemp("mh_train"))
    raw = {
        "model": str(root / "model"),
        "data": {"train": [str(root / "train.jsonl")], "max_prompt_length": 16},
        "stages": [
            {
                "steps": 2,
                "max_response_length": 3,
                "prompts_per_step": 4,
                "mini_batch_groups": 2,
                "group_size": 8,
            }
        ],
        "mesh": {"fsdp": 4, "tensor": 2},
        # all 32 samples of a step decode at once: fewer decode programs to compile
        "rollout": {"max_concurrent_decodes": 32, "decode_steps": 8},
        # Adam's eps 1e-4 (not 1e-8): the k_proj biases' gradient is zero up to rounding
        # (softmax ignores a per-query constant), and Adam would turn that noise, summed
        # in another order by a cross-process all-reduce, into lr-sized steps.
        "optimizer": {"learning_rate": 1e-2, "eps": 1e-4},
        "entropy": {"target": 5.0, "delta": 0.01},
        "rewards": {"num_workers": 1},
        "checkpoint_every": 1,
        "keep_checkpoints": 2,
        "export_dtype": "float32",
    }
    (root / "run.yaml").write_text(yaml.safe_dump(raw))
    return root


def _train(root, out, n, port, *more):
    """argv_of for ``launch``: process i of ``magic-jax train`` over n processes."""

    def argv(i):
        env = [f"MAGIC_JAX_COORDINATOR=localhost:{port}", f"MAGIC_JAX_NUM_PROCESSES={n}",
               f"MAGIC_JAX_PROCESS_ID={i}"] if n > 1 else []  # fmt: skip
        return ["env", *env, sys.executable, "-m", "magic_jax.jobs.cli", "train",
                str(root / "run.yaml"), "--set", f"output_dir={out}", *more]  # fmt: skip

    return argv


def _records(out):
    from magic_jax.run import rundir

    return [
        {k: v for k, v in r.items() if not k.startswith("t_") and k != "rollout_tokens_per_s"}
        for r in rundir.read_records(out / "metrics.jsonl")
    ]


def _close(got, want, where):
    """Equal records: integers, strings and counts exactly, floats to rtol 1e-5 (the
    sampler's |log ratio|, rounding noise in an fp32 run, to 1e-5 absolute)."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), where
        for k in want:
            _close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _close(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        # |log pi_trainer - log pi_sampler| is float32 rounding of log-probs (|log p| up to
        # ~10 here) in an fp32 run: near zero, where only an absolute tolerance applies
        atol = 1e-5 if ".sampler_abs_log_ratio" in where else 1e-7
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol, err_msg=where)
    else:
        assert got == want, where


def _stopped_by_sigterm_to_process_1(argv_of, env, tmp_path) -> list[str]:
    """Starts 2 processes x 4 devices, sends SIGTERM to process 1 once its first step has
    begun, and returns both logs; both must exit with 143 (stopped by SIGTERM)."""
    import signal
    import time

    env = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONUNBUFFERED="1")  # fmt: skip
    logs = [tmp_path / f"stop-{i}.log" for i in range(2)]
    procs = []
    try:
        for i, log in enumerate(logs):
            with open(log, "w") as f:
                procs.append(
                    subprocess.Popen(
                        argv_of(i), env=env, stdout=f, stderr=subprocess.STDOUT, cwd=HERE.parent
                    )
                )
        deadline = time.monotonic() + 300
        # "[stage 0]" is printed with the stop handlers installed, just before step 0,
        # whose first compilations take seconds: the signal lands inside step 0.
        while "[stage 0]" not in logs[1].read_text():
            assert time.monotonic() < deadline and procs[1].poll() is None, logs[1].read_text()
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = [log.read_text() for log in logs]
    assert codes == [143, 143], "\n".join(o[-3000:] for o in outs)
    return outs


@pytest.mark.slow
def test_train_on_two_hosts_with_a_resume_equals_one_host(train_files, tmp_path):
    import json

    from safetensors.numpy import load_file

    env = dict(os.environ, MAGIC_JAX_COMPILATION_CACHE=str(tmp_path / "jax_cache"),
               JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")  # fmt: skip
    one, two = tmp_path / "one", tmp_path / "two"
    launch(_train(train_files, one, 1, 0), 1, 8, env=env)
    # Two processes; SIGTERM to process 1 alone during step 0: both stop at the same
    # decode chunk or optimizer step (distributed.agreed_stop), keeping the groups each
    # finished, then a second two-process job resumes the step.
    first = _stopped_by_sigterm_to_process_1(_train(train_files, two, 2, free_port()), env,
                                             tmp_path)  # fmt: skip
    done = len(_records(two))
    for out in first:
        assert "[stop] stop asked (signal 15) during" in out, out[-2000:]
        assert f"[stop] SIGTERM: stopped at step {done} (checkpoint at step {done})" in out
    second = launch(_train(train_files, two, 2, free_port()), 2, 4, env=env)
    for out in second:  # both processes restored the step process 0 chose
        assert done == 0 or f"continuing at step {done}" in out, out[-2000:]
    got, want = _records(two), _records(one)
    assert [r["step"] for r in got] == [0, 1]
    assert want[0]["sgd_steps"] > 0 and want[0]["reward_status"]["correct"] > 0
    _close(got, want, "metrics")
    s_got, s_want = (json.loads((o / "summary.json").read_text()) for o in (two, one))
    for s in (s_got, s_want):
        s.pop("hf_export")
        s["last"] = {k: v for k, v in s["last"].items() if k in want[-1]}
    _close(s_got, s_want, "summary")
    w_got = load_file(str(two / "hf_final" / "model.safetensors"))
    w_want = load_file(str(one / "hf_final" / "model.safetensors"))
    w_init = load_file(str(train_files / "model" / "model.safetensors"))
    assert sorted(w_got) == sorted(w_want) == sorted(w_init)
    # What training changed agrees to 1e-5 of the largest change (all-reduces across
    # processes sum in another order than within one: the last bits differ).
    scale = max(float(np.abs(w_want[k] - w_init[k]).max()) for k in w_init)
    assert scale > 1e-3
    for k in w_want:
        np.testing.assert_allclose(
            w_got[k] - w_init[k], w_want[k] - w_init[k], rtol=1e-5, atol=1e-5 * scale, err_msg=k
        )
    # each process wrote its own shards of each checkpoint (orbax's OCDBT per process)
    for step in (1, 2):
        state = two / "checkpoints" / f"step_{step:08d}" / "state"
        assert (state / "ocdbt.process_0").is_dir() and (state / "ocdbt.process_1").is_dir()


@pytest.mark.slow
def test_train_on_two_hosts_writes_a_verified_checkpoint_to_the_bucket(
    train_files, tmp_path, monkeypatch
):
    import json

    from conftest import GcsEmulator

    from magic_jax import storage
    from magic_jax.run import rundir
    from magic_jax.run.checkpoint import MANIFEST, verify_checkpoint

    emulator = GcsEmulator(tmp_path / "emulator.log")
    try:
        for k, v in emulator.env.items():  # this process reads the bucket too
            monkeypatch.setenv(k, v)
        model, out = emulator.uri("model"), emulator.uri("run")
        fs = storage.gcs_fs()
        for f in sorted((train_files / "model").rglob("*")):
            if f.is_file():
                fs.put_file(str(f), f"{model}/{f.relative_to(train_files / 'model').as_posix()}")
        env = dict(os.environ, MAGIC_JAX_COMPILATION_CACHE=str(tmp_path / "jax_cache"),
                   JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
                   **{storage.CACHE_ENV: str(tmp_path / "gcs_cache")})  # fmt: skip
        one = tmp_path / "one"
        steps = ("--set", "stages.0.steps=1")
        launch(_train(train_files, one, 1, 0, *steps), 1, 8, env=env)
        launch(_train(train_files, out, 2, free_port(), *steps, "--set", f"model={model}"),
               2, 4, env=env)  # fmt: skip
        names = storage.listing(out)
        ckpt = f"{out}/checkpoints/step_00000001"
        assert f"checkpoints/step_00000001/{MANIFEST}" in names, sorted(names)
        assert verify_checkpoint(ckpt) is None
        files = json.loads(storage.path(f"{ckpt}/{MANIFEST}").read_text())["files"]
        for i in range(2):  # the shards each process wrote (orbax's OCDBT per process)
            assert f"state/ocdbt.process_{i}/manifest.ocdbt" in files, sorted(files)
            assert f"state/array_metadatas/process_{i}" in files, sorted(files)
            assert any(f.startswith(f"state/ocdbt.process_{i}/d/") for f in files), sorted(files)
        assert "hf_final/model.safetensors" in names
        # the model was read from the bucket (copied to the local cache)
        assert list((tmp_path / "gcs_cache").rglob("model.safetensors"))
        assert rundir.LOCK not in names  # released after a clean finish
        got, want = _records(storage.path(out)), _records(one)
        assert [r["step"] for r in got] == [0] and want[0]["sgd_steps"] > 0
        _close(got, want, "metrics")
    finally:
        emulator.stop()
