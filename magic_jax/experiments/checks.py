"""The report's predictions, per ablation (``CHECKS``), each a ``Check``: an outcome of
``magic_jax.experiments.verdicts.OUTCOMES`` and the sign of one arm minus another."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Check:
    """One directional prediction of the report: ``arm`` minus ``reference`` in ``outcome``.

    Attributes:
      outcome: a key of ``OUTCOMES``.
      reference / arm: arm keys; ``reference`` None compares ``arm`` with 0.
      sign: the report's predicted sign of (arm - reference): -1, +1, or 0 for "the same".
      tolerance: for sign 0, the largest |difference| that counts as the same.
    """

    outcome: str
    reference: str | None
    arm: str
    sign: int
    tolerance: float = 0.0


# The report's predictions, per ablation.
CHECKS: dict[str, tuple[Check, ...]] = {
    "central": (
        Check("final accuracy", "carry-none", "carry-adaptive", +1),
        Check("final accuracy", "carry-fixed-0.005", "carry-adaptive", +1),
        Check("late entropy", "carry-none", "carry-adaptive", +1),
        Check("final check rate (carry columns)", "carry-none", "carry-adaptive", +1),
        Check("final accuracy", "carry-none", "carry-adaptive-0.07", +1),
        Check("final accuracy", "carry-fixed-0.005", "carry-adaptive-0.07", +1),
        Check("late entropy", "carry-none", "carry-adaptive-0.07", +1),
        Check("final accuracy", "carry-none", "carry-fixed-0.005", +1),
        Check("final accuracy", "carry-none", "carry-adaptive-0.08", +1),
        Check("final accuracy", "carry-fixed-0.005", "carry-adaptive-0.08", +1),
        Check("late entropy", "carry-none", "carry-adaptive-0.08", +1),
        Check("final check rate (carry columns)", "carry-none", "carry-adaptive-0.08", +1),
    ),
    "temperature": (
        Check("mean entropy", "carry-temp-1.0", "carry-temp-0.6", -1),
        Check("final accuracy", "carry-temp-1.0", "carry-temp-0.6", -1),
        Check("final accuracy (evaluated at 0.6)", "carry-temp-1.0", "carry-temp-0.6", -1),
    ),
    "off_policy": (
        Check("mean entropy", "carry-none", "carry-nsgd4-minibatch", -1),
        Check("final accuracy", "carry-none", "carry-nsgd4-minibatch", -1),
        Check("mean entropy", "carry-none", "carry-nsgd4-reuse", -1),
        Check("final accuracy", "carry-none", "carry-nsgd4-reuse", -1),
    ),
    "entropy_control": (
        Check("late entropy", "carry-adaptive-0.08", "carry-fixed-0.005", -1),
        Check("late entropy", "carry-adaptive-0.08", "carry-fixed-2", +1),
        Check("late |entropy - carry target|", "carry-fixed-0.005", "carry-adaptive-0.08", -1),
        Check("late |entropy - carry target|", "carry-fixed-2", "carry-adaptive-0.08", -1),
    ),
    "adv_mask": (
        Check("stage-1 truncated fraction", "carry-none", "carry-mask-before", +1),
        Check("stage-1 rollout reward", "carry-none", "carry-mask-before", -1),
        Check("stage-1 non-truncated accuracy", "carry-none", "carry-mask-before", +1),
        Check("stage-1 truncated fraction", "carry-none", "carry-mask-after", +1),
        Check("stage-1 rollout reward", "carry-mask-after", "carry-mask-before", -1),
        Check("stage-1 non-truncated accuracy", "carry-mask-after", "carry-mask-before", +1),
    ),
    "clip_higher": (
        Check("mean entropy", "carry-clip-0.05", "carry-clip-0.07", +1),
        Check("late entropy", "carry-clip-0.05", "carry-clip-0.07", +1),
        Check("final accuracy", "carry-clip-0.05", "carry-clip-0.07", +1),
        Check("mean entropy", "carry-clip-0.05", "carry-clip-0.1", +1),
        Check("max grad norm", "carry-clip-0.05", "carry-clip-0.1", +1),
    ),
    "kl": (
        # the reference exists only while some stage has a KL term, and its KL is measured
        # only where beta > 0: the pull is read from the both-stages arm's own KL over stage 2
        Check("stage-2 KL drift", None, "carry-kl-0.1", -1),
        Check("final accuracy", "carry-kl-0.1-stage1", "carry-kl-0.1", -1),
        Check("final accuracy", "carry-none", "carry-kl-0.1", -1),
    ),
    "multi_stage": (
        Check("final accuracy", "carry-single-T64", "carry-none", 0, tolerance=0.02),
        Check("rollout tokens (M)", "carry-single-T64", "carry-none", -1),
    ),
    # as pre-registered in notebooks/prereg/central-lockout.yaml (its 7 predictions)
    "central_lockout": (
        Check("final accuracy", "lockout-none", "lockout-adaptive", +1),
        Check("final chain accuracy", "lockout-none", "lockout-adaptive", +1),
        Check("probe log10 p at stage-1 end", "lockout-none", "lockout-adaptive", +1),
        Check("final accuracy", "lockout-fixed-mean", "lockout-adaptive", +1),
        Check("final accuracy", "lockout-none", "lockout-long-T", +1),
        Check("probe log10 p at stage-1 end", "lockout-none", "lockout-long-T", +1),
        Check("late entropy", "lockout-none", "lockout-adaptive", +1),
    ),
    # as pre-registered in notebooks/prereg/lockout-control.yaml
    "lockout_control": (
        Check("final chain accuracy", "lockout-mask-none", "lockout-mask-adaptive", +1),
        Check("probe log10 p at stage-1 end", "lockout-mask-none", "lockout-mask-adaptive", +1),
        Check("final accuracy", "lockout-mask-none", "lockout-mask-adaptive", +1),
        Check("late entropy", "lockout-mask-none", "lockout-mask-adaptive", +1),
    ),
    # as pre-registered in notebooks/prereg/central-decision.yaml (the first is its primary
    # endpoint, the second its positive control)
    "central_decision": (
        Check("final chain accuracy", "decision-none", "decision-adaptive", +1),
        Check("final chain accuracy", "decision-none", "decision-open", +1),
        Check("probe log10 p at stage-1 end", "decision-none", "decision-adaptive", +1),
        Check("final chain accuracy", "decision-fixed", "decision-adaptive", +1),
        Check("final accuracy", "decision-none", "decision-adaptive", +1),
        Check("late decision-token entropy", "decision-none", "decision-adaptive", +1),
    ),
    # as pre-registered in notebooks/prereg/central-choice.yaml
    "central_choice": (
        Check("final accuracy", "carry-choice-none", "carry-choice-adaptive", +1),
        Check("late choice-token entropy", "carry-choice-none", "carry-choice-adaptive", +1),
        Check("final check rate (carry columns)", "carry-choice-none", "carry-choice-adaptive", +1),
    ),
    # as pre-registered in notebooks/prereg/offpolicy-adaptive.yaml
    "offpolicy_adaptive": (
        Check("final accuracy", "carry-a9-nsgd4", "carry-a9-nsgd4-adaptive", +1),
        Check("late entropy", "carry-a9-nsgd4", "carry-a9-nsgd4-adaptive", +1),
        Check("mean entropy", "carry-a9-nsgd1", "carry-a9-nsgd4", -1),
        Check("final accuracy", "carry-a9-nsgd1", "carry-a9-nsgd4", -1),
    ),
    # as pre-registered in notebooks/prereg/staleness.yaml (the first is its primary endpoint;
    # entropy and alpha are exploratory; the two "same" are outside the Holm family)
    "staleness": (
        Check("final accuracy", "carry-stale4-naive", "carry-stale4-decoupled", +1),
        Check("final accuracy", "carry-stale-sync", "carry-stale4-naive", -1),
        Check("final accuracy", "carry-stale-sync", "carry-stale4-decoupled", 0, tolerance=0.05),
        Check("final accuracy", "carry-stale-sync", "carry-stale0-decoupled", 0, tolerance=0.05),
        Check("mean entropy", "carry-stale-sync", "carry-stale4-naive", +1),
        Check("mean alpha", "carry-stale-sync", "carry-stale4-naive", -1),
    ),
    "staleness_lr": tuple(
        Check(outcome, f"carry-slr-{ref}-s4-lr{lr0}", f"carry-slr-{arm}-s4-lr{lr}", sign, tol)
        for outcome, ref, lr0, arm, lr, sign, tol in (
            ("final accuracy", "decoupled", "3e-4", "trust", "3e-4", +1, 0.0),
            ("final accuracy", "naive", "3e-4", "trust", "3e-4", 0, 0.05),
            ("final accuracy", "decoupled", "3e-4", "naive", "3e-4", +1, 0.0),
            ("final accuracy", "decoupled", "3e-4", "decoupled", "1e-4", +1, 0.0),
            ("mean sampler KL", "decoupled", "3e-4", "trust", "3e-4", -1, 0.0),
        )
    ),
}
