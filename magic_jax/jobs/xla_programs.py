"""Programs compiled ahead of time for a TPU slice: their per-device memory and costs, or
what XLA said they need when they do not fit in HBM (the planner's measurements)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any


def cache_copies(program: Program, cache_k: Any) -> int:
    """The ``copy`` instructions of the compiled program whose result holds at least one
    layer's keys (per device) and spans the cache length: relayouts of the cache."""
    if program.compiled is None:
        return 0
    shard = cache_k.sharding.shard_shape(cache_k.shape)  # [B, L, K, S, H] per device
    one_layer = math.prod(shard) // shard[1]
    n = 0
    for dims in re.findall(r"\b\w+\[([\d,]+)\]\{[^}]*\} copy\(", program.compiled.as_text()):
        shape = [int(d) for d in dims.split(",")]
        n += shard[3] in shape and math.prod(shape) >= one_layer
    return n


@dataclasses.dataclass
class Program:
    """A compiled program's per-device memory, or what XLA said it needs when over HBM."""

    compiled: Any
    temp: int
    output: int
    over_hbm: bool

    def cost(self, key: str) -> float:
        if self.compiled is None:
            return 0.0
        ca = self.compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, list | tuple) else ca
        return float((ca or {}).get(key, 0.0))


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}


def compile_program(lowered: Any) -> Program:
    """Compiles for the TPU; a program over HBM is refused by XLA with its temporaries' size."""
    from jax.errors import JaxRuntimeError

    try:
        c = lowered.compile()
    except JaxRuntimeError as e:
        m = re.search(r"required for HLO temporaries \(([\d.]+)([KMGTP]?)\)", str(e))
        if "RESOURCE_EXHAUSTED" not in str(e) or not m:
            raise
        return Program(None, int(float(m[1]) * _UNITS[m[2]]), 0, True)
    ma = c.memory_analysis()
    return Program(c, ma.temp_size_in_bytes, ma.output_size_in_bytes, False)
