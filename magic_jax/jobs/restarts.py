"""Which exit statuses of a run restart it: one list for GKE (``jobs/gke.py``) and for a
pod run under ``tpu_scripts/launch.sh`` (``jobs/pod_decide.py``).

A restart resumes the run from its ``output_dir``. The list is xpk's own (42 and
127-255: 143 is a stop on SIGTERM at a checkpoint, as on a preemption or maintenance;
137 a kill) and three of the run's own: 69, Cloud Storage still failing after its
retries; 86, a device or runtime fault (``magic_jax.jobs.cli``: a ``JaxRuntimeError``
other than out-of-memory or a bad argument); 124, a step that hung
(``magic_jax.watchdog``), often a flaky host. Any other status (a bad config, a Python
error, out of memory, a run that lost its lock) ends the run: a restart would fail the
same way. No JAX import here: ``launch.sh``'s supervisor asks this module on the
machine it runs on.
"""

from __future__ import annotations

# xpk restarts a workload on exit codes 42 and 127-255 (xpk's get_restart_exit_codes)
XPK_RESTART_EXIT_CODES = (42, *range(127, 256))
EXTRA_RESTART_EXIT_CODES = (69, 86, 124)
RESTART_EXIT_CODES = tuple(sorted({*XPK_RESTART_EXIT_CODES, *EXTRA_RESTART_EXIT_CODES}))
# SIGTERM: what a preemption or a host's shutdown sends; the run checkpoints and exits 143
PREEMPTED_EXIT_CODE = 143


def restarts(status: int | str | None) -> bool:
    """Whether a run that ended with ``status`` is run again (a retry left).

    Args:
      status: the exit status, as a number or as ``worker_run.sh`` records it; anything
        that is not a number (``gone``, nothing) is no exit status and never restarts.
    """
    try:
        code = int(str(status))
    except ValueError:
        return False
    return code in RESTART_EXIT_CODES
