"""Keeps the expected literals of ``assert f(x) == literal`` out of the sandboxed test code."""

# An assert evaluated inside the sandbox can be faked by a program that knows
# how the harness reports success. For the common form `assert call == literal`
# (and `assert call is True/False/None`) the literal stays outside: the sandbox
# only reports the value of `call`, and the verdict is taken here, so passing
# needs the right values, not just a forged report.

from __future__ import annotations

import ast
from typing import Any

OBSERVE = "__mj_observe__"
_MISSING = object()


def normalize(value: Any, depth: int = 0) -> Any:
    """Mirrors the harness's tagged encoding of observed values.

    Tuples and sets keep their type (``[1, 2] != (1, 2)`` as in Python), dict
    keys become strings, numbers compare as Python numbers do.

    Raises:
      TypeError: a value the harness could not report (bytes, complex, ...).
    """
    if depth > 100:
        raise TypeError("value nested too deeply")
    t = type(value)
    if t in (int, float, str, bool) or value is None:
        return value
    if t is list:
        return [normalize(v, depth + 1) for v in value]
    if t is tuple:
        return {"__tuple__": [normalize(v, depth + 1) for v in value]}
    if t in (set, frozenset):
        return {"__set__": sorted(normalize(v, depth + 1) for v in value)}
    if t is dict:
        return {str(normalize(k, depth + 1)): normalize(v, depth + 1) for k, v in value.items()}
    raise TypeError(f"cannot observe a {t.__name__}")


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _MISSING


class _Split(ast.NodeTransformer):
    def __init__(self, start: int) -> None:
        self.next = start
        self.expected: dict[int, tuple[str, Any]] = {}

    def visit_Assert(self, node: ast.Assert) -> ast.stmt:
        test = node.test
        if not isinstance(test, ast.Compare) or len(test.ops) != 1:
            return node
        op, left, right = test.ops[0], test.left, test.comparators[0]
        if isinstance(op, ast.Eq):
            for probe, other in ((left, right), (right, left)):
                value = _literal(other)
                if value is not _MISSING and _literal(probe) is _MISSING:
                    try:
                        return self._observe(node, probe, ("eq", normalize(value)))
                    except TypeError:
                        return node
        if (
            isinstance(op, ast.Is)
            and isinstance(right, ast.Constant)
            and (right.value is None or type(right.value) is bool)
        ):
            return self._observe(node, left, ("is", right.value))
        return node

    def _observe(self, node: ast.Assert, probe: ast.expr, expected: tuple[str, Any]) -> ast.stmt:
        k = self.next
        self.next += 1
        self.expected[k] = expected
        call = ast.Call(ast.Name(OBSERVE, ast.Load()), [ast.Constant(k), probe], [])
        return ast.copy_location(ast.Expr(call), node)


def split_expected(source: str, start: int = 0) -> tuple[str, dict[int, tuple[str, Any]]]:
    """Rewrites literal asserts of ``source`` into ``__mj_observe__(k, value)`` calls.

    Args:
      source: test code (already known to parse).
      start: first observation index, so several sources can share one numbering.

    Returns:
      The rewritten source and ``{k: (kind, expected)}`` with kind ``"eq"`` or ``"is"``.
    """
    splitter = _Split(start)
    tree = splitter.visit(ast.parse(source))
    if not splitter.expected:
        return source, {}
    return ast.unparse(ast.fix_missing_locations(tree)), splitter.expected


def observed_matches(actual: Any, expected: tuple[str, Any]) -> bool:
    """Compares a reported value (decoded JSON) with what ``split_expected`` kept."""
    kind, value = expected
    if kind == "is":
        return type(actual) is type(value) and actual == value
    return bool(actual == value)
