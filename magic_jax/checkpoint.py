"""Orbax checkpoints of models (and, later, whole train states) with a JSON config beside them."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from magic_jax.model import ModelConfig, Qwen2, abstract_model
from magic_jax.sharding import TRAIN_RULES, Rules, model_shardings

CONFIG_FILE = "model_config.json"
STATE_DIR = "state"


def save_model(model: Qwen2, path: str | os.PathLike) -> Path:
    """Saves parameters (orbax, sharded arrays written in parallel) and ``model_config.json``.

    The directory is written under a temporary name and renamed when complete,
    so an interrupted save never replaces a good checkpoint.
    """
    path = Path(path).absolute()
    if path.exists():
        raise FileExistsError(f"{path} exists; refusing to overwrite a checkpoint")
    tmp = path.with_name(path.name + ".partial")
    if jax.process_index() == 0:
        tmp.mkdir(parents=True, exist_ok=True)
        cfg = dataclasses.asdict(model.config)
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp / STATE_DIR, nnx.state(model, nnx.Param))
        ckptr.wait_until_finished()
    if jax.process_index() == 0:
        os.replace(tmp, path)
    return path


def read_model_config(path: str | os.PathLike) -> ModelConfig:
    """The ``ModelConfig`` stored beside a checkpoint."""
    cfg_path = Path(path) / CONFIG_FILE
    if not cfg_path.exists():
        raise FileNotFoundError(f"{path}: no {CONFIG_FILE}; not a magic_jax model checkpoint")
    raw: dict[str, Any] = json.loads(cfg_path.read_text())
    for key in ("sliding_layers",):
        raw[key] = tuple(raw.get(key) or ())
    if isinstance(raw.get("eos_token_id"), list):
        raw["eos_token_id"] = tuple(raw["eos_token_id"])
    try:
        return ModelConfig(**raw)
    except TypeError as e:
        raise ValueError(f"{cfg_path}: does not describe a ModelConfig ({e})") from e


def load_model(
    path: str | os.PathLike, mesh: Mesh | None = None, *, rules: Rules = TRAIN_RULES
) -> Qwen2:
    """Restores a model saved by ``save_model`` straight into the target shardings."""
    path = Path(path).absolute()
    config = read_model_config(path)
    graphdef, abs_state = nnx.split(abstract_model(config))
    if mesh is not None:
        shardings = model_shardings(abs_state, mesh, rules)
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
    with ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore(path / STATE_DIR, target)
    return nnx.merge(graphdef, state)
