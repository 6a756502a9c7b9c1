"""The rollout path is typed: no ``Any`` in the signatures or class fields of ``rollout/``
and ``run/stages.py`` (the seams between them are protocols: ``rollout.protocols.Driver``,
``update.updater.Updater``, ``run.stages.BatchSource``)."""

import ast
import pathlib

import pytest

import magic_jax

ROOT = pathlib.Path(magic_jax.__file__).parent
CHECKED = [*sorted((ROOT / "rollout").glob("*.py")), ROOT / "run" / "stages.py"]


def _mentions_any(annotation: ast.expr | None) -> bool:
    """Whether an annotation names ``Any`` (``Any``, ``typing.Any``, inside a subscript or
    a union, or in a string annotation)."""
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "Any":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Any":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                inner = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                continue
            if _mentions_any(inner):
                return True
    return False


def any_annotations(source: str) -> list[str]:
    """``name (line)`` of each function parameter, return and class field annotated with
    ``Any`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
            for p in params:
                if p is not None and _mentions_any(p.annotation):
                    found.append(f"{node.name}({p.arg}) (line {p.lineno})")
            if _mentions_any(node.returns):
                found.append(f"{node.name} -> (line {node.lineno})")
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and _mentions_any(item.annotation):
                    found.append(f"{node.name}.{ast.unparse(item.target)} (line {item.lineno})")
    return found


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_any_on_the_rollout_path(path):
    found = any_annotations(path.read_text())
    assert not found, f"{path.relative_to(ROOT.parent)}: Any in " + ", ".join(found)


def test_the_check_sees_every_place_any_hides():
    source = """
from typing import Any
import typing

def f(a: Any, *args: list[Any], b: "dict[str, Any]" = None, **kw: int) -> typing.Any: ...

class C:
    x: int | Any
    y: int = 0
"""
    found = any_annotations(source)
    want = ["f(a)", "f(args)", "f(b)", "f ->", "C.x"]
    assert sorted(found) == sorted(f"{w} (line {8 if w == 'C.x' else 5})" for w in want)


def test_the_seams_are_protocols():
    from typing import Protocol

    from magic_jax.rollout.driver import RolloutDriver
    from magic_jax.rollout.protocols import Driver
    from magic_jax.run.stages import BatchSource
    from magic_jax.update.updater import PolicyUpdater, Updater

    for seam in (Driver, Updater, BatchSource):
        assert Protocol in seam.__mro__
    # the package's own implementations provide every method of their seam
    for impl, seam in ((RolloutDriver, Driver), (PolicyUpdater, Updater)):
        wanted = {n for n in vars(seam) if not n.startswith("_")}
        assert wanted <= set(dir(impl)), (impl, wanted - set(dir(impl)))
