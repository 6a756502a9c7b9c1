"""Live run feedback: metric lines (JSON lines), TensorBoard event files and progress bars.

One ``Monitor`` per run writes every step's metrics to ``metrics.jsonl`` and
every evaluation to ``eval.jsonl``, mirrors both as TensorBoard scalars in
event files beside them (tensorboardX: no TensorFlow needed; ``tensorboard
--logdir RUN_DIR`` opens them), and shows a progress bar on a terminal. When
stdout is not a terminal (a log file, a pod's stdout) it prints plain lines
instead, so logs stay readable. ``Progress`` is the bar alone, for the
``eval`` and ``estimate-difficulty`` commands.

On a ``gs://`` run directory the record files cannot be appended to (GCS
objects are written whole): ``Records`` keeps the rows and rewrites the file at
most every ``GCS_FLUSH_S`` seconds, and always before a checkpoint is written
(``Monitor.flush``), so a killed run loses only rows of steps after its last
checkpoint, which its resume computes again. TensorBoard event files are
written to a local temporary directory and uploaded whole at the same times.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from magic_jax.run.rundir import JSON
    from magic_jax.storage import StoragePath

METRICS = "metrics.jsonl"
EVALS = "eval.jsonl"
# seconds between rewrites of a record file on GCS (a checkpoint always rewrites it first)
GCS_FLUSH_S = 30.0


def is_terminal() -> bool:
    """True when both stdout and stderr are terminals (the bar goes to stderr)."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = round(seconds)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    """A tqdm bar on a terminal, plain lines otherwise.

    Args:
      total: units of work (steps, problems).
      desc: label in front of the bar or line.
      unit: name of one unit.
      initial: units already done (a resumed job); the rate and ETA count
        only the units done here.
      log: where plain lines go (default ``print``).
      bar: force the bar on or off; ``None`` shows it on a terminal.
    """

    def __init__(
        self,
        total: int,
        *,
        desc: str = "",
        unit: str = "it",
        initial: int = 0,
        log: Callable[[str], None] = print,
        bar: bool | None = None,
    ):
        self.total = total
        self.desc = desc
        self.unit = unit
        self.log = log
        self.done = self._start = initial
        self._t0 = time.monotonic()
        self._bar = None
        if bar if bar is not None else is_terminal():
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, leave=True
            )

    def eta_s(self) -> float:
        """Seconds left at the rate seen so far (inf before the first unit)."""
        done_here = self.done - self._start
        if done_here <= 0:
            return math.inf
        return (time.monotonic() - self._t0) / done_here * (self.total - self.done)

    def update(
        self,
        n: int = 1,
        *,
        postfix: Mapping[str, object] | None = None,
        line: str | None = None,
        desc: str | None = None,
    ) -> None:
        """Advances by ``n``; ``line`` is printed above the bar (or as the plain line).

        Without a ``line`` the plain mode prints ``desc done/total, elapsed, ETA, postfix``.
        """
        self.done += n
        if desc is not None:
            self.desc = desc
        post = ", ".join(f"{k} {_fmt(v)}" for k, v in (postfix or {}).items())
        if self._bar is not None:
            if desc is not None:
                self._bar.set_description_str(desc, refresh=False)
            if postfix:
                self._bar.set_postfix_str(post, refresh=False)
            if line:
                self._bar.write(line)
            self._bar.update(n)
            return
        if line is None:
            elapsed = time.monotonic() - self._t0
            line = (
                f"[{self.desc}] {self.done}/{self.total} {self.unit}s, "
                f"{_duration(elapsed)} elapsed, ETA {_duration(self.eta_s())}"
                + (f", {post}" if post else "")
            )
        self.log(line)

    def write(self, line: str) -> None:
        """Prints a line without disturbing the bar."""
        if self._bar is not None:
            self._bar.write(line)
        else:
            self.log(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.3g}"
    return str(v)


def scalars(row: Mapping[str, object], prefix: str) -> Iterator[tuple[str, float]]:
    """The numeric fields of a metrics row as ``(tag, value)``; nested dicts become ``a/b``."""
    for key, value in row.items():
        if key == "step":
            continue
        tag = f"{prefix}/{key}"
        if isinstance(value, Mapping):
            yield from scalars(value, tag)
        elif isinstance(value, bool | int | float) and math.isfinite(float(value)):
            yield tag, float(value)


class Monitor:
    """Writes a run's metric lines, TensorBoard scalars and progress (process 0 only).

    Args:
      out_dir: the run directory (``metrics.jsonl``, ``eval.jsonl`` and the
        event files go here).
      stage_steps: the step budget of each stage, in order.
      start_step: the first step this process runs (after a resume). Events of
        later steps written before the interruption are hidden by TensorBoard
        (``purge_step``), as the trainer drops their JSON lines.
      log: where plain lines go.
      primary: only the primary process writes; the others do nothing.
      tensorboard: write event files.
      bar: force the progress bar on or off (``None``: on a terminal).

    Example:
      with Monitor(run_dir, stage_steps=[100, 50]) as mon:
          mon.step(row, text)  # row holds "step", "stage", "stage_step", ...
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        stage_steps: Sequence[int],
        start_step: int = 0,
        log: Callable[[str], None] = print,
        primary: bool = True,
        tensorboard: bool = True,
        bar: bool | None = None,
    ):
        from magic_jax import storage

        self.out = storage.path(out_dir)
        self.stage_steps = list(stage_steps)
        self.primary = primary
        self.log = log
        self._writer = None
        self._progress: Progress | None = None
        self._synced = time.monotonic()
        self._tb_local: Path | None = None
        if not primary:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self._metrics = Records(self.out / METRICS)
        self._evals = Records(self.out / EVALS)
        if tensorboard:
            from tensorboardX import SummaryWriter

            logdir = str(self.out)
            if self._metrics.remote:
                # event files are written here and uploaded whole with the records; the
                # folders of killed runs (uploaded up to their last flush) are removed
                import tempfile

                from magic_jax.rewards.procs import remove_orphan_dirs

                remove_orphan_dirs(None, "magic-jax-tb-")
                self._tb_local = Path(tempfile.mkdtemp(prefix=f"magic-jax-tb-{os.getpid()}-"))
                logdir = str(self._tb_local)
            # tensorboardX names event files by the second: a resume within the same
            # second would reopen (and truncate) the previous file; the suffix keeps
            # names distinct and in creation order, which is how TensorBoard reads them
            self._writer = SummaryWriter(
                logdir=logdir,
                purge_step=start_step or None,
                flush_secs=10,
                filename_suffix=f".{time.time_ns()}",
            )
        self._progress = Progress(
            sum(self.stage_steps), desc="train", unit="step", initial=start_step, log=log, bar=bar
        )

    def step(self, row: JSON, line: str) -> None:
        """Records one training step: a ``metrics.jsonl`` line, scalars, the bar / a plain line."""
        if not self.primary:
            return
        self._metrics.append(row)
        self._scalars(row, "train")
        if self._metrics.remote and time.monotonic() - self._synced >= GCS_FLUSH_S:
            self.flush()
        stage, k = int(row.get("stage", 0)), int(row.get("stage_step", 0))
        n = self.stage_steps[stage] if stage < len(self.stage_steps) else 0
        postfix = {
            "reward": float(row.get("reward", math.nan)),
            "entropy": float(row.get("entropy", math.nan)),
            "tok/s": round(float(row.get("rollout_tokens_per_s", math.nan))),
        }
        self._bar().update(1, postfix=postfix, line=line, desc=f"stage {stage} {k + 1}/{n}")

    def eval(self, row: JSON, line: str) -> None:
        """Records one evaluation: an ``eval.jsonl`` line, scalars and a printed line."""
        if not self.primary:
            return
        self._evals.append(row)
        self._scalars(row, "eval")
        self._bar().write(line)

    def write(self, line: str) -> None:
        """Prints a line (above the bar on a terminal)."""
        if self.primary:
            self._bar().write(line)
        else:
            self.log(line)

    def _scalars(self, row: JSON, prefix: str) -> None:
        if self._writer is None:
            return
        step = int(row["step"])
        for tag, value in scalars(row, prefix):
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def flush(self) -> None:
        """Makes every record so far durable (called before each checkpoint); on GCS also
        uploads the TensorBoard event files."""
        if not self.primary:
            return
        self._metrics.flush()
        self._evals.flush()
        if self._tb_local is not None and self._writer is not None:
            self._writer.flush()
            self._upload_events(self._tb_local)
        self._synced = time.monotonic()

    def _bar(self) -> Progress:
        assert self._progress is not None, "the primary process's monitor has a progress bar"
        return self._progress

    def _upload_events(self, local: Path) -> None:
        """Uploads the TensorBoard event files of ``local`` (``_tb_local``)."""
        from magic_jax import storage
        from magic_jax.run.runlock import check_fence

        check_fence("TensorBoard event files")
        fs = storage.gcs_fs()
        for f in sorted(local.iterdir()):
            fs.put_file(str(f), str(self.out / f.name))

    def close(self) -> None:
        # the writer, the local event folder and the bar are closed even when the final
        # upload is refused (a lost run lock: ``LockLost`` propagates)
        try:
            if self.primary:
                self.flush()
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
                if self._tb_local is not None:
                    import shutil

                    try:
                        self._upload_events(self._tb_local)
                    finally:
                        shutil.rmtree(self._tb_local, ignore_errors=True)
                        self._tb_local = None
            if self._progress is not None:
                self._progress.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class Records:
    """A JSON-lines record file: appended line by line locally, rewritten whole on GCS.

    Locally each row is one ``write`` of one line, so after a kill a line is
    whole or absent. On GCS the rows are kept here (with those the file held
    when opened) and the file is rewritten, in one upload, when ``flush`` is
    called (``Monitor`` does so every ``GCS_FLUSH_S`` seconds and before each
    checkpoint). Every write is fenced by the run lock (``runlock.check_fence``).
    """

    def __init__(self, path: StoragePath):
        from magic_jax import storage
        from magic_jax.run import rundir

        self.path = path
        self.remote = storage.is_gcs(path)
        self._lines: list[str] = []
        self._dirty = False
        if self.remote:
            self._lines = [json.dumps(r) + "\n" for r in rundir.read_records(path)]

    def append(self, row: Mapping[str, object]) -> None:
        line = json.dumps(row) + "\n"
        if not self.remote:
            from magic_jax.run.runlock import check_fence

            check_fence(self.path.name)
            with open(self.path, "a") as f:
                f.write(line)
            return
        self._lines.append(line)
        self._dirty = True

    def flush(self) -> None:
        """Rewrites the file on GCS (fenced: nothing is written once the run lock is lost).

        Raises:
          LockLost: this process no longer holds its run lock (``runlock.check_fence``).
        """
        if self.remote and self._dirty:
            from magic_jax import storage
            from magic_jax.run.runlock import check_fence

            check_fence(self.path.name, server=True)
            storage.write_text(self.path, "".join(self._lines))
            self._dirty = False
