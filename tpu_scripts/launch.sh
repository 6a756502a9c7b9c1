#!/usr/bin/env bash
# The whole life of a run on a Cloud TPU slice: create (or reuse) it, install this
# checkout's commit on every worker, run one command on all workers at once, stream
# worker 0's log, collect every worker's log here, and tear the slice down on request.
#
#   tpu_scripts/launch.sh [options] -- magic-jax train configs/skywork-or1-7b.yaml
#   tpu_scripts/launch.sh --name NAME --zone ZONE --delete
#
# Options (defaults in brackets):
#   --name NAME         TPU VM (node) name [magic-jax]
#   --zone ZONE         zone [us-east5-a]
#   --project P         project [gcloud's configured project]
#   --accelerator T     accelerator type [v5p-64]
#   --version V         runtime version [by generation: v4 tpu-ubuntu2204-base,
#                       v5e v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5, v6e v2-alpha-tpuv6e]
#   --spot              Spot capacity
#   --reserved          capacity from the project's reservations
#   --queued            request the slice as a queued resource (NAME-qr) and wait for it,
#                       as long as it takes (or --timeout); a launch that finds NAME-qr
#                       waiting or ACTIVE attaches to it; one FAILED or SUSPENDED is
#                       deleted and requested again (counted in --create-tries)
#   --reservation R     (--queued) this reservation, by name or full path
#   --best-effort       (--queued) best-effort capacity
#   --valid-until-duration D  (--queued) the request lapses after D, e.g. 6h
#   --service-account SA  the VMs' service account (it needs roles on the bucket: docs/tpu.md)
#   --network N, --subnetwork S  the VMs' VPC network and subnetwork
#   --internal-ip       VMs without external IPs; ssh and scp over internal IPs
#   --retry N           when the slice is preempted, lost or restarted by maintenance, or
#                       the command exits with a status that restarts, rerun it, up to N
#                       times: on the same slice once it is READY again (maintenance, a
#                       status that restarts), else on a new one (re-requested with
#                       --queued); the run resumes from its output_dir [0]
#   --create-tries N    a create that finds no capacity (code 8, or code 13 as Spot
#                       stockouts also come) or is rate-limited (429) is tried again,
#                       after 60 s, then twice as long each time (at most
#                       --create-backoff-max), up to N tries in all [$LAUNCH_CREATE_TRIES
#                       or 12]; ALREADY_EXISTS (a delete under way) is waited for; quota,
#                       credentials, a missing role and other errors end at once, in one
#                       line naming the fix
#   --create-backoff-max S  the longest wait between creates [$LAUNCH_CREATE_BACKOFF_MAX_S or 1800]
#   --env KEY=VALUE     set KEY for the command on every worker (repeatable)
#   --compile-cache URL the command's persistent compilation cache on every worker, e.g.
#                       gs://BUCKET/jax-cache (sets MAGIC_JAX_COMPILATION_CACHE)
#   --no-setup          the workers already have this commit installed
#   --logs DIR          where every worker's log is collected [runs/launch/NAME-run-TIME]
#   --delete-on-exit    delete the slice when the command ends (also on failure or Ctrl-C)
#   --delete            delete the slice (and its queued resource) and exit; a supervisor
#                       of it is stopped first, so that it does not take the deletion for
#                       a preemption: on this machine by SIGTERM; on another, with --stage,
#                       by a stop request in its lease, waited for until it acknowledges
#                       (its lease's stale time and 15 s at most; then deleted anyway)
#   --attach NAME       supervise the command an earlier launch left running on NAME (its
#                       supervisor killed, its machine down) to its end, with that launch's
#                       --retry unless given; the same command as that launch's attaches
#                       too (otherwise: the TPU is in use); not while its supervisor lives,
#                       here or on another machine (its lease in the stage, stale 60 s
#                       after its last renewal)
#   --stage URL         where the archive (once per commit) and the workers' heartbeats
#                       go [gs://BUCKET/magic-jax-launch, BUCKET the output_dir's]
#   --timeout S         seconds to wait for the slice to be ready [3600; no limit for
#                       a queued resource]
#   --dry-run           print every gcloud command and Cloud TPU API request (tpu-api
#                       VERB ...) instead of running it (or DRY_RUN=1)
#
# Set-up (tpu_scripts/worker_setup.sh, from the archive, on every worker): uv (found, or
# installed with the image's pip, or with uv's installer) makes ~/magic-jax/<commit>/.venv
# with Python $LAUNCH_PYTHON [3.11] (the stock images' python3 is 3.10: uv takes a 3.11
# on the worker or downloads one) and runs `uv pip install $LAUNCH_INSTALL`
# [-c constraints.txt -e .[tpu]]; once per commit. A worker that fails ends the launch
# with one line naming it and its last error line; no command is started.
# The command runs in ~/magic-jax/<commit> inside its venv on every worker, detached,
# under tpu_scripts/worker_run.sh (which records its exit status even when a shutdown
# signals it, the host's boot id, and with a stage a heartbeat every
# $LAUNCH_HEARTBEAT_S [10] s); magic_jax starts jax.distributed itself on a multi-host
# slice. The supervisor is Python's (magic_jax/jobs/launch.py, run by this script with
# $LAUNCH_API_PYTHON [python3], 3.11 or newer: pip install 'magic-jax[launch]'). It asks Cloud TPU
# (nodes, queued resources, their operations, state, health and errors) through its
# API's client, google-cloud-tpu, in its own process (Application Default Credentials:
# gcloud auth application-default login); the decisions below are
# magic_jax/jobs/pod_decide.py's; gcloud only reaches the workers (ssh, scp) and the
# stage, without prompts (CLOUDSDK_CORE_DISABLE_PROMPTS=1).
# While it runs, a status cycle every $LAUNCH_POLL_S [10] s makes two calls at any
# host count: the node's state and health (the API), and every worker's heartbeat
# (one listing of the stage through the storage client; without a stage: one ssh to
# all workers). Health is part of the state: a READY node whose health
# is UNHEALTHY_* or TIMEOUT is waited for (maintenance: hours, on every host), never
# probed or deleted, with no time limit unless --timeout. On a READY, healthy node a
# worker silent for $LAUNCH_LOST_S [20] s is asked once, with $LAUNCH_PROBE_S [15] s to
# answer. Every ssh gives up connecting after $LAUNCH_SSH_CONNECT_S [10] s; a question to
# one worker after $LAUNCH_SSH_DEADLINE_S [120] s (gcloud's own ssh tries a gone host for
# about 20 min); logs are fetched $LAUNCH_SSH_FANOUT [16] workers at a time, never from a
# host known gone. The exit status is worker 0's, unless
# another worker's command ends with a failure while worker 0's still runs (any status
# but 0, 130 or 143, or gone without one): then every worker's command is stopped
# (SIGTERM, SIGKILL $LAUNCH_KILL_S [30] s later) and the status is that worker's (1 when
# it left none). Commands still running $LAUNCH_GRACE_S [120] s after worker 0's ended
# are stopped too (status 1 if worker 0's was 0). A create that fails for quota ends at
# once (no retry can fix it). A command already running on the slice (an earlier
# launch's, detached) ends the launch before anything starts: the TPU is in use.
# A preemption is worker 0 exiting with 143 (stopped at a checkpoint on SIGTERM) or the
# slice lost while the command runs (PREEMPTED, TERMINATED, gone; a queued resource
# SUSPENDED or FAILED; a worker that neither writes its heartbeat nor answers on a READY
# node: "a host lost"); --retry reruns on a new slice; with no retries left the status
# is 143. Maintenance is a command gone without an exit status from a host that booted
# since it started (the node REPAIRING, or UNHEALTHY_MAINTENANCE, meanwhile): --retry
# reruns it on the same slice once READY and healthy. So does a status that restarts a
# GKE JobSet too (magic_jax/jobs/restarts.py: 86 a device fault, 124 a hang, 69, 137,
# 42, 127-255; 143 as above). A command gone from a host that did not restart (killed)
# ends the launch with 1.
# Every worker's log is collected into --logs when the command ends and at each
# preemption, worker-N.log, worker-N.attempt-K.log: from the workers that still answer,
# else (with a stage) the copy each worker keeps in STAGE/logs/RUN/ every 60 heartbeats
# and at its command's end, so a preempted slice's logs survive it.
# An ssh failure never ends a run: while the slice is not lost, launch.sh reconnects to
# worker 0 after $LAUNCH_SSH_BACKOFF_S [30] s, twice as long each time up to
# $LAUNCH_SSH_BACKOFF_MAX_S [300] s, for as long as it takes.
# A closed terminal stops nothing: SIGHUP is ignored by the supervisor and every gcloud
# call it makes (a create or set-up in flight included), and at a terminal its messages
# also go to LOGS/launch.log, through relays that outlive the terminal. Ctrl-C (or SIGTERM) exits 130 (143). While the command runs, without --delete-on-exit
# the command goes on, detached (--delete stops it with the slice); with it, the command
# is stopped on every worker (SIGTERM: the run checkpoints), the logs are collected and
# the slice is deleted; a second Ctrl-C deletes it at once. Before the command runs,
# --delete-on-exit deletes the slice (a create in flight included).
# --retry and --delete-on-exit need the command's output_dir (--set output_dir=..., or
# the top-level output_dir: of its YAML config) on gs://: the slice's disks go with it.
set -euo pipefail

# A lost terminal (the laptop closed, the ssh session dropped: SIGHUP to every process
# of the launch) stops nothing: ignored here, so by the supervisor and every gcloud call
# it makes (an ignored signal stays ignored over exec).
trap '' HUP
for a in "$@"; do
  case $a in
    --) break ;;
    -h|--help) sed -n '2,/^[^#]/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  esac
done
here=${0%/*}; [ "$here" != "$0" ] || here=.
REPO=$(cd "$here/.." && pwd)
PY=${LAUNCH_API_PYTHON:-python3}
if ! command -v "$PY" > /dev/null; then
  dry=${DRY_RUN:-0}
  for a in "$@"; do [ "$a" != -- ] || break; [ "$a" != --dry-run ] || dry=1; done
  if [ "$dry" = 0 ] && ! command -v gcloud > /dev/null; then
    echo "launch.sh: gcloud not found on PATH (install the Google Cloud CLI)" >&2; exit 2
  fi
  echo "launch.sh: $PY not found on PATH: the supervisor is Python's (set LAUNCH_API_PYTHON;" \
    "pip install 'magic-jax[launch]')" >&2
  exit 2
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2> /dev/null; then
  v=$("$PY" -c 'import platform; print(platform.python_version())' 2> /dev/null) || v="?"
  echo "launch.sh: $PY is Python $v; the supervisor needs 3.11 or newer, as magic-jax does" \
    "(set LAUNCH_API_PYTHON to one, with pip install 'magic-jax[launch]')" >&2
  exit 2
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m magic_jax.jobs.launch "$@"
