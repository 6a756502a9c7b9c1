"""Multi-host runs: the few host-side agreements an SPMD training loop needs between processes.

Under ``jax.distributed`` every process runs the same Python program and the
same jitted programs with the same shapes. Device data moves by XLA's
collectives; what this module moves is the host-side data the processes must
agree on before they can issue identical programs: each host's slice of a
step's prompts (token ids, uids), the rewards its verifiers computed, process
0's choice of checkpoint, and whether any process was asked to stop. Every
function here is a collective when ``jax.process_count() > 1`` (all processes
must call it, in the same order) and a plain no-op copy in a single process,
so single-process code paths run unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def process_count() -> int:
    """The number of processes of the job (1 without ``jax.distributed``)."""
    import jax

    return jax.process_count()


def is_primary() -> bool:
    """Whether this is process 0, the one that writes the run directory's records."""
    import jax

    return jax.process_index() == 0


def _allgather(x: np.ndarray) -> np.ndarray:
    """[P, *x.shape]: every process's ``x`` (same shape and dtype everywhere), by process."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def broadcast_int(value: int) -> int:
    """Process 0's ``value`` on every process.

    Used where one process decides for all (the checkpoint to resume from:
    only process 0 verifies checksums and sets bad checkpoints aside, and the
    others must not list the directory while it moves them).
    """
    if process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.asarray(value, np.int32)))


def max_int(value: int) -> int:
    """The largest of the processes' ``value`` on every process (e.g. a stop signal's number).

    A SIGTERM reaches the hosts of a pod at slightly different times; a process
    that stopped alone would leave the others waiting in its next collective.
    """
    if process_count() == 1:
        return int(value)
    return int(_allgather(np.asarray([value], np.int32)).max())


def preemption_notice(step: int) -> bool:
    """True on every process when JAX's preemption service says to stop at ``step``.

    On Cloud TPU, ``jax.distributed`` relays a maintenance or spot preemption
    notice to all hosts; ``reached_preemption_sync_point`` answers True on all of
    them at the same step, which is where the loop saves and stops. Without the
    service (one process, CPU, no distributed client) it is always False: there a
    SIGTERM is the notice.
    """
    from jax._src import distributed as jax_distributed

    if getattr(jax_distributed.global_state, "preemption_sync_manager", None) is None:
        return False
    from jax.experimental import multihost_utils

    return bool(multihost_utils.reached_preemption_sync_point(step))


_FAILED = -(2**31)


def on_primary(fn: Callable[[], int]) -> int:
    """Runs ``fn`` on process 0 only; every process returns its result.

    For what one process decides for all (claiming and locking the run
    directory, choosing the checkpoint to resume from). It is also a barrier:
    no process goes on before process 0 has finished ``fn``.

    Args:
      fn: returns an int in [-2**31 + 1, 2**31).

    Raises:
      Whatever ``fn`` raised, on process 0; ``ProcessError`` on the others,
      which must not wait for a process that has given up.
    """
    if process_count() == 1:
        return fn()
    if not is_primary():
        value = broadcast_int(0)
        if value == _FAILED:
            raise ProcessError("process 0 stopped with an error (its log says which)")
        return value
    try:
        value = fn()
    except BaseException:
        broadcast_int(_FAILED)
        raise
    return broadcast_int(value)


class ProcessError(ValueError):
    """Another process of a multi-host run failed; this one stops too."""


def allgather_ragged(arrays: Sequence[np.ndarray], dtype: np.dtype | type) -> list[np.ndarray]:
    """Every process's list of 1-D arrays, concatenated in process order.

    The lists may differ in length from process to process and the arrays in
    size. Three small collectives: counts, sizes, padded data.

    Args:
      arrays: this process's arrays [n_i] (any n_i, possibly none).
      dtype: their dtype, the same on every process; 32 bits or less (jax
        without x64 would narrow wider ones).

    Returns:
      The arrays of process 0, then process 1's, ... (exact copies, ``dtype``).
    """
    dtype = np.dtype(dtype)
    if dtype.itemsize > 4:
        raise ValueError(f"allgather_ragged: {dtype} is wider than 32 bits")
    arrays = [np.asarray(a, dtype).reshape(-1) for a in arrays]
    if process_count() == 1:
        return [a.copy() for a in arrays]
    counts = _allgather(np.asarray([len(arrays)], np.int32))[:, 0]
    n = max(int(counts.max()), 1)
    sizes = np.zeros(n, np.int32)
    sizes[: len(arrays)] = [len(a) for a in arrays]
    all_sizes = _allgather(sizes)  # [P, n]
    width = max(int(all_sizes.max()), 1)
    data = np.zeros((n, width), dtype)
    for i, a in enumerate(arrays):
        data[i, : len(a)] = a
    all_data = _allgather(data)  # [P, n, width]
    return [
        all_data[p, i, : all_sizes[p, i]].copy()
        for p in range(len(counts))
        for i in range(int(counts[p]))
    ]


def allgather_strings(strings: Sequence[str]) -> list[str]:
    """Every process's strings (e.g. prompt uids), concatenated in process order."""
    if process_count() == 1:
        return list(strings)
    raw = [np.frombuffer(s.encode("utf-8"), np.uint8) for s in strings]
    return [bytes(a).decode("utf-8") for a in allgather_ragged(raw, np.uint8)]
