"""What an ablation is made of: the world it runs in (``World``), its arms (``Arm``) and
the claim they test (``Ablation``); ``magic_jax.experiments.arms`` lists the shipped ones."""

from __future__ import annotations

import dataclasses

# Seeds of an ablation that names none.
SEEDS = (0, 1, 2)

# The default's stage fields, for arms that replace the whole schedule.
_STAGE_FIELDS = "prompts_per_step: 16, mini_batch_groups: 16, group_size: 8"


@dataclasses.dataclass(frozen=True)
class World:
    """A shipped task and base model that ablations run on.

    Attributes:
      key: ``default``, ``carry``, ``lockout`` or ``decision``.
      config: the config file as typed in a checkout (``configs/<name>.yaml``).
      package_config: the same file shipped in the package (``assets/...``), which runs use.
      stage_steps: steps of each of the world's two stages in every run: one number for
        both, or a pair.
      eval_overrides / run_overrides: ``--set`` assignments every run of this world gets.
      statistics: whether a finished run's final model is measured with
        ``magic_jax.jobs.carry_world.world_statistics`` (``world.json``; needs the HF export).
    """

    key: str
    config: str
    package_config: str
    stage_steps: int | tuple[int, int]
    eval_overrides: tuple[str, ...]
    run_overrides: tuple[str, ...]
    statistics: bool = False

    @property
    def total_steps(self) -> int:
        """Steps of every run of this world."""
        return sum(steps_of(self.stage_steps))


def steps_of(stage_steps: int | tuple[int, int]) -> tuple[int, int]:
    """The two stages' steps of ``stage_steps`` (one number for both, or a pair)."""
    if isinstance(stage_steps, int):
        return stage_steps, stage_steps
    return stage_steps


@dataclasses.dataclass(frozen=True)
class Arm:
    """One configuration of an ablation.

    Attributes:
      key: unique among all ablations; names the run directories (``runs/<key>/seed<k>``).
        Arms with the same key are the same runs (the baseline serves several ablations).
      label: legend text.
      overrides: ``--set`` assignments on top of ``configs/default.yaml``.
      stages: ``None`` for the world's two stages, or the (name, T) of each stage of a
        schedule that replaces them; each gets an equal share of the two stages' steps, so
        every arm trains the same number of steps.
      pending: why the arm cannot run yet (a setting that waits on other arms' runs), or
        ``None``. The runner skips a pending arm and refuses one asked for by name.
    """

    key: str
    label: str
    overrides: tuple[str, ...] = ()
    stages: tuple[tuple[str, int], ...] | None = None
    pending: str | None = None

    def step_overrides(self, stage_steps: int | tuple[int, int]) -> tuple[str, ...]:
        """The ``--set`` fixing each stage's steps (``stage_steps``: the world's two
        stages', one number for both or a pair)."""
        first, second = steps_of(stage_steps)
        if self.stages is None:
            return (f"stages.0.steps={first}", f"stages.1.steps={second}")
        each = (first + second) // len(self.stages)
        items = ", ".join(
            f"{{name: {name}, steps: {each}, max_response_length: {t}, {_STAGE_FIELDS}}}"
            for name, t in self.stages
        )
        return (f"stages=[{items}]",)


@dataclasses.dataclass(frozen=True)
class Ablation:
    """One of the report's claims and the arms that test it.

    Attributes:
      key: short name (``temperature``); the notebook is ``notebooks/NN_<key>.py``.
      title: one line.
      claim: the report's claim, in words.
      arms: the arms, the reference arm first.
      seeds: seeds per arm.
      world: a key of ``WORLDS``.
    """

    key: str
    title: str
    claim: str
    arms: tuple[Arm, ...]
    seeds: tuple[int, ...] = SEEDS
    world: str = "default"

    def arm(self, key: str) -> Arm:
        for a in self.arms:
            if a.key == key:
                return a
        raise KeyError(f"ablation {self.key!r} has no arm {key!r} (arms: {self.arm_keys})")

    @property
    def arm_keys(self) -> list[str]:
        return [a.key for a in self.arms]
