"""Addition where each column opens with one decision token, so entropy can hold the choice.

The lock-out task's problems (``magic_jax.data.tasks.lockout``: half full carry chains,
half with no carry), but every reasoning line starts with a token of its own that
chooses what the line does: ``<check>`` (the column worked, ``x+y+1=s``) or ``<skip>``
(the column hurried, one digit)::

    <think>
    <check>8+7=15        5678+4567, a chain: right only when every line is checked
    <check>7+6+1=14
    <check>6+5+1=12
    <check>5+4+1=10
    </think>
    \\boxed{10245}

In the lock-out world the choice is the line's first digit, so an entropy bonus on
the choice tokens can be bought with wrong digits (as its control's runs did). Here the choice is a
token that only ever chooses: ``token_classes`` gives it the class ``decision``, and
``entropy.tokens: "decision:decision"`` puts the bonus and the controller's measured
entropy on it alone, so holding that entropy means holding P(check).

Stage 1's limit (``stage1_limit``) fits every all-skip response and truncates any
response with a checked line: a check costs the reward on a problem with no carry
(the punishment; its dose is the share of such problems, ``1 - chain_share``; with
``chain_share = 1`` the choice is unrewarded, every stage-1 group is all wrong).
Stage 2's limit (``stage2_limit``) fits the full check, which then alone solves a
chain. ``}`` ends decoding (``STOP``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from magic_jax.data.tasks import carry
from magic_jax.data.tasks.carry import prompt as prompt  # re-exported: the same user message
from magic_jax.data.tasks.sums import distinct_problems, sum_rows
from magic_jax.data.tasks.sums import row_problem as row_problem  # re-exported

CHECK, SKIP = "<check>", "<skip>"
DECISIONS = (CHECK, SKIP)  # whole tokens of the vocabulary, one per reasoning line
STOP = "}"
DIGITS = 3  # the default operand size: three decisions, all of them needed on a chain
MIN_DIGITS, MAX_DIGITS = 2, 4  # within these, stage 1's limit splits the strategies exactly
# The classes ``token_classes`` gives a response's tokens.
TOKEN_CLASSES = ("decision", "digit", "format", "after_answer")


def stage1_limit(digits: int = DIGITS) -> int:
    """Stage 1's T: the longest all-skip response (3 tokens a line, ``</think>\\n\\boxed{``,
    at most ``digits`` answer digits and ``}``); any checked line makes a response longer."""
    _check_digits(digits)
    return 4 * digits + 10


def stage2_limit(digits: int = DIGITS) -> int:
    """Stage 2's T: the longest response, a chain's full check (the first line
    ``<check>x+y=ss``, each other ``<check>x+y+1=ss``, a carry into a new top digit)."""
    _check_digits(digits)
    return 11 * digits + 9


def _check_digits(digits: int) -> None:
    if not isinstance(digits, int) or not MIN_DIGITS <= digits <= MAX_DIGITS:
        raise ValueError(f"digits must be an integer in [{MIN_DIGITS}, {MAX_DIGITS}], got {digits}")


def is_chain(a: int, b: int) -> bool:
    """Whether every column of ``a + b`` must be checked for the answer to be right."""
    return all(carry.needed(a, b))


def is_plain(a: int, b: int) -> bool:
    """Whether ``a + b`` has no carry (every choice gives the right answer)."""
    return carry.carries(a, b) == 0


def solution(a: int, b: int, checks: Sequence[bool]) -> str:
    """The response that checks column i (right to left) where ``checks[i]``: each line
    opens with its decision token, then the carry task's line."""
    body, tail = carry.solution(a, b, checks).split("\n</think>", 1)
    lines = [(CHECK if c else SKIP) + line for c, line in zip(checks, body.split("\n"))]
    return "\n".join(lines) + "\n</think>" + tail


def full_check(a: int, b: int) -> str:
    """The response that checks every column: the better strategy on a chain problem."""
    return solution(a, b, [True] * len(carry.columns(a, b)))


def read_decisions(text: str) -> list[bool] | None:
    """The decision of each reasoning line (True: ``<check>``), right to left; None when
    the reasoning is not closed or a line opens with no decision token."""
    if "</think>" not in text:
        return None
    body = text.split("</think>", 1)[0].strip("\n")
    lines = body.split("\n") if body else []
    if not all(line.startswith(DECISIONS) for line in lines):
        return None
    return [line.startswith(CHECK) for line in lines]


def response_tokens(text: str) -> int:
    """Tokens of a response text under ``tokenizer()``: one per character, one per
    decision token and ``</think>``."""
    whole = (*DECISIONS, "</think>")
    return len(text) - sum(text.count(t) * (len(t) - 1) for t in whole)


def token_classes(pieces: Sequence[str]) -> list[str]:
    """The class of each token of a response, from its tokens' texts (in order).

    ``decision``: a ``<check>`` or ``<skip>`` token before the answer's end; otherwise as
    the carry task's classes (``carry.token_classes``) with its ``choice`` read as
    ``digit`` (here the first digit of a line does not choose): ``digit``, ``format``
    (operators, line breaks, ``</think>``, ``\\boxed{``), ``after_answer``.
    """
    out = []
    for piece, cls in zip(pieces, carry.token_classes(pieces)):
        if cls != "after_answer" and piece in DECISIONS:
            cls = "decision"
        out.append("digit" if cls == "choice" else cls)
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecisionTask:
    """The problems and the checking habit of the supervised data.

    Attributes:
      digits: operand size and decisions per response (``MIN_DIGITS``-``MAX_DIGITS``).
      chain_share: share of chain problems, in (0, 1]; the rest have no carry, where a
        check is punished in stage 1 (``1 - chain_share`` is the punishment's dose).
      check_rate: the supervised data's probability of ``<check>`` per line, in (0, 1)
        (the base's full check of a chain: about ``check_rate ** digits``).
    """

    digits: int = DIGITS
    chain_share: float = 0.5
    check_rate: float = 0.5

    def __post_init__(self):
        _check_digits(self.digits)
        if not 0.0 < self.chain_share <= 1.0:
            raise ValueError(f"chain_share must be in (0, 1], got {self.chain_share}")
        if not 0.0 < self.check_rate < 1.0:
            raise ValueError(f"check_rate must be in (0, 1), got {self.check_rate}")

    def sample(self, rng: np.random.Generator) -> tuple[int, int]:
        """One problem: a chain with probability ``chain_share``, else one with no carry."""
        want = is_chain if rng.random() < self.chain_share else is_plain
        lo, hi = 10 ** (self.digits - 1), 10**self.digits
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
        """A supervised target: each line ``<check>`` with probability ``check_rate``."""
        rate = self.check_rate if check_rate is None else check_rate
        return solution(a, b, [bool(x) for x in rng.random(self.digits) < rate])


def verl_rows(
    n: int,
    seed: int,
    task: DecisionTask | None = None,
    *,
    source: str = "decision",
    exclude: Iterable[tuple[int, int]] = (),
) -> list[dict[str, Any]]:
    """``n`` distinct problems as verl rows (``extra_info.chain``), each half with its own
    ``data_source`` (``{source}-chain``, ``{source}-plain``)."""
    task = task or DecisionTask()
    problems = task.problems(n, np.random.default_rng(seed), exclude)
    rows = sum_rows(problems, source=source, extra=lambda a, b: {"chain": is_chain(a, b)})
    for r in rows:
        r["data_source"] = f"{source}-{'chain' if r['extra_info']['chain'] else 'plain'}"
    return rows


def probe_target(row: Any) -> tuple[int, int] | None:
    """The problem of a chain row (a verl row or a ``PromptRow``); None for one with no carry."""
    extra = row["extra_info"] if isinstance(row, dict) else row.extra_info
    a, b = int(extra["a"]), int(extra["b"])
    return (a, b) if is_chain(a, b) else None


def tokenizer():
    """The carry task's characters, with ``<check>`` and ``<skip>`` as whole tokens."""
    from magic_jax.data.tasks.vocab import R1_THINK, char_tokenizer

    return char_tokenizer(carry.CHARS, added=(*R1_THINK, *DECISIONS))
