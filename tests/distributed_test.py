"""``on_primary`` across processes, with the collective faked: no second process."""

import pytest

from magic_jax import distributed


@pytest.fixture
def two_processes(monkeypatch):
    """Two processes; ``broadcast_int`` records what this one sends and answers ``reply``."""
    sent = []
    reply = {"value": 0}

    def broadcast_int(value):
        sent.append(value)
        return reply["value"] if not distributed.is_primary() else int(value)

    monkeypatch.setattr(distributed, "process_count", lambda: 2)
    monkeypatch.setattr(distributed, "broadcast_int", broadcast_int)
    return sent, reply


def test_a_failing_primary_broadcasts_the_int_sentinel(two_processes, monkeypatch):
    sent, _ = two_processes
    monkeypatch.setattr(distributed, "is_primary", lambda: True)

    def fn():
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):  # its own error, not the broadcast's
        distributed.on_primary(fn)
    assert sent == [-(2**31)]


def test_the_others_stop_when_the_primary_failed(two_processes, monkeypatch):
    _, reply = two_processes
    monkeypatch.setattr(distributed, "is_primary", lambda: False)
    reply["value"] = -(2**31)
    with pytest.raises(distributed.ProcessError, match="process 0 stopped"):
        distributed.on_primary(lambda: 1)
    reply["value"] = 5
    assert distributed.on_primary(lambda: 1) == 5
