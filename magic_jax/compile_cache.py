"""JAX's persistent compilation cache for command-line runs, and a count of compile time.

A second run with the same shapes (the same config on the same kind of machine)
reads every executable from the cache instead of compiling it again. The cache
directory is ``$MAGIC_JAX_COMPILATION_CACHE``, else JAX's own
``$JAX_COMPILATION_CACHE_DIR``, else ``~/.cache/magic-jax/jax``; set
``MAGIC_JAX_COMPILATION_CACHE=off`` to disable it.

A ``gs://bucket/path`` cache is handed to JAX as it is: JAX's file cache
(``jax._src.lru_cache.LRUCache``) goes through etils' ``epath``, which is gcsfs
here (``storage``), so every process reads entries from the bucket and a
recreated slice compiles nothing it compiled before. JAX writes entries from
process 0 only; each entry is one object, uploaded whole and never rewritten,
so readers see a whole executable or none.

A cache that cannot be written (its disk full, its directory read-only) costs
nothing but the saving: JAX warns once per executable it fails to save, which on a
full disk is every compile of the run, and once per entry it cannot read (a write
the full disk cut short leaves a truncated entry, which is compiled again). ``enable``
turns each kind into one line naming the directory and the first error; the run
goes on.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from pathlib import Path

ENV = "MAGIC_JAX_COMPILATION_CACHE"
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_CACHE_READ_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"


class CompileClock:
    """Executables this process compiled or read from the persistent cache, and the time.

    Attributes:
      seconds: backend seconds of every ``jit`` compilation, cache reads included.
      read_seconds: the part spent reading executables from the cache.
      compiles: executables requested from the backend.
      cache_hits: those read from the cache (the rest were compiled).
    """

    def __init__(self):
        self.seconds = 0.0
        self.read_seconds = 0.0
        self.compiles = 0
        self.cache_hits = 0
        self._lock = threading.Lock()

    @property
    def compiled(self) -> int:
        return self.compiles - self.cache_hits

    @property
    def compile_seconds(self) -> float:
        """Seconds of real compilation (cache reads excluded)."""
        return max(self.seconds - self.read_seconds, 0.0)

    def _on_duration(self, event: str, duration_secs: float, **_: str | int) -> None:
        with self._lock:
            if event == _BACKEND_COMPILE_EVENT:
                self.seconds += duration_secs
                self.compiles += 1
            elif event == _CACHE_READ_EVENT:
                self.read_seconds += duration_secs

    def _on_event(self, event: str, **_: str | int) -> None:
        if event == _CACHE_HIT_EVENT:
            with self._lock:
                self.cache_hits += 1

    def summary(self) -> str:
        return (
            f"{self.compile_seconds:.1f}s compiling {self.compiled} executables, "
            f"{self.read_seconds:.1f}s reading {self.cache_hits} from the persistent cache"
        )


CLOCK = CompileClock()
_installed = False


def cache_dir() -> Path | str | None:
    """The cache directory the environment asks for: a local path, a ``gs://`` URI, or
    None (disabled)."""
    value = os.environ.get(ENV) or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if value and value.lower() in ("off", "0", "none", "false"):
        return None
    if value and value.startswith("gs://"):
        return value.rstrip("/")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "magic-jax" / "jax"


def enable() -> Path | str | None:
    """Turns on the persistent cache for every compilation of this process.

    Every executable is cached, however fast it compiled: the default run
    compiles dozens of small ones, and the point is that a repeated run
    compiles nothing. Also starts ``CLOCK``. Returns the directory or ``gs://``
    URI (None when disabled, not writable, or a bucket that cannot be used: a
    one-line warning says so and the run goes on without the cache).
    """
    global _installed
    import jax

    if not _installed:
        jax.monitoring.register_event_duration_secs_listener(CLOCK._on_duration)
        jax.monitoring.register_event_listener(CLOCK._on_event)
        warnings.showwarning = _one_line_for_failed_writes(warnings.showwarning)
        _installed = True
    path = cache_dir()
    if path is None:
        return None
    if isinstance(path, str):
        if not _bucket_usable(path):
            return None
        # JAX would hand XLA's C++ GPU caches a directory under this URI, outside gcsfs
        jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    else:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None  # a read-only home: run without the cache
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


_FAILED = {
    "Error writing persistent compilation cache entry": (
        "cannot be written",
        "programs compile as usual and are not saved for the next run",
    ),
    "Error reading persistent compilation cache entry": (
        "holds an unreadable entry",
        "such entries are compiled again",
    ),
}


def _one_line_for_failed_writes(show):
    """``warnings.showwarning`` with JAX's per-executable cache warnings (a failed write, an
    unreadable entry) replaced by one line of each kind for the process."""
    told: set[str] = set()

    def showwarning(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        kind = next((k for k in _FAILED if text.startswith(k)), None)
        if kind is None:
            return show(message, category, filename, lineno, file, line)
        if kind not in told:
            told.add(kind)
            what, then = _FAILED[kind]
            error = text.split(": ", 1)[-1]
            print(
                f"warning: the compilation cache {cache_dir()} {what} ({error}); {then}",
                file=sys.stderr,
            )
        return None

    return showwarning


def _bucket_usable(uri: str) -> bool:
    """Asks the cache's bucket once (``storage.check``); a one-line warning when it cannot
    be used."""
    from magic_jax import storage

    try:
        storage.path(uri, what=ENV)
        storage.check(uri, what=ENV)
    except storage.StorageError as e:
        print(f"warning: {e}; running without the persistent compilation cache", file=sys.stderr)
        return False
    return True
