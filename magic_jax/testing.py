"""Tiny random Hugging Face Qwen2 checkpoints for tests, benchmarks and examples (needs torch)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # grouped-query attention, untied, as the R1-Distill checkpoints
    "gqa_untied": dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    # multi-head attention, tied embeddings, other rope theta
    "mha_tied": dict(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    # explicit head_dim larger than hidden/heads, single kv head
    "wide_heads": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        rope_theta=5e5,
        tie_word_embeddings=False,
    ),
}


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


def torch_logits(model: Any, input_ids: Any, attention_mask: Any = None):
    """Logits [B, T, V] as a float32 numpy array from a torch model."""
    import numpy as np
    import torch

    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    kw = {}
    if attention_mask is not None:
        mask = torch.as_tensor(np.asarray(attention_mask), dtype=torch.long)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        kw = {"attention_mask": mask, "position_ids": pos}
    with torch.no_grad():
        return model(ids, **kw).logits.float().numpy()


def make_char_tokenizer(
    chars: str = "abcdefghijklmnopqrstuvwxyz0123456789 +-*/=?.,()\n\\{}$^_", **kw: Any
):
    """A character-level tokenizer with the R1-Distill markers (see ``tasks.vocab``)."""
    from magic_jax.data.tasks.vocab import char_tokenizer

    return char_tokenizer(chars, **kw)


# The vocabulary of one-digit sums: a random policy hits the gold answer often enough
# that groups with mixed rewards (which train) occur in every short run.
SUMS_CHARS = "0123+= "


def save_sums_model(path: str | os.PathLike, seed: int = 0) -> Path:
    """A tiny tied Qwen2 (d 32, 2 layers, 4 / 2 heads) with the sums tokenizer, saved at ``path``.

    The run, eval and difficulty tests train or sample it on one-digit sums.
    """
    tok = make_char_tokenizer(chars=SUMS_CHARS)
    hf = make_hf_model(
        seed=seed,
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    out = save_hf_model(hf, path)
    tok.save_pretrained(out)
    return out


def sums_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` verl rows asking one-digit sums ``a+b=`` (a, b in {0, 1}) with their gold answers."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(0, 2, 2))
        rows.append(
            {
                "data_source": "sums",
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "ability": "math",
                "reward_model": {"ground_truth": str(a + b), "style": "rule"},
                "extra_info": {"index": i},
            }
        )
    return rows


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


# float32's unit roundoff: two programs that sum the same terms in another order (another
# processor, thread count, fusion or micro-batch split) agree to about this many ulps per term.
F32_EPS = 2.0**-23


def assert_fp32_close(
    actual: Any, desired: Any, *, terms: int, rtol: float = 1e-5, err_msg: str = ""
) -> None:
    """Asserts two float32 results agree up to the rounding of a reordered sum.

    A reduction of ``terms`` float32 terms summed in another order can differ by
    about ``terms * eps * max|term|``; the largest magnitude compared stands in
    for the terms' (a gradient's entries are sums of terms of that size). So the
    absolute tolerance is ``4 * eps * terms * max(|desired|)``: it scales with
    what is compared and with the reduction length, never a fixed 1e-7. ``rtol``
    still bounds each entry relative to itself. Works on arrays and pytrees
    (the scale is taken per leaf).

    Args:
      actual, desired: arrays, scalars or pytrees of them with the same structure.
      terms: the longest reduction behind the values (e.g. tokens x layers).
      rtol: relative tolerance per entry.
      err_msg: shown on failure.
    """
    import jax
    import numpy as np

    a_leaves, d_leaves = jax.tree.leaves(actual), jax.tree.leaves(desired)
    assert len(a_leaves) == len(d_leaves), f"{err_msg}: {len(a_leaves)} vs {len(d_leaves)} leaves"
    for i, (a, d) in enumerate(zip(a_leaves, d_leaves)):
        a, d = np.asarray(a, np.float64), np.asarray(d, np.float64)
        scale = float(np.max(np.abs(d))) if d.size else 0.0
        atol = 4 * F32_EPS * max(terms, 1) * scale
        np.testing.assert_allclose(a, d, rtol=rtol, atol=atol, err_msg=f"{err_msg} (leaf {i})")
