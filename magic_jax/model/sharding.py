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
from collections.abc import Sequence
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
        return tuple(sizes)  # type: ignore[return-value]


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


def maybe_initialize_distributed() -> bool:
    """Calls ``jax.distributed.initialize()`` on multi-host jobs; returns whether it did.

    Cloud TPU pods and SLURM/Open MPI GPU clusters are detected by jax itself;
    ``MAGIC_JAX_COORDINATOR`` / ``MAGIC_JAX_NUM_PROCESSES`` / ``MAGIC_JAX_PROCESS_ID``
    set the coordinator explicitly elsewhere.
    """
    if jax.distributed.is_initialized():
        return False
    coordinator = os.environ.get("MAGIC_JAX_COORDINATOR")
    if coordinator:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=int(os.environ["MAGIC_JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["MAGIC_JAX_PROCESS_ID"]),
        )
        return True
    if os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",") >= 1:
        jax.distributed.initialize()
        return True
    return False


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
