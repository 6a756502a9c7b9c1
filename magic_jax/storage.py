"""Paths on Cloud Storage (``gs://``) or the local disk, through etils ``epath``.

Every path a user gives (model, tokenizer, data, output directory, checkpoints,
exports) may be a ``gs://bucket/...`` URI. ``path`` turns it into an
``epath.Path`` (gcsfs underneath; orbax and TensorStore read and write the same
URIs themselves), or a local path into an absolute ``pathlib.Path``, resolved
once where it enters. ``check`` asks the bucket once, up front, so an
unreachable endpoint, missing credentials or a missing bucket stop a command in
one line naming the path, before anything is written.

Local emulators: ``STORAGE_EMULATOR_HOST`` (``http://127.0.0.1:9023``) is the
variable Google's clients and gcsfs read; ``configure`` also points TensorStore
(``TENSORSTORE_GCS_HTTP_URL``) at it, and gives TensorStore a dummy token, so
the whole stack (records, locks, orbax) talks to the emulator. A
``TENSORSTORE_GCS_HTTP_URL`` already set is kept.

GCS objects cannot be appended to: record files are rewritten whole (see
``monitor``), small files are written in one upload (atomic on GCS).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
TS_URL_ENV = "TENSORSTORE_GCS_HTTP_URL"
TS_TOKEN_ENV = "GOOGLE_AUTH_TOKEN_FOR_TESTING"
CACHE_ENV = "MAGIC_JAX_GCS_CACHE"
# seconds one check of a bucket may take (retries included) before it counts as unreachable
CHECK_TIMEOUT_ENV = "MAGIC_JAX_GCS_CHECK_TIMEOUT_S"
CHECK_TIMEOUT_S = 20.0


# the exit status of a command a full local disk ended (sysexits' EX_IOERR)
DISK_FULL_EXIT = 74
# the exit status of a command a Cloud Storage fault ended after its clients' retries
# (sysexits' EX_UNAVAILABLE): the same command resumes once the bucket answers again
UNAVAILABLE_EXIT = 69


# What ``path`` gives: an ``epath.Path`` for ``gs://`` (etils ships no types, so mypy reads
# it as Any) or a ``pathlib.Path``; the run's modules name storage paths by this.
StoragePath = Any


class StorageError(ValueError):
    """A ``gs://`` path that cannot be used; the message names it and why, in one line."""


def is_gcs(p: Any) -> bool:
    """True for a ``gs://`` URI (a string or an ``epath.Path`` of one)."""
    return str(p).startswith("gs://")


def configure() -> None:
    """Points TensorStore and gcsfs at ``STORAGE_EMULATOR_HOST`` when it is set.

    Called before the first ``gs://`` access (``path`` calls it); harmless to
    call again. Without an emulator it only turns off gcsfs's listing cache, so
    one process sees what another wrote (multi-host runs list checkpoints one
    process wrote).
    """
    _configure_once(os.environ.get(EMULATOR_ENV, ""))


@functools.cache
def _configure_once(emulator: str) -> None:
    if emulator:
        url = emulator if "://" in emulator else f"http://{emulator}"
        os.environ.setdefault(TS_URL_ENV, url)
        os.environ.setdefault(TS_TOKEN_ENV, "emulator")
        # gcsfs asks a bucket's layout through the control API, which emulators lack
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        logging.getLogger("gcsfs").setLevel(logging.ERROR)
    import fsspec.config

    for proto in ("gs", "gcs"):
        conf = fsspec.config.conf.setdefault(proto, {})
        conf.setdefault("use_listings_cache", False)
        if emulator:
            conf.setdefault("token", "anon")  # emulators take no credentials


def path(p: str | os.PathLike, *, what: str | None = None) -> StoragePath:
    """``p`` as a path object: ``epath.Path`` for ``gs://``, else an absolute ``pathlib.Path``.

    Args:
      p: a local path or a ``gs://bucket/...`` URI.
      what: with it, a bad URI (``gs://`` without a bucket) is refused naming ``what``.
    """
    if isinstance(p, Path):
        return p.absolute()
    s = os.fspath(p)
    if is_gcs(s):
        bucket = s[len("gs://") :].split("/", 1)[0]
        if not bucket:
            raise StorageError(f"{what or 'path'} {s}: no bucket name after gs://")
        configure()
        from etils import epath

        return epath.Path(s)
    return Path(s).expanduser().absolute()


def split(uri: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` -> (``bucket``, ``a/b``)."""
    rest = str(uri)[len("gs://") :]
    bucket, _, key = rest.partition("/")
    return bucket, key.strip("/")


def client() -> Any:
    """A ``google.cloud.storage.Client`` (anonymous against an emulator).

    Raises:
      StorageError: no credentials are configured.
    """
    configure()
    return _client(os.environ.get(EMULATOR_ENV, ""))


@functools.cache
def _client(emulator: str) -> Any:
    import google.auth.exceptions
    from google.cloud import storage

    if emulator:
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project="emulator", credentials=AnonymousCredentials())
    try:
        return storage.Client()
    except google.auth.exceptions.DefaultCredentialsError:
        raise StorageError(
            "no Google Cloud credentials: run `gcloud auth application-default login` (on a TPU "
            "VM, give the VM a service account with access to the bucket)"
        ) from None


def check(p: str | os.PathLike, *, what: str) -> None:
    """Asks the bucket of a ``gs://`` path once; does nothing for a local path.

    Raises:
      StorageError: one line naming ``what`` and ``p``: unreachable endpoint,
        missing credentials, missing bucket, or access denied.
    """
    if not is_gcs(p):
        return
    uri = str(p)
    bucket, key = split(uri)
    if not bucket:
        raise StorageError(f"{what} {uri}: no bucket name after gs://")
    try:
        c = client()
    except StorageError as e:
        raise StorageError(f"{what} {uri}: {e}") from None
    reason = _ask(c, bucket, key)
    if reason:
        raise StorageError(f"{what} {uri}: {reason}")


def _ask(c: Any, bucket: str, key: str) -> str | None:
    import google.api_core.exceptions as gex
    import google.auth.exceptions
    import requests
    from google.api_core import retry as retries

    where = os.environ.get(EMULATOR_ENV) or "storage.googleapis.com"
    limit = float(os.environ.get(CHECK_TIMEOUT_ENV) or CHECK_TIMEOUT_S)
    retry = retries.Retry(timeout=limit, initial=0.5, maximum=4.0)
    try:
        found = c.list_blobs(bucket, prefix=key, max_results=1, timeout=limit, retry=retry)
        next(iter(found), None)
    except gex.NotFound:
        return f"the bucket {bucket} does not exist"
    except (gex.Forbidden, gex.Unauthorized) as e:
        return f"access to the bucket {bucket} denied ({e.code}: {_short(e)})"
    except google.auth.exceptions.GoogleAuthError as e:
        return f"the credentials do not work ({_short(e)})"
    except (requests.exceptions.ConnectionError, requests.exceptions.Timeout, gex.RetryError):
        return f"cannot reach Cloud Storage at {where}"
    except gex.GoogleAPICallError as e:
        return f"Cloud Storage answered {e.code}: {_short(e)}"
    return None


def failure_line(e: BaseException) -> tuple[str, int] | None:
    """(one line, exit status) when ``e`` is Cloud Storage failing after its client's
    retries (``UNAVAILABLE_EXIT``) or a full local disk (``DISK_FULL_EXIT``); else None."""
    if (text := describe_failure(e)) is not None:
        return text, UNAVAILABLE_EXIT
    if (text := describe_disk_full(e)) is not None:
        return text, DISK_FULL_EXIT
    return None


def describe_failure(e: BaseException) -> str | None:
    """One line naming the object and the fault, when ``e`` (or what caused it) is a
    Cloud Storage request that failed after its client's retries; else None.

    gcsfs's errors do not name the object (a 503 reads "We encountered an internal
    error. Please try again., 503"; a 404 is the bare request URL), so the object is
    read from the request gcsfs was making (its ``_call`` frame) or from the URL.
    """
    import re
    import urllib.parse

    if type(e).__module__.startswith("magic_jax"):
        return None  # the library's own errors are one line already
    for x in _chain(e):
        fault = _fault(x)
        if fault is not None:
            url = _request_url(x) or str(x)
            m = re.search(r"(?:^|/)b/([^/?]+)/o(?:/([^?\s]+)|\?(?:[^\s]*&)?name=([^&\s]+))", url)
            if m:
                key = urllib.parse.unquote(m.group(2) or m.group(3))
                what = f"gs://{m.group(1)}/{key}"
            else:
                m = re.search(r"gs://[^\s\"']+", str(x))
                what = m.group(0) if m else "a request"
            return f"Cloud Storage failed on {what}: {fault}, after the client's retries"
    return None


def describe_disk_full(e: BaseException) -> str | None:
    """One line naming the full disk, when ``e`` (or what caused it) is a write that
    found no space (ENOSPC, a quota, TensorStore's RESOURCE_EXHAUSTED on a local file);
    else None. What was saved before stays: every file the library writes is written
    whole or not at all, and a checkpoint is used only once it is complete."""
    import errno
    import shutil

    for x in _chain(e):
        text = str(x)
        full = (isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT)) or (
            "No space left on device" in text
            or "Disk quota exceeded" in text
            or ("RESOURCE_EXHAUSTED" in text and "local file" in text)
        )
        if full:
            where = getattr(x, "filename", None) or _local_file(text) or _path_local(x)
            run_dir = next((d for y in _chain(e) if (d := getattr(y, _RUN_DIR, None))), None)
            if where is None and run_dir is not None:  # e.g. a write in another thread
                usage = shutil.disk_usage(_existing(Path(run_dir)))
                if usage.free < max(64 * 2**20, usage.total // 100):  # that disk is full
                    where = run_dir
                else:
                    return (
                        f"no space left on a local disk (the run directory {run_dir} has "
                        f"{usage.free / 2**30:.1f} GiB free); free some and run the same "
                        "command to resume"
                    )
            if where is None:
                return "no space left on a local disk; free some and run the same command to resume"
            where = Path(os.fspath(where))
            free = shutil.disk_usage(_existing(where)).free
            return (
                f"no space left on the disk holding {where} ({free / 2**20:.1f} MiB free); "
                "free some and run the same command to resume"
            )
    return None


_RUN_DIR = "_magic_jax_run_dir"


@contextlib.contextmanager
def writing_into(run_dir: Path) -> Iterator[Path]:
    """Marks an error escaping the block with the local run directory it was writing
    into, for ``describe_disk_full`` when the error names no file (a buffered write
    that failed in a checkpointer's thread, say)."""
    try:
        yield run_dir
    except Exception as e:
        if not is_gcs(run_dir):
            with contextlib.suppress(AttributeError):  # an exception type with __slots__
                setattr(e, _RUN_DIR, os.fspath(run_dir))
        raise


def _existing(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _chain(e: BaseException | None) -> Iterator[BaseException]:
    """``e`` and what caused it, as a traceback shows them (a suppressed context is not)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = (
            e.__cause__
            if e.__cause__ is not None
            else (None if e.__suppress_context__ else e.__context__)
        )


def _local_file(text: str) -> str | None:
    import re

    m = re.search(r'local file "([^"]+)"', text)
    return m.group(1) if m else None


def _path_local(e: BaseException) -> str | None:
    """The innermost local path among the frames ``e`` passed through: a file the frame
    had open (a buffered write's ENOSPC comes at ``close`` and names no file), else a
    variable holding an absolute path."""
    found, tb = None, e.__traceback__
    while tb is not None:
        found = _frame_path(tb.tb_frame.f_locals) or found
        tb = tb.tb_next
    return found


def _frame_path(names: Mapping[str, Any]) -> str | None:
    import io

    for v in names.values():  # a file open for writing (a read's file is not the full one)
        if isinstance(v, io.IOBase) and set(getattr(v, "mode", "")) & set("wax+"):
            name = getattr(v, "name", None)
            if isinstance(name, str) and not name.startswith("<"):  # not <stderr>
                return os.path.abspath(name)
    for name in ("tmp", "path", "p", "file", "filename", "dest", "target", "local"):
        v = names.get(name)
        if isinstance(v, (str, os.PathLike)) and os.path.isabs(os.fspath(v)):
            return os.fspath(v)
    return None


def _fault(e: BaseException) -> str | None:
    """What went wrong, if ``e`` is a Cloud Storage client's error; else None."""
    module = type(e).__module__
    if module.startswith("gcsfs") and hasattr(e, "code"):
        return f"{e.code} {_short(e).removesuffix(f', {e.code}')}"
    if module.startswith("google.api_core") and hasattr(e, "code"):
        return f"{int(e.code)} {_short(e)}"
    if module.startswith(("aiohttp", "requests", "urllib3")):
        return f"{type(e).__name__} ({_short(e)})"
    if isinstance(e, FileNotFoundError) and "/storage/v1/b/" in str(e):
        return "404 the object or upload session is gone"
    return None


def _request_url(e: BaseException) -> str | None:
    """The URL of the request gcsfs was making when ``e`` was raised (its frames)."""
    import urllib.parse

    tb, url = e.__traceback__, None
    while tb is not None:
        code, f = tb.tb_frame.f_code, tb.tb_frame.f_locals
        if code.co_name in ("_call", "_request") and "gcsfs" in code.co_filename:
            path, args = f.get("path"), f.get("args") or ()
            if isinstance(path, str):
                try:
                    url = path.format(*(urllib.parse.quote(str(a), safe="") for a in args))
                except (IndexError, KeyError, ValueError):
                    url = path
        tb = tb.tb_next
    return url


def _short(e: BaseException) -> str:
    text = getattr(e, "message", None) or str(e)
    return text.strip().splitlines()[0][:200] if text.strip() else type(e).__name__


def write_text(p: Any, text: str) -> None:
    """Writes ``text`` whole or not at all: a temporary file and a rename locally, one
    upload (atomic) on GCS."""
    if is_gcs(p):
        path(p).write_text(text)
        return
    p = Path(p)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)


def gcs_fs() -> Any:
    """The gcsfs file system (fsspec), configured for the emulator when one is set."""
    configure()
    import fsspec

    return fsspec.filesystem("gs")


def listing(root: Any) -> dict[str, dict[str, Any]]:
    """Every object under a ``gs://`` prefix: relative path -> {size, crc32c, generation}.

    One listing request (paged), no reads: what a checkpoint manifest is checked against.
    """
    fs = gcs_fs()
    base = str(root).rstrip("/")
    fs.invalidate_cache()
    try:
        found = fs.find(base, detail=True)
    except FileNotFoundError:
        return {}
    out = {}
    for name, info in found.items():
        if info.get("type") == "directory":
            continue
        rel = name[len(base.removeprefix("gs://")) :].lstrip("/")
        out[rel] = {
            "size": int(info.get("size") or 0),
            "crc32c": info.get("crc32c"),
            "generation": info.get("generation"),
        }
    return out


def remove_tree(p: Any) -> None:
    """Deletes a directory (or ``gs://`` prefix) and everything under it, if present."""
    if is_gcs(p):
        fs = gcs_fs()
        if fs.exists(str(p)):
            fs.rm(str(p), recursive=True)
        return
    import shutil

    if Path(p).exists():
        shutil.rmtree(p)


def move_tree(src: Any, dest: Any) -> None:
    """Moves a directory (locally a rename; on GCS a server-side copy, then delete).

    On GCS every step may be repeated: a copy (a rewrite) of an object already copied
    writes it again, and the deletes are one batch that passes over objects already
    gone. A delete whose reply was lost and was retried finds its object gone (404),
    which gcsfs's own ``mv`` (copy, then one delete per object) raises as
    ``FileNotFoundError``.
    """
    if is_gcs(src):
        fs = gcs_fs()
        src, dest = str(src).rstrip("/"), str(dest).rstrip("/")
        names = listing(src)
        for rel in names:
            fs.copy(f"{src}/{rel}", f"{dest}/{rel}")
        if names:
            with contextlib.suppress(FileNotFoundError):  # every object was gone already
                fs.rm([f"{src}/{rel}" for rel in names])
        return
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    os.replace(src, dest)


def local_copy(
    p: str | os.PathLike, *, what: str, only: Callable[[str], bool] | None = None
) -> Path:
    """A local directory (or file) holding what ``p`` holds: ``p`` itself when local.

    A ``gs://`` model or tokenizer directory is downloaded once into the cache
    (``$MAGIC_JAX_GCS_CACHE``, default ``~/.cache/magic-jax/gcs``), keyed by the
    URI; a file already there with the object's size and CRC32C is not fetched
    again, so every worker of a slice gets its own copy and a restarted run
    reuses it (a model converted by ``magic-jax convert`` is not copied: orbax
    reads each host's shards from the bucket). ``only`` picks the files to copy
    by their relative path (a tokenizer's files beside a checkpoint's weights).

    Raises:
      StorageError: the bucket cannot be used, or nothing is at ``p``.
    """
    if not is_gcs(p):
        return Path(p)
    uri = str(p).rstrip("/")
    check(uri, what=what)
    objects = {k: v for k, v in listing(uri).items() if only is None or only(k)}
    fs = gcs_fs()
    if not objects:
        if not fs.exists(uri):
            raise StorageError(f"{what} {uri}: nothing there")
        objects = {"": {"size": fs.info(uri)["size"], "crc32c": fs.info(uri).get("crc32c")}}
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "magic-jax" / "gcs")
    bucket, key = split(uri)
    dest = root / bucket / key
    for rel, info in sorted(objects.items()):
        target = dest / rel if rel else dest
        src = f"{uri}/{rel}" if rel else uri
        stamp = target.with_name(f".{target.name}.crc32c")
        if (
            target.is_file()
            and target.stat().st_size == info["size"]
            and stamp.is_file()
            and stamp.read_text() == str(info["crc32c"])
        ):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
        fs.get_file(src, str(tmp))
        os.replace(tmp, target)
        stamp.write_text(str(info["crc32c"]))
    return dest


@contextlib.contextmanager
def staged(
    p: str | os.PathLike, *, upload: bool = True, between: Callable[[], None] | None = None
) -> Iterator[Path]:
    """A local directory to write what belongs at ``p``: ``p`` itself when local.

    For a ``gs://`` destination, files are written to a temporary directory and
    uploaded to ``p`` when the block ends without an error (only when
    ``upload``: the other processes of a multi-host job stage nothing), then the
    temporary copy is removed. Tools that write with plain ``open`` (safetensors,
    tokenizers, plots) so write to the bucket. ``between`` is called between two
    files' uploads (the export's kill point, for the fault campaign).
    """
    if not is_gcs(p):
        yield Path(p)
        return
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="magic-jax-stage-"))
    try:
        yield tmp
        if upload:
            fs = gcs_fs()
            dest = str(p).rstrip("/")
            for i, file in enumerate(f for f in sorted(tmp.rglob("*")) if f.is_file()):
                if i and between is not None:
                    between()  # some of the files are on the bucket
                fs.put_file(str(file), f"{dest}/{file.relative_to(tmp).as_posix()}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
