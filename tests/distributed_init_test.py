"""Where ``maybe_initialize_distributed`` starts ``jax.distributed``, and with what.

Each environment is faked the way JAX's own cluster detection reads it: the
variables of SLURM, Open MPI and GKE; the VM metadata server of a Cloud TPU VM,
a real HTTP server on 127.0.0.1 that answers as GCE's does (JAX's own client
reaches it through ``GCE_METADATA_IP``; no ``Metadata-Flavor: Google`` header is a
403, a missing key a 404); and whether this is a TPU VM at all (decided by JAX at
import from the PCI bus). ``jax.distributed.initialize`` is replaced by a
recorder that checks its arguments against the real signature and then lets
JAX's detection resolve them (coordinator, process count, id, local devices) as
the real call would. No second process is involved.
"""

import http.server
import inspect
import threading
import time

import jax
import pytest
from jax._src import clusters
from jax._src.clusters import cloud_tpu_cluster

from magic_jax.model import sharding

REAL_INITIALIZE = jax.distributed.initialize

VARIABLES = (
    "MAGIC_JAX_COORDINATOR", "MAGIC_JAX_NUM_PROCESSES", "MAGIC_JAX_PROCESS_ID",
    "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
    "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES",
    "TPU_WORKER_ID", "TPU_SKIP_MDS_QUERY", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID",
    "MEGASCALE_COORDINATOR_ADDRESS", "KUBERNETES_SERVICE_HOST", "JAX_COORDINATOR_PORT",
    "JAX_COORDINATOR_ADDRESS", "JAX_LOCAL_DEVICE_IDS",
)  # fmt: skip


HEARTBEAT = {"heartbeat_timeout_seconds": 60}  # distributed.initialize_options()


class Recorder:
    """Stands in for ``jax.distributed``: records ``initialize``'s arguments and what
    JAX's cluster detection makes of them."""

    def __init__(self):
        self.calls, self.resolved = [], []

    def initialize(self, **kwargs):
        inspect.signature(REAL_INITIALIZE).bind(**kwargs)  # arguments jax 0.10.2 takes
        self.calls.append(kwargs)
        method = kwargs.get("cluster_detection_method")
        if method != "deactivate":  # what initialize itself would resolve
            self.resolved.append(
                clusters.ClusterEnv.auto_detect_unset_distributed_params(
                    None, None, None, None, method, 300
                )
            )

    def is_initialized(self):
        return bool(self.calls)


@pytest.fixture
def dist(monkeypatch, metadata_server):
    """A plain machine: none of the clusters' variables, no TPU, a metadata server
    that fails the test if asked."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    rec = Recorder()
    monkeypatch.setattr(jax.distributed, "initialize", rec.initialize)
    monkeypatch.setattr(jax.distributed, "is_initialized", rec.is_initialized)
    on_tpu_vm(monkeypatch, False)
    # JAX's client waits 0.5 s between its 6 tries of a key that is not 200: not slept
    monkeypatch.setattr(time, "sleep", lambda s: None)
    SERVER[:] = [metadata_server]
    metadata_server.asked.clear()
    metadata(monkeypatch, None)
    yield rec
    assert not metadata_server.asked, f"the metadata server was asked for {metadata_server.asked}"


def on_tpu_vm(monkeypatch, yes: bool) -> None:
    # what jax's cloud_tpu_init decided at import (a TPU chip on the PCI bus and libtpu)
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", yes)
    monkeypatch.setattr(clusters.cluster, "running_in_cloud_tpu_vm", yes)


class MetadataServer(http.server.ThreadingHTTPServer):
    """GCE's metadata server for one VM: ``/computeMetadata/v1/instance/attributes/KEY``
    answers its instance attributes (``attributes``; None: a server that must not be
    asked, and each request is recorded in ``asked``)."""

    PREFIX = "/computeMetadata/v1/instance/attributes/"

    def __init__(self):
        self.attributes: dict[str, str] | None = None
        self.asked: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(h):
                key = h.path.removeprefix(self.PREFIX)
                if h.headers.get("Metadata-Flavor") != "Google":
                    h._answer(403, "Missing required header: Metadata-Flavor")
                elif self.attributes is None:
                    self.asked.append(key)
                    h._answer(500, "this test's metadata server must not be asked")
                elif h.path.startswith(self.PREFIX) and key in self.attributes:
                    h._answer(200, self.attributes[key])
                else:
                    h._answer(404, "not found")

            def _answer(h, code, text):
                body = text.encode()
                h.send_response(code)
                h.send_header("Content-Type", "application/text")
                h.send_header("Content-Length", str(len(body)))
                h.end_headers()
                h.wfile.write(body)

            def log_message(h, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def metadata_server():
    server = MetadataServer()
    yield server
    server.shutdown()


def metadata(monkeypatch, attributes: dict[str, str] | None) -> None:
    """The VM metadata server's instance attributes (a missing key answers 404);
    None: a server that must not be asked."""
    server = SERVER[0]
    server.attributes = attributes
    monkeypatch.setenv("GCE_METADATA_IP", f"127.0.0.1:{server.server_address[1]}")


SERVER: list[MetadataServer] = []  # the module's server, set by the ``dist`` fixture


def test_cloud_tpu_vm_slice_starts_from_the_metadata(dist, monkeypatch, capsys):
    # a v5p-32 made by `gcloud compute tpus tpu-vm create`, seen from worker 2 over ssh
    on_tpu_vm(monkeypatch, True)
    metadata(monkeypatch, {
        "agent-worker-number": "2",
        "worker-network-endpoints": "10.130.0.2,10.130.0.3,10.130.0.4,10.130.0.5",
        "tpu-env": "ACCELERATOR_TYPE: 'v5p-32'\nTYPE: 'V5P'",
    })  # fmt: skip
    assert sharding.maybe_initialize_distributed()
    assert dist.calls == [{"cluster_detection_method": "gcetpu", **HEARTBEAT}]
    assert dist.resolved == [("10.130.0.2:8482", 4, 2, None)]
    # the second call (the trainer's after the CLI's) does nothing and prints nothing more
    assert not sharding.maybe_initialize_distributed()
    assert len(dist.calls) == 1
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[distributed]")]
    assert len(lines) == 1
    assert "(via gcetpu)" in lines[0] and "local devices" in lines[0]
    n = jax.local_device_count()
    assert f"{n} local devices" in lines[0] and str([d.id for d in jax.local_devices()]) in lines[0]


def test_single_host_slices_of_a_multislice_job_start(dist, monkeypatch):
    # two v5litepod-8 slices (one host each) joined by Megascale: two processes
    on_tpu_vm(monkeypatch, True)
    metadata(monkeypatch, {"agent-worker-number": "0", "worker-network-endpoints": "10.0.1.7"})
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "1")
    monkeypatch.setenv("MEGASCALE_COORDINATOR_ADDRESS", "10.0.0.9:8080")
    assert sharding.maybe_initialize_distributed()
    assert dist.resolved == [("10.0.0.9:8482", 2, 1, None)]


@pytest.mark.parametrize(
    "endpoints", ["10.130.0.2", "t1v-n-1a2b3c4d-w-0:0:10.130.0.2"], ids=["new", "old-format"]
)
def test_single_host_tpu_vm_does_not_start(dist, monkeypatch, capsys, endpoints):
    # a v6e-8 or v5litepod-8: one worker in the slice, one process
    on_tpu_vm(monkeypatch, True)
    metadata(monkeypatch, {"agent-worker-number": "0", "worker-network-endpoints": endpoints})
    assert not sharding.maybe_initialize_distributed()
    assert dist.calls == []
    assert "[distributed]" not in capsys.readouterr().out


def test_gke_tpu_starts_from_the_worker_hostnames(dist, monkeypatch):
    on_tpu_vm(monkeypatch, True)
    metadata(monkeypatch, {})  # GKE's metadata server has no TPU VM attributes
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "10.8.0.4,10.8.0.5,10.8.0.6,10.8.0.7")
    monkeypatch.setenv("TPU_WORKER_ID", "3")
    assert sharding.maybe_initialize_distributed()
    assert dist.calls == [{"cluster_detection_method": "gketpu", **HEARTBEAT}]
    assert dist.resolved == [("10.8.0.4:8482", 4, 3, None)]


def test_slurm_gpu_job_starts_one_process_per_gpu(dist, monkeypatch):
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[017-018]", "SLURM_NTASKS": "16",
           "SLURM_PROCID": "9", "SLURM_LOCALID": "1"}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert sharding.maybe_initialize_distributed()
    assert dist.calls == [{"cluster_detection_method": "slurm", **HEARTBEAT}]
    # port: JAX's rule, the job id mod 4096 in the top 4096 ports (4242 % 4096 + 61440)
    assert dist.resolved == [("gpu017:61586", 16, 9, [1])]


def test_slurm_single_task_does_not_start(dist, monkeypatch):
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu017", "SLURM_NTASKS": "1",
           "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert not sharding.maybe_initialize_distributed()
    assert dist.calls == []


def test_open_mpi_job_starts(dist, monkeypatch):
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    assert sharding.maybe_initialize_distributed()
    assert dist.calls == [{"cluster_detection_method": "ompi", **HEARTBEAT}]
    # port: (1531576320 // 4096) % 4096 + 61440
    assert dist.resolved == [("10.96.0.1:62624", 4, 3, [1])]
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")  # mpirun -n 1
    dist.calls.clear()
    assert not sharding.maybe_initialize_distributed()


def test_explicit_variables_win_and_are_passed_as_given(dist, monkeypatch, capsys):
    monkeypatch.setenv("MAGIC_JAX_COORDINATOR", "10.0.0.2:8476")
    monkeypatch.setenv("MAGIC_JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("MAGIC_JAX_PROCESS_ID", "1")
    for k, v in {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "8",
                 "SLURM_PROCID": "5", "SLURM_LOCALID": "1"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    assert sharding.maybe_initialize_distributed()
    assert dist.calls == [{
        "coordinator_address": "10.0.0.2:8476", "num_processes": 2, "process_id": 1,
        "cluster_detection_method": "deactivate", **HEARTBEAT,
    }]  # fmt: skip
    assert "(via MAGIC_JAX_COORDINATOR)" in capsys.readouterr().out
    assert not sharding.maybe_initialize_distributed()
    assert len(dist.calls) == 1


GOOD = {"MAGIC_JAX_COORDINATOR": "10.0.0.2:8476", "MAGIC_JAX_NUM_PROCESSES": "2",
        "MAGIC_JAX_PROCESS_ID": "0"}  # fmt: skip


@pytest.mark.parametrize(
    "change, named",
    [
        ({"MAGIC_JAX_NUM_PROCESSES": None, "MAGIC_JAX_PROCESS_ID": None},
         "MAGIC_JAX_NUM_PROCESSES is not set but MAGIC_JAX_COORDINATOR is"),
        ({"MAGIC_JAX_COORDINATOR": None}, "MAGIC_JAX_COORDINATOR is not set"),
        ({"MAGIC_JAX_PROCESS_ID": ""}, "MAGIC_JAX_PROCESS_ID is not set"),
        ({"MAGIC_JAX_COORDINATOR": "10.0.0.2"}, "MAGIC_JAX_COORDINATOR must be host:port"),
        ({"MAGIC_JAX_COORDINATOR": ":8476"}, "MAGIC_JAX_COORDINATOR must be host:port"),
        ({"MAGIC_JAX_COORDINATOR": "h:http"}, "MAGIC_JAX_COORDINATOR must be host:port"),
        ({"MAGIC_JAX_COORDINATOR": "h:70000"}, "MAGIC_JAX_COORDINATOR must be host:port"),
        ({"MAGIC_JAX_NUM_PROCESSES": "two"}, "MAGIC_JAX_NUM_PROCESSES must be a positive"),
        ({"MAGIC_JAX_NUM_PROCESSES": "0"}, "MAGIC_JAX_NUM_PROCESSES must be a positive"),
        ({"MAGIC_JAX_PROCESS_ID": "2"}, r"MAGIC_JAX_PROCESS_ID must be an integer in \[0, 2\)"),
        ({"MAGIC_JAX_PROCESS_ID": "-1"}, "MAGIC_JAX_PROCESS_ID must be an integer"),
    ],
)  # fmt: skip
def test_explicit_variables_are_checked(dist, monkeypatch, change, named):
    for k, v in {**GOOD, **change}.items():
        if v is not None:
            monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=named):
        sharding.maybe_initialize_distributed()
    assert dist.calls == []


def test_plain_cpu_machine_asks_no_network(dist, monkeypatch, recwarn, capsys):
    # a laptop, or a CPU job in a Kubernetes pod (a CI runner): no TPU chip, so the
    # TPU checks never reach the metadata server (which fails the test if asked)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert not sharding.maybe_initialize_distributed()
    assert dist.calls == []
    assert sharding.detected_cluster() is None
    assert not [w for w in recwarn if "Kubernetes" in str(w.message)]
    assert capsys.readouterr().out == ""
