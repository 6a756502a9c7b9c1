"""Multi-digit addition in two solution styles: a long worked one and a short one that guesses.

The embedded default task. A prompt is ``"{a}+{b}"`` (2 to 5 digit operands).
Its supervised data mixes two ways of answering, as distilled long-CoT data
mixes careful and hurried solutions:

- the **worked** style writes one line per column, right to left, with the
  carry it takes in (``7+9=16``, ``4+8+1=13``; a missing digit is 0), then
  closes the reasoning and boxes the sum; it is long (about 8 tokens per
  column, 25 to 60 tokens with EOS) and always right::

      <think>
      3+9=12
      2+5+1=8
      </think>
      \\boxed{812}

- the **quick** style closes the reasoning at once and boxes a guess: as
  many random digits as the longer operand has (``</think>\\n\\boxed{407}``
  for 23 + 589); it is short (12 to 16 tokens) and almost never right.

Supervised batches hold the two styles in a fixed proportion
(``worked_share``), assigned to problems at random, not by problem, so more
supervised training converges to that mixture and no further: its accuracy
at temperature 1 plateaus near ``worked_share`` times the worked style's
accuracy. The verified reward separates the styles at the first response
token, where they diverge, so RL can learn to prefer the worked style. The
worked style's length grows with the number of columns, so a short
first-stage T truncates it on the longest problems. The reward is the
report's math reward (Math-Verify on the text after ``</think>``); rows come
out in the verl format, so the task goes through exactly the path real data
takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from magic_jax.data.tasks.sums import distinct_problems, sum_rows
from magic_jax.data.tasks.sums import row_problem as row_problem  # re-exported

# Every character prompts and solutions use.
CHARS = "0123456789+=\n\\{}boxed"


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdditionTask:
    """Operand sizes and the style mixture of the supervised data.

    Attributes:
      min_digits / max_digits: each operand has a uniformly drawn number of
        digits in this range (no leading zeros).
      worked_share: probability that a supervised example uses the worked
        style (else the quick one).
    """

    min_digits: int = 2
    max_digits: int = 5
    worked_share: float = 0.3

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}"
            )
        if not 0.0 <= self.worked_share <= 1.0:
            raise ValueError(f"worked_share must be in [0, 1], got {self.worked_share}")

    def sample(self, rng: np.random.Generator) -> tuple[int, int]:
        """One problem (a, b)."""

        def operand():
            n = int(rng.integers(self.min_digits, self.max_digits + 1))
            lo = 10 ** (n - 1) if n > 1 else 0
            return int(rng.integers(lo, 10**n))

        return operand(), operand()

    def problems(
        self, n: int, rng: np.random.Generator, exclude: Iterable[tuple[int, int]] = ()
    ) -> list[tuple[int, int]]:
        """``n`` distinct problems, none of them in ``exclude``."""
        return distinct_problems(self.sample, n, rng, exclude)

    def sft_response(self, a: int, b: int, rng: np.random.Generator) -> str:
        """A supervised target: the worked style with probability ``worked_share``."""
        if rng.random() < self.worked_share:
            return worked_solution(a, b)
        return quick_solution(a, b, rng)

    def worked_in_batch(self, step: int, batch: int) -> int:
        """How many of step ``step``'s ``batch`` supervised examples use the worked style.

        Exactly ``worked_share`` of the examples up to any step (rounded down),
        so the style proportion carries no sampling noise from batch to batch:
        supervised training settles on it instead of drifting around it.
        """
        done = int(self.worked_share * batch * step)
        return int(self.worked_share * batch * (step + 1)) - done


def prompt(a: int, b: int) -> str:
    """The user message of a problem."""
    return f"{a}+{b}"


def worked_solution(a: int, b: int) -> str:
    """The worked style: the reasoning (after ``<think>\\n``) and the answer."""
    da, db = str(a)[::-1], str(b)[::-1]
    lines, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        lines.append(f"{x}+{y}" + ("+1" if carry else "") + f"={s}")
        carry = s // 10
    return "\n".join(lines) + "\n</think>\n\\boxed{" + str(a + b) + "}"


def quick_solution(a: int, b: int, rng: np.random.Generator) -> str:
    """The quick style: no reasoning, a guess of the longer operand's length boxed."""
    n = max(len(str(a)), len(str(b)))
    guess = int(rng.integers(10 ** (n - 1), 10**n))
    return "</think>\n\\boxed{" + str(guess) + "}"


def verl_rows(
    n: int,
    seed: int,
    task: AdditionTask | None = None,
    *,
    source: str = "addition",
    exclude: Iterable[tuple[int, int]] = (),
) -> list[dict[str, Any]]:
    """``n`` distinct problems as verl rows (``ability`` math, the sum as ground truth).

    Args:
      n: number of rows.
      seed: problems are drawn from ``np.random.default_rng(seed)``.
      task: operand sizes.
      source: the rows' ``data_source`` (``extra_info.index`` numbers them).
      exclude: problems (a, b) never to emit, e.g. a held-out set.
    """
    task = task or AdditionTask()
    problems = task.problems(n, np.random.default_rng(seed), exclude)
    return sum_rows(problems, source=source)


def tokenizer():
    """The task's character-level tokenizer (R1-Distill markers + ``CHARS``)."""
    from magic_jax.data.tasks.vocab import char_tokenizer

    return char_tokenizer(CHARS)
