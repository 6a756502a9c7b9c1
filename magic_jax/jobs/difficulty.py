"""Offline difficulty estimation: how many of N samples a model gets right, per prompt.

The report's offline filter (SPEC item 10) drops the prompts the base model
solves 0 or N of N times (N = 16 math, 8 code, temperature 1, long context).
``estimate_difficulty`` samples N responses per prompt, verifies them, and
writes the rows back with ``extra_info.model_difficulty[<model name>] =
correct``: the field the public Skywork-OR1 data carries, which
``magic_jax.data.rows.offline_filter`` (and so the trainer's
``data.offline_filter_model``) reads.

Output directory:
  ``difficulty.json``  the protocol; a restart with another one is refused.
  ``records.jsonl``    one line per prompt, appended chunk by chunk; a
                       restarted job skips finished chunks and, because chunk
                       c of N always draws from ``eval_seed(seed, c)`` with
                       step N, ends with what one run writes.
  ``rated/<file>``     every input row with the model's entry added.
  ``filtered/<file>``  the rows ``offline_filter`` keeps (0/N and N/N dropped).
  ``histogram.json``   prompts per number correct, for each ability.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from magic_jax import distributed
from magic_jax.data.rows import DataError, PromptRow, offline_filter, tokenize_rows
from magic_jax.data.sources import read_rows
from magic_jax.jobs.scoring_job import Chunk, Scorer, ScoringJob, open_logs
from magic_jax.rollout.evaluate import ProblemResult, eval_seed

# The report's N per ability.
DEFAULT_SAMPLES = {"math": 16, "code": 8}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DifficultyOptions(ScoringJob):
    """Protocol and resources of an ``estimate-difficulty`` job: a ``ScoringJob``'s
    (prompts longer than ``max_prompt_length`` get no entry; ``chunk`` counts prompts,
    default 256 // N) and these.

    Attributes:
      model_name: the key written under ``model_difficulty`` (default: the
        model directory's name).
      samples: N per ``ability``.
    """

    model_name: str | None = None
    samples: Mapping[str, int] = dataclasses.field(default_factory=lambda: dict(DEFAULT_SAMPLES))

    def __post_init__(self):
        super().__post_init__()
        for k, v in self.samples.items():
            if v <= 1:
                raise ValueError(f"--samples {k}={v}: N must be at least 2")


def _files(paths: Sequence[str]) -> list[Path]:
    from magic_jax.data.tfds import is_tfds_dir

    out = []
    for p in map(Path, paths):
        if is_tfds_dir(p):
            raise DataError(
                f"{p}: an array_record dataset; rows are written back in their own format, "
                "so give the Parquet / JSON-lines files it was prepared from"
            )
        if p.is_dir():
            out += sorted(f for f in p.iterdir() if f.suffix in (".parquet", ".jsonl"))
        elif p.exists():
            out.append(p)
        else:
            raise DataError(f"{p}: no such file or directory")
    names = [f.name for f in out]
    for name in set(names):
        if names.count(name) > 1:
            raise DataError(f"two input files are named {name}; outputs are written by file name")
    if not out:
        raise DataError(f"no .parquet or .jsonl files in {list(paths)}")
    return out


def with_difficulty(raw: Mapping[str, Any], model: str, correct: int, *, parquet: bool) -> dict:
    """A raw verl row with ``extra_info.model_difficulty[model] = correct``.

    The table keeps the form it had (a JSON string or a mapping); a new table
    is a JSON string in Parquet (free-form keys do not fit a Parquet struct)
    and a mapping in JSON lines.
    """
    row = dict(raw)
    extra = row.get("extra_info") or {}
    extra_str = isinstance(extra, str)
    extra = json.loads(extra) if isinstance(extra, str) else dict(extra)
    table = extra.get("model_difficulty")
    as_str = isinstance(table, str) or (table is None and parquet)
    table = json.loads(table) if isinstance(table, str) else dict(table or {})
    table[model] = int(correct)
    extra["model_difficulty"] = json.dumps(table, sort_keys=True) if as_str else table
    row["extra_info"] = json.dumps(extra) if extra_str else extra
    return row


def _write_rows(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(rows)), tmp)
    else:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)


def histogram(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{ability: {"samples": N, "counts": [prompts with 0, 1, ..., N correct]}}``."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        h = out.setdefault(r["ability"], {"samples": r["n"], "counts": [0] * (r["n"] + 1)})
        h["counts"][r["correct"]] += 1
    return dict(sorted(out.items()))


def format_histogram(hist: Mapping[str, Mapping[str, Any]], width: int = 40) -> str:
    """Text bars of a ``histogram``."""
    lines = []
    for ability, h in hist.items():
        n, counts = h["samples"], h["counts"]
        total = sum(counts)
        kept = total - counts[0] - counts[-1]
        lines.append(
            f"{ability}: {total} prompts, N = {n}; {kept} kept, {counts[0]} at 0/{n} and "
            f"{counts[-1]} at {n}/{n} dropped"
        )
        top = max(counts) or 1
        for c, k in enumerate(counts):
            lines.append(f"  {c:>3}/{n:<3} {'#' * round(width * k / top):<{width}} {k}")
    return "\n".join(lines)


def _items(files: Sequence[Path], samples: Mapping[str, int]) -> list[tuple[str, PromptRow]]:
    """``(record key, row)`` of every row; the key is ``file index:row index``."""
    items = []
    for i, f in enumerate(files):
        for j, row in enumerate(read_rows(f)):
            if row.ability not in samples:
                raise DataError(
                    f"{f}:{j}: ability {row.ability!r} has no N; pass --samples {row.ability}=N"
                )
            items.append((f"{i}:{j}", row))
    return items


def _chunks(
    items: Sequence[tuple[str, PromptRow]],
    encoded: Sequence[PromptRow],
    kept: Sequence[int],
    done: set[str],
    options: DifficultyOptions,
) -> Iterator[Chunk]:
    """The chunks not written yet, largest N first; chunk c of N draws from
    ``eval_seed(seed, c)`` with step N. A chunk's indices count the kept prompts."""
    for n in sorted({options.samples[r.ability] for _, r in items}, reverse=True):
        mine = [k for k in range(len(kept)) if options.samples[items[kept[k]][1].ability] == n]
        size = options.chunk_size(n)
        for c in range(math.ceil(len(mine) / size)):
            part = mine[c * size : (c + 1) * size]
            if not all(items[kept[k]][0] in done for k in part):
                yield Chunk([encoded[k] for k in part], part, n, eval_seed(options.seed, c), n)


def estimate_difficulty(
    model: str,
    data: Sequence[str],
    out: str | os.PathLike,
    options: DifficultyOptions,
    *,
    log: Callable[[str], None] = print,
    bar: bool | None = None,
) -> dict[str, dict[str, Any]]:
    """Samples N responses per prompt, counts the correct ones, writes the rated rows.

    Args:
      model: Hugging Face directory, magic_jax model, run directory or checkpoint.
      data: files or directories of verl rows.
      out: output directory (resumed if it holds a job with the same protocol).
      options: protocol and resources.
      log: where lines go.
      bar: force the progress bar on or off (None: on a terminal).

    Returns:
      The histogram (also in ``histogram.json``).
    """
    out = Path(out)
    files = _files(data)
    name = options.model_name or Path(model).absolute().name
    items = _items(files, options.samples)
    job = Scorer(model, options, log=log, bar=bar)
    groups = sorted({options.samples[r.ability] for _, r in items}, reverse=True)
    job.check(
        out / "difficulty.json",
        {
            "model": str(Path(model).absolute()),
            "checkpoint": job.loaded.checkpoint,
            "model_name": name,
            "data": [str(f.absolute()) for f in files],
            "samples": dict(sorted(options.samples.items())),
            "chunk": {str(n): options.chunk_size(n) for n in groups},
        },
    )
    rows = [r for _, r in items]
    encoded, kept = tokenize_rows(rows, job.tokenizer, max_prompt_length=options.max_prompt_length)
    if len(kept) < len(items):
        skipped = len(items) - len(kept)
        log(f"[difficulty] {skipped} prompts longer than --max-prompt-length get no entry")
    (records,) = open_logs([out / "records.jsonl"])
    done = {r["key"] for r in records.records}
    if done:
        log(f"[difficulty] resuming: {len(done)} of {len(kept)} prompts already in {out}")

    def record(chunk: Chunk, results: list[ProblemResult]) -> tuple[int, dict[str, Any]]:
        new = [
            _record(items[kept[k]], res)
            for k, res in zip(chunk.indices, results)
            if items[kept[k]][0] not in done
        ]
        records.append(new)
        done.update(r["key"] for r in new)
        return len(new), {"N": chunk.num_samples}

    chunks = _chunks(items, encoded, kept, done, options)
    job.score(chunks, record, total=len(kept), done=len(done), desc="difficulty", unit="prompt")
    if not distributed.is_primary():  # process 0 alone writes the outputs
        return histogram(sorted(records.records, key=lambda r: _key_order(r["key"])))
    return _write_outputs(out, files, name, records.records, options.samples, log)


def _write_outputs(
    out: Path,
    files: Sequence[Path],
    name: str,
    records: Sequence[Mapping[str, Any]],
    samples: Mapping[str, int],
    log: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    """``rated/``, ``filtered/`` and ``histogram.json`` from the job's records."""
    from magic_jax.data.rows import raw_rows

    by_key = {r["key"]: r for r in records}
    for i, f in enumerate(files):
        parquet = f.suffix == ".parquet"
        rated = []
        for j, (_, raw) in enumerate(raw_rows(str(f))):
            r = by_key.get(f"{i}:{j}")
            rated.append(
                raw if r is None else with_difficulty(raw, name, r["correct"], parquet=parquet)
            )
        _write_rows(out / "rated" / f.name, rated)
        back = read_rows(out / "rated" / f.name)  # the filter reads what was written
        keep = {r.uid for r in offline_filter(back, name, samples)}
        _write_rows(out / "filtered" / f.name, [w for w, r in zip(rated, back) if r.uid in keep])
    hist = histogram([by_key[k] for k in sorted(by_key, key=_key_order)])
    (out / "histogram.json").write_text(json.dumps({"model_name": name, **hist}, indent=2))
    log(format_histogram(hist))
    return hist


def _record(item: tuple[str, PromptRow], res: Any) -> dict[str, Any]:
    key, row = item
    statuses = {s: res.statuses.count(s) for s in sorted(set(res.statuses))}
    n = len(res.rewards)
    return {
        "key": key,
        "uid": row.uid,
        "ability": row.ability,
        "n": n,
        "correct": res.correct,
        "statuses": statuses,
    }


def _key_order(key: str) -> tuple[int, int]:
    i, j = key.split(":")
    return int(i), int(j)
