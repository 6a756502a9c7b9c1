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


_CUBES = ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16",
           "8x16x16", "16x16x16")  # fmt: skip


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


def parse_topology(name: str) -> tuple[Chip, int]:
    """``v5e:4x4`` -> (the v5e chip, 16 chips).

    Raises:
      PlanError: an unknown generation or a malformed shape.
    """
    m = re.fullmatch(r"(v\d+[a-z]*)[:_-]((?:\d+x)*\d+)", name.strip())
    if not m:
        raise PlanError(f"--topology {name!r}: expected GENERATION:SHAPE, e.g. v5e:4x4, v5p:2x2x2")
    gen, shape = m.groups()
    if gen not in CHIPS:
        raise PlanError(
            f"--topology {name!r}: unknown TPU generation {gen!r}; known: {list(CHIPS)}"
        )
    return CHIPS[gen], math.prod(int(s) for s in shape.split("x"))


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

    _, chips = parse_topology(name)  # a clear error for a malformed name first
    if not libtpu_available():
        raise PlanError(
            "compiling for TPU needs libtpu here: pip install 'jax[tpu]' "
            "(`make test-tpu` sets up .venv-tpu with it)"
        )
    # Nothing runs on a TPU here: several planning processes may load libtpu at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        name = name.replace("-", ":")
        kw = {}
        if chips < 4:  # slices below one host's 2x2 chips
            dims = [int(d) for d in name.split(":")[1].split("x")]
            kw["chips_per_host_bounds"] = tuple([*dims, 1, 1, 1][:3])
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name, **kw)
    except Exception as e:  # libtpu's own message names what is wrong
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PlanError(f"--topology {name!r}: {msg}") from None
    return list(topo.devices)
