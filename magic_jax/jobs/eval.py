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
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from magic_jax import storage
from magic_jax.data.rows import DataError, PromptRow, read_rows, tokenize_rows
from magic_jax.rollout.evaluate import ProblemResult, eval_seed, format_summary, summarize

# The report's n: AIME avg@32, LiveCodeBench avg@4.
DEFAULT_SAMPLES = {"math": 32, "code": 4}
# Samples per chunk when --chunk is not given: enough to keep a decode batch full.
CHUNK_SAMPLES = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalOptions:
    """Protocol and resources of an ``eval`` job.

    Attributes:
      num_samples: n per data set name (a file's stem).
      default_num_samples: n of the other sets; None: 32 for math, 4 for code.
      max_response_length / max_prompt_length: limits in tokens.
      temperature / top_p: sampling (the report's protocol: 1.0 / 1.0).
      seed: sampling seed.
      chunk: problems per chunk (the unit of resumption); None: 256 // n.
      limit: only the first ``limit`` problems of each set.
      tokenizer: tokenizer directory (default: the model's).
      param_dtype: parameter dtype of a Hugging Face model.
      mesh: ``data=..,fsdp=..,tensor=..`` or None for one device.
      max_concurrent_decodes / decode_steps: decode engine shape.
      workers: verifier processes (None: one per CPU).
      keep_responses: write each response's text in the per-problem lines.
    """

    num_samples: Mapping[str, int] = dataclasses.field(default_factory=dict)
    default_num_samples: int | None = None
    max_response_length: int = 32768
    max_prompt_length: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    chunk: int | None = None
    limit: int | None = None
    tokenizer: str | None = None
    param_dtype: str = "float32"
    mesh: str | None = None
    max_concurrent_decodes: int = 64
    decode_steps: int = 64
    workers: int | None = None
    keep_responses: bool = False

    def __post_init__(self):
        for name in ("max_response_length", "max_prompt_length", "max_concurrent_decodes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        for k, v in self.num_samples.items():
            if v <= 0:
                raise ValueError(f"--n {k}={v}: n must be positive")
        if self.default_num_samples is not None and self.default_num_samples <= 0:
            raise ValueError(f"--n {self.default_num_samples}: n must be positive")
        if self.chunk is not None and self.chunk <= 0:
            raise ValueError(f"--chunk {self.chunk}: must be positive")


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
    out, seen = [], {}
    for p in paths:
        where = storage.path(p)
        name = where.stem if where.is_file() else where.name
        if name in seen:
            raise ValueError(f"data sets {seen[name]} and {p} have the same name {name!r}")
        seen[name] = p
        out.append((name, p))
    return out


class ChunkLog:
    """An append-only JSON-lines file written a chunk at a time, readable after a kill.

    A torn last line (the process died inside a write) is cut off on open. On
    ``gs://`` (objects cannot be appended to) each chunk rewrites the file whole.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = storage.path(path)
        self.records: list[dict[str, Any]] = []
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        good = 0
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            try:
                self.records.append(json.loads(line))
            except json.JSONDecodeError:
                break
            good += len(line)
        if good != len(data):
            if storage.is_gcs(self.path):
                self.path.write_bytes(data[:good])
            else:
                with open(self.path, "r+b") as f:
                    f.truncate(good)

    def append(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Appends records in one write, flushed to disk."""
        if not records:
            return
        if storage.is_gcs(self.path):  # no appends on GCS: the whole file, in one upload
            self.records.extend(records)
            storage.write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
            return
        text = "".join(json.dumps(r) + "\n" for r in records)
        with open(self.path, "a") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        self.records.extend(records)


def check_protocol(path: Path, protocol: Mapping[str, Any]) -> None:
    """Writes ``protocol`` to ``path``, or checks it equals the one already there.

    Raises:
      ValueError: naming the first field that differs.
    """
    if path.exists():
        old = json.loads(path.read_text())
        for key in sorted(set(old) | set(protocol)):
            if old.get(key) != protocol.get(key):
                raise ValueError(
                    f"{path}: this output was made with {key} = {old.get(key)!r}, now "
                    f"{protocol.get(key)!r}; use another --out or the same options"
                )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(protocol, indent=2))


def majority_ability(rows: Sequence[PromptRow]) -> str:
    abilities = [r.ability for r in rows]
    return max(set(abilities), key=abilities.count)


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
    from magic_jax.rewards import PoolConfig, VerifierPool
    from magic_jax.rollout.sampling import SamplingConfig
    from magic_jax.run.monitor import Progress

    storage.check(out, what="--out")
    out = storage.path(out)
    sets = []
    for name, path in dataset_names(data):
        rows = read_rows(path)[: options.limit]
        if not rows:
            raise DataError(f"{path}: no rows")
        n = options.num_samples.get(name, options.default_num_samples)
        n = n or DEFAULT_SAMPLES.get(majority_ability(rows), DEFAULT_SAMPLES["math"])
        sets.append((name, path, rows, n))
    unknown = set(options.num_samples) - {s[0] for s in sets}
    if unknown:
        raise ValueError(f"--n names {sorted(unknown)}, not among the data sets")
    sampling = SamplingConfig(temperature=options.temperature, top_p=options.top_p)
    from magic_jax.model.sharding import mesh_from_text
    from magic_jax.rollout.driver import make_driver
    from magic_jax.rollout.evaluate import score_problems
    from magic_jax.run.policy import load_model_any

    mesh = mesh_from_text(options.mesh)
    loaded = load_model_any(model, dtype=options.param_dtype, mesh=mesh)
    protocol = {
        "model": str(storage.path(model)),
        "checkpoint": loaded.checkpoint,
        "step": loaded.step,
        "data": {name: str(storage.path(p)) for name, p, _, _ in sets},
        "num_samples": {name: n for name, _, _, n in sets},
        "limit": options.limit,
        "chunk": {name: options.chunk or math.ceil(CHUNK_SAMPLES / n) for name, _, _, n in sets},
        "max_response_length": options.max_response_length,
        "max_prompt_length": options.max_prompt_length,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "seed": options.seed,
        "keep_responses": options.keep_responses,
    }
    check_protocol(out / "eval.json", protocol)

    from magic_jax.run.policy import load_tokenizer

    tok_dir = options.tokenizer or loaded.tokenizer_dir
    if tok_dir is None:
        raise ValueError(f"{model}: no tokenizer beside the model; pass --tokenizer DIR")
    tokenizer = load_tokenizer(tok_dir)
    work = []  # (name, rows, tokenised rows that fit, their indices in rows, n, log)
    for name, _, rows, n in sets:
        encoded, kept = tokenize_rows(rows, tokenizer, max_prompt_length=options.max_prompt_length)
        if not kept:
            raise DataError(f"{name}: no prompt fits --max-prompt-length")
        work.append((name, rows, encoded, kept, n, ChunkLog(out / f"{name}.jsonl")))
    total = sum(len(w[3]) for w in work)
    done = sum(len({r["index"] for r in w[5].records}) for w in work)
    if done:
        log(f"[eval] resuming: {done} of {total} problems already in {out}")
    driver = make_driver(
        loaded.model,
        max_prompt_length=options.max_prompt_length,
        max_response_length=options.max_response_length,
        sampling=sampling,
        max_concurrent_decodes=options.max_concurrent_decodes,
        decode_steps=options.decode_steps,
        mesh=mesh,
    )
    params = driver.engine.load_params(loaded.model)
    with (
        VerifierPool(PoolConfig(num_workers=options.workers)) as pool,
        Progress(total, desc="eval", unit="problem", initial=done, log=log, bar=bar) as bar_,
    ):
        for name, _, encoded, kept, n, chunks in work:
            size = protocol["chunk"][name]
            have = {r["index"] for r in chunks.records}
            right = sum(r["correct"] for r in chunks.records)
            count = sum(r["n"] for r in chunks.records)
            for c in range(math.ceil(len(kept) / size)):
                part = list(range(c * size, min((c + 1) * size, len(kept))))
                todo = [kept[i] for i in part if kept[i] not in have]
                if not todo:
                    continue
                results = score_problems(
                    driver,
                    params,
                    [encoded[i] for i in part],
                    tokenizer,
                    num_samples=n,
                    seed=eval_seed(options.seed, c),
                    indices=[kept[i] for i in part],
                    pool=pool,
                    keep_responses=options.keep_responses,
                )
                new = [r for r in results if r.index in todo]
                chunks.append([r.to_json() for r in new])
                right += sum(r.correct for r in new)
                count += n * len(new)
                bar_.update(len(todo), postfix={"set": name, f"avg@{n}": right / count})
    tables = {}
    for name, rows, _, kept, _, chunks in work:
        problems = sorted(
            (ProblemResult.from_json(r) for r in chunks.records), key=lambda p: p.index
        )
        tables[name] = {**summarize(problems), "skipped_long_prompts": len(rows) - len(kept)}
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
