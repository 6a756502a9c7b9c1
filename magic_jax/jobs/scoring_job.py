"""What ``magic-jax eval`` and ``estimate-difficulty`` share: one scoring job.

Both load a policy and its tokenizer, write their protocol (or check it against
the one a previous run of the same output directory wrote), then sample and
verify their problems in chunks on one engine with the verifier pool and a
progress bar, each chunk appended to a ``ChunkLog`` as it finishes, so a killed
job resumes where it stopped. ``ScoringJob`` holds the options they share (the
engine's among them, as an ``EngineOptions``); ``Scorer`` runs the job; the
commands say which problems form a chunk and what a chunk's results become.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from magic_jax import storage
from magic_jax.data.rows import PromptRow
from magic_jax.rollout.engine_config import EngineOptions
from magic_jax.rollout.evaluate import ProblemResult

if TYPE_CHECKING:
    from magic_jax.run.policy import RunTokenizer

# Samples per chunk when --chunk is not given: enough to keep a decode batch full.
CHUNK_SAMPLES = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScoringJob:
    """The options a scoring job (``eval``, ``estimate-difficulty``) has.

    Attributes:
      max_response_length / max_prompt_length: limits in tokens.
      temperature / top_p: sampling (the report's protocol: 1.0 / 1.0).
      seed: sampling seed.
      chunk: problems per chunk (the unit of resumption); None: 256 // n.
      tokenizer: tokenizer directory (default: the model's).
      param_dtype: parameter dtype of a Hugging Face model.
      mesh: ``data=..,fsdp=..,tensor=..`` or None for one device.
      engine: the decode engine's options (``--set rollout.KEY=VALUE``), as a
        run config's ``rollout`` section gives them.
      workers: verifier processes (None: one per CPU).
    """

    max_response_length: int = 32768
    max_prompt_length: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    chunk: int | None = None
    tokenizer: str | None = None
    param_dtype: str = "float32"
    mesh: str | None = None
    engine: EngineOptions = dataclasses.field(default_factory=EngineOptions)
    workers: int | None = None

    def __post_init__(self):
        for name in ("max_response_length", "max_prompt_length"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.chunk is not None and self.chunk <= 0:
            raise ValueError(f"--chunk {self.chunk}: must be positive")

    def protocol(self) -> dict[str, Any]:
        """The options that change what is sampled; a resumed job must keep them."""
        return {
            "max_response_length": self.max_response_length,
            "max_prompt_length": self.max_prompt_length,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "engine": {
                "dtype": self.engine.dtype,
                "kv_dtype": self.engine.kv_dtype,
                "decode_attention": self.engine.decode_attention,
            },
        }

    def chunk_size(self, num_samples: int) -> int:
        """Problems per chunk at ``num_samples`` samples each."""
        return self.chunk or -(-CHUNK_SAMPLES // num_samples)


def engine_options(assignments: Sequence[str], extensions: Sequence[str] = ()) -> EngineOptions:
    """``EngineOptions`` from ``rollout.KEY=VALUE`` assignments (values read as YAML).

    ``extensions`` are imported first, so that what they register (a decode
    attention) can be named.

    Raises:
      ConfigError: naming the option that is unknown or has a bad value.
    """
    from magic_jax.run.config_dict import ConfigError, apply_override, from_dict, import_extensions

    import_extensions(list(extensions))
    raw: dict[str, Any] = {}
    for assignment in assignments:
        if not assignment.strip().startswith("rollout."):
            raise ConfigError(
                f"--set {assignment!r}: this command takes engine options only, "
                "as rollout.KEY=VALUE (e.g. rollout.dtype=bfloat16)"
            )
        apply_override(raw, assignment.strip())
    return from_dict(EngineOptions, raw.get("rollout", {}), "rollout")


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
            self.records.extend(dict(r) for r in records)
            storage.write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
            return
        text = "".join(json.dumps(r) + "\n" for r in records)
        with open(self.path, "a") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        self.records.extend(dict(r) for r in records)


class LogCopy:
    """Another process's view of process 0's ``ChunkLog`` in a multi-host job: the
    records it held at the start, then those appended, kept in memory and never
    written (only process 0 writes a job's outputs)."""

    def __init__(self, records: Sequence[dict[str, Any]]):
        self.records = list(records)

    def append(self, records: Sequence[Mapping[str, Any]]) -> None:
        self.records.extend(dict(r) for r in records)


def open_logs(paths: Sequence[str | os.PathLike]) -> list[ChunkLog | LogCopy]:
    """A ``ChunkLog`` per path on process 0; on the others a ``LogCopy`` of what it
    holds, so that every process of a multi-host job resumes at the same chunk
    (a collective there: every process calls it)."""
    from magic_jax import distributed

    if distributed.process_count() == 1:
        return [ChunkLog(p) for p in paths]
    logs: list[ChunkLog | LogCopy] = (
        [ChunkLog(p) for p in paths] if distributed.is_primary() else []
    )
    held = distributed.allgather_strings([json.dumps(log.records) for log in logs])
    return logs or [LogCopy(json.loads(text)) for text in held[: len(paths)]]


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


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Problems sampled together, from one seed: the unit a job resumes by.

    Attributes:
      rows: the problems, tokenised.
      indices: each problem's index (``ProblemResult.index``).
      num_samples: n.
      seed / step: sampling keys.
      tag: what the command needs to file the results (a data set's name).
    """

    rows: Sequence[PromptRow]
    indices: Sequence[int]
    num_samples: int
    seed: int
    step: int = 0
    tag: Any = None


# A chunk's results -> (units of progress done, the bar's postfix)
Record = Callable[[Chunk, list[ProblemResult]], tuple[int, dict[str, Any]]]


class Scorer:
    """A scoring job's policy, tokenizer and engine; ``score`` runs its chunks.

    Args:
      model: Hugging Face directory, magic_jax model, run directory or checkpoint.
      options: the job's options.
      log: where lines go.
      bar: force the progress bar on or off (None: on a terminal).
    """

    def __init__(
        self,
        model: str,
        options: ScoringJob,
        *,
        log: Callable[[str], None] = print,
        bar: bool | None = None,
    ):
        from magic_jax.model.sharding import mesh_from_text
        from magic_jax.run.policy import load_model_any

        self.model = model
        self.options = options
        self.log = log
        self.bar = bar
        self.mesh = mesh_from_text(options.mesh)
        self.loaded = load_model_any(model, dtype=options.param_dtype, mesh=self.mesh)
        self._tokenizer: RunTokenizer | None = None

    def check(self, path: Path, protocol: Mapping[str, Any]) -> dict[str, Any]:
        """The job's whole protocol (``protocol`` and the options'), written to ``path``
        or checked against the one there (``check_protocol``; by process 0 alone)."""
        from magic_jax import distributed

        full = {**protocol, **self.options.protocol()}
        if distributed.is_primary():  # the one process that writes the outputs
            check_protocol(path, full)
        return full

    @property
    def tokenizer(self) -> RunTokenizer:
        if self._tokenizer is None:
            from magic_jax.run.policy import load_tokenizer

            where = self.options.tokenizer or self.loaded.tokenizer_dir
            if where is None:
                raise ValueError(
                    f"{self.model}: no tokenizer beside the model; pass --tokenizer DIR"
                )
            self._tokenizer = load_tokenizer(where)
        return self._tokenizer

    def score(
        self,
        chunks: Iterable[Chunk],
        record: Record,
        *,
        total: int,
        done: int,
        desc: str,
        unit: str,
        keep_responses: bool = False,
    ) -> None:
        """Samples and verifies each chunk, handing its results to ``record``.

        ``total`` / ``done``: units (problems, prompts) in all and already done.
        """
        from magic_jax.rewards import RewardsConfig, VerifierPool
        from magic_jax.rollout.driver import make_driver
        from magic_jax.rollout.evaluate import score_problems
        from magic_jax.rollout.sampling import SamplingConfig
        from magic_jax.run.monitor import Progress

        o = self.options
        driver = make_driver(
            self.loaded.model,
            o.engine,
            max_prompt_length=o.max_prompt_length,
            max_response_length=o.max_response_length,
            sampling=SamplingConfig(temperature=o.temperature, top_p=o.top_p),
            mesh=self.mesh,
        )
        params = driver.engine.load_params(self.loaded.model)
        self.log(f"[{desc}] engine: {describe_engine(driver, params)}")
        pool = VerifierPool(RewardsConfig(num_workers=o.workers))
        bar = Progress(total, desc=desc, unit=unit, initial=done, log=self.log, bar=self.bar)
        with pool, bar:
            for chunk in chunks:
                results = score_problems(
                    driver,
                    params,
                    chunk.rows,
                    self.tokenizer,
                    num_samples=chunk.num_samples,
                    seed=chunk.seed,
                    step=chunk.step,
                    indices=chunk.indices,
                    pool=pool,
                    keep_responses=keep_responses,
                )
                units, postfix = record(chunk, results)
                bar.update(units, postfix=postfix)


def describe_engine(driver: Any, params: Any) -> str:
    """What the engine runs, read from its weights and its cache as built: dtypes,
    attention, lanes and slots."""
    import jax
    import jax.numpy as jnp

    engine = driver.engine
    leaves = jax.tree.leaves(params)
    weights = sorted({str(x.dtype) for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)})
    cache = jax.eval_shape(engine.init_decode_state).cache.k.dtype
    attention = engine.attention.name
    spec = engine.ragged_spec
    int8_dense = cache == jnp.int8 and spec is not None and spec.backend == "gpu"
    if engine.attention.ragged and (int8_dense or engine.model_config.sliding_layers):
        attention = "dense"  # the kernel reads full-attention layers only, int8 not on GPU
    return (
        f"{'/'.join(weights)} weights, {cache} KV cache, {attention} attention, "
        f"{driver.lanes} lane(s) x {engine.config.max_concurrent_decodes} slots"
    )
