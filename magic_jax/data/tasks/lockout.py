"""Addition where the better strategy is a conjunction of choices, so collapse can lock it out.

Every problem adds two 4-digit numbers, and the response works the columns
right to left, checking or hurrying each (the carry task's lines,
``magic_jax.data.tasks.carry``)::

    <think>
    8+7=15      5678+4567, a full carry chain: right only when all four columns
    7+6+1=14    are checked (49 tokens)
    6+5+1=12
    5+4+1=10
    </think>
    \\boxed{10245}

    <think>
    5           1234+4321, no carry: right whatever is checked; all hurried
    5           is the shortest answer (22 tokens)
    5
    5
    </think>
    \\boxed{5555}

Half the problems are **chains** (every column takes part in a carry, so every
column must be checked) and half have **no carry** (every choice is right).
Decoding ends at the answer's end: ``}`` is an end-of-sequence token of the
world's model (``STOP``), so nothing is written after the answer, and the
response has no optional token: the four choices are the only freedom.

Why a conjunction: when every sample of a group makes the same choice, the
group's advantages are all zero and the pressure against the other choice
stops; a single choice is delayed, never locked out. Here the better
strategy on a chain problem is four choices at once, whose probabilities
multiply. A first stage whose T truncates any checked line (``STAGE1_T``)
rewards hurrying on the no-carry half while the chain half gives all-zero
groups; if checking falls from 1/2 to 1/10 per column, the full check falls
from 1/16 to 1/10,000, and a second stage that fits it (``STAGE2_T``) may
never sample it again. ``full_check`` is that strategy's text, the target of
the lock-out probe (``magic_jax.rollout.probes``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from magic_jax.data.tasks import carry
from magic_jax.data.tasks.carry import prompt as prompt  # re-exported: the same user message
from magic_jax.data.tasks.sums import distinct_problems, sum_rows
from magic_jax.data.tasks.sums import row_problem as row_problem  # re-exported

DIGITS = 4
# ``}`` closes the boxed answer and ends decoding (an end-of-sequence token of the model).
STOP = "}"
# Response tokens (the closing ``}`` counted, it is the last): every column hurried, 20-22
# (a hurried top column can write a leading zero, which the answer drops); any checked line
# adds 4-7; every column of a chain checked, the longest response:
LONGEST = 49
STAGE1_T = 23  # fits every all-hurried response (20-22), truncates any with a checked line (24+)
STAGE2_T = 52  # fits every response


def is_chain(a: int, b: int) -> bool:
    """Whether every column of ``a + b`` must be checked for the answer to be right."""
    return all(carry.needed(a, b))


def is_plain(a: int, b: int) -> bool:
    """Whether ``a + b`` has no carry (every choice gives the right answer)."""
    return carry.carries(a, b) == 0


def full_check(a: int, b: int) -> str:
    """The response that checks every column: the better strategy on a chain problem."""
    return carry.solution(a, b, [True] * len(carry.columns(a, b)))


def solution(a: int, b: int, checks: list[bool]) -> str:
    """The response that checks column i (right to left) where ``checks[i]``."""
    return carry.solution(a, b, checks)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LockoutTask:
    """The problems and the checking habit of the supervised data.

    Attributes:
      chain_share: share of chain problems (the rest have no carry).
      check_rate: probability that a supervised solution checks a column,
        independently per column (the base's habit: the full check of a chain has
        probability ``check_rate ** 4``).
    """

    chain_share: float = 0.5
    check_rate: float = 0.5

    def __post_init__(self):
        for name in ("chain_share", "check_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    def sample(self, rng: np.random.Generator) -> tuple[int, int]:
        """One problem: a chain with probability ``chain_share``, else one with no carry."""
        want = is_chain if rng.random() < self.chain_share else is_plain
        lo, hi = 10 ** (DIGITS - 1), 10**DIGITS
        while True:
            a, b = int(rng.integers(lo, hi)), int(rng.integers(lo, hi))
            if want(a, b):
                return a, b

    def problems(
        self, n: int, rng: np.random.Generator, exclude: Iterable[tuple[int, int]] = ()
    ) -> list[tuple[int, int]]:
        """``n`` distinct problems, none of them in ``exclude``."""
        return distinct_problems(self.sample, n, rng, exclude)

    def sft_response(
        self, a: int, b: int, rng: np.random.Generator, check_rate: float | None = None
    ) -> str:
        """A supervised target: each column checked with probability ``check_rate``."""
        rate = self.check_rate if check_rate is None else check_rate
        return solution(a, b, [bool(x) for x in rng.random(DIGITS) < rate])


def verl_rows(
    n: int,
    seed: int,
    task: LockoutTask | None = None,
    *,
    source: str = "lockout",
    exclude: Iterable[tuple[int, int]] = (),
) -> list[dict[str, Any]]:
    """``n`` distinct problems as verl rows (``extra_info.chain``: a chain problem or not).

    Each half has its own ``data_source`` (``{source}-chain``, ``{source}-plain``), so an
    evaluation's ``by_source`` gives the accuracy of each.
    """
    task = task or LockoutTask()
    problems = task.problems(n, np.random.default_rng(seed), exclude)
    rows = sum_rows(problems, source=source, extra=lambda a, b: {"chain": is_chain(a, b)})
    for r in rows:
        r["data_source"] = f"{source}-{'chain' if r['extra_info']['chain'] else 'plain'}"
    return rows


def probe_target(row: Any) -> str | None:
    """The lock-out probe's text for a row (a verl row or a ``PromptRow``): the full check
    of a chain problem; None for a problem with no carry."""
    extra = row["extra_info"] if isinstance(row, dict) else row.extra_info
    a, b = int(extra["a"]), int(extra["b"])
    return full_check(a, b) if is_chain(a, b) else None


def tokenizer():
    """The carry task's character tokenizer (the same characters)."""
    return carry.tokenizer()
