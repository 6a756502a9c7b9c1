"""Decode attention implementations by name: the built-in ``dense`` product and ``ragged``
kernel, and registered ones (``register_attention``).

The engine looks its attention up once, when it builds its programs
(``Engine.attention``): a registered product is a static argument of the compiled
decode step, traced into it like the built-in dense one; nothing is looked up per token.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax

from magic_jax.registry import Registry


class AttendFn(Protocol):
    """One decode query per row against one layer's KV cache.

    Args:
      q_BKGH: [B, K kv heads, G query heads per kv head, H] the new token's queries
        (RoPE applied; the cache's dtype or the compute dtype).
      k_BSKH / v_BSKH: [B, S, K, H] the layer's keys and values, the new token's
        already written at its slot (a float cache: registered attentions do not
        read an int8 one; a transposed view of the cache's [B, K, S, H] layer).
      allowed_BS: [B, S] bool, the slots the row attends (its past, the new token,
        inside a sliding window where the layer has one).

    Returns:
      [B, K, G, H] float32: softmax(q . k / sqrt(H)) over the allowed slots, times v.
    """

    def __call__(
        self, q_BKGH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, allowed_BS: jax.Array
    ) -> jax.Array: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeAttention:
    """A decode attention known by name.

    Attributes:
      name: what ``rollout.decode_attention`` (``EngineConfig.decode_attention``) calls it.
      attend: the product (``AttendFn``); None: the built-in dense one
        (``decode.decode_attention``, which also reads an int8 cache).
      ragged: the built-in kernel that reads only the slots each row holds
        (``ragged_attention``; where it does not apply, an int8 cache on GPU among
        them, the dense product runs).
    """

    name: str
    attend: AttendFn | None = None
    ragged: bool = False

    @property
    def reads_int8(self) -> bool:
        """Whether it reads an int8 KV cache (``kv_dtype``): the built-ins (the ragged
        kernel on TPU; on GPU an int8 cache runs the dense product,
        ``ragged_attention.applies``), not a registered one."""
        return self.attend is None


_ATTENTIONS: Registry[DecodeAttention] = Registry(
    "decode attention",
    {"dense": DecodeAttention(name="dense"), "ragged": DecodeAttention(name="ragged", ragged=True)},
)


def register_attention(name: str, attend: AttendFn, *, replace: bool = False) -> DecodeAttention:
    """Registers ``attend`` (an ``AttendFn``) as the decode attention ``name``.

    The function is part of the compiled decode step's cache key: register a
    module-level function (or one object) once, not a new closure per engine.

    Raises:
      ValueError: an empty name, a built-in's name, or a name another function holds
        (unless ``replace``).
    """
    if not callable(attend):
        raise ValueError(f"decode attention {name!r}: {attend!r} is not callable")
    impl = DecodeAttention(name=name, attend=attend)
    return _ATTENTIONS.add(name, impl, replace=replace, same=lambda a, b: a.attend is b.attend)


def get_attention(name: str) -> DecodeAttention:
    """The decode attention ``name``.

    Raises:
      ValueError: one line naming ``name`` and the registered attentions.
    """
    return _ATTENTIONS.get(name)
