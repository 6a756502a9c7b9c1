"""Prompt datasets in the tensorflow-datasets array_record format, written and read without TF.

``prepare_dataset`` (``magic-jax prepare-data ROWS... --out DIR``) checks verl
rows (Parquet / JSON lines, as ``data.read_rows``) and writes them, in order,
with a tfds builder as an array_record dataset under ``DIR/verl_rows/1.0.0``.
``data.train: DIR`` then reads it through ``tfds.data_source``: a random-access
sequence that decodes a record only when it is asked for, feeding the same
grain pipeline as the Parquet path (same prompts, same uids, same order, so
the same step-k batches and the same resume). Neither side imports TensorFlow.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

from magic_jax.data.rows import DataError, PromptRow, parse_row

NAME = "verl_rows"
VERSION = "1.0.0"
SPLIT = "train"


@functools.cache
def _builder_class() -> type:
    """The tfds builder of verl rows (defined once, on first use: tfds is slow to import)."""
    import tensorflow_datasets as tfds

    class VerlRows(tfds.core.GeneratorBasedBuilder):
        """verl prompt rows, one record each: the row as JSON and its uid, in input order."""

        name = NAME
        VERSION = tfds.core.Version(VERSION)

        def __init__(self, *, rows: Sequence[PromptRow] = (), **kwargs: Any):
            self._rows = rows
            super().__init__(**kwargs)

        def _info(self) -> Any:
            return tfds.core.DatasetInfo(
                builder=self,
                description="verl / Skywork-OR1 prompt rows (magic_jax prepare-data).",
                features=tfds.features.FeaturesDict(
                    {"uid": tfds.features.Text(), "row": tfds.features.Text()}
                ),
                # the records keep the input order: the trainer shuffles by its seed
                disable_shuffling=True,
            )

        def _split_generators(self, dl_manager: Any) -> dict[str, Iterator]:
            del dl_manager
            return {SPLIT: self._generate_examples()}

        def _generate_examples(self) -> Iterator[tuple[int, dict[str, str]]]:
            for i, row in enumerate(self._rows):
                yield i, {"uid": row.uid, "row": json.dumps(row.as_verl_row())}

    return VerlRows


def is_tfds_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory written by ``prepare_dataset``."""
    from magic_jax import storage

    return (storage.path(path) / NAME / VERSION / "dataset_info.json").is_file()


def write_dataset(rows: Sequence[PromptRow], out: str | os.PathLike) -> Path:
    """Writes checked rows, in order, as an array_record tfds dataset under ``out``.

    Returns:
      The directory of the written version (``out/verl_rows/1.0.0``).
    """
    builder = _builder_class()(rows=rows, data_dir=os.fspath(out), file_format="array_record")
    builder.download_and_prepare()
    return Path(out) / NAME / VERSION


class TfdsRows(Sequence[PromptRow]):
    """The rows of a prepared dataset as a lazy random-access sequence of ``PromptRow``.

    Only the records asked for are read and decoded, so a pipeline over it
    materialises just the prompts it batches.
    """

    def __init__(self, path: str | os.PathLike):
        import tensorflow_datasets as tfds

        from magic_jax import storage

        self.path = storage.path(path)
        # array_record's reader opens local files only: a gs:// dataset is copied to the
        # local cache first (prompt rows: small beside the model), once per machine
        local = storage.local_copy(path, what="data")
        try:
            self._source = tfds.data_source(NAME, data_dir=os.fspath(local), split=SPLIT)
        except Exception as e:  # tfds raises several types for a damaged directory
            raise DataError(f"{path}: not a readable {NAME} dataset: {e}") from None

    def __len__(self) -> int:
        return len(self._source)

    @overload
    def __getitem__(self, i: int) -> PromptRow: ...
    @overload
    def __getitem__(self, i: slice) -> list[PromptRow]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of {n}")
        i = i + n if i < 0 else i
        record = self._source[i]
        where = f"{self.path}: record {i}"

        def text(x: Any) -> str:
            return x.decode("utf-8") if isinstance(x, bytes) else str(x)

        try:
            raw = json.loads(text(record["row"]))
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: the row is not JSON: {e}") from None
        row = parse_row(raw, where, default_uid="")
        uid = text(record["uid"])
        return row if row.uid == uid else _with_uid(row, uid)


def _with_uid(row: PromptRow, uid: str) -> PromptRow:
    return dataclasses.replace(row, uid=uid)


def read_tfds_rows(path: str | os.PathLike) -> list[PromptRow]:
    """Every row of a prepared dataset, in order (the records are checked as they are read).

    Raises:
      DataError: an unreadable dataset or a bad record.
    """
    rows = TfdsRows(path)
    return [rows[i] for i in range(len(rows))]
