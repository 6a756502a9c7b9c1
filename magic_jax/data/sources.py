"""Where prompt rows come from: ``read_rows`` over Parquet and JSON-lines files,
directories of them and prepared array_record datasets, and ``prepare_dataset``
(``magic-jax prepare-data``), which writes the latter."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from magic_jax import storage
from magic_jax.data.rows import DataError, PromptRow, parse_row, raw_rows
from magic_jax.data.tfds import NAME, is_tfds_dir, read_tfds_rows, write_dataset


def read_rows(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
) -> list[PromptRow]:
    """Reads and checks every row of one or more files (or directories of them).

    Args:
      paths: files (``.parquet``, ``.jsonl``) or directories; a directory
        contributes its ``.parquet`` and ``.jsonl`` files in sorted order, or,
        if ``magic-jax prepare-data`` wrote it, its array_record rows
        (``tfds_data``).

    Returns:
      The rows in file order.

    Raises:
      DataError: a missing file, an unsupported type, an unreadable file, a bad
        row, or two rows with the same uid.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    # a list, so that the error below still names them after the loop read a generator
    names = [os.fspath(p) for p in paths]
    files: list[str] = []
    for p in names:
        storage.check(p, what="data")
        where = storage.path(p) if storage.is_gcs(p) else Path(p)
        if is_tfds_dir(p):
            files.append(p)
        elif where.is_dir():
            files += sorted(
                str(f) for f in where.iterdir() if f.name.endswith((".parquet", ".jsonl"))
            )
        elif where.exists():
            files.append(p)
        else:
            raise DataError(f"{p}: no such file or directory")
    if not files:
        raise DataError(f"no .parquet or .jsonl files in {names}")
    out: list[PromptRow] = []
    seen: dict[str, str] = {}
    for path in files:
        if is_tfds_dir(path):
            for n, row in enumerate(read_tfds_rows(path)):
                if row.uid in seen:
                    raise DataError(f"{path}: record {n}: uid {row.uid!r} repeats {seen[row.uid]}")
                seen[row.uid] = f"{path}: record {n}"
                out.append(row)
            continue
        stem = os.path.splitext(os.path.basename(path))[0]
        raws = raw_rows(path)
        if not raws:
            raise DataError(f"{path}: holds no rows")
        # the default uid counts rows from 0 (stable across versions); messages give lines
        for n, (where, raw) in enumerate(raws):
            row = parse_row(raw, where, default_uid=f"{stem}:{n}")
            if row.uid in seen:
                raise DataError(f"{where}: uid {row.uid!r} repeats {seen[row.uid]}")
            seen[row.uid] = where
            out.append(row)
    return out


def prepare_dataset(
    rows: str | os.PathLike | Iterable[str | os.PathLike], out: str | os.PathLike
) -> Path:
    """Checks verl rows and writes them as an array_record tfds dataset.

    Args:
      rows: files (``.parquet`` / ``.jsonl``) or directories of them, as ``read_rows``.
      out: the dataset root (``data.train`` names it); must not hold a dataset yet.

    Returns:
      The directory of the written version (``out/verl_rows/1.0.0``).

    Raises:
      DataError: a bad row (named by file and line) or an ``out`` that already
        holds a dataset.
    """
    out = Path(out).absolute()
    if (out / NAME).exists():
        raise DataError(f"{out}: already holds a {NAME} dataset; choose a new --out")
    return write_dataset(read_rows(rows), out)
