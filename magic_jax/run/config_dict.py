"""Plain dicts (YAML) to and from the config dataclasses, with errors that name the
field; dotted command-line overrides."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from magic_jax.run.rundir import JSON

# a config dataclass
T = TypeVar("T", bound="DataclassInstance")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the option's path."""


def _type_name(tp: object) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _same_kind(tp: object, value: object) -> bool:
    """Whether ``value`` is the container kind ``tp`` takes (mapping or list)."""
    origin = typing.get_origin(tp)
    if isinstance(value, Mapping):
        return origin is dict or dataclasses.is_dataclass(tp)
    if isinstance(value, list | tuple):
        return origin is tuple
    return False


def _convert(tp: object, value: object, path: str) -> object:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{path}: must not be null")
        options = [a for a in args if a is not type(None)]
        errors, same_kind = [], []
        for option in options:
            try:
                return _convert(option, value, path)
            except ConfigError as e:
                errors.append(str(e))
                if _same_kind(option, value):
                    same_kind.append(str(e))
        if len(same_kind) == 1:  # a mapping given where a mapping fits: its own error
            raise ConfigError(same_kind[0])
        if len(errors) == 1:
            raise ConfigError(errors[0])
        names = [_type_name(o) for o in options]
        raise ConfigError(f"{path}: {value!r} fits none of {names}")
    if value is None:
        raise ConfigError(f"{path}: must not be null")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, Sequence):
            if args and args[-1] is Ellipsis and isinstance(value, str):
                value = [value]  # a single path where a list is expected
            else:
                raise ConfigError(f"{path}: expected a list, got {value!r}")
        item = args[0] if args else object  # a bare ``tuple``: items as they are
        return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        key_tp, value_tp = args if args else (object, object)
        return {
            _convert(key_tp, k, f"{path}.{k}"): _convert(value_tp, v, f"{path}.{k}")
            for k, v in value.items()
        }
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: expected one of {list(args)}, got {value!r}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(
                f"{path}: expected one of {[e.value for e in tp]}, got {value!r}"
            ) from None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    return value


def from_dict(cls: type[T], data: object, path: str = "") -> T:
    """Builds dataclass ``cls`` from a nested mapping, checking keys, types and values.

    Raises:
      ConfigError: naming the dotted path of the first bad option.
    """
    where = path or cls.__name__
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of options, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = unknown[0]
        raise ConfigError(
            f"{path + '.' if path else ''}{key}: unknown option of {cls.__name__}; "
            f"expected one of {sorted(fields)}"
        )
    missing = [
        n
        for n, f in fields.items()
        if n not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{where}: missing required option {missing[0]!r}")
    kwargs = {k: _convert(hints[k], v, f"{path + '.' if path else ''}{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        named = re.match(r"([a-z_]+)[:\[]", str(e))
        if path and named and named.group(1) in fields:  # "option: ..." gets its whole path
            raise ConfigError(f"{path}.{e}") from None
        # the whole run's checks name their options' paths themselves
        raise ConfigError(f"{where}: {e}" if path else str(e)) from None


def import_extensions(names: object, near: str | os.PathLike | None = None) -> None:
    """Imports the modules a config's ``extensions`` lists, before the config is checked,
    so that what they register (rewards, advantage estimators, decode attentions, sampling
    methods, token classifiers) can be named in it. A name is looked up on ``sys.path``,
    then in ``near`` (the config file's folder), then in the working directory; the folder
    it is found in joins ``sys.path`` (the verifier workers import a reward from there too).

    Raises:
      ConfigError: not a list of module names, or a module that does not import.
    """
    import importlib.util
    import sys

    names = [names] if isinstance(names, str) else names or []
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"extensions: expected a list of module names, got {names!r}")
    folders = [str(Path(near).resolve())] if near is not None else []
    folders.append(os.getcwd())
    for i, name in enumerate(names):
        top = name.split(".")[0]
        try:
            if importlib.util.find_spec(top) is None:
                for folder in folders:
                    found = (Path(folder) / f"{top}.py").exists() or (Path(folder) / top).is_dir()
                    if found:
                        if folder not in sys.path:
                            sys.path.append(folder)
                        break
            importlib.import_module(name)
        except Exception as e:
            where = " or ".join(dict.fromkeys(folders))
            raise ConfigError(
                f"extensions[{i}]: cannot import {name!r} (looked on sys.path and in {where}): {e}"
            ) from None


def to_dict(obj: object) -> Any:
    """A dataclass tree as plain YAML/JSON values (enums as their strings)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, tuple | list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def apply_override(raw: JSON, assignment: str) -> None:
    """Applies ``a.b.c=value`` (value parsed as YAML) to a raw config mapping in place.

    List items are addressed by index: ``stages.1.steps=100``.
    """
    import yaml

    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r}: expected key.path=value")
    key, text = assignment.split("=", 1)
    value = yaml.safe_load(text)
    parts = key.strip().split(".")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        here = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"override {assignment!r}: {here} is not an item of the list")
            node = node[int(part)]
        else:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        if not isinstance(node, dict | list):
            raise ConfigError(f"override {assignment!r}: {here} is not a mapping or list")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"override {assignment!r}: {key} is not an item of the list")
        node[int(last)] = value
    else:
        node[last] = value
