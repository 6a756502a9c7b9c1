"""A checkpoint's manifest: every file's size and checksum, written last, so a
checkpoint counts only once it is whole and verifies only while it still matches.

Locally a file's checksum is its SHA-256; on ``gs://`` the CRC32C that Cloud Storage
keeps for every object (verifying reads one listing, nothing is downloaded). A
checkpoint copied between kinds of storage is checked by content.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from magic_jax import storage
from magic_jax.run.rundir import write_atomic

if TYPE_CHECKING:
    from magic_jax.run.rundir import JSON
    from magic_jax.storage import StoragePath

MANIFEST = "manifest.json"


def first_line(e: BaseException) -> str:
    """An exception in one line: its type and the first 300 characters of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def listed_files(path: StoragePath) -> dict[str, JSON]:
    """Every file under ``path`` except the manifest: relative POSIX path -> facts.

    Locally the facts are the size; on GCS the size and the CRC32C that Cloud
    Storage keeps for every object (one listing, nothing downloaded).
    """
    if storage.is_gcs(path):
        found = storage.listing(path)
        return {rel: found[rel] for rel in sorted(found) if rel != MANIFEST}
    out = {}
    for dirpath, _, names in os.walk(path):
        for name in names:
            file = Path(dirpath, name)
            rel = file.relative_to(path).as_posix()
            if rel != MANIFEST:
                out[rel] = {"size": file.stat().st_size}
    return dict(sorted(out.items()))


def sha256(path: StoragePath) -> str:
    """The SHA-256 of a file's content (read in 4 MiB pieces)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(path: str | os.PathLike) -> JSON:
    """Records every file of a finished checkpoint in ``manifest.json``: its size and
    SHA-256 (local), or its size and the CRC32C Cloud Storage computed (``gs://``)."""
    ckpt = storage.path(path)
    files = {}
    for rel, facts in listed_files(ckpt).items():
        if storage.is_gcs(ckpt):
            files[rel] = {"size": facts["size"], "crc32c": facts["crc32c"]}
        else:
            files[rel] = {"size": facts["size"], "sha256": sha256(ckpt / rel)}
    manifest = {"format": 1, "files": files}
    write_atomic(ckpt / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def mismatch(path: StoragePath) -> str | None:
    """How the files under ``path`` differ from its manifest (None: they match): a
    missing or unreadable manifest, a file missing, of another size or checksum, or
    a file the manifest does not list."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not an object")
    except FileNotFoundError:
        return f"no {MANIFEST} (its writing never finished)"
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({first_line(e)})"
    try:
        present = listed_files(path)
        for rel, entry in files.items():
            if rel not in present:
                return f"{rel} is missing"
            size = present[rel]["size"]
            if size != entry["size"]:
                return f"{rel} has {size} bytes, the manifest says {entry['size']}"
            if "crc32c" in entry and "crc32c" in present[rel]:
                same = present[rel]["crc32c"] == entry["crc32c"]
            else:  # a checksum of the content (a run directory copied between kinds of storage)
                same = sha256(path / rel) == entry.get("sha256")
            if not same:
                return f"{rel} does not match its checksum"
    except (OSError, KeyError, TypeError) as e:
        return f"cannot be read ({first_line(e)})"
    extra = sorted(set(present) - set(files))
    return f"{extra[0]} is not in the manifest" if extra else None
