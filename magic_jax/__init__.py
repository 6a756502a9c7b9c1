"""magic_jax: reinforcement-learning post-training of long chain-of-thought models in JAX.

Heavy modules (jax, flax, transformers) are imported lazily so that
``import magic_jax`` stays fast and the reward workers never load JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

from magic_jax import extras as _extras

__version__ = "0.1.0"

# a missing optional dependency names the extra that installs it (magic_jax.extras)
_extras.install()

# public name -> module that defines it, by role
_LAZY = {
    # the policy network and its weights
    "ModelConfig": "magic_jax.model.config",
    "PRESETS": "magic_jax.model.config",
    "Qwen2": "magic_jax.model.qwen2",
    "KVCache": "magic_jax.model.kv_cache",
    "load_hf": "magic_jax.model.convert",
    "save_hf": "magic_jax.model.convert",
    "MeshConfig": "magic_jax.model.sharding",
    "make_mesh": "magic_jax.model.sharding",
    # sampling: the engine and the driver that batches requests on it
    "Engine": "magic_jax.rollout.engine",
    "EngineConfig": "magic_jax.rollout.engine",
    "EngineOptions": "magic_jax.rollout.engine_config",
    "RolloutDriver": "magic_jax.rollout.driver",
    "SamplingConfig": "magic_jax.rollout.sampling",
    # the policy update
    "PolicyUpdater": "magic_jax.update.updater",
    "UpdateConfig": "magic_jax.update.config",
    "UpdateOptions": "magic_jax.update.config",
    # verification
    "VerifierPool": "magic_jax.rewards",
    "RewardResult": "magic_jax.rewards",
    # the extension points (docs/extending.md)
    "register_reward": "magic_jax.rewards",
    "register_advantage": "magic_jax.update.advantages",
    "register_attention": "magic_jax.rollout.attention",
    "register_token_classes": "magic_jax.update.token_classes",
    "register_sampling": "magic_jax.rollout.sampling",
    "SamplingMethod": "magic_jax.rollout.sampling",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'magic_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
