"""Math reward: Math-Verify on the answer region after ``</think>`` against the gold answer."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections.abc import Sequence
from typing import Any

from magic_jax.rewards.types import GroundTruthError, RewardResult, RewardStatus

THINK_END = "</think>"
# An integer literal with no leading zero: two of them are equal numbers iff equal strings.
_INTEGER = re.compile(r"0|-?[1-9][0-9]*")
_LONE_BOX = re.compile(r"\\boxed\{(-?[0-9]+)\}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MathConfig:
    """Math-Verify limits.

    Attributes:
      parse_timeout_s: SIGALRM limit for parsing one string (Math-Verify takes
        whole seconds).
      verify_timeout_s: SIGALRM limit for one gold/answer comparison.
    """

    parse_timeout_s: int = 5
    verify_timeout_s: int = 5

    def __post_init__(self) -> None:
        for name in ("parse_timeout_s", "verify_timeout_s"):
            value = getattr(self, name)
            # signal.alarm only takes whole seconds; 0 would disable the timeout.
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def extract_answer_region(response: str) -> str:
    """Returns the text after the first ``</think>``, or all of it when there is none.

    Math-Verify takes the last ``\\boxed{}`` of the whole string, so a box
    written while reasoning must not be visible to it when the final answer
    section has none.
    """
    _, sep, tail = response.partition(THINK_END)
    return tail if sep else response


def parse_math_ground_truth(ground_truth: Any) -> list[str]:
    """Normalises a math ground truth to a non-empty list of gold answer strings.

    Accepts a plain answer (``"204"``, ``"025"``, ``"336^\\circ"``), a JSON
    string holding a string or a list of strings (``'["204", "0204"]'``), or
    an already-parsed list. A JSON value that is a number is kept as the
    original text (``"3.50"`` stays ``"3.50"``), and a JSON list of numbers is
    read as a plain answer (``"[1, 2]"`` is an interval, not two answers).

    Raises:
      GroundTruthError: the ground truth is empty or of an unsupported type.
    """
    if isinstance(ground_truth, (list, tuple)):
        answers = [_answer_to_str(a) for a in ground_truth]
    elif isinstance(ground_truth, (int, float)) and not isinstance(ground_truth, bool):
        answers = [str(ground_truth)]
    elif isinstance(ground_truth, str):
        answers = [ground_truth]
        try:
            decoded = json.loads(ground_truth)
        except (json.JSONDecodeError, RecursionError):
            decoded = None
        if isinstance(decoded, str):
            answers = [decoded]
        elif isinstance(decoded, list) and decoded and all(isinstance(a, str) for a in decoded):
            answers = list(decoded)
    else:
        raise GroundTruthError(
            f"math ground_truth must be a str or a list of str, got {type(ground_truth).__name__}"
        )
    answers = [a.strip() for a in answers]
    if not answers or not all(answers):
        raise GroundTruthError(f"math ground_truth has an empty answer: {ground_truth!r}")
    return answers


def _answer_to_str(answer: Any) -> str:
    if isinstance(answer, str):
        return answer
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return str(answer)
    raise GroundTruthError(f"math gold answers must be strings, got {type(answer).__name__}")


def integer_verdict(response: str, gold: Any) -> RewardResult | None:
    """The verdict of ``math_reward`` without Math-Verify, where it is certain; else None.

    Decided only when every gold answer is an integer literal and the answer
    region (``extract_answer_region``) is, up to surrounding whitespace, one
    ``\\boxed{n}`` of an integer literal ``n``. Math-Verify then finds that box
    and nothing else, and its parse is the integer ``n``: an exact match of the
    string is ``CORRECT`` (as ``math_reward`` says it), and two integer literals
    without leading zeros that differ are different numbers (``WRONG``). Anything
    else (other text in the region, leading zeros, a non-integer gold answer)
    returns None and goes to Math-Verify. Needs no main thread and takes
    microseconds, so ``VerifierPool`` decides such items without a worker.
    """
    try:
        golds = parse_math_ground_truth(gold)
    except GroundTruthError:
        return None
    return _integer_verdict(extract_answer_region(response), golds)


def _integer_verdict(region: str, golds: list[str]) -> RewardResult | None:
    match = _LONE_BOX.fullmatch(region.strip())
    if match is None or not all(_INTEGER.fullmatch(g) for g in golds):
        return None
    answer = match.group(1)
    if answer in golds:
        return RewardResult.of(RewardStatus.CORRECT, "exact match")
    if _INTEGER.fullmatch(answer):
        return RewardResult.of(RewardStatus.WRONG)
    return None


def math_reward(
    response: str, gold: str | Sequence[str], *, config: MathConfig | None = None
) -> RewardResult:
    """Scores a math response against its gold answer(s).

    The answer region is parsed with Math-Verify; an exact match of the parsed
    answer string to a gold string counts, otherwise ``verify(parse("\\boxed{"
    + gold + "}"), parsed)`` decides. Any of several gold answers may match.

    Must run in a process's main thread: Math-Verify's timeouts use SIGALRM
    (``VerifierPool`` runs it in worker processes).

    Args:
      response: the decoded model output.
      gold: the ground truth in any form ``parse_math_ground_truth`` accepts.
      config: Math-Verify limits.

    Returns:
      ``CORRECT``; ``WRONG``; ``NO_ANSWER`` when nothing parses; ``TIMEOUT``
      when a parse or comparison hit its limit and nothing matched; ``ERROR``
      for a malformed or unparsable gold answer.
    """
    config = config or MathConfig()
    try:
        golds = parse_math_ground_truth(gold)
    except GroundTruthError as e:
        return RewardResult.of(RewardStatus.ERROR, str(e))
    if threading.current_thread() is not threading.main_thread():
        return RewardResult.of(RewardStatus.ERROR, _THREAD_MESSAGE)
    region = extract_answer_region(response)
    fast = _integer_verdict(region, golds)
    if fast is not None:
        return fast
    # Imported here: sympy and Math-Verify take about a second to import, and
    # `import magic_jax.rewards` has to stay fast.
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    try:
        parsed = parse(region, parsing_timeout=config.parse_timeout_s, raise_on_error=True)
    except TimeoutException:
        return RewardResult.of(RewardStatus.TIMEOUT, "parsing the answer timed out")
    except Exception:
        # Any failure inside the parser means no usable answer, as with
        # raise_on_error=False; raising is only asked for to see timeouts.
        parsed = []
    # Math-Verify returns [expression, extracted string] for a successful
    # parse; a lone string is a regex match that did not parse.
    if len(parsed) < 2:
        return RewardResult.of(RewardStatus.NO_ANSWER)
    answer_str = parsed[1] if isinstance(parsed[1], str) else str(parsed[1])
    if answer_str.strip() in golds:
        return RewardResult.of(RewardStatus.CORRECT, "exact match")

    timed_out = False
    gold_parsed_any = False
    for g in golds:
        try:
            gold_parsed = parse(
                "\\boxed{" + g + "}", parsing_timeout=config.parse_timeout_s, raise_on_error=True
            )
        except TimeoutException:
            timed_out = True
            continue
        except Exception:
            continue
        if not gold_parsed:
            continue
        gold_parsed_any = True
        # One comparison per pair (as verify() does internally) so that a
        # timeout is seen and the remaining pairs still get their chance.
        for gp in gold_parsed:
            for ap in parsed:
                try:
                    if verify(gp, ap, timeout_seconds=config.verify_timeout_s, raise_on_error=True):
                        return RewardResult.of(RewardStatus.CORRECT)
                except TimeoutException:
                    timed_out = True
                except Exception:
                    continue
    if timed_out:
        return RewardResult.of(RewardStatus.TIMEOUT, "Math-Verify comparison timed out")
    if not gold_parsed_any:
        return RewardResult.of(
            RewardStatus.ERROR, f"gold answer could not be parsed by Math-Verify: {golds!r}"
        )
    return RewardResult.of(RewardStatus.WRONG)


_THREAD_MESSAGE = (
    "math_reward must run in a process's main thread (Math-Verify uses SIGALRM); "
    "use VerifierPool from other threads"
)
