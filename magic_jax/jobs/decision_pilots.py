"""Pilot runs of the decision world, declared as pilots: a declaration in, a pilots table out.

A pilot (``Pilot``, read from a YAML file by ``load_pilot``) names the world's
settings (``digits``, ``chain_share``: the stage-1 punishment's dose, ``check_rate``:
the base's habit, ``sft_steps``), the two stages' lengths, its seeds and its arms
(each a list of ``--set`` overrides of ``decision_world.run_config``). ``run_pilot``
builds the base once (``base/``), trains every arm x seed (``runs/ARM-sSEED/``, a
finished run is not run again) and writes ``pilots.json`` (the declaration, every
run's figures, each arm's summary) and ``pilots.md`` (the table): P(full-check
decisions) at stage 1's end (the decision probe's ``p_mean``), locked out (at most
``locked_out_below``) or learnable (at least ``learnable_above``), and whether stage 2
learned (final held-out chain accuracy at least ``learned_above``); each run's P at
every evaluation (``p_by_step``) for the figure of P over steps. ``--jobs N`` runs N
arm x seed runs at a time, each in a process of its own (``runs/ARM-sSEED.log``).
A declaration::

    name: dose-a
    seeds: [100, 101, 102]
    chain_share: 0.5          # half the problems punish a check in stage 1
    check_rate: 0.5
    stage1_steps: 150
    arms:
      - {name: none, overrides: [entropy.mode=fixed, entropy.init_coef=0.0]}
      - {name: held, overrides: [entropy.tokens=decision:decision, entropy.target=0.5]}
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# The decision tokens' entropy, held by the adaptive controller at a target below
# ln 2 = 0.69 (a coin flip): a pilot's knobs, with the bonus on the decision tokens only.
DECISION_ADAPTIVE = ("entropy.tokens=decision:decision", "entropy.target=0.5", "entropy.delta=0.01")
NO_BONUS = ("entropy.mode=fixed", "entropy.init_coef=0.0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PilotArm:
    """One arm of a pilot: a name and its ``--set`` overrides of the run config."""

    name: str
    overrides: tuple[str, ...] = ()


DEFAULT_ARMS = (
    PilotArm(name="none", overrides=NO_BONUS),
    PilotArm(name="adaptive-decision", overrides=DECISION_ADAPTIVE),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pilot:
    """A declared pilot of the decision world.

    Attributes:
      name: the pilot's label (letters, digits, ``-``, ``_``).
      seeds: the runs' seeds (distinct, >= 0); the base is built with ``base_seed``.
      digits / chain_share / check_rate / sft_steps: the base's build
        (``decision_world.DecisionBuildConfig``).
      build: further ``DecisionBuildConfig`` options (``train_problems``, ...).
      stage1_steps / stage2_steps / eval_every: the runs' stages; ``eval_every``
        divides both, so stage 1's end is evaluated.
      arms: the arms (unique names).
      locked_out_below / learnable_above: P thresholds of stage 1's end, in (0, 1).
      learned_above: final held-out chain accuracy that counts as learned, in (0, 1].
    """

    name: str
    seeds: tuple[int, ...]
    digits: int = 3
    chain_share: float = 0.5
    check_rate: float = 0.5
    sft_steps: int = 2400
    base_seed: int = 0
    build: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    stage1_steps: int = 150
    stage2_steps: int = 150
    eval_every: int = 25
    arms: tuple[PilotArm, ...] = DEFAULT_ARMS
    locked_out_below: float = 5e-5
    learnable_above: float = 1e-2
    learned_above: float = 0.5

    def __post_init__(self):
        if not self.name or not all(c.isalnum() or c in "-_" for c in self.name):
            raise ValueError(f"pilot name must be letters, digits, '-' or '_', got {self.name!r}")
        seeds = tuple(self.seeds)
        if (
            not seeds
            or len(set(seeds)) != len(seeds)
            or not all(isinstance(s, int) and s >= 0 for s in seeds)
        ):
            raise ValueError(
                f"pilot {self.name}: seeds must be distinct integers >= 0, got {seeds}"
            )
        for f in ("stage1_steps", "stage2_steps", "eval_every", "sft_steps"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                raise ValueError(
                    f"pilot {self.name}: {f} must be a positive integer, got {getattr(self, f)!r}"
                )
        if self.stage1_steps % self.eval_every or self.stage2_steps % self.eval_every:
            raise ValueError(
                f"pilot {self.name}: eval_every ({self.eval_every}) must divide stage1_steps "
                f"({self.stage1_steps}) and stage2_steps ({self.stage2_steps})"
            )
        for f in ("chain_share", "check_rate", "locked_out_below", "learnable_above"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"pilot {self.name}: {f} must be a number, got {v!r}")
        if isinstance(self.learned_above, bool) or not isinstance(self.learned_above, (int, float)):
            raise ValueError(f"pilot {self.name}: learned_above must be a number")
        for f in ("locked_out_below", "learnable_above"):
            if not 0.0 < getattr(self, f) < 1.0:
                raise ValueError(
                    f"pilot {self.name}: {f} must be in (0, 1), got {getattr(self, f)}"
                )
        if self.locked_out_below >= self.learnable_above:
            raise ValueError(f"pilot {self.name}: locked_out_below must be below learnable_above")
        if not 0.0 < self.learned_above <= 1.0:
            raise ValueError(
                f"pilot {self.name}: learned_above must be in (0, 1], got {self.learned_above}"
            )
        names = [a.name for a in self.arms]
        if not names or len(set(names)) != len(names) or not all(names):
            raise ValueError(f"pilot {self.name}: arms need distinct non-empty names, got {names}")
        try:
            self.build_config()
        except (TypeError, ValueError) as e:
            raise ValueError(f"pilot {self.name}: {e}") from None

    def build_config(self) -> Any:
        """The base's ``DecisionBuildConfig``."""
        from magic_jax.jobs.decision_world import DecisionBuildConfig

        return DecisionBuildConfig(
            seed=self.base_seed,
            digits=self.digits,
            chain_share=self.chain_share,
            check_rate=self.check_rate,
            sft_steps=self.sft_steps,
            **dict(self.build),
        )


def load_pilot(path: str | Path) -> Pilot:
    """A pilot declared in a YAML file: ``Pilot``'s fields, ``arms`` as a list of
    ``{name, overrides}``.

    Raises:
      ValueError: an unreadable file, an unknown key or a bad value, naming the file.
    """
    import yaml

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read the pilot: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a pilot is a mapping of Pilot's fields")
    known = {f.name for f in dataclasses.fields(Pilot)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
    try:
        if "arms" in raw:
            raw["arms"] = tuple(
                PilotArm(name=str(a["name"]), overrides=tuple(a.get("overrides", ())))
                for a in raw["arms"]
            )
        if "seeds" in raw:
            raw["seeds"] = tuple(raw["seeds"])
        return Pilot(**raw)
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


def _read_evals(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "eval.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run_figures(pilot: Pilot, evals: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's pilot figures from its ``eval.jsonl`` records.

    Raises:
      ValueError: stage 1's end or the last step was not evaluated.
    """
    by_step = {int(e["step"]): e for e in evals}
    total = pilot.stage1_steps + pilot.stage2_steps
    for step in (0, pilot.stage1_steps, total):
        if step not in by_step:
            raise ValueError(f"pilot {pilot.name}: no evaluation at step {step}")
    p0, p1 = (float(by_step[s]["probe"]["p_mean"]) for s in (0, pilot.stage1_steps))
    chain = float(by_step[total]["by_source"]["heldout-chain"])
    probe1 = by_step[pilot.stage1_steps]["probe"]
    return {
        "p_start": p0,
        "p_stage1_end": p1,
        "log10_p_stage1_end": math.log10(p1) if p1 > 0 else float("-inf"),
        "p_check_first_stage1_end": probe1.get("p_check_first"),
        "p_sequence_stage1_end": probe1.get("p_sequence_mean"),
        "expected_per_step_stage1_end": probe1["expected_per_step"],
        "locked_out": p1 <= pilot.locked_out_below,
        "learnable": p1 >= pilot.learnable_above,
        "chain_accuracy_final": chain,
        "p_by_step": {str(k): float(e["probe"]["p_mean"]) for k, e in sorted(by_step.items())},
        "learned": chain >= pilot.learned_above,
    }


def _summary(pilot: Pilot, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for arm in pilot.arms:
        rs = [r for r in runs if r["arm"] == arm.name]
        ps = sorted(r["p_stage1_end"] for r in rs)
        out.append(
            {
                "arm": arm.name,
                "runs": len(rs),
                "p_stage1_end_median": statistics.median(ps),
                "p_stage1_end_min": ps[0],
                "p_stage1_end_max": ps[-1],
                **{k: sum(r[k] for r in rs) for k in ("locked_out", "learnable", "learned")},
            }
        )
    return out


def _table(pilot: Pilot, summary: list[dict[str, Any]]) -> str:
    p = pilot
    head = [
        f"# Pilot {p.name} (declared as a pilot: excluded from any registered test)",
        "",
        f"digits {p.digits}, chain_share {p.chain_share}, check_rate {p.check_rate}, "
        f"sft_steps {p.sft_steps}, stages {p.stage1_steps} + {p.stage2_steps}, "
        f"seeds {list(p.seeds)}; locked out: P <= {p.locked_out_below:g}, learnable: "
        f"P >= {p.learnable_above:g}, learned: final chain accuracy >= {p.learned_above:g}",
        "",
        "| arm | runs | P at stage-1 end: median [min, max] | locked out | learnable "
        "| stage 2 learned |",
        "|---|---|---|---|---|---|",
    ]
    for s in summary:
        n = s["runs"]
        p_range = f"{s['p_stage1_end_min']:.3g}, {s['p_stage1_end_max']:.3g}"
        head.append(
            f"| {s['arm']} | {n} | {s['p_stage1_end_median']:.3g} [{p_range}] "
            f"| {s['locked_out']}/{n} | {s['learnable']}/{n} | {s['learned']}/{n} |"
        )
    return "\n".join(head) + "\n"


def _run_dir(out: Path, arm: PilotArm, seed: int) -> Path:
    return out / "runs" / f"{arm.name}-s{seed}"


def _finished(pilot: Pilot, run_dir: Path) -> bool:
    evals = _read_evals(run_dir)
    return bool(evals) and int(evals[-1]["step"]) >= pilot.stage1_steps + pilot.stage2_steps


def _train_one(pilot: Pilot, out: Path, arm: PilotArm, seed: int, train: Callable[[Any], None]):
    from magic_jax.jobs.decision_world import run_config

    cfg = run_config(
        out / "base",
        digits=pilot.digits,
        stage1_steps=pilot.stage1_steps,
        stage2_steps=pilot.stage2_steps,
        eval_every=pilot.eval_every,
        seed=seed,
        output_dir=_run_dir(out, arm, seed),
        overrides=arm.overrides,
    )
    train(cfg)


def _default_train(cfg: Any) -> None:
    from magic_jax.run.trainer import Trainer

    Trainer(cfg).run()


def _run_children(
    pending: list[tuple[PilotArm, int]],
    pilot_file: Path,
    out: Path,
    jobs: int,
    log: Callable[[str], None],
) -> None:
    """Runs each pending arm x seed as ``python -m ... --only ARM-sSEED``, ``jobs`` at a
    time, each child's output in ``runs/ARM-sSEED.log``.

    Raises:
      RuntimeError: a child failed, naming its run and its log (the others are finished).
    """
    import subprocess
    import sys
    import time

    queue = list(pending)
    running: list[tuple[str, subprocess.Popen, Any]] = []
    failed: list[str] = []
    (out / "runs").mkdir(parents=True, exist_ok=True)
    while queue or running:
        while queue and len(running) < jobs:
            arm, seed = queue.pop(0)
            label = f"{arm.name}-s{seed}"
            log_file = open(out / "runs" / f"{label}.log", "w")  # noqa: SIM115 (closed below)
            cmd = [
                sys.executable,
                "-m",
                "magic_jax.jobs.decision_pilots",
                str(pilot_file),
                "--out",
                str(out),
            ]
            log(f"[pilot] {label} (log: {log_file.name})")
            child = subprocess.Popen(
                [*cmd, "--only", label], stdout=log_file, stderr=subprocess.STDOUT
            )
            running.append((label, child, log_file))
        done = [r for r in running if r[1].poll() is not None]
        if not done:
            time.sleep(0.2)
        for label, child, log_file in done:
            running.remove((label, child, log_file))
            if child.returncode != 0:
                failed.append(f"{label} (exit {child.returncode}, log {log_file.name})")
            log_file.close()
    if failed:
        raise RuntimeError(f"pilot runs failed: {', '.join(failed)}")


def run_pilot(
    pilot: Pilot,
    out: str | Path,
    *,
    log: Callable[[str], None] = print,
    train: Callable[[Any], None] | None = None,
    jobs: int = 1,
    pilot_file: str | Path | None = None,
) -> dict[str, Any]:
    """Runs ``pilot`` under ``out`` and writes ``pilots.json`` and ``pilots.md``.

    Args:
      train: runs one ``TrainConfig`` (default: ``Trainer(cfg).run()``).
      jobs: runs at a time; above 1 each run is a child process of the pilot command
        reading ``pilot_file`` (the declaration ``pilot`` was read from).

    Returns:
      ``pilots.json``'s content: ``pilot`` (the declaration), ``runs``, ``summary``.
    """
    from magic_jax.jobs.decision_world import build_decision_world

    out = Path(out)
    if not (out / "base" / "build.json").exists():
        build_decision_world(out / "base", pilot.build_config(), log=log)
    pending = [
        (arm, seed)
        for arm in pilot.arms
        for seed in pilot.seeds
        if not _finished(pilot, _run_dir(out, arm, seed))
    ]
    if jobs > 1 and len(pending) > 1:
        if pilot_file is None:
            raise ValueError("run_pilot: jobs > 1 needs the pilot's file (pilot_file)")
        _run_children(pending, Path(pilot_file), out, jobs, log)
    else:
        for arm, seed in pending:
            log(f"[pilot {pilot.name}] {arm.name} seed {seed}")
            _train_one(pilot, out, arm, seed, train or _default_train)
    runs = [
        {"arm": arm.name, "seed": seed, **run_figures(pilot, _read_evals(_run_dir(out, arm, seed)))}
        for arm in pilot.arms
        for seed in pilot.seeds
    ]
    summary = _summary(pilot, runs)
    result = {"pilot": dataclasses.asdict(pilot), "runs": runs, "summary": summary}
    (out / "pilots.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "pilots.md").write_text(_table(pilot, summary))
    return result


def _only(pilot: Pilot, out: Path, label: str) -> None:
    """Runs the one arm x seed ``label`` (``ARM-sSEED``) of ``pilot``, whose base is built."""
    runs = {f"{a.name}-s{s}": (a, s) for a in pilot.arms for s in pilot.seeds}
    if label not in runs:
        raise ValueError(f"--only {label}: not a run of pilot {pilot.name} ({', '.join(runs)})")
    if not (out / "base" / "build.json").exists():
        raise ValueError(f"--only {label}: no base under {out / 'base'} (run the pilot first)")
    arm, seed = runs[label]
    if not _finished(pilot, _run_dir(out, arm, seed)):
        _train_one(pilot, out, arm, seed, _default_train)


def main(argv: list[str] | None = None) -> int:
    """``python -m magic_jax.jobs.decision_pilots PILOT.yaml --out DIR [--jobs N]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m magic_jax.jobs.decision_pilots",
        description="run a declared pilot of the decision world (pilots.json, pilots.md)",
    )
    parser.add_argument("pilot", help="the pilot's YAML declaration (docs/decision-world.md)")
    parser.add_argument("--out", required=True, help="directory: base/, runs/, the table")
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs at a time, each in its own process (default 1)"
    )
    parser.add_argument("--only", metavar="ARM-sSEED", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    try:
        pilot = load_pilot(args.pilot)
        if args.only:
            _only(pilot, Path(args.out), args.only)
            return 0
    except ValueError as e:
        parser.error(str(e))
    run_pilot(pilot, args.out, jobs=args.jobs, pilot_file=args.pilot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
