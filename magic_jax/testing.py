"""Tiny random Hugging Face Qwen2 checkpoints and rollout samples for benchmarks and tests
(needs torch); what only the tests use is in ``tests/helpers.py``."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any


def hf_qwen2_config(vocab_size: int = 128, **kw: Any):
    """A ``transformers.Qwen2Config`` with small defaults."""
    from transformers import Qwen2Config

    base = dict(
        vocab_size=vocab_size,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return Qwen2Config(**(base | kw))


def make_hf_model(seed: int = 0, dtype: str = "float32", **config_kw: Any):
    """A random ``Qwen2ForCausalLM`` (eval mode); biases get non-zero values so they matter."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(hf_qwen2_config(**config_kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.to(getattr(torch, dtype))


def save_hf_model(model: Any, path: str | os.PathLike, max_shard_size: str | None = None) -> Path:
    """Saves a torch model as safetensors (optionally split into several files)."""
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    return Path(path)


@dataclasses.dataclass(frozen=True)
class Sample:
    """A sampled response as ``buffer.pack_rollouts`` reads it, for tests and benchmarks
    that build rollout buffers without decoding (the fields of ``rollout.Sample`` it uses)."""

    prompt_index: int
    sample_index: int
    prompt_tokens: Any
    tokens: Any
    logprobs: Any
    entropies: Any
    truncated: bool
    length: int
