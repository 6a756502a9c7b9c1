"""The package's layout (docs/layout.md): each folder imports only its own floor or lower,
no import cycle, no module past about 500 lines, no function past 80 lines of code
unless the map says why, and nothing private used across modules."""

import ast
import io
import pathlib
import tokenize

import magic_jax

ROOT = pathlib.Path(magic_jax.__file__).parent

# Floors, bottom up: a module may import its own folder and the folders of lower floors.
FLOORS = {
    "foundation": 0,  # storage, distributed, compile_cache (top-level modules)
    "rewards": 0,
    "model": 1,
    "data": 1,
    "update": 2,
    "rollout": 3,
    "run": 4,
    "jobs": 5,
    "experiments": 6,
}
# The package's lazy ``__init__``: it may name anything (and imports nothing at import time).
EXEMPT = {"magic_jax"}
# Modules allowed past 500 lines, with the reason docs/layout.md gives.
LONG = {}
MAX_LINES = 540
# Functions allowed past MAX_FUNCTION_LINES lines of code, with the reason docs/layout.md gives.
LONG_FUNCTIONS = {}
MAX_FUNCTION_LINES = 80
# ``Any`` named in run/, all modules together: a ratchet, lowered as types are named (212
# before mypy checked the package in CI; 118 after; 10 once the rest were named, with
# ``rundir.JSON``, ``channel.Body`` and ``storage.StoragePath`` each naming one Any). Only JSON
# rows, optax's state and storage paths (etils ships no types) are meant to keep one.
RUN_ANY_MAX = 10


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _folder(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 2 and parts[1] not in FLOORS:
        return "foundation"
    return parts[1]


def _imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:``, which never run."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def _runtime_imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports when it runs, imports inside functions included."""
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found & modules - EXEMPT


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a path (first module repeated at its end), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str]:
        state[name] = 1
        path.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[name] = 2
        return []

    for name in sorted(graph):
        if name not in state and (found := visit(name)):
            return found
    return []


def _code_lines(source: str) -> set[int]:
    """Line numbers holding code: not blank, not only a comment (a string's every line counts)."""
    lines = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip and tok.type != tokenize.ENDMARKER:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function, methods and nested functions included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _functions(node, f"{name}.")
        else:
            yield from _functions(node, prefix)


def function_lengths(path: pathlib.Path) -> dict[str, int]:
    """Lines of code of each function in ``path``: its signature and body, without its
    docstring, blank lines and comment lines."""
    source = path.read_text()
    code = _code_lines(source)
    out = {}
    for name, node in _functions(ast.parse(source)):
        lines = set(range(node.lineno, node.end_lineno + 1)) & code
        if ast.get_docstring(node, clean=False) is not None:
            doc = node.body[0]
            lines -= set(range(doc.lineno, doc.end_lineno + 1))
        out[name] = len(lines)
    return out


def test_every_folder_imports_only_its_floor_or_lower():
    modules = _modules()
    wrong = []
    for name, path in sorted(modules.items()):
        if name in EXEMPT:
            continue
        here = FLOORS[_folder(name)]
        for target in sorted(_imports(path) & set(modules)):
            if target in EXEMPT:
                continue
            if FLOORS[_folder(target)] > here:
                wrong.append(f"{name} ({_folder(name)}) imports {target} ({_folder(target)})")
    assert not wrong, "\n".join(wrong)


def test_every_module_sits_in_a_known_folder():
    unknown = {n for n in _modules() if n.count(".") >= 2 and n.split(".")[1] not in FLOORS}
    assert not unknown


def test_modules_stay_short():
    long = {
        name: n
        for name, path in _modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES and name not in LONG
    }
    assert not long, f"modules over {MAX_LINES} lines: {long} (split them, or say why in LONG)"


def test_no_import_cycle():
    """Imports inside functions count: a cycle through one still ties the modules together."""
    modules = _modules()
    names = set(modules)
    graph = {
        name: _runtime_imports(path, names) - {name}
        for name, path in modules.items()
        if name not in EXEMPT
    }
    cycle = _cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_reports_the_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_functions_fit_on_a_screen():
    long = {}
    for name, path in sorted(_modules().items()):
        for function, n in function_lengths(path).items():
            if n > MAX_FUNCTION_LINES and f"{name}.{function}" not in LONG_FUNCTIONS:
                long[f"{name}.{function}"] = n
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines of code: {long} "
        "(split them, or say why in LONG_FUNCTIONS and docs/layout.md)"
    )


def test_long_functions_are_listed_in_the_map():
    doc = (ROOT.parent / "docs" / "layout.md").read_text()
    lengths = {
        f"{name}.{function}": n
        for name, path in _modules().items()
        for function, n in function_lengths(path).items()
    }
    missing = [f for f in LONG_FUNCTIONS if f.removeprefix("magic_jax.") not in doc]
    assert not missing, f"docs/layout.md does not list {missing}"
    short = [f for f in LONG_FUNCTIONS if lengths.get(f, 0) <= MAX_FUNCTION_LINES]
    assert not short, f"listed in LONG_FUNCTIONS but gone or short enough now: {short}"


def test_function_length_counts_code_only(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        'def f(\n    a,\n):\n    """Doc.\n\n    More.\n    """\n\n    # why\n'
        '    x = """\n\n"""\n    return a\n'
    )
    assert function_lengths(f) == {"f": 7}


def any_count(source: str) -> int:
    """How many times ``source`` names ``Any`` (``Any`` or ``typing.Any``; imports aside)."""
    return sum(
        1
        for node in ast.walk(ast.parse(source))
        if (isinstance(node, ast.Name) and node.id == "Any")
        or (isinstance(node, ast.Attribute) and node.attr == "Any")
    )


def test_any_count_reads_names_not_imports():
    source = (
        "import typing\nfrom typing import Any\n"
        "x: Any\ndef f(a: typing.Any) -> dict[str, Any]: ...\n"
    )
    assert any_count(source) == 3


def test_any_in_run_does_not_grow():
    counts = {p.name: any_count(p.read_text()) for p in sorted((ROOT / "run").glob("*.py"))}
    total = sum(counts.values())
    print(f"Any in run/: {total} ({', '.join(f'{k} {v}' for k, v in counts.items() if v)})")
    assert total <= RUN_ANY_MAX, (
        f"{total} Any in run/, more than {RUN_ANY_MAX}: name the types ({counts})"
    )


def test_no_fmt_skip():
    marked = [
        f"{path.relative_to(ROOT.parent)}:{i}"
        for path in sorted(ROOT.rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert not marked, f"format these normally: {marked}"


def _module_aliases(tree: ast.AST, modules: set[str]) -> dict[str, str]:
    """Local names bound to package modules (``import magic_jax.x as m``,
    ``from magic_jax import x``)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if f"{node.module}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses_in(name: str, text: str, names: set[str]) -> list[str]:
    tree = ast.parse(text)
    aliases = _module_aliases(tree, names)

    def other_module(node: ast.AST) -> str | None:
        target = ast.unparse(node)
        module = aliases.get(target, target if target in names else None)
        return module if module != name else None

    wrong = []
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.module in names and node.module != name:
            wrong += [
                f"{where} imports {node.module}.{a.name}" for a in node.names if _private(a.name)
            ]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if module := other_module(node.value):
                wrong.append(f"{where} uses {module}.{node.attr}")
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "setattr"):
            obj, attr, *_ = [*node.args, None, None]
            private = isinstance(attr, ast.Constant) and _private(str(attr.value))
            if private and obj is not None and (module := other_module(obj)):
                wrong.append(f"{where} uses {module}.{attr.value}")
    return wrong


def private_uses(sources: dict[str, str]) -> list[str]:
    """Where a module imports, reads or ``getattr``s another package module's private name
    (``sources``: module name -> its text)."""
    return [
        w
        for name, text in sorted(sources.items())
        for w in _private_uses_in(name, text, set(sources))
    ]


def test_private_uses_are_found():
    sources = {
        "magic_jax.a": "_x = 1\ny = _x\n",
        "magic_jax.b": "from magic_jax.a import _x\n",
        "magic_jax.c": "def f():\n    from magic_jax import a\n    return a._x\n",
        "magic_jax.d": "import magic_jax.a as m\nv = getattr(m, '_x')\nw = m.y\n",
    }
    assert private_uses(sources) == [
        "magic_jax.b:1 imports magic_jax.a._x",
        "magic_jax.c:3 uses magic_jax.a._x",
        "magic_jax.d:2 uses magic_jax.a._x",
    ]


def test_nothing_private_used_across_modules():
    wrong = private_uses({name: path.read_text() for name, path in _modules().items()})
    assert not wrong, "private names used across modules:\n" + "\n".join(wrong)
