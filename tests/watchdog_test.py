"""The step watchdog and the failure reports in one process (magic_jax.watchdog,
magic_jax.distributed); tests/multihost_failure_test.py has them across processes."""

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from magic_jax import distributed, watchdog

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, env=None, timeout: float = 60):
    """Runs ``code`` in a fresh interpreter (no JAX imported unless the code does)."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, cwd=ROOT, env=dict(os.environ, **(env or {})),
                         timeout=timeout)  # fmt: skip
    return out, time.monotonic() - t0


def test_beat_records_when_and_what():
    watchdog.beat("decode chunk")
    assert watchdog.idle_s() < 1.0 and watchdog._what == "decode chunk"
    time.sleep(0.05)
    assert watchdog.idle_s() >= 0.05


def test_beat_is_cheap():
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        watchdog.beat("optimizer step")
    assert (time.perf_counter() - t0) / n < 5e-6  # about 0.2 us here: two stores


def test_off_without_a_limit(tmp_path):
    with watchdog.Watchdog(None, tmp_path) as dog:
        assert dog._thread is None
    assert not (tmp_path / "logs").exists()


def test_quiet_while_beats_come(tmp_path):
    with watchdog.Watchdog(0.3, tmp_path, poll_s=0.02, exit_code=None) as dog:
        for _ in range(40):  # 0.8 s, a beat every 0.02 s
            watchdog.beat("step")
            time.sleep(0.02)
        assert dog.fired is None
    assert not (tmp_path / "logs").exists()


def waiting_here(dog, stop):
    """A frame the stacks must show."""
    while dog.fired is None and time.monotonic() < stop:
        time.sleep(0.01)


def test_fires_after_its_limit_with_every_threads_stack(tmp_path, capfd):
    t0 = time.monotonic()
    with watchdog.Watchdog(0.3, tmp_path, poll_s=0.02, exit_code=None) as dog:
        waiting_here(dog, time.monotonic() + 10)
    waited = time.monotonic() - t0
    assert dog.fired and 0.3 <= waited < 2.0, waited
    (dump,) = (tmp_path / "logs").glob("watchdog-process0-*.txt")
    assert str(dump) == dog.fired
    text = dump.read_text()
    assert text.startswith("watchdog: process 0 made no progress for 0s (limit 0.3s)")
    assert "the last progress was 'watchdog started'" in text
    assert "Thread MainThread" in text and "in waiting_here" in text
    assert "Thread watchdog" in text  # every thread, its own included
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("[watchdog] process 0: no progress for 0s")
    assert f"every thread's stack in {dump}; stopped watching" in err[0]


def test_without_a_run_directory_the_stacks_go_to_stderr(capfd):
    with watchdog.Watchdog(0.1, None, poll_s=0.02, exit_code=None) as dog:
        waiting_here(dog, time.monotonic() + 10)
    assert dog.fired == ""
    err = capfd.readouterr().err
    assert "every thread's stack in the report below" in err and "in waiting_here" in err


def test_one_watchdog_per_process(tmp_path):
    with watchdog.Watchdog(60, tmp_path) as outer:
        with watchdog.Watchdog(0.01, tmp_path, exit_code=None) as inner:
            assert inner._thread is None  # the outer one watches
            time.sleep(0.1)
            assert inner.fired is None
        assert outer._thread is not None
    assert outer._thread is None and watchdog._active is None
    threads = [t.name for t in threading.enumerate()]
    assert "watchdog" not in threads


def test_a_hung_process_ends_with_124_and_its_stacks(tmp_path):
    out, took = _python(f"""
        import time
        from magic_jax import watchdog

        def stuck_in_a_collective():
            time.sleep(60)

        with watchdog.Watchdog(0.5, {str(tmp_path)!r}):
            watchdog.beat("decode chunk")
            stuck_in_a_collective()
        """)  # fmt: skip
    assert out.returncode == watchdog.HUNG_EXIT, out.stderr
    assert took < 20, took
    (dump,) = (tmp_path / "logs").glob("watchdog-process0-*.txt")
    text = dump.read_text()
    assert "the last progress was 'decode chunk'" in text and "in stuck_in_a_collective" in text
    assert "[watchdog] process 0: no progress for" in out.stderr
    assert "ending it (exit 124)" in out.stderr


LOOP = """
from magic_jax import interrupt, watchdog

for step in range(5):
    interrupt.at(step)
    watchdog.beat("decode chunk")
    watchdog.beat("optimizer step")
    print("done", step, flush=True)
"""


def test_the_fault_hook_raises_at_its_beat_and_step():
    out, _ = _python(LOOP, env={"MAGIC_JAX_FAULT_AT": "raise:optimizer step:3"})
    assert out.returncode == 1
    assert out.stdout.split() == ["done", "0", "done", "1", "done", "2"]
    assert "RuntimeError: test fault MAGIC_JAX_FAULT_AT=raise:optimizer step:3" in out.stderr


def test_the_fault_hook_hangs_at_its_beat_and_step():
    watched = "from magic_jax import watchdog\nwith watchdog.Watchdog(0.5):\n" + "".join(
        f"    {line}\n" for line in LOOP.strip().splitlines()
    )  # the watchdog ends the hang
    out, took = _python(watched, env={"MAGIC_JAX_FAULT_AT": "hang:decode chunk:2"})
    assert out.returncode == watchdog.HUNG_EXIT and took < 20, (out.stderr, took)
    assert out.stdout.split() == ["done", "0", "done", "1"]
    assert "[test] hang at" in out.stderr and "in _fault_hook" in out.stderr


def test_one_process_has_no_job_to_end():
    assert not distributed.running() and distributed.failed_processes() == {}
    assert distributed.process_index() == 0
    assert not distributed.watch_failures()  # nothing to watch


def test_the_heartbeat_timeout_bounds_a_killed_process(monkeypatch):
    import inspect

    import jax

    opts = distributed.initialize_options()
    assert opts == {"heartbeat_timeout_seconds": distributed.HEARTBEAT_S}
    inspect.signature(jax.distributed.initialize).bind(**opts)  # what jax 0.10.2 takes
    monkeypatch.setenv(distributed.HEARTBEAT_ENV, "10")
    assert distributed.initialize_options() == {"heartbeat_timeout_seconds": 10}


def test_end_job_in_one_process_writes_its_report_and_exits(tmp_path):
    report = tmp_path / "run" / "logs" / "failure-process0-x.txt"
    out, _ = _python(f"""
        from magic_jax import distributed
        distributed.end_job("Traceback: it broke", 2, log_file=lambda: {str(report)!r})
        """)  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert report.read_text() == "Traceback: it broke"


def test_a_report_that_cannot_be_written_does_not_raise(tmp_path, capfd):
    (tmp_path / "file").write_text("")
    assert not distributed.write_report(tmp_path / "file" / "logs" / "r.txt", "x")
    assert "[failure] could not write" in capfd.readouterr().err


def test_the_stacks_go_to_a_bucket_run_directory(tmp_path, monkeypatch):
    from conftest import GcsEmulator

    from magic_jax import storage

    emulator = GcsEmulator(tmp_path / "emulator.log")
    try:
        for k, v in emulator.env.items():
            monkeypatch.setenv(k, v)
        out = emulator.uri("run")
        with watchdog.Watchdog(0.2, out, poll_s=0.02, exit_code=None) as dog:
            waiting_here(dog, time.monotonic() + 30)
        assert dog.fired.startswith(f"{out}/logs/watchdog-process0-")
        (name,) = storage.listing(out)
        assert name.startswith("logs/watchdog-process0-")
        assert "in waiting_here" in storage.path(dog.fired).read_text()
    finally:
        emulator.stop()
