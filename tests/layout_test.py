"""The package's layout (docs/layout.md): each folder imports only its own floor or lower,
and no module grows past about 500 lines unless the map says why."""

import ast
import pathlib

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
# Shipped test helpers: they may build anything.
EXEMPT = {"magic_jax.testing", "magic_jax"}
# Modules allowed past 500 lines, with the reason docs/layout.md gives.
LONG = {}
MAX_LINES = 540


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


def test_every_folder_imports_only_its_floor_or_lower():
    modules = _modules()
    wrong = []
    for name, path in sorted(modules.items()):
        if name in EXEMPT:
            continue
        here = FLOORS[_folder(name)]
        for target in sorted(_imports(path) & set(modules)):
            if target in EXEMPT or target == "magic_jax":
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
