"""VerifierPool: async submit/collect, deadlines, recycling, hostile items, clean shutdown."""

import dataclasses
import os
import time

import psutil
import pytest
from conftest import our_tmp_dirs, reward_statuses

from magic_jax.rewards import (
    MathConfig,
    RewardItem,
    RewardsConfig,
    SandboxConfig,
    VerifierPool,
    compute_reward,
)
from magic_jax.rewards.procs import kill_uid, uid_pids

C, W, N, T, E = reward_statuses()
ROOT = os.geteuid() == 0
SANDBOX = SandboxConfig(test_timeout_s=1.0, cpu_s=1, max_wall_s=4.0, memory_mb=512)
# Math-Verify's own limit is far above the pool deadline so that the power
# tower is stopped from outside, by killing its worker.
CONFIG = RewardsConfig(
    num_workers=2,
    max_items_per_worker=4,
    math_deadline_s=2.0,
    code_deadline_s=8.0,
    math=MathConfig(verify_timeout_s=60, parse_timeout_s=60),
    sandbox=SANDBOX,
)
TOWER = "\\boxed{9^{9^{9^{9}}}}"
STDIO = '{"inputs": ["2\\n", "5\\n"], "outputs": ["4", "10"]}'


# Worker processes, kills and "leaves nothing" checks: `make test` runs this file after the
# parallel part, alone (marker `serial`).
pytestmark = pytest.mark.serial


def math_item(answer, gold="204", **kw):
    return RewardItem(response=f"<think>...</think> \\boxed{{{answer}}}", ground_truth=gold, **kw)


def code_item(code, tests=STDIO):
    return RewardItem(response=f"```python\n{code}\n```", ground_truth=tests, ability="code")


def sandbox_uid_pids(config):
    uids = {config.sandbox_for(i).uid for i in range(config.workers)}
    return [
        p.pid
        for p in psutil.process_iter(["uids", "status"])
        if p.info["uids"] and p.info["uids"].real in uids and p.info["status"] != "zombie"
    ]


def children():
    return [p for p in psutil.Process().children(recursive=True) if p.status() != "zombie"]


def settled(found, timeout_s=5.0):
    """``found()`` once it is empty, or its last value after ``timeout_s``. A worker that
    replaces a recycled one probes the sandbox's Python as the sandbox uid while it starts:
    a process for a moment, where a leaked one stays."""
    deadline = time.monotonic() + timeout_s
    while (left := found()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(CONFIG) as p:
        yield p
    assert children() == []


def test_mixed_batch_matches_sequential(pool):
    items = [
        math_item(204),
        math_item(205),
        math_item("025", gold="25"),
        RewardItem(response="no answer", ground_truth='["204"]', ability="math"),
        code_item("print(int(input()) * 2)"),
        code_item("print(int(input()) + 2)"),
        {
            "response": "```python\nprint(3)\n```",
            "ground_truth": '{"assert_case": ["assert 1 == 1"]}',
        },
        RewardItem(response="\\boxed{1}", ground_truth="1", ability="Chemistry"),
        RewardItem(response="x", ground_truth="{broken", ability="code"),
    ]
    results = pool.map(items, timeout=60)
    assert [r.status for r in results] == [C, W, C, N, C, W, C, E, E]
    assert "unknown ability 'Chemistry'" in results[7].detail
    assert "not valid JSON" in results[8].detail
    sequential = [
        compute_reward(it, math_config=CONFIG.math, sandbox_config=SANDBOX) for it in items
    ]
    assert [r.status for r in sequential] == [r.status for r in results]


def test_items_from_verl_rows():
    row = {
        "data_source": "test-math-aime24",
        "prompt": [{"role": "user", "content": "Find x."}],
        "ability": "math",
        "reward_model": {"ground_truth": "025", "style": "rule"},
        "extra_info": {"index": 1},
    }
    item = RewardItem.from_row(row, "<think>x</think>\\boxed{25}")
    assert (item.ability, item.ground_truth) == ("math", "025")
    assert compute_reward(item).status is C
    code_row = {"reward_model": {"ground_truth": STDIO}, "ability": None}
    assert compute_reward(RewardItem.from_row(code_row, "```python\nprint(2)\n```")).status is W
    with pytest.raises(ValueError, match="ground_truth"):
        RewardItem.from_row({"ability": "math"}, "x")


def test_submit_poll_collect_are_asynchronous(pool):
    slow = pool.submit(code_item("import time\ntime.sleep(0.8)\nprint(int(input()) * 2)"))
    fast = pool.submit(math_item(204))
    assert pool.poll(slow) is None  # queued or running: the caller is not blocked
    with pytest.raises(TimeoutError):
        pool.collect([slow], timeout=0.05)
    [fast_result] = pool.collect([fast], timeout=30)
    assert fast_result.status is C
    [slow_result] = pool.collect([slow], timeout=30)
    assert slow_result.status is C
    with pytest.raises(KeyError):
        pool.collect([slow])


def test_power_tower_is_killed_at_its_deadline_and_pool_recovers(pool):
    before = pool.stats()
    start = time.monotonic()
    tower, after = pool.submit_many(
        [RewardItem(response=TOWER, ground_truth="204", ability="math"), math_item(204)]
    )
    [result] = pool.collect([tower], timeout=30)
    elapsed = time.monotonic() - start
    assert result.status is T and result.reward == 0.0
    assert CONFIG.math_deadline_s <= result.elapsed_s < CONFIG.math_deadline_s + 1.0
    assert elapsed < CONFIG.math_deadline_s + 5.0
    assert pool.collect([after], timeout=30)[0].status is C
    stats = pool.stats()
    assert stats["killed_at_deadline"] == before.get("killed_at_deadline", 0) + 1
    assert stats["workers_started"] > before["workers_started"]  # the killed one was replaced


def test_item_deadline_overrides_the_default(pool):
    item = RewardItem(response=TOWER, ground_truth="1", ability="math", deadline_s=0.5)
    start = time.monotonic()
    [result] = pool.map([item], timeout=30)
    assert result.status is T
    assert time.monotonic() - start < 4.0


def test_workers_are_recycled(pool):
    before = pool.stats().get("workers_recycled", 0)
    # text beside the box: Math-Verify decides these in a worker (no integer fast path)
    items = [
        RewardItem(response=f"<think>...</think> so \\boxed{{{i}}}", ground_truth="3")
        for i in range(2 * CONFIG.max_items_per_worker + 1)
    ]
    results = pool.map(items)
    assert sum(r.status is C for r in results) == 1
    assert pool.stats()["workers_recycled"] > before


HOSTILE = [
    "while True:\n    pass",
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "import os\nos.kill(os.getppid(), 9)\nprint(4)",
    "import os\nos.killpg(0, 9)",
    "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\nprint(1)",
    "x = ' ' * (1 << 40)",
    "import sys\nsys.exit(0)",
]


def test_hostile_code_scores_zero_and_pool_keeps_working(pool):
    start = time.monotonic()
    results = pool.map([code_item(c) for c in HOSTILE], timeout=60)
    assert [r.reward for r in results] == [0.0] * len(HOSTILE), results
    assert time.monotonic() - start < 2 * CONFIG.code_deadline
    assert pool.map([code_item("print(int(input()) * 2)")])[0].status is C
    if ROOT:
        assert settled(lambda: sandbox_uid_pids(CONFIG)) == []

    def below_workers():  # no sandbox process outlived its item
        workers = {p.pid for p in psutil.Process().children()}
        return {p.pid for p in children()} - workers

    assert settled(below_workers) == set()


@pytest.mark.skipif(not ROOT, reason="kills by uid only as root")
def test_kill_uid_stops_a_fork_loop_and_waits_until_it_is_gone():
    import resource
    import subprocess

    # The killed processes stay zombies, counted against the uid's process limit,
    # until init reaps them: a uid of this run's own lets the test run again at once.
    uid = CONFIG.sandbox_uid_base + 300 + os.getpid() % 100
    QUIET = {"stderr": subprocess.DEVNULL, "start_new_session": True}

    def confine():
        resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))

    # Every shell forks a sleep and another shell; at the limit a shell's fork fails
    # and it exits, so processes keep being born and dying.
    loop = 'while :; do sleep 100 & sh -c "$0" & done'
    proc = subprocess.Popen(
        ["/bin/sh", "-c", loop, loop], user=uid, group=uid, preexec_fn=confine, **QUIET
    )
    try:
        deadline = time.monotonic() + 10
        while len(uid_pids(uid)) < 8:  # the loop is forking
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert kill_uid(uid) >= 8
        assert uid_pids(uid) == []  # nothing left, at once: no polling here
    finally:
        kill_uid(uid)
        proc.wait(timeout=10)
    with pytest.raises(ValueError, match="refusing"):
        kill_uid(os.getuid())


@pytest.mark.parametrize("isolation", ["auto", "process"])
def test_worker_killed_mid_sandbox_leaves_no_process(isolation):
    # The pool deadline is shorter than the sandbox's own limits, so the
    # worker is killed while its sandboxed program is still running.
    sandbox = SandboxConfig(isolation=isolation, test_timeout_s=20, cpu_s=20, max_wall_s=30)
    config = RewardsConfig(
        num_workers=1, sandbox=sandbox, sandbox_uid_base=CONFIG.sandbox_uid_base + 200
    )
    before = {p.pid for p in children()}
    tmp_before = our_tmp_dirs()
    with VerifierPool(config) as pool:
        pool.map([math_item(1)])  # warm
        spinner = code_item("import os, time\nos.fork()\nos.setsid()\nwhile True:\n    pass")
        [result] = pool.map([dataclasses.replace(spinner, deadline_s=1.0)])
        assert result.status is T and "pool deadline" in result.detail
        if ROOT:
            assert settled(lambda: sandbox_uid_pids(config)) == []
        assert pool.map([code_item("print(int(input()) * 2)")])[0].status is C
    assert {p.pid for p in children()} <= before
    assert our_tmp_dirs() <= tmp_before  # no working directory left


def test_worker_does_not_load_jax(pool):
    pool.map([math_item(204)])
    workers = psutil.Process().children()
    assert workers
    for w in workers:
        with open(f"/proc/{w.pid}/maps") as f:
            maps = f.read()
        assert "jaxlib" not in maps and "xla_extension" not in maps
        assert "magic_jax.rewards.worker" in " ".join(w.cmdline())


def test_close_cancels_queued_items_and_leaves_no_process():
    config = RewardsConfig(
        num_workers=1,
        math_deadline_s=3.0,
        math=CONFIG.math,
        sandbox=SANDBOX,
        sandbox_uid_base=CONFIG.sandbox_uid_base + 100,
    )
    before = {p.pid for p in children()}
    pool = VerifierPool(config)
    tickets = pool.submit_many(
        [math_item(204)] + [RewardItem(response=TOWER, ground_truth="1")] * 3
    )
    pool.close(cancel_pending=True)
    results = pool.collect(tickets)
    assert results[-1].status is E and "pool closed" in results[-1].detail
    assert {p.pid for p in children()} <= before
    if ROOT:
        assert sandbox_uid_pids(config) == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(math_item(1))
    pool.close()  # idempotent


def test_pool_config_validation_names_the_field():
    for kwargs, field in [
        ({"num_workers": 0}, "num_workers"),
        ({"max_items_per_worker": 0}, "max_items_per_worker"),
        ({"math_deadline_s": 0}, "math_deadline_s"),
        ({"code_deadline_s": 1.0}, "code_deadline_s"),
        ({"worker_memory_mb": 10}, "worker_memory_mb"),
    ]:
        with pytest.raises(ValueError, match=field):
            RewardsConfig(**kwargs)
    assert RewardsConfig().workers == (os.cpu_count() or 1)
    with pytest.raises(TypeError, match="response must be a str"):
        RewardItem(response=None, ground_truth="1")


def test_a_pool_removes_the_folders_of_killed_pools(tmp_path):
    """A pool whose process was killed (SIGKILL) leaves its working folder; the next pool
    on the machine removes it, and keeps those of live processes and unknown names."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"mj-verifier-pool-{gone.pid}-k1ll3d"
    (dead / "worker-0").mkdir(parents=True)
    live = tmp_path / f"mj-verifier-pool-{os.getpid()}-al1ve"
    live.mkdir()
    unknown = tmp_path / "mj-verifier-pool-0ldst"
    unknown.mkdir()
    config = dataclasses.replace(
        CONFIG, num_workers=1, sandbox=dataclasses.replace(SANDBOX, tmp_root=str(tmp_path))
    )
    with VerifierPool(config) as pool:
        assert pool.map([math_item(204)])[0].status == C
        mine = {p.name for p in tmp_path.iterdir()} - {live.name, unknown.name}
        assert len(mine) == 1 and mine.pop().startswith(f"mj-verifier-pool-{os.getpid()}-")
    assert not dead.exists() and live.exists() and unknown.exists()
    assert {p.name for p in tmp_path.iterdir()} == {live.name, unknown.name}


def test_integer_answers_are_decided_without_a_worker():
    """Lone integer boxes get their verdict at submit (no worker round trip), equal to
    ``compute_reward``'s; anything else still goes to a worker."""
    from magic_jax.rewards import compute_reward

    items = [
        RewardItem(response="<think>3+4=7</think>\n\\boxed{7}", ground_truth="7"),
        RewardItem(response="<think>3+4=8</think>\n\\boxed{8}", ground_truth="7"),
        RewardItem(response="<think>x</think> so it is \\boxed{0.5}", ground_truth="\\frac12"),
    ]
    with VerifierPool(RewardsConfig(num_workers=1)) as pool:
        tickets = pool.submit_many(items)
        assert pool.poll(tickets[0]) is not None and pool.poll(tickets[1]) is not None
        rest = pool.collect([tickets[2]])
    got = [compute_reward(it) for it in items]
    assert [r.status for r in got[:2]] == [C, W]
    assert rest[0].status == got[2].status == C
