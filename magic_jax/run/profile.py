"""Profiles on demand: a ``jax.profiler`` trace of training steps A to B-1 (``profile_steps``).

``StepProfiler`` starts the trace before step A and stops it after step B-1;
each process traces its own host. jaxlib's own ``gs://`` writer talks to
www.googleapis.com directly (no emulator, its own credentials) and fails only at
the end, losing the trace, so every trace is written to a local temporary
directory first and then copied (uploaded through ``magic_jax.storage``) to
``<output_dir>/profile/plugins/profile/steps_<first>-<last>/``: one TensorBoard
run holding every host's ``<host>.xplane.pb`` (``<host>-process<i>`` when a job
has several processes, which may share a host). Open it with
``tensorboard --logdir <output_dir>/profile`` and the ``tensorboard-plugin-profile``
package (the Profile tab).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import jax

from magic_jax import storage

# what jax's profiler writes per host: the trace (XSpace) and its trace-viewer copy
TRACE_SUFFIXES = (".xplane.pb", ".trace.json.gz")


def parse_profile_steps(spec: str) -> tuple[int, int]:
    """``(A, B)`` of a ``profile_steps`` value ``"A:B"``: global steps A to B-1 are traced.

    Raises:
      ValueError: not two integers ``0 <= A < B``, naming ``profile_steps``.
    """
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", spec) if isinstance(spec, str) else None
    if m is None or int(m[1]) >= int(m[2]):
        raise ValueError(
            f'profile_steps must be "A:B" with integers 0 <= A < B (traces steps A to B-1; '
            f"quote it in YAML), got {spec!r}"
        )
    return int(m[1]), int(m[2])


class StepProfiler:
    """Traces global steps A to B-1 of ``profile_steps`` ("A:B"; None: never).

    The trainer calls ``before(step)`` and ``after(step)`` around each step, or
    wraps it in ``with profiler.step(step):``, and ``close()`` at the end (also
    through ``with StepProfiler(...)``): a run that stops or resumes inside the
    range keeps the steps it did trace. Every process decides from the step alone,
    so all hosts trace the same steps; each writes only its own files.

    Args:
      out_dir: the run directory (local or ``gs://``); traces go to ``<out_dir>/profile``.
      spec: ``"A:B"`` or None.
      log: where the one line per trace (the files and the TensorBoard command) goes.
    """

    def __init__(
        self, out_dir: str | os.PathLike, spec: str | None, *, log: Callable[[str], None] = print
    ) -> None:
        self.span = None if spec is None else parse_profile_steps(spec)
        self.dest = f"{str(out_dir).rstrip('/')}/profile"
        self.log = log
        self._tmp: Path | None = None
        self._first = self._last = -1
        self._annotation: jax.profiler.StepTraceAnnotation | None = None

    @property
    def active(self) -> bool:
        return self._tmp is not None

    def before(self, step: int) -> None:
        """Starts the trace at the first step of the range this run reaches."""
        if self.span is None:
            return
        a, b = self.span
        if not self.active and a <= step < b:
            tmp = Path(tempfile.mkdtemp(prefix="magic-jax-profile-"))
            try:
                jax.profiler.start_trace(str(tmp))
            except RuntimeError as e:  # another trace running: this run goes on without one
                shutil.rmtree(tmp, ignore_errors=True)
                self.log(f"[profile] not started at step {step}: {e}")
                self.span = None
                return
            self._tmp = tmp
            self._first = step
        if self.active:
            self._end_marker()
            self._last = step
            # step markers: TensorBoard's overview page splits the trace by step
            self._annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
            self._annotation.__enter__()

    def after(self, step: int, result: object = None) -> None:
        """Ends the step's marker; after step B-1 stops the trace and writes it.

        ``result`` (any pytree of arrays) is waited for first, so the trace holds
        the step's device work; the trainer's step has waited already.
        """
        if not self.active:
            return
        self._end_marker()
        assert self.span is not None, "a trace runs only inside its span"
        if step >= self.span[1] - 1:
            if result is not None:
                jax.block_until_ready(result)
            self._finish()

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """``before(step)``, the block, ``after(step)``."""
        self.before(step)
        try:
            yield
        finally:
            self.after(step)

    def close(self) -> None:
        """Stops and writes a trace still running (the run ended inside the range)."""
        self._end_marker()
        if self.active:
            self._finish()

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _end_marker(self) -> None:
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None

    def _finish(self) -> None:
        tmp = self._tmp
        assert tmp is not None, "called while a trace runs"
        self._tmp = None
        self.span = None  # one trace per run
        steps = f"{self._first}-{self._last}"
        run = f"{self.dest}/plugins/profile/steps_{steps}"
        tag = f"-process{jax.process_index()}" if jax.process_count() > 1 else ""
        try:
            jax.profiler.stop_trace()
            files = sorted(p for p in tmp.glob("plugins/profile/*/*") if p.is_file())
            with storage.staged(run) as local:
                local.mkdir(parents=True, exist_ok=True)
                for f in files:
                    shutil.copyfile(f, local / _tagged(f.name, tag))
        except Exception as e:  # a lost trace must not end the training run
            self.log(f"[profile] steps {steps}: the trace was not written ({e}); kept in {tmp}")
            return
        shutil.rmtree(tmp, ignore_errors=True)
        names = ", ".join(_tagged(f.name, tag) for f in files if f.name.endswith(".xplane.pb"))
        self.log(
            f"[profile] steps {steps} traced: {run}/{names}; open with "
            f"`tensorboard --logdir {self.dest}` (pip install tensorboard-plugin-profile; "
            f"the Profile tab)"
        )


def _tagged(name: str, tag: str) -> str:
    """``host.xplane.pb`` -> ``host<tag>.xplane.pb``."""
    for suffix in TRACE_SUFFIXES:
        if name.endswith(suffix):
            return f"{name[: -len(suffix)]}{tag}{suffix}"
    return f"{tag.lstrip('-')}-{name}" if tag else name
