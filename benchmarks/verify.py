"""Verifier throughput: VerifierPool against sequential verification, and worst-case latency.

Builds a batch of long chain-of-thought math responses from the AIME data
(right, wrong, equivalent-form and missing answers) plus code items in the
four test styles, verifies it sequentially in this process and with the pool,
and prints items/s for both and their ratio. Then it times pathological items
against their deadlines.

    .venv/bin/python benchmarks/verify.py --math 192 --code 32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from magic_jax.rewards import (
    MathConfig,
    RewardItem,
    RewardsConfig,
    SandboxConfig,
    VerifierPool,
    compute_reward,
    status_counts,
)

DATA = "/work/shared/data/skywork_or1_eval"


def load_problems() -> list[tuple[str, str]]:
    """(problem, gold) pairs from the AIME parquet files, or a synthetic set without them."""
    problems = []
    try:
        import pyarrow.parquet as pq

        for name in ("aime24.parquet", "aime25.parquet"):
            path = os.path.join(DATA, name)
            if os.path.exists(path):
                for row in pq.read_table(path).to_pylist():
                    problems.append(
                        (row["prompt"][0]["content"], row["reward_model"]["ground_truth"])
                    )
    except ImportError:
        pass
    return problems or [(f"Compute {k} * 7.", str(7 * k)) for k in range(1, 61)]


def long_cot(rng: random.Random, problem: str, final: str, steps: int) -> str:
    lines = [problem, "<think>"]
    for k in range(steps):
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        lines.append(
            f"Step {k}: let x_{k} = {a}/{b}; then $x_{{{k}}}^2 = \\frac{{{a * a}}}{{{b * b}}}$, "
            "which does not change the parity argument, so we continue."
        )
        if k % 50 == 49:
            lines.append(f"Wait, maybe the answer is \\boxed{{{a}}}. Let me re-check.")
    lines += ["</think>", "", final]
    return "\n".join(lines)


def math_items(n: int, rng: random.Random) -> list[RewardItem]:
    problems = load_problems()
    items = []
    for i in range(n):
        problem, gold = problems[i % len(problems)]
        value = int(gold) if gold.isdigit() else None
        kind = i % 5
        if kind == 0 or value is None:
            final = f"The answer is $\\boxed{{{gold}}}$."
        elif kind == 1:
            final = f"Therefore the answer is \\boxed{{{value}}}."  # no leading zeros
        elif kind == 2:
            final = f"So the result is $\\boxed{{\\frac{{{2 * value}}}{{2}}}}$."  # equivalent form
        elif kind == 3:
            final = f"The answer is \\boxed{{{value + rng.randint(1, 9)}}}."
        else:
            final = "I could not finish the computation."
        steps = rng.randint(150, 600)  # about 20k-80k characters, 5k-20k tokens
        items.append(RewardItem(response=long_cot(rng, problem, final, steps), ground_truth=gold))
    return items


CODE_CASES = [
    (
        "a, b = map(int, input().split())\nprint(a + b)",
        {
            "inputs": [f"{k} {k * 3}\n" for k in range(10)],
            "outputs": [str(4 * k) for k in range(10)],
        },
    ),
    (
        "a, b = map(int, input().split())\nprint(a * b)",
        {
            "inputs": [f"{k} {k * 3}\n" for k in range(10)],
            "outputs": [str(4 * k) for k in range(10)],
        },
    ),
    (
        "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
        "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
        "                return [seen[target - x], i]\n            seen[x] = i\n",
        {
            "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]],
            "outputs": [[0, 1], [1, 2]],
            "fn_name": "twoSum",
        },
    ),
    (
        "def add(a, b):\n    return a + b\n",
        {"assert_case": [f"assert add({k}, {k}) == {2 * k}" for k in range(20)]},
    ),
    (
        "class Solution:\n    def total(self, nums: List[int]) -> int:\n        return sum(nums)\n",
        {
            "import_prefix": "from typing import List",
            "test_code": "def check(candidate):\n"
            + "".join(
                f"    assert candidate(list(range({k}))) == {k * (k - 1) // 2}\n" for k in range(20)
            ),
            "entry_point": "Solution().total",
        },
    ),
]


def code_items(n: int, rng: random.Random) -> list[RewardItem]:
    items = []
    for i in range(n):
        code, tests = CODE_CASES[i % len(CODE_CASES)]
        response = long_cot(rng, "Write a program.", f"```python\n{code}```", rng.randint(50, 150))
        items.append(RewardItem(response=response, ground_truth=json.dumps(tests), ability="code"))
    return items


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--math", type=int, default=192, help="math items in the batch")
    parser.add_argument("--code", type=int, default=32, help="code items in the batch")
    parser.add_argument("--workers", type=int, default=None, help="pool workers (cpu count)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    items = math_items(args.math, rng) + code_items(args.code, rng)
    rng.shuffle(items)
    chars = sum(len(it.response) for it in items) / len(items)
    math_config, sandbox_config = MathConfig(), SandboxConfig()
    config = RewardsConfig(num_workers=args.workers, math=math_config, sandbox=sandbox_config)
    print(f"batch: {args.math} math + {args.code} code items, mean response {chars:,.0f} chars")
    print(f"cpus: {os.cpu_count()}, pool workers: {config.workers}")

    # Warm up Math-Verify and the sandbox probe so that neither side pays imports.
    compute_reward(items[0], math_config=math_config, sandbox_config=sandbox_config)
    compute_reward(code_items(1, rng)[0], math_config=math_config, sandbox_config=sandbox_config)
    seq, t_seq = timed(
        lambda: [
            compute_reward(it, math_config=math_config, sandbox_config=sandbox_config)
            for it in items
        ]
    )

    start = time.perf_counter()
    with VerifierPool(config) as pool:
        pool.map(items[: config.workers * 2])  # wait until every worker is warm
        t_start = time.perf_counter() - start
        par, t_pool = timed(lambda: pool.map(items))
        agree = sum(a.status == b.status for a, b in zip(seq, par))

        print()
        print("| mode | items | seconds | items/s |")
        print("|---|---|---|---|")
        print(f"| sequential (1 process) | {len(items)} | {t_seq:.2f} | {len(items) / t_seq:.1f} |")
        print(
            f"| VerifierPool ({config.workers} workers) | {len(items)} | {t_pool:.2f} "
            f"| {len(items) / t_pool:.1f} |"
        )
        print(f"\nratio pool/sequential: {t_seq / t_pool:.2f}x  (pool warm after {t_start:.2f} s)")
        print(f"statuses agree: {agree}/{len(items)}  {status_counts(par)}")

        tower = "\\boxed{9^{9^{9^{9}}}}"
        loop = "```python\nwhile True:\n    pass\n```"
        stdio = json.dumps({"inputs": ["1"], "outputs": ["1"]})
        cases = [
            (
                f"math power tower (Math-Verify limit {math_config.verify_timeout_s} s)",
                RewardItem(response=tower, ground_truth="204"),
                config.math_deadline_s,
            ),
            (
                "math power tower, pool deadline 3 s",
                RewardItem(response=tower, ground_truth="204", deadline_s=3.0),
                3.0,
            ),
            (
                f"code infinite loop (test limit {sandbox_config.test_timeout_s:.0f} s)",
                RewardItem(response=loop, ground_truth=stdio, ability="code"),
                config.code_deadline,
            ),
        ]
        print()
        print("| pathological item | status | latency s | deadline s |")
        print("|---|---|---|---|")
        for name, item, deadline in cases:
            [result], latency = timed(lambda item=item: pool.map([item]))
            print(f"| {name} | {result.status.value} | {latency:.2f} | {deadline:.0f} |")
        follow = pool.map(items[:8])
        print(f"\npool still serving after them: {sum(r is not None for r in follow)}/8 results")
        print(f"pool stats: {pool.stats()}")


if __name__ == "__main__":
    main()
