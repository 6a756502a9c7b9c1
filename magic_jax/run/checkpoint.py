"""Checkpoints: models (orbax + JSON config) and whole train states with manifests and fallback.

Model checkpoints (``save_model`` / ``load_model``) hold parameters and
``model_config.json``. Train-state checkpoints (``TrainCheckpoints``) live in
``RUN/checkpoints/step_NNNNNNNN``: orbax's ``CheckpointManager`` writes the
state (``state/``) and keeps the newest ones; beside it go the loop's own
state (``trainer.json``), the model config (so ``magic-jax export`` can read
a training checkpoint) and, last, ``manifest.json``: the size and SHA-256 of
every file (on ``gs://``, the size and the CRC32C Cloud Storage keeps for each
object, so verifying reads one listing, not the checkpoint). A checkpoint
counts only once its manifest is written and every file matches it. On
resume the newest checkpoint that verifies is used; a checkpoint that does
not is named in one log line with the reason and moved to
``RUN/checkpoints_bad/`` (never deleted). Saves are asynchronous: the state is
written while training goes on, and the manifest follows once orbax commits it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from magic_jax import storage
from magic_jax.run.manifest import MANIFEST, first_line, mismatch, write_manifest
from magic_jax.run.rundir import RunDirError, write_atomic

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from magic_jax.model.config import ModelConfig
    from magic_jax.model.qwen2 import Qwen2
    from magic_jax.model.sharding import Rules
    from magic_jax.run.rundir import JSON
    from magic_jax.run.versions import Checkpointed
    from magic_jax.update.state import TrainState

# what a checkpoint holds: a ``TrainState``, or a ``Checkpointed`` (overlap: the lagged
# versions with it)
Item = TypeVar("Item")

CONFIG_FILE = "model_config.json"
STATE_DIR = "state"
CHECKPOINTS = "checkpoints"
BAD_CHECKPOINTS = "checkpoints_bad"
TRAINER_STATE = "trainer.json"
_STEP_NAME = re.compile(r"^step_(\d+)$")


# --------------------------------------------------------------------------- model checkpoints


def save_model(model: Qwen2, path: str | os.PathLike) -> Path:
    """Saves parameters (orbax, sharded arrays written in parallel) and ``model_config.json``.

    The directory is written under a temporary name and renamed when complete,
    so an interrupted save never replaces a good checkpoint.
    """
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    ckpt = storage.path(path)
    if ckpt.exists():
        raise FileExistsError(f"{ckpt} exists; refusing to overwrite a checkpoint")
    cfg = json.dumps(dataclasses.asdict(model.config), indent=2)
    if storage.is_gcs(ckpt):
        # no directory renames on GCS: the config, which makes the directory a checkpoint
        # for read_model_config, is written after orbax has committed the parameters
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(ckpt / STATE_DIR, nnx.state(model, nnx.Param))
            ckptr.wait_until_finished()
        if jax.process_index() == 0:
            storage.write_text(ckpt / CONFIG_FILE, cfg)
        return ckpt
    tmp = ckpt.with_name(ckpt.name + ".partial")
    if jax.process_index() == 0:
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / CONFIG_FILE).write_text(cfg)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp / STATE_DIR, nnx.state(model, nnx.Param))
        ckptr.wait_until_finished()
    if jax.process_index() == 0:
        os.replace(tmp, ckpt)
    return ckpt


def read_model_config(path: str | os.PathLike) -> ModelConfig:
    """The ``ModelConfig`` stored beside a checkpoint."""
    from magic_jax.model.config import ModelConfig

    cfg_path = storage.path(path) / CONFIG_FILE
    if not cfg_path.exists():
        raise FileNotFoundError(f"{path}: no {CONFIG_FILE}; not a magic_jax model checkpoint")
    try:
        raw: JSON = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_path}: not a JSON model config ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_path}: not a JSON model config (top level is not an object)")
    for key in ("sliding_layers",):
        raw[key] = tuple(raw.get(key) or ())
    if "scan_layers" not in raw:
        raise ValueError(
            f"{cfg_path}: no scan_layers; written by an older layout this version does not "
            f"read (convert the model again from its Hugging Face checkpoint)"
        )
    if isinstance(raw.get("eos_token_id"), list):
        raw["eos_token_id"] = tuple(raw["eos_token_id"])
    try:
        return ModelConfig(**raw)
    except TypeError as e:
        raise ValueError(f"{cfg_path}: does not describe a ModelConfig ({e})") from e


def load_model(
    path: str | os.PathLike, mesh: Mesh | None = None, *, rules: Rules | None = None
) -> Qwen2:
    """Restores a model saved by ``save_model``, or the policy of a training checkpoint.

    Args:
      path: a ``save_model`` directory, or ``RUN/checkpoints/step_N`` (its
        manifest is verified first and only the parameters are read).
      mesh: place the parameters on this mesh (default: one device).
      rules: logical-axis rules for ``mesh`` (default: the training rules).

    Raises:
      FileNotFoundError: ``path`` holds no model config.
      magic_jax.model.convert.CheckpointError: a damaged or mismatched checkpoint, in one line.
    """
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    from magic_jax.model.convert import CheckpointError
    from magic_jax.model.qwen2 import abstract_model
    from magic_jax.model.sharding import TRAIN_RULES, model_shardings

    ckpt = storage.path(path)
    training = (ckpt / TRAINER_STATE).exists()
    if training:
        reason = verify_checkpoint(ckpt)
        if reason is not None:
            raise CheckpointError(f"{ckpt}: bad checkpoint: {reason}")
    config = read_model_config(ckpt)
    graphdef, abs_state = nnx.split(abstract_model(config))
    if mesh is not None:
        shardings = model_shardings(abs_state, mesh, rules or TRAIN_RULES)
    else:
        single = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(
            lambda v: v.replace(single), abs_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
    target = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s.get_value())),
        abs_state,
        shardings,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    try:
        if training:
            # A train state holds the optimizer too: read the parameters alone.
            # nnx variables are stored as {"value": array}: the template says so too.
            pure = jax.tree.map(lambda x: {"value": x}, target.to_pure_dict())
            restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), pure)
            with ocp.PyTreeCheckpointer() as ckptr:
                got = ckptr.restore(
                    ckpt / STATE_DIR,
                    args=ocp.args.PyTreeRestore(
                        item={"params": pure},
                        restore_args={"params": restore_args},
                        partial_restore=True,
                    ),
                )
            values = jax.tree.map(
                lambda d: d["value"],
                got["params"],
                is_leaf=lambda d: isinstance(d, dict) and "value" in d,
            )
            nnx.replace_by_pure_dict(target, values)
            state = target
        else:
            with ocp.StandardCheckpointer() as ckptr:
                state = ckptr.restore(ckpt / STATE_DIR, target)
    except Exception as e:  # orbax and tensorstore raise many types for damaged files
        raise CheckpointError(f"{ckpt}: cannot read the checkpoint: {first_line(e)}") from None
    return nnx.merge(graphdef, state)


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """Why a training checkpoint cannot be used (None when it verifies).

    Checks the manifest against every file (``manifest.mismatch``) and the contents
    of ``trainer.json``.
    """
    ckpt = storage.path(path)
    wrong = mismatch(ckpt)
    if wrong is not None:
        return wrong
    try:
        read_trainer_state(ckpt)
    except RunDirError as e:
        return str(e).removeprefix(f"{ckpt / TRAINER_STATE}: ")
    except (OSError, KeyError, TypeError) as e:
        return f"cannot be read ({first_line(e)})"
    return None


def read_trainer_state(path: str | os.PathLike) -> JSON:
    """The loop state of a training checkpoint, checked field by field.

    Raises:
      RunDirError: ``trainer.json`` is missing, not JSON, or lacks a field.
    """
    file = storage.path(path) / TRAINER_STATE
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunDirError(f"{file}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunDirError(f"{file}: not a JSON trainer state ({first_line(e)})") from None
    checks: dict[str, Callable[[object], bool]] = {
        "next_step": lambda v: isinstance(v, int) and v > 0,
        "stage": lambda v: isinstance(v, int) and v >= 0,
        "excluded": lambda v: isinstance(v, list) and all(isinstance(u, str) for u in v),
        "tracker": lambda v: isinstance(v, dict) and isinstance(v.get("counts"), dict),
        "schedule": lambda v: isinstance(v, dict) and isinstance(v.get("switches"), list),
    }
    if not isinstance(meta, dict):
        raise RunDirError(f"{file}: not a JSON object")
    for key, ok in checks.items():
        if key not in meta:
            raise RunDirError(f"{file}: missing field {key!r}")
        if not ok(meta[key]):
            raise RunDirError(f"{file}: field {key!r} has a bad value {meta[key]!r:.80}")
    return meta


def checkpoint_kind(
    path: str | os.PathLike, *, option: str = "model"
) -> tuple[str, storage.StoragePath]:
    """What ``path`` names, without loading it: ``(kind, checkpoint directory)``.

    The one answer to "what kind of checkpoint is this", for training
    (``policy.load_policy``) and evaluation (``policy.load_model_any``).
    ``kind`` is ``"hf"`` (``config.json``), ``"orbax"`` (a ``save_model``
    directory), or ``"run"``: a training checkpoint ``RUN/checkpoints/step_N``,
    or a run directory, which names its newest checkpoint that verifies.
    ``path`` may be a ``gs://`` URI.

    Raises:
      FileNotFoundError: ``path`` is none of these, or a run has no usable
        checkpoint; the message starts with ``option``.
    """
    storage.check(path, what=option)
    p = storage.path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{option}: {p} is not a directory")
    if (p / "config.json").exists():
        return "hf", p
    if (p / TRAINER_STATE).exists():
        return "run", p
    if (p / CONFIG_FILE).exists():
        return "orbax", p
    if (p / "config.yaml").exists() or (p / CHECKPOINTS).is_dir():
        ckpt = latest_good_checkpoint(p)
        if ckpt is None:
            raise FileNotFoundError(f"{option}: the run directory {p} has no usable checkpoint yet")
        return "run", ckpt
    raise FileNotFoundError(
        f"{option}: {p} holds no Hugging Face checkpoint (config.json), no magic_jax model "
        f"({CONFIG_FILE}) and is not a training run directory"
    )


# --------------------------------------------------------------------------- train states


def step_dirs(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, directory) of every ``checkpoints/step_N`` of a run, oldest first (unverified)."""
    root = storage.path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_NAME.match(p.name))]
    return sorted(found)


def latest_good_checkpoint(
    output_dir: str | os.PathLike,
    *,
    log: Callable[[str], None] | None = None,
    set_aside: bool = False,
) -> Path | None:
    """The newest checkpoint of a run directory that verifies (None if there is none).

    Args:
      output_dir: the run directory.
      log: gets one line per checkpoint that fails, naming it and why.
      set_aside: move each failed checkpoint newer than the good one to
        ``checkpoints_bad/`` (a resumed run then writes those steps anew). In a
        multi-host run only process 0 may do this (the trainer asks it alone
        and tells the others its choice: ``distributed.on_primary``).

    Raises:
      RunDirError: some checkpoint holds a manifest (it was completed) but none
        verifies: resuming from scratch would silently redo finished work.
    """
    failed: list[tuple[Path, str]] = []
    good = None
    for _, path in reversed(step_dirs(output_dir)):
        reason = verify_checkpoint(path)
        if reason is None:
            good = path
            break
        failed.append((path, reason))
    complete = [f"{p.name} ({r})" for p, r in failed if (p / MANIFEST).exists()]
    if good is None and complete:
        # Nothing is moved: the same command gives the same answer until someone looks.
        raise RunDirError(
            f"{storage.path(output_dir) / CHECKPOINTS}: no usable checkpoint: "
            + "; ".join(complete)
        )
    for path, reason in failed:
        where = f"; moved to {_set_aside(storage.path(output_dir), path)}" if set_aside else ""
        if log is not None:
            log(f"[checkpoint] {path} is not usable: {reason}{where}")
    return good


def step_path(output_dir: str | os.PathLike, step: int) -> Path:
    """The directory of checkpoint ``step`` of a run (``checkpoints/step_NNNNNNNN``)."""
    return storage.path(output_dir) / CHECKPOINTS / f"step_{step:08d}"


def _set_aside(output_dir: Path, path: Path) -> Path:
    dest = output_dir / BAD_CHECKPOINTS / path.name
    n = 1
    while dest.exists():
        dest = output_dir / BAD_CHECKPOINTS / f"{path.name}.{n}"
        n += 1
    storage.move_tree(path, dest)
    return dest


@dataclasses.dataclass
class _KeepNewest:
    """Orbax preservation policy: the newest ``n`` checkpoints, and always the newest
    one with a manifest, so a process killed while a manifest is being written still
    leaves a verified checkpoint behind."""

    n: int
    root: Path

    def should_preserve(self, checkpoints, *, context):  # orbax's PreservationPolicy protocol
        steps = [c.step for c in checkpoints]
        verified = [s for s in steps if (self.root / f"step_{s:08d}" / MANIFEST).exists()]
        keep = set(sorted(steps)[-self.n :]) | set(verified[-1:])
        return [s in keep for s in steps]


class TrainCheckpoints:
    """The train-state checkpoints of one run directory.

    Example:
      ckpts = TrainCheckpoints(out, keep=2)
      ckpts.save(step, state, meta, model_config)
      state = ckpts.restore(abstract_or_live_state, ckpts.root / "step_00000010")
    """

    def __init__(self, output_dir: str | os.PathLike, *, keep: int):
        self.out = storage.path(output_dir)
        self.root = self.out / CHECKPOINTS
        self.keep = keep
        self._manager = None
        self._pending: threading.Thread | None = None
        self._error: BaseException | None = None

    def _mgr(self):
        if self._manager is None:
            import orbax.checkpoint as ocp

            options = ocp.CheckpointManagerOptions(
                step_prefix="step",
                step_format_fixed_length=8,
                preservation_policy=_KeepNewest(self.keep, self.root),
                create=True,
                cleanup_tmp_directories=True,  # what a killed save left behind
                enable_async_checkpointing=True,  # ``save`` returns once off the devices
            )
            self._manager = ocp.CheckpointManager(self.root, options=options, item_names=("state",))
        return self._manager

    def save(
        self,
        step: int,
        state: TrainState | Checkpointed,
        meta: Mapping[str, object],
        model_config: ModelConfig | None = None,
    ) -> Path:
        """Starts checkpoint ``step``: the state (orbax, asynchronously), then, in a thread
        once orbax committed it, ``trainer.json``, the model config and the manifest that
        makes it count. Returns once the state is off the devices (it may then be donated);
        the previous checkpoint's writes finish first (raising what they raised), and
        ``wait`` / ``close`` wait for this one's."""
        import orbax.checkpoint as ocp

        from magic_jax.run import runlock

        self.wait()
        runlock.check_fence(f"checkpoint step {step}")  # a run that lost its lock writes nothing
        mgr = self._mgr()
        mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
        path = self.root / f"step_{step:08d}"
        args = (mgr, step, path, dict(meta), model_config)
        self._pending = threading.Thread(target=self._finish, args=args, daemon=True)
        self._pending.start()
        return path

    def _finish(
        self, mgr, step: int, path: Path, meta: dict, model_config: ModelConfig | None
    ) -> None:
        import jax

        from magic_jax import interrupt, watchdog

        try:
            mgr.wait_until_finished()
            interrupt.kill_point("checkpoint", step)
            if jax.process_index() == 0:
                write_atomic(path / TRAINER_STATE, json.dumps(meta))
                if model_config is not None:
                    cfg = dataclasses.asdict(model_config)
                    write_atomic(path / CONFIG_FILE, json.dumps(cfg, indent=2))
                write_manifest(path)
            watchdog.beat("checkpoint")
        except BaseException as e:  # re-raised by the next save, wait or close
            self._error = e

    def wait(self) -> None:
        """Waits until the newest checkpoint is whole (manifest included); raises what its
        writes raised."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def restore(self, state: Item, path: str | os.PathLike) -> Item:
        """The train state of checkpoint ``path``, placed like ``state`` (a live or abstract
        state of this run).

        Raises:
          RunDirError: the stored state does not fit this run's model and optimizer.
        """
        import jax
        import orbax.checkpoint as ocp

        named = _STEP_NAME.match(storage.path(path).name)
        assert named is not None, f"{path}: checkpoints are named step_N"
        step = int(named.group(1))
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
        try:
            got = self._mgr().restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
            )
        except Exception as e:  # orbax raises many types for a mismatched tree
            raise RunDirError(
                f"{path}: does not fit this run's model and optimizer: {first_line(e)}"
            ) from None
        return got["state"]

    def close(self) -> None:
        """Waits for the checkpoint being written (raising what it raised), closes orbax."""
        try:
            self.wait()
        finally:
            manager, self._manager = self._manager, None
            if manager is not None:
                manager.close()
