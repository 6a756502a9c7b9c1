"""Hugging Face safetensors <-> Flax Qwen2, streamed tensor by tensor into target shardings.

The whole conversion is ``KEY_TABLE``: a regex over our parameter path, the
Hugging Face tensor name it maps to, and whether the matrix is transposed
(torch ``Linear.weight`` is [out, in]; our ``kernel`` is [in, out]). The table
speaks of one layer (``layers.3.mlp...``); a stacked parameter of the scanned
layers (``layers.mlp...``, [L, ...]) is the L per-layer tensors, read or written
one layer at a time.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from magic_jax.model.config import ModelConfig
from magic_jax.model.qwen2 import Qwen2, abstract_model
from magic_jax.model.sharding import TRAIN_RULES, Rules, model_shardings

log = logging.getLogger(__name__)

# (our path regex, HF name template, transpose)
KEY_TABLE: tuple[tuple[str, str, bool], ...] = (
    (r"embed_tokens\.embedding", "model.embed_tokens.weight", False),
    (r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.kernel", r"model.layers.\1.\2.\3.weight", True),
    (r"layers\.(\d+)\.self_attn\.(\w+_proj)\.bias", r"model.layers.\1.self_attn.\2.bias", False),
    (
        r"layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.scale",
        r"model.layers.\1.\2.weight",
        False,
    ),
    (r"norm\.scale", "model.norm.weight", False),
    (r"lm_head\.kernel", "lm_head.weight", True),
)

# Tensors some checkpoints carry that the model recomputes or does not use.
_IGNORED = (re.compile(r".*rotary_emb\.inv_freq$"),)

_ST_TO_NP = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NP_TO_ST = {v: k for k, v in _ST_TO_NP.items()}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, malformed or does not fit the model."""


def hf_name(path: str) -> tuple[str, bool]:
    """Hugging Face tensor name and transpose flag for one of our parameter paths."""
    for pattern, template, transpose in KEY_TABLE:
        if re.fullmatch(pattern, path):
            return re.sub(pattern, template, path), transpose
    raise CheckpointError(f"parameter {path!r} has no entry in convert.KEY_TABLE")


def hf_names(path: str, num_stacked: int = 0) -> list[tuple[int | None, str, bool]]:
    """``(layer, Hugging Face name, transpose)`` of each tensor behind one parameter.

    ``num_stacked`` is L for a model with stacked layers: a ``layers.*`` path then
    stands for L tensors, one per layer index; otherwise layer is None.
    """
    if num_stacked and path.startswith("layers.") and not path.split(".")[1].isdigit():
        rest = path[len("layers.") :]
        return [(i, *hf_name(f"layers.{i}.{rest}")) for i in range(num_stacked)]
    return [(None, *hf_name(path))]


def _path_str(path: tuple) -> str:
    return ".".join(str(p) for p in path)


# --------------------------------------------------------------------- safetensors I/O


class SafetensorsFile:
    """Random access to the tensors of one ``.safetensors`` file, one tensor per read.

    Reads go through ``seek``/``readinto`` rather than a memory map, so the
    host holds exactly the tensor asked for and nothing else of the file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > 100 * 2**20:
                    raise CheckpointError(f"{self.path}: header of {n} bytes is not plausible")
                header = json.loads(f.read(n))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: not a readable safetensors file ({e})") from e
        self._data_start = 8 + n
        self.metadata = header.pop("__metadata__", {}) or {}
        self._entries = header
        size = self.path.stat().st_size
        for name, entry in header.items():
            if entry.get("dtype") not in _ST_TO_NP:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r}"
                )
            begin, end = entry["data_offsets"]
            want = int(np.prod(entry["shape"], dtype=np.int64)) * _ST_TO_NP[entry["dtype"]].itemsize
            if end - begin != want or self._data_start + end > size:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} byte range {begin}..{end} does not match "
                    f"its shape {entry['shape']} / dtype {entry['dtype']} or the file size "
                    f"({size} bytes); the file may be truncated"
                )

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return _ST_TO_NP[self._entries[name]["dtype"]]

    def read(self, name: str) -> np.ndarray:
        e = self._entries[name]
        begin, end = e["data_offsets"]
        out = np.empty(self.shape(name), self.dtype(name))
        with open(self.path, "rb") as f:
            f.seek(self._data_start + begin)
            got = f.readinto(out.reshape(-1).view(np.uint8).data)
        if got != end - begin:
            raise CheckpointError(f"{self.path}: tensor {name!r} is truncated")
        return out


def write_safetensors(
    path: str | os.PathLike, tensors: list[tuple[str, Any]], metadata: dict[str, str] | None = None
) -> None:
    """Writes ``(name, array-producing callable or array)`` pairs, one tensor in memory at a time.

    Each value is either a numpy array or a zero-argument callable returning one,
    in which case its shape/dtype must be given as ``(callable, shape, dtype)``.
    """
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    specs = []
    for name, value in tensors:
        if isinstance(value, tuple):
            fn, shape, dtype = value
        else:
            fn, shape, dtype = (lambda v=value: v), value.shape, value.dtype
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {
            "dtype": _NP_TO_ST[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        specs.append((name, fn, tuple(shape), dtype))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keeps tensor data 8-byte aligned
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, fn, shape, dtype in specs:
            arr = np.ascontiguousarray(np.asarray(fn()), dtype=dtype)
            if arr.shape != shape:
                raise CheckpointError(
                    f"tensor {name!r}: produced shape {arr.shape}, expected {shape}"
                )
            f.write(arr.reshape(-1).view(np.uint8).data)
            del arr
    os.replace(tmp, path)


class HFCheckpoint:
    """A Hugging Face checkpoint directory: ``config.json`` plus one or several safetensors."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory")
        cfg_path = self.path / "config.json"
        if not cfg_path.exists():
            raise CheckpointError(f"{self.path}: no config.json")
        try:
            self.hf_config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from e
        index = self.path / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
        elif (self.path / SINGLE_FILE).exists():
            weight_map = None
        else:
            raise CheckpointError(f"{self.path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        self._files: dict[str, SafetensorsFile] = {}
        if weight_map is None:
            f = self._file(SINGLE_FILE)
            self.weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
        else:
            self.weight_map = dict(weight_map)
            for fname in sorted(set(self.weight_map.values())):
                f = self._file(fname)
                listed = {k for k, v in self.weight_map.items() if v == fname}
                missing = listed - set(f.keys())
                if missing:
                    raise CheckpointError(
                        f"{self.path / fname}: index lists tensors the file "
                        f"lacks: {sorted(missing)[:5]}"
                    )

    def _file(self, fname: str) -> SafetensorsFile:
        if fname not in self._files:
            p = self.path / fname
            if not p.exists():
                raise CheckpointError(f"{p}: listed in {INDEX_FILE} but missing")
            self._files[fname] = SafetensorsFile(p)
        return self._files[fname]

    def locate(self, name: str) -> tuple[SafetensorsFile, str]:
        fname = self.weight_map.get(name)
        if fname is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        return self._file(fname), fname


# --------------------------------------------------------------------------- load


def _target_shardings(abs_state, mesh: Mesh | None, rules: Rules):
    if mesh is not None:
        return model_shardings(abs_state, mesh, rules)
    single = SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(
        lambda v: v.replace(single), abs_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def _read_tensor(ckpt, name, transpose, shape, sharding, dt, path_t, config) -> jax.Array:
    """Reads one checkpoint tensor straight into ``sharding`` (each device its own shard)."""
    f, fname = ckpt.locate(name)
    got = f.shape(name)[::-1] if transpose else f.shape(name)
    if tuple(got) != tuple(shape):
        raise CheckpointError(
            f"{ckpt.path / fname}: tensor {name!r} has shape {f.shape(name)}, expected "
            f"{tuple(shape)[::-1] if transpose else tuple(shape)} for "
            f"{_path_str(path_t)} (config.json: {config})"
        )
    raw = f.read(name)
    src = raw.T if transpose else raw

    def shard(index: tuple[slice, ...] | None) -> np.ndarray:  # a device's slices
        return np.asarray(src[index], dtype=dt)

    return jax.make_array_from_callback(tuple(shape), sharding, shard)


def _drop_leading_axis(sharding: Any) -> Any:
    """The sharding of one layer's slice of a stacked array (the layer axis is never split)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    return sharding


def _zeros(shape: tuple, dtype: Any, sharding: Any) -> jax.Array:
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stacked: jax.Array, layer: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(stacked, layer.astype(stacked.dtype), i, 0)


def load_hf(
    path: str | os.PathLike,
    dtype: Any = jnp.float32,
    mesh: Mesh | None = None,
    *,
    rules: Rules = TRAIN_RULES,
    compute_dtype: Any = None,
    strict: bool = True,
    overrides: dict[str, Any] | None = None,
) -> Qwen2:
    """Loads a Hugging Face Qwen2 checkpoint directory into a sharded ``Qwen2``.

    Tensors stream one at a time: each is read from disk, converted, and every
    device receives only its own shard (``jax.make_array_from_callback``), so
    host memory holds about one tensor beyond the loaded parameters.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` or
        ``model.safetensors.index.json`` + shards (bf16, fp16 or fp32).
      dtype: parameter dtype (fp32 master weights by default).
      mesh: place parameters over this mesh with ``rules``; default: the first device.
      rules: logical-axis rules (``sharding.TRAIN_RULES`` or ``SAMPLE_RULES``).
      compute_dtype: matmul dtype (default: ``dtype``).
      strict: fail on checkpoint tensors the model does not use.
      overrides: ``ModelConfig`` fields to set beyond ``config.json``
        (``scan_layers``, ``remat``, ``attention_chunk``).

    Raises:
      CheckpointError: a missing, extra, or wrongly shaped tensor, naming it and its file.
    """
    ckpt = HFCheckpoint(path)
    dt = jnp.dtype(dtype)
    config = ModelConfig.from_hf_config(
        ckpt.hf_config,
        param_dtype=dt.name,
        dtype=jnp.dtype(compute_dtype or dt).name,
        **(overrides or {}),
    )
    graphdef, abs_state = nnx.split(abstract_model(config))
    shardings = _target_shardings(abs_state, mesh, rules)
    flat_sh = dict(nnx.to_flat_state(shardings))
    used: set[str] = set()
    leaves = []
    stacked = config.num_layers if config.scan_layers else 0
    for path_t, var in nnx.to_flat_state(abs_state):
        sharding = flat_sh[path_t].get_value()
        entries = hf_names(_path_str(path_t), stacked)
        if entries[0][0] is None:
            _, name, transpose = entries[0]
            arr = _read_tensor(ckpt, name, transpose, var.shape, sharding, dt, path_t, config)
        else:
            # One layer's tensor in host memory at a time, written into the stacked
            # array on device in place.
            arr = _zeros(tuple(var.shape), dt, sharding)
            layer_sharding = _drop_leading_axis(sharding)
            for i, name, transpose in entries:
                x = _read_tensor(
                    ckpt, name, transpose, var.shape[1:], layer_sharding, dt, path_t, config
                )
                arr = _set_layer(arr, x, jnp.int32(i))
                del x
        used.update(n for _, n, _ in entries)
        leaves.append((path_t, var.replace(arr)))
    extra = [k for k in ckpt.weight_map if k not in used and not any(p.match(k) for p in _IGNORED)]
    if config.tie_word_embeddings:
        extra = [k for k in extra if k != "lm_head.weight"]
    if extra:
        msg = f"{ckpt.path}: tensors not used by the model: " + ", ".join(
            f"{k} ({ckpt.weight_map[k]})" for k in extra[:8]
        )
        if strict:
            raise CheckpointError(msg)
        log.warning(msg)
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


# --------------------------------------------------------------------------- save


def _host_value(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _iter_hf_tensors(model: Qwen2, out_dtype: np.dtype) -> Iterator[tuple[str, tuple]]:
    cfg = model.config
    stacked = cfg.num_layers if cfg.scan_layers else 0
    for path_t, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        for layer, name, transpose in hf_names(_path_str(path_t), stacked):
            shape = tuple(value.shape) if layer is None else tuple(value.shape[1:])
            shape = shape[::-1] if transpose else shape

            def produce(v=value, i=layer, t=transpose):
                host = _host_value(v if i is None else v[i])
                return (host.T if t else host).astype(out_dtype)

            yield name, (produce, shape, out_dtype)


def save_hf(
    model: Qwen2,
    out_dir: str | os.PathLike,
    *,
    dtype: Any = jnp.bfloat16,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Writes ``model`` as a Hugging Face checkpoint directory.

    ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads the
    result. Tensors are gathered and written one at a time; files are split
    at ``max_shard_bytes`` with a ``model.safetensors.index.json``. On a
    multi-host job every process gathers, only process 0 writes.

    Args:
      model: a ``Qwen2`` (sharded or not).
      out_dir: target directory (created).
      dtype: stored dtype (bf16 as released checkpoints; fp32 for exact round trips).
      max_shard_bytes: largest file size before splitting.
    """
    out = Path(out_dir)
    writer = jax.process_index() == 0
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    np_dtype = np.dtype(jnp.dtype(dtype))
    tensors = list(_iter_hf_tensors(model, np_dtype))
    shards: list[list] = [[]]
    size = 0
    for name, spec in tensors:
        nbytes = int(np.prod(spec[1], dtype=np.int64)) * np_dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, spec))
        size += nbytes
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for fname, shard in zip(names, shards):
        if writer:
            write_safetensors(out / fname, shard)
        else:  # still take part in the collective gathers
            for _, (fn, _, _) in shard:
                fn()
    if not writer:
        return out
    if len(shards) > 1:
        total = sum(int(np.prod(s[1], dtype=np.int64)) * np_dtype.itemsize for _, s in tensors)
        index = {
            "metadata": {"total_size": total},
            "weight_map": {n: f for f, shard in zip(names, shards) for n, _ in shard},
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    else:
        stale = out / INDEX_FILE
        if stale.exists():
            stale.unlink()
    hf = model.config.to_hf_config(
        torch_dtype=np_dtype.name if np_dtype.name != "bfloat16" else "bfloat16"
    )
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    return out


__all__ = [
    "KEY_TABLE",
    "CheckpointError",
    "HFCheckpoint",
    "SafetensorsFile",
    "hf_name",
    "hf_names",
    "load_hf",
    "save_hf",
    "write_safetensors",
]
