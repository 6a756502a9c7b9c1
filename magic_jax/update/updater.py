"""The update's host loop: ``PolicyUpdater`` runs a rollout buffer's passes and
mini-batches through the compiled ``train_step`` and advances the entropy controller."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from magic_jax import interrupt, watchdog
from magic_jax.model.sharding import batch_sharding, data_shards
from magic_jax.update.buffer import RolloutBuffer, split_mini_batches
from magic_jax.update.config import UpdateConfig
from magic_jax.update.entropy_control import (
    EntropyControlConfig,
    entropy_coefficient,
    measure_entropy,
    update_entropy_control,
)
from magic_jax.update.packing import PackedRows, pack_rows
from magic_jax.update.state import TrainState, init_train_state, shardings_on_mesh
from magic_jax.update.step import (
    StepSpec,
    compute_logprobs,
    live_first,
    micro_batches,
    packed_logprobs,
    train_step,
    update_graphdef,
)

# an update's metrics: per optimizer step arrays [N_SGD] and the step's scalars
Metrics = dict[str, np.ndarray | float | int]


class Updater(Protocol):
    """What the trainer calls on an updater (``PolicyUpdater`` is the one the package
    builds): one training step's optimizer steps over its rollout buffer."""

    def update(
        self,
        state: TrainState,
        buffer: RolloutBuffer,
        rng: jax.Array,
        ref_params: nnx.State | None = None,
    ) -> tuple[TrainState, Metrics]: ...


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
        # by (old_from_current, micro_rows): one compiled step each
        self._jitted: dict[tuple[bool, int | None], Callable[..., Any]] = {}
        self._logprobs: Callable[..., jax.Array] | None = None

    def init_state(self, params: Any) -> TrainState:
        """See ``init_train_state``."""
        return init_train_state(params, self.config, mesh=self.mesh)

    def live_micro_rows(self, group_size: int) -> int | None:
        """Rows per micro-batch of the kept-rows-only update, or None when it is off.

        A mini-batch is padded to D_T groups (one compiled shape per stage) with
        its kept groups first, and the update loops over only the micro-batches
        that hold them (``loss_and_grads(live_micro=...)``): the cost follows what
        rejection sampling kept. The micro-batch is ``micro_batch_size`` or, unset,
        the fewest whole groups that split over the mesh's data shards (one group on
        one device), so that no padding group is computed (the fastest on the default
        run: docs/benchmarks.md#update-defaults). Off for the ``micro-token-mean``
        aggregation (its value depends on the micro split) and where a micro-batch
        would not split over the mesh's data shards.
        """
        cfg = self.config
        if cfg.loss.aggregation == "micro-token-mean":
            return None
        d_t = cfg.mini_batch_groups
        shards = data_shards(self.mesh)
        rows = cfg.micro_batch_size
        if rows is None:
            fits = [k for k in range(1, d_t + 1) if d_t % k == 0 and (k * group_size) % shards == 0]
            if not fits:
                return None
            rows = fits[0] * group_size
        if rows % shards or (d_t * group_size) % rows:
            return None
        return rows

    def packed_bins(self, group_size: int, length: int) -> int:
        """K, bins of ``length`` slots per packed micro-batch (``update.packing``):
        ``micro_batch_tokens // length`` when set, else as many bins as the padded
        update's micro-batch has rows (the same activation memory); a multiple of the
        mesh's data shards, at least one bin per shard."""
        cfg, shards = self.config, data_shards(self.mesh)
        if cfg.micro_batch_tokens is not None:
            return max(shards, cfg.micro_batch_tokens // length // shards * shards)
        rows = self.live_micro_rows(group_size) or cfg.micro_batch_size
        rows = min(rows or cfg.mini_batch_groups * group_size, cfg.mini_batch_groups * group_size)
        return max(shards, rows // shards * shards)

    def _compile(self, state: TrainState, old_from_current: bool, micro_rows: int | None):
        shardings = None if self.mesh is None else shardings_on_mesh(state, self.mesh)

        def step(state, batch, alpha, ref_params, live_micro, packed):
            spec = StepSpec(
                self.graphdef,
                self.config,
                batch_sharding=self.batch_sharding,
                # micro-token-mean divides by the nominal D_T x G, whatever the bucket
                nominal_rows=self.config.mini_batch_groups * batch.group_size,
                old_from_current=old_from_current,
                micro_rows=micro_rows,
            )
            new_state, metrics = train_step(
                state,
                batch,
                alpha,
                spec,
                ref_params=ref_params,
                live_micro=live_micro,
                packed=packed,
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
        packed: PackedRows | None = None,
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """One jitted optimizer step (``state`` is donated: do not reuse it; the
        reference ``ref_params`` is only read). ``old_from_current``,
        ``micro_rows``, ``live_micro``, ``packed``: see ``loss_and_grads``
        (``live_micro`` needs ``micro_rows`` or ``packed``)."""
        if self.config.loss.kl_beta == 0:
            ref_params = None  # no reference forward, nothing to transfer
        key = (old_from_current, micro_rows if live_micro is not None and packed is None else None)
        if key not in self._jitted:
            self._jitted[key] = self._compile(state, *key)
        if self.batch_sharding is not None:
            batch = jax.device_put(batch, self.batch_sharding)
            if packed is not None:
                packed = jax.device_put(packed, _packed_sharding(self.batch_sharding))
        live = None if live_micro is None else jnp.int32(live_micro)
        return self._jitted[key](state, batch, jnp.float32(alpha), ref_params, live, packed)

    def logprobs(self, params: Any, buffer: RolloutBuffer) -> np.ndarray:
        """[B, R] float32 log-probs of the buffer's response tokens under ``params``.

        Computed D_T groups at a time (the training mini-batch shape), and within
        that ``micro_batch_size`` rows at a time as the update runs them (with
        ``packing``, the valid rows packed into the update's bins), so memory
        stays that of one micro-batch's forward pass; no gradients.
        """
        if self.config.packing:
            return self._packed_logprobs(params, buffer)
        if self._logprobs is None:
            cfg, lcfg = self.config, self.config.loss
            rows = self.batch_sharding

            def one(p, b):
                # the update's numerics (remat, compute dtype): pi_old as the update computes pi
                return compute_logprobs(update_graphdef(self.graphdef, p, cfg), p, b, lcfg, rows)[0]

            def logprobs(p, b):
                size = cfg.micro_batch_size
                if size is None or size >= b.num_rows:
                    return one(p, b)
                out = jax.lax.map(lambda mb: one(p, mb), micro_batches(b, size, rows))
                # micro-batch i holds rows i, i + n, ...: back to the buffer's row order
                return out.swapaxes(0, 1).reshape(b.num_rows, -1)

            self._logprobs = jax.jit(logprobs)
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

    def _packed_logprobs(self, params: Any, buffer: RolloutBuffer) -> np.ndarray:
        """``logprobs`` over packed rows (``update.packing``): padding rows get 0."""
        if self._logprobs is None:
            cfg, lcfg = self.config, self.config.loss

            def logprobs(p, b, packed, n):
                graphdef = update_graphdef(self.graphdef, p, cfg)

                def body(i, out_BR):
                    r = b.response_len
                    logp_BR, _ = packed_logprobs(
                        graphdef, p, packed, i, r, lcfg, self.batch_sharding
                    )
                    return jnp.where((packed.row_micro == i)[:, None], logp_BR, out_BR)

                return jax.lax.fori_loop(0, n, body, jnp.zeros(b.response_mask.shape, jnp.float32))

            self._logprobs = jax.jit(logprobs)
        d_t, n, g = self.config.mini_batch_groups, buffer.num_groups, buffer.group_size
        out = np.zeros(buffer.response_mask.shape, np.float32)
        for start in range(0, n, d_t):
            groups = np.minimum(np.arange(start, start + d_t), n - 1)
            batch = buffer.take_groups(groups)
            batch = dataclasses.replace(batch, keep=batch.valid)  # every row, kept or not
            packed, n_live = pack_rows(batch, self.packed_bins(g, batch.tokens.shape[1]))
            if self.batch_sharding is not None:
                batch = jax.device_put(batch, self.batch_sharding)
                packed = jax.device_put(packed, _packed_sharding(self.batch_sharding))
            logp = np.asarray(self._logprobs(params, batch, packed, jnp.int32(n_live)))
            take = min(d_t, n - start) * g
            out[start * g : start * g + take] = logp[:take]
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
        self,
        state: TrainState,
        buffer: RolloutBuffer,
        rng: jax.Array,
        ref_params: nnx.State | None = None,
    ) -> tuple[TrainState, Metrics]:
        """All optimizer steps of one training step over its rollout buffer.

        Measures e_k over the response tokens of every valid row of the buffer
        (before rejection sampling; with ``entropy.tokens`` only the selected
        ones, see ``buffer_entropy``), sets alpha_k = c_k * 1{e_k <= target} for every
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
          ``num_sgd_steps``, ``update_token_fill`` (the share of the token positions
          the optimizer steps computed that held a counted row's token: what padding
          or packing leaves), ``entropy_coef_next`` (with ``entropy.tokens`` also
          ``buffer_entropy_selected`` and ``selected_token_fraction``).

        Raises:
          interrupt.Interrupted: a stop was asked (checked after each optimizer step;
            ``state`` is then consumed and the step must be redone from a checkpoint).
        """
        cfg = self.config
        buffer = jax.tree.map(np.asarray, buffer)
        e_k, measured = buffer_entropy(buffer, cfg.entropy)
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
        fill = [0.0, 0.0]  # real tokens, token positions computed
        for groups in mini_batches:
            # pad to D_T groups (one static shape); padding rows count for nothing
            live = np.arange(d_t) < len(groups)
            groups = np.concatenate([groups, np.full(d_t - len(groups), groups[0])])
            batch = buffer.take_groups(groups, live)
            n_live, packed = None, None
            length = batch.tokens.shape[1]
            slots = batch.num_rows * length  # the token positions the step computes
            if cfg.packing:  # the counted rows packed; the micro-batches that hold them
                bins = self.packed_bins(batch.group_size, length)
                packed, n_live = pack_rows(batch, bins)
                slots = n_live * bins * length
            elif micro is not None:  # kept rows into the first micro-batches; skip the rest
                rows = int(live.sum()) * batch.group_size
                order, n_live = live_first(batch.num_rows, micro, rows)
                batch = jax.tree.map(lambda x, o=order: x[o], batch)
                slots = n_live * micro * length
            counted = np.asarray(batch.keep & batch.valid)
            fill[0] += float(np.asarray(batch.attention_mask)[counted].sum())
            fill[1] += slots
            state, m = self.train_step(
                state,
                batch,
                alpha,
                ref_params,
                old_from_current=from_current,
                micro_rows=micro,
                live_micro=n_live,
                packed=packed,
            )
            steps.append(m)
            if len(steps) > 1:  # one optimizer step in flight: a stop waits for at most two
                jax.block_until_ready(steps[-2])
            watchdog.beat("optimizer step")
            interrupt.check("update")
        new_ctl = update_entropy_control(state.entropy, jnp.float32(e_k), cfg.entropy)
        shardings = jax.tree.map(lambda x: x.sharding, state.entropy)
        state = dataclasses.replace(state, entropy=jax.device_put(new_ctl, shardings))
        metrics: Metrics = {
            k: np.stack([np.asarray(m[k]) for m in steps]) for k in (steps[0] if steps else {})
        }
        metrics.update(
            alpha=alpha,
            kept_group_fraction=float(keep_N.sum() / max(valid_N.sum(), 1)),
            num_sgd_steps=len(steps),
            update_token_fill=fill[0] / fill[1] if fill[1] else 0.0,
            entropy_coef_next=float(state.entropy.coef),
            **measured,
        )
        return state, metrics


def buffer_entropy(
    buffer: RolloutBuffer, config: EntropyControlConfig
) -> tuple[float, dict[str, float]]:
    """e_k of a rollout buffer (numpy arrays) and its entropy figures.

    e_k is the mean entropy (``config.estimator``) over the response tokens of valid
    rows, or with ``config.tokens`` over those of them the buffer's ``entropy_mask``
    selects.

    Returns:
      (e_k, figures): ``buffer_entropy`` (every response token of valid rows, as
      without ``tokens``) and, with ``config.tokens``, ``buffer_entropy_selected``
      (e_k) and ``selected_token_fraction`` (the selected share of those tokens).

    Raises:
      ValueError: ``config.tokens`` is set but the buffer has no ``entropy_mask``.
    """
    all_BR = buffer.response_mask * buffer.valid[:, None]
    e_all = float(measure_entropy(buffer.entropies, buffer.old_logprobs, all_BR, config.estimator))
    if config.tokens is None:
        return e_all, {"buffer_entropy": e_all}
    if buffer.entropy_mask is None:
        raise ValueError(
            f"entropy.tokens is {config.tokens!r} but the rollout buffer has no entropy_mask "
            "(pack_rollouts(entropy_tokens=...))"
        )
    sel_BR = all_BR * buffer.entropy_mask
    e_sel = float(measure_entropy(buffer.entropies, buffer.old_logprobs, sel_BR, config.estimator))
    return e_sel, {
        "buffer_entropy": e_all,
        "buffer_entropy_selected": e_sel,
        "selected_token_fraction": float(sel_BR.sum() / max(all_BR.sum(), 1.0)),
    }


def _packed_sharding(rows: NamedSharding) -> PackedRows:
    """The packed micro-batches' bins split over the data shards as the rows are (``rows``:
    the batch's sharding); the per-row indices follow the rows."""
    bins = NamedSharding(rows.mesh, PartitionSpec(None, *rows.spec))
    return PackedRows(bins, bins, bins, rows, rows)
