"""What ``tpu_scripts/launch.sh`` reads back from its stage through the storage layer
(``magic_jax/storage.py``'s client), in its supervisor's process:
the workers' heartbeats (``STAGE/beats/RUN/worker-N``, one line ``N SEQ STATUS BOOT``) and
their logs (``STAGE/logs/RUN/worker-N.log``), which each worker writes with ``gcloud
storage cp`` (``tpu_scripts/worker_run.sh``). Each read is one listing of the prefix,
then its objects one by one, every request within ``READ_TIMEOUT_S``; a local directory
stands for a stage too. A read that fails comes out as ``jobs/pod_errors.py``'s
``TpuError``: its line says what the bucket answered, and its fix names the missing role
or the login.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

from magic_jax import storage
from magic_jax.jobs import pod_errors

# seconds one request to the bucket may take (a status cycle waits for it)
READ_TIMEOUT_S = 15.0


def objects(prefix: str, pick: Callable[[str], bool] = bool) -> dict[str, bytes]:
    """The objects right under ``prefix`` that ``pick`` takes, by their name after it.

    Args:
      prefix: ``gs://BUCKET/KEY`` or a local directory; nothing there is no object.
      pick: takes an object's name (after ``prefix/``) or not.

    Raises:
      Whatever the storage client raises (``unreadable`` tells it).
    """
    if not storage.is_gcs(prefix):
        root = Path(prefix)
        if not root.is_dir():
            return {}
        found = (p for p in sorted(root.iterdir()) if p.is_file() and pick(p.name))
        return {p.name: p.read_bytes() for p in found}
    from google.api_core import retry as retries

    bucket, key = storage.split(prefix)
    retry = retries.Retry(timeout=READ_TIMEOUT_S, initial=0.5, maximum=4.0)
    client = storage.client()
    out = {}
    listed = client.list_blobs(bucket, prefix=f"{key}/", timeout=READ_TIMEOUT_S, retry=retry)
    for blob in listed:
        name = blob.name[len(key) + 1 :]
        if "/" not in name and pick(name):
            out[name] = blob.download_as_bytes(timeout=READ_TIMEOUT_S, retry=retry)
    return out


def unreadable(e: BaseException, prefix: str) -> pod_errors.TpuError:
    """``e``, an error reading ``prefix``, told apart: its kind, line and fix."""
    if isinstance(e, ImportError):
        line = f"{e} (reading {prefix} needs the [launch] extra: pip install 'magic-jax[launch]')"
        return pod_errors.TpuError(pod_errors.Kind.OTHER, line)
    text = str(getattr(e, "message", "") or e) or type(e).__name__
    text = re.sub(r"^(GET|POST|PUT|PATCH|DELETE) \S+: ", "", " ".join(text.split()))
    code = getattr(e, "code", None)
    said = pod_errors.classify(text)
    line = f"{code} {text}" if isinstance(code, int) else f"{type(e).__name__}: {text}"
    return pod_errors.TpuError(said.kind, line[:300], said.fix)


def beats(prefix: str) -> list[str]:
    """Every worker's heartbeat line under ``prefix`` (``worker-N`` objects), in one listing.

    Raises:
      StageError: the prefix cannot be read.
    """
    try:
        found = objects(prefix, lambda name: re.fullmatch(r"worker-\d+", name) is not None)
    except Exception as e:  # every failure of the bucket is a line launch.sh shows
        raise StageError(unreadable(e, prefix)) from e
    text = "\n".join(data.decode(errors="replace") for data in found.values())
    return [x.strip() for x in text.splitlines() if x.strip()]


def keep_logs(prefix: str, dest: str | Path, suffix: str, workers: Iterable[int]) -> int:
    """Copies ``prefix/worker-N.log`` to ``dest/worker-N{suffix}.log`` for each of
    ``workers`` that has none there yet; returns how many were copied.

    Raises:
      StageError: the prefix cannot be read.
    """
    want = {f"worker-{w}.log": Path(dest) / f"worker-{w}{suffix}.log" for w in workers}
    want = {k: v for k, v in want.items() if not (v.is_file() and v.stat().st_size)}
    if not want:
        return 0
    try:
        found = objects(prefix, lambda name: name in want)
    except Exception as e:  # every failure of the bucket is a line launch.sh shows
        raise StageError(unreadable(e, prefix)) from e
    for name, data in found.items():
        want[name].parent.mkdir(parents=True, exist_ok=True)
        storage.write_text(want[name], data.decode(errors="replace"))
    return sum(1 for data in found.values() if data)


class StageError(Exception):
    """A stage that cannot be read, told apart (``error``) with its one line."""

    def __init__(self, error: pod_errors.TpuError) -> None:
        super().__init__(error.say())
        self.error = error
