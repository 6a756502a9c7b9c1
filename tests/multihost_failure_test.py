"""On a multi-host run nothing hangs: 2 processes x 4 CPU devices under jax.distributed.

One process fails (raises, hangs, is killed) in the middle of a step; the other,
waiting in a collective, must end too, both with a nonzero status, in bounded time,
with the failing process's report in the run directory's ``logs/``. First on a loop of
collectives (``multihost_worker.loop``), then on ``magic-jax train`` itself.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multihost_test import free_port

HERE = Path(__file__).resolve().parent
WORKER = HERE / "multihost_worker.py"


def run_two(argv_of, env_of, logs_dir: Path, timeout: float, cwd: Path = HERE.parent):
    """Starts processes 0 and 1 (argv_of(i), env_of(i)) with 4 CPU devices each, in
    ``cwd``; returns their exit statuses, the times they ended (time.time()) and their logs."""
    base = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
                JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")  # fmt: skip
    logs = [logs_dir / f"process-{i}.log" for i in range(2)]
    procs = []
    try:
        for i, log in enumerate(logs):
            with open(log, "w") as f:
                env = dict(base, **env_of(i))
                p = subprocess.Popen(argv_of(i), env=env, stdout=f, stderr=subprocess.STDOUT,
                                     cwd=cwd)  # fmt: skip
                procs.append(p)
        ended = [None, None]
        deadline = time.monotonic() + timeout
        while None in ended and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.time()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = [log.read_text() for log in logs]
    assert None not in ended, "a process still ran:\n" + "\n".join(t[-3000:] for t in texts)
    return [p.returncode for p in procs], ended, texts


def fault_time(log: str) -> float:
    """When the test hook fired (its ``[test] raise|hang at T`` line)."""
    found = re.search(r"\[test\] (?:raise|hang) at ([0-9.]+)", log)
    assert found, log[-3000:]
    return float(found.group(1))


def _loop(out, port, watchdog_s=0.0):
    return lambda i: [sys.executable, str(WORKER), "loop", str(out), "2", str(i), str(port),
                      str(watchdog_s)]  # fmt: skip


# --------------------------------------------------------------------------- collectives


def test_a_raise_on_one_host_ends_both_within_seconds(tmp_path):
    env = {1: {"MAGIC_JAX_FAULT_AT": "raise:loop:3"}}
    codes, ended, logs = run_two(_loop(tmp_path, free_port()), lambda i: env.get(i, {}),
                                 tmp_path, 120)  # fmt: skip
    t = fault_time(logs[1])
    assert codes[1] == 1 and codes[0] == 3, logs  # 3: another process failed
    assert max(ended) - t < 15, (max(ended) - t, logs)
    # the failing host's traceback: in its report, and in the other host's log
    reports = list((tmp_path / "logs").glob("failure-process1-*.txt"))
    assert len(reports) == 1, list((tmp_path / "logs").iterdir())
    assert "RuntimeError: test fault MAGIC_JAX_FAULT_AT=raise:loop:3" in reports[0].read_text()
    assert "[failure] process 1 of 2 failed" in logs[0] or "process 1 had failed" in logs[0]


# killing process 1 takes 12 s to end process 0 (measured): the slow suite; 0 stays default
@pytest.mark.parametrize(
    "killed", [pytest.param(1, marks=[pytest.mark.slow, pytest.mark.serial]), 0]
)
def test_a_killed_host_ends_the_other(tmp_path, killed):
    # The other is not in a collective (as a TPU host waiting on the interconnect, whose
    # collective never errors): only the coordination service can tell. A killed process
    # 1 misses its heartbeats (the bound); process 0 takes the service with it (at once).
    other = 1 - killed
    env = {other: {"MAGIC_JAX_FAULT_AT": "hang:loop:3"}, killed: {"MAGIC_JAX_KILL_AT": "step:3"}}
    heartbeat = 10
    codes, ended, logs = run_two(
        _loop(tmp_path, free_port()),
        lambda i: dict(env[i], MAGIC_JAX_HEARTBEAT_S=str(heartbeat)),
        tmp_path,
        120,
    )
    assert codes[killed] == -9 and codes[other] != 0, (codes, logs)
    waited = ended[other] - ended[killed]
    print(f"process {other} ended {waited:.1f}s after process {killed} was killed")
    low, high = (heartbeat - 2, 2 * heartbeat + 10) if killed else (-1, 10)
    assert low < waited < high, (waited, logs[other][-3000:])
    assert "JAX distributed service detected fatal errors" in logs[other], logs[other][-3000:]


def test_a_hung_host_ends_both_with_every_hosts_stacks(tmp_path):
    limit = 4.0
    env = {0: {"MAGIC_JAX_FAULT_AT": "hang:loop:3"}}
    codes, ended, logs = run_two(_loop(tmp_path, free_port(), limit), lambda i: env.get(i, {}),
                                 tmp_path, 120)  # fmt: skip
    t = fault_time(logs[0])
    assert all(c in (124, 3) for c in codes) and 124 in codes, (codes, logs)
    assert max(ended) - t < limit + 15, (max(ended) - t, logs)
    dumps = {i: list((tmp_path / "logs").glob(f"watchdog-process{i}-*.txt")) for i in (0, 1)}
    assert all(len(d) == 1 for d in dumps.values()), list((tmp_path / "logs").iterdir())
    hung = dumps[0][0].read_text()
    assert "Thread MainThread" in hung and "in _fault_hook" in hung and "time.sleep" in hung
    assert "[watchdog] process" in logs[0] + logs[1]


# --------------------------------------------------------------------------- magic-jax train


@pytest.fixture(scope="module")
def train_files(tmp_path_factory):
    """The tiny sums run on a (fsdp 4, tensor 2) mesh over the two processes: 4 steps."""
    import yaml
    from conftest import write_sums_run

    root = write_sums_run(tmp_path_factory.mktemp("mh_fail"))
    raw = {
        "model": str(root / "model"),
        "data": {"train": [str(root / "train.jsonl")], "max_prompt_length": 16},
        "stages": [{"steps": 4, "max_response_length": 3, "prompts_per_step": 4,
                    "mini_batch_groups": 2, "group_size": 8}],
        "mesh": {"fsdp": 4, "tensor": 2},
        "rollout": {"max_concurrent_decodes": 32, "decode_steps": 8},
        "optimizer": {"learning_rate": 1e-2, "eps": 1e-4},
        "rewards": {"num_workers": 1},
        "checkpoint_every": 1,
        "export_hf": False,
    }  # fmt: skip
    (root / "run.yaml").write_text(yaml.safe_dump(raw))
    return root


def _train(root, out, port, *more):
    def argv(i):
        return [sys.executable, "-m", "magic_jax.jobs.cli", "train", str(root / "run.yaml"),
                "--set", f"output_dir={out}", *more]  # fmt: skip

    def env(i):
        return {"MAGIC_JAX_COORDINATOR": f"localhost:{port}", "MAGIC_JAX_NUM_PROCESSES": "2",
                "MAGIC_JAX_PROCESS_ID": str(i),
                "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo"}  # fmt: skip

    return argv, env


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One compilation cache for the module's runs: the second run compiles little."""
    return str(tmp_path_factory.mktemp("jax_cache"))


def _train_with_fault(train_files, cache, tmp_path, process, fault, *more):
    """Two processes of ``magic-jax train`` with ``MAGIC_JAX_FAULT_AT=fault`` in
    ``process``; returns (the run directory, exit codes, end times, logs)."""
    out = tmp_path / "run"
    argv, env = _train(train_files, out, free_port(), *more)
    faults = {process: {"MAGIC_JAX_FAULT_AT": fault}}
    codes, ended, logs = run_two(
        argv, lambda i: dict(env(i), MAGIC_JAX_COMPILATION_CACHE=cache, **faults.get(i, {})),
        tmp_path, 600,
    )  # fmt: skip
    return out, codes, ended, logs


@pytest.mark.slow
@pytest.mark.serial  # a signal or heartbeat timed against the clock
def test_train_a_raise_on_process_1_at_step_2_ends_both(train_files, cache, tmp_path):
    out, codes, ended, logs = _train_with_fault(
        train_files, cache, tmp_path, 1, "raise:decode chunk:2"
    )
    t = fault_time(logs[1])
    print(f"both ended {max(ended) - t:.1f}s after the raise (exit {codes})")
    assert codes[1] == 1 and codes[0] == 3, (codes, logs[0][-3000:], logs[1][-3000:])
    assert max(ended) - t < 120
    assert "[step 1]" in logs[0]  # steps 0 and 1 ran; step 2 failed
    reports = list((out / "logs").glob("failure-process1-*.txt"))
    assert len(reports) == 1, list((out / "logs").iterdir())
    text = reports[0].read_text()
    assert text.startswith("magic-jax train failed on process 1 (exit 1)")
    assert "RuntimeError: test fault MAGIC_JAX_FAULT_AT=raise:decode chunk:2" in text
    assert "rollout/driver.py" in text  # where the step was
    # process 0's log (the one launch.sh follows) holds process 1's traceback too
    assert "[failure] process 1 of 2 failed" in logs[0], logs[0][-3000:]
    assert "test fault MAGIC_JAX_FAULT_AT" in logs[0]


@pytest.mark.slow
@pytest.mark.serial  # a signal or heartbeat timed against the clock
def test_train_a_hang_on_process_0_ends_both_by_the_watchdog(train_files, cache, tmp_path):
    limit = 30
    out, codes, ended, logs = _train_with_fault(
        train_files, cache, tmp_path, 0, "hang:decode chunk:2", "--set", f"watchdog_s={limit}"
    )
    t = fault_time(logs[0])
    print(f"both ended {max(ended) - t:.1f}s after the hang (limit {limit}s, exit {codes})")
    assert all(c in (124, 3) for c in codes) and 124 in codes, (codes, logs)
    assert max(ended) - t < limit + 60
    dumps = {i: list((out / "logs").glob(f"watchdog-process{i}-*.txt")) for i in (0, 1)}
    assert all(len(d) == 1 for d in dumps.values()), list((out / "logs").iterdir())
    hung = dumps[0][0].read_text()
    assert "Thread MainThread" in hung and "in _fault_hook" in hung and "rollout/driver.py" in hung
    assert "[watchdog] process" in logs[0] + logs[1]
