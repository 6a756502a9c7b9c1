"""The update's state: ``TrainState`` and its initialisation (the optimizer state
sharded like the parameters). The update's options are in ``update.config``."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from magic_jax.model.sharding import replicated
from magic_jax.update.config import UpdateConfig
from magic_jax.update.entropy_control import EntropyControlState, init_entropy_control
from magic_jax.update.optim import make_optimizer

log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """Everything an update changes; a pytree of arrays (checkpointed as one).

    Attributes:
      params: fp32 master parameters (``nnx.State`` of ``nnx.Param``).
      opt_state: optax state.
      step: int32 optimizer steps applied.
      skipped: int32 updates skipped for a non-finite loss or gradient.
      entropy: adaptive entropy controller state (c_k).

    The frozen reference policy of the KL term is not part of it: it never
    changes, so it is passed to each step beside the state, never donated,
    never given to the optimizer and never checkpointed (it is rebuilt from
    the run's initial weights or ``loss.kl_reference``).
    """

    params: Any
    opt_state: Any
    step: jax.Array
    skipped: jax.Array
    entropy: EntropyControlState


def init_train_state(params: Any, config: UpdateConfig, *, mesh: Mesh | None = None) -> TrainState:
    """A fresh train state; optimizer state is created next to (sharded like) the params.

    Args:
      params: ``nnx.state(model, nnx.Param)``, possibly sharded.
      config: update options (optimizer, controller).
      mesh: the mesh the params live on (default: the mesh of sharded params, if
        any); scalars (step, counters, controller, Adam's count) are replicated
        over it so every leaf shares the device set.
    """
    low = {str(x.dtype) for x in jax.tree.leaves(params) if x.dtype != jnp.float32}
    if low:
        log.warning("parameters stored as %s: a 1e-6 learning rate may not move them", low)
    tx = make_optimizer(config.optimizer)
    if mesh is None:
        mesh = next(
            (
                x.sharding.mesh
                for x in jax.tree.leaves(params)
                if isinstance(getattr(x, "sharding", None), NamedSharding)
            ),
            None,
        )
    init = jax.jit(tx.init)
    if mesh is not None:
        init = jax.jit(tx.init, out_shardings=opt_state_shardings(tx, params, mesh))
    state = TrainState(
        params=params,
        opt_state=init(params),
        step=jnp.zeros((), jnp.int32),
        skipped=jnp.zeros((), jnp.int32),
        entropy=init_entropy_control(config.entropy),
    )
    if mesh is not None:
        return jax.device_put(state, shardings_on_mesh(state, mesh))
    # Commit every leaf to the params' device: a mix of committed and uncommitted
    # inputs would compile the step a second time once its outputs come back committed.
    device = next(iter(jax.tree.leaves(params)[0].devices()))
    return jax.device_put(state, jax.sharding.SingleDeviceSharding(device))


def opt_state_shardings(tx: optax.GradientTransformation, params: Any, mesh: Mesh) -> Any:
    """Shardings of ``tx.init(params)``: moments like their parameters, the rest replicated.

    Without them ``jit(tx.init)`` leaves Adam's moments (zeros, no sharded input
    to follow) replicated on every device: two full fp32 copies of the model
    per device.

    Args:
      tx: the optimizer.
      params: the parameters (arrays or ``ShapeDtypeStruct``s) placed on ``mesh``.
      mesh: the mesh.
    """
    repl = replicated(mesh)
    param_sh = jax.tree.map(
        lambda x: (
            x.sharding
            if isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh
            else repl
        ),
        params,
    )
    return optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        jax.eval_shape(tx.init, params),
        param_sh,
        transform_non_params=lambda _: repl,
        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
    )


def shardings_on_mesh(tree: Any, mesh: Mesh) -> Any:
    """Each leaf's sharding if it already lives on ``mesh``, else replicated over it."""
    repl = replicated(mesh)

    def one(x):
        sh = getattr(x, "sharding", None)
        if isinstance(sh, NamedSharding) and sh.mesh == mesh:
            return sh
        return repl

    return jax.tree.map(one, tree)
