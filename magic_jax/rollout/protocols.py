"""What the rollout path takes and gives, typed: the driver, the tokenizer, the verifiers.

``collect``, ``scoring`` and ``evaluate`` call a driver only through ``Driver``
(``RolloutDriver`` is the one the package builds; a test or a new decode loop may
bring another), decode responses through ``Tokenizer`` and send them to the
verifiers through ``Verifiers`` (a ``rewards.VerifierPool``, or the in-thread
verifier of ``scoring``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypedDict, Unpack

import numpy as np
from flax import nnx

if TYPE_CHECKING:
    from magic_jax.model.qwen2 import Qwen2
    from magic_jax.rewards import RewardItem, RewardResult
    from magic_jax.rollout.samples import RolloutStats, Sample, Truncation

# The policy's weights in the engine's (sampling) layout: ``Driver.load_params``' result.
Params = nnx.State


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the rollout path uses."""

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> Sequence[int]: ...

    def decode(
        self, token_ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = ...
    ) -> str: ...


class Verifiers(Protocol):
    """Where responses are verified: ``submit`` queues one, ``collect`` waits for results."""

    def submit(self, item: RewardItem) -> int: ...

    def collect(self, tickets: Sequence[int]) -> list[RewardResult]: ...


class RunOptions(TypedDict, total=False):
    """A rollout's options beside its weights and prompts (``RolloutDriver.run`` says
    what each means): what a driver that wraps another passes through."""

    num_samples: int
    seed: int
    step: int
    max_new_tokens: int | np.ndarray | None
    truncation: Truncation
    profile: bool
    on_sample: Callable[[Sample], None] | None
    prompt_indices: Sequence[int] | None


class Driver(Protocol):
    """Samples G responses to each prompt on an engine (``driver.RolloutDriver``)."""

    def load_params(self, model_or_params: Qwen2 | nnx.State) -> Params:
        """The weights in the layout ``run`` takes."""
        ...

    def run(
        self, params: Params, prompts: Sequence[np.ndarray], **options: Unpack[RunOptions]
    ) -> tuple[list[Sample], RolloutStats]:
        """The samples ordered by (prompt, sample), and where the time went."""
        ...


class VersionSchedule(Protocol):
    """Which policy version a rollout's lanes sample with (``rollout.mode: overlap``).

    A lane starts under ``start`` and, before each of its decode chunks, asks
    ``version_at`` with the chunks it has run: the answer is a function of that
    count alone, so which version samples which token never depends on thread
    timing. ``params`` gives a version's weights in the engine's layout, waiting
    until that version is published. Responses in flight keep their KV cache when
    the version changes (the cache of earlier tokens was written by the older one),
    or with ``reprefill`` True have it prefilled again under the new version.
    """

    start: int
    reprefill: bool

    def version_at(self, chunks: int) -> int: ...

    def params(self, version: int) -> nnx.State: ...
