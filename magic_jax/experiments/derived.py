"""A new arm from the command line: a committed arm's runs with some options changed.

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
from collections.abc import Callable, Sequence
from pathlib import Path

from magic_jax.experiments import ablations
from magic_jax.experiments.arms import ABLATIONS, Arm
from magic_jax.experiments.progress import confirm, estimate_minutes
from magic_jax.experiments.results import is_done, raw_dir, results_dir, step_budget

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


def _check(where: Path, ab: str, arm: Arm, base: str, sets: Sequence[str]) -> None:
    """Refuses a bad option before any run (the config is loaded) and a reused name."""
    from magic_jax.run.config import load_config

    world = ABLATIONS[ab].world
    overrides = [*ablations.overrides_for(arm, 0, step_budget(), world), "output_dir=/tmp/x"]
    try:
        load_config(ablations.train_config(world), overrides)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--set {' '.join(sets)}: {e}") from e
    spec = {"from": base, "ablation": ab, "world": world, "set": list(sets)}
    path = where / "runs" / arm.key / "arm.json"
    if path.exists() and json.loads(path.read_text()) != spec:
        raise ValueError(
            f"--name {arm.key}: {path} already holds runs of {path.read_text().strip()}; "
            "choose another name"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, indent=1) + "\n")


def run_derived(
    base: str,
    name: str,
    sets: Sequence[str],
    seeds: Sequence[int],
    *,
    results: str | os.PathLike | None = None,
    yes: bool = False,
    dry_run: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Trains every missing seed of the arm ``base`` + ``sets`` named ``name``; returns the
    directory whose ``runs/<name>/seed<k>/`` hold them (``derived_dir``).

    Raises:
      KeyError: no arm ``base``.
      ValueError: a name already used (by a committed arm or another definition) or an
        option the run's config refuses.
      SystemExit: more than a few runs and nobody said yes (``progress.confirm``).
    """
    ab, arm = derive(base, name, sets)
    where, budget, world = derived_dir(results), step_budget(), ABLATIONS[ab].world
    _check(where, ab, arm, base, sets)
    todo = [s for s in seeds if not is_done(where, arm, s)]
    if todo:
        minutes = estimate_minutes([world] * len(todo), budget)
        log(f"[ablations] {name}: {len(todo)} run(s) to do in {where}, about {minutes:.0f} min")
        if not dry_run:
            confirm(len(todo), minutes, where, yes=yes)
    for seed in todo:
        if dry_run:
            cmd = ablations.train_command(arm, seed, raw_dir(where, arm, seed), budget, world=world)
            log(shlex.join(cmd))
            continue
        dest = ablations.run_one(ab, arm, seed, where, budget=budget, world=world, log=log)
        record = json.loads((dest / "run.json").read_text())
        record.update(rerun=command(base, name, sets, seed), derived_from=base)
        (dest / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    return where
