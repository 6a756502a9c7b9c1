"""Packed rows for the update (``update.packing``): a mini-batch's rows laid end to end in
bins of one length, with segment ids and per-segment positions, and cut into
micro-batches of a fixed number of bins.

A padded mini-batch runs every row at the step's longest prompt and response; at
long-tailed response lengths most of its token positions are padding. Packed, a
micro-batch holds at most ``bins x length`` tokens whatever the rows' lengths (verl's
``use_dynamic_bsz``: micro-batches bounded by tokens over unpadded rows), and the
update runs only the micro-batches that hold rows. Every shape is static: the bins'
length is the buffer's row length L = P + R (already bucketed per step), the bins per
micro-batch a run option, and the number of micro-batches at most the padded path's.

The loss is computed per original token exactly as on padded rows: each micro-batch's
log-probs and entropies are gathered back to the mini-batch's [M, R] response layout
(``rows_of``), and ``policy_loss`` counts the rows the micro-batch holds. With the global
token mean (and the sequence means) the split does not change the result; with
``micro-token-mean`` the value depends on which rows share a micro-batch, as it does in
the reference code (``micro_of_row`` fixes the split).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from magic_jax.update.buffer import RolloutBuffer


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedRows:
    """A mini-batch's rows packed into N micro-batches of K bins of S slots (a pytree).

    Attributes:
      tokens: [N, K, S] int32 ids (free slots: the pad id).
      positions: [N, K, S] int32 RoPE positions, 0 at each row's first prompt token.
      segments: [N, K, S] int32, 1, 2, ... for the rows of a bin, 0 on free slots.
      row_micro: [M] int32 the micro-batch that holds each row of the mini-batch; -1 for
        a row that is not packed (not kept, padding, or no response token).
      row_start: [M] int32 the slot (bin * S + offset, within its micro-batch) whose
        hidden state predicts the row's first response token; response token j is
        predicted at ``row_start + j``.
    """

    tokens: Any
    positions: Any
    segments: Any
    row_micro: Any
    row_start: Any

    @property
    def bins(self) -> int:
        """K, bins per micro-batch."""
        return self.tokens.shape[1]

    @property
    def length(self) -> int:
        """S, slots per bin."""
        return self.tokens.shape[2]


def micro_batches_of(num_rows: int, bins: int) -> int:
    """N, the most micro-batches ``pack_rows`` makes of a mini-batch of ``num_rows`` rows
    (each bin holds at least one row): the static leading dimension of ``PackedRows``."""
    return -(-num_rows // bins)


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Bins for items of ``lengths`` (each <= capacity), largest first, each into the first
    bin it fits: (bin of each item, offset of each item in its bin); bins numbered from 0
    in the order they were opened."""
    order = np.argsort(-lengths, kind="stable")
    free = np.full(len(lengths), capacity, np.int64)  # at most one bin per item
    opened = 0
    bin_of = np.zeros(len(lengths), np.int64)
    offset = np.zeros(len(lengths), np.int64)
    for i in order:
        fits = np.flatnonzero(free[:opened] >= lengths[i])
        b = int(fits[0]) if len(fits) else opened
        opened = max(opened, b + 1)
        offset[i] = capacity - free[b]
        free[b] -= lengths[i]
        bin_of[i] = b
    return bin_of, offset


def pack_rows(
    batch: RolloutBuffer,
    bins: int,
    *,
    micro_of_row: np.ndarray | None = None,
    pad_id: int = 0,
) -> tuple[PackedRows, int]:
    """Packs a mini-batch's counted rows (kept, valid, with a response) into bins of the
    buffer's row length L, ``bins`` per micro-batch (host side, numpy).

    Rows go into bins by first-fit decreasing, and bins into micro-batches in order, so
    every micro-batch but the last is full up to what first-fit leaves. With
    ``micro_of_row`` the rows of each micro-batch are given instead (``-1``: not
    packed), and each micro-batch's rows are packed into its own ``bins`` bins.

    Args:
      batch: a mini-batch ``RolloutBuffer`` (numpy arrays) of M rows.
      bins: K, bins per micro-batch (a multiple of the data shards when sharded).
      micro_of_row: [M] optional micro-batch of each row.
      pad_id: the id of free slots.

    Returns:
      (the ``PackedRows`` with N = ``micro_batches_of(M, bins)`` micro-batches (or more if
      ``micro_of_row`` names more), the micro-batches that hold rows).

    Raises:
      ValueError: ``bins`` < 1, or a ``micro_of_row`` micro-batch whose rows do not fit in
        ``bins`` bins.
    """
    if bins < 1:
        raise ValueError(f"pack_rows: bins per micro-batch must be >= 1, got {bins}")
    tokens_BL = np.asarray(batch.tokens)
    attn_BL = np.asarray(batch.attention_mask).astype(bool)
    m, s = tokens_BL.shape
    p = batch.prompt_len
    resp_B = np.asarray(batch.response_mask).sum(-1).astype(np.int64)
    counted = np.asarray(batch.keep) & np.asarray(batch.valid) & (resp_B > 0)
    plen_B = attn_BL[:, :p].sum(-1).astype(np.int64)
    len_B = plen_B + resp_B
    rows = np.flatnonzero(counted)
    micro = np.full(m, -1, np.int64)
    start = np.zeros(m, np.int64)  # flat slot of the row's first token, within its micro-batch
    if micro_of_row is None:
        bin_of, offset = first_fit_decreasing(len_B[rows], s)
        micro[rows] = bin_of // bins
        start[rows] = (bin_of % bins) * s + offset
    else:
        micro_of_row = np.asarray(micro_of_row, np.int64)
        for i in np.unique(micro_of_row[rows]):
            mine = rows[micro_of_row[rows] == i]
            bin_of, offset = first_fit_decreasing(len_B[mine], s)
            if bin_of.max() >= bins:
                raise ValueError(
                    f"pack_rows: the {len(mine)} rows given to micro-batch {i} "
                    f"({len_B[mine].sum()} tokens) do not fit in {bins} bins of {s}"
                )
            micro[mine] = i
            start[mine] = bin_of * s + offset
    n = max(micro_batches_of(m, bins), int(micro.max()) + 1)
    tokens = np.full((n, bins * s), pad_id, np.int32)
    positions = np.zeros((n, bins * s), np.int32)
    segments = np.zeros((n, bins * s), np.int32)
    for r in rows:
        seq = tokens_BL[r][attn_BL[r]]  # left-padded prompt, then the response: its real tokens
        at = slice(start[r], start[r] + len_B[r])
        tokens[micro[r], at] = seq[: len_B[r]]
        positions[micro[r], at] = np.arange(len_B[r])
        segments[micro[r], at] = r + 1
    packed = PackedRows(
        tokens=tokens.reshape(n, bins, s),
        positions=positions.reshape(n, bins, s),
        segments=segments.reshape(n, bins, s),
        row_micro=micro.astype(np.int32),
        row_start=np.where(micro >= 0, start + plen_B - 1, 0).astype(np.int32),
    )
    return packed, int(micro.max()) + 1 if len(rows) else 0


def rows_of(x_KS: jax.Array, row_start_M: jax.Array, response_len: int) -> jax.Array:
    """[K, S] per-slot values of one micro-batch -> [M, R] per response token of the
    mini-batch's rows (row m's token j at slot ``row_start[m] + j``; slots of rows in other
    micro-batches and past a response are whatever they hold, for the caller to mask)."""
    flat = x_KS.reshape(-1)
    idx_MR = row_start_M[:, None] + jnp.arange(response_len, dtype=jnp.int32)[None, :]
    return flat[jnp.clip(idx_MR, 0, flat.shape[0] - 1)]
