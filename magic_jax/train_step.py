"""The jitted policy update: micro-batched loss and grads, AdamW step, and passes over a buffer."""

from __future__ import annotations

import dataclasses
import functools
import logging
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from magic_jax.advantages import count_loss_tokens
from magic_jax.buffer import MiniBatchSplit, RolloutBuffer, split_mini_batches
from magic_jax.entropy import (
    EntropyControlConfig,
    EntropyControlState,
    entropy_coefficient,
    init_entropy_control,
    measure_entropy,
    token_logprobs_and_entropy,
    update_entropy_control,
)
from magic_jax.losses import MAX_METRICS, LossConfig, policy_loss
from magic_jax.model import RematPolicy, abstract_model, check_unroll
from magic_jax.optim import OptimizerConfig, make_optimizer
from magic_jax.sharding import batch_sharding, data_shards, replicated

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
      layer_unroll: how the update's forward and backward run the stacked layers
        (``ModelConfig.layer_unroll``); None takes ``default_update_layer_unroll()``
        for the platform. Same values either way; only speed and compile time change.
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
    layer_unroll: int | bool | None = None
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
        if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"UpdateConfig.compute_dtype must be one of {COMPUTE_DTYPES}, "
                f"got {self.compute_dtype!r}"
            )
        check_unroll("UpdateConfig.layer_unroll", self.layer_unroll, allow_none=True)


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
        return jax.device_put(state, _on_mesh(state, mesh))
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


def _on_mesh(tree: Any, mesh: Mesh) -> Any:
    """Each leaf's sharding if it already lives on ``mesh``, else replicated over it."""
    repl = replicated(mesh)

    def one(x):
        sh = getattr(x, "sharding", None)
        if isinstance(sh, NamedSharding) and sh.mesh == mesh:
            return sh
        return repl

    return jax.tree.map(one, tree)


@functools.lru_cache(maxsize=16)
def _graphdef_of(model_config: Any) -> nnx.GraphDef:
    return nnx.split(abstract_model(model_config), nnx.Param)[0]


# The update's layer unroll per platform, measured with benchmarks/loss_memory.py (58M
# Qwen2, 8 layers, 8 x 512 tokens, forward + backward + AdamW, 2-core CPU, 2026-11-24):
# every layer inlined 11.0-11.2 s per step, unroll 4 12.3 s, unroll 2 11.9 s, the plain scan
# 12.4 s. GPU and TPU were not measured: they keep the scan (which also keeps compile
# time flat in depth) until a measurement says otherwise.
UPDATE_LAYER_UNROLL_DEFAULT: dict[str, int | bool] = {"cpu": True}


def default_update_layer_unroll(platform: str | None = None) -> int | bool:
    """The update's layer unroll for ``platform`` (default: jax's default backend)."""
    return UPDATE_LAYER_UNROLL_DEFAULT.get(platform or jax.default_backend(), 1)


def update_graphdef(graphdef: nnx.GraphDef, params: Any, config: UpdateConfig) -> nnx.GraphDef:
    """The policy's graph with the update's ``remat``, ``compute_dtype`` and
    ``layer_unroll`` options.

    Both are static fields of the model's ``ModelConfig``: the graph of a model
    built with the changed config takes the same parameters. Works inside a trace
    (``params`` may be tracers or ``ShapeDtypeStruct``s).

    Args:
      graphdef: the policy's ``nnx.GraphDef`` (from ``nnx.split(model, nnx.Param)``).
      params: its parameters (only their structure is used).
      config: update options; None fields keep the model's setting.
    """
    current = nnx.merge(graphdef, params).config
    unroll = config.layer_unroll
    changes: dict[str, Any] = {
        "layer_unroll": default_update_layer_unroll() if unroll is None else unroll
    }
    if config.remat is not None:
        changes["remat"] = config.remat
    if config.compute_dtype is not None:
        changes["dtype"] = config.compute_dtype
    wanted = dataclasses.replace(current, **changes)
    return graphdef if wanted == current else _graphdef_of(wanted)


def compute_logprobs(
    graphdef: nnx.GraphDef, params: Any, batch: RolloutBuffer, config: LossConfig
) -> tuple[jax.Array, jax.Array]:
    """Log-probs and entropies of the response tokens of ``batch`` under ``params``.

    Returns:
      (logp_BR, ent_BR), float32 [B, R], aligned with ``batch.old_logprobs``.
    """
    model = nnx.merge(graphdef, params)
    hidden_BLD = model(
        batch.tokens,
        positions=batch.positions,
        attention_mask=batch.attention_mask,
        return_hidden=True,
    )
    p, r = batch.prompt_len, batch.response_len
    # hidden at position t predicts token t + 1: response token j is predicted at P + j - 1.
    hidden_BRD = hidden_BLD[:, p - 1 : p - 1 + r]
    return token_logprobs_and_entropy(
        hidden_BRD,
        model.unembedding(),
        batch.tokens[:, p:],
        temperature=config.temperature,
        chunk_size=config.logit_chunk,
        compute_dtype=model.config.dtype,
    )


def _micro_batches(batch: RolloutBuffer, size: int, sharding: NamedSharding | None):
    """[M, ...] -> [M / size, size, ...]; micro-batch i takes rows i, i + n, i + 2n, ...

    The strided split keeps every micro-batch spread over all data shards when the
    rows are sharded in contiguous blocks.
    """
    m = batch.num_rows
    if m % size:
        raise ValueError(f"micro_batch_size {size} does not divide the mini-batch of {m} rows")
    n = m // size

    def split(x):
        x = x.reshape(size, n, *x.shape[1:]).swapaxes(0, 1)
        if sharding is not None:
            spec = PartitionSpec(None, *sharding.spec)
            x = jax.lax.with_sharding_constraint(x, NamedSharding(sharding.mesh, spec))
        return x

    return jax.tree.map(split, batch)


def loss_and_grads(
    params: Any,
    batch: RolloutBuffer,
    alpha: jax.Array | float,
    *,
    graphdef: nnx.GraphDef,
    config: UpdateConfig,
    ref_params: Any = None,
    batch_sharding: NamedSharding | None = None,
    nominal_rows: int | None = None,
    old_from_current: bool = False,
    micro_rows: int | None = None,
    live_micro: jax.Array | None = None,
) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """Mini-batch loss, gradients and metrics, accumulated over micro-batches.

    T_k (and the sequence counts of the other aggregations) are taken over the
    whole mini-batch before the micro-batch loop, so with the default global token
    mean the result does not depend on ``micro_batch_size`` or on sharding.

    Args:
      params: policy parameters (differentiated).
      batch: a mini-batch ``RolloutBuffer`` [M rows].
      alpha: entropy-bonus coefficient alpha_k.
      graphdef: the policy's ``nnx.GraphDef`` (``config.remat`` and
        ``config.compute_dtype`` are applied to it, see ``update_graphdef``).
      config: update options.
      ref_params: reference-policy parameters (used iff ``config.loss.kl_beta > 0``).
      batch_sharding: sharding of the batch rows, kept on every micro-batch.
      nominal_rows: the nominal mini-batch in sequences (D_T x G), which
        ``micro-token-mean`` divides by; default the batch's rows.
      micro_rows: rows per micro-batch; default ``config.micro_batch_size``.
      live_micro: () int32, only the first this many micro-batches hold counted
        rows (see ``live_first``): the loop runs over those alone, so the cost
        follows the kept rows, not the batch's shape. None runs every one.
      old_from_current: the ratio's denominator pi_old is these ``params``
        themselves (the trainer's log-probs before an on-policy step): take it
        from this forward pass, stop-gradient, instead of ``batch.old_logprobs``.
        The loss and gradients equal those of a separate pi_old pass.

    Returns:
      (loss, grads, metrics); grads have the structure of ``params``.
    """
    lcfg = config.loss
    if lcfg.kl_beta > 0 and ref_params is None:
        raise ValueError("UpdateConfig.loss.kl_beta > 0 needs ref_params (the reference policy)")
    graphdef = update_graphdef(graphdef, params, config)
    mask_BR = batch.loss_mask()
    num_tokens = count_loss_tokens(batch.response_mask, batch.keep & batch.valid)  # T_k
    num_seqs = (mask_BR.sum(-1) > 0).sum().astype(jnp.float32)
    nominal = float(nominal_rows or batch.num_rows)

    def micro_loss(p, mb):
        logp_BR, ent_BR = compute_logprobs(graphdef, p, mb, lcfg)
        old_BR = jax.lax.stop_gradient(logp_BR) if old_from_current else mb.old_logprobs
        ref_logp_BR = None
        if lcfg.kl_beta > 0:
            ref_logp_BR, _ = compute_logprobs(graphdef, ref_params, mb, lcfg)
            ref_logp_BR = jax.lax.stop_gradient(ref_logp_BR)
        return policy_loss(
            logp_BR,
            old_BR,
            mb.advantages,
            mb.loss_mask(),
            ent_BR,
            alpha=alpha,
            config=lcfg,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            nominal_seqs=nominal,
            ref_logp_BT=ref_logp_BR,
            behaviour_logp_BT=mb.behaviour_logprobs,
        )

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    size = micro_rows or config.micro_batch_size or batch.num_rows
    if size >= batch.num_rows and live_micro is None:
        (loss, metrics), grads = grad_fn(params, batch)
        return loss, grads, metrics
    micro = _micro_batches(batch, min(size, batch.num_rows), batch_sharding)
    n_micro = micro.tokens.shape[0]

    def body(i, acc):
        mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), micro)
        (loss, m), g = grad_fn(params, mb)
        acc_g, acc_loss, acc_m = acc
        # ratio maxima combine by max (>= 0, so 0 starts them); token sums by sum
        acc_m = {
            k: jnp.maximum(acc_m[k], v) if k in MAX_METRICS else acc_m[k] + v for k, v in m.items()
        }
        return jax.tree.map(jnp.add, acc_g, g), acc_loss + loss, acc_m

    _, m_shapes = jax.eval_shape(micro_loss, params, jax.tree.map(lambda x: x[0], micro))
    init = (
        jax.tree.map(jnp.zeros_like, params),
        jnp.zeros((), jnp.float32),
        {k: jnp.zeros(v.shape, v.dtype) for k, v in m_shapes.items()},
    )
    n = n_micro if live_micro is None else jnp.minimum(jnp.int32(live_micro), n_micro)
    grads, loss, metrics = jax.lax.fori_loop(0, n, body, init)
    return loss, grads, metrics


def live_first(num_rows: int, micro_rows: int, live_rows: int) -> tuple[np.ndarray, int]:
    """A row order that puts ``live_rows`` rows into the first micro-batches.

    ``_micro_batches`` gives micro-batch i the rows i, i + n, i + 2n, ... (n
    micro-batches). Row j of the returned order is the ``order[j]``-th row of a
    batch whose live rows come first, so micro-batch i holds rows
    ``i * micro_rows ... (i + 1) * micro_rows - 1`` of that batch.

    Returns:
      (order [num_rows], the micro-batches that hold live rows).
    """
    n = num_rows // micro_rows
    order = np.arange(num_rows).reshape(n, micro_rows).T.reshape(-1)
    return order, -(-live_rows // micro_rows)


def train_step(
    state: TrainState,
    batch: RolloutBuffer,
    alpha: jax.Array | float,
    *,
    graphdef: nnx.GraphDef,
    config: UpdateConfig,
    ref_params: Any = None,
    batch_sharding: NamedSharding | None = None,
    nominal_rows: int | None = None,
    old_from_current: bool = False,
    micro_rows: int | None = None,
    live_micro: jax.Array | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step over one mini-batch (pure; jit it with ``state`` donated).

    A non-finite loss or gradient leaves params and optimizer state untouched and
    increments ``state.skipped``; a mini-batch with no counted token is a no-op.

    Args:
      state: the train state.
      batch: a mini-batch ``RolloutBuffer`` [M rows].
      alpha: entropy-bonus coefficient alpha_k of this training step.
      graphdef: the policy's ``nnx.GraphDef``.
      config: update options.
      ref_params: the frozen reference policy, needed iff ``config.loss.kl_beta > 0``.
      batch_sharding: sharding of the batch rows (None when unsharded).
      nominal_rows / old_from_current / micro_rows / live_micro: see ``loss_and_grads``.

    Returns:
      (new state, metrics): loss, pg_loss, clipfrac_low/high/dual, ratio_mean/max,
      entropy, approx_kl (to the behaviour policy), ref_kl (with KL on), alpha,
      grad_norm (before clipping), num_tokens, num_seqs, applied, skipped, step.
    """
    loss, grads, metrics = loss_and_grads(
        state.params,
        batch,
        alpha,
        graphdef=graphdef,
        config=config,
        ref_params=ref_params,
        batch_sharding=batch_sharding,
        nominal_rows=nominal_rows,
        old_from_current=old_from_current,
        micro_rows=micro_rows,
        live_micro=live_micro,
    )
    num_tokens = count_loss_tokens(batch.response_mask, batch.keep & batch.valid)
    finite = jnp.isfinite(loss) & jnp.all(
        jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])
    )
    apply = finite & (num_tokens > 0)
    tx = make_optimizer(config.optimizer)
    updates, new_opt = tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)

    def pick(new, old):
        return jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, old)

    skipped = state.skipped + (~finite).astype(jnp.int32)
    step = state.step + apply.astype(jnp.int32)
    new_state = dataclasses.replace(
        state,
        params=pick(new_params, state.params),
        opt_state=pick(new_opt, state.opt_state),
        step=step,
        skipped=skipped,
    )
    metrics = dict(metrics)
    metrics.update(
        loss=loss,
        alpha=jnp.asarray(alpha, jnp.float32),
        grad_norm=optax.tree.norm(grads),
        num_tokens=num_tokens,
        num_seqs=(batch.loss_mask().sum(-1) > 0).sum(),
        applied=apply,
        skipped=skipped,
        step=step,
    )
    return new_state, metrics


class PolicyUpdater:
    """Binds a policy graph, options and mesh to a jitted ``train_step`` and ``update``.

    Example:
      graphdef, params = nnx.split(model, nnx.Param)
      updater = PolicyUpdater(graphdef, UpdateConfig(mini_batch_groups=64), mesh=mesh)
      state = updater.init_state(params)
      state, metrics = updater.update(state, buffer, jax.random.key(step))
    """

    def __init__(self, graphdef: nnx.GraphDef, config: UpdateConfig, *, mesh: Mesh | None = None):
        self.graphdef = graphdef
        self.config = config
        self.mesh = mesh
        self.batch_sharding = None if mesh is None else batch_sharding(mesh)
        self._jitted: dict[bool, Any] = {}
        self._logprobs = None

    def init_state(self, params: Any) -> TrainState:
        """See ``init_train_state``."""
        return init_train_state(params, self.config, mesh=self.mesh)

    def live_micro_rows(self, group_size: int) -> int | None:
        """Rows per micro-batch of the kept-rows-only update, or None when it is off.

        A mini-batch is padded to D_T groups (one compiled shape per stage) with
        its kept groups first, and the update loops over only the micro-batches
        that hold them (``loss_and_grads(live_micro=...)``): the cost follows what
        rejection sampling kept. The micro-batch is ``micro_batch_size`` or,
        unset, about an eighth of the mini-batch (whole groups). Off for the
        ``micro-token-mean`` aggregation (its value depends on the micro split)
        and where a micro-batch would not split over the mesh's data shards.
        """
        cfg = self.config
        if cfg.loss.aggregation == "micro-token-mean":
            return None
        d_t = cfg.mini_batch_groups
        rows = cfg.micro_batch_size
        if rows is None:
            k = max(x for x in range(1, max(1, d_t // 8) + 1) if d_t % x == 0)
            rows = k * group_size
        if rows % data_shards(self.mesh) or (d_t * group_size) % rows:
            return None
        return rows

    def _compile(self, state: TrainState, old_from_current: bool, micro_rows: int | None):
        shardings = None if self.mesh is None else _on_mesh(state, self.mesh)

        def step(state, batch, alpha, ref_params, live_micro):
            new_state, metrics = train_step(
                state,
                batch,
                alpha,
                graphdef=self.graphdef,
                config=self.config,
                ref_params=ref_params,
                batch_sharding=self.batch_sharding,
                # micro-token-mean divides by the nominal D_T x G, whatever the bucket
                nominal_rows=self.config.mini_batch_groups * batch.group_size,
                old_from_current=old_from_current,
                micro_rows=micro_rows,
                live_micro=live_micro,
            )
            if shardings is not None:
                # Donation aliases buffers only when the output keeps the input's layout.
                new_state = jax.lax.with_sharding_constraint(new_state, shardings)
            return new_state, metrics

        return jax.jit(step, donate_argnums=0)

    def train_step(
        self,
        state: TrainState,
        batch: RolloutBuffer,
        alpha: float,
        ref_params: Any = None,
        *,
        old_from_current: bool = False,
        micro_rows: int | None = None,
        live_micro: int | None = None,
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """One jitted optimizer step (``state`` is donated: do not reuse it; the
        reference ``ref_params`` is only read). ``old_from_current``,
        ``micro_rows``, ``live_micro``: see ``loss_and_grads`` (``live_micro``
        needs ``micro_rows``)."""
        if self.config.loss.kl_beta == 0:
            ref_params = None  # no reference forward, nothing to transfer
        key = (old_from_current, micro_rows if live_micro is not None else None)
        if key not in self._jitted:
            self._jitted[key] = self._compile(state, *key)
        if self.batch_sharding is not None:
            batch = jax.device_put(batch, self.batch_sharding)
        live = None if key[1] is None else jnp.int32(live_micro)
        return self._jitted[key](state, batch, jnp.float32(alpha), ref_params, live)

    def logprobs(self, params: Any, buffer: RolloutBuffer) -> np.ndarray:
        """[B, R] float32 log-probs of the buffer's response tokens under ``params``.

        Computed D_T groups at a time (the training mini-batch shape, so memory
        stays that of one optimizer step's forward pass); no gradients.
        """
        if self._logprobs is None:
            cfg, lcfg = self.config, self.config.loss
            # the update's numerics (remat, compute dtype): pi_old as the update computes pi
            self._logprobs = jax.jit(
                lambda p, b: compute_logprobs(update_graphdef(self.graphdef, p, cfg), p, b, lcfg)[0]
            )
        d_t, n = self.config.mini_batch_groups, buffer.num_groups
        out = np.zeros(buffer.response_mask.shape, np.float32)
        for start in range(0, n, d_t):
            groups = np.minimum(np.arange(start, start + d_t), n - 1)
            batch = buffer.take_groups(groups)
            if self.batch_sharding is not None:
                batch = jax.device_put(batch, self.batch_sharding)
            logp = np.asarray(self._logprobs(params, batch))
            take = min(d_t, n - start) * buffer.group_size
            out[start * buffer.group_size : start * buffer.group_size + take] = logp[:take]
        return out

    def _prepare(
        self, state: TrainState, buffer: RolloutBuffer, one_step: bool
    ) -> tuple[RolloutBuffer, bool]:
        """Sets the ratio's denominator and the behaviour log-probs (SPEC item 4, TIS).

        With TIS the denominator is the trainer's own pi_old. When the buffer gets
        one optimizer step (``one_step``: on-policy) pi_old is the policy being
        updated, so that step takes it from its own forward pass (returns True)
        instead of a separate pass here.
        """
        lcfg = self.config.loss
        behaviour = buffer.old_logprobs
        if lcfg.behaviour_logprobs == "sampled" and buffer.sampling_logprobs is not None:
            behaviour = buffer.sampling_logprobs
        old, from_current = behaviour, False
        if lcfg.tis_cap is not None:
            if one_step:
                from_current = True
            else:
                old = self.logprobs(state.params, buffer)  # the trainer's pi_old
        buffer = dataclasses.replace(buffer, old_logprobs=old, behaviour_logprobs=behaviour)
        return buffer, from_current

    def update(
        self, state: TrainState, buffer: RolloutBuffer, rng: jax.Array, ref_params: Any = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """All optimizer steps of one training step over its rollout buffer.

        Measures e_k over the response tokens of every valid row of the buffer
        (before rejection sampling), sets alpha_k = c_k * 1{e_k <= target} for every
        step, runs ``num_reuse`` shuffled passes over the kept groups, cut into
        mini-batches by ``split_mini_batches`` (none when no group is kept: the
        step is skipped), then advances the controller to c_{k+1} (also when no
        group was kept).

        Args:
          state: the train state (donated).
          buffer: the step's ``RolloutBuffer`` (numpy or jax arrays) of D_R groups.
          rng: key for shuffling groups into mini-batches.
          ref_params: the frozen reference policy (KL on), else None.

        Returns:
          (new state, metrics): per-step arrays [N_SGD] of ``train_step``'s metrics
          and scalars ``buffer_entropy``, ``alpha``, ``kept_group_fraction``,
          ``num_sgd_steps``, ``entropy_coef_next``.
        """
        cfg = self.config
        buffer = jax.tree.map(np.asarray, buffer)
        e_k = float(
            measure_entropy(
                buffer.entropies,
                buffer.old_logprobs,
                buffer.response_mask * buffer.valid[:, None],
                cfg.entropy.estimator,
            )
        )
        alpha = float(entropy_coefficient(state.entropy, jnp.float32(e_k), cfg.entropy))
        keep_N = buffer.group_keep()
        valid_N = buffer.valid.reshape(buffer.num_groups, buffer.group_size).any(-1)
        kept = np.flatnonzero(keep_N)
        d_t = cfg.mini_batch_groups
        mini_batches = []
        for _ in range(cfg.num_reuse if len(kept) else 0):
            rng, sub = jax.random.split(rng)
            # a permutation of all D_R groups (one compiled shape), the kept ones in its order
            perm = np.asarray(jax.random.permutation(sub, buffer.num_groups))
            order = perm[keep_N[perm]]
            mini_batches += split_mini_batches(order, buffer.num_groups, d_t, cfg.mini_batch_split)
        buffer, from_current = self._prepare(state, buffer, one_step=len(mini_batches) == 1)
        micro = self.live_micro_rows(buffer.group_size)
        steps = []
        for groups in mini_batches:
            # pad to D_T groups (one static shape); padding rows count for nothing
            live = np.arange(d_t) < len(groups)
            groups = np.concatenate([groups, np.full(d_t - len(groups), groups[0])])
            batch = buffer.take_groups(groups, live)
            n_live = None
            if micro is not None:  # kept rows into the first micro-batches; skip the rest
                rows = int(live.sum()) * batch.group_size
                order, n_live = live_first(batch.num_rows, micro, rows)
                batch = jax.tree.map(lambda x, o=order: x[o], batch)
            state, m = self.train_step(
                state,
                batch,
                alpha,
                ref_params,
                old_from_current=from_current,
                micro_rows=micro,
                live_micro=n_live,
            )
            steps.append(m)
        new_ctl = update_entropy_control(state.entropy, jnp.float32(e_k), cfg.entropy)
        shardings = jax.tree.map(lambda x: x.sharding, state.entropy)
        state = dataclasses.replace(state, entropy=jax.device_put(new_ctl, shardings))
        metrics: dict[str, Any] = {
            k: np.stack([np.asarray(m[k]) for m in steps]) for k in (steps[0] if steps else {})
        }
        metrics.update(
            buffer_entropy=e_k,
            alpha=alpha,
            kept_group_fraction=float(keep_N.sum() / max(valid_N.sum(), 1)),
            num_sgd_steps=len(steps),
            entropy_coef_next=float(state.entropy.coef),
        )
        return state, metrics
