"""Code reward: last python block, AST syntax check, then the unit tests in the sandbox."""

from __future__ import annotations

import ast
import re
from typing import Any

from magic_jax.rewards.code_tests import (
    CodeTests,
    call_output_matches,
    parse_code_ground_truth,
    stdio_output_matches,
)
from magic_jax.rewards.math_reward import extract_answer_region
from magic_jax.rewards.observe import observed_matches, split_expected
from magic_jax.rewards.sandbox import SandboxConfig, run_sandboxed
from magic_jax.rewards.types import GroundTruthError, RewardResult, RewardStatus

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3", "py3"}


def extract_code(text: str) -> str | None:
    """Returns the last fenced python block of ``text``.

    Blocks tagged ``python``/``py``/``python3`` win; without one, the last
    untagged block is taken. ``None`` when there is no usable block.
    """
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    for tags in (_PYTHON_TAGS, {""}):
        picked = [body for tag, body in blocks if tag in tags]
        if picked and picked[-1].strip():
            return picked[-1]
    return None


def syntax_error(code: str) -> str | None:
    """Returns a description of the first syntax error of ``code``, or None if it parses."""
    try:
        ast.parse(code)
    except SyntaxError as e:
        return f"line {e.lineno}: {e.msg}"
    except (ValueError, RecursionError, MemoryError) as e:
        # Null bytes, or nesting too deep for the parser.
        return f"{type(e).__name__}: {e}"
    return None


def _validate_test_syntax(tests: CodeTests) -> None:
    sources = [("import_prefix", tests.import_prefix)]
    sources += [(f"assert_case[{i}]", src) for i, src in enumerate(tests.asserts)]
    sources.append(("test_code", tests.test_code))
    for name, src in sources:
        if src and (err := syntax_error(src)):
            raise GroundTruthError(f"{name} is not valid Python ({err})")
    if tests.entry_point:
        try:
            ast.parse(tests.entry_point, mode="eval")
        except SyntaxError:
            raise GroundTruthError(
                f"entry_point is not a Python expression: {tests.entry_point!r}"
            ) from None


def build_job(tests: CodeTests, code: str) -> tuple[dict[str, Any], dict[int, Any]]:
    """The harness job for ``tests``, and the expected values kept out of it.

    Expected outputs never go into the job: stdin/stdout and call outputs are
    compared here, and literal asserts are split by ``observe.split_expected``.
    """
    program = f"{tests.import_prefix}\n{code}" if tests.import_prefix else code
    job: dict[str, Any] = {"style": tests.style, "code": program}
    expected: dict[int, Any] = {}
    if tests.style in ("stdio", "call"):
        job["tests"] = list(tests.inputs)
        job["fn_name"] = tests.fn_name
    elif tests.style == "assert":
        job["tests"] = []
        for source in tests.asserts:
            source, kept = split_expected(source, len(expected))
            job["tests"].append(source)
            expected.update(kept)
    else:
        job["tests"] = [None]
        job["test_code"], expected = split_expected(tests.test_code)
        job["entry_point"] = tests.entry_point
    return job, expected


class _Verdict:
    """Judges records as they stream in; returning False stops the run early."""

    def __init__(self, tests: CodeTests, expected: dict[int, Any]) -> None:
        self.tests = tests
        self.expected = expected
        self.observed: set[int] = set()
        self.passed: set[int] = set()
        self.failure: tuple[RewardStatus, str] | None = None
        self.done = False
        self.fatal: str | None = None

    def fail(self, status: RewardStatus, detail: str) -> bool:
        if self.failure is None:
            self.failure = (status, detail)
        return False

    def __call__(self, rec: dict[str, Any]) -> bool:
        event = rec.get("event")
        if event == "done":
            self.done = True
        elif event in ("fatal", "garbled"):
            self.fatal = str(rec.get("detail", ""))
            return False
        elif event == "overflow":
            return self.fail(RewardStatus.WRONG, "output too large")
        elif event == "load_error":
            return self.fail(RewardStatus.WRONG, f"program failed to load: {rec.get('detail')}")
        elif event == "child" and rec.get("status") == "timeout":
            return self.fail(RewardStatus.TIMEOUT, f"tests: {rec.get('detail')}")
        elif "obs" in rec:
            return self._observation(rec)
        elif event is None:
            return self._test(rec)
        return True

    def _observation(self, rec: dict[str, Any]) -> bool:
        k = rec["obs"]
        if k not in self.expected or "value" not in rec:
            return self.fail(RewardStatus.WRONG, f"unexpected record {str(rec)[:100]}")
        if not observed_matches(rec["value"], self.expected[k]):
            return self.fail(RewardStatus.WRONG, f"assert {k}: wrong value")
        self.observed.add(k)
        return True

    def _test(self, rec: dict[str, Any]) -> bool:
        i = rec.get("i")
        if not isinstance(i, int) or not 0 <= i < self.tests.num_tests or i in self.passed:
            return self.fail(RewardStatus.WRONG, f"unexpected test record {str(rec)[:100]}")
        status, detail = rec.get("status"), rec.get("detail", "")
        if status == "timeout":
            return self.fail(RewardStatus.TIMEOUT, f"test {i}: {detail}")
        if status != "ok":
            return self.fail(RewardStatus.WRONG, f"test {i} {status}: {detail}")
        # stdio and call tests hold one expected output per test (code_tests._parse_io)
        style = self.tests.style
        outputs = self.tests.outputs
        if style == "stdio" and not stdio_output_matches(str(rec.get("output", "")), outputs[i]):
            return self.fail(RewardStatus.WRONG, f"test {i}: wrong output")
        if style == "call" and (
            "value" not in rec or not call_output_matches(rec["value"], outputs[i])
        ):
            return self.fail(RewardStatus.WRONG, f"test {i}: wrong return value")
        self.passed.add(i)
        return True

    def result(self, run_timed_out: bool) -> RewardResult:
        if self.failure is not None:
            return RewardResult.of(*self.failure)
        if self.fatal is not None:
            return RewardResult.of(RewardStatus.ERROR, f"sandbox failure: {self.fatal}")
        if run_timed_out:
            return RewardResult.of(RewardStatus.TIMEOUT, "sandbox deadline")
        n = self.tests.num_tests
        # Every literal assert must have reported: a program cannot skip them.
        if self.done and len(self.passed) == n and self.observed == set(self.expected):
            return RewardResult.of(RewardStatus.CORRECT, f"{n}/{n} tests passed")
        return RewardResult.of(
            RewardStatus.WRONG, f"run ended after {len(self.passed)}/{n} passing tests"
        )


def code_reward(response: str, tests: Any, *, config: SandboxConfig | None = None) -> RewardResult:
    """Scores a code response by running its unit tests in the sandbox.

    Args:
      response: the decoded model output; the program is the last fenced
        python block after ``</think>``.
      tests: the ground truth: a JSON string or dict with ``inputs``/``outputs``
        (optionally ``fn_name``), ``assert_case``, or ``import_prefix`` /
        ``test_code`` / ``entry_point``; or a parsed ``CodeTests``.
      config: sandbox limits and isolation.

    Returns:
      ``CORRECT`` only when every test passes; ``NO_ANSWER`` without a python
      block; ``WRONG`` for a syntax error, a failed test or a crash; ``TIMEOUT``
      when a test or the run hit its time limit; ``ERROR`` for malformed tests
      or a sandbox that could not start.
    """
    config = config or SandboxConfig()
    try:
        suite = tests if isinstance(tests, CodeTests) else parse_code_ground_truth(tests)
        _validate_test_syntax(suite)
    except GroundTruthError as e:
        return RewardResult.of(RewardStatus.ERROR, str(e))
    code = extract_code(extract_answer_region(response))
    if code is None:
        return RewardResult.of(RewardStatus.NO_ANSWER, "no python code block")
    if err := syntax_error(code):
        return RewardResult.of(RewardStatus.WRONG, f"syntax error: {err}")
    job, expected = build_job(suite, code)
    verdict = _Verdict(suite, expected)
    run = run_sandboxed(job, config, on_record=verdict)
    return verdict.result(run.timed_out)
