"""What a rollout gives: its samples (``Sample``) and where its time went (``RolloutStats``);
``SlotBuffers``, the responses growing in a lane's decode slots."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from magic_jax.rollout.decode import StepOutput

Truncation = Literal["no_eos", "length"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """One response of the policy to one prompt.

    Attributes:
      prompt_index: index of the prompt in the rollout's prompt list.
      sample_index: index of this sample in its group, in [0, G).
      prompt_tokens: [P] int32 prompt ids.
      tokens: [L] int32 response ids, EOS included when the response has one.
      logprobs: [L] float32 behaviour log-prob of each response token under the
        temperature-scaled full distribution (what the trainer recomputes).
      entropies: [L] float32 entropy of that distribution at each token.
      sampling_logprobs: [L] float32 log-prob under the distribution sampled from
        (after top-k / top-p; equal to ``logprobs`` when they are off).
      truncated: see ``Truncation``: no EOS within the limit (``"no_eos"``) or
        length equal to the limit, EOS counted (``"length"``, the reference code).
      length: L, exact.
      finish_reason: ``"eos"`` or ``"length"``.
      versions: [L] int32 policy version that sampled each token (a rollout with a
        ``driver.VersionSchedule``: ``rollout.mode: overlap``); None without one.
    """

    prompt_index: int
    sample_index: int
    prompt_tokens: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    entropies: np.ndarray
    sampling_logprobs: np.ndarray
    truncated: bool
    length: int
    finish_reason: Literal["eos", "length"]
    versions: np.ndarray | None = None


@dataclasses.dataclass
class RolloutStats:
    """Where a rollout's time went (seconds) and how full the decode batch was.

    ``prefill_s`` / ``insert_s`` are exact only with ``profile=True`` (else the
    work is asynchronous and lands in ``decode_s``). ``slot_steps`` counts rows
    computed per device step (the batch run), ``tokens`` the useful ones;
    ``by_batch`` maps a decode batch size to [steps, seconds] spent at it;
    ``version_wait_s`` is time a lane waited for a scheduled policy version;
    ``reprefills`` counts responses re-prefilled under a new version (their time is in
    ``prefill_s``).
    """

    tokens: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    insert_s: float = 0.0
    decode_s: float = 0.0
    host_s: float = 0.0
    chunks: int = 0
    steps: int = 0
    slot_steps: int = 0
    prefills: int = 0
    reprefills: int = 0
    version_wait_s: float = 0.0
    by_batch: dict[int, list[float]] = dataclasses.field(default_factory=dict)

    @classmethod
    def merged(cls, parts: list[RolloutStats]) -> RolloutStats:
        """The lanes' stats in one (counts and times summed, ``by_batch`` per batch size)."""
        out = cls()
        for st in parts:
            for f in dataclasses.fields(cls):
                if f.name == "by_batch":
                    for b, (n, t) in st.by_batch.items():
                        at = out.by_batch.setdefault(b, [0, 0.0])
                        at[0] += n
                        at[1] += t
                else:
                    setattr(out, f.name, getattr(out, f.name) + getattr(st, f.name))
        return out


class SlotBuffers:
    """The responses growing in the slots, on the host: [slots, T] per field.

    A chunk's outputs land in one scatter per field (no per-slot Python work),
    and a finished sample is one slice per field.
    """

    def __init__(self, slots: int, limit: int, versions: bool = False):
        self.length = np.zeros(slots, np.int64)
        # the policy version of each token (a rollout under a ``VersionSchedule``)
        self.versions = np.zeros((slots, limit), np.int32) if versions else None
        self.fields = (
            np.zeros((slots, limit), np.int32),  # tokens
            np.zeros((slots, limit), np.float32),  # logprobs
            np.zeros((slots, limit), np.float32),  # entropies
            np.zeros((slots, limit), np.float32),  # sampling_logprobs
        )

    def start(self, slots: np.ndarray, draws: tuple[np.ndarray, ...], version: int = 0) -> None:
        """The first token of each of ``slots`` (sampled at insert, by ``version``)."""
        for buf, x in zip(self.fields, draws):
            buf[slots, 0] = x
        if self.versions is not None:
            self.versions[slots, 0] = version
        self.length[slots] = 1

    def add(self, slots: np.ndarray, outs: StepOutput, version: int = 0) -> None:
        """A chunk's tokens [n, b] for the slots of its columns (sampled by ``version``)."""
        valid = outs.valid
        step, col = np.nonzero(valid)
        at = self.length[slots[col]] + (np.cumsum(valid, axis=0)[step, col] - 1)
        for buf, x in zip(self.fields, outs[:4]):
            buf[slots[col], at] = x[step, col]
        if self.versions is not None:
            self.versions[slots[col], at] = version
        self.length[slots] += valid.sum(axis=0)

    def sequence(self, slot: int, prompt: np.ndarray) -> np.ndarray:
        """What the slot's KV cache holds: ``prompt`` and every response token but the
        newest (sampled, not yet fed)."""
        return np.concatenate([prompt, self.fields[0][slot, : int(self.length[slot]) - 1]])

    def take(
        self, slot: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """(tokens, logprobs, entropies, sampling_logprobs, versions or None) of ``slot``."""
        n = int(self.length[slot])
        tokens, logprobs, entropies, sampling_logprobs = (b[slot, :n].copy() for b in self.fields)
        versions = None if self.versions is None else self.versions[slot, :n].copy()
        return tokens, logprobs, entropies, sampling_logprobs, versions
