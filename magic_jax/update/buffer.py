"""The rollout buffer: one training step's samples as fixed-shape arrays, and its host packer."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import jax
import numpy as np

from magic_jax.update.advantages import AdvantageConfig, estimate_advantages, group_keep_mask


class SampleRecord(Protocol):
    """What the sampler returns per response (duck-typed; read only, so a frozen
    dataclass such as ``rollout.samples.Sample`` fits)."""

    @property
    def prompt_index(self) -> int: ...
    @property
    def sample_index(self) -> int: ...
    @property
    def prompt_tokens(self) -> np.ndarray: ...  # [P_i] int32
    @property
    def tokens(self) -> np.ndarray: ...  # [R_i] int32 response ids, EOS included if any
    @property
    def logprobs(self) -> np.ndarray: ...  # [R_i] float32 behaviour log-prob of each token
    # optional: [R_i] float32 log-prob under the top-k / top-p truncated distribution
    # sampling_logprobs: np.ndarray
    @property
    def entropies(self) -> np.ndarray: ...  # [R_i] float32 full-distribution entropy
    @property
    def truncated(self) -> bool: ...
    @property
    def length(self) -> int: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RolloutBuffer:
    """One rollout step's samples as fixed-shape arrays (a pytree, leading dim = sequences).

    Rows are grouped by prompt: rows ``g * G ... g * G + G - 1`` are the G samples of
    group g. A row is its left-padded prompt (P slots) followed by its right-padded
    response (R slots), L = P + R. Per-token arrays are aligned to the response
    tokens: column j refers to ``tokens[:, P + j]``, whose log-prob the model's hidden
    state at position ``P + j - 1`` gives.

    Attributes:
      tokens: [B, L] int32 prompt + response ids (padding = pad id).
      positions: [B, L] int32 RoPE positions (0 at the first real prompt token).
      attention_mask: [B, L] int32, 1 on real tokens.
      response_mask: [B, R] float32, 1 on response tokens (EOS included).
      old_logprobs: [B, R] float32 behaviour log-probs of the response tokens.
      entropies: [B, R] float32 sampler entropy at each response token.
      rewards: [B] float32.
      truncated: [B] bool, the response hit the length limit.
      group_ids: [B] int32 prompt index of the row's group (-1 for padding groups).
      advantages: [B] float32 group advantage of the row.
      keep: [B] bool, the row's group survived rejection sampling.
      valid: [B] bool, False for padding rows.
      sampling_logprobs: [B, R] float32 log-probs under the truncated (top-k /
        top-p) distribution the tokens were drawn from; None if not recorded.
      behaviour_logprobs: [B, R] float32 the sampler log-probs the update
        measures the rollout/trainer mismatch against (set by
        ``PolicyUpdater.update``; None = ``old_logprobs``).
      entropy_mask: [B, R] float32, 1 on the response tokens ``entropy.tokens``
        selects (the entropy bonus and e_k count only those); None = every one.
      staleness: [B, R] int32, how many versions older than the policy being
        updated each response token's sampler was (``rollout.mode: overlap``; the
        loss then counts clipped tokens per staleness); None otherwise.
      group_size: G (static).
    """

    tokens: Any
    positions: Any
    attention_mask: Any
    response_mask: Any
    old_logprobs: Any
    entropies: Any
    rewards: Any
    truncated: Any
    group_ids: Any
    advantages: Any
    keep: Any
    valid: Any
    sampling_logprobs: Any = None
    behaviour_logprobs: Any = None
    entropy_mask: Any = None
    staleness: Any = None
    group_size: int = dataclasses.field(metadata=dict(static=True), default=1)

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def prompt_len(self) -> int:
        """P, the prompt slots before the response."""
        return self.tokens.shape[1] - self.response_mask.shape[1]

    @property
    def response_len(self) -> int:
        """R, the response slots."""
        return self.response_mask.shape[1]

    @property
    def num_groups(self) -> int:
        return self.num_rows // self.group_size

    def loss_mask(self) -> Any:
        """[B, R] float32: response tokens of kept, valid rows (the tokens T_k counts)."""
        row = (self.keep & self.valid).astype(self.response_mask.dtype)
        return self.response_mask * row[:, None]

    def group_keep(self) -> np.ndarray:
        """[N] bool host array: groups kept by rejection sampling."""
        keep = np.asarray(self.keep) & np.asarray(self.valid)
        return keep.reshape(self.num_groups, self.group_size).any(-1)

    def take_groups(self, groups_N: np.ndarray, live_N: np.ndarray | None = None) -> RolloutBuffer:
        """The rows of the given groups, in that order (host-side gather).

        Args:
          groups_N: [n] group indices.
          live_N: [n] bool; rows of groups with False get ``keep = valid = False``
            (padding of a last, partial mini-batch).
        """
        g = self.group_size
        rows = (np.asarray(groups_N)[:, None] * g + np.arange(g)[None, :]).reshape(-1)
        out = jax.tree.map(lambda x: np.asarray(x)[rows], self)
        if live_N is not None:
            live = np.repeat(np.asarray(live_N, bool), g)
            out = dataclasses.replace(out, keep=out.keep & live, valid=out.valid & live)
        return out


# How the kept groups of a buffer are cut into mini-batches (see ``split_mini_batches``).
MiniBatchSplit = Literal["even", "fixed-size"]


def split_mini_batches(
    order_K: np.ndarray, num_groups: int, mini_batch_groups: int, split: MiniBatchSplit
) -> list[np.ndarray]:
    """Cuts the kept groups of one pass, in shuffled order, into mini-batches.

    ``"even"`` (the report's ``N_SGD = D_R / D_T * N_reuse``): exactly
    D_R / D_T mini-batches per pass whatever rejection sampling kept, their
    sizes equal up to one group (``np.array_split``); when fewer groups than
    that are kept, one group per mini-batch. Each optimizer step then sees a
    similar share of the kept data.

    ``"fixed-size"`` (verl's): ceil(kept / D_T) mini-batches of D_T groups; the
    last holds the remainder, which can be a few groups, yet its token-mean
    loss weighs as much as a full mini-batch in its optimizer step.

    Args:
      order_K: [K] indices of the kept groups, in the order of this pass.
      num_groups: D_R, the buffer's groups (kept or not).
      mini_batch_groups: D_T.
      split: ``"even"`` or ``"fixed-size"``.

    Returns:
      Non-empty arrays of group indices, each at most D_T long, together ``order_K``.

    Raises:
      ValueError: ``"even"`` with D_R not a multiple of D_T, or an unknown split.
    """
    order_K = np.asarray(order_K)
    k, d_t = len(order_K), mini_batch_groups
    if k == 0:
        return []
    if split == "fixed-size":
        return [order_K[i : i + d_t] for i in range(0, k, d_t)]
    if split != "even":
        raise ValueError(f"mini_batch_split must be 'even' or 'fixed-size', got {split!r}")
    if num_groups % d_t:
        raise ValueError(
            f"mini_batch_split 'even' needs D_R ({num_groups}) to be a multiple of D_T ({d_t})"
        )
    return list(np.array_split(order_K, min(num_groups // d_t, k)))


def _bucket(n: int, multiple: int) -> int:
    return max(multiple, math.ceil(n / multiple) * multiple)


def pack_rollouts(
    samples: Sequence[SampleRecord],
    rewards: Sequence[float] | np.ndarray,
    *,
    group_size: int | None = None,
    num_groups: int | None = None,
    advantage: AdvantageConfig | None = None,
    advantages: Sequence[float] | np.ndarray | None = None,
    prompt_bucket: int = 64,
    response_bucket: int = 256,
    prompt_len: int | None = None,
    response_len: int | None = None,
    pad_id: int = 0,
    entropy_tokens: Callable[[np.ndarray], np.ndarray] | None = None,
) -> RolloutBuffer:
    """Packs the sampler's per-response records and their rewards into a ``RolloutBuffer``.

    Groups are formed by ``prompt_index`` (sorted), samples within a group by
    ``sample_index``. Lengths are padded up to multiples of the buckets (or to the
    fixed ``prompt_len`` / ``response_len``) so jit sees few distinct shapes.
    Advantages are ``advantages`` when given (the trainer's, computed once when
    the rollouts were collected), else ``advantage``'s estimator; the keep mask is
    ``group_keep_mask`` of them. Missing samples of a group (fewer than
    ``group_size``) become padding rows that take no part in the statistics.

    Args:
      samples: records with ``prompt_index, sample_index, prompt_tokens, tokens,
        logprobs, entropies, truncated, length`` (``length`` response tokens,
        EOS included, are used).
      rewards: one reward per record, same order as ``samples``.
      group_size: G; default the largest number of samples of any prompt.
      num_groups: pad to this many groups (rows of padding); default the prompts seen.
      advantage: advantage options (estimator, truncation mask, eps, ddof); default
        ``AdvantageConfig()``.
      advantages: one advantage per record, same order as ``samples`` (then
        ``advantage`` is not used).
      prompt_bucket: P is the longest prompt rounded up to a multiple of this.
      response_bucket: R is the longest response rounded up to a multiple of this.
      prompt_len: fixed P instead of the bucket (must fit every prompt).
      response_len: fixed R instead of the bucket (must fit every response).
      pad_id: token id of padding slots.
      entropy_tokens: a response's ids [R_i] -> [R_i] 1.0 on the tokens the entropy
        bonus and e_k count (``token_classes.TokenMask``); None: no ``entropy_mask``.

    Returns:
      A ``RolloutBuffer`` of numpy arrays with B = num_groups * G rows.

    Raises:
      ValueError: on mismatched lengths, duplicate samples, or lengths that do not fit.
    """
    rewards = np.asarray(rewards, np.float32)
    if len(samples) != len(rewards):
        raise ValueError(f"pack_rollouts: {len(samples)} samples but {len(rewards)} rewards")
    if advantages is not None and len(advantages) != len(samples):
        raise ValueError(f"pack_rollouts: {len(samples)} samples but {len(advantages)} advantages")
    if not samples:
        raise ValueError("pack_rollouts: no samples")
    by_group, g, n = _groups(samples, group_size, num_groups)
    p_len, r_len = _padded_lengths(
        samples, prompt_bucket, response_bucket, prompt_len, response_len
    )
    rows = _Rows.empty(n * g, p_len, r_len, pad_id, entropy_tokens is not None)
    for slot, p in enumerate(sorted(by_group)):
        idx = sorted(by_group[p], key=lambda i: int(samples[i].sample_index))
        for j, i in enumerate(idx):
            given = None if advantages is None else advantages[i]
            rows.put(slot * g + j, samples[i], p, rewards[i], given, entropy_tokens)
    if advantages is None:
        rows.adv = estimate_advantages(
            advantage or AdvantageConfig(),
            rows.rew.reshape(n, g),
            rows.trunc.reshape(n, g),
            rows.valid.reshape(n, g),
        )
    return rows.buffer(n, g)


def _groups(
    samples: Sequence[SampleRecord], group_size: int | None, num_groups: int | None
) -> tuple[dict[int, list[int]], int, int]:
    """(the indices of each prompt's samples, G, the number of groups), checked."""
    by_group: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        by_group.setdefault(int(s.prompt_index), []).append(i)
    g = group_size or max(len(v) for v in by_group.values())
    n = num_groups or len(by_group)
    if len(by_group) > n:
        raise ValueError(f"pack_rollouts: {len(by_group)} prompts but num_groups={n}")
    for p, idx in by_group.items():
        if len(idx) > g:
            raise ValueError(f"pack_rollouts: prompt {p} has {len(idx)} samples > group_size {g}")
        if len({int(samples[i].sample_index) for i in idx}) != len(idx):
            raise ValueError(f"pack_rollouts: prompt {p} has duplicate sample_index values")
    return by_group, g, n


def _padded_lengths(
    samples: Sequence[SampleRecord],
    prompt_bucket: int,
    response_bucket: int,
    prompt_len: int | None,
    response_len: int | None,
) -> tuple[int, int]:
    """(P, R): the fixed lengths, or the longest prompt and response rounded up to
    their buckets."""
    max_p = max(len(s.prompt_tokens) for s in samples)
    max_r = max(int(s.length) for s in samples)
    if min(len(s.prompt_tokens) for s in samples) < 1:
        raise ValueError("pack_rollouts: every prompt needs at least one token")
    p_len = prompt_len or _bucket(max_p, prompt_bucket)
    r_len = response_len or _bucket(max_r, response_bucket)
    if max_p > p_len:
        raise ValueError(f"pack_rollouts: a prompt has {max_p} tokens > prompt_len {p_len}")
    if max_r > r_len:
        raise ValueError(f"pack_rollouts: a response has {max_r} tokens > response_len {r_len}")
    return p_len, r_len


@dataclasses.dataclass
class _Rows:
    """The buffer's arrays while ``pack_rollouts`` fills them, row by row."""

    tokens: np.ndarray
    attn: np.ndarray
    resp_mask: np.ndarray
    old_logp: np.ndarray
    samp_logp: np.ndarray
    ents: np.ndarray
    rew: np.ndarray
    trunc: np.ndarray
    gid: np.ndarray
    adv: np.ndarray
    valid: np.ndarray
    ent_mask: np.ndarray | None = None

    @classmethod
    def empty(cls, b: int, p_len: int, r_len: int, pad_id: int, ent_mask: bool = False) -> _Rows:
        """B padding rows of P prompt and R response slots (and an entropy mask if asked)."""
        return cls(
            tokens=np.full((b, p_len + r_len), pad_id, np.int32),
            attn=np.zeros((b, p_len + r_len), np.int32),
            resp_mask=np.zeros((b, r_len), np.float32),
            old_logp=np.zeros((b, r_len), np.float32),
            samp_logp=np.zeros((b, r_len), np.float32),
            ents=np.zeros((b, r_len), np.float32),
            rew=np.zeros((b,), np.float32),
            trunc=np.zeros((b,), bool),
            gid=np.full((b,), -1, np.int32),
            adv=np.zeros((b,), np.float32),
            valid=np.zeros((b,), bool),
            ent_mask=np.zeros((b, r_len), np.float32) if ent_mask else None,
        )

    def put(
        self,
        row: int,
        s: SampleRecord,
        p: int,
        reward: float,
        advantage: float | None,
        entropy_tokens: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        """Sample ``s`` of prompt ``p`` into ``row``: its prompt left-padded to P, its
        response from P on (its entropy mask by ``entropy_tokens``, if given)."""
        p_len = self.tokens.shape[1] - self.resp_mask.shape[1]
        prompt = np.asarray(s.prompt_tokens, np.int32)
        k = int(s.length)
        for name in ("tokens", "logprobs", "entropies"):
            if len(getattr(s, name)) < k:
                raise ValueError(
                    f"pack_rollouts: sample ({p}, {s.sample_index}) has length {k} but "
                    f"{len(getattr(s, name))} {name}"
                )
        self.tokens[row, p_len - len(prompt) : p_len] = prompt
        self.attn[row, p_len - len(prompt) : p_len] = 1
        self.tokens[row, p_len : p_len + k] = np.asarray(s.tokens[:k], np.int32)
        self.attn[row, p_len : p_len + k] = 1
        self.resp_mask[row, :k] = 1.0
        self.old_logp[row, :k] = np.asarray(s.logprobs[:k], np.float32)
        self.samp_logp[row, :k] = np.asarray(getattr(s, "sampling_logprobs", s.logprobs)[:k])
        self.ents[row, :k] = np.asarray(s.entropies[:k], np.float32)
        if entropy_tokens is not None:
            assert self.ent_mask is not None, "rows made by empty(ent_mask=True)"
            self.ent_mask[row, :k] = entropy_tokens(np.asarray(s.tokens[:k], np.int32))
        self.rew[row] = reward
        if advantage is not None:
            self.adv[row] = advantage
        self.trunc[row] = bool(s.truncated)
        self.gid[row] = p
        self.valid[row] = True

    def buffer(self, n: int, g: int) -> RolloutBuffer:
        """The ``RolloutBuffer`` of these rows: N groups of G, kept where ``group_keep_mask``
        of their advantages says."""
        positions = np.maximum(np.cumsum(self.attn, axis=1) - 1, 0).astype(np.int32)
        adv_NG = np.asarray(self.adv, np.float32).reshape(n, g)
        keep_N = np.asarray(group_keep_mask(adv_NG))
        return RolloutBuffer(
            tokens=self.tokens,
            positions=positions,
            attention_mask=self.attn,
            response_mask=self.resp_mask,
            old_logprobs=self.old_logp,
            entropies=self.ents,
            rewards=self.rew,
            truncated=self.trunc,
            group_ids=self.gid,
            advantages=adv_NG.reshape(n * g),
            keep=np.repeat(keep_N, g) & self.valid,
            valid=self.valid,
            sampling_logprobs=self.samp_logp,
            entropy_mask=self.ent_mask,
            group_size=g,
        )
