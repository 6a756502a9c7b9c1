"""The persistent compilation cache on ``gs://`` (``MAGIC_JAX_COMPILATION_CACHE``), against
the Cloud Storage emulator.

The default ``magic-jax train`` (shortened) twice, each run in a fresh empty HOME: the
second compiles nothing and reads every executable from the bucket. Two two-process
jobs: only process 0 writes entries, and reads them back in the second. A
bucket that cannot be used is a one-line warning, and the run goes on without the cache.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import GcsEmulator

from magic_jax import compile_cache, storage

SUMMARY = re.compile(
    r"([\d.]+)s compiling (\d+) executables, ([\d.]+)s reading (\d+) from the persistent cache"
)


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gcs")
    with GcsEmulator(root / "emulator.log").in_env() as emulator:
        yield emulator


def _env(home, cache: str, **extra) -> dict[str, str]:
    home.mkdir(parents=True)
    return dict(os.environ, HOME=str(home), MAGIC_JAX_COMPILATION_CACHE=cache, **extra)


def _entries(uri: str) -> list[str]:
    return sorted(k for k in storage.listing(uri) if k.endswith("-cache"))


def test_cache_dir_keeps_a_bucket_uri(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.ENV, "gs://b/jax/")
    assert compile_cache.cache_dir() == "gs://b/jax"
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "c"))
    assert compile_cache.cache_dir() == tmp_path / "c"
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.cache_dir() is None


@pytest.mark.slow  # two shortened default runs (35-56 s on 2 cores)
def test_default_train_twice_compiles_nothing_the_second_time(gcs, tmp_path):
    uri = gcs.uri("jax-cache")
    counts = []
    for i in range(2):
        home = tmp_path / f"home{i}"
        argv = ["train", "--set", f"output_dir={tmp_path / f'run{i}'}", "--set",
                "stages.0.steps=1", "--set", "stages.1.steps=1", "--set", "eval.every=2",
                "--set", "eval.num_samples=1", "--set", "rewards.num_workers=1"]  # fmt: skip
        proc = subprocess.run(
            [sys.executable, "-m", "magic_jax.jobs.cli", *argv], cwd=tmp_path,
            env=_env(home, uri), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        last = proc.stdout.strip().splitlines()[-1]
        found = SUMMARY.search(last)
        assert last.startswith("[done]") and found, last
        counts.append((int(found[2]), int(found[4])))
        assert not (home / ".cache" / "magic-jax" / "jax").exists()
        if i == 0:
            written = _entries(uri)
    (compiled0, hits0), (compiled1, hits1) = counts
    # a run also reads entries it wrote itself (one program built by two jit wrappers)
    assert compiled0 > 20 and len(written) == compiled0
    assert compiled1 == 0 and hits1 == compiled0 + hits0
    assert _entries(uri) == written  # the second run wrote nothing
    assert not (tmp_path / "gs:").exists()  # no local directory named after the URI


_WORKER = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    pid, port = int(sys.argv[1]), sys.argv[2]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from magic_jax import compile_cache
    compile_cache.enable()
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    x = jax.make_array_from_callback(
        (8,), NamedSharding(mesh, P("d")), lambda i: np.arange(8.0, dtype=np.float32)[i])
    def shared_by_both(v):
        return jnp.sum(v * v)
    total = jax.jit(shared_by_both, out_shardings=NamedSharding(mesh, P()))(x)
    def only_on(v):
        return v + pid
    only_on.__name__ = f"only_on_process_{pid}"
    jax.jit(only_on)(np.float32(1.0)).block_until_ready()
    c = compile_cache.CLOCK
    print(f"process {pid}: total {float(total)} compiled {c.compiled} hits {c.cache_hits}")
    jax.distributed.shutdown()
    """
)


def _two_processes(tmp_path, uri: str, tag: str) -> dict[int, tuple[int, int]]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = "--xla_force_host_platform_device_count=2"
    procs = []
    for pid in (0, 1):
        env = _env(tmp_path / f"{tag}-home{pid}", uri, XLA_FLAGS=flags)
        argv = [sys.executable, "-c", _WORKER, str(pid), str(port)]
        procs.append(subprocess.Popen(argv, cwd=tmp_path, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    out = {}
    for pid, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        found = re.search(r"total 140.0 compiled (\d+) hits (\d+)", stdout)
        assert found, stdout + stderr[-2000:]
        out[pid] = (int(found[1]), int(found[2]))
    return out


@pytest.mark.slow  # about 20 s: the slow target
def test_on_two_processes_only_process_zero_writes(gcs, tmp_path):
    """Process 1 writes nothing, also when the bucket lacks its programs. On CPU a
    program's key differs between the processes (JAX hashes each process's CPU topology
    into it), so process 1 compiles again; on a TPU slice the topology, and so the key,
    is the slice's."""
    uri = gcs.uri("jax-cache-2p")
    first = _two_processes(tmp_path, uri, "first")
    names = _entries(uri)
    assert len(names) == first[0][0] == 2, names
    assert {n.split("-")[0] for n in names} == {"jit_shared_by_both", "jit_only_on_process_0"}
    second = _two_processes(tmp_path, uri, "second")
    assert second[0] == (0, 2)  # process 0 reads all it wrote
    assert second[1] == (2, 0)
    assert _entries(uri) == names


def test_an_unusable_bucket_is_one_warning_and_no_cache(gcs, monkeypatch, capsys):
    monkeypatch.setenv(compile_cache.ENV, "gs://no-such-bucket/jax")
    assert compile_cache.enable() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gs://no-such-bucket/jax" in err[0], err
    assert compile_cache.ENV in err[0] and "does not exist" in err[0]
