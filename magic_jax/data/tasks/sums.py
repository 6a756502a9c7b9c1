"""The sums the built-in addition tasks ask: distinct (a, b) problems and their verl rows."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

Problem = tuple[int, int]


def distinct_problems(
    sample: Callable[[np.random.Generator], Problem],
    n: int,
    rng: np.random.Generator,
    exclude: Iterable[Problem] = (),
) -> list[Problem]:
    """``n`` distinct problems drawn with ``sample``, none of them in ``exclude``."""
    seen = set(exclude)
    out: list[Problem] = []
    while len(out) < n:
        p = sample(rng)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def sum_rows(
    problems: Iterable[Problem],
    *,
    source: str,
    extra: Callable[[int, int], dict[str, Any]] = lambda a, b: {},
) -> list[dict[str, Any]]:
    """verl rows asking ``a+b`` (``ability`` math, the sum as ground truth).

    ``extra_info`` holds ``index`` (the row's position), ``a``, ``b`` and ``extra(a, b)``.
    """
    return [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": f"{a}+{b}"}],
            "ability": "math",
            "reward_model": {"ground_truth": str(a + b), "style": "rule"},
            "extra_info": {"index": i, "a": a, "b": b, **extra(a, b)},
        }
        for i, (a, b) in enumerate(problems)
    ]


def row_problem(row: dict[str, Any]) -> Problem:
    """(a, b) of a row written by ``sum_rows``."""
    return int(row["extra_info"]["a"]), int(row["extra_info"]["b"])
