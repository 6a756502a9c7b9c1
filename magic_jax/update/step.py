"""The pure policy update: log-probs, micro-batched loss and grads, one AdamW step (jit it)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from magic_jax.model.logprobs import token_logprobs_and_entropy
from magic_jax.model.qwen2 import abstract_model
from magic_jax.update.advantages import count_loss_tokens
from magic_jax.update.buffer import RolloutBuffer
from magic_jax.update.config import UpdateConfig
from magic_jax.update.losses import MAX_METRICS, LossConfig, policy_loss
from magic_jax.update.optim import make_optimizer
from magic_jax.update.packing import PackedRows, rows_of
from magic_jax.update.state import TrainState


@functools.lru_cache(maxsize=16)
def _graphdef_of(model_config: Any) -> nnx.GraphDef:
    return nnx.split(abstract_model(model_config), nnx.Param)[0]


# The update's layer unroll per platform: CPU inlines every layer, the fastest update
# measured (docs/benchmarks.md#update-defaults). GPU and TPU were not measured: they keep
# the scan (which also keeps compile time flat in depth) until a measurement says otherwise.
UPDATE_LAYER_UNROLL_DEFAULT: dict[str, int | bool] = {"cpu": True}


def default_update_layer_unroll(platform: str | None = None) -> int | bool:
    """The update's layer unroll for ``platform`` (default: jax's default backend)."""
    return UPDATE_LAYER_UNROLL_DEFAULT.get(platform or jax.default_backend(), 1)


# The update's MLP with a hand-written backward pass (``model.kernels.swiglu``) per
# platform. CPU: autodiff's transposed copy of the SiLU gradient costs as much as a
# product there, and the kernel avoids it. TPU keeps autodiff: the kernel's temporaries
# for the 7B long-context update do not fit in HBM. GPU was not measured.
# (docs/benchmarks.md#update-defaults)
UPDATE_MLP_KERNEL_DEFAULT: dict[str, bool] = {"cpu": True}


def default_update_mlp_kernel(platform: str | None = None) -> bool:
    """Whether the update runs the MLP kernel on ``platform`` (default: jax's default backend)."""
    return UPDATE_MLP_KERNEL_DEFAULT.get(platform or jax.default_backend(), False)


def with_platform_defaults(config: UpdateConfig, platform: str | None = None) -> UpdateConfig:
    """``config`` with an unset ``layer_unroll`` / ``mlp_kernel`` taken from ``platform``'s
    measured defaults (default platform: jax's default backend)."""
    unroll, kernel = config.layer_unroll, config.mlp_kernel
    return dataclasses.replace(
        config,
        layer_unroll=default_update_layer_unroll(platform) if unroll is None else unroll,
        mlp_kernel=default_update_mlp_kernel(platform) if kernel is None else kernel,
    )


def update_graphdef(graphdef: nnx.GraphDef, params: Any, config: UpdateConfig) -> nnx.GraphDef:
    """The policy's graph with the update's ``remat``, ``compute_dtype``,
    ``attention_chunk``, ``attention``, ``layer_unroll`` and ``mlp_kernel`` options.

    All are static fields of the model's ``ModelConfig``: the graph of a model
    built with the changed config takes the same parameters. Works inside a trace
    (``params`` may be tracers or ``ShapeDtypeStruct``s).

    Args:
      graphdef: the policy's ``nnx.GraphDef`` (from ``nnx.split(model, nnx.Param)``).
      params: its parameters (only their structure is used).
      config: update options; None fields keep the model's setting.
    """
    current = nnx.merge(graphdef, params).config
    config = with_platform_defaults(config)
    changes: dict[str, Any] = {
        "layer_unroll": config.layer_unroll,
        "mlp_kernel": config.mlp_kernel,
    }
    if config.remat is not None:
        changes["remat"] = config.remat
    if config.compute_dtype is not None:
        changes["dtype"] = config.compute_dtype
    if config.attention_chunk is not None:
        changes["attention_chunk"] = config.attention_chunk
    if config.attention is not None:
        changes["attention"] = config.attention
    wanted = dataclasses.replace(current, **changes)
    return graphdef if wanted == current else _graphdef_of(wanted)


def compute_logprobs(
    graphdef: nnx.GraphDef,
    params: Any,
    batch: RolloutBuffer,
    config: LossConfig,
    row_sharding: NamedSharding | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-probs and entropies of the response tokens of ``batch`` under ``params``.

    ``row_sharding``: the rows' sharding, kept on the activations (``Qwen2.__call__``).

    Returns:
      (logp_BR, ent_BR), float32 [B, R], aligned with ``batch.old_logprobs``.
    """
    model = nnx.merge(graphdef, params)
    hidden_BLD = model(
        batch.tokens,
        positions=batch.positions,
        attention_mask=batch.attention_mask,
        return_hidden=True,
        row_sharding=row_sharding,
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


def packed_logprobs(
    graphdef: nnx.GraphDef,
    params: Any,
    packed: PackedRows,
    micro: jax.Array | int,
    response_len: int,
    config: LossConfig,
    row_sharding: NamedSharding | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``compute_logprobs`` of the rows one micro-batch of ``packed`` holds: the model runs
    over its K bins (attention within each row's segment), and the log-probs and
    entropies come back in the mini-batch's [M, R] layout (rows of other micro-batches
    hold values to mask)."""
    model = nnx.merge(graphdef, params)
    bins = jax.tree.map(lambda x: x[micro], (packed.tokens, packed.positions, packed.segments))
    if row_sharding is not None:
        bins = jax.lax.with_sharding_constraint(bins, row_sharding)
    tokens_KS, positions_KS, segments_KS = bins
    hidden_KSD = model(
        tokens_KS,
        positions=positions_KS,
        attention_mask=segments_KS > 0,
        segment_ids=segments_KS,
        return_hidden=True,
        row_sharding=row_sharding,
    )
    # the slot after each one holds the token it predicts (within a segment; the last
    # slot of a segment predicts nothing the rows read)
    targets_KS = jnp.pad(tokens_KS[:, 1:], ((0, 0), (0, 1)))
    logp_KS, ent_KS = token_logprobs_and_entropy(
        hidden_KSD,
        model.unembedding(),
        targets_KS,
        temperature=config.temperature,
        chunk_size=config.logit_chunk,
        compute_dtype=model.config.dtype,
    )
    return (
        rows_of(logp_KS, packed.row_start, response_len),
        rows_of(ent_KS, packed.row_start, response_len),
    )


def micro_batches(batch: RolloutBuffer, size: int, sharding: NamedSharding | None):
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


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What an update step is traced for: ``loss_and_grads`` and ``train_step`` take one
    (hashable: a static part of the compiled step).

    Attributes:
      graphdef: the policy's ``nnx.GraphDef`` (``config.remat`` and
        ``config.compute_dtype`` are applied to it, see ``update_graphdef``).
      config: update options.
      batch_sharding: sharding of the batch rows, kept on every micro-batch (None
        when unsharded).
      nominal_rows: the nominal mini-batch in sequences (D_T x G), which
        ``micro-token-mean`` divides by; default the batch's rows.
      old_from_current: the ratio's denominator pi_old is the ``params`` themselves
        (the trainer's log-probs before an on-policy step): take it from this forward
        pass, stop-gradient, instead of ``batch.old_logprobs``. The loss and gradients
        equal those of a separate pi_old pass.
      micro_rows: rows per micro-batch; default ``config.micro_batch_size``.
    """

    graphdef: nnx.GraphDef
    config: UpdateConfig
    batch_sharding: NamedSharding | None = None
    nominal_rows: int | None = None
    old_from_current: bool = False
    micro_rows: int | None = None


def loss_and_grads(
    params: Any,
    batch: RolloutBuffer,
    alpha: jax.Array | float,
    spec: StepSpec,
    *,
    ref_params: Any = None,
    live_micro: jax.Array | None = None,
    packed: PackedRows | None = None,
) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """Mini-batch loss, gradients and metrics, accumulated over micro-batches.

    T_k (and the sequence counts of the other aggregations) are taken over the
    whole mini-batch before the micro-batch loop, so with the default global token
    mean the result does not depend on ``micro_batch_size`` or on sharding.

    Args:
      params: policy parameters (differentiated).
      batch: a mini-batch ``RolloutBuffer`` [M rows].
      alpha: entropy-bonus coefficient alpha_k.
      spec: the policy's graph, the update options and how the batch is laid out.
      ref_params: reference-policy parameters (used iff ``config.loss.kl_beta > 0``).
      live_micro: () int32, only the first this many micro-batches hold counted
        rows (see ``live_first``): the loop runs over those alone, so the cost
        follows the kept rows, not the batch's shape. None runs every one.
      packed: the batch's rows packed (``packing.pack_rows``): the micro-batches are
        its bins, and ``live_micro`` the number that hold rows (None: all of them).
        The rows' per-token values are those of the padded rows up to rounding.

    Returns:
      (loss, grads, metrics); grads have the structure of ``params``.
    """
    config, batch_sharding = spec.config, spec.batch_sharding
    lcfg = config.loss
    if lcfg.kl_beta > 0 and ref_params is None:
        raise ValueError("UpdateConfig.loss.kl_beta > 0 needs ref_params (the reference policy)")
    graphdef = update_graphdef(spec.graphdef, params, config)
    mask_BR = batch.loss_mask()
    num_tokens = count_loss_tokens(batch.response_mask, batch.keep & batch.valid)  # T_k
    num_seqs = (mask_BR.sum(-1) > 0).sum().astype(jnp.float32)
    nominal = float(spec.nominal_rows or batch.num_rows)

    def forward(p, mb, i):
        if packed is None:
            return compute_logprobs(graphdef, p, mb, lcfg, batch_sharding)
        r = batch.response_len
        return packed_logprobs(graphdef, p, packed, i, r, lcfg, batch_sharding)

    def micro_loss(p, mb, i=None):
        if packed is not None:  # the whole mini-batch's rows; this micro-batch's count
            mb = dataclasses.replace(mb, keep=mb.keep & (packed.row_micro == i))
        logp_BR, ent_BR = forward(p, mb, i)
        old_BR = jax.lax.stop_gradient(logp_BR) if spec.old_from_current else mb.old_logprobs
        ref_logp_BR = None
        if lcfg.kl_beta > 0:
            ref_logp_BR, _ = forward(ref_params, mb, i)
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
            entropy_mask_BT=mb.entropy_mask,
            staleness_BT=mb.staleness,
        )

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    size = spec.micro_rows or config.micro_batch_size or batch.num_rows
    if packed is not None:
        n_micro = packed.tokens.shape[0]

        def micro_at(i):
            return batch, i

    else:
        if size >= batch.num_rows and live_micro is None:
            (loss, metrics), grads = grad_fn(params, batch)
            return loss, grads, metrics
        micro = micro_batches(batch, min(size, batch.num_rows), batch_sharding)
        n_micro = micro.tokens.shape[0]

        def micro_at(i):
            take = functools.partial(jax.lax.dynamic_index_in_dim, index=i, keepdims=False)
            return jax.tree.map(take, micro), None

    def body(i, acc):
        (loss, m), g = grad_fn(params, *micro_at(i))
        acc_g, acc_loss, acc_m = acc
        # ratio maxima combine by max (>= 0, so 0 starts them); token sums by sum
        acc_m = {
            k: jnp.maximum(acc_m[k], v) if k in MAX_METRICS else acc_m[k] + v for k, v in m.items()
        }
        return jax.tree.map(jnp.add, acc_g, g), acc_loss + loss, acc_m

    _, m_shapes = jax.eval_shape(micro_loss, params, *micro_at(jnp.int32(0)))
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

    ``micro_batches`` gives micro-batch i the rows i, i + n, i + 2n, ... (n
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
    spec: StepSpec,
    *,
    ref_params: Any = None,
    live_micro: jax.Array | None = None,
    packed: PackedRows | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step over one mini-batch (pure; jit it with ``state`` donated).

    A non-finite loss or gradient leaves params and optimizer state untouched and
    increments ``state.skipped``; a mini-batch with no counted token is a no-op.

    Args:
      state: the train state.
      batch: a mini-batch ``RolloutBuffer`` [M rows].
      alpha: entropy-bonus coefficient alpha_k of this training step.
      spec: what the step is traced for (``StepSpec``).
      ref_params: the frozen reference policy, needed iff ``config.loss.kl_beta > 0``.
      live_micro, packed: see ``loss_and_grads``.

    Returns:
      (new state, metrics): loss, pg_loss, clipfrac_low/high/dual, ratio_mean/max,
      entropy, approx_kl (to the behaviour policy), ref_kl (with KL on), alpha,
      grad_norm (before clipping), num_tokens, num_seqs, applied, skipped, step.
    """
    loss, grads, metrics = loss_and_grads(
        state.params,
        batch,
        alpha,
        spec,
        ref_params=ref_params,
        live_micro=live_micro,
        packed=packed,
    )
    num_tokens = count_loss_tokens(batch.response_mask, batch.keep & batch.valid)
    finite = jnp.isfinite(loss) & jnp.all(
        jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])
    )
    apply = finite & (num_tokens > 0)
    tx = make_optimizer(spec.config.optimizer)
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
