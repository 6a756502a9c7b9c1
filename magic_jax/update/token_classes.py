"""Token classifiers by name, and the entropy mask of ``entropy.tokens``.

A classifier is ``fn(pieces) -> classes``: the text of each token of one response
(each id decoded alone, in order) to one class name per token, from a fixed set.
``entropy.tokens: "carry:choice"`` (classifier ``carry``, classes joined by ``+``)
restricts the entropy bonus and the controller's measured entropy to the response
tokens of those classes (an extension beyond the report's recipe, which counts
every response token). Built in: ``carry`` (``magic_jax.data.tasks.carry``'s
``choice``, ``digit``, ``format``, ``after_answer``), for the carry and lock-out
worlds; ``decision`` (``magic_jax.data.tasks.decision``'s ``decision``, ``digit``,
``format``, ``after_answer``), for the decision world. ``register_token_classes``
adds others (from a config's ``extensions`` module).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from magic_jax.data.tasks import carry, decision
from magic_jax.data.tasks.vocab import TokenPieces

# fn(the text of each token of a response) -> the class of each token
TokenClassFn = Callable[[Sequence[str]], Sequence[str]]


@dataclasses.dataclass(frozen=True)
class _Classifier:
    fn: TokenClassFn
    classes: tuple[str, ...]


_BUILTIN = ("carry", "decision")
_CLASSIFIERS: dict[str, _Classifier] = {
    "carry": _Classifier(carry.token_classes, tuple(carry.TOKEN_CLASSES)),
    "decision": _Classifier(decision.token_classes, tuple(decision.TOKEN_CLASSES)),
}


def register_token_classes(
    name: str, fn: TokenClassFn, classes: Sequence[str], *, replace: bool = False
) -> None:
    """Registers ``fn`` as the token classifier ``name`` (``entropy.tokens: "name:cls"``).

    Args:
      name: the classifier's name (no ``:``).
      fn: ``fn(pieces) -> classes``, one class of ``classes`` per token text.
      classes: every class ``fn`` gives (class names hold no ``+``).
      replace: allow replacing a classifier registered under ``name``.

    Raises:
      ValueError: an empty name, a built-in's name, a name with ``:``, no classes, a class
        name that is empty or holds ``+``, or a name another classifier holds (unless
        ``replace``).
    """
    if not isinstance(name, str) or not name.strip() or name in _BUILTIN or ":" in name:
        raise ValueError(f"token classifier name {name!r} is empty, built in or holds ':'")
    if not callable(fn):
        raise ValueError(f"token classifier {name!r}: {fn!r} is not callable")
    classes = tuple(classes)
    if not classes or not all(isinstance(c, str) and c and "+" not in c for c in classes):
        raise ValueError(
            f"token classifier {name!r}: classes must be non-empty names without '+', "
            f"got {classes!r}"
        )
    old = _CLASSIFIERS.get(name)
    if old is not None and (old.fn, old.classes) != (fn, classes) and not replace:
        raise ValueError(f"token classifier {name!r} is already registered; pass replace=True")
    _CLASSIFIERS[name] = _Classifier(fn, classes)


def get_token_classes(name: str) -> tuple[TokenClassFn, tuple[str, ...]]:
    """The classifier ``name``: (its function, its classes).

    Raises:
      ValueError: one line naming ``name`` and the registered classifiers.
    """
    found = _CLASSIFIERS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(
            f"unknown token classifier {name!r}; registered: {', '.join(_CLASSIFIERS)}"
        )
    return found.fn, found.classes


def parse_token_selection(spec: str) -> tuple[str, frozenset[str]]:
    """``"carry:choice+digit"`` -> (``"carry"``, {``"choice"``, ``"digit"``}), checked.

    Raises:
      ValueError: not ``classifier:class[+class...]``, an unknown classifier (naming the
        registered ones) or an unknown class (naming the classifier's classes).
    """
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(
            f"expected 'classifier:class[+class...]' (e.g. 'carry:choice'), got {spec!r}"
        )
    name, wanted = spec.split(":")
    _, classes = get_token_classes(name.strip())
    chosen = [c.strip() for c in wanted.split("+")]
    unknown = [c for c in chosen if c not in classes]
    if unknown:
        raise ValueError(
            f"unknown class {unknown[0]!r} of token classifier {name.strip()!r}; "
            f"its classes: {', '.join(classes)}"
        )
    return name.strip(), frozenset(chosen)


class TokenMask:
    """The ``entropy.tokens`` selection of a response's tokens: ``mask(ids)`` is 1.0 on the
    tokens whose class is selected. Each id is decoded once (``decode([id])``) and cached.

    Args:
      spec: ``"classifier:class[+class...]"`` (``parse_token_selection``).
      decode: ids -> text (a tokenizer's ``decode``).
    """

    def __init__(self, spec: str, decode: Callable[[list[int]], str]):
        self.spec = spec
        name, self.selected = parse_token_selection(spec)
        self.classify, _ = get_token_classes(name)
        self.pieces = TokenPieces(decode)  # the text of each token id alone

    def __call__(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """[len(ids)] float32: 1.0 where the token's class is selected, else 0.0.

        Raises:
          ValueError: the classifier gave another number of classes than tokens.
        """
        classes = list(self.classify(self.pieces(np.asarray(ids).tolist())))
        if len(classes) != len(ids):
            raise ValueError(
                f"entropy.tokens {self.spec!r}: the classifier gave {len(classes)} classes "
                f"for {len(ids)} tokens"
            )
        return np.asarray([c in self.selected for c in classes], np.float32)
