"""The hooks after a training step: when each runs, in what order, what they share."""

import pytest

from magic_jax.run.hooks import StepDone, StepHooks


def _done(step, ended=None, last_stage=False):
    return StepDone(step, None, {}, ended, last_stage, None, None)  # type: ignore[arg-type]


def test_hooks_run_by_step_count_or_condition_in_the_order_added():
    ran = []
    hooks = StepHooks()
    hooks.add(lambda d: ran.append(("record", d.step)))
    hooks.add(lambda d: ran.append(("eval", d.step)), every=3, also=lambda d: d.last_stage)
    hooks.add(lambda d: ran.append(("switch", d.step)), every=None, also=lambda d: bool(d.ended))
    for step in range(1, 7):
        hooks.run(_done(step, ended="budget" if step == 4 else None, last_stage=step == 5))
    assert ran == [
        ("record", 1),
        ("record", 2),
        ("record", 3),
        ("eval", 3),
        ("record", 4),
        ("switch", 4),
        ("record", 5),
        ("eval", 5),
        ("record", 6),
        ("eval", 6),
    ]


def test_a_later_hook_sees_what_an_earlier_one_changed():
    """An evaluation's until rule ends the stage: the switch after it runs."""
    switched = []

    def evaluate(done):
        done.ended = "no eval gain for 2 evaluation(s)"

    hooks = StepHooks()
    hooks.add(evaluate, every=2)
    hooks.add(
        lambda d: switched.append((d.step, d.ended)), every=None, also=lambda d: bool(d.ended)
    )
    for step in (1, 2, 3):
        hooks.run(_done(step))
    assert switched == [(2, "no eval gain for 2 evaluation(s)")]


@pytest.mark.parametrize("every", [0, -2])
def test_a_hook_needs_a_positive_step_count(every):
    with pytest.raises(ValueError, match=f"positive step count, got {every}"):
        StepHooks().add(lambda d: None, every=every)
