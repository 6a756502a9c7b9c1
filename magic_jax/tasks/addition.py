"""Multi-digit addition with a worked, column-by-column chain of thought.

The embedded default task. A prompt is ``"{a}+{b}"`` (2 to 5 digit operands);
the worked solution writes one line per column, right to left, with the carry
it takes in (``7+9=16``, ``4+8+1=13``; a missing digit is 0), then closes the
reasoning and boxes the sum::

    <think>
    3+9=12
    2+5+1=8
    </think>
    \\boxed{812}

so responses run from about 25 to 60 tokens and the reward is the report's
math reward (Math-Verify on the text after ``</think>``). Rows come out in the
verl format, so the task goes through exactly the path real data takes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

# Every character prompts and solutions use.
CHARS = "0123456789+=\n\\{}boxed"


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdditionTask:
    """Operand sizes of the task.

    Attributes:
      min_digits / max_digits: each operand has a uniformly drawn number of
        digits in this range (no leading zeros).
    """

    min_digits: int = 2
    max_digits: int = 5

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}"
            )

    def sample(self, rng: np.random.Generator) -> tuple[int, int]:
        """One problem (a, b)."""

        def operand():
            n = int(rng.integers(self.min_digits, self.max_digits + 1))
            lo = 10 ** (n - 1) if n > 1 else 0
            return int(rng.integers(lo, 10**n))

        return operand(), operand()


def prompt(a: int, b: int) -> str:
    """The user message of a problem."""
    return f"{a}+{b}"


def worked_solution(a: int, b: int) -> str:
    """The reasoning (after ``<think>\\n``) and the answer, as the SFT target."""
    da, db = str(a)[::-1], str(b)[::-1]
    lines, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        lines.append(f"{x}+{y}" + ("+1" if carry else "") + f"={s}")
        carry = s // 10
    return "\n".join(lines) + "\n</think>\n\\boxed{" + str(a + b) + "}"


def verl_rows(
    n: int, seed: int, task: AdditionTask | None = None, *, source: str = "addition"
) -> list[dict[str, Any]]:
    """``n`` problems as verl rows (``ability`` math, the sum as ground truth).

    Args:
      n: number of rows.
      seed: problems are drawn from ``np.random.default_rng(seed)``.
      task: operand sizes.
      source: the rows' ``data_source`` (``extra_info.index`` numbers them).
    """
    task = task or AdditionTask()
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        a, b = task.sample(rng)
        rows.append(
            {
                "data_source": source,
                "prompt": [{"role": "user", "content": prompt(a, b)}],
                "ability": "math",
                "reward_model": {"ground_truth": str(a + b), "style": "rule"},
                "extra_info": {"index": i, "a": a, "b": b},
            }
        )
    return rows


def tokenizer():
    """The task's character-level tokenizer (R1-Distill markers + ``CHARS``)."""
    from magic_jax.tasks.vocab import char_tokenizer

    return char_tokenizer(CHARS)
