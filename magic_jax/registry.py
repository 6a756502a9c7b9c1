"""Named extensions of one kind: the one registry behind ``register_advantage``,
``register_attention``, ``register_probe`` and ``register_sampling``.

Built-ins cannot be replaced; a name another object holds is replaced only when asked;
an unknown name is a one-line error that lists what is registered (the config check
prefixes the option's path).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Objects of one kind by name.

    Args:
      kind: what the objects are, as errors name them (``"advantage estimator"``).
      builtins: the built-in ones, in the order errors list them.
    """

    def __init__(self, kind: str, builtins: Mapping[str, T]):
        self.kind = kind
        self._builtin = tuple(builtins)
        self._items: dict[str, T] = dict(builtins)

    def add(
        self,
        name: str,
        value: T,
        *,
        replace: bool = False,
        same: Callable[[T, T], bool] = lambda a, b: a is b,
    ) -> T:
        """Registers ``value`` as ``name``; returns it.

        Args:
          same: whether a registered object counts as ``value`` again (re-registering
            the same one is not a clash).

        Raises:
          ValueError: an empty or built-in name, or a name another object holds
            (unless ``replace``).
        """
        if not isinstance(name, str) or not name.strip() or name in self._builtin:
            raise ValueError(f"{self.kind} name {name!r} is empty or built in")
        old = self._items.get(name)
        if old is not None and not same(old, value) and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered; pass replace=True")
        self._items[name] = value
        return value

    def get(self, name: str) -> T:
        """The object ``name``.

        Raises:
          ValueError: one line naming ``name`` and the registered ones.
        """
        value = self._items.get(name) if isinstance(name, str) else None
        if value is None:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self._items)}")
        return value

    def names(self) -> tuple[str, ...]:
        """Every name: the built-ins, then the registered ones."""
        return tuple(self._items)

    def is_builtin(self, name: str) -> bool:
        return name in self._builtin
