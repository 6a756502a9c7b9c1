"""Cloud TPU slices to plan for: chip specifications, topology names, and a slice's
devices from ``jax.experimental.topologies`` (with libtpu installed)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

GiB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
    """Public per-chip figures of a TPU generation (Cloud TPU system architecture pages).

    Attributes:
      name: the generation's topology prefix (``v5e``).
      hbm_gib: HBM per chip, GiB.
      hbm_gbps: HBM bandwidth per chip, GB/s.
      bf16_tflops: peak bf16 matmul throughput per chip, TFLOP/s.
      topologies: slice shapes offered, smallest first (the smallest-fit search).
    """

    name: str
    hbm_gib: float
    hbm_gbps: float
    bf16_tflops: float
    topologies: tuple[str, ...]


_CUBES = (
    "2x2x1",
    "2x2x2",
    "2x2x4",
    "2x4x4",
    "4x4x4",
    "4x4x8",
    "4x8x8",
    "8x8x8",
    "8x8x16",
    "8x16x16",
    "16x16x16",
)


# Per chip, from cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e} ("System architecture"):
# HBM capacity (listed in GB; the chips hold that many GiB), HBM bandwidth, peak bf16.
CHIPS: dict[str, Chip] = {
    "v4": Chip(
        name="v4",
        hbm_gib=32,
        hbm_gbps=1200,
        bf16_tflops=275,
        topologies=_CUBES,
    ),
    "v5e": Chip(
        name="v5e",
        hbm_gib=16,
        hbm_gbps=819,
        bf16_tflops=197,
        topologies=("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    ),
    "v5p": Chip(
        name="v5p",
        hbm_gib=95,
        hbm_gbps=2765,
        bf16_tflops=459,
        topologies=_CUBES,
    ),
    "v6e": Chip(
        name="v6e",
        hbm_gib=32,
        hbm_gbps=1640,
        bf16_tflops=918,
        topologies=("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    ),
}


class PlanError(ValueError):
    """A plan that cannot be made (no libtpu, an unknown topology or model)."""


# gcloud accelerator types -> slice shape, from the "Configurations" tables of
# cloud.google.com/tpu/docs/{v5p,v5e,v6e}; v4's are the same cubes (/tpu/docs/types-topologies:
# v4-32 is 2x2x4). v4-N and v5p-N count TensorCores (2 per chip: v5p-128 is 64 chips),
# v5litepod-N and v6e-N count chips.
_CUBE_TYPES = {
    8: "2x2x1",
    16: "2x2x2",
    32: "2x2x4",
    64: "2x4x4",
    128: "4x4x4",
    256: "4x4x8",
    512: "4x8x8",
    1024: "8x8x8",
    2048: "8x8x16",
    4096: "8x16x16",
}
_TORUS_TYPES = {
    1: "1x1",
    4: "2x2",
    8: "2x4",
    16: "4x4",
    32: "4x8",
    64: "8x8",
    128: "8x16",
    256: "16x16",
}
# prefix -> (generation, TensorCores per chip counted by N, N -> shape)
ACCELERATOR_TYPES: dict[str, tuple[str, int, dict[int, str]]] = {
    "v4": ("v4", 2, _CUBE_TYPES),
    "v5p": ("v5p", 2, _CUBE_TYPES | {8192: "16x16x16", 12288: "16x16x24"}),
    "v5litepod": ("v5e", 1, _TORUS_TYPES),
    "v6e": ("v6e", 1, _TORUS_TYPES),
}
_GCLOUD_PREFIX = {gen: prefix for prefix, (gen, _, _) in ACCELERATOR_TYPES.items()}


@dataclasses.dataclass(frozen=True)
class SliceName:
    """A TPU slice by both its names.

    Attributes:
      chip: the generation's figures.
      shape: ``GEN:SHAPE`` as libtpu's ``get_topology_desc`` takes it (``v5p:4x4x4``).
      chips: chips in the slice.
      gcloud: the gcloud accelerator type (``v5p-128``); None for a shape it does not name.
    """

    chip: Chip
    shape: str
    chips: int
    gcloud: str | None

    def __str__(self) -> str:
        return f"{self.gcloud} ({self.shape})" if self.gcloud else self.shape


def gcloud_name(gen: str, shape: str) -> str | None:
    """The accelerator type of a ``gen`` slice of ``shape`` (``v5p``, ``4x4x4`` -> ``v5p-128``)."""
    prefix = _GCLOUD_PREFIX.get(gen)
    if prefix is None:
        return None
    sizes = ACCELERATOR_TYPES[prefix][2]
    return next((f"{prefix}-{n}" for n, s in sizes.items() if s == shape), None)


def resolve_topology(name: str) -> SliceName:
    """A slice named as gcloud names it (``v5p-128``, ``v5litepod-64``, ``v6e-64``, ``v4-32``)
    or as ``GEN:SHAPE`` (``v5e:8x8``).

    Raises:
      PlanError: an unknown generation, accelerator type or size, or a malformed shape.
    """
    text = name.strip().lower()
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", text)
    if m:
        return _accelerator_type(name, m[1], int(m[2]))
    m = re.fullmatch(r"(v\d+[a-z]*)[:_-]((?:\d+x)*\d+)", text)
    if not m:
        raise PlanError(
            f"--topology {name!r}: expected a gcloud accelerator type (v5p-128, v5litepod-64, "
            "v6e-64, v4-32) or GENERATION:SHAPE (v5e:8x8, v5p:4x4x4)"
        )
    gen, shape = m.groups()
    if gen not in CHIPS:
        raise PlanError(
            f"--topology {name!r}: unknown TPU generation {gen!r}; known: {list(CHIPS)}"
        )
    chips = math.prod(int(s) for s in shape.split("x"))
    return SliceName(CHIPS[gen], f"{gen}:{shape}", chips, gcloud_name(gen, shape))


def _accelerator_type(name: str, prefix: str, n: int) -> SliceName:
    if prefix not in ACCELERATOR_TYPES:
        hint = f" (v5e's is v5litepod-{n})" if prefix == "v5e" else ""
        raise PlanError(
            f"--topology {name!r}: unknown accelerator type {prefix!r}{hint}; known: "
            f"{', '.join(p + '-N' for p in ACCELERATOR_TYPES)}, or GENERATION:SHAPE"
        )
    gen, per_chip, sizes = ACCELERATOR_TYPES[prefix]
    if n not in sizes:
        unit = "TensorCores, 2 per chip" if per_chip == 2 else "chips"
        raise PlanError(
            f"--topology {name!r}: no {prefix}-{n} slice; N ({unit}) is one of "
            f"{', '.join(map(str, sizes))}"
        )
    return SliceName(CHIPS[gen], f"{gen}:{sizes[n]}", n // per_chip, f"{prefix}-{n}")


def libtpu_available() -> bool:
    """Whether libtpu is installed (``pip install jax[tpu]``): TPU programs can be compiled."""
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


def topology_devices(name: str) -> list[Any]:
    """The devices of a TPU slice to compile for (needs libtpu: ``pip install jax[tpu]``).

    Raises:
      PlanError: no libtpu, or a slice shape libtpu does not know.
    """
    from jax.experimental import topologies

    s = resolve_topology(name)  # a clear error for a malformed name first
    if not libtpu_available():
        raise PlanError(
            "compiling for TPU needs libtpu here: pip install 'jax[tpu]' "
            "(`make test-tpu` sets up .venv-tpu with it)"
        )
    # Nothing runs on a TPU here: several planning processes may load libtpu at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        name = s.shape
        kw = {}
        if s.chips < 4:  # slices below one host's 2x2 chips
            dims = [int(d) for d in name.split(":")[1].split("x")]
            kw["chips_per_host_bounds"] = tuple([*dims, 1, 1, 1][:3])
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name, **kw)
    except Exception as e:  # libtpu's own message names what is wrong
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PlanError(f"--topology {s}: {msg}") from None
    return list(topo.devices)
