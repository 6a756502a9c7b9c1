"""Which install extra brings each optional dependency, and the one-line error that says so.

``pip install magic-jax`` is the light core (jax, optax, numpy): the loss functions,
advantages and entropy control. The model, the trainer and its commands need extras
(``setup.py``). ``import magic_jax`` appends a finder to ``sys.meta_path`` that is asked
only after every other finder failed, and only answers for the packages below when a
``magic_jax`` module is the one importing: it raises ``ModuleNotFoundError`` naming the
extra to install instead of the bare "No module named 'flax'".
"""

from __future__ import annotations

import sys
import types
from typing import Any

# module (top-level, or a package by its full name) -> the smallest extra that installs it
EXTRA_OF = {
    "flax": "model",
    "orbax": "model",
    "transformers": "model",
    "safetensors": "model",
    "yaml": "model",
    "grain": "train",
    "math_verify": "train",
    "tensorflow_datasets": "train",
    "importlib_resources": "train",
    "psutil": "train",
    "pyarrow": "train",
    "tensorboardX": "train",
    "tqdm": "train",
    "matplotlib": "train",
    "gcsfs": "train",
    "etils": "train",
    "google": "train",
    "google.cloud.tpu_v2": "launch",  # (a package of the namespace: its longest name wins)
    "google.cloud.tpu_v2alpha1": "launch",
    "jetstream": "jetstream",
    "jupytext": "notebooks",
}


def _known(name: str) -> str | None:
    """The longest of ``name``'s dotted prefixes that ``EXTRA_OF`` names, if any."""
    parts = name.split(".")
    found = (".".join(parts[:i]) for i in range(len(parts), 0, -1))
    return next((p for p in found if p in EXTRA_OF), None)


def message(name: str, importer: str | None = None, extra: str | None = None) -> str | None:
    """The one-line error for a missing ``name`` (None when no extra brings it)."""
    known = _known(name)
    extra = extra or (EXTRA_OF[known] if known else None)
    if known is None or extra is None:
        return None
    who = f"{importer} needs it" if importer else "it is needed"
    return (
        f"No module named {name!r}: {who}; install the [{extra}] extra: "
        f"pip install 'magic-jax[{extra}]'"
    )


def _importer() -> str | None:
    """The ``magic_jax`` module whose import statement is running, if any (None for a
    lookup such as ``importlib.util.find_spec``, which asks whether a module exists)."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        mod = frame.f_globals.get("__name__", "")
        if mod == "importlib.util" and frame.f_code.co_name == "find_spec":
            return None
        if not mod.startswith(("importlib", "_frozen_importlib", __name__)):
            return mod if mod == "magic_jax" or mod.startswith("magic_jax.") else None
        frame = frame.f_back
    return None


class HintFinder:
    """The last finder on ``sys.meta_path``: turns a missing optional dependency of a
    ``magic_jax`` module into an error that names its extra."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if _known(name) is None:
            return None
        importer = _importer()
        text = message(name, importer) if importer else None
        if text is not None:
            raise ModuleNotFoundError(text, name=name)
        return None


def install() -> None:
    """Appends the finder once (``import magic_jax`` calls this)."""
    if not any(isinstance(f, HintFinder) for f in sys.meta_path):
        sys.meta_path.append(HintFinder())
