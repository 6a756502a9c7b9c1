"""Addition with a hurried strategy and a checked one: a world where exploration pays.

A prompt is ``"{a}+{b}"`` (2 to 5 digit operands). A problem's difficulty is
its number of **carries**: the columns whose digits (with the carry coming
in) sum to 10 or more, the top column's carry out included. Problems are drawn
with every carry count equally likely, so difficulty is spread evenly from
easy (no carry) to hard (a carry in every column).

The supervised data answers in two strategies, each in two equally correct
variants, so that a policy's entropy holds real choices, not only noise in
wrong digits:

- **quick** (common, short): close the reasoning at once and box the
  column-wise sum *without carries*, the hurried answer. Right exactly when
  the problem has no carry. Variant ``a`` boxes it directly; variant ``b``
  first restates the problem with it::

      </think>\\n\\boxed{702}                 389+423, variant a (wrong: 812)
      </think>\\n389+423=702\\n\\boxed{702}

- **checked** (rare, long): write the hurried answer as a guess, then work the
  columns right to left with their carries (``9+3=12``, ``8+2+1=11``, a
  missing digit is 0), assemble the sum, then box it: the solution checks
  and corrects its own first answer and is always right. Variant ``a`` writes
  each column as (digit of a)+(digit of b), variant ``b`` the other way round::

      702?
      9+3=12
      8+2+1=11
      3+4+1=8
      =812
      </think>
      \\boxed{812}

The checked strategy is about four times as long as the quick one, so a
short first-stage T truncates it on all but the shortest problems. A model
trained on data where it is rare uses it rarely; reinforcement learning can
only discover that it pays on hard problems while the policy still samples
it, which is what entropy control is for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

# Every character prompts and solutions use.
CHARS = "0123456789+=?\n\\{}boxed"
STRATEGIES = ("quick", "checked")
VARIANTS = ("a", "b")


def columns(a: int, b: int) -> list[tuple[int, int, int]]:
    """(digit of a, digit of b, carry in) per column, right to left (a missing digit is 0)."""
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


def hurried_sum(a: int, b: int) -> int:
    """The column-wise sum of a and b with every carry dropped (right iff no carry)."""
    return int("".join(str((x + y) % 10) for x, y, _ in reversed(columns(a, b))))


def quick_solution(a: int, b: int, variant: str = "a") -> str:
    """The quick strategy: no reasoning, the hurried sum boxed (``variant`` a or b)."""
    n = hurried_sum(a, b)
    said = f"{a}+{b}={n}\n" if variant == "b" else ""
    return f"</think>\n{said}\\boxed{{{n}}}"


def checked_solution(a: int, b: int, variant: str = "a") -> str:
    """The checked strategy: the hurried guess, the columns with carries, the corrected sum."""
    lines = [f"{hurried_sum(a, b)}?"]
    for x, y, c in columns(a, b):
        p, q = (x, y) if variant == "a" else (y, x)
        lines.append(f"{p}+{q}" + ("+1" if c else "") + f"={x + y + c}")
    lines.append(f"={a + b}")
    return "\n".join(lines) + "\n</think>\n\\boxed{" + str(a + b) + "}"


def solution(a: int, b: int, strategy: str, variant: str) -> str:
    """A response of the given strategy and variant."""
    if strategy == "quick":
        return quick_solution(a, b, variant)
    if strategy == "checked":
        return checked_solution(a, b, variant)
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def classify(text: str) -> tuple[str, str]:
    """(strategy, variant) of a response, read from its first line(s).

    A response that closes its reasoning at once is quick (variant b if it
    restates the problem); anything else is checked (variant by the order of
    its first column line against the prompt is not recoverable from the
    response alone, so checked responses report variant ``"?"`` unless
    ``classify_in`` is given the problem).
    """
    t = text.lstrip("\n")
    if t.startswith("</think>"):
        return "quick", ("b" if "+" in t.split("\\boxed", 1)[0] else "a")
    return "checked", "?"


def classify_in(text: str, a: int, b: int) -> tuple[str, str]:
    """(strategy, variant) of a response to a + b; a checked one's variant from its first column."""
    strategy, variant = classify(text)
    if strategy == "checked":
        x, y, _ = columns(a, b)[0]
        lines = text.lstrip("\n").split("\n")
        first = lines[1] if len(lines) > 1 else ""
        if x == y:
            variant = "a"  # both orders read the same
        elif first.startswith(f"{y}+{x}"):
            variant = "b"
        elif first.startswith(f"{x}+{y}"):
            variant = "a"
    return strategy, variant


@dataclasses.dataclass(frozen=True, kw_only=True)
class CarryTask:
    """Operand sizes and the strategy mixture of the supervised data.

    Attributes:
      min_digits / max_digits: each operand has a uniformly drawn number of
        digits in this range (no leading zeros).
      checked_share: probability that a supervised example uses the checked
        strategy (else the quick one).
      variant_b_share: probability of variant b within either strategy.
    """

    min_digits: int = 2
    max_digits: int = 5
    checked_share: float = 0.05
    variant_b_share: float = 0.5

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}"
            )
        for name in ("checked_share", "variant_b_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")

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
        seen = set(exclude)
        out = []
        while len(out) < n:
            p = self.sample(rng)
            if p not in seen:
                seen.add(p)
                out.append(p)
        return out

    def sft_response(
        self, a: int, b: int, rng: np.random.Generator, checked_share: float | None = None
    ) -> str:
        """A supervised target: checked with probability ``checked_share`` (default the task's)."""
        share = self.checked_share if checked_share is None else checked_share
        strategy = "checked" if rng.random() < share else "quick"
        variant = "b" if rng.random() < self.variant_b_share else "a"
        return solution(a, b, strategy, variant)


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
    rows = []
    for i, (a, b) in enumerate(task.problems(n, np.random.default_rng(seed), exclude)):
        rows.append(
            {
                "data_source": source,
                "prompt": [{"role": "user", "content": prompt(a, b)}],
                "ability": "math",
                "reward_model": {"ground_truth": str(a + b), "style": "rule"},
                "extra_info": {"index": i, "a": a, "b": b, "carries": carries(a, b)},
            }
        )
    return rows


def row_problem(row: dict[str, Any]) -> tuple[int, int]:
    """(a, b) of a row written by ``verl_rows``."""
    return int(row["extra_info"]["a"]), int(row["extra_info"]["b"])


def tokenizer():
    """The task's character-level tokenizer (R1-Distill markers + ``CHARS``)."""
    from magic_jax.data.tasks.vocab import char_tokenizer

    return char_tokenizer(CHARS)
