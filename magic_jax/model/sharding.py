"""Device mesh, logical-axis rule tables, and state/batch shardings.

The model names logical axes only (``embed``, ``q_heads``, ...). This module
owns the mapping onto the mesh axes ``data`` / ``fsdp`` / ``tensor``:

* ``TRAIN_RULES``: fully-sharded data parallel over ``fsdp`` plus tensor
  parallel over ``tensor`` (the update step).
* ``SAMPLE_RULES``: tensor parallel only, weights replicated over the data
  axes (the rollout engine, where every data shard decodes its own slots).

The stacked layer axis (``layers``) is never sharded: ``nnx.scan`` slices it
one layer per step on every device.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

TRAIN_RULES: Rules = (
    ("batch", BATCH_AXES),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("norm", None),
    ("layers", None),
)

SAMPLE_RULES: Rules = (
    ("batch", BATCH_AXES),
    ("vocab", "tensor"),
    ("embed", None),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("norm", None),
    ("layers", None),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Mesh shape. One axis may be -1: it takes all remaining devices.

    Attributes:
      data: pure data parallelism (replicated weights).
      fsdp: data parallelism with parameters and optimizer state sharded.
      tensor: tensor (model) parallelism inside attention heads and the MLP.
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def __post_init__(self):
        sizes = self.sizes()
        if sum(s == -1 for s in sizes) > 1:
            raise ValueError(f"MeshConfig: at most one axis may be -1, got {self}")
        for name, s in zip(MESH_AXES, sizes):
            if s == 0 or s < -1:
                raise ValueError(f"MeshConfig.{name} must be positive or -1, got {s}")

    def sizes(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.tensor)

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        """Concrete axis sizes for ``num_devices`` devices."""
        sizes = list(self.sizes())
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(
                    f"MeshConfig {self}: {num_devices} devices are not divisible by the fixed "
                    f"axes' product {known}"
                )
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ValueError(
                f"MeshConfig {self}: data*fsdp*tensor = {math.prod(sizes)} but there are "
                f"{num_devices} devices"
            )
        data, fsdp, tensor = sizes
        return data, fsdp, tensor


def make_mesh(config: MeshConfig | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """Builds a ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all devices).

    TPU devices get a topology-aware order from ``jax.make_mesh`` (``tensor`` on
    the fastest interconnect, as the innermost axis). An axis that is no
    product of the slice's physical axes (``tensor=4`` on a 2-D ``8x8`` torus)
    splits a physical axis (``mesh_utils.create_device_mesh`` with
    ``allow_split_physical_axes``): its devices are still neighbours on one
    ring. Other devices given explicitly are used in the order given.
    """
    config = config or MeshConfig()
    devices = list(devices) if devices is not None else jax.devices()
    shape = config.resolve(len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if devices != jax.devices() and devices[0].platform != "tpu":
        return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
    except NotImplementedError:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, MESH_AXES, axis_types=auto)


# The multi-process environments JAX's own cluster detection (``jax._src.clusters``) finds
# and that start jax.distributed by themselves: Open MPI, SLURM, a Cloud TPU VM slice
# (``gcloud compute tpus tpu-vm create``: the VM metadata), GKE TPU (``TPU_WORKER_HOSTNAMES``).
# Not the generic Kubernetes one (any CPU pod of a CI would probe the cluster's API) nor
# mpi4py (opt-in in JAX too): those set the MAGIC_JAX_* variables.
AUTO_CLUSTERS = ("ompi", "slurm", "gcetpu", "gketpu")
COORDINATOR_ENV = "MAGIC_JAX_COORDINATOR"
NUM_PROCESSES_ENV = "MAGIC_JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "MAGIC_JAX_PROCESS_ID"


def explicit_distributed_args(environ: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """``jax.distributed.initialize``'s arguments from the ``MAGIC_JAX_*`` variables.

    Returns:
      None when none of the three is set; else the coordinator, process count and
      id, with JAX's cluster detection off (the variables say everything).

    Raises:
      ValueError: one is missing or malformed, named.
    """
    names = (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV)
    given = {n: environ.get(n, "").strip() for n in names}
    if not any(given.values()):
        return None
    for n in names:
        if not given[n]:
            have = [m for m in names if given[m]]
            raise ValueError(
                f"{n} is not set but {' and '.join(have)} {'is' if len(have) == 1 else 'are'}: "
                f"a multi-host run sets all three of {', '.join(names)}"
            )
    host, _, port = given[COORDINATOR_ENV].rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{COORDINATOR_ENV} must be host:port (process 0's address, e.g. 10.0.0.2:8476), "
            f"got {given[COORDINATOR_ENV]!r}"
        )
    count, index = given[NUM_PROCESSES_ENV], given[PROCESS_ID_ENV]
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"{NUM_PROCESSES_ENV} must be a positive integer, got {count!r}")
    if not index.isdigit() or int(index) >= int(count):
        raise ValueError(
            f"{PROCESS_ID_ENV} must be an integer in [0, {count}) ({NUM_PROCESSES_ENV} is "
            f"{count}), got {index!r}"
        )
    return {
        "coordinator_address": given[COORDINATOR_ENV],
        "num_processes": int(count),
        "process_id": int(index),
        "cluster_detection_method": "deactivate",
    }


def detected_cluster() -> str | None:
    """The name of the multi-process cluster JAX's detection finds here, else None.

    JAX's order and rule (the first environment present wins), limited to
    ``AUTO_CLUSTERS``; one that holds a single process (``srun -n 1``, a
    one-host TPU VM such as v5litepod-8 or v6e-8) is no multi-host job. Off a TPU
    VM (no TPU chip on the PCI bus) the TPU checks read no metadata server, so a
    laptop or CPU run asks no network.
    """
    from jax._src import clusters

    for env in clusters.ClusterEnv._cluster_types:
        if env.name in AUTO_CLUSTERS and not env.opt_in_only_method and env.is_env_present():
            return env.name if env.get_process_count() > 1 else None
    return None


def multi_host_job() -> str | None:
    """How this process is one of several (``MAGIC_JAX_COORDINATOR`` or the cluster
    JAX detects), before anything starts; None for a one-process job."""
    kwargs = explicit_distributed_args()
    if kwargs is not None:
        return COORDINATOR_ENV if kwargs["num_processes"] > 1 else None
    return detected_cluster()


def maybe_initialize_distributed() -> bool:
    """Starts ``jax.distributed`` on a multi-process job; returns whether this call did.

    Explicit ``MAGIC_JAX_COORDINATOR`` / ``MAGIC_JAX_NUM_PROCESSES`` /
    ``MAGIC_JAX_PROCESS_ID`` come first; else JAX's own detection of a
    multi-host Cloud TPU VM slice, GKE TPU, SLURM or Open MPI job
    (``detected_cluster``). A single-host TPU VM, a one-task job and a plain CPU
    or GPU machine start nothing: one process needs no coordinator, and a second
    run on the same VM would find the coordinator's port taken. Each process
    prints one line at start, ``[distributed] process i of n (via ...): local
    devices ...``. A second call (or one after jax was started elsewhere) does nothing.

    Raises:
      ValueError: a missing or malformed ``MAGIC_JAX_*`` variable, named.
    """
    if jax.distributed.is_initialized():
        return False
    kwargs = explicit_distributed_args()
    via = COORDINATOR_ENV
    if kwargs is None:
        detected = detected_cluster()
        if detected is None:
            return False
        via = detected
        kwargs = {"cluster_detection_method": via}
    from magic_jax import distributed

    # a host killed outright ends the others after the heartbeat timeout, not never
    jax.distributed.initialize(**kwargs, **distributed.initialize_options())
    devices = jax.local_devices()
    kinds = ", ".join(sorted({d.device_kind for d in devices}))
    print(
        f"[distributed] process {jax.process_index()} of {jax.process_count()} (via {via}): "
        f"{len(devices)} local devices ({kinds}) ids {[d.id for d in devices]}",
        flush=True,
    )
    return True


def logical_to_spec(
    names: Sequence[str | None] | None,
    rules: Rules,
    mesh: Mesh | None = None,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """Maps logical axis names to a ``PartitionSpec`` through a rule table.

    A mesh axis is used at most once per array (later dims are replicated).
    Given ``mesh`` and ``shape``, a dim that does not divide evenly over its
    mesh axes is replicated instead, with a warning.

    Raises:
      KeyError: a logical name with no rule.
    """
    if not names:
        return PartitionSpec()
    table = dict(rules)
    used: set[str] = set()
    spec: list[Any] = []
    for dim, name in enumerate(names):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no rule in {[r[0] for r in rules]}")
        target = table[name]
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used)
        if axes and mesh is not None and shape is not None:
            size = math.prod(mesh.shape[a] for a in axes)
            if shape[dim] % size:
                log.warning(
                    "dim %d (%s, size %d) does not divide over %s (%d): replicated",
                    dim,
                    name,
                    shape[dim],
                    axes,
                    size,
                )
                axes = ()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def _var_names(v: Any) -> tuple | None:
    if isinstance(v, nnx.Variable):
        return v.get_metadata().get("out_sharding")
    return None


def model_shardings(state: Any, mesh: Mesh, rules: Rules) -> Any:
    """A pytree of ``NamedSharding`` matching an nnx state (or abstract state)."""

    def one(v):
        names = _var_names(v)
        shape = v.shape if hasattr(v, "shape") else None
        spec = logical_to_spec(names, rules, mesh, shape)
        return (
            v.replace(NamedSharding(mesh, spec))
            if isinstance(v, nnx.Variable)
            else NamedSharding(mesh, spec)
        )

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_spec(mesh: Mesh | None = None) -> PartitionSpec:
    """Spec of a batch-leading array: rows split over the data axes."""
    del mesh
    return PartitionSpec(BATCH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(mesh))


def data_shards(mesh: Mesh | None) -> int:
    """How many shards batch rows are split into (the product of the data axes)."""
    if mesh is None:
        return 1
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES if a in mesh.shape]))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def mesh_from_text(text: str | None) -> Mesh | None:
    """The mesh of a ``--mesh`` option, ``data=1,fsdp=-1,tensor=2`` (None or empty: one device).

    Starts ``jax.distributed`` first on a multi-host job.

    Raises:
      ValueError: a malformed option, named with its text.
    """
    if not text:
        return None
    maybe_initialize_distributed()  # a no-op on one host
    try:
        kw = {k.strip(): int(v) for k, v in (p.split("=") for p in text.split(","))}
        return make_mesh(MeshConfig(**kw))
    except (ValueError, TypeError) as e:
        raise ValueError(f"--mesh {text!r}: {e}") from None
