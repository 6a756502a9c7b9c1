"""The report's entropy-dynamics ablations: arms, worlds, a resumable runner.

Each (arm, seed) is an ordinary ``magic-jax train`` run of its world's config
(``configs/default.yaml``, the embedded default, or ``configs/carry.yaml``, the carry
world) with ``--set`` overrides, in its own directory under ``<results>/raw/`` (git-ignored:
checkpoints, TensorBoard files). When a run finishes, its records (``metrics.jsonl``,
``eval.jsonl``, ``config.yaml``; in the carry world also ``world.json``, the final
model's ``magic_jax.jobs.carry_world.world_statistics``) and a ``run.json`` (the command, the
wall time, the commit it ran at and whether the tree had uncommitted changes) are copied to
``<results>/runs/<arm>/seed<k>/``, the JSON lines gzip-compressed (``metrics.jsonl.gz``, a
seventh of the size): a small directory that
``magic_jax.jobs.report.load_run`` reads and that is committed. Runs already there are
skipped, and a run killed half-way resumes from its last checkpoint, so the set can be
built over several sessions::

    python -m magic_jax.experiments.ablations run --yes            # every missing (arm, seed)
    python -m magic_jax.experiments.ablations run --ablation temperature --seeds 0
    python -m magic_jax.experiments.ablations run --ablation staleness --seeds 0 --dry-run
    python -m magic_jax.experiments.ablations status
    python -m magic_jax.experiments.ablations pack                 # gzip records copied in plain
    python -m magic_jax.experiments.ablations run --from carry-clip-0.1 --name clip-0.4 \
        --set loss.eps_high=0.4 --seeds 0-4 --yes    # a new arm (experiments/derived.py)

More than a few missing runs (``progress.FEW``) start only with ``--yes``,
``MAGIC_JAX_NOTEBOOK_YES=1`` or a yes typed at a terminal (the SFT baselines too); each run
prints the path of its log, ``<results>/raw/<arm>/seed<k>.log``, and its progress: at a
terminal one line rewritten every 2 s, elsewhere (a notebook, a log) a line every 30 s.

A short budget for smoke runs (CI executes the notebooks this way):
``MAGIC_JAX_NOTEBOOK_STEPS=1`` runs every stage for that many steps, one seed per arm,
with results in ``<results>/budget-1/`` unless ``MAGIC_JAX_NOTEBOOK_RESULTS`` names a
directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from magic_jax.experiments.arms import (  # noqa: F401 (re-exported: the notebooks' API)
    ABLATIONS,
    CARRY_STAGE_STEPS,
    EVAL_OVERRIDES,
    RUN_OVERRIDES,
    SEEDS,
    SEEDS_CENTRAL,
    STAGE_STEPS,
    WORLDS,
    Ablation,
    Arm,
    World,
)
from magic_jax.experiments.prereg import late_runs, load_all
from magic_jax.experiments.progress import confirm, estimate_minutes
from magic_jax.experiments.results import (  # noqa: F401 (re-exported: the notebooks' API)
    RESULTS_ENV,
    STEPS_ENV,
    default_results,
    is_done,
    load_arm_runs,
    raw_dir,
    rerun_command,
    results_dir,
    step_budget,
    summary_dir,
    train_config,
)
from magic_jax.experiments.runner import (  # noqa: F401 (re-exported: the notebooks' API)
    PACKED,
    RECORD_FILES,
    WORLD_SAMPLES,
    measure_world,
    overrides_for,
    pack,
    pack_records,
    recorded_seconds,
    run_one,
    train_command,
)


def plan_runs(
    names: Sequence[str] | None = None,
    arms: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    budget: int | None = None,
) -> list[tuple[str, Arm, int]]:
    """(ablation, arm, seed) of every run asked for, seed-major (all arms' seed 0 first),
    each shared arm once; pending arms (``Arm.pending``) are left out, or refused when
    ``arms`` names them."""
    for n in names or ():
        if n not in ABLATIONS:
            raise KeyError(f"no ablation {n!r} (known: {', '.join(ABLATIONS)})")
    chosen = [ABLATIONS[n] for n in (names or ABLATIONS)]
    if arms:
        known = {a.key for ab in chosen for a in ab.arms}
        for a in arms:
            if a not in known:
                raise KeyError(
                    f"no arm {a!r} in {[ab.key for ab in chosen]} (arms: {sorted(known)})"
                )
    all_seeds = sorted({s for ab in chosen for s in ab.seeds})
    if seeds is None:
        seeds = all_seeds[:1] if budget is not None else all_seeds
    out, seen = [], set()
    for seed in seeds:
        for ab in chosen:
            if seed not in ab.seeds and budget is None and not arms:
                continue
            for arm in ab.arms:
                if (arms and arm.key not in arms) or (arm.key, seed) in seen:
                    continue
                if arm.pending:
                    if arms:
                        raise ValueError(f"{ab.key}/{arm.key} cannot run yet: {arm.pending}")
                    continue
                seen.add((arm.key, seed))
                out.append((ab.key, arm, seed))
    return out


def ensure(
    names: Sequence[str] | None = None,
    *,
    arms: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    results: str | os.PathLike | None = None,
    log: Callable[[str], None] = print,
    dry_run: bool = False,
    yes: bool = False,
) -> Path:
    """Runs every missing (ablation, arm, seed) asked for; returns the results directory.

    With ``MAGIC_JAX_NOTEBOOK_STEPS`` set, each stage runs that many steps and only the
    first seed is run (unless ``seeds`` says otherwise). With ``dry_run``, logs each
    missing run's ``magic-jax train`` command (its world's config as typed in a checkout)
    instead of running it. More than a few runs start only with ``yes``,
    ``$MAGIC_JAX_NOTEBOOK_YES=1`` or a terminal user's yes (``progress.confirm``).
    """
    budget = step_budget()
    where = results_dir(results)
    todo = [r for r in plan_runs(names, arms, seeds, budget) if not is_done(where, r[1], r[2])]
    if todo:
        minutes = estimate_minutes([ABLATIONS[ab].world for ab, _, _ in todo], budget)
        log(f"[ablations] {len(todo)} run(s) to do in {where}, about {minutes:.0f} min")
        if not dry_run:
            confirm(len(todo), minutes, where, yes=yes)
    for ab, arm, seed in todo:
        if dry_run:
            world = ABLATIONS[ab].world
            cmd = train_command(arm, seed, raw_dir(where, arm, seed), budget, world=world)
            log(shlex.join(cmd))
        else:
            run_one(ab, arm, seed, where, budget=budget, log=log)
    return where


def sft_path(results: Path, arm: Arm, seed: int) -> Path:
    """Where the supervised baseline matched to one run goes (committed with the runs)."""
    return results / "sft" / arm.key / f"seed{seed}.json"


def ensure_sft(
    ablation: str,
    arm: str,
    *,
    seeds: Sequence[int] | None = None,
    results: str | os.PathLike | None = None,
    log: Callable[[str], None] = print,
    yes: bool = False,
) -> dict[int, dict]:
    """Carry world: for every finished seed of ``arm`` (of ``seeds``, default all), supervised
    training continued from the base for the same seconds of training steps as that run
    (``world.sft_continuation``, same seed), made once and kept in
    ``<results>/sft/<arm>/seed<k>.json``; returns them by seed. More than a few missing ones
    start only when told, as runs do (``progress.confirm``)."""
    from magic_jax.jobs.carry_world import sft_continuation

    ab = ABLATIONS[ablation]
    if not WORLDS[ab.world].statistics:
        raise ValueError(f"{ablation}: a supervised baseline needs the carry world")
    where = results_dir(results)
    a = ab.arm(arm)
    done = [s for s in (ab.seeds if seeds is None else seeds) if is_done(where, a, s)]
    missing = [s for s in done if not sft_path(where, a, s).exists()]
    todo = {s: recorded_seconds(summary_dir(where, a, s), evals=False) for s in missing}
    if todo:
        # each takes its run's seconds of steps, plus about a minute to start and evaluate
        minutes = sum(todo.values()) / 60 + len(todo)
        log(f"[ablations] {len(todo)} SFT continuation(s) of {arm} to do, about {minutes:.0f} min")
        confirm(len(todo), minutes, where, yes=yes)
    out = {}
    for seed in done:
        dest = sft_path(where, a, seed)
        if seed in todo:
            seconds = todo[seed]
            log(f"[ablations] SFT continuation for {arm} seed {seed}: {seconds:.0f}s of steps")
            budget = step_budget()
            res = sft_continuation(seconds, seed=seed, num_samples=1 if budget else WORLD_SAMPLES)
            res = {"arm": arm, "seed": seed, "seconds": seconds, **res}
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(json.dumps(res, indent=1) + "\n")
        out[seed] = json.loads(dest.read_text())
    return out


# --------------------------------------------------------------------------- command line


def _status(results: Path) -> None:
    budget = step_budget()
    for ab, arm, seed in plan_runs(budget=budget):
        done = is_done(results, arm, seed)
        wall = ""
        if done:
            rec = json.loads((summary_dir(results, arm, seed) / "run.json").read_text())
            wall = f" ({rec.get('steps_and_evals_s') or 0:.0f}s of steps and evaluations)"
        print(f"{'done' if done else 'todo'}  {ab:16s} {arm.key:24s} seed {seed}{wall}")


def seed_list(text: str) -> list[int]:
    """``--seeds`` values: ``3`` or a range ``0-4`` (both ends included)."""
    first, _, last = text.partition("-")
    if not first.isdigit() or (last and not last.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a seed (3) or a range (0-4)")
    return list(range(int(first), int(last or first) + 1))


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
    """Trains every missing seed of the arm ``base`` + ``sets`` named ``name``
    (``experiments.derived``); returns the directory whose ``runs/<name>/seed<k>/`` hold them.

    Raises:
      KeyError: no arm ``base``.
      ValueError: a name already used (by a committed arm or another definition) or an
        option the run's config refuses (checked before any run).
      SystemExit: more than a few runs and nobody said yes (``progress.confirm``).
    """
    from magic_jax.experiments import derived
    from magic_jax.run.config import load_config

    ab, arm = derived.derive(base, name, sets)
    where, budget, world = derived.derived_dir(results), step_budget(), ABLATIONS[ab].world
    try:
        load_config(train_config(world), [*overrides_for(arm, 0, budget, world), "output_dir=x"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--set {' '.join(sets)}: {e}") from e
    spec = {"from": base, "ablation": ab, "world": world, "set": list(sets)}
    derived.keep_definition(where, arm, spec)
    todo = [s for s in seeds if not is_done(where, arm, s)]
    if todo:
        minutes = estimate_minutes([world] * len(todo), budget)
        log(f"[ablations] {name}: {len(todo)} run(s) to do in {where}, about {minutes:.0f} min")
        if not dry_run:
            confirm(len(todo), minutes, where, yes=yes)
    for seed in todo:
        if dry_run:
            log(
                shlex.join(train_command(arm, seed, raw_dir(where, arm, seed), budget, world=world))
            )
            continue
        dest = run_one(ab, arm, seed, where, budget=budget, world=world, log=log)
        record = json.loads((dest / "run.json").read_text())
        record.update(rerun=derived.command(base, name, sets, seed), derived_from=base)
        (dest / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    return where


def run_sweep(
    base: str,
    sets: Sequence[str],
    seeds: Sequence[int],
    *,
    results: str | os.PathLike | None = None,
    yes: bool = False,
    dry_run: bool = False,
    log: Callable[[str], None] = print,
) -> Path | None:
    """One derived arm of ``base`` per value of the one ``--set key=v1,v2,...`` (named
    ``<base>-<last part of key>-<value>``, the other ``--set`` in each), trained on ``seeds``
    like ``run_derived``, then compared with ``base`` (``compare.compare``) and drawn value
    by value (``sweep.png``); returns the comparison's directory (None for a dry run).

    Raises:
      ValueError: not exactly one option with several values, or what ``run_derived`` raises.
    """
    from magic_jax.experiments import compare, derived

    swept = [s for s in sets if "," in s.partition("=")[2]]
    if len(swept) != 1:
        raise ValueError("sweep: give exactly one --set KEY=V1,V2,... (the option swept)")
    key, _, values = swept[0].partition("=")
    fixed = [s for s in sets if s != swept[0]]
    points = [
        (f"{base}-{key.rsplit('.', 1)[-1]}-{v}", [*fixed, f"{key}={v}"]) for v in values.split(",")
    ]
    where, budget = derived.derived_dir(results), step_budget()
    todo = [
        (n, s)
        for n, sets_ in points
        for s in seeds
        if not is_done(where, derived.derive(base, n, sets_)[1], s)
    ]
    world = ABLATIONS[derived.find_arm(base)[0]].world
    if todo and not dry_run:
        confirm(len(todo), estimate_minutes([world] * len(todo), budget), where, yes=yes)
    for name, point in points:
        run_derived(base, name, point, seeds, results=results, yes=True, dry_run=dry_run, log=log)
    if dry_run:
        return None
    names = [base, *(n for n, _ in points)]
    png, text = compare.compare(names, results)
    compare.sweep_figure(base, key, compare.load(names, results)).savefig(
        png.with_name("sweep.png")
    )
    log(f"{text}\n[ablations] sweep of {key}: {png.parent}")
    return png.parent


def _run_derived(args: argparse.Namespace, seeds: list[int] | None) -> None:
    from magic_jax.experiments.derived import find_arm

    if not (args.base and args.name and args.set) or args.ablation or args.arm:
        raise ValueError("a new arm: --from ARM --name NEW --set KEY=VALUE, no --ablation/--arm")
    run_derived(
        args.base,
        args.name,
        args.set,
        seeds if seeds is not None else list(ABLATIONS[find_arm(args.base)[0]].seeds),
        results=args.results,
        yes=args.yes,
        dry_run=args.dry_run,
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m magic_jax.experiments.ablations", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train every missing (arm, seed)")
    r.add_argument("--ablation", action="append", help="only these ablations (repeatable)")
    r.add_argument("--arm", action="append", help="only these arms (repeatable)")
    r.add_argument("--seeds", type=seed_list, nargs="+", help="only these seeds (3 4, or 0-4)")
    r.add_argument("--from", dest="base", help="a new arm: this arm's runs with --set changes")
    r.add_argument("--name", help="the new arm's name (with --from)")
    r.add_argument("--set", action="append", default=[], help="key=value (with --from)")
    r.add_argument("--results", help="results directory (default notebooks/results)")
    r.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    r.add_argument("--yes", action="store_true", help="train more than a few runs unasked")
    w = sub.add_parser("sweep", help="a derived arm per value of one option, then compare")
    w.add_argument("--from", dest="base", required=True, help="the arm the values change")
    w.add_argument("--set", action="append", required=True, help="KEY=V1,V2,... and KEY=VALUE")
    w.add_argument("--seeds", type=seed_list, nargs="+", help="these seeds (default the base's)")
    for q in (w, c := sub.add_parser("compare", help="arms' panels, outcomes and exact tests")):
        q.add_argument("--results", help="results directory (default notebooks/results)")
    w.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    w.add_argument("--yes", action="store_true", help="train more than a few runs unasked")
    c.add_argument(
        "arms", nargs="+", help="arm keys, committed or derived; the first is the reference"
    )
    c.add_argument("--out", help="directory (default <results>/compare/<arms>)")
    t = sub.add_parser(
        "sft", help="carry world: supervised baseline for each finished seed of an arm"
    )
    t.add_argument("--ablation", required=True)
    t.add_argument("--arm", required=True)
    t.add_argument("--seeds", type=int, nargs="+", help="only these seeds")
    t.add_argument("--results", help="results directory (default notebooks/results)")
    t.add_argument("--yes", action="store_true", help="train more than a few unasked")
    s = sub.add_parser("status", help="which runs are done")
    s.add_argument("--results")
    k = sub.add_parser(
        "pack", help="gzip the plain JSON lines of runs copied in from an older checkout"
    )
    k.add_argument("--results")
    f = sub.add_parser("figures", help="one PNG per ablation and the summary table")
    f.add_argument("--results")
    f.add_argument("--out", default=None, help="figure directory (default <results>/../figures)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "run":
            seeds = [s for group in args.seeds for s in group] if args.seeds else None
        if args.cmd == "run" and (args.base or args.name or args.set):
            _run_derived(args, seeds)
        elif args.cmd == "run":
            ensure(
                args.ablation,
                arms=args.arm,
                seeds=seeds,
                results=args.results,
                dry_run=args.dry_run,
                yes=args.yes,
            )
        elif args.cmd == "sweep":
            from magic_jax.experiments.derived import find_arm

            seeds = [s for g in args.seeds for s in g] if args.seeds else None
            default = list(ABLATIONS[find_arm(args.base)[0]].seeds)
            opts = {"results": args.results, "yes": args.yes, "dry_run": args.dry_run}
            run_sweep(args.base, args.set, seeds or default, **opts)
        elif args.cmd == "compare":
            from magic_jax.experiments.compare import compare

            png, text = compare(args.arms, args.results, args.out)
            print(f"{text}\n[ablations] compare: {png} and {png.with_name('compare.md')}")
        elif args.cmd == "sft":
            opts = {"seeds": args.seeds, "results": args.results, "yes": args.yes}
            ensure_sft(args.ablation, args.arm, **opts)
        elif args.cmd == "status":
            _status(results_dir(args.results))
        elif args.cmd == "pack":
            print(f"{pack_records(results_dir(args.results))} record file(s) compressed")
        else:
            from magic_jax.experiments.ablation_report import write_figures

            where = results_dir(args.results)
            out = Path(args.out) if args.out else where.parent / "figures"
            print(write_figures(where, out))
            # a prospective claim's runs must follow its pre-registration
            for pre in load_all().values():
                if pre.status == "prospective":
                    for line in late_runs(pre, where):
                        print(f"warning: {pre.name}: {line}", file=sys.stderr)
    except (KeyError, ValueError, RuntimeError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
