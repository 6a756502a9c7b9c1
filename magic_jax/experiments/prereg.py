"""Pre-registrations: one YAML file per claim under ``notebooks/prereg/``, and where each
run's code came from.

A file (``notebooks/prereg/<claim>.yaml``) holds::

    claim: the claim, in words
    world: carry                      # the world its arms run in
    status: prospective               # or retrospective: written after its runs
    arms: [carry-none, carry-adaptive-0.08]
    seeds: [0, 1, 2, 3, 4]
    primary_endpoint: {measure: final accuracy, arms: [a, b], direction: greater, test: welch}
    predictions:                      # each: a minus b in measure
      - {measure: late entropy, arms: [a, b], direction: greater}
      - {measure: final accuracy, arms: [a, b], direction: same, tolerance: 0.02}
    tests: {final accuracy: welch}    # or one name for every measure; "default" as a key
    correction: holm
    notes: what was fixed before the runs, and how

Optional keys: ``ablation`` (the key in ``experiments.arms.ABLATIONS`` it judges),
``measure_changes`` (a list of {measure, first_declared, commit, note}: a measure chosen
after the runs, the one first declared, and the commit that changed it), and a ``note``
on a prediction. ``arms: [a, null]`` compares ``a`` with 0.

The pre-registration commit of a file is the commit that first added it
(``git log --diff-filter=A``). A run records the commit it ran at in its ``run.json``
(``commit``, ``dirty``); for runs made before that, ``run_origin`` derives it from the
history: the newest commit before the run started (its ``finished`` time minus its
``wall_s``), and the commit that added its ``run.json``.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from magic_jax.experiments.checks import Check

STATUSES = ("prospective", "retrospective")
DIRECTIONS = {"greater": +1, "less": -1, "same": 0}
TESTS = ("welch", "mann-whitney", "wilcoxon-paired")
CORRECTIONS = ("holm",)
REQUIRED = (
    "claim",
    "world",
    "status",
    "arms",
    "seeds",
    "primary_endpoint",
    "predictions",
    "tests",
    "correction",
    "notes",
)


class PreregError(ValueError):
    """A pre-registration file that does not follow the schema (names the file and key)."""


@dataclasses.dataclass(frozen=True)
class Prediction:
    """``arms[0]`` minus ``arms[1]`` (None: 0) in ``measure`` is ``direction`` (greater,
    less, or the same within ``tolerance``)."""

    measure: str
    arms: tuple[str, str | None]
    direction: str
    tolerance: float = 0.0
    test: str | None = None
    note: str = ""

    def check(self, measure: str | None = None) -> Check:
        """The prediction as a ``verdicts.Check`` (in ``measure`` if given)."""
        return Check(
            measure or self.measure,
            self.arms[1],
            self.arms[0],
            DIRECTIONS[self.direction],
            self.tolerance,
        )


@dataclasses.dataclass(frozen=True)
class MeasureChange:
    """A measure chosen after the runs: ``measure`` (now used) replaced ``first_declared``
    in ``commit``."""

    measure: str
    first_declared: str
    commit: str
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Prereg:
    """One claim's pre-registration (``load``)."""

    path: Path
    claim: str
    world: str
    status: str
    arms: tuple[str, ...]
    seeds: tuple[int, ...]
    primary: Prediction
    predictions: tuple[Prediction, ...]
    tests: Mapping[str, str]
    correction: str
    notes: str
    ablation: str | None = None
    measure_changes: tuple[MeasureChange, ...] = ()

    @property
    def name(self) -> str:
        return self.path.stem

    def test_for(self, measure: str) -> str:
        """The test declared for ``measure`` (``tests[measure]``, else ``tests['default']``)."""
        return self.tests.get(measure) or self.tests["default"]

    def first_declared(self, measure: str) -> str:
        """The measure first declared in place of ``measure`` (itself if never changed)."""
        for c in self.measure_changes:
            if c.measure == measure:
                return c.first_declared
        return measure


def _fail(path: Path, key: str, why: str) -> PreregError:
    return PreregError(f"{path}: {key}: {why}")


def _text(path: Path, key: str, v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise _fail(path, key, f"expected non-empty text, got {v!r}")
    return v.strip()


def _prediction(path: Path, key: str, d: Any, tests: Mapping[str, str]) -> Prediction:
    if not isinstance(d, dict):
        raise _fail(path, key, f"expected a mapping, got {d!r}")
    measure = _text(path, f"{key}.measure", d.get("measure"))
    arms = d.get("arms")
    if not (isinstance(arms, list) and len(arms) == 2 and isinstance(arms[0], str)):
        raise _fail(path, f"{key}.arms", f"expected [arm, arm or null], got {arms!r}")
    if arms[1] is not None and not isinstance(arms[1], str):
        raise _fail(path, f"{key}.arms", f"expected an arm name or null, got {arms[1]!r}")
    direction = d.get("direction")
    if direction not in DIRECTIONS:
        raise _fail(
            path, f"{key}.direction", f"expected one of {list(DIRECTIONS)}, got {direction!r}"
        )
    tol = d.get("tolerance", 0.0)
    if direction == "same" and not (isinstance(tol, int | float) and tol > 0):
        raise _fail(path, f"{key}.tolerance", f"'same' needs a tolerance > 0, got {tol!r}")
    test = d.get("test")
    if test is not None and test not in TESTS:
        raise _fail(path, f"{key}.test", f"expected one of {list(TESTS)}, got {test!r}")
    if test is None and measure not in tests and "default" not in tests:
        raise _fail(path, f"{key}.test", f"no test declared for {measure!r} (see 'tests')")
    return Prediction(
        measure, (arms[0], arms[1]), direction, float(tol), test, str(d.get("note", ""))
    )


def _tests(path: Path, v: Any) -> dict[str, str]:
    """``tests`` as {measure or 'default': test}: one name, {measure: test},
    {test: [measures]}, or a list of {measure, test}."""
    if isinstance(v, str) or (isinstance(v, list) and len(v) == 1 and isinstance(v[0], str)):
        v = {"default": v if isinstance(v, str) else v[0]}
    elif isinstance(v, dict) and v and all(k in TESTS for k in v):
        # {test: [measures]} (or {test: measure}): inverted
        inv: dict[str, Any] = {}
        for test, ms in v.items():
            for m in [ms] if isinstance(ms, str) else list(ms or []):
                inv[str(m)] = test
        v = inv
    elif isinstance(v, list):
        if not all(isinstance(x, dict) and {"measure", "test"} <= set(x) for x in v):
            raise _fail(path, "tests", "a list of tests needs {measure, test} items")
        v = {x["measure"]: x["test"] for x in v}
    if not isinstance(v, dict) or not v:
        raise _fail(path, "tests", f"expected a test name, a mapping or a list, got {v!r}")
    for measure, test in v.items():
        if test not in TESTS:
            raise _fail(path, f"tests.{measure}", f"expected one of {list(TESTS)}, got {test!r}")
    return {str(k): str(t) for k, t in v.items()}


def _changes(path: Path, v: Any) -> tuple[MeasureChange, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise _fail(path, "measure_changes", f"expected a list, got {v!r}")
    out = []
    for i, d in enumerate(v):
        key = f"measure_changes[{i}]"
        if not isinstance(d, dict):
            raise _fail(path, key, f"expected a mapping, got {d!r}")
        out.append(
            MeasureChange(
                _text(path, f"{key}.measure", d.get("measure")),
                _text(path, f"{key}.first_declared", d.get("first_declared")),
                _text(path, f"{key}.commit", d.get("commit")),
                str(d.get("note", "")),
            )
        )
    return tuple(out)


def parse(path: str | Path, data: Any) -> Prereg:
    """Validates one file's parsed YAML.

    Raises:
      PreregError: a missing or malformed key (the message names the file and the key).
    """
    path = Path(path)
    if not isinstance(data, dict):
        raise _fail(path, "(top)", f"expected a mapping, got {type(data).__name__}")
    for key in REQUIRED:
        if key not in data:
            raise _fail(path, key, "missing")
    if data["status"] not in STATUSES:
        raise _fail(path, "status", f"expected one of {list(STATUSES)}, got {data['status']!r}")
    if data["correction"] not in CORRECTIONS:
        raise _fail(path, "correction", f"expected one of {list(CORRECTIONS)}")
    arms = data["arms"]
    if not (isinstance(arms, list) and arms and all(isinstance(a, str) for a in arms)):
        raise _fail(path, "arms", f"expected a list of arm names, got {arms!r}")
    seeds = data["seeds"]
    if not (isinstance(seeds, list) and seeds and all(type(s) is int for s in seeds)):
        raise _fail(path, "seeds", f"expected a list of integers, got {seeds!r}")
    tests = _tests(path, data["tests"])
    primary = _prediction(path, "primary_endpoint", data["primary_endpoint"], tests)
    preds = data["predictions"]
    if not isinstance(preds, list) or not preds:
        raise _fail(path, "predictions", "expected a non-empty list")
    predictions = tuple(
        _prediction(path, f"predictions[{i}]", d, tests) for i, d in enumerate(preds)
    )
    for key, p in [("primary_endpoint", primary)] + [
        (f"predictions[{i}]", p) for i, p in enumerate(predictions)
    ]:
        for a in p.arms:
            if a is not None and a not in arms:
                raise _fail(path, f"{key}.arms", f"{a!r} is not among 'arms'")
    return Prereg(
        path,
        _text(path, "claim", data["claim"]),
        _text(path, "world", data["world"]),
        data["status"],
        tuple(arms),
        tuple(seeds),
        primary,
        predictions,
        tests,
        data["correction"],
        str(data["notes"] or ""),
        data.get("ablation"),
        _changes(path, data.get("measure_changes")),
    )


def load(path: str | Path) -> Prereg:
    """Reads and validates one pre-registration file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise PreregError(f"{path}: not YAML: {e}") from e
    return parse(path, data)


def prereg_dir() -> Path:
    """``notebooks/prereg`` of the checkout this package sits in."""
    return Path(__file__).resolve().parents[2] / "notebooks" / "prereg"


def load_all(where: str | Path | None = None) -> dict[str, Prereg]:
    """Every ``*.yaml`` of ``where`` (default ``prereg_dir()``), by file stem."""
    d = Path(where) if where is not None else prereg_dir()
    return {p.stem: load(p) for p in sorted(d.glob("*.yaml"))}


def for_ablation(ablation: str, where: str | Path | None = None) -> Prereg | None:
    """The pre-registration whose ``ablation`` is ``ablation`` (None without one)."""
    return next((p for p in load_all(where).values() if p.ablation == ablation), None)


# --------------------------------------------------------------------------- git


def git(args: Sequence[str], cwd: str | Path | None = None) -> str | None:
    """``git <args>``'s stdout in ``cwd`` (default: this package's checkout); None when git
    fails (not a checkout, no git)."""
    where = Path(cwd) if cwd is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", *args], cwd=where, capture_output=True, text=True, check=False, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def head_state(cwd: str | Path | None = None) -> dict[str, Any]:
    """``{"commit": HEAD's hash or None, "dirty": whether tracked files differ from it}``:
    what a new run records in its ``run.json``."""
    head = git(["rev-parse", "HEAD"], cwd)
    status = git(["status", "--porcelain", "--untracked-files=no"], cwd)
    return {
        "commit": head.strip() if head else None,
        "dirty": bool(status.strip()) if status is not None else None,
    }


def added_in(path: str | Path, *, first: bool = True) -> str | None:
    """The commit that added ``path`` (the first one, or with ``first`` False the newest);
    None if it was never committed."""
    p = Path(path).resolve()
    out = git(["log", "--diff-filter=A", "--format=%H", "--", p.name], p.parent)
    shas = (out or "").split()
    return (shas[-1] if first else shas[0]) if shas else None


def is_ancestor(older: str, newer: str, cwd: str | Path | None = None) -> bool:
    """Whether ``older`` is ``newer`` or one of its ancestors."""
    return git(["merge-base", "--is-ancestor", older, newer], cwd) is not None


@functools.cache
def _history(top: str) -> tuple[tuple[int, str], ...]:
    """(commit time, hash) of HEAD's history, newest first."""
    out = git(["log", "--format=%ct %H"], top) or ""
    return tuple((int(t), h) for t, h in (line.split() for line in out.splitlines()))


@functools.cache
def _run_json_additions(top: str) -> dict[str, str]:
    """{path of a run.json relative to the checkout: newest commit that added it}."""
    out = git(["log", "--diff-filter=A", "--format=C %H", "--name-only", "--", "*/run.json"], top)
    found: dict[str, str] = {}
    sha = ""
    for line in (out or "").splitlines():
        if line.startswith("C "):
            sha = line[2:].strip()
        elif line.strip():
            found.setdefault(line.strip(), sha)
    return found


@dataclasses.dataclass(frozen=True)
class RunOrigin:
    """Where a run's code came from.

    Attributes:
      commit: the commit it ran at (recorded, or derived), None if unknown.
      dirty: whether its tree had uncommitted changes (None: not recorded).
      recorded: whether ``commit`` comes from the run's own ``run.json``.
      committed_in: the commit that added its ``run.json`` (None: not committed).
    """

    commit: str | None
    dirty: bool | None
    recorded: bool
    committed_in: str | None


def _started(rec: Mapping[str, Any]) -> int | None:
    if not rec.get("finished"):
        return None
    end = datetime.datetime.fromisoformat(rec["finished"]).timestamp()
    return int(end - float(rec.get("wall_s") or 0.0))


def run_origin(run_dir: str | Path) -> RunOrigin:
    """The commit a run ran at: ``run.json``'s ``commit`` if recorded, else the newest
    commit of HEAD's history before the run started."""
    run_dir = Path(run_dir).resolve()
    top = (git(["rev-parse", "--show-toplevel"], run_dir) or "").strip()
    rec = json.loads((run_dir / "run.json").read_text())
    rel = str((run_dir / "run.json").relative_to(top)) if top else ""
    committed = _run_json_additions(top).get(rel) if top else None
    if rec.get("commit"):
        return RunOrigin(rec["commit"], rec.get("dirty"), True, committed)
    start = _started(rec)
    derived = None
    if top and start is not None:
        derived = next((h for t, h in _history(top) if t <= start), None)
    return RunOrigin(derived, None, False, committed)


def late_runs(pre: Prereg, results: str | Path) -> list[str]:
    """The runs of ``pre``'s arms and seeds under ``<results>/runs`` not made at or after
    its pre-registration commit (each as a line saying why); [] when every one was. A run
    with uncommitted changes (``dirty``) counts by its commit: the table shows the flag."""
    runs = [
        d
        for arm in pre.arms
        for seed in pre.seeds
        if (d := Path(results) / "runs" / arm / f"seed{seed}").joinpath("run.json").exists()
    ]
    if not runs:
        return []
    reg = added_in(pre.path)
    if reg is None:
        return [f"{d}: {pre.path} is not committed" for d in runs]
    out = []
    for d in runs:
        o = run_origin(d)
        if o.commit is None:
            out.append(f"{d}: no commit recorded or derived")
        elif not is_ancestor(reg, o.commit, pre.path.parent):
            out.append(f"{d}: ran at {o.commit[:7]}, before the pre-registration {reg[:7]}")
    return out
