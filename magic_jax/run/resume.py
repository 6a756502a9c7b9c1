"""Opening a run directory and finding where a run continues.

``open_run_dir`` claims and locks the directory for the run's life, checks a
resumed run's config against the stored one and says whether the run has
finished before; ``newest_good_checkpoint`` finds the checkpoint a run continues
from and ``resume_from`` restores it and drops the records of the steps after
it, which the resumed run writes again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from magic_jax import distributed
from magic_jax.run import rundir, runlock
from magic_jax.run.checkpoint import (
    latest_good_checkpoint,
    read_trainer_state,
    step_dirs,
    step_path,
)
from magic_jax.run.stages import LoopState

if TYPE_CHECKING:
    from magic_jax.run.checkpoint import TrainCheckpoints

# what a checkpoint of the run holds (``RolloutSource.checkpoint_template``)
Item = TypeVar("Item")


def open_run_dir(
    out: Path,
    raw: Mapping[str, object],
    stack: contextlib.ExitStack,
    *,
    total_steps: int,
    log: Callable[[str], None],
) -> int:
    """Claims and locks ``out`` for ``stack``'s life and checks a resume against it
    (``raw``: the run's config as plain data); returns 1 when the run has finished
    before (nothing to do), else 0 (the config is then written)."""
    stack.enter_context(runlock.run_directory(out))
    old = rundir.stored_config(out)
    newest = step_dirs(out)[-1:]
    done, current = 0, None
    if newest:
        done = newest[0][0]
        with contextlib.suppress(rundir.RunDirError):  # judged again before restoring
            current = read_trainer_state(newest[0][1])["stage"]
    if old is not None and done > 0:
        for change in rundir.check_resume_config(old, raw, done, current):
            log(f"[resume] changed {change}")
    finished = rundir.finished_summary(out, total_steps)
    if finished is not None:
        log(
            f"[done] {out} has finished ({finished['steps']} steps); nothing to do "
            f"(use a new output_dir for a new run)"
        )
        return 1
    rundir.write_config(out, raw)
    return 0


def newest_good_checkpoint(out: Path, *, log: Callable[[str], None]) -> Path | None:
    """The newest checkpoint of ``out`` that verifies, bad ones set aside, or None.

    Process 0 verifies the checksums and sets bad checkpoints aside; every process
    gets the step it chose (and restores it: orbax restores on all processes at once).
    """

    def newest_good() -> int:
        found = latest_good_checkpoint(out, log=log, set_aside=True)
        return -1 if found is None else int(found.name.removeprefix("step_"))

    chosen = distributed.on_primary(newest_good)
    return None if chosen < 0 else step_path(out, chosen)


def resume_from(
    out: Path,
    found: Path | None,
    ckpts: TrainCheckpoints,
    state: Item,
    *,
    log: Callable[[str], None],
) -> tuple[Item, LoopState]:
    """What checkpoint ``found`` holds, restored into ``state``'s shape, and its loop state
    (None: ``state`` at step 0); the records of the steps after it are dropped."""
    loop = LoopState()
    if found is not None:
        loop = LoopState.from_meta(read_trainer_state(found))
        state = ckpts.restore(state, found)
        log(f"[resume] {found}: continuing at step {loop.step}")
    dropped = rundir.trim_records(out, loop.step) if distributed.is_primary() else {}
    if any(dropped.values()):
        log(f"[resume] dropped the records of steps after step {loop.step}: {dropped}")
    return state, loop
