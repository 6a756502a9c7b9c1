"""Prompt data in the verl / Skywork-OR1 row format: checking, rendering, filtering, batching.

A row holds ``data_source`` (str), ``prompt`` (a list of ``{role, content}``
chat messages), ``ability`` (``"math"`` or ``"code"``), ``reward_model``
(``{ground_truth, style}``; the ground truth is a plain string or a JSON
string) and ``extra_info`` (a dict; in the public training set
``extra_info.model_difficulty`` maps a model name to its correct answers out
of 16, also as JSON). Files are Parquet (``.parquet``) or JSON lines
(``.jsonl``), read by ``data.sources.read_rows``; a bad row raises ``DataError``
naming the file, the line (1-based, ``file:line``; ``file: row N`` in Parquet) and
the field.

Batches come from a ``grain.MapDataset`` with random access: the prompts of
training step k are ``dataset[k]``, so a resumed run picks up exactly where it
stopped without replaying an iterator.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from magic_jax import storage
from magic_jax.rewards.registry import find_reward, reward_names

# Special tokens of the DeepSeek-R1-Distill chat format.
R1_BOS = "<｜begin▁of▁sentence｜>"
R1_EOS = "<｜end▁of▁sentence｜>"
R1_USER = "<｜User｜>"
R1_ASSISTANT = "<｜Assistant｜>"


class DataError(ValueError):
    """A data file or row that cannot be used; the message names the file, row and field."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptRow:
    """One training or evaluation prompt.

    Attributes:
      uid: stable id, ``"{file stem}:{row}"`` unless the row carries
        ``extra_info.index`` (then ``"{data_source}:{index}"``); online
        filtering keys its statistics by it.
      data_source: the row's ``data_source``.
      messages: the chat messages, ``({"role": ..., "content": ...}, ...)``.
      ability: ``"math"`` or ``"code"`` (as stored).
      ground_truth: ``reward_model.ground_truth`` as stored (string or JSON string).
      extra_info: the row's ``extra_info`` (a dict; ``{}`` when absent).
      token_ids: the rendered prompt's token ids, once ``tokenize_rows`` has
        read it (what the rollouts sample from); None before.
    """

    uid: str
    data_source: str
    messages: tuple[dict[str, str], ...]
    ability: str
    ground_truth: Any
    extra_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    token_ids: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    def as_verl_row(self) -> dict[str, Any]:
        """The row in the verl layout (what ``RewardItem.from_row`` reads)."""
        return {
            "data_source": self.data_source,
            "prompt": [dict(m) for m in self.messages],
            "ability": self.ability,
            "reward_model": {"ground_truth": self.ground_truth, "style": "rule"},
            "extra_info": dict(self.extra_info),
        }

    def difficulty(self, model: str) -> int | None:
        """Correct answers of ``model`` out of N from ``extra_info.model_difficulty``, if given."""
        table = self.extra_info.get("model_difficulty")
        if table is None:
            return None
        if isinstance(table, str):
            table = json.loads(table)
        value = table.get(model)
        return None if value is None else int(value)


# --------------------------------------------------------------------------- reading


def _field(row: Mapping[str, Any], name: str, where: str) -> Any:
    if name not in row or row[name] is None:
        raise DataError(f"{where}: missing field {name!r}")
    return row[name]


def _maybe_json(value: Any, name: str, where: str) -> Any:
    """A field stored either as an object or as its JSON string."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: field {name!r} is a string but not JSON: {e}") from None


def parse_row(row: Mapping[str, Any], where: str, default_uid: str) -> PromptRow:
    """Checks one raw row and builds a ``PromptRow``.

    Args:
      row: the raw mapping (a Parquet or JSON-lines record).
      where: ``"file:row"`` for error messages.
      default_uid: the uid when the row has no ``extra_info.index``.

    Raises:
      DataError: a missing or malformed field, named with ``where``.
    """
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: a row must be a mapping, got {type(row).__name__}")
    prompt = _field(row, "prompt", where)
    prompt = _maybe_json(prompt, "prompt", where)
    if not isinstance(prompt, Sequence) or isinstance(prompt, str) or not prompt:
        raise DataError(f"{where}: field 'prompt' must be a non-empty list of chat messages")
    messages = []
    for i, m in enumerate(prompt):
        if not isinstance(m, Mapping) or not {"role", "content"} <= set(m):
            raise DataError(f"{where}: prompt[{i}] must have 'role' and 'content'")
        role, content = m["role"], m["content"]
        if role not in ("system", "user", "assistant"):
            raise DataError(f"{where}: prompt[{i}].role {role!r} is not system/user/assistant")
        if not isinstance(content, str):
            raise DataError(f"{where}: prompt[{i}].content must be a string")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in messages):
        raise DataError(f"{where}: field 'prompt' has no user message")
    ability = _field(row, "ability", where)
    if not isinstance(ability, str) or not ability:
        raise DataError(f"{where}: field 'ability' must be a non-empty string")
    if find_reward(ability) is None:
        # every reward of such a row would be an error: refuse it before training
        raise DataError(
            f"{where}: ability {ability!r} has no verifier "
            f"(expected one of {', '.join(reward_names())}, or register one: docs/extending.md)"
        )
    reward_model = _field(row, "reward_model", where)
    reward_model = _maybe_json(reward_model, "reward_model", where)
    if not isinstance(reward_model, Mapping) or reward_model.get("ground_truth") is None:
        raise DataError(f"{where}: missing field 'reward_model.ground_truth'")
    extra = row.get("extra_info") or {}
    extra = _maybe_json(extra, "extra_info", where)
    if not isinstance(extra, Mapping):
        raise DataError(f"{where}: field 'extra_info' must be a mapping")
    source = row.get("data_source") or ""
    if not isinstance(source, str):
        raise DataError(f"{where}: field 'data_source' must be a string")
    index = extra.get("index")
    uid = f"{source}:{index}" if source and index is not None else default_uid
    return PromptRow(
        uid=uid,
        data_source=source,
        messages=tuple(messages),
        ability=ability,
        ground_truth=reward_model["ground_truth"],
        extra_info=dict(extra),
    )


def raw_rows(path: str) -> list[tuple[str, dict[str, Any]]]:
    """(``file:line`` or ``file:row N``, raw row) for every row of one file (1-based)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            if storage.is_gcs(path):
                with storage.path(path).open("rb") as f:
                    table = pq.read_table(f).to_pylist()
            else:
                table = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise DataError(f"{path}: not a readable Parquet file: {e}") from None
        return [(f"{path}: row {n + 1}", row) for n, row in enumerate(table)]
    if path.endswith((".jsonl", ".json")):
        rows = []
        try:
            f = storage.path(path).open("rb")  # closed below; lines decoded one by one
        except OSError as e:
            raise DataError(f"{path}: cannot read it: {e.strerror}") from None
        with f:
            for n, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start})"
                    ) from None
                if not line.strip():
                    continue
                try:
                    rows.append((f"{path}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not a JSON line: {e}") from None
        return rows
    raise DataError(f"{path}: unsupported file type (use .parquet or .jsonl)")


# --------------------------------------------------------------------------- prompts


def render_r1(messages: Sequence[Mapping[str, str]], *, think: bool = True) -> str:
    """The DeepSeek-R1-Distill chat format, ready for generation.

    ``<｜begin▁of▁sentence｜>{system}<｜User｜>{question}<｜Assistant｜><think>\\n``;
    earlier assistant turns end with ``<｜end▁of▁sentence｜>``.

    Args:
      messages: chat messages.
      think: open the reasoning block (``<think>\\n``) as the released template does.
    """
    system = "".join(m["content"] for m in messages if m["role"] == "system")
    parts = [R1_BOS, system]
    for m in messages:
        if m["role"] == "user":
            parts += [R1_USER, m["content"]]
        elif m["role"] == "assistant":
            parts += [R1_ASSISTANT, m["content"], R1_EOS]
    parts.append(R1_ASSISTANT + ("<think>\n" if think else ""))
    return "".join(parts)


def encode_prompts(
    rows: Sequence[PromptRow],
    encode: Callable[[str], Sequence[int]] | Any,
    *,
    max_prompt_length: int,
    render: Callable[[Sequence[Mapping[str, str]]], str] = render_r1,
) -> tuple[list[np.ndarray], list[int]]:
    """Renders and tokenizes prompts; drops those longer than ``max_prompt_length``.

    Args:
      rows: the prompts.
      encode: ``str -> token ids``, or a Hugging Face tokenizer (its
        ``encode(text, add_special_tokens=False)`` is used: the rendered text
        already holds the special tokens).
      max_prompt_length: longest prompt kept, in tokens.
      render: messages -> text (default ``render_r1``).

    Returns:
      (token arrays of the kept prompts, indices of the kept rows in ``rows``).
    """
    if hasattr(encode, "encode"):
        tokenizer = encode

        def encode(text):
            return tokenizer.encode(text, add_special_tokens=False)

    out, kept = [], []
    for i, row in enumerate(rows):
        ids = np.asarray(encode(render(row.messages)), np.int32)
        if len(ids) <= max_prompt_length:
            out.append(ids)
            kept.append(i)
    return out, kept


def tokenize_rows(
    rows: Sequence[PromptRow], tokenizer: Any, *, max_prompt_length: int
) -> tuple[list[PromptRow], list[int]]:
    """The rows whose prompt fits ``max_prompt_length``, each with its ``token_ids``.

    Prompts are tokenised here, once, where a job reads its data; the rollouts
    sample from ``row.token_ids``.

    Returns:
      (the kept rows in order, their indices in ``rows``).
    """
    ids, kept = encode_prompts(rows, tokenizer, max_prompt_length=max_prompt_length)
    return [dataclasses.replace(rows[i], token_ids=x) for i, x in zip(kept, ids)], kept


# --------------------------------------------------------------------------- filtering


def offline_filter(
    rows: Iterable[PromptRow],
    model: str,
    num_samples: int | Mapping[str, int],
    *,
    keep_unrated: bool = True,
) -> list[PromptRow]:
    """Drops prompts the base model solved 0 or all of N times (SPEC item 10).

    Args:
      rows: the prompts.
      model: the key in ``extra_info.model_difficulty``.
      num_samples: N, or N per ``ability`` (e.g. ``{"math": 16, "code": 8}``).
      keep_unrated: keep rows without an entry for ``model`` (default) or drop them.

    Raises:
      DataError: a rated row whose ability has no N in ``num_samples``.
    """
    out = []
    for row in rows:
        d = row.difficulty(model)
        if d is None:
            if keep_unrated:
                out.append(row)
            continue
        n = num_samples if isinstance(num_samples, int) else num_samples.get(row.ability)
        if n is None:
            assert not isinstance(num_samples, int)
            raise DataError(f"{row.uid}: no N for ability {row.ability!r} in {dict(num_samples)}")
        if 0 < d < n:
            out.append(row)
    return out


@dataclasses.dataclass
class AccuracyTracker:
    """Per-prompt accuracy over a stage, for online filtering (SPEC item 10).

    ``record`` adds a step's rewards; ``solved()`` lists the prompts whose
    accuracy (mean reward) over the stage is 1, every response at full credit (they
    are dropped at the start of the next stage; partial credit never solves a
    prompt); ``reset`` starts a new stage. The state is plain JSON
    (``state_dict`` / ``from_state_dict``), saved with the checkpoint.
    """

    counts: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def record(self, uid: str, rewards: Iterable[float]) -> None:
        r = [float(x) for x in rewards]
        c = self.counts.setdefault(uid, [0.0, 0.0])
        c[0] += sum(r)
        c[1] += len(r)

    def accuracy(self, uid: str) -> float | None:
        c = self.counts.get(uid)
        return None if not c or c[1] == 0 else c[0] / c[1]

    def solved(self) -> set[str]:
        return {u for u, (s, n) in self.counts.items() if n > 0 and s >= n}

    def reset(self) -> None:
        self.counts.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"counts": {u: list(c) for u, c in self.counts.items()}}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> AccuracyTracker:
        return cls(counts={u: [float(c[0]), float(c[1])] for u, c in state["counts"].items()})


def online_filter(rows: Iterable[PromptRow], solved: set[str]) -> list[PromptRow]:
    """Drops the prompts whose accuracy in the previous stage was 1."""
    return [r for r in rows if r.uid not in solved]


# --------------------------------------------------------------------------- batching


def prompt_batches(
    rows: Sequence[PromptRow],
    prompts_per_step: int,
    *,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> Any:
    """A ``grain.MapDataset`` whose element k is the list of step k's prompts (or a host's slice).

    The rows are shuffled anew each epoch (from ``seed``) and repeated without
    end; element k is computed from k alone, so a resumed run asks for its
    next step's index and gets exactly the prompts it would have seen. Only
    the rows of the batches asked for are read from ``rows`` (a lazy sequence
    such as ``tfds_data.TfdsRows`` decodes nothing else).

    With ``process_count`` n > 1, element k is host ``process_index``'s
    contiguous D_R / n of step k's prompts (pass ``jax.process_index()`` /
    ``jax.process_count()``): each host materialises only its slice, and the
    slices of hosts 0..n-1 in order are exactly the one-host batch.

    Args:
      rows: the stage's prompts (after filtering).
      prompts_per_step: D_R.
      seed: shuffle seed.
      process_index: this host's index in [0, process_count).
      process_count: hosts sharing each step's batch; must divide D_R.
    """
    import grain

    if prompts_per_step <= 0:
        raise ValueError(f"prompts_per_step must be positive, got {prompts_per_step}")
    if len(rows) < prompts_per_step:
        raise DataError(f"{len(rows)} prompts left, fewer than the {prompts_per_step} a step needs")
    if process_count <= 0 or prompts_per_step % process_count:
        raise ValueError(
            f"{process_count} hosts cannot share a batch of {prompts_per_step} prompts evenly"
        )
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    source = rows if isinstance(rows, Sequence) else list(rows)
    per_host = prompts_per_step // process_count
    batches = (
        grain.MapDataset.source(source)
        .shuffle(seed=seed)
        .repeat(None)
        .batch(per_host, batch_fn=list)
    )
    # host h's slice of step k is batch k * n + h of the per-host batches
    return batches if process_count == 1 else batches[process_index::process_count]
