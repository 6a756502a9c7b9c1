"""Verifier warnings: each logged once per process, and sandbox ones only once code is verified."""

import json
import logging
import os

from magic_jax.rewards import RewardItem, RewardsConfig, SandboxConfig, VerifierPool
from magic_jax.rewards import pool as pool_mod

# A sandbox set-up that warns on every machine: as root, an interpreter the
# sandbox uid cannot run (it falls back to the system python3); otherwise,
# process isolation without root.
if os.geteuid() == 0:
    SANDBOX = SandboxConfig(python="/nonexistent/bin/python")
    EXPECTED = "cannot run /nonexistent/bin/python"
else:
    SANDBOX = SandboxConfig(isolation="process")
    EXPECTED = "isolation='process' without root"

# text beside the box: a worker verifies it (no integer fast path at submit)
MATH = RewardItem(response="so \\boxed{1}", ground_truth="1", ability="math")
CODE = RewardItem(
    response="</think>```python\nprint(int(input()) + 1)\n```",
    ground_truth=json.dumps({"inputs": ["1\n"], "outputs": ["2\n"]}),
    ability="code",
)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "magic_jax.rewards.pool"]


def test_sandbox_warning_once_and_only_when_code_runs(caplog, capfd):
    pool_mod._logged_notes.clear()
    # two items per worker: fresh workers keep starting and probing the sandbox again
    config = RewardsConfig(num_workers=2, max_items_per_worker=2, sandbox=SANDBOX)
    with caplog.at_level(logging.WARNING), VerifierPool(config) as pool:
        assert {r.status.value for r in pool.map([MATH] * 4)} == {"correct"}
        assert not [m for m in _warnings(caplog) if EXPECTED in m]  # math only: silent
        assert {r.status.value for r in pool.map([CODE] * 4)} == {"correct"}
        # 8 items, 2 per worker: 4 replacements, or 3 when both live workers hold one item
        assert pool.stats()["workers_recycled"] >= 3
    found = [m for m in _warnings(caplog) if EXPECTED in m]
    assert len(found) == 1, _warnings(caplog)
    assert EXPECTED not in capfd.readouterr().err  # the workers print nothing themselves
