"""The code sandbox at a code recipe's volume: one verifier-pool batch of 256 programs,
a quarter of them hostile, against the same pool's honest-only batch.

Every honest program gets the verdict it gets in an honest-only batch, every hostile
one scores zero, and nothing is left behind: no process, no working directory, no
mount, no file outside. The throughput of both batches and their ratio are printed
(``pytest -s``).
"""

import os
import random
import time

import psutil
import pytest
from conftest import our_tmp_dirs, reward_statuses

from magic_jax.rewards import RewardItem, RewardsConfig, SandboxConfig, VerifierPool

C, W, N, T, E = reward_statuses()
ROOT = os.geteuid() == 0
OUTSIDE = "/tmp/magic_jax_volume_escape_probe"
SECRET = "/tmp/magic_jax_volume_secret_answer"
CONFIG = RewardsConfig(
    num_workers=2,
    code_deadline_s=8.0,
    sandbox=SandboxConfig(test_timeout_s=1.0, cpu_s=1, max_wall_s=4.0, memory_mb=512),
    sandbox_uid_base=1_900_000_000 + 500,
)
STDIO = {"inputs": ["1 2\n", "3 4\n", "10 -3\n"], "outputs": ["3\n", "7\n", "7"]}
ASSERTS = {"assert_case": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}
HONEST = [  # (program, tests): right and wrong answers, both test styles
    ("a, b = map(int, input().split())\nprint(a + b)", STDIO),
    ("a, b = map(int, input().split())\nprint(a - b)", STDIO),
    ("import sys\nfor line in sys.stdin:\n    print(sum(map(int, line.split())))", STDIO),
    ("def add(a, b):\n    return a + b", ASSERTS),
    ("def add(a, b):\n    return a * b", ASSERTS),
    ("def add(a, b):\n    return sum([a, b])", ASSERTS),
    ("print(int(input().split()[0]) + 2)", STDIO),
    ("def add(a, b):\n    return (a + b) if a > 0 else a", ASSERTS),
]
HOSTILE = {  # one of each kind per eight hostile items
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
    "        pass",
    "memory bomb": "x = []\nwhile True:\n    x.append(' ' * (1 << 24))",
    "output bomb": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
    "sleep": "import time\ntime.sleep(1000)",
    "spin": "while True:\n    pass",
    "write outside": f"open({OUTSIDE!r}, 'w').write('x')\nprint(3)",
    "read outside": f"print(open({SECRET!r}).read())",
    "network": "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\nprint(3)",
}
pytestmark = [pytest.mark.slow, pytest.mark.serial]


def _item(code, tests):
    return RewardItem(response=f"```python\n{code}\n```", ground_truth=tests, ability="code")


def _mounts() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return sorted(line.split()[4] for line in f)


def _left() -> tuple[set, set]:
    procs = {p.pid for p in psutil.Process().children(recursive=True) if p.status() != "zombie"}
    uids = {CONFIG.sandbox_for(i).uid for i in range(CONFIG.workers)}
    strays = {
        p.pid
        for p in psutil.process_iter(["uids", "status"])
        if ROOT and p.info["uids"] and p.info["uids"].real in uids and p.info["status"] != "zombie"
    }
    return procs, strays


def _batch(pool, items):
    start = time.monotonic()
    results = pool.map(items, timeout=900)
    return results, len(items) / (time.monotonic() - start)


def test_a_batch_of_256_programs_a_quarter_hostile(capsys):
    rng = random.Random(0)
    honest = [_item(*rng.choice(HONEST)) for _ in range(256)]
    hostile = [(name, _item(code, STDIO)) for name, code in list(HOSTILE.items()) * 8]
    mixed = [(None, item) for item in honest[:192]] + hostile
    rng.shuffle(mixed)
    with open(SECRET, "w") as f:
        f.write("3\n7\n7\n")
    if os.path.exists(OUTSIDE):
        os.remove(OUTSIDE)
    mounts, dirs = _mounts(), our_tmp_dirs()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        with VerifierPool(CONFIG) as pool:
            pool.map([_item(*HONEST[0])])  # the workers started
            alone, honest_rate = _batch(pool, honest)
            got, mixed_rate = _batch(pool, [item for _, item in mixed])
    finally:
        os.remove(SECRET)
    want = {id(item): r for item, r in zip(honest, alone, strict=True)}
    assert {r.status for r in alone} <= {C, W}, [r for r in alone if r.status not in (C, W)]
    assert 0 < sum(r.status is C for r in alone) < 256  # both verdicts occur
    for (name, item), r in zip(mixed, got, strict=True):
        if name is None:  # an honest program: its verdict as in the honest-only batch
            assert (r.status, r.reward) == (want[id(item)].status, want[id(item)].reward), r
        else:
            assert r.reward == 0.0, (name, r)
    assert not os.path.exists(OUTSIDE), "a sandboxed program wrote outside its directory"
    procs, strays = _left()
    assert procs <= before and strays == set()
    assert our_tmp_dirs() <= dirs
    assert _mounts() == mounts
    with capsys.disabled():
        print(
            f"\n[sandbox volume] honest-only {honest_rate:.1f} items/s, with 64 of 256 hostile "
            f"{mixed_rate:.1f} items/s: {mixed_rate / honest_rate:.2f}x ({CONFIG.workers} "
            f"workers, {os.cpu_count()} cores)"
        )
