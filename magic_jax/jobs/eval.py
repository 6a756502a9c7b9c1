"""The ``magic-jax eval`` command: avg@n / pass@k of a model on data sets, with resumable output.

Output directory:
  ``eval.json``    the protocol (model checkpoint, n per data set, limits,
                   sampling, seed, chunk size); a restart with another protocol
                   is refused rather than mixing samples.
  ``<set>.jsonl``  one line per problem (``ProblemResult.to_json``), appended
                   chunk by chunk; a restarted job skips the chunks already
                   written, and because chunk c always draws from seed
                   ``eval_seed(seed, c)`` it ends with the lines one run writes.
  ``summary.json`` / ``summary.md``  the table of each data set.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from magic_jax import distributed, storage
from magic_jax.data.rows import DataError, PromptRow, tokenize_rows
from magic_jax.data.sources import read_rows
from magic_jax.jobs.scoring_job import Chunk, ChunkLog, LogCopy, Scorer, ScoringJob, open_logs
from magic_jax.rollout.evaluate import ProblemResult, eval_seed, format_summary, summarize

# The report's n: AIME avg@32, LiveCodeBench avg@4.
DEFAULT_SAMPLES = {"math": 32, "code": 4}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalOptions(ScoringJob):
    """Protocol and resources of an ``eval`` job: a ``ScoringJob``'s and these.

    Attributes:
      num_samples: n per data set name (a file's stem).
      default_num_samples: n of the other sets; None: 32 for math, 4 for code.
      limit: only the first ``limit`` problems of each set.
      keep_responses: write each response's text in the per-problem lines.
    """

    num_samples: Mapping[str, int] = dataclasses.field(default_factory=dict)
    default_num_samples: int | None = None
    limit: int | None = None
    keep_responses: bool = False

    def __post_init__(self):
        super().__post_init__()
        for k, v in self.num_samples.items():
            if v <= 0:
                raise ValueError(f"--n {k}={v}: n must be positive")
        if self.default_num_samples is not None and self.default_num_samples <= 0:
            raise ValueError(f"--n {self.default_num_samples}: n must be positive")


def parse_n(values: Iterable[str]) -> tuple[dict[str, int], int | None]:
    """``["aime24=32", "lcb=4", "8"]`` -> ``({"aime24": 32, "lcb": 4}, 8)``."""
    named, default = {}, None
    for v in values:
        name, _, num = v.rpartition("=")
        try:
            n = int(num)
        except ValueError:
            raise ValueError(f"--n {v!r}: expected N or NAME=N") from None
        if name:
            named[name] = n
        else:
            default = n
    return named, default


def dataset_names(paths: Sequence[str]) -> list[tuple[str, str]]:
    """``(name, path)`` of each data argument; the name is the file (or directory) stem."""
    out: list[tuple[str, str]] = []
    seen: dict[str, str] = {}
    for p in paths:
        where = storage.path(p)
        name = where.stem if where.is_file() else where.name
        if name in seen:
            raise ValueError(f"data sets {seen[name]} and {p} have the same name {name!r}")
        seen[name] = p
        out.append((name, p))
    return out


def majority_ability(rows: Sequence[PromptRow]) -> str:
    abilities = [r.ability for r in rows]
    return max(set(abilities), key=abilities.count)


@dataclasses.dataclass
class _Set:
    """One data set of an eval job: its rows, n, and (once tokenised) what is scored."""

    name: str
    path: str
    rows: list[PromptRow]
    n: int
    encoded: list[PromptRow] = dataclasses.field(default_factory=list)
    kept: list[int] = dataclasses.field(default_factory=list)
    log: ChunkLog | LogCopy | None = None  # LogCopy: not process 0 (it writes nothing)

    def opened(self) -> ChunkLog | LogCopy:
        """Its log (``open_logs``), which every read follows."""
        assert self.log is not None, "opened by run_eval before the set is read"
        return self.log


def _read_sets(data: Sequence[str], options: EvalOptions) -> list[_Set]:
    sets = []
    for name, path in dataset_names(data):
        rows = read_rows(path)[: options.limit]
        if not rows:
            raise DataError(f"{path}: no rows")
        n = options.num_samples.get(name, options.default_num_samples)
        n = n or DEFAULT_SAMPLES.get(majority_ability(rows), DEFAULT_SAMPLES["math"])
        sets.append(_Set(name, path, rows, n))
    unknown = set(options.num_samples) - {s.name for s in sets}
    if unknown:
        raise ValueError(f"--n names {sorted(unknown)}, not among the data sets")
    return sets


def _chunks(sets: Sequence[_Set], options: EvalOptions) -> Iterator[Chunk]:
    """The chunks not written yet; chunk c of a set draws from ``eval_seed(seed, c)``."""
    for s in sets:
        size, have = options.chunk_size(s.n), {r["index"] for r in s.opened().records}
        for c in range(math.ceil(len(s.kept) / size)):
            part = range(c * size, min((c + 1) * size, len(s.kept)))
            if all(s.kept[i] in have for i in part):
                continue
            rows, indices = [s.encoded[i] for i in part], [s.kept[i] for i in part]
            yield Chunk(rows, indices, s.n, eval_seed(options.seed, c), tag=s)


def run_eval(
    model: str,
    data: Sequence[str],
    out: str | os.PathLike,
    options: EvalOptions,
    *,
    log: Callable[[str], None] = print,
    bar: bool | None = None,
) -> dict[str, dict[str, Any]]:
    """Evaluates ``model`` on each data set; resumes from what ``out`` already holds.

    Args:
      model: Hugging Face directory, magic_jax orbax model, run directory or
        one of its ``checkpoints/step_*``.
      data: files or directories of verl rows, one data set each.
      out: output directory.
      options: protocol and resources.
      log: where lines go.
      bar: force the progress bar on or off (None: on a terminal).

    Returns:
      ``{set name: summary table}`` (also in ``summary.json`` / ``summary.md``).
    """
    storage.check(out, what="--out")
    out_dir = storage.path(out)
    sets = _read_sets(data, options)
    job = Scorer(model, options, log=log, bar=bar)
    protocol = job.check(
        out_dir / "eval.json",
        {
            "model": str(storage.path(model)),
            "checkpoint": job.loaded.checkpoint,
            "step": job.loaded.step,
            "data": {s.name: str(storage.path(s.path)) for s in sets},
            "num_samples": {s.name: s.n for s in sets},
            "limit": options.limit,
            "chunk": {s.name: options.chunk_size(s.n) for s in sets},
            "keep_responses": options.keep_responses,
        },
    )
    for s in sets:
        s.encoded, s.kept = tokenize_rows(
            s.rows, job.tokenizer, max_prompt_length=options.max_prompt_length
        )
        if not s.kept:
            raise DataError(f"{s.name}: no prompt fits --max-prompt-length")
    for s, log_ in zip(sets, open_logs([out_dir / f"{s.name}.jsonl" for s in sets])):
        s.log = log_
    total = sum(len(s.kept) for s in sets)
    done = sum(len({r["index"] for r in s.opened().records}) for s in sets)
    if done:
        log(f"[eval] resuming: {done} of {total} problems already in {out_dir}")
    tally = {
        s.name: [
            sum(r["correct"] for r in s.opened().records),
            sum(r["n"] for r in s.opened().records),
        ]
        for s in sets
    }

    def record(chunk: Chunk, results: list[ProblemResult]) -> tuple[int, dict[str, Any]]:
        s, have = chunk.tag, {r["index"] for r in chunk.tag.opened().records}
        new = [r for r in results if r.index not in have]
        s.opened().append([r.to_json() for r in new])
        tally[s.name][0] += sum(r.correct for r in new)
        tally[s.name][1] += s.n * len(new)
        return len(new), {"set": s.name, f"avg@{s.n}": tally[s.name][0] / tally[s.name][1]}

    job.score(
        _chunks(sets, options),
        record,
        total=total,
        done=done,
        desc="eval",
        unit="problem",
        keep_responses=options.keep_responses,
    )
    return _write_summary(out_dir, sets, protocol, log)


def _write_summary(
    out: Any, sets: Sequence[_Set], protocol: Mapping[str, Any], log: Callable[[str], None]
) -> dict[str, dict[str, Any]]:
    tables = {}
    for s in sets:
        problems = sorted(
            (ProblemResult.from_json(r) for r in s.opened().records), key=lambda p: p.index
        )
        tables[s.name] = {**summarize(problems), "skipped_long_prompts": len(s.rows) - len(s.kept)}
    if distributed.is_primary():  # process 0 alone writes
        (out / "summary.json").write_text(json.dumps(tables, indent=2))
        (out / "summary.md").write_text(summary_markdown(tables, protocol))
    for name, table in tables.items():
        log(format_summary(name, table))
    return tables


def summary_markdown(tables: Mapping[str, Mapping[str, Any]], protocol: Mapping[str, Any]) -> str:
    """The tables as Markdown: one overview row per data set, then pass@k of each."""
    lines = [
        f"# Evaluation of {protocol['checkpoint']}"
        + (f" (step {protocol['step']})" if protocol.get("step") is not None else ""),
        "",
        f"temperature {protocol['temperature']}, top-p {protocol['top_p']}, "
        f"max response length {protocol['max_response_length']}, seed {protocol['seed']}",
        "",
        "| data set | problems | n | avg@n | +- | pass@n | mean length | truncated | statuses |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, t in tables.items():
        n = t["num_samples"]
        statuses = ", ".join(f"{k} {v}" for k, v in t["reward_status"].items() if v)
        lines.append(
            f"| {name} | {t['problems']} | {n} | {t['accuracy']:.4f} | "
            f"{t['accuracy_stderr']:.4f} | {t['pass_at_k'][str(n)]:.4f} | "
            f"{t['response_length_mean']:.1f} | {100 * t['truncated_fraction']:.2f}% | "
            f"{statuses} |"
        )
    for name, t in tables.items():
        ks = list(t["pass_at_k"])
        lines += ["", f"## {name}: pass@k", "", "| " + " | ".join(f"pass@{k}" for k in ks) + " |"]
        lines += ["|" + "---|" * len(ks)]
        lines += ["| " + " | ".join(f"{t['pass_at_k'][k]:.4f}" for k in ks) + " |"]
    return "\n".join(lines) + "\n"
