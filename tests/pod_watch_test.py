"""jobs/pod_watch.py's status cycle, without gcloud or Cloud TPU: its questions are
functions here (the node's state and health, the heartbeats, every worker's answers, the
clock), and what it keeps between cycles (when each worker was last heard, which ended,
the lines said once) is checked cycle by cycle."""

from magic_jax.jobs import pod_watch
from magic_jax.jobs.pod_watch import BeatsUnreadable, Cycle


class World:
    """What the cycle's questions answer, scripted."""

    def __init__(self, workers=2):
        self.t = 0
        self.node = ("READY", "HEALTHY")
        self.seq = 0
        self.beats = {w: "running" for w in range(workers)}
        self.stuck: set[int] = set()  # workers whose heartbeat stopped changing
        self.answers: dict[int, str] = {}  # what a probe hears: "N STATUS BOOT" by worker
        self.unreadable = ""
        self.probes = 0
        self.said: list[str] = []

    def beat_lines(self):
        if self.unreadable:
            raise BeatsUnreadable(self.unreadable)
        self.seq += 1
        lines = []
        for w, st in self.beats.items():
            seq = "1" if w in self.stuck else str(self.seq)
            seq = "end" if st.startswith("exit-") else seq
            lines.append(f"{w} {seq} {st} boot-{w}")
        return lines

    def probe(self):
        self.probes += 1
        return list(self.answers.values())

    def cycle(self, workers=2, beats=True):
        return Cycle(
            workers=workers,
            name="n",
            node=lambda: self.node,
            beats=self.beat_lines if beats else None,
            probe=self.probe,
            now_ms=lambda: self.t,
            say=self.said.append,
            lost_ms=20_000,
            probe_ms=15_000,
            where="gs://b/s/beats/r-1",
        )


def test_a_quiet_cycle_asks_no_worker_and_decides_nothing():
    w = World()
    c = w.cycle()
    for _ in range(5):
        w.t += 10_000
        assert c.cycle() == pod_watch.Verdict()
    assert w.probes == 0 and not w.said


def test_a_silent_worker_is_asked_once_then_lost_when_it_does_not_answer():
    w = World()
    c = w.cycle()
    w.stuck.add(1)
    w.t += 10_000
    assert c.cycle().what == ""  # (its heartbeat seen: silent from now on)
    w.t += 10_000
    assert c.cycle().what == ""  # (10 s: not silent yet)
    w.t += 15_000
    w.answers = {0: "0 running same"}  # worker 1 does not answer
    v = c.cycle()
    assert w.probes == 1 and v.what == "lost" and v.workers == (1,) and v.kind == "a host lost"
    assert v.lost == (
        "worker 1 stopped answering (no heartbeat for 25s, no answer in 15s; n is READY)"
    )


def test_a_worker_whose_command_ended_is_not_silent():
    w = World()
    c = w.cycle()
    w.beats[1] = "exit-0"  # its last heartbeat, never changing again
    for _ in range(6):
        w.t += 10_000
        assert c.cycle().what == ""
    assert w.probes == 0 and 1 in c.ended


def test_unreadable_heartbeats_are_said_once_while_the_workers_answer():
    w = World()
    c = w.cycle()
    w.unreadable = "403 denied (grant the caller roles/storage.objectUser)"
    w.answers = {0: "0 running same", 1: "1 running same"}
    for _ in range(6):
        w.t += 10_000
        assert c.cycle().what == ""
    said = [x for x in w.said if "cannot be read" in x]
    assert said == [
        "worker(s) 0 1 answer, but their heartbeats in gs://b/s/beats/r-1 cannot be read: "
        "403 denied (grant the caller roles/storage.objectUser)"
    ]
    assert w.probes >= 2  # asked again once they went silent again


def test_old_heartbeats_of_answering_workers_are_said_each_time():
    w = World()
    c = w.cycle()
    w.stuck.add(0)
    w.answers = {0: "0 running same", 1: "1 running same"}
    w.t += 10_000
    assert c.cycle().what == ""
    w.t += 25_000
    assert c.cycle().what == "" and w.said == [
        "worker(s) 0 answer, but their heartbeats are 20s old or more: are they reaching "
        "gs://b/s/beats/r-1?"
    ]
    w.t += 10_000  # heard at the answer: not silent again yet
    assert c.cycle().what == "" and w.probes == 1


def test_maintenance_is_waited_for_said_once_and_no_worker_is_asked():
    w = World()
    c = w.cycle()
    w.node = ("READY", "UNHEALTHY_MAINTENANCE")
    w.stuck = {0, 1}
    for _ in range(10):
        w.t += 60_000
        assert c.cycle().what == ""
    assert w.probes == 0 and w.said == ["n is READY (UNHEALTHY_MAINTENANCE): waiting for it"]
    w.node = ("REPAIRING", "")
    w.t += 60_000
    c.cycle()
    assert w.said[-1] == "n is REPAIRING: waiting for it"


def test_another_workers_failure_and_a_restarted_host():
    w = World()
    c = w.cycle()
    w.beats[1] = "exit-9"
    w.t += 10_000
    assert c.cycle() == pod_watch.Verdict("failed", workers=(1,), status="9")
    w = World()
    c = w.cycle()
    w.stuck.add(0)
    w.answers = {0: "0 gone restarted", 1: "1 running same"}
    w.t += 10_000
    assert c.cycle().what == ""
    w.t += 30_000
    assert c.cycle() == pod_watch.Verdict("restarted", workers=(0,))


def test_a_lost_node_is_lost_whatever_the_workers_say():
    w = World()
    c = w.cycle()
    w.node = ("PREEMPTED", "")
    w.t += 10_000
    assert c.cycle() == pod_watch.Verdict("lost", lost="n is PREEMPTED")


def test_without_a_stage_every_worker_is_asked_each_cycle_and_an_answer_is_a_sign_of_life():
    w = World()
    c = w.cycle(beats=False)
    w.answers = {0: "0 running same", 1: "1 running same"}
    for _ in range(5):
        w.t += 10_000
        assert c.cycle().what == ""
    assert w.probes == 5
    w.answers = {0: "0 running same"}  # worker 1's host stops answering
    w.t += 10_000
    assert c.cycle().what == ""  # (silent 10 s)
    w.t += 10_000
    v = c.cycle()
    assert v.what == "lost" and v.workers == (1,)
