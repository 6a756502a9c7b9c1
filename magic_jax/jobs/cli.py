"""The ``magic-jax`` command line: training, evaluation, difficulty, reports, checkpoints."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from magic_jax.jobs import convert as convert_job

# The commands every host of a multi-host job runs (under jax.distributed, with a mesh).
MULTI_HOST = ("train", "convert", "export", "eval", "estimate-difficulty")
# The commands that keep XLA's compiled programs on disk for the next run.
COMPILE_CACHED = ("train", "demo", "build-default", "build-world", "eval", "estimate-difficulty")


def _export(args: argparse.Namespace) -> int:
    import jax

    from magic_jax import storage
    from magic_jax.model.convert import save_hf
    from magic_jax.model.sharding import mesh_from_text
    from magic_jax.run.checkpoint import CHECKPOINTS, latest_good_checkpoint, load_model

    t0 = time.perf_counter()
    storage.check(args.ckpt, what="ckpt")
    storage.check(args.out, what="out")
    ckpt = storage.path(args.ckpt)
    if (ckpt / CHECKPOINTS).is_dir():  # a run directory: its newest good checkpoint
        found = latest_good_checkpoint(ckpt, log=lambda s: print(s, file=sys.stderr))
        if found is None:
            raise FileNotFoundError(f"{ckpt}: the run has no checkpoint yet")
        ckpt = found
    model = load_model(ckpt, mesh=mesh_from_text(args.mesh))
    with storage.staged(args.out, upload=jax.process_index() == 0) as local:
        save_hf(model, local, dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * 2**30))
    out = args.out
    print(f"exported {ckpt} -> {out} ({args.dtype}) in {time.perf_counter() - t0:.1f}s")
    return 0


def _demo(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from magic_jax.jobs.demo import compare_sft, run_default

    sets = [f"output_dir={args.workdir}", f"seed={args.seed}", *(args.set or ())]
    summary = run_default(sets)
    out = Path(summary["output_dir"])
    if args.compare_sft and "accuracy_after" in summary:
        sft = compare_sft(summary["model"], summary["wall_s"], seed=args.seed)
        row = {
            "seed": args.seed,
            "before": summary["accuracy_before"],
            "after": summary["accuracy_after"],
            "sft_continuation": sft["after"]["accuracy"],
            "wall_s": summary["wall_s"],
            "sft": sft,
        }
        (out / "compare_sft.json").write_text(json.dumps(row, indent=2) + "\n")
        print(
            f"[compare] seed {args.seed}: MAGIC {row['before']:.3f} -> {row['after']:.3f}, "
            f"SFT continuation for the same {row['wall_s']:.0f}s -> {row['sft_continuation']:.3f}"
        )
    return 0


def _default_config() -> str:
    from magic_jax.jobs.default_world import CONFIG_FILE

    return str(CONFIG_FILE)


def _build_default(args: argparse.Namespace) -> int:
    from magic_jax.jobs.default_world import BuildConfig, build_default

    build_default(args.out, BuildConfig(seed=args.seed))
    return 0


def _build_world(args: argparse.Namespace) -> int:
    from magic_jax.jobs import carry_world, decision_world, lockout_world

    worlds: dict[str, tuple[Any, Any]] = {
        "carry": (carry_world.build_carry_world, carry_world.WorldBuildConfig),
        "lockout": (lockout_world.build_lockout_world, lockout_world.LockoutBuildConfig),
        "decision": (decision_world.build_decision_world, decision_world.DecisionBuildConfig),
    }
    build, config = worlds[args.world]
    build(args.out, config(seed=args.seed))
    return 0


def _prepare_data(args: argparse.Namespace) -> int:
    from magic_jax.data.sources import prepare_dataset

    t0 = time.perf_counter()
    out = prepare_dataset(args.rows, args.out)
    print(f"prepared {out} in {time.perf_counter() - t0:.1f}s (data.train: {args.out})")
    return 0


def _train(args: argparse.Namespace) -> int:
    from magic_jax.jobs import hosts
    from magic_jax.run.config import load_config
    from magic_jax.run.rundir import STOP_EXIT_CODES
    from magic_jax.run.trainer import Trainer

    if args.stop_after is not None and args.stop_after <= 0:
        raise ValueError(f"--stop-after {args.stop_after}: must be a positive number of steps")
    if args.profile_steps is not None:  # as a string: YAML reads 3:5 as a number (185)
        args.set = [*(args.set or ()), f"profile_steps={json.dumps(args.profile_steps)}"]
    if args.config is None and args.stop_after is None:  # the embedded default
        from magic_jax.jobs.demo import run_default

        summary = run_default(args.set or ())
    else:
        shown = None if args.config else "configs/default.yaml"  # as --help names it
        config = load_config(args.config or _default_config(), args.set or (), name=shown)
        hosts.RUN_DIR[0] = config.output_dir
        if config.mesh is not None and config.rollout.hosts is None:
            hosts.start()
        summary = Trainer(config).run(stop_after=args.stop_after)
    stopped = summary.get("stopped_by")
    return 0 if stopped is None else STOP_EXIT_CODES[getattr(signal, stopped)]


def _status(args: argparse.Namespace) -> int:
    from magic_jax.jobs.status import format_status, run_status

    info = run_status(args.run_dir)
    print(json.dumps(info, indent=1) if args.json else format_status(info))
    return 0


def _plan(args: argparse.Namespace) -> int:
    import os

    # The plan compiles for a TPU slice described by libtpu; this machine's own
    # accelerator (if any) is not needed, and probing for one only prints warnings.
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from magic_jax.jobs.plan import plan_command

    return plan_command(args)


def _eval(args: argparse.Namespace) -> int:
    from magic_jax.jobs.eval import EvalOptions, parse_n, run_eval

    named, default = parse_n(args.n or ())
    options = EvalOptions(
        num_samples=named,
        default_num_samples=default,
        limit=args.limit,
        keep_responses=args.responses,
        **_job_options(args),
    )
    run_eval(args.model, args.data, args.out, options)
    print(f"per-problem lines and summary.md in {args.out}")
    return 0


def _estimate_difficulty(args: argparse.Namespace) -> int:
    from magic_jax.jobs.difficulty import DEFAULT_SAMPLES, DifficultyOptions, estimate_difficulty
    from magic_jax.jobs.eval import parse_n

    named, default = parse_n(args.samples or ())
    if default is not None:
        raise ValueError(f"--samples {default}: give ABILITY=N, e.g. --samples math=16")
    options = DifficultyOptions(
        model_name=args.model_name, samples=DEFAULT_SAMPLES | named, **_job_options(args)
    )
    estimate_difficulty(args.model, args.data, args.out, options)
    print(f"rated rows in {args.out}/rated, filtered rows in {args.out}/filtered")
    return 0


def _report(args: argparse.Namespace) -> int:
    from magic_jax.jobs.report import write_report

    out = write_report(args.runs, args.output, names=args.name)
    print(f"report: {out}")
    return 0


def _job_options(args: argparse.Namespace) -> dict:
    """The ``ScoringJob`` options of ``eval`` and ``estimate-difficulty``."""
    from magic_jax.jobs.scoring_job import engine_options

    return {
        "max_response_length": args.max_response_length,
        "max_prompt_length": args.max_prompt_length,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "chunk": args.chunk,
        "tokenizer": args.tokenizer,
        "param_dtype": args.param_dtype,
        "mesh": args.mesh,
        "engine": engine_options(args.set or (), args.extensions or ()),
        "workers": args.workers,
    }


def _add_job_args(p: argparse.ArgumentParser) -> None:
    """The arguments of a ``ScoringJob`` (``eval``, ``estimate-difficulty``)."""
    p.add_argument("model", help="Hugging Face dir, magic_jax model, run dir or run checkpoint")
    p.add_argument("data", nargs="+", help="Parquet / JSON-lines files (or dirs) of verl rows")
    p.add_argument("--max-response-length", type=int, default=32768)
    p.add_argument("--max-prompt-length", type=int, default=2048, help="longer prompts skipped")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--chunk", type=int, help="prompts per resumable chunk (default 256 // n; fixes the seeds)"
    )
    p.add_argument("--tokenizer", help="tokenizer dir (default: the model's)")
    p.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--mesh", help="e.g. fsdp=-1,tensor=4 (default: one device)")
    p.add_argument(
        "--set",
        action="append",
        metavar="rollout.KEY=VALUE",
        help="a decode engine option, as a run config's rollout section takes it, e.g. "
        "--set rollout.dtype=bfloat16 --set rollout.kv_dtype=int8 "
        "--set rollout.max_concurrent_decodes=128",
    )
    p.add_argument(
        "--extensions",
        action="append",
        metavar="MODULE",
        help="a module to import first (one that registers a decode attention or a reward)",
    )
    p.add_argument("--workers", type=int, help="verifier processes (default: one per CPU)")


def _add_export(sub: Any) -> None:
    p = sub.add_parser("export", help="orbax checkpoint -> Hugging Face checkpoint dir")
    p.add_argument(
        "ckpt",
        help="a checkpoint written by convert, a training checkpoint (RUN/checkpoints/step_N), "
        "or a run directory (its newest good checkpoint)",
    )
    p.add_argument("out", help="output directory (loadable by transformers)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--max-shard-gb", type=float, default=5.0)
    p.add_argument("--mesh", help="e.g. fsdp=-1,tensor=4 (default: one device)")
    p.set_defaults(func=_export)


def _add_train(sub: Any) -> None:
    p = sub.add_parser(
        "train",
        help="run a MAGIC training config (resumes from its output_dir)",
        description="Runs a training config; a run directory that has checkpoints resumes "
        "from the newest good one. SIGINT / SIGTERM stop at the next decode chunk or "
        "optimizer step, keeping the step's finished groups (exit status 130 / 143); "
        "errors exit with status 2; a run whose lock another run took exits 75; a "
        "Cloud Storage request that failed after its client's retries exits 69 (the "
        "same command resumes once the bucket answers); a full local disk exits 74. On a "
        "multi-host job an error on one host ends every host (status 3 on the others; "
        "the traceback in OUTPUT_DIR/logs). With watchdog_s set, watchdog_s seconds "
        "without progress end the run with status 124 (every thread's stack in "
        "OUTPUT_DIR/logs).",
    )
    p.add_argument(
        "config",
        nargs="?",
        help="YAML run configuration (see configs/); default: configs/default.yaml, the "
        "embedded default run, which ends with a report and a before -> after line",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override an option, e.g. --set loss.eps_high=0.28 --set stages.0.steps=10",
    )
    p.add_argument(
        "--stop-after", type=int, help="stop after this many steps in all (resumable; >= 1)"
    )
    p.add_argument(
        "--profile-steps",
        metavar="A:B",
        help="a jax.profiler trace of global steps A to B-1 into OUTPUT_DIR/profile "
        "(--set profile_steps=A:B)",
    )
    p.set_defaults(func=_train)


def _add_status(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="where a stopped run resumes: checkpoint, saved groups, lock, host reports",
    )
    p.add_argument("run_dir", help="a run directory (local or gs://)")
    p.add_argument("--json", action="store_true", help="print it as JSON")
    p.set_defaults(func=_status)


def _add_plan(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="per-device memory and roofline time of each stage on a TPU slice (needs libtpu)",
    )
    p.add_argument("config", help="YAML run configuration (see configs/)")
    p.add_argument("--topology", required=True, help="TPU slice: v5p-128, v6e-64 (gcloud), v5e:8x8")
    p.add_argument("--mesh", help="e.g. fsdp=-1,tensor=4 (default: the config's mesh)")
    p.add_argument("--preset", help="model preset when the config's model is not here")
    p.add_argument("--stage", type=int, help="plan only this stage (index)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override an option")
    p.add_argument("--no-search", action="store_true", help="do not look for a slice that fits")
    p.add_argument("--price-per-chip-hour", type=float, metavar="USD", help="print a cost too")
    shapes = (
        "tail, early, full, tail-grouped, early-grouped, lognormal:MEAN,CLIP[,RHO] or run:DIR "
        "(repeatable; default the first 3)"
    )
    p.add_argument("--lengths", action="append", metavar="SHAPE", help="[schedule]: " + shapes)
    floors = "[schedule]: a decode step's fixed cost in ms (repeatable; default 0, 4 and 8)"
    p.add_argument("--step-floor-ms", action="append", type=float, metavar="MS", help=floors)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_plan)


def _add_demo(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="the default run in a directory of your choice, then supervised training from the "
        "same base model for the same wall time (the baseline MAGIC must beat)",
    )
    p.add_argument(
        "--workdir",
        default="runs/demo",
        help="run directory (new, empty, or a run of this project to resume; never deleted)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override an option")
    p.add_argument(
        "--no-compare-sft",
        dest="compare_sft",
        action="store_false",
        help="skip the supervised-continuation baseline",
    )
    p.set_defaults(func=_demo)


def _add_builds(sub: Any) -> None:
    p = sub.add_parser(
        "build-default",
        help="rebuild the shipped base model and problems of the default run (from a seed)",
    )
    p.add_argument("--out", required=True, help="directory (e.g. magic_jax/assets/default)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_build_default)

    p = sub.add_parser(
        "build-world",
        help="build a world's base model and problems (check or hurry each column)",
    )
    p.add_argument("--out", required=True, help="directory (e.g. magic_jax/assets/carry)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--world",
        choices=("carry", "lockout", "decision"),
        default="carry",
        help="carry, lockout or decision (docs/<world>-world.md)",
    )
    p.set_defaults(func=_build_world)


def _add_scoring_jobs(sub: Any) -> None:
    p = sub.add_parser(
        "eval", help="avg@n and pass@k of a model on data sets (resumable per-problem output)"
    )
    _add_job_args(p)
    p.add_argument(
        "--n",
        action="append",
        metavar="[SET=]N",
        help="samples per problem, per data set (file stem) or for all: --n aime24=32 --n 4 "
        "(default 32 for math sets, 4 for code)",
    )
    p.add_argument("--limit", type=int, help="only the first LIMIT problems of each set")
    p.add_argument("--responses", action="store_true", help="write response texts too")
    p.add_argument("--out", default="eval_out", help="output directory (resumed if present)")
    p.set_defaults(func=_eval)

    p = sub.add_parser(
        "estimate-difficulty",
        help="N samples per prompt -> extra_info.model_difficulty, filtered rows, histogram",
    )
    _add_job_args(p)
    p.add_argument(
        "--samples",
        action="append",
        metavar="ABILITY=N",
        help="N per ability (default math=16, code=8)",
    )
    p.add_argument("--model-name", help="key under model_difficulty (default: model dir name)")
    p.add_argument("--out", required=True, help="output directory (resumed if present)")
    p.set_defaults(func=_estimate_difficulty)


def _add_report_and_data(sub: Any) -> None:
    p = sub.add_parser("report", help="curves of one or more runs: PNGs and one HTML page")
    p.add_argument("runs", nargs="+", help="run directories (metrics.jsonl, eval.jsonl)")
    p.add_argument("-o", "--output", default="report.html", help="HTML page; PNGs beside it")
    p.add_argument(
        "--name", action="append", help="legend name of each run, in order (default: dir name)"
    )
    p.set_defaults(func=_report)

    p = sub.add_parser(
        "prepare-data", help="verl rows (Parquet / JSON lines) -> an array_record tfds dataset"
    )
    p.add_argument("rows", nargs="+", help="files or directories of verl rows")
    p.add_argument("--out", required=True, help="new dataset directory (data.train may name it)")
    p.set_defaults(func=_prepare_data)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="magic-jax", description="RL post-training of long chain-of-thought models in JAX."
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    convert_job.add_parser(sub)
    for add in (
        _add_export,
        _add_train,
        _add_status,
        _add_plan,
        _add_demo,
        _add_builds,
        _add_scoring_jobs,
        _add_report_and_data,
    ):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except ModuleNotFoundError as e:  # a light install: name the extra, in one line
        from magic_jax import extras

        text = extras.message(e.name or "", f"magic-jax {args.command}", extra="train")
        if text is None:
            raise
        print(f"magic-jax {args.command}: error: {text}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from magic_jax.data.rows import DataError
    from magic_jax.jobs import hosts
    from magic_jax.model.convert import CheckpointError
    from magic_jax.run.runlock import LOST_LOCK_EXIT, LockLost

    if args.command in COMPILE_CACHED:
        from magic_jax import compile_cache

        compile_cache.enable()
    # In a multi-host job a failure on any host ends every host (``hosts.failed``): the
    # others would otherwise wait in their next collective forever.
    try:
        if args.command in MULTI_HOST and getattr(args, "mesh", None):
            hosts.start()
        elif args.command in ("eval", "estimate-difficulty"):
            from magic_jax.model.sharding import multi_host_job

            if via := multi_host_job():  # every host would run the whole job on one chip
                print(
                    f"magic-jax {args.command}: error: this is one process of a multi-host "
                    f"job ({via}): pass --mesh over all its devices (e.g. --mesh fsdp=-1) "
                    "so that the hosts score together and process 0 alone writes --out",
                    file=sys.stderr,
                )
                return 2
        return args.func(args)
    except LockLost as e:  # another run holds the directory now: this one writes nothing more
        print(f"magic-jax {args.command}: error: {e}", file=sys.stderr)
        return hosts.failed(args.command, LOST_LOCK_EXIT)
    except KeyboardInterrupt:
        print(f"magic-jax {args.command}: interrupted", file=sys.stderr)
        return hosts.failed(args.command, 130)
    except Exception as e:
        from magic_jax import distributed, storage

        # Cloud Storage failing after its retries (69), a full disk (74): one line, and
        # the same command resumes; else one line naming what is wrong (2)
        known = storage.failure_line(e)
        if known is None and isinstance(e, (CheckpointError, DataError, ValueError, OSError)):
            known = (str(e), 2)
        if known is None:
            known = _device_fault(e)
        if known is not None:
            print(f"magic-jax {args.command}: error: {known[0]}", file=sys.stderr)
            return hosts.failed(args.command, known[1])
        if not distributed.running():
            raise
        import traceback

        traceback.print_exc()
        return hosts.failed(args.command, 1)


# A device or runtime fault (a TPU or ICI error surfacing in XLA): the same command on
# new hosts may well succeed, so schedulers restart on it (jobs/gke.py); running out of
# memory or a bad argument will fail again, and exits 1.
DEVICE_FAULT_EXIT = 86  # not a sysexits code: 75 is a lost run lock (runlock.py)


def _device_fault(e: BaseException) -> tuple[str, int] | None:
    import jax

    if not isinstance(e, jax.errors.JaxRuntimeError):
        return None
    text = str(e).strip()
    if text.startswith(("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "UNIMPLEMENTED")):
        return None
    return f"a device or runtime fault: {text.splitlines()[0][:300]}", DEVICE_FAULT_EXIT


if __name__ == "__main__":
    sys.exit(main())
