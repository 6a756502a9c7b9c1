"""A new arm from the command line: a committed arm's runs with some options changed
(``ablations.run_derived`` trains it).

``python -m magic_jax.experiments.ablations run --from carry-clip-0.1 --name clip-0.4 --set
loss.eps_high=0.4 --seeds 0-4`` trains the arm ``clip-0.4``: ``carry-clip-0.1``'s world,
stages and overrides, then each ``--set`` (the last assignment of a key wins), with the same
step budget, evaluations and seeds as the committed arms, so its seed k pairs with theirs.
Its runs go to ``<results>/derived/`` (git-ignored): ``runs/<name>/seed<k>/`` as the
committed ones (``report.load_run`` reads them) and ``runs/<name>/arm.json``, the arm's
definition; a name keeps its definition (another ``--set`` under the same name is refused).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Sequence
from pathlib import Path

from magic_jax.experiments.arms import ABLATIONS, Arm
from magic_jax.experiments.results import results_dir

DERIVED = "derived"


def find_arm(key: str) -> tuple[str, Arm]:
    """The first ablation that has the arm ``key``, and the arm."""
    for ab in ABLATIONS.values():
        for arm in ab.arms:
            if arm.key == key:
                return ab.key, arm
    known = sorted({a.key for ab in ABLATIONS.values() for a in ab.arms})
    raise KeyError(f"--from {key}: no such arm (arms: {', '.join(known)})")


def derive(base: str, name: str, sets: Sequence[str]) -> tuple[str, Arm]:
    """``(ablation of base, the new arm)``: ``base``'s overrides followed by ``sets``."""
    ab, arm = find_arm(base)
    if any(a.key == name for x in ABLATIONS.values() for a in x.arms):
        raise ValueError(f"--name {name}: already a committed arm; choose another name")
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"--name {name!r}: expected a plain folder name")
    for s in sets:
        key = s.split("=", 1)[0]
        if "=" not in s or key in ("seed", "output_dir"):
            raise ValueError(f"--set {s}: expected key=value (not seed or output_dir)")
    label = f"{name} ({arm.label}; {', '.join(sets) or 'no change'})"
    return ab, Arm(name, label, (*arm.overrides, *sets), arm.stages, arm.pending)


def derived_dir(results: str | os.PathLike | None = None) -> Path:
    """Where derived arms' runs go: ``<results>/derived``."""
    return results_dir(results) / DERIVED


def command(base: str, name: str, sets: Sequence[str], seed: int) -> str:
    """The shell command that (re)builds one seed of a derived arm."""
    args = ["python", "-m", "magic_jax.experiments.ablations", "run", "--from", base]
    args += ["--name", name, *(x for s in sets for x in ("--set", s)), "--seeds", str(seed)]
    return shlex.join(args)


def keep_definition(where: Path, arm: Arm, spec: dict) -> None:
    """Records a derived arm's definition as ``<where>/runs/<name>/arm.json``.

    Raises:
      ValueError: the name already holds runs of another definition.
    """
    path = where / "runs" / arm.key / "arm.json"
    if path.exists() and json.loads(path.read_text()) != spec:
        raise ValueError(
            f"--name {arm.key}: {path} already holds runs of {path.read_text().strip()}; "
            "choose another name"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, indent=1) + "\n")
