"""Progress beats and the step watchdog (to be completed)."""

from __future__ import annotations


def beat(what: str = "") -> None:
    """Marks progress (a decode chunk, an update micro-batch, a checkpoint completed)."""
    del what
