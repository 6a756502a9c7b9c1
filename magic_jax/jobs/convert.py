"""``magic-jax convert``: a Hugging Face model staged once as an orbax checkpoint that
every host of a run reads its own shards of.

The source is a Hugging Face Hub repo id (``org/name``, fetched with
``huggingface_hub.snapshot_download``: config, tokenizer and safetensors only), or a
local or ``gs://`` Hugging Face directory. The destination (local or ``gs://``) gets
``state/`` (orbax; arrays stored in chunks of at most ``--chunk-mb``, so a host whose
shards cover part of an array reads about that part, not the array), the tokenizer's
files, ``source.json`` (where the weights came from: repo id and resolved commit, or
the path) and ``model_config.json``, written last: a directory without it is an
unfinished conversion. ``model: DEST`` then gives a run its policy and tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from magic_jax import storage
from magic_jax.run.checkpoint import CONFIG_FILE, STATE_DIR

SOURCE_FILE = "source.json"
CHUNK_MB = 4.0
# A tokenizer's files (the Hub's layouts for fast, slow and sentencepiece tokenizers);
# never config.json: beside it the directory would read as a Hugging Face checkpoint.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_HUB_SMALL = ["config.json", *TOKENIZER_FILES]
_HUB_WEIGHTS = ["*.safetensors", "model.safetensors.index.json"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass
class Source:
    """A source resolved to a local Hugging Face directory, and where it came from."""

    local: Path
    label: str  # how messages name it: the repo id and revision, or the path
    record: dict[str, Any] = field(default_factory=dict)  # what source.json says


def add_parser(sub: Any) -> None:
    """Registers ``convert`` on the CLI's subparsers."""
    p = sub.add_parser(
        "convert",
        help="Hugging Face model (Hub repo id, local or gs:// dir) -> orbax checkpoint + tokenizer",
        description="Stages a Hugging Face model once (e.g. on the bucket) as an orbax "
        "checkpoint with its tokenizer and where it came from (source.json): a run with "
        "`model: OUT` reads on each host only that host's shards of it.",
    )
    p.add_argument("source", help="Hub repo id (org/name), or a local or gs:// HF directory")
    p.add_argument("out", help="new checkpoint directory (local or gs://)")
    p.add_argument("--revision", help="Hub branch, tag or commit (default: main)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="stored parameter dtype, kept by runs (fp32 master weights by default)",
    )
    p.add_argument("--mesh", help="e.g. fsdp=-1,tensor=4 (default: one device)")
    p.add_argument(
        "--chunk-mb",
        type=float,
        default=CHUNK_MB,
        help="largest stored chunk of an array: a host reads whole chunks (default 4)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a model already at OUT, once the new one is complete",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The ``convert`` command: prints where the model came from, then what was written."""
    from magic_jax.model.sharding import mesh_from_text

    if not args.chunk_mb > 0:
        raise ValueError(f"--chunk-mb {args.chunk_mb}: must be a positive number of MiB")
    t0 = time.perf_counter()
    record = convert(
        args.source,
        args.out,
        revision=args.revision,
        dtype=args.dtype,
        mesh=mesh_from_text(args.mesh),
        overwrite=args.overwrite,
        chunk_bytes=int(args.chunk_mb * 2**20),
    )
    print(
        f"converted {describe(record)} -> {args.out}: {record['parameters']:,} parameters "
        f"({args.dtype}) in {time.perf_counter() - t0:.1f}s"
    )
    return 0


def describe(record: dict[str, Any]) -> str:
    """One line naming a staged model's origin (``source.json``)."""
    if "commit" in record:
        return f"{record['repo_id']} (revision {record['revision']}, commit {record['commit']})"
    return record["path"]


def convert(
    source: str,
    out: str,
    *,
    revision: str | None = None,
    dtype: str = "float32",
    mesh: Any = None,
    overwrite: bool = False,
    chunk_bytes: int = int(CHUNK_MB * 2**20),
    log: Any = print,
) -> dict[str, Any]:
    """Stages ``source`` at ``out``; returns what ``source.json`` records.

    Raises:
      FileExistsError: ``out`` holds a model (without ``overwrite``) or other files.
      ValueError: the source, its tokenizer or its weights cannot be used, in one line.
    """
    from magic_jax.model.convert import load_hf
    from magic_jax.model.qwen2 import count_params

    replacing = check_out(out, source, overwrite=overwrite)
    src = resolve(source, revision)
    tokenizer = tokenizer_files(src)
    log(f"source: {describe(src.record)}")
    if "repo_id" in src.record:  # the weights, at the commit the tokenizer came from
        _hub_download(src.record["repo_id"], src.record["commit"], _HUB_WEIGHTS + _HUB_SMALL)
    model = load_hf(src.local, dtype=dtype, mesh=mesh)
    record = src.record | {
        "dtype": dtype,
        "parameters": count_params(model),
        "chunk_bytes": chunk_bytes,
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    where = _sibling(out, ".partial") if replacing or not storage.is_gcs(out) else out
    _write(model, where, chunk_bytes, tokenizer, record)
    if where != out:
        _put_in_place(where, out)
    return record


# --------------------------------------------------------------------------- the source


def resolve(source: str, revision: str | None) -> Source:
    """A local Hugging Face directory holding ``source`` (a ``gs://`` one copied once)."""
    if storage.is_gcs(source) or Path(source).expanduser().exists():
        if revision is not None:
            raise ValueError(f"--revision {revision}: applies to a Hub repo id, not to {source}")
        if storage.is_gcs(source):
            uri = str(source).rstrip("/")
            local = storage.local_copy(uri, what="source", only=_hf_file)
            return Source(local, uri, {"path": uri})
        local = Path(source).expanduser().absolute()
        if not local.is_dir():
            raise NotADirectoryError(f"source {local}: not a directory")
        return Source(local, str(local), {"path": str(local)})
    if not _REPO_ID.fullmatch(source):
        raise FileNotFoundError(
            f"source {source}: no such directory, and not a Hub repo id (org/name)"
        )
    local = _hub_download(source, revision, _HUB_SMALL)
    record = {"repo_id": source, "revision": revision or "main", "commit": local.name}
    return Source(local, f"{source}@{revision or 'main'}", record)


def _hf_file(rel: str) -> bool:
    """The files of a Hugging Face directory that a conversion reads."""
    names = ("config.json", "model.safetensors.index.json", *TOKENIZER_FILES)
    return "/" not in rel and (rel.endswith(".safetensors") or rel in names)


def _hub_download(repo: str, revision: str | None, patterns: list[str]) -> Path:
    """``snapshot_download`` of the files matching ``patterns``; Hub errors in one line."""
    import huggingface_hub as hub
    from huggingface_hub import errors

    what = f"source {repo}" + (f" (revision {revision})" if revision else "")
    try:
        return Path(hub.snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except errors.RevisionNotFoundError:
        raise ValueError(f"{what}: the Hub has no such revision") from None
    except errors.GatedRepoError:
        raise ValueError(
            f"{what}: a gated repo; accept its terms on the Hub, then `hf auth login`"
        ) from None
    except errors.RepositoryNotFoundError:
        raise FileNotFoundError(
            f"{what}: no such directory here, and no such repo on the Hub (or it is private: "
            "`hf auth login`)"
        ) from None
    except errors.LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"{what}: not in the Hugging Face cache ({hub.constants.HF_HUB_CACHE}) and the Hub "
            f"cannot be reached{' (HF_HUB_OFFLINE is set)' if hub.constants.HF_HUB_OFFLINE else ''}"
        ) from None
    except (errors.HfHubHTTPError, errors.HFValidationError, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"{what}: {first}") from None


def tokenizer_files(src: Source) -> list[Path]:
    """The tokenizer's files beside the weights, checked to load on their own.

    Raises:
      ValueError: there are none, or they do not load without the weights' config.
    """
    import shutil
    import tempfile

    from magic_jax.run.policy import load_tokenizer

    files = [src.local / n for n in TOKENIZER_FILES if (src.local / n).is_file()]
    if not any(f.name in ("tokenizer.json", "tokenizer_config.json") for f in files):
        raise FileNotFoundError(
            f"source {src.label}: no tokenizer (tokenizer.json or tokenizer_config.json "
            "beside config.json); a converted model carries its tokenizer"
        )
    tmp = Path(tempfile.mkdtemp(prefix="magic-jax-tokenizer-"))
    try:
        for f in files:
            shutil.copyfile(f, tmp / f.name)
        load_tokenizer(tmp)  # as a run will read it: these files alone
    except Exception as e:  # transformers raises many types for a broken tokenizer
        reason = str(e).split(f"{tmp}: ", 1)[-1]
        raise ValueError(f"source {src.label}: its tokenizer does not load: {reason}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return files


# --------------------------------------------------------------------------- the destination


def check_out(out: str, source: str, *, overwrite: bool) -> bool:
    """Whether ``out`` holds a model that ``overwrite`` replaces; refuses what it must.

    Raises:
      FileExistsError: ``out`` holds a model (without ``overwrite``), or files that are
        not a model, or is the source itself.
      ValueError: ``out`` or a parent of it is a file; the bucket cannot be used.
    """
    storage.check(out, what="out")
    p = storage.path(out)
    if not storage.is_gcs(out):
        for q in (p, *p.parents):
            if q.exists() and not q.is_dir():
                raise NotADirectoryError(f"out {p}: {q} is a file, not a directory")
    if _same(source, out):
        raise FileExistsError(f"out {p}: is the source; choose another directory")
    names = _names(p)
    if not names:
        return False
    held = _holds(p, names)
    if held is None:
        raise FileExistsError(
            f"out {p}: not empty ({sorted(names)[0]}) and not a model; refusing to overwrite it"
        )
    if not overwrite:
        raise FileExistsError(
            f"out {p}: holds {held}; refusing to overwrite it (--overwrite replaces it once "
            "the new model is complete)"
        )
    left = _sibling(out, ".replaced")
    if _names(storage.path(left)):
        raise FileExistsError(
            f"out {p}: {left} holds the model an interrupted --overwrite moved aside; move it "
            "back or delete it first"
        )
    return True


def _same(source: str, out: str) -> bool:
    if storage.is_gcs(source) or storage.is_gcs(out):
        return str(source).rstrip("/") == str(out).rstrip("/")
    return Path(source).expanduser().resolve() == Path(out).expanduser().resolve()


def _names(p: Any) -> set[str]:
    """The top-level names under a directory or ``gs://`` prefix (empty if absent)."""
    if storage.is_gcs(p):
        return {rel.split("/", 1)[0] for rel in storage.listing(p)}
    return {q.name for q in p.iterdir()} if p.is_dir() else set()


def _holds(p: Any, names: set[str]) -> str | None:
    """What kind of model the directory holds, in words (None: not a model)."""
    if SOURCE_FILE in names and CONFIG_FILE in names:
        try:
            return f"a model converted from {describe(json.loads((p / SOURCE_FILE).read_text()))}"
        except (OSError, ValueError, KeyError):
            return "a magic_jax model"
    if CONFIG_FILE in names:
        return "a magic_jax model"
    if "config.json" in names:
        return "a Hugging Face model"
    if STATE_DIR in names:
        return f"an unfinished conversion (no {CONFIG_FILE})"
    return None


def _sibling(out: str, suffix: str) -> str:
    return str(storage.path(out)).rstrip("/") + suffix


def _write(model: Any, where: str, chunk_bytes: int, tokenizer: list[Path], record: dict) -> None:
    """The parameters (orbax, chunked), then the tokenizer and ``source.json``, then
    ``model_config.json``: written last, it makes the directory a model."""
    import dataclasses

    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    if jax.process_index() == 0:
        storage.remove_tree(where)  # what an interrupted conversion left there
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("convert: destination cleared")
    path = storage.path(where)
    state = nnx.state(model, nnx.Param)
    chunks = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=chunk_bytes), state)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / STATE_DIR, state, save_args=chunks)
        ckptr.wait_until_finished()
    if jax.process_index() != 0:
        return
    for f in tokenizer:
        (path / f.name).write_bytes(f.read_bytes())
    storage.write_text(path / SOURCE_FILE, json.dumps(record, indent=2) + "\n")
    storage.write_text(path / CONFIG_FILE, json.dumps(dataclasses.asdict(model.config), indent=2))


def _put_in_place(new: str, out: str) -> None:
    """Moves the finished ``new`` to ``out``; a model there is moved aside first and
    deleted only once ``out`` holds the new one."""
    import jax

    if jax.process_index() != 0:
        return
    old = _sibling(out, ".replaced")
    held = bool(_names(storage.path(out)))
    if held:
        storage.move_tree(storage.path(out), storage.path(old))
    elif not storage.is_gcs(out) and Path(out).exists():
        os.rmdir(Path(out))  # an empty directory
    storage.move_tree(storage.path(new), storage.path(out))
    if held:
        storage.remove_tree(storage.path(old))


__all__ = [
    "SOURCE_FILE",
    "TOKENIZER_FILES",
    "Source",
    "add_parser",
    "check_out",
    "convert",
    "describe",
    "resolve",
    "run",
    "tokenizer_files",
]
