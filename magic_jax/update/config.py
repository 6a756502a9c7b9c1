"""The update's options: ``UpdateOptions`` (a run config's ``update:`` section) and
``UpdateConfig`` (those options plus one stage's mini-batch size and objective)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from magic_jax.model.config import ATTENTIONS, RematPolicy, SequenceAttention, check_unroll
from magic_jax.update.buffer import MiniBatchSplit
from magic_jax.update.entropy_control import EntropyControlConfig
from magic_jax.update.losses import LossConfig
from magic_jax.update.optim import OptimizerConfig

REMAT_POLICIES: tuple[str, ...] = typing.get_args(RematPolicy)
COMPUTE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
MINI_BATCH_SPLITS: tuple[str, ...] = typing.get_args(MiniBatchSplit)


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpdateOptions:
    """How the update runs: the ``update:`` section of a run config, the same for
    every stage.

    Attributes:
      mini_batch_split: how the kept groups are cut into mini-batches: ``even`` (the
        report's N_SGD = D_R / D_T * N_reuse: D_R / D_T mini-batches of equal size,
        +-1 group) or ``fixed-size`` (verl's ceil(kept / D_T) mini-batches of D_T
        groups, the last one smaller); see ``buffer.split_mini_batches``.
      micro_batch_size: sequences per micro-batch (gradient accumulation inside jit);
        None = the whole mini-batch at once. Must divide D_T * G.
      packing: run the update on packed rows (``update.packing``): a mini-batch's
        rows laid end to end, without their padding, in bins of the step's row length
        with segment ids, so that the update pays for real tokens rather than for
        every row at the step's longest prompt and response. Same loss, gradients and
        metrics up to rounding (``micro-token-mean`` excepted: its value depends on
        which rows share a micro-batch). False: every row padded, as before.
      micro_batch_tokens: with ``packing``, the token slots of one micro-batch (bins
        x row length, rounded down to whole bins per data shard; verl's
        ``ppo_max_token_len_per_gpu`` times the data shards); None = as many bins as
        the padded micro-batch has rows, the same activation memory.
      num_reuse: N_reuse, passes over each rollout buffer.
      remat: what the backward pass keeps of each decoder layer's forward
        (``ModelConfig.remat``): ``none`` (every activation: fastest, the most
        memory), ``full`` (only each layer's input; the layer runs again in the
        backward, about a third more update flops) or ``dots_saveable`` (the matmul
        outputs; the elementwise work runs again). None = the policy model's own.
        The results are the same up to rounding; ``magic-jax plan`` shows the memory
        each needs.
      compute_dtype: matmul dtype of the update's forward and backward and of the
        trainer's log-prob recomputation: ``float32`` or ``bfloat16`` (half the
        activations, the MXU's native input); None = the policy model's own
        (``param_dtype`` for a Hugging Face checkpoint). Parameters, gradients and
        optimizer state keep their dtype; softmax, norms, RoPE, log-probs and the
        loss stay fp32.
      attention_chunk: queries per attention block of the update's forward and
        backward (and the recomputed log-probs) for rows longer than it
        (``ModelConfig.attention_chunk``); None = the model's own. The scores of one
        block, [heads, chunk, row length] in float32, and their backward's copies are
        the largest update temporaries of long rows: 512 holds a quarter of 2048's.
      layer_unroll: how the update runs the stacked layers (``ModelConfig.layer_unroll``:
        ``True`` inlines every layer, an int n unrolls n at a time, 1 is a plain scan);
        None = the platform's measured default (``step.default_update_layer_unroll``).
        Same values either way; speed and compile time change.
      mlp_kernel: run the MLP's backward pass by hand (``model.kernels.swiglu``,
        ``ModelConfig.mlp_kernel``); None = the platform's measured default
        (``step.default_update_mlp_kernel``). Same values; speed and memory change.
      attention: how the update's forwards attend (``ModelConfig.attention``): ``dense``
        (the masked product by query chunks of ``attention_chunk``, every key of the
        row), ``splash`` (the TPU kernel: only the score tiles on and below the diagonal
        within each sequence, no [T, S] scores; TPU only) or ``splash-interpret`` (that
        kernel interpreted, any platform, slow); None = the model's own (``dense``). Same
        values up to rounding.
    """

    mini_batch_split: MiniBatchSplit = "even"
    micro_batch_size: int | None = None
    packing: bool = False
    micro_batch_tokens: int | None = None
    num_reuse: int = 1
    remat: RematPolicy | None = "none"
    compute_dtype: Literal["float32", "bfloat16"] | None = None
    attention_chunk: int | None = None
    layer_unroll: int | bool | None = None
    mlp_kernel: bool | None = None
    attention: SequenceAttention | None = None

    def __post_init__(self):
        for name, allowed in (
            ("mini_batch_split", MINI_BATCH_SPLITS),
            ("attention", (None, *ATTENTIONS)),
            ("remat", (None, *REMAT_POLICIES)),
            ("compute_dtype", (None, *COMPUTE_DTYPES)),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: must be one of {allowed}, got {getattr(self, name)!r}")
        if not isinstance(self.packing, bool):
            raise ValueError(f"packing: must be true or false, got {self.packing!r}")
        for name in ("micro_batch_size", "micro_batch_tokens", "attention_chunk"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError(f"{name}: must be a positive integer or null, got {value!r}")
        if isinstance(self.num_reuse, bool) or not self.num_reuse > 0:
            raise ValueError(f"num_reuse: must be positive, got {self.num_reuse!r}")
        check_unroll("layer_unroll", self.layer_unroll, allow_none=True)
        if not (self.mlp_kernel is None or isinstance(self.mlp_kernel, bool)):
            raise ValueError(f"mlp_kernel: must be true, false or null, got {self.mlp_kernel!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpdateConfig(UpdateOptions):
    """How a rollout buffer becomes optimizer steps in one stage (SPEC item 7): the
    run's ``UpdateOptions`` plus the stage's mini-batch size and objective.

    N_SGD = D_R / D_T * N_reuse (``mini_batch_split="even"``) or ceil(kept groups /
    D_T) * N_reuse (``"fixed-size"``); with D_R = D_T and num_reuse = 1 both are one
    on-policy step.

    Attributes:
      mini_batch_groups: D_T, prompts (groups) per optimizer step (the most a
        mini-batch holds; its static shape).
      loss: objective options (with the stage's KL weight).
      entropy: entropy-bonus controller options.
      optimizer: AdamW options.
    """

    mini_batch_groups: int
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    entropy: EntropyControlConfig = dataclasses.field(default_factory=EntropyControlConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)

    @classmethod
    def of(cls, options: UpdateOptions, **stage: object) -> UpdateConfig:
        """The update of ``options`` (only its ``UpdateOptions`` fields are read) with
        the stage's ``stage`` fields (this class's own, or an option to override)."""
        own = {f.name: getattr(options, f.name) for f in dataclasses.fields(UpdateOptions)}
        return cls(**own | stage)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.mini_batch_groups, bool) or not self.mini_batch_groups > 0:
            raise ValueError(f"mini_batch_groups: must be > 0, got {self.mini_batch_groups!r}")
