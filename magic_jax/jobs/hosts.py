"""What every host of a multi-host command does at start and when it fails.

``start`` starts ``jax.distributed`` (a no-op on one host) and the thread that
ends this process when another process of the job fails; ``failed`` turns this
process's own failure into the end of the whole job, its traceback published and
written to the run's ``logs/`` (``distributed.end_job``).
"""

from __future__ import annotations

# The run directory of the running command (``train`` sets it): where a failure's report goes.
RUN_DIR: list[str | None] = [None]


def start() -> None:
    """Starts ``jax.distributed`` on a multi-host job (a no-op elsewhere) and the thread
    that ends this process when another process of the job fails."""
    from magic_jax import distributed
    from magic_jax.model.sharding import maybe_initialize_distributed

    maybe_initialize_distributed()
    distributed.watch_failures(logs_dir)


def logs_dir() -> object | None:
    """The run's ``logs/`` once the run directory is this project's (claimed), else None:
    a report must not make a directory that the run would then refuse as not its own."""
    from magic_jax import storage
    from magic_jax.run.rundir import MARKER

    if RUN_DIR[0] is None:
        return None
    out = storage.path(RUN_DIR[0])
    return out / "logs" if (out / MARKER).exists() else None


def failed(command: str, code: int) -> int:
    """``code``; in a multi-host job this process ends here instead, after publishing
    its traceback so every other process ends too (and writing it to the run's ``logs/``)."""
    from magic_jax import distributed

    if not distributed.running():
        return code
    import traceback

    report = (
        f"magic-jax {command} failed on process {distributed.process_index()} "
        f"(exit {code}):\n{traceback.format_exc()}"
    )

    def log_file():
        logs = logs_dir()
        return None if logs is None else f"{logs}/{distributed.report_name('failure')}"

    distributed.end_job(report, code, log_file=log_file)
