"""Code reward: extraction, ground-truth parsing, the four test styles, and hostile programs."""

import json
import logging
import os
import shutil
import textwrap
import time

import psutil
import pytest
from conftest import our_tmp_dirs, reward_statuses

from magic_jax.rewards import (
    CodeTests,
    GroundTruthError,
    SandboxConfig,
    code_reward,
    extract_code,
    isolation_plan,
    parse_code_ground_truth,
)
from magic_jax.rewards import sandbox as sandbox_mod
from magic_jax.rewards.code_tests import call_output_matches, stdio_output_matches, values_equal
from magic_jax.rewards.observe import split_expected

C, W, N, T, E = reward_statuses()
ROOT = os.geteuid() == 0
CFG = SandboxConfig(test_timeout_s=1.0, cpu_s=1, max_wall_s=5.0, memory_mb=512, max_file_mb=4)
# A hostile run must end within max_wall_s plus launch and cleanup.
DEADLINE_S = CFG.max_wall_s + 3.0
# Fixed host paths, process limits and "leaves no process" checks: `make test` runs this
# file after the parallel part, alone (marker `serial`).
pytestmark = pytest.mark.serial
OUTSIDE = "/tmp/magic_jax_sandbox_escape_probe"
# Holds the expected stdout of STDIO test 0: a program that can read it passes.
SECRET = "/tmp/magic_jax_sandbox_secret_answer"

STDIO = {"inputs": ["1 2\n", "3 4\n", "10 -3\n"], "outputs": ["3\n", "7\n", "7"]}
ONE = {"inputs": ["1 2\n"], "outputs": ["3"]}
CALL = {
    "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]],
    "outputs": [[0, 1], [1, 2]],
    "fn_name": "twoSum",
}
ASSERTS = {"assert_case": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}
CHECK = {
    "import_prefix": "from typing import List",
    "test_code": "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n"
    "    assert candidate([]) == 0\n",
    "entry_point": "Solution().total",
}


def src(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def respond(code: str) -> str:
    draft = "```python\nprint('draft')\n```"
    return f"<think>\n{draft}\n</think>\nHere is my solution.\n```python\n{code}\n```\n"


def sandbox_pids() -> list[int]:
    """Live processes of the sandbox uid (as root) or of this test process's tree."""
    if ROOT:
        procs = [
            p
            for p in psutil.process_iter(["uids"])
            if p.info["uids"] and p.info["uids"].real == CFG.uid
        ]
    else:
        procs = psutil.Process().children(recursive=True)
    return [p.pid for p in procs if p.status() != psutil.STATUS_ZOMBIE]


# -- extraction and parsing ---------------------------------------------------------


def test_extract_code_takes_last_python_block_after_think():
    text = "```python\nA\n```\nthen\n```\nB\n```\n```py\nC\n```\n```text\nD\n```"
    assert extract_code(text) == "C\n"
    assert extract_code("```\nonly untagged\n```") == "only untagged\n"
    assert extract_code("no code at all") is None
    assert extract_code("```python\n   \n```") is None
    result = code_reward("<think>```python\nprint(3)\n```</think> no code", STDIO, config=CFG)
    assert result.status is N


def test_parse_each_ground_truth_style():
    stdio = parse_code_ground_truth(json.dumps(STDIO))
    assert stdio.style == "stdio" and stdio.num_tests == 3
    call = parse_code_ground_truth(CALL)
    assert call.style == "call" and call.fn_name == "twoSum" and call.inputs[1] == [[3, 2, 4], 6]
    lines = parse_code_ground_truth({"inputs": ["[1, 2]\n3"], "outputs": ["[1]"], "fn_name": "f"})
    assert lines.inputs == ([[1, 2], 3],)
    asserts = parse_code_ground_truth(json.dumps(ASSERTS))
    assert asserts.style == "assert" and asserts.num_tests == 2
    check = parse_code_ground_truth(CHECK)
    assert check.style == "check" and check.entry_point == "Solution().total"
    nested = parse_code_ground_truth({"inputs": json.dumps(["1"]), "outputs": json.dumps(["1"])})
    assert nested.inputs == ("1",)


@pytest.mark.parametrize(
    ("ground_truth", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({"tests": []}, "keys: ['tests']"),
        ({"inputs": ["1"]}, "needs both"),
        ({"inputs": ["1", "2"], "outputs": ["1"]}, "2 inputs but 1 outputs"),
        ({"inputs": [], "outputs": []}, "empty"),
        ({"inputs": [[1]], "outputs": [1], "fn_name": "not valid"}, "identifier"),
        ({"inputs": ["[1"], "outputs": [1], "fn_name": "f"}, "not JSON"),
        ({"assert_case": []}, "non-empty list"),
        ({"assert_case": ["assert (1 =="]}, "assert_case[0] is not valid Python"),
        ({"test_code": "def check(c): pass"}, "entry_point"),
        ({"test_code": "def check(c) pass", "entry_point": "f"}, "test_code is not valid"),
    ],
)
def test_malformed_ground_truth_is_an_error_naming_the_problem(ground_truth, message):
    result = code_reward(respond("print(1)"), ground_truth, config=CFG)
    assert result.status is E
    assert message in result.detail


def test_parse_raises_ground_truth_error():
    with pytest.raises(GroundTruthError, match="not valid JSON"):
        parse_code_ground_truth("{not json")
    with pytest.raises(GroundTruthError, match="2 inputs but 1 outputs"):
        parse_code_ground_truth({"inputs": ["1", "2"], "outputs": ["1"]})


def test_output_comparisons():
    assert stdio_output_matches("3 \n\n7\n", "3\n7")
    assert stdio_output_matches("0.3333333", "0.333333333")
    assert not stdio_output_matches("1000000", "1000001")  # integers compare exactly
    assert not stdio_output_matches("3\n7\n8", "3\n7")
    assert stdio_output_matches("nan", "nan") and not stdio_output_matches("nan", "0.0")
    assert values_equal([1, 2.0000001], [1, 2])
    assert not values_equal(True, 1) and not values_equal(1, True)
    assert not values_equal("1", 1)
    assert call_output_matches([0, 1], [[0, 1]])  # APPS wraps outputs in a list
    assert call_output_matches("abc", '"abc"') and call_output_matches(12, "12")
    assert not call_output_matches([1, 0], [0, 1])


def test_syntax_error_is_wrong_without_running():
    result = code_reward(respond("def f(:\n  pass"), STDIO, config=CFG)
    assert result.status is W and "syntax error" in result.detail


# -- the four styles ----------------------------------------------------------------

ADD = "a, b = map(int, input().split())\nprint(a + b)"
TWO_SUM = src("""
    def twoSum(self, nums, target):
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return [seen[target - x], i]
            seen[x] = i
""")
TOTAL = src("""
    class Solution:
        def total(self, nums: List[int]) -> int:
            return sum(nums)
""")

STYLES = {
    "stdio": (ADD, STDIO, C),
    "stdio sys.stdin": (
        "import sys\nfor line in sys.stdin:\n    print(sum(map(int, line.split())))",
        STDIO,
        C,
    ),
    "stdio float tolerance": ("print(1 / 3)", {"inputs": [""], "outputs": ["0.3333333"]}, C),
    "stdio wrong": ("a, b = map(int, input().split())\nprint(a - b)", STDIO, W),
    "stdio crash after output": (ADD + "\nraise ValueError", STDIO, W),
    "stdio sys.exit(0) after output": (ADD + "\nimport sys\nsys.exit(0)", STDIO, C),
    "stdio thread idiom": (
        src("""
            import sys, threading
            sys.setrecursionlimit(10**6)
            threading.stack_size(2**26)
            def main():
                print(sum(map(int, input().split())))
            threading.Thread(target=main).start()
        """),
        STDIO,
        C,
    ),
    "call method": ("class Solution:\n" + textwrap.indent(TWO_SUM, "    "), CALL, C),
    "call bare function with self": (TWO_SUM, CALL, C),
    "call bare function": (TWO_SUM.replace("self, ", ""), CALL, C),
    "call wrong": ("def twoSum(nums, target):\n    return [0, 1]", CALL, W),
    "call missing function": ("def other():\n    pass", CALL, W),
    "call unserialisable value": ("def twoSum(n, t):\n    return object()", CALL, W),
    "assert": ("def add(a, b):\n    return a + b", ASSERTS, C),
    "assert wrong": ("def add(a, b):\n    return a * b", ASSERTS, W),
    "check": (TOTAL, CHECK, C),
    "check wrong": (TOTAL.replace("sum(nums)", "6"), CHECK, W),
    "stdlib imports": ("import heapq, bisect, fractions\nprint(3)", ONE, C),
}


@pytest.mark.parametrize(("name", "case"), STYLES.items(), ids=list(STYLES))
def test_styles(name, case):
    code, tests, expected = case
    result = code_reward(respond(code), tests, config=CFG)
    assert result.status is expected, (name, result)


# -- hostile programs ---------------------------------------------------------------

ZERO_ADD = "def add(a, b):\n    return 0"
ALWAYS_EQUAL = src("""
    class A:
        def __eq__(self, other):
            return True
        __hash__ = None
""")
# Knows the harness protocol: writes "passed" records for every test to the
# record descriptor and leaves before any test runs.
FORGE = src("""
    import os
    for fd in range(3, 64):
        for i in range(2):
            try:
                os.write(fd, b'{"i": %d, "status": "ok", "detail": ""}\\n' % i)
            except OSError:
                pass
    os._exit(0)
""")
HOSTILE = {
    # name: (program, tests, expected status; None means WRONG or TIMEOUT)
    "infinite loop": ("while True:\n    pass", STDIO, T),
    "sleep forever": ("import time\ntime.sleep(1000)", STDIO, T),
    "infinite loop in function": ("def add(a, b):\n    while True:\n        pass", ASSERTS, T),
    "fork bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        STDIO,
        None,
    ),
    "setsid daemon": (
        src("""
            import os, time
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    time.sleep(1000)
                os._exit(0)
            print(0)
        """),
        STDIO,
        W,
    ),
    "memory bomb": ("x = []\nwhile True:\n    x.append(' ' * (1 << 24))", STDIO, None),
    "huge output": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", STDIO, W),
    "write outside": (f"open({OUTSIDE!r}, 'w').write('x')\n" + ADD, STDIO, W),
    "read outside": (f"print(open({SECRET!r}).read())", ONE, W),
    "kill parent": ("import os\nos.kill(os.getppid(), 9)\n" + ZERO_ADD, ASSERTS, W),
    "kill everything": (
        "import os\ntry:\n    os.kill(-1, 9)\nexcept OSError:\n    pass\n" + ZERO_ADD,
        ASSERTS,
        W,
    ),
    "sys.exit(0) before asserts": ("import sys\nsys.exit(0)\n" + ZERO_ADD, ASSERTS, W),
    "sys.exit(0) before check": ("import sys\nsys.exit(0)", CHECK, W),
    "sys.exit(0) before call": ("import sys\nsys.exit(0)", CALL, W),
    "sys.exit(0) stdio": ("import sys\nsys.exit(0)", STDIO, W),
    "os._exit(0) before asserts": ("import os\nos._exit(0)", ASSERTS, W),
    "os._exit(0) in the function": ("import os\ndef add(a, b):\n    os._exit(0)", ASSERTS, W),
    "os._exit(0) stdio": ("import os\nos._exit(0)", STDIO, W),
    "atexit forces exit 0": (
        "import atexit, os\natexit.register(lambda: os._exit(0))\n" + ZERO_ADD,
        ASSERTS,
        W,
    ),
    "print replaced": (
        "import builtins\nbuiltins.print = lambda *a, **k: None\nprint('3')",
        STDIO,
        W,
    ),
    "stdout.write replaced": (
        "import sys\nsys.stdout.write = lambda s: len(s)\nprint('ok')",
        STDIO,
        W,
    ),
    "input replaced": ("import builtins\nbuiltins.input = lambda *a: '1 2'\nprint(3)", STDIO, W),
    "exit replaced": (
        "import builtins, sys\nbuiltins.exit = sys.exit = lambda *a: None\n" + ZERO_ADD,
        ASSERTS,
        W,
    ),
    "AssertionError replaced": (
        "import builtins\nclass Quiet(Exception):\n    pass\nbuiltins.AssertionError = Quiet\n"
        + ZERO_ADD,
        ASSERTS,
        W,
    ),
    "exception classes replaced": (
        src("""
            import builtins
            for name in ("AssertionError", "Exception", "BaseException"):
                setattr(builtins, name, type(None))
            def add(a, b):
                return 0
        """),
        {"test_code": "def check(f):\n    assert f(1, 2) == 3\n", "entry_point": "add"},
        W,
    ),
    "exec replaced": (
        "import builtins\nbuiltins.exec = lambda *a, **k: None\n" + ZERO_ADD,
        ASSERTS,
        W,
    ),
    "always-equal object": (ALWAYS_EQUAL + "\ndef add(a, b):\n    return A()", ASSERTS, W),
    "always-equal int subclass": (
        src("""
            class A(int):
                def __eq__(self, other):
                    return True
                __hash__ = int.__hash__
            def add(a, b):
                return A(0)
        """),
        ASSERTS,
        W,
    ),
    "always-equal in a list, all() replaced": (
        "import builtins\nbuiltins.all = lambda x: True\n" + ALWAYS_EQUAL + "\n"
        "class Solution:\n    def total(self, nums):\n        return [A()]",
        {**CHECK, "test_code": "def check(candidate):\n    assert candidate([1]) == [1]\n"},
        W,
    ),
    "prints a success record": ('print(\'{"i": 0, "status": "ok"}\')', ASSERTS, W),
    "forges records on the harness channel": (FORGE, ASSERTS, W),
    "forges records, check style": (FORGE.replace("range(2)", "range(1)"), CHECK, W),
    "network": (
        "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\n" + ADD,
        STDIO,
        W,
    ),
}


@pytest.fixture(autouse=True)
def _probe_files():
    with open(SECRET, "w") as f:
        f.write("3\n")
    os.chmod(SECRET, 0o644)
    if os.path.exists(OUTSIDE):
        os.remove(OUTSIDE)
    yield
    os.remove(SECRET)
    assert not os.path.exists(OUTSIDE), "a sandboxed program wrote outside its directory"


@pytest.mark.parametrize(("name", "case"), HOSTILE.items(), ids=list(HOSTILE))
def test_hostile_program_scores_zero_in_time_and_leaves_nothing(name, case):
    code, tests, expected = case
    if name == "read outside" and not isolation_plan(CFG)["landlock"]:
        pytest.skip("reads of world-readable files are only blocked with Landlock")
    before = set(psutil.Process().children(recursive=True))
    dirs_before = our_tmp_dirs()
    start = time.monotonic()
    result = code_reward(respond(code), tests, config=CFG)
    elapsed = time.monotonic() - start
    assert result.reward == 0.0, (name, result)
    assert result.status in ((expected,) if expected else (W, T)), (name, result)
    assert elapsed < DEADLINE_S, (name, elapsed)
    assert sandbox_pids() == []
    assert set(psutil.Process().children(recursive=True)) <= before
    assert our_tmp_dirs() <= dirs_before  # the working directory was removed


def test_the_secret_probe_would_pass_if_readable():
    # Guards the "read outside" case: the same program passes once the
    # expected output is inside its reach (its own stdin here).
    result = code_reward(respond("print(open(0).read().count(' ') + 2)"), ONE, config=CFG)
    assert result.status is C


def test_literal_asserts_are_checked_outside_the_sandbox():
    source, expected = split_expected(
        "assert f(1) == [1, 2]\nassert 3 == g()\nassert h() is True\n"
        "assert abs(f(2) - 1.5) < 1e-6\nassert f(3) == x\n",
        start=5,
    )
    assert expected == {5: ("eq", [1, 2]), 6: ("eq", 3), 7: ("is", True)}
    assert "[1, 2]" not in source and "__mj_observe__(5, f(1))" in source
    assert "abs(f(2) - 1.5) < 1e-06" in source and "f(3) == x" in source
    tuple_test = {"assert_case": ["assert pair() == (1, 2)"]}
    as_list = code_reward(respond("def pair():\n    return [1, 2]"), tuple_test, config=CFG)
    as_tuple = code_reward(respond("def pair():\n    return (1, 2)"), tuple_test, config=CFG)
    assert (as_list.status, as_tuple.status) == (W, C)  # as Python's == decides
    is_test = {"assert_case": ["assert ok() is True"]}
    assert code_reward(respond("def ok():\n    return 1"), is_test, config=CFG).status is W
    assert code_reward(respond("def ok():\n    return True"), is_test, config=CFG).status is C


def test_isolation_plan_is_reported():
    plan = isolation_plan(CFG)
    assert set(plan) == {"namespaces", "drop_uid", "landlock", "python", "command"}
    assert plan["drop_uid"] is ROOT


@pytest.fixture
def no_unshare(monkeypatch):
    real = shutil.which
    monkeypatch.setattr(
        sandbox_mod.shutil, "which", lambda n, **kw: None if n == "unshare" else real(n, **kw)
    )
    sandbox_mod._plan.cache_clear()
    yield
    sandbox_mod._plan.cache_clear()


def test_namespace_isolation_required_but_missing_raises(no_unshare):
    config = SandboxConfig(isolation="namespace")
    with pytest.raises(RuntimeError, match="unshare command is not installed"):
        isolation_plan(config)


FALLBACK = ["fork bomb", "setsid daemon", "kill parent", "write outside", "os._exit(0) stdio"]


@pytest.mark.parametrize("name", [*FALLBACK, "correct"])
def test_fallback_without_namespaces_degrades_with_a_warning(no_unshare, caplog, name):
    code, tests, expected = HOSTILE[name] if name != "correct" else (ADD, STDIO, C)
    sandbox_mod._warned.clear()
    with caplog.at_level(logging.WARNING, logger="magic_jax.rewards.sandbox"):
        plan = isolation_plan(CFG)
        result = code_reward(respond(code), tests, config=CFG)
    assert not plan["namespaces"]
    assert "namespaces unavailable" in caplog.text
    assert result.status in ((expected,) if expected else (W, T)), (name, result)
    time.sleep(0.05)  # orphans reparented to init are reaped by it
    assert sandbox_pids() == []


def test_config_validation_names_the_field():
    for kwargs, field in [
        ({"isolation": "vm"}, "isolation"),
        ({"test_timeout_s": 0}, "test_timeout_s"),
        ({"memory_mb": 0}, "memory_mb"),
        ({"uid": 0}, "uid"),
        ({"tmpfs_mb": 0}, "tmpfs_mb"),
        ({"max_wall_s": 1, "test_timeout_s": 2}, "max_wall_s"),
    ]:
        with pytest.raises(ValueError, match=field):
            SandboxConfig(**kwargs)


def test_parsed_tests_object_is_accepted():
    tests = CodeTests(style="stdio", inputs=("5\n",), outputs=("10",))
    assert code_reward(respond("print(int(input()) * 2)"), tests, config=CFG).status is C
