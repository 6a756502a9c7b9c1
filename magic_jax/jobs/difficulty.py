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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from magic_jax.data.rows import DataError, PromptRow, offline_filter, read_rows, tokenize_rows
from magic_jax.jobs.eval import ChunkLog, check_protocol
from magic_jax.rollout.evaluate import eval_seed

# The report's N per ability.
DEFAULT_SAMPLES = {"math": 16, "code": 8}
CHUNK_SAMPLES = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class DifficultyOptions:
    """Protocol and resources of an ``estimate-difficulty`` job.

    Attributes:
      model_name: the key written under ``model_difficulty`` (default: the
        model directory's name).
      samples: N per ``ability``.
      max_response_length / max_prompt_length: limits in tokens; longer
        prompts get no entry.
      temperature / top_p: sampling (the report: 1.0 / 1.0).
      seed: sampling seed.
      chunk: prompts per chunk (the unit of resumption); None: 256 // N.
      tokenizer / param_dtype / mesh / max_concurrent_decodes / decode_steps /
        workers: as for ``eval``.
    """

    model_name: str | None = None
    samples: Mapping[str, int] = dataclasses.field(default_factory=lambda: dict(DEFAULT_SAMPLES))
    max_response_length: int = 32768
    max_prompt_length: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    chunk: int | None = None
    tokenizer: str | None = None
    param_dtype: str = "float32"
    mesh: str | None = None
    max_concurrent_decodes: int = 64
    decode_steps: int = 64
    workers: int | None = None

    def __post_init__(self):
        for k, v in self.samples.items():
            if v <= 1:
                raise ValueError(f"--samples {k}={v}: N must be at least 2")
        if self.chunk is not None and self.chunk <= 0:
            raise ValueError(f"--chunk {self.chunk}: must be positive")


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
    extra = json.loads(extra) if extra_str else dict(extra)
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
    from magic_jax.data.rows import _raw_rows
    from magic_jax.rewards import PoolConfig, VerifierPool
    from magic_jax.rollout.driver import make_driver
    from magic_jax.rollout.evaluate import score_problems
    from magic_jax.rollout.sampling import SamplingConfig
    from magic_jax.run.monitor import Progress
    from magic_jax.run.policy import load_model_any, load_tokenizer

    out = Path(out)
    files = _files(data)
    name = options.model_name or Path(model).absolute().name
    items: list[tuple[str, PromptRow]] = []  # (record key, row)
    for i, f in enumerate(files):
        for j, row in enumerate(read_rows(f)):
            if row.ability not in options.samples:
                raise DataError(
                    f"{f}:{j}: ability {row.ability!r} has no N; pass --samples {row.ability}=N"
                )
            items.append((f"{i}:{j}", row))
    from magic_jax.model.sharding import mesh_from_text

    mesh = mesh_from_text(options.mesh)
    loaded = load_model_any(model, dtype=options.param_dtype, mesh=mesh)
    groups = sorted({options.samples[r.ability] for _, r in items}, reverse=True)
    chunk = {n: options.chunk or math.ceil(CHUNK_SAMPLES / n) for n in groups}
    protocol = {
        "model": str(Path(model).absolute()),
        "checkpoint": loaded.checkpoint,
        "model_name": name,
        "data": [str(f.absolute()) for f in files],
        "samples": dict(sorted(options.samples.items())),
        "chunk": {str(n): c for n, c in chunk.items()},
        "max_response_length": options.max_response_length,
        "max_prompt_length": options.max_prompt_length,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "seed": options.seed,
    }
    check_protocol(out / "difficulty.json", protocol)
    tok_dir = options.tokenizer or loaded.tokenizer_dir
    if tok_dir is None:
        raise ValueError(f"{model}: no tokenizer beside the model; pass --tokenizer DIR")
    tokenizer = load_tokenizer(tok_dir)
    encoded, kept = tokenize_rows(
        [r for _, r in items], tokenizer, max_prompt_length=options.max_prompt_length
    )
    if len(kept) < len(items):
        skipped = len(items) - len(kept)
        log(f"[difficulty] {skipped} prompts longer than --max-prompt-length get no entry")
    records = ChunkLog(out / "records.jsonl")
    done = {r["key"] for r in records.records}
    if done:
        log(f"[difficulty] resuming: {len(done)} of {len(kept)} prompts already in {out}")
    driver = make_driver(
        loaded.model,
        max_prompt_length=options.max_prompt_length,
        max_response_length=options.max_response_length,
        sampling=SamplingConfig(temperature=options.temperature, top_p=options.top_p),
        max_concurrent_decodes=options.max_concurrent_decodes,
        decode_steps=options.decode_steps,
        mesh=mesh,
    )
    params = driver.engine.load_params(loaded.model)
    with (
        VerifierPool(PoolConfig(num_workers=options.workers)) as pool,
        Progress(
            len(kept), desc="difficulty", unit="prompt", initial=len(done), log=log, bar=bar
        ) as progress,  # fmt: skip
    ):
        for n in groups:
            mine = [k for k in range(len(kept)) if options.samples[items[kept[k]][1].ability] == n]
            for c in range(math.ceil(len(mine) / chunk[n])):
                part = mine[c * chunk[n] : (c + 1) * chunk[n]]
                if all(items[kept[k]][0] in done for k in part):
                    continue
                results = score_problems(
                    driver,
                    params,
                    [encoded[k] for k in part],
                    tokenizer,
                    num_samples=n,
                    seed=eval_seed(options.seed, c),
                    step=n,
                    indices=part,
                    pool=pool,
                )
                new = [
                    _record(items[kept[k]], res)
                    for k, res in zip(part, results)
                    if items[kept[k]][0] not in done
                ]
                records.append(new)
                done |= {r["key"] for r in new}
                progress.update(len(new), postfix={"N": n})
    by_key = {r["key"]: r for r in records.records}
    for i, f in enumerate(files):
        parquet = f.suffix == ".parquet"
        rated = []
        for j, (_, raw) in enumerate(_raw_rows(str(f))):
            r = by_key.get(f"{i}:{j}")
            rated.append(
                raw if r is None else with_difficulty(raw, name, r["correct"], parquet=parquet)
            )
        _write_rows(out / "rated" / f.name, rated)
        back = read_rows(out / "rated" / f.name)  # the filter reads what was written
        keep = {r.uid for r in offline_filter(back, name, options.samples)}
        _write_rows(out / "filtered" / f.name, [w for w, r in zip(rated, back) if r.uid in keep])
    hist = histogram([by_key[k] for k in sorted(by_key, key=_key_order)])
    (out / "histogram.json").write_text(json.dumps({"model_name": name, **hist}, indent=2))
    log(format_histogram(hist))
    return hist


def _record(item: tuple[str, PromptRow], res: Any) -> dict[str, Any]:
    key, row = item
    statuses = {s: res.statuses.count(s) for s in sorted(set(res.statuses))}
    n = len(res.rewards)
    return {"key": key, "uid": row.uid, "ability": row.ability, "n": n, "correct": res.correct,
            "statuses": statuses}  # fmt: skip


def _key_order(key: str) -> tuple[int, int]:
    i, j = key.split(":")
    return int(i), int(j)
