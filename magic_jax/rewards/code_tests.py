"""Code ground truth: parsing the four unit-test styles and comparing program outputs."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from collections.abc import Mapping
from typing import Any, Literal

from magic_jax.rewards.types import GroundTruthError

TestStyle = Literal["stdio", "call", "assert", "check"]
# Keys whose presence marks a ground truth as a code test suite.
CODE_KEYS = ("inputs", "outputs", "assert_case", "test_code")
FLOAT_TOL = 1e-6
_INT_RE = re.compile(r"[+-]?\d+\Z")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodeTests:
    """A parsed code test suite.

    Attributes:
      style: ``stdio`` (program reads stdin, output compared line by line),
        ``call`` (``fn_name`` called with JSON arguments, return value
        compared), ``assert`` (assert statements run after the program) or
        ``check`` (``test_code`` defines ``check(candidate)``, called with
        ``entry_point``).
      inputs: stdio: one stdin text per test; call: one argument list per test.
      outputs: the expected outputs (stdio text or call values). They are
        compared outside the sandbox and never sent into it.
      fn_name: function (or ``Solution`` method) name for ``call``.
      asserts: assert statements for ``assert``.
      import_prefix: source prepended to the program (``assert`` and ``check``).
      test_code: source defining ``check`` for ``check``.
      entry_point: expression naming the candidate, e.g. ``Solution().twoSum``.
    """

    style: TestStyle
    inputs: tuple[Any, ...] = ()
    outputs: tuple[Any, ...] = ()
    fn_name: str | None = None
    asserts: tuple[str, ...] = ()
    import_prefix: str = ""
    test_code: str = ""
    entry_point: str = ""

    @property
    def num_tests(self) -> int:
        """Number of test records a full passing run produces."""
        if self.style in ("stdio", "call"):
            return len(self.inputs)
        if self.style == "assert":
            return len(self.asserts)
        return 1


def looks_like_code_ground_truth(ground_truth: Any) -> bool:
    """True when a ground truth (dict or JSON string) has the shape of a code test suite."""
    if isinstance(ground_truth, str):
        text = ground_truth.lstrip()
        if not text.startswith("{"):
            return False
        try:
            ground_truth = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            return False
    return isinstance(ground_truth, Mapping) and any(k in ground_truth for k in CODE_KEYS)


def parse_code_ground_truth(ground_truth: Any) -> CodeTests:
    """Parses a code ground truth (JSON string or dict) into ``CodeTests``.

    Raises:
      GroundTruthError: invalid JSON, an unknown shape, or inconsistent fields;
        the message names what is wrong.
    """
    if isinstance(ground_truth, (str, bytes)):
        try:
            ground_truth = json.loads(ground_truth)
        except (json.JSONDecodeError, RecursionError, UnicodeDecodeError) as e:
            raise GroundTruthError(f"code ground_truth is not valid JSON: {e}") from None
    if not isinstance(ground_truth, Mapping):
        raise GroundTruthError(
            f"code ground_truth must be a JSON object, got {type(ground_truth).__name__}"
        )
    gt = ground_truth
    if "inputs" in gt or "outputs" in gt:
        return _parse_io(gt)
    if "assert_case" in gt:
        asserts = _decode_json_field(gt["assert_case"], "assert_case")
        if isinstance(asserts, str):
            asserts = [asserts]
        if not isinstance(asserts, list) or not asserts:
            raise GroundTruthError("assert_case must be a non-empty list of strings")
        if not all(isinstance(a, str) and a.strip() for a in asserts):
            raise GroundTruthError("assert_case entries must be non-empty strings")
        return CodeTests(
            style="assert",
            asserts=tuple(asserts),
            import_prefix=_optional_str(gt, "import_prefix"),
        )
    if "test_code" in gt:
        test_code = gt["test_code"]
        entry_point = gt.get("entry_point")
        if not isinstance(test_code, str) or not test_code.strip():
            raise GroundTruthError("test_code must be a non-empty string")
        if not isinstance(entry_point, str) or not entry_point.strip():
            raise GroundTruthError("test_code ground truth needs a non-empty entry_point string")
        return CodeTests(
            style="check",
            test_code=test_code,
            entry_point=entry_point.strip(),
            import_prefix=_optional_str(gt, "import_prefix"),
        )
    raise GroundTruthError(
        "code ground_truth has none of inputs/outputs, assert_case or test_code; "
        f"keys: {sorted(map(str, gt))}"
    )


def _optional_str(gt: Mapping[str, Any], key: str) -> str:
    value = gt.get(key) or ""
    if not isinstance(value, str):
        raise GroundTruthError(f"{key} must be a string, got {type(value).__name__}")
    return value


def _decode_json_field(value: Any, name: str) -> Any:
    # Some data sets store the test lists as JSON strings inside the JSON object.
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise GroundTruthError(f"{name} is a string that is not valid JSON") from None
    return value


def _parse_io(gt: Mapping[str, Any]) -> CodeTests:
    if "inputs" not in gt or "outputs" not in gt:
        raise GroundTruthError("inputs/outputs ground truth needs both 'inputs' and 'outputs'")
    inputs = _decode_json_field(gt["inputs"], "inputs")
    outputs = _decode_json_field(gt["outputs"], "outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise GroundTruthError("'inputs' and 'outputs' must be lists")
    if len(inputs) != len(outputs):
        raise GroundTruthError(f"{len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise GroundTruthError("'inputs' is empty: a code item needs at least one test")
    fn_name = gt.get("fn_name")
    if fn_name in (None, ""):
        return CodeTests(
            style="stdio",
            inputs=tuple(_as_text(x, "inputs") for x in inputs),
            outputs=tuple(_as_text(x, "outputs") for x in outputs),
        )
    if not isinstance(fn_name, str) or not fn_name.isidentifier():
        raise GroundTruthError(f"fn_name must be a Python identifier, got {fn_name!r}")
    return CodeTests(
        style="call",
        inputs=tuple(_call_args(x, i) for i, x in enumerate(inputs)),
        outputs=tuple(outputs),
        fn_name=fn_name,
    )


def _as_text(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise GroundTruthError(f"stdin/stdout {name} must be strings, got {type(value).__name__}")


def _call_args(value: Any, index: int) -> list[Any] | dict[str, Any]:
    """Arguments of one function-call test: a list, a kwargs dict, or JSON lines."""
    if isinstance(value, list):
        return value
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        args = []
        for line in value.splitlines():
            if not line.strip():
                continue
            try:
                args.append(json.loads(line))
            except (json.JSONDecodeError, RecursionError):
                raise GroundTruthError(
                    f"function-call input {index} line is not JSON: {line[:80]!r}"
                ) from None
        return args
    raise GroundTruthError(
        f"function-call input {index} must be a list, dict or JSON lines, "
        f"got {type(value).__name__}"
    )


def _token_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    # Integers must match exactly; only tokens written as reals get a tolerance.
    if _INT_RE.match(a) and _INT_RE.match(b):
        return False
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    if not (math.isfinite(x) and math.isfinite(y)):
        return False
    return math.isclose(x, y, rel_tol=FLOAT_TOL, abs_tol=FLOAT_TOL)


def stdio_output_matches(actual: str, expected: str) -> bool:
    """Line-wise comparison with stripped whitespace, blank lines ignored.

    Lines that differ as text are compared token by token, where real numbers
    may differ by ``FLOAT_TOL`` (absolute or relative).
    """
    got = [line.strip() for line in actual.splitlines() if line.strip()]
    want = [line.strip() for line in expected.splitlines() if line.strip()]
    if got == want:
        return True
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if g == w:
            continue
        gt, wt = g.split(), w.split()
        if len(gt) != len(wt) or not all(_token_equal(a, b) for a, b in zip(gt, wt)):
            return False
    return True


def values_equal(actual: Any, expected: Any) -> bool:
    """Type-aware equality of JSON-like values (bool is not an int, reals within ``FLOAT_TOL``)."""
    if isinstance(actual, bool) or isinstance(expected, bool):
        return type(actual) is bool and type(expected) is bool and actual == expected
    if isinstance(actual, (int, float)) and isinstance(expected, (int, float)):
        if isinstance(actual, int) and isinstance(expected, int):
            return actual == expected
        if math.isnan(actual) or math.isnan(expected):
            return False
        return math.isclose(actual, expected, rel_tol=FLOAT_TOL, abs_tol=FLOAT_TOL)
    if isinstance(actual, str) and isinstance(expected, str):
        return actual == expected
    if actual is None or expected is None:
        return actual is None and expected is None
    if isinstance(actual, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(actual) == len(expected) and all(
            values_equal(a, e) for a, e in zip(actual, expected)
        )
    if isinstance(actual, Mapping) and isinstance(expected, Mapping):
        if set(map(str, actual)) != set(map(str, expected)):
            return False
        exp = {str(k): v for k, v in expected.items()}
        return all(values_equal(v, exp[str(k)]) for k, v in actual.items())
    return False


def call_output_matches(actual: Any, expected: Any) -> bool:
    """Compares a function's return value (decoded JSON) with the expected output.

    The expected output may be the value itself, its JSON text, or the value
    wrapped in a one-element list (the APPS/TACO convention).
    """
    candidates: list[Any] = [expected]
    if isinstance(expected, str):
        with contextlib.suppress(json.JSONDecodeError, RecursionError):
            candidates.append(json.loads(expected))
    for cand in list(candidates):
        if isinstance(cand, list) and len(cand) == 1:
            candidates.append(cand[0])
    return any(values_equal(actual, c) for c in candidates)
