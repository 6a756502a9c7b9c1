"""One option, one place: no option name is defined by two of the option dataclasses.

The tree is every dataclass reachable from the run config (``TrainConfig``: each field's
type, recursively, and each dataclass base), plus the option classes built outside it:
the engine's (``EngineConfig``), the update's (``UpdateConfig``) and the scoring jobs'
(``eval``, ``estimate-difficulty``). An option is defined where its name is annotated:
a subclass that inherits it does not define it again. A section (a field whose type is
one option dataclass, such as ``loss: LossConfig``) held by two classes is one place:
its options are defined once, in the section's class.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import typing

# (module, class) of the option classes outside the run config's tree.
ROOTS = (
    ("magic_jax.run.config", "TrainConfig"),
    ("magic_jax.rollout.engine_config", "EngineConfig"),
    ("magic_jax.update.config", "UpdateConfig"),
    ("magic_jax.jobs.eval", "EvalOptions"),
    ("magic_jax.jobs.difficulty", "DifficultyOptions"),
)

# Names that two classes hold for different things, with the reason. Each entry names
# the classes exactly: a third class defining the name fails the test.
DIFFERENT_THINGS = {
    "mode": (
        {"EntropyControlConfig", "RolloutConfig"},
        "the entropy controller's (adaptive or fixed); the rollouts' (sync or overlap)",
    ),
    "temperature": (
        {"SamplingConfig", "LossConfig", "EvalConfig", "ScoringJob"},
        "the rollouts' sampling temperature; the loss's (load_config sets it to the "
        "sampling's, the loss checks they agree); the in-run evaluation's and the scoring "
        "jobs' own protocol (1.0 whatever the rollouts use)",
    ),
    "top_p": (
        {"SamplingConfig", "EvalConfig", "ScoringJob"},
        "the rollouts' nucleus; the in-run evaluation's and the scoring jobs' protocol",
    ),
    "max_response_length": (
        {"StageConfig", "EvalConfig", "ScoringJob"},
        "each stage's T; the in-run evaluation's limit; a scoring job's limit",
    ),
    "max_prompt_length": (
        {"DataConfig", "ScoringJob"},
        "the training prompts' limit; a scoring job's",
    ),
    "data": (
        {"TrainConfig", "EvalConfig", "MeshConfig"},
        "the training data section; the evaluation sets' paths; the mesh's data axis",
    ),
    "mini_batch_groups": (
        {"StageConfig", "UpdateConfig"},
        "D_T is set per stage in the schedule; UpdateConfig is the one stage's update "
        "that stages.update_config builds from it (never read from a config file)",
    ),
    "kl_beta": (
        {"LossConfig", "StageConfig"},
        "the run's KL weight; a stage's override of it (null: the run's)",
    ),
    "eps": (
        {"AdvantageConfig", "OptimizerConfig"},
        "added to the group reward std; Adam's epsilon",
    ),
    "estimator": (
        {"AdvantageConfig", "EntropyControlConfig"},
        "the registered advantage estimator; how the entropy controller measures entropy",
    ),
    "num_samples": (
        {"EvalConfig", "EvalOptions"},
        "n of the in-run avg@n; n per data set of the eval command",
    ),
    "seed": (
        {"TrainConfig", "ScoringJob"},
        "the run's data order and sampling; a scoring job's sampling seed",
    ),
    "mesh": (
        {"TrainConfig", "ScoringJob"},
        "the run's mesh section; a scoring job's mesh as text (--mesh)",
    ),
    "tokenizer": (
        {"TrainConfig", "ScoringJob"},
        "the run's tokenizer; a scoring job's",
    ),
    "param_dtype": (
        {"TrainConfig", "ScoringJob"},
        "the run's master weights; the dtype a scoring job loads a checkpoint in",
    ),
    "layer_unroll": (
        {"EngineOptions", "UpdateOptions"},
        "the decode step's layer unroll; the update's (measured apart: the scan on CPU "
        "for decode, every layer inlined for the update)",
    ),
}


def _dataclasses_in(tp: typing.Any) -> typing.Iterator[type]:
    """The dataclasses a type annotation names (inside unions, tuples, mappings)."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        yield tp
    for arg in typing.get_args(tp):
        yield from _dataclasses_in(arg)


def option_tree() -> list[type]:
    """Every option dataclass reachable from ``ROOTS`` (field types and bases)."""
    todo = [getattr(importlib.import_module(m), name) for m, name in ROOTS]
    seen: list[type] = []
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        todo += [b for b in cls.__mro__[1:] if dataclasses.is_dataclass(b)]
        for tp in typing.get_type_hints(cls).values():
            todo += _dataclasses_in(tp)
    return seen


def own_options(cls: type) -> dict[str, typing.Any]:
    """The fields ``cls`` annotates itself (not those it inherits): name -> a key that is
    the section's class for a section, else the class itself (an option of its own)."""
    own = set(vars(cls).get("__annotations__", {}))
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in own:
            inner = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
            section = hints[f.name] if not inner else inner[0] if len(inner) == 1 else None
            is_section = isinstance(section, type) and dataclasses.is_dataclass(section)
            out[f.name] = section if is_section else cls
    return out


def test_no_option_is_defined_twice():
    definitions = collections.defaultdict(lambda: collections.defaultdict(set))
    for cls in option_tree():
        for name, key in own_options(cls).items():
            definitions[name][key].add(cls.__name__)
    twice = {}
    for name, by_key in definitions.items():
        holders = set().union(*by_key.values())
        if len(by_key) > 1 and holders != DIFFERENT_THINGS.get(name, (None,))[0]:
            twice[name] = sorted(holders)
    assert not twice, f"options defined in more than one dataclass: {twice}"


def test_the_tree_holds_the_sections_and_the_listed_names_exist():
    names = {cls.__name__ for cls in option_tree()}
    assert {"RolloutConfig", "EngineOptions", "UpdateOptions", "SamplingConfig"} <= names
    for name, (classes, reason) in DIFFERENT_THINGS.items():
        assert classes <= names and reason, name
