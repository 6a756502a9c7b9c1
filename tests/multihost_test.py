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
    # The engine's copy holds exactly the trained weights.
    for k in (f for f in got.files if f.startswith("param/")):
        np.testing.assert_array_equal(got["engine/" + k.removeprefix("param/")], got[k])
