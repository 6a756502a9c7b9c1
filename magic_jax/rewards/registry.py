"""Rewards by name: the built-in verifiers (``math``, ``code``) and registered ones, and
how the verifier pool's worker processes find a registered reward again.

A reward is ``fn(response, ground_truth) -> score``: a float in [0, 1] (1 full credit,
between 0 and 1 partial credit) or a ``RewardResult``. ``register_reward`` names it;
a data row's ``ability`` (or ``RewardsConfig.abilities``) picks it.

The pool verifies in fresh interpreters (``worker.py``), which know only the
built-ins. A registered reward reaches them by reference: registration records the
function's ``module:qualname`` (and refuses a function no other process could import:
a lambda, a closure, one defined in ``__main__``), and the pool hands every worker the
references with this process's ``sys.path`` at start; the worker imports them before
it reports ready. Nothing has to be re-registered by hand and no configuration has to
repeat the names, whichever way the registering module was imported here. A worker
knows the rewards registered before it started: register before the pool starts.
"""

from __future__ import annotations

import dataclasses
import importlib
import numbers
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any, Literal

from magic_jax.rewards.code_reward import code_reward
from magic_jax.rewards.math_reward import math_reward
from magic_jax.rewards.types import ABILITIES, RewardResult

RewardFn = Callable[..., "float | RewardResult"]
_NAME = re.compile(r"^[a-z][a-z0-9_.-]*$")
DEFAULT_DEADLINE_S = 30.0


class RewardScoreError(ValueError):
    """A reward returned something that is not a score in [0, 1] (NaN included)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardSpec:
    """A reward known by name.

    Attributes:
      name: what a row's ``ability`` (or ``RewardsConfig.abilities``) calls it.
      fn: ``fn(response, ground_truth) -> float | RewardResult``.
      deadline_s: the pool's wall-clock limit of one item; None: the pool's own option
        (the built-ins: ``RewardsConfig.math_deadline_s`` and ``code_deadline``).
      ref: ``"module:qualname"``, how a worker process imports ``fn`` (None: built in).
      config: the pool option a built-in verifier takes as ``config=``: ``"math"``
        (``MathConfig``) or ``"sandbox"`` (``SandboxConfig``); None for a registered one.
    """

    name: str
    fn: RewardFn
    deadline_s: float | None = None
    ref: str | None = None
    config: Literal["math", "sandbox"] | None = None


_REWARDS: dict[str, RewardSpec] = {
    "math": RewardSpec(name="math", fn=math_reward, config="math"),
    "code": RewardSpec(name="code", fn=code_reward, config="sandbox"),
}


def register_reward(
    name: str, fn: RewardFn, *, deadline_s: float = DEFAULT_DEADLINE_S, replace: bool = False
) -> RewardSpec:
    """Registers ``fn`` as the reward ``name``.

    Args:
      name: lower-case letters, digits, ``_ . -``, starting with a letter.
      fn: ``fn(response: str, ground_truth) -> float | RewardResult``, defined at the top
        level of an importable module (the pool's workers import it from there; keep
        that module free of JAX imports, the workers never load JAX).
      deadline_s: the pool kills a worker that spends longer on one item (the item
        then gets ``TIMEOUT``).
      replace: replace another function registered under ``name`` (registering the
        same function again only updates its deadline).

    Returns:
      The registered spec.

    Raises:
      ValueError: a bad name or deadline, a built-in's name, a name taken by another
        function, or a function the workers could not import.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"reward name {name!r}: use lower-case letters, digits, '_', '.', '-'")
    if name in ABILITIES:
        raise ValueError(f"reward {name!r} is built in; register another name and route to it")
    if not (isinstance(deadline_s, numbers.Real) and deadline_s > 0):
        raise ValueError(f"reward {name!r}: deadline_s must be > 0, got {deadline_s!r}")
    old = _REWARDS.get(name)
    if old is not None and old.fn is not fn and not replace:
        raise ValueError(f"reward {name!r} is already registered ({old.ref}); pass replace=True")
    spec = RewardSpec(name=name, fn=fn, deadline_s=float(deadline_s), ref=_ref_of(name, fn))
    _REWARDS[name] = spec
    return spec


def _ref_of(name: str, fn: Any) -> str:
    """``module:qualname`` of ``fn``, checked to import back to ``fn`` itself."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    why = None
    if not callable(fn):
        why = "is not callable"
    elif not module or not qualname or "<" in qualname:
        why = "is not a top-level function or class (a lambda, closure or partial)"
    elif module == "__main__":
        why = "is defined in __main__, which the workers cannot import"
    else:
        try:
            found = _resolve(f"{module}:{qualname}")
        except Exception as e:  # an import error of the module, by any name
            found = f"{type(e).__name__}: {e}"
        if found is not fn:
            why = f"is not what {module}:{qualname} imports ({found!r})"
    if why:
        raise ValueError(
            f"reward {name!r}: {fn!r} {why}; define it at the top level of an importable "
            "module, the verifier workers import it from there"
        )
    return f"{module}:{qualname}"


def _resolve(ref: str) -> Any:
    module, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def find_reward(name: str | None) -> RewardSpec | None:
    """The reward ``name`` (case and surrounding blanks ignored), or None."""
    if not isinstance(name, str):
        return None
    return _REWARDS.get(name.strip().lower())


def get_reward(name: str) -> RewardSpec:
    """The reward ``name``.

    Raises:
      ValueError: one line naming ``name`` and the registered rewards.
    """
    spec = find_reward(name)
    if spec is None:
        raise ValueError(f"unknown reward {name!r}; registered: {', '.join(reward_names())}")
    return spec


def reward_names() -> tuple[str, ...]:
    """Every reward's name: the built-ins, then the registered ones in order."""
    return tuple(_REWARDS)


def check_routes(abilities: Mapping[str, str]) -> dict[str, str]:
    """``RewardsConfig.abilities`` checked (every target known) and lower-cased."""
    routes = {}
    for ability, target in abilities.items():
        if not isinstance(ability, str) or not isinstance(target, str):
            raise ValueError(f"abilities must map names to names, got {ability!r}: {target!r}")
        try:
            routes[ability.strip().lower()] = get_reward(target).name
        except ValueError as e:
            raise ValueError(f"abilities[{ability}]: {e}") from None
    return routes


def as_result(spec: RewardSpec, out: Any, uid: str | None) -> RewardResult:
    """What ``spec.fn`` returned as a ``RewardResult``.

    Raises:
      RewardScoreError: not a ``RewardResult`` nor a finite number in [0, 1], naming
        the reward and the row.
    """
    if isinstance(out, RewardResult):
        return out
    row = f"row {uid!r}" if uid else "an item"
    if isinstance(out, numbers.Real) and 0.0 <= float(out) <= 1.0:  # NaN is not
        return RewardResult.scored(float(out))
    what = repr(out) if isinstance(out, numbers.Real) else f"a {type(out).__name__}"
    raise RewardScoreError(
        f"reward {spec.name!r} scored {row} {what}: a score must be a finite number in [0, 1]"
    )


def worker_setup() -> dict[str, Any]:
    """What a worker process needs to find the registered rewards (``install``)."""
    rewards = [(s.name, s.ref, s.deadline_s) for s in _REWARDS.values() if s.ref is not None]
    return {"rewards": rewards, "path": list(sys.path)}


def install(setup: Mapping[str, Any]) -> None:
    """In a worker: this process's ``sys.path`` extended by the pool's, and every reward
    of ``worker_setup`` imported and registered."""
    sys.path.extend(p for p in setup.get("path", ()) if p not in sys.path)
    for name, ref, deadline_s in setup.get("rewards", ()):
        fn = _resolve(ref)
        if fn is None:
            raise ImportError(f"reward {name!r}: {ref} does not import")
        register_reward(name, fn, deadline_s=deadline_s, replace=True)
