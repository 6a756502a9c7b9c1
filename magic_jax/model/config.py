"""Qwen2 model configuration: ``ModelConfig`` (shapes, dtypes, layer options, the Hugging
Face config round trip) and the DeepSeek-R1-Distill-Qwen presets."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

DType = Literal["float32", "bfloat16", "float16"]


_DTYPES = ("float32", "bfloat16", "float16")


RematPolicy = Literal["none", "full", "dots_saveable"]


_REMAT = ("none", "full", "dots_saveable")


SequenceAttention = Literal["dense", "splash", "splash-interpret"]


ATTENTIONS = ("dense", "splash", "splash-interpret")


def check_unroll(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Raises a ValueError naming ``name`` unless ``value`` is a scan unroll
    (``True``, ``False`` or an int >= 1; or None where ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or (isinstance(value, int) and value >= 1):
        return
    allowed = "None, " if allow_none else ""
    raise ValueError(f"{name} must be {allowed}True, False or an int >= 1, got {value!r}")


_HF_ARCHITECTURES = ("Qwen2ForCausalLM",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a Qwen2 decoder.

    Attributes:
      vocab_size: V.
      hidden_size: D.
      intermediate_size: F (SwiGLU width).
      num_layers: L.
      num_heads: N query heads.
      num_kv_heads: K key/value heads (grouped-query attention when K < N).
      head_dim: H; defaults to ``hidden_size // num_heads``.
      rope_theta: rotary base frequency.
      rms_norm_eps: RMSNorm epsilon.
      tie_word_embeddings: unembed with the input embedding (no ``lm_head``).
      max_position_embeddings: longest position the checkpoint was trained for.
      sliding_window: window length for layers listed in ``sliding_layers``.
      sliding_layers: indices of layers that use sliding-window attention.
      bos_token_id / eos_token_id: special ids from the checkpoint config.
      param_dtype: storage dtype of the parameters. fp32 by default: an lr of
        1e-6 vanishes when added to bf16 weights.
      dtype: compute dtype of matmuls; softmax, norms and RoPE stay in fp32.
      attention_chunk: queries per attention block for long inputs (0: all at
        once); bounds attention memory by [B, N, chunk, S] instead of [B, N, T, S].
      scan_layers: stack the layers' parameters on a leading ``layers`` axis and
        run them under ``nnx.scan`` (False: a Python loop over separate layers).
      remat: what the backward pass keeps of each layer's forward: ``none``
        (everything), ``full`` (only the layer inputs; the layer is recomputed),
        ``dots_saveable`` (matmul outputs; the elementwise work is recomputed).
      layer_unroll: how a forward without a cache runs the stacked layers
        (``scan_layers``): the layer scan's ``unroll`` (``True`` inlines every
        layer with static weight slices, an int n unrolls n at a time, 1 is a
        plain scan). The parameters stay stacked and the values are the same;
        only speed and compile time change. The update sets it per platform
        (``UpdateConfig.layer_unroll``). Stored as an int (``True`` becomes
        ``num_layers``, ``False`` 1).
      mlp_kernel: run the MLP as ``kernels.swiglu`` (a hand-written backward pass;
        the same values). The update sets it per platform (``UpdateConfig.mlp_kernel``).
      attention: how a forward without a cache attends: ``dense`` (the masked product
        in query chunks, ``kernels.masked_attention``), ``splash`` (``splash.py``: the
        TPU kernel, each sequence's causal tiles only; TPU only, no sliding windows) or
        ``splash-interpret`` (that kernel in Pallas's interpreter: any platform, slow).
        The same values up to rounding. The update sets it (``UpdateConfig.attention``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    param_dtype: DType = "float32"
    dtype: DType = "float32"
    attention_chunk: int = 2048
    scan_layers: bool = True
    remat: RematPolicy = "none"
    layer_unroll: int | bool = 1
    mlp_kernel: bool = False
    attention: SequenceAttention = "dense"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads <= 0 or self.num_kv_heads <= 0:
            raise ValueError(
                f"ModelConfig.num_heads/num_kv_heads must be positive, got "
                f"{self.num_heads}/{self.num_kv_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelConfig.hidden_size ({self.hidden_size}) is not divisible by num_heads "
                f"({self.num_heads}); set head_dim explicitly"
            )
        if self.head_dim is not None and self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(
                    f"ModelConfig.{name} must be one of {_DTYPES}, got {getattr(self, name)!r}"
                )
        if self.attention_chunk < 0:
            raise ValueError(
                f"ModelConfig.attention_chunk must be >= 0, got {self.attention_chunk}"
            )
        if self.remat not in _REMAT:
            raise ValueError(f"ModelConfig.remat must be one of {_REMAT}, got {self.remat!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(
                f"ModelConfig.attention must be one of {ATTENTIONS}, got {self.attention!r}"
            )
        if self.attention != "dense" and self.sliding_layers:
            raise ValueError(
                f"ModelConfig.attention {self.attention!r} (update.attention) has no "
                f"sliding-window mask; this model's layers {list(self.sliding_layers)} slide: "
                f"use 'dense'"
            )
        check_unroll("ModelConfig.layer_unroll", self.layer_unroll)
        # stored as an int (True == 1 in Python: configs and caches must not mix them up)
        if isinstance(self.layer_unroll, bool):
            unroll = self.num_layers if self.layer_unroll else 1
            object.__setattr__(self, "layer_unroll", unroll)
        if self.sliding_layers and not self.sliding_window:
            raise ValueError("ModelConfig.sliding_layers is set but sliding_window is not")
        bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"ModelConfig.sliding_layers has indices outside [0, {self.num_layers}): {bad}"
            )

    @property
    def head_size(self) -> int:
        """H, the per-head width."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def layer_window(self, layer: int) -> int | None:
        """The sliding-window length of layer ``layer`` (None: full attention)."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids as a tuple (checkpoints give an int or a list)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def num_params(self) -> int:
        """Parameter count computed from the shapes (no allocation)."""
        d, h = self.hidden_size, self.head_size
        q, kv = self.num_heads * h, self.num_kv_heads * h
        attn = d * q + q + 2 * (d * kv + kv) + q * d
        layer = attn + 3 * d * self.intermediate_size + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + d + embed

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
        """Builds a config from a Hugging Face ``config.json`` dict.

        Raises:
          ValueError: for an unsupported architecture or rope scaling, naming it.
        """
        archs = hf.get("architectures") or []
        if hf.get("model_type") != "qwen2" and not set(archs) & set(_HF_ARCHITECTURES):
            raise ValueError(
                f"unsupported architecture: model_type={hf.get('model_type')!r}, "
                f"architectures={archs!r}; magic_jax loads Qwen2ForCausalLM checkpoints"
            )
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"unsupported rope scaling {rope_type!r} in config.json")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        num_layers = hf["num_hidden_layers"]
        sliding: tuple[int, ...] = ()
        if hf.get("use_sliding_window") and hf.get("sliding_window"):
            types = hf.get("layer_types")
            if types:
                sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
            else:
                first = hf.get("max_window_layers", num_layers)
                sliding = tuple(range(first, num_layers))
        kwargs = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            rope_theta=float(theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 131072)),
            sliding_window=hf.get("sliding_window") if sliding else None,
            sliding_layers=sliding,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=(
                tuple(hf["eos_token_id"])
                if isinstance(hf.get("eos_token_id"), list)
                else hf.get("eos_token_id")
            ),
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf_config(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """A ``config.json`` dict that transformers' ``Qwen2ForCausalLM`` loads."""
        eos = self.eos_token_id
        extra = {} if self.head_dim is None else {"head_dim": self.head_dim}
        return extra | {
            "architectures": list(_HF_ARCHITECTURES),
            "model_type": "qwen2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "use_sliding_window": bool(self.sliding_layers),
            "sliding_window": self.sliding_window,
            "layer_types": [
                "sliding_attention" if i in self.sliding_layers else "full_attention"
                for i in range(self.num_layers)
            ],
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
            "dtype": torch_dtype,
            "torch_dtype": torch_dtype,
            "use_cache": True,
        }


def _r1_distill(**kw: Any) -> ModelConfig:
    base = dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
        bos_token_id=151646,
        eos_token_id=151643,
        tie_word_embeddings=False,
    )
    return ModelConfig(**(base | kw))


PRESETS: dict[str, ModelConfig] = {
    "r1-distill-qwen-1.5b": _r1_distill(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        rope_theta=10000.0,
    ),
    "r1-distill-qwen-7b": _r1_distill(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        rope_theta=10000.0,
    ),
    "r1-distill-qwen-32b": _r1_distill(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_layers=64,
        num_heads=40,
        num_kv_heads=8,
        rope_theta=1000000.0,
    ),
}
