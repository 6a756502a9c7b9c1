"""The update's options and state: ``UpdateConfig``, ``TrainState`` and its
initialisation (the optimizer state sharded like the parameters)."""

from __future__ import annotations

import dataclasses
import logging
import typing
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from magic_jax.model.config import RematPolicy, check_unroll
from magic_jax.model.sharding import replicated
from magic_jax.update.buffer import MiniBatchSplit
from magic_jax.update.entropy import EntropyControlConfig, EntropyControlState, init_entropy_control
from magic_jax.update.losses import LossConfig
from magic_jax.update.optim import OptimizerConfig, make_optimizer

log = logging.getLogger(__name__)


REMAT_POLICIES: tuple[str, ...] = typing.get_args(RematPolicy)


COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpdateConfig:
    """How a rollout buffer becomes optimizer steps (SPEC item 7).

    N_SGD = D_R / D_T * N_reuse (``mini_batch_split="even"``, the report's) or
    ceil(kept groups / D_T) * N_reuse (``"fixed-size"``, verl's), see
    ``buffer.split_mini_batches``; with D_R = D_T and num_reuse = 1 both are one
    on-policy step.

    Attributes:
      mini_batch_groups: D_T, prompts (groups) per optimizer step (the most a
        mini-batch holds; its static shape).
      mini_batch_split: how the kept groups are cut into mini-batches:
        ``"even"``, D_R / D_T mini-batches of equal size (+-1 group), or
        ``"fixed-size"``, mini-batches of D_T groups with a smaller last one.
      micro_batch_size: sequences per micro-batch (gradient accumulation inside
        jit); None = the whole mini-batch at once. Must divide D_T * G.
      num_reuse: N_reuse, passes over the buffer.
      remat: what the backward pass keeps of each decoder layer's forward in the
        update (``ModelConfig.remat``: ``none``, ``full``, ``dots_saveable``);
        None = the policy model's own setting.
      compute_dtype: matmul dtype of the update's forward and backward and of
        the trainer's log-prob recomputation (``float32`` / ``bfloat16``); None =
        the policy model's own. Parameters, gradients and optimizer state keep
        their dtype; softmax, norms, RoPE, log-probs and the loss stay fp32.
      attention_chunk: queries per attention block of the update's forward and
        backward (``ModelConfig.attention_chunk``); None = the model's own.
      layer_unroll: how the update's forward and backward run the stacked layers
        (``ModelConfig.layer_unroll``); None takes ``default_update_layer_unroll()``
        for the platform. Same values either way; only speed and compile time change.
      mlp_kernel: run the MLP's backward pass by hand (``ModelConfig.mlp_kernel``);
        None takes ``default_update_mlp_kernel()`` for the platform. Same values.
      loss: objective options.
      entropy: entropy-bonus controller options.
      optimizer: AdamW options.
    """

    mini_batch_groups: int
    mini_batch_split: MiniBatchSplit = "even"
    micro_batch_size: int | None = None
    num_reuse: int = 1
    remat: RematPolicy | None = None
    compute_dtype: str | None = None
    attention_chunk: int | None = None
    layer_unroll: int | bool | None = None
    mlp_kernel: bool | None = None
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    entropy: EntropyControlConfig = dataclasses.field(default_factory=EntropyControlConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)

    def __post_init__(self):
        if self.mini_batch_groups <= 0:
            raise ValueError(
                f"UpdateConfig.mini_batch_groups must be > 0, got {self.mini_batch_groups}"
            )
        if self.mini_batch_split not in ("even", "fixed-size"):
            raise ValueError(
                "UpdateConfig.mini_batch_split must be 'even' or 'fixed-size', got "
                f"{self.mini_batch_split!r}"
            )
        if self.micro_batch_size is not None and self.micro_batch_size <= 0:
            raise ValueError(
                f"UpdateConfig.micro_batch_size must be > 0, got {self.micro_batch_size}"
            )
        if self.num_reuse <= 0:
            raise ValueError(f"UpdateConfig.num_reuse must be > 0, got {self.num_reuse}")
        if self.remat is not None and self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"UpdateConfig.remat must be one of {REMAT_POLICIES}, got {self.remat!r}"
            )
        if self.attention_chunk is not None and self.attention_chunk <= 0:
            raise ValueError(
                f"UpdateConfig.attention_chunk must be > 0, got {self.attention_chunk}"
            )
        if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"UpdateConfig.compute_dtype must be one of {COMPUTE_DTYPES}, "
                f"got {self.compute_dtype!r}"
            )
        check_unroll("UpdateConfig.layer_unroll", self.layer_unroll, allow_none=True)
        if not (self.mlp_kernel is None or isinstance(self.mlp_kernel, bool)):
            raise ValueError(
                f"UpdateConfig.mlp_kernel must be true, false or null, got {self.mlp_kernel!r}"
            )


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
