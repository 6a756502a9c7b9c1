"""What a rollout gives: its samples (``Sample``) and where its time went (``RolloutStats``)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

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
    ``version_wait_s`` is time a lane waited for a scheduled policy version.
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
