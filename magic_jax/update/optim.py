"""The optimiser: AdamW with global-norm clipping, its options and its optax chain."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with global-norm clipping (the reference code's optimiser).

    Attributes:
      learning_rate: constant learning rate.
      b1, b2, eps: Adam moments and epsilon.
      weight_decay: decoupled weight decay (applied to every parameter, as torch AdamW).
      max_grad_norm: clip the global gradient norm to this; None = no clipping.
    """

    learning_rate: float = 1e-6
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0

    def __post_init__(self):
        if self.learning_rate <= 0:
            raise ValueError(f"OptimizerConfig.learning_rate must be > 0, got {self.learning_rate}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(
                    f"OptimizerConfig.{name} must be in [0, 1), got {getattr(self, name)}"
                )
        if self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(
                f"OptimizerConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm}"
            )


def make_optimizer(config: OptimizerConfig) -> Any:
    """The optax chain: optional global-norm clip, then AdamW."""
    import optax

    adamw = optax.adamw(
        config.learning_rate,
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=config.weight_decay,
    )
    if config.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)
