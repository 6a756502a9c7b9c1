"""jobs/pod_collect.py and jobs/pod_workers.py's fan-out, with the workers' ssh replaced
by a script: every worker's exit status collected (one still running past the grace
period stopped, its status then read), and the logs fetched so many at a time, never from
a host known gone, none from the others when worker 0 does not answer."""

import threading
import time

from magic_jax.jobs import pod_collect, pod_state, pod_workers


class Scripted(pod_workers.Workers):
    """Workers whose ssh answers as a script says: ``exit[w]`` (``running`` until the job
    is stopped, then ``after[w]``), ``log[w]`` (None: no answer)."""

    def __init__(self, n, **kw):
        super().__init__(name="n", where=("--zone", "z"), **kw)
        self.exit = {w: "0" for w in range(n)}
        self.after: dict[int, str] = {}
        self.log = {w: f"log of worker {w}\n" for w in range(n)}
        self.asked: list[tuple[int, str]] = []
        self.stopped = False
        self.busy = self.most = 0
        self.lock = threading.Lock()

    def on(self, worker, command, **kw):
        if "pkill -TERM" in command:
            self.stopped = True
        return 0

    def ask(self, worker, command, out=None):
        with self.lock:
            self.asked.append((worker, command.split()[0]))
            self.busy += 1
            self.most = max(self.most, self.busy)
        try:
            if command.startswith("cat") and ".exit" in command:
                s = self.exit[worker]
                if s == "running" and self.stopped:
                    s = self.after.get(worker, "143")
                return 0, ("none\n" if s == "running" else f"{s}\n")
            if "--status" in command:
                s = self.exit[worker]
                s = self.after.get(worker, "143") if s == "running" and self.stopped else s
                return 0, f"{worker} {s} same\n"
            time.sleep(0.05)  # a log takes a while
            said = self.log[worker]
            if said is None:
                return 255, ""
            if out is not None:
                out.write(said)
                return 0, ""
            return 0, said
        finally:
            with self.lock:
                self.busy -= 1


def _run(tmp_path, n=2, **kw):
    a = pod_state.Args(command=["true"], version="v2")
    r = pod_state.Run(a, tmp_path, "p")
    r.ssh = Scripted(n, **kw)
    r.workers, r.logs, r.log = n, str(tmp_path / "logs"), "$HOME/magic-jax/logs/run-1"
    r.run_dir, r.poll_s, r.grace_s, r.kill_s = "magic-jax/c", 0.0, "0", 0
    return r


def test_every_status_then_every_log_worker_0s_status_is_the_runs(tmp_path, capfd):
    r = _run(tmp_path)
    r.ssh.exit = {0: "3", 1: "4"}
    assert pod_collect.collect(r) and r.status == "3" and not r.stopped
    err = capfd.readouterr().err
    assert f"[launch] worker 1 exited with 4 (log: {r.logs}/worker-1.log)" in err
    assert f"[launch] logs of 2 worker(s) in {r.logs}" in err
    assert (tmp_path / "logs" / "worker-1.log").read_text() == "log of worker 1\n"


def test_a_command_running_past_the_grace_period_is_stopped_then_its_status_read(tmp_path, capfd):
    r = _run(tmp_path)
    r.ssh.exit[1], r.ssh.after[1] = "running", "137"
    assert pod_collect.collect(r) and r.status == "0" and r.stopped == [1] and r.ssh.stopped
    err = capfd.readouterr().err
    assert "launch.sh: worker 1's command still ran 0s after worker 0's ended: stopping it" in err
    assert "[launch] worker 1 exited with 137" in err


def test_logs_come_so_many_at_a_time_never_from_a_gone_host(tmp_path, capfd):
    r = _run(tmp_path, n=8, fanout=3)
    r.gone_hosts = {5}
    assert pod_collect.fetch_logs(r) == 7
    asked = [w for w, _ in r.ssh.asked]
    assert asked[0] == 0 and sorted(asked) == [0, 1, 2, 3, 4, 6, 7]  # worker 0 first, alone
    assert 2 <= r.ssh.most <= 3
    assert not (tmp_path / "logs" / "worker-5.log").exists()
    assert not list((tmp_path / "logs").glob("*.part"))


def test_no_log_is_asked_of_the_others_when_worker_0_does_not_answer(tmp_path, capfd):
    r = _run(tmp_path, n=4)
    r.ssh.log[0] = None  # a slice gone answers no ssh
    r.lost = "n is PREEMPTED"
    pod_collect.salvage_logs(r)
    assert [w for w, _ in r.ssh.asked] == [0]
    assert (
        f"[launch] logs of 0 of 4 worker(s) in {r.logs} (n is PREEMPTED)" in capfd.readouterr().err
    )
    r.ssh.asked.clear()
    r.gone_hosts = {0}  # worker 0 known gone: the others are asked
    assert pod_collect.fetch_logs(r) == 3 and sorted(w for w, _ in r.ssh.asked) == [1, 2, 3]


def test_the_logs_a_worker_kept_in_the_stage_fill_in(tmp_path):
    r = _run(tmp_path, n=2)
    r.ssh.log[1] = None
    r.attempt = 2
    kept = tmp_path / "stage" / "logs" / "n-run-2"
    kept.mkdir(parents=True)
    (kept / "worker-1.log").write_text("kept by worker 1\n")
    r.beats = str(tmp_path / "stage" / "beats" / "n-run-2")
    assert pod_collect.kept_prefix(r.beats) == str(kept)
    assert pod_collect.fetch_logs(r) == 2
    assert (tmp_path / "logs" / "worker-1.attempt-2.log").read_text() == "kept by worker 1\n"
