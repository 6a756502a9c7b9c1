"""Moves weights from the trainer's layout to the sampler's, on device."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from magic_jax.sharding import SAMPLE_RULES, Rules, model_shardings


class Resharder:
    """A compiled copy of a parameter state into the sampling shardings.

    The copy is one jitted program whose outputs carry the sampler's
    ``NamedSharding``s: XLA moves the shards with collectives (all-gathers over
    ``fsdp``), never through the host, so it runs under
    ``jax.transfer_guard('disallow')``. The trainer's arrays are left intact
    (not donated): it keeps training on them.
    """

    def __init__(self, params: nnx.State, mesh: Mesh, rules: Rules = SAMPLE_RULES):
        """Args: params: a state (or abstract state) with the parameters' metadata."""
        self.shardings = model_shardings(params, mesh, rules)
        self._copy = jax.jit(lambda x: x, out_shardings=self.shardings)

    def __call__(self, params: nnx.State) -> Any:
        """The parameters, resharded for sampling."""
        return self._copy(params)
