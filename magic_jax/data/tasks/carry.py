"""Addition where every column is a choice: check it, or hurry it.

A prompt is ``"{a}+{b}"`` (2 to 5 digit operands). A response works the
columns right to left, one line per column, and at every column chooses:

- **check** it: write ``x+y=s`` or, with a carry coming in, ``x+y+1=s`` (6 to
  8 characters); the column's digit is ``s mod 10`` and it carries ``s // 10``
  into the next column;
- **hurry** it: write only the digit ``(x + y) mod 10`` (1 character),
  ignoring the carry coming in and passing none on.

Then it closes the reasoning and boxes the number its lines spell (a checked
top column that carries adds a leading 1)::

    <think>
    9+3=12      389 + 423: every column checked
    8+2+1=11
    3+4+1=8
    </think>
    \\boxed{812}

    <think>
    2           hurried throughout: 702, wrong
    0
    7
    </think>
    \\boxed{702}

The answer is right exactly when every column that takes part in a carry
(one whose digits and incoming carry sum to 10 or more, and the column that
receives that carry) is checked; checking any other column changes nothing
but the length. So:

- a problem's difficulty is its number of **carries** (problems are drawn
  with every carry count equally likely), and a problem with no carry is
  solved whatever the choices;
- correct responses differ in which of the other columns they check: real
  diversity, and the policy's entropy sits in these choices, not only in
  noise on wrong digits;
- the supervised data checks each column independently with a small
  probability (``check_rate``), so the base model rarely checks every column
  a hard problem needs (about ``check_rate`` to the power of the columns in
  carries), and the checked solutions are longer (up to 60 tokens against
  22-27), so a short first-stage T truncates them. Reinforcement learning can
  only learn when to check while the policy still samples checked columns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from magic_jax.data.tasks.sums import distinct_problems, sum_rows
from magic_jax.data.tasks.sums import row_problem as row_problem  # re-exported

# Every character prompts and solutions use.
CHARS = "0123456789+=\n\\{}boxed"


def columns(a: int, b: int) -> list[tuple[int, int, int]]:
    """(digit of a, digit of b, true carry in) per column, right to left (a missing digit is 0)."""
    da, db = str(a)[::-1], str(b)[::-1]
    out, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        out.append((x, y, carry))
        carry = (x + y + carry) // 10
    return out


def carries(a: int, b: int) -> int:
    """How many columns of a + b carry (the top column's carry out included)."""
    return sum((x + y + c) >= 10 for x, y, c in columns(a, b))


def needed(a: int, b: int) -> list[bool]:
    """Per column, right to left: must it be checked for the answer to be right?

    True for a column whose digits and true carry in sum to 10 or more, and
    for a column that receives a carry.
    """
    return [(x + y + c) >= 10 or c == 1 for x, y, c in columns(a, b)]


def solution(a: int, b: int, checks: Sequence[bool]) -> str:
    """The response that checks column i (right to left) where ``checks[i]``, else hurries it."""
    cols = columns(a, b)
    if len(checks) != len(cols):
        raise ValueError(f"{a}+{b} has {len(cols)} columns, got {len(checks)} choices")
    lines, digits, carry = [], [], 0
    for (x, y, _), check in zip(cols, checks):
        if check:
            s = x + y + carry
            lines.append(f"{x}+{y}" + ("+1" if carry else "") + f"={s}")
            digits.append(s % 10)
            carry = s // 10
        else:
            d = (x + y) % 10
            lines.append(str(d))
            digits.append(d)
            carry = 0
    answer = ("1" if carry else "") + "".join(map(str, reversed(digits)))
    return "\n".join(lines) + "\n</think>\n\\boxed{" + str(int(answer)) + "}"


def read_checks(text: str) -> list[bool] | None:
    """Which lines of a response's reasoning are checked (``x+y...=s``), right to left.

    None when the reasoning is not closed (a truncated or malformed response).
    """
    if "</think>" not in text:
        return None
    body = text.split("</think>", 1)[0].strip("\n")
    return [("=" in line) for line in body.split("\n")] if body else []


# The classes ``token_classes`` gives a response's tokens.
TOKEN_CLASSES = ("choice", "digit", "format", "after_answer")


def token_classes(pieces: Sequence[str]) -> list[str]:
    """The class of each token of a response, from its tokens' texts (in order).

    ``choice``: the first token of a reasoning line, where the response checks the column
    (``x+y...``, the line starts with the digit ``x``) or hurries it (the line is one
    digit); ``digit``: every other digit, in the reasoning or the answer; ``format``: the
    rest up to the answer's closing ``}`` (operators, line breaks, ``</think>``,
    ``\\boxed{``); ``after_answer``: every token after that ``}`` (text the verifier
    ignores). A token's class is read from the text before it, so a truncated response
    is classified as far as it goes.
    """
    out, reasoning, line_start, answered, boxed = [], True, True, False, False
    for piece in pieces:
        if answered:
            out.append("after_answer")
            continue
        if reasoning and piece.strip() == "</think>":
            reasoning = False
            out.append("format")
            continue
        digit = piece.isdigit()
        out.append(
            "choice" if reasoning and line_start and digit else "digit" if digit else "format"
        )
        line_start = reasoning and piece.endswith("\n")
        boxed = boxed or "{" in piece
        answered = boxed and "}" in piece
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class CarryTask:
    """Operand sizes and the checking habit of the supervised data.

    Attributes:
      min_digits / max_digits: each operand has a uniformly drawn number of
        digits in this range (no leading zeros).
      check_rate: probability that a supervised solution checks a column,
        independently per column.
    """

    min_digits: int = 2
    max_digits: int = 5
    check_rate: float = 0.25

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}"
            )
        if not 0.0 <= self.check_rate <= 1.0:
            raise ValueError(f"check_rate must be in [0, 1], got {self.check_rate}")

    def sample(self, rng: np.random.Generator) -> tuple[int, int]:
        """One problem (a, b): digit counts uniform, then a uniform carry count, then operands."""

        def operand(n):
            return int(rng.integers(10 ** (n - 1) if n > 1 else 0, 10**n))

        while True:
            na, nb = (int(rng.integers(self.min_digits, self.max_digits + 1)) for _ in range(2))
            want = int(rng.integers(0, max(na, nb) + 1))
            for _ in range(400):
                a, b = operand(na), operand(nb)
                if carries(a, b) == want:
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
        n = len(columns(a, b))
        return solution(a, b, [bool(x) for x in rng.random(n) < rate])


def prompt(a: int, b: int) -> str:
    """The user message of a problem."""
    return f"{a}+{b}"


def verl_rows(
    n: int,
    seed: int,
    task: CarryTask | None = None,
    *,
    source: str = "carry",
    exclude: Iterable[tuple[int, int]] = (),
) -> list[dict[str, Any]]:
    """``n`` distinct problems as verl rows (the sum as ground truth, carries in ``extra_info``)."""
    task = task or CarryTask()
    problems = task.problems(n, np.random.default_rng(seed), exclude)
    return sum_rows(problems, source=source, extra=lambda a, b: {"carries": carries(a, b)})


def tokenizer():
    """The task's character-level tokenizer (R1-Distill markers + ``CHARS``)."""
    from magic_jax.data.tasks.vocab import char_tokenizer

    return char_tokenizer(CHARS)
