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
#                       of it on this machine is stopped first (SIGTERM), so that it does
#                       not take the deletion for a preemption
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
# slice. Cloud TPU (nodes, queued resources, their operations, state, health and errors)
# is asked through its API's Python client, google-cloud-tpu (magic_jax/jobs/pod_api.py,
# with $LAUNCH_API_PYTHON [python3]: pip install 'magic-jax[launch]'; Application Default
# Credentials: gcloud auth application-default login), and a slice is brought up
# (created, requested, waited for) by magic_jax/jobs/pod_up.py with it; gcloud only
# reaches the workers (ssh, scp) and the stage, without prompts
# (CLOUDSDK_CORE_DISABLE_PROMPTS=1). The decisions below are
# magic_jax/jobs/pod_decide.py's, run with this machine's python3 (3.10 or newer, the
# standard library only; $LAUNCH_HOST_PYTHON).
# While it runs, a status cycle every $LAUNCH_POLL_S [10] s makes two calls at any
# host count: the node's state and health (the API), and every worker's heartbeat
# (one listing of the stage through the storage client, served by the API's process;
# without a stage: one ssh to all workers). Health is part of the state: a READY node whose health
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

quit() { local code=$1; shift; echo "launch.sh: $*" >&2; exit "$code"; }
# A lost terminal (the laptop closed, the ssh session dropped: SIGHUP to every process
# of the launch, its shell's jobs) stops nothing: ignored here, so by every child too
# (a gcloud create, set-up or stream in flight goes on), and --delete-on-exit deletes
# only once the run has ended or on Ctrl-C or SIGTERM.
trap '' HUP
RELAYS=() SAID_TO="" SUPERVISOR=""  # (relay_terminal; SAID_TO its launch.log; alone)
die() { quit 2 "$@"; }
usage() { sed -n '2,/^[^#]/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }

NAME=magic-jax ZONE=us-east5-a PROJECT=() ACCEL=v5p-64 VERSION="" QUEUED=0 STAGE=""
SETUP=1 LOGS="" ATTACH=0 RETRY_GIVEN=0 VALID="" DELETE_ON_EXIT=0 DELETE_ONLY=0 TIMEOUT="" DRY="${DRY_RUN:-0}" RETRY=0
CAPACITY=() QUEUED_ONLY=() VM=() SSH_VIA=()
ENVS=() CREATE_TRIES="${LAUNCH_CREATE_TRIES:-12}" CREATE_MAX_S="${LAUNCH_CREATE_BACKOFF_MAX_S:-1800}"
POLL_S="${LAUNCH_POLL_S:-10}" GRACE_S="${LAUNCH_GRACE_S:-120}" KILL_S="${LAUNCH_KILL_S:-30}"
SSH_WAIT_S="${LAUNCH_SSH_BACKOFF_S:-30}" SSH_MAX_S="${LAUNCH_SSH_BACKOFF_MAX_S:-300}"
CREATE_WAIT_S="${LAUNCH_CREATE_BACKOFF_S:-60}"
need() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"; }
while [ $# -gt 0 ]; do
  case $1 in
    --name) need "$@"; NAME=$2; shift 2 ;;
    --zone) need "$@"; ZONE=$2; shift 2 ;;
    --project) need "$@"; PROJECT=(--project "$2"); shift 2 ;;
    --accelerator) need "$@"; ACCEL=$2; shift 2 ;;
    --version) need "$@"; VERSION=$2; shift 2 ;;
    --spot|--reserved) CAPACITY+=("$1"); shift ;;
    --best-effort) CAPACITY+=("$1"); QUEUED_ONLY+=("$1"); shift ;;
    --reservation|--valid-until-duration) need "$@"; CAPACITY+=("$1=$2"); QUEUED_ONLY+=("$1")
      [ "$1" != --valid-until-duration ] || VALID=$2
      shift 2 ;;
    --service-account) need "$@"; VM+=("--service-account=$2"); shift 2 ;;
    --network|--subnetwork) need "$@"; VM+=("$1=$2"); shift 2 ;;
    --internal-ip) VM+=(--internal-ips); SSH_VIA=(--internal-ip); shift ;;
    --queued) QUEUED=1; shift ;;
    --stage) need "$@"; STAGE=${2%/}; shift 2 ;;
    --retry) need "$@"; RETRY=$2 RETRY_GIVEN=1; shift 2 ;;
    --create-tries) need "$@"; CREATE_TRIES=$2; shift 2 ;;
    --create-backoff-max) need "$@"; CREATE_MAX_S=$2; shift 2 ;;
    --env) need "$@"
      [[ $2 =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] ||
        die "--env needs KEY=VALUE with KEY a variable name (letters, digits, _), got $2"
      ENVS+=("$2"); shift 2 ;;
    --compile-cache) need "$@"; ENVS+=("MAGIC_JAX_COMPILATION_CACHE=$2"); shift 2 ;;
    --no-setup) SETUP=0; shift ;;
    --logs) need "$@"; LOGS=$2; shift 2 ;;
    --delete-on-exit) DELETE_ON_EXIT=1; shift ;;
    --delete) DELETE_ONLY=1; shift ;;
    --attach) need "$@"; NAME=$2; ATTACH=1; shift 2 ;;
    --timeout) need "$@"; TIMEOUT=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[ "$DELETE_ONLY" = 1 ] || [ "$ATTACH" = 1 ] || [ $# -gt 0 ] ||
  die "no command after -- (or --delete to tear down, --attach NAME to supervise a running one)"
[[ $TIMEOUT =~ ^[0-9]*$ ]] || die "--timeout must be a number of seconds, got $TIMEOUT"
[ "$QUEUED" = 1 ] || [ "${#QUEUED_ONLY[@]}" = 0 ] || die "${QUEUED_ONLY[0]} needs --queued"
kinds=0
for c in "${CAPACITY[@]}"; do case $c in --spot|--reserved|--best-effort) kinds=$((kinds + 1)) ;; esac; done
[ "$kinds" -le 1 ] || die "--spot, --reserved and --best-effort exclude each other: choose one"
[[ $RETRY =~ ^[0-9]+$ ]] || die "--retry must be a number of retries, got $RETRY"
# gcloud's durations: 6h, 90m, 1d, 3600s, 1h30m
VALID_S=0 rest=$VALID
while [[ $rest =~ ^([0-9]+)([smhd])(.*)$ ]]; do
  case ${BASH_REMATCH[2]} in s) f=1 ;; m) f=60 ;; h) f=3600 ;; d) f=86400 ;; esac
  VALID_S=$((VALID_S + BASH_REMATCH[1] * f)) rest=${BASH_REMATCH[3]}
done
[ -z "$rest" ] || die "--valid-until-duration must be a duration such as 6h or 90m, got $VALID"
[[ $CREATE_TRIES =~ ^[1-9][0-9]*$ ]] || die "--create-tries must be a number of tries (1 or more), got $CREATE_TRIES"
[[ $CREATE_MAX_S =~ ^[0-9]+$ ]] || die "--create-backoff-max must be a number of seconds, got $CREATE_MAX_S"
if [ -z "$VERSION" ]; then
  case $ACCEL in
    v4-*) VERSION=tpu-ubuntu2204-base ;;
    v5litepod-*|v5e-*) VERSION=v2-alpha-tpuv5-lite ;;
    v5p-*) VERSION=v2-alpha-tpuv5 ;;
    v6e-*) VERSION=v2-alpha-tpuv6e ;;
    *) die "no default runtime version for accelerator $ACCEL: pass --version" ;;
  esac
fi
here=${0%/*}; [ "$here" != "$0" ] || here=.
REPO=$(cd "$here/.." && pwd)

# The command's output_dir: its last `--set output_dir=V` (or `output_dir=V`), else the
# top-level `output_dir:` of a YAML config it names that is in this checkout (or here).
output_dir() {
  local a v="" cfg=""
  for a in "$@"; do
    case $a in
      --set=output_dir=*|output_dir=*) v=${a#--set=}; v=${v#output_dir=} ;;
      *.yaml|*.yml) if [ -f "$REPO/$a" ]; then cfg=$REPO/$a; elif [ -f "$a" ]; then cfg=$a; fi ;;
    esac
  done
  if [ -z "$v" ] && [ -n "$cfg" ]; then
    v=$(sed -n 's/^output_dir:[[:space:]]*//p' "$cfg" | tail -n 1)
    v=${v%%[[:space:]]#*}  # a trailing comment
  fi
  v=${v%"${v##*[![:space:]]}"}
  v=${v#[\"\']}; v=${v%[\"\']}
  echo "$v"
}
# A slice that may be deleted (or replaced) under the run needs its output_dir on gs://.
out=""; [ "$DELETE_ONLY" = 1 ] || out=$(output_dir "$@")
if [ "$DELETE_ONLY" = 0 ] && [ $# -gt 0 ] && { [ "$DELETE_ON_EXIT" = 1 ] || [ "$RETRY" -gt 0 ]; }; then
  opt=--delete-on-exit why="the slice's disks are deleted with it"
  [ "$DELETE_ON_EXIT" = 1 ] || opt=--retry why="a recreated slice starts with empty disks"
  [ -n "$out" ] || die "$opt needs output_dir on gs:// ($why); the command has none" \
    "(pass --set output_dir=gs://BUCKET/RUN)"
  [[ $out == gs://?* ]] || die "$opt needs output_dir on gs:// ($why); the command's output_dir is $out"
fi
if [ -z "$STAGE" ] && [[ $out == gs://?* ]]; then out=${out#gs://}; STAGE=gs://${out%%/*}/magic-jax-launch; fi
[ -z "$STAGE" ] || [[ $STAGE == gs://?* ]] || die "--stage must be a gs:// URL, got $STAGE"
[ "$DRY" = 1 ] || command -v gcloud >/dev/null || die "gcloud not found on PATH (install the Google Cloud CLI)"
# The decisions (what a node's state and health, the heartbeats, an error, an exit status
# call for) are magic_jax/jobs/pod.py's, run with this machine's python3 (3.10 or newer,
# the standard library only) from this checkout. The plain case (READY and HEALTHY, a
# status 0, every worker running and heard) needs no decision and asks no Python.
HOST_PYTHON=${LAUNCH_HOST_PYTHON:-python3}
[ "$DRY" = 1 ] || command -v "$HOST_PYTHON" > /dev/null ||
  die "$HOST_PYTHON (3.10 or newer) not found on PATH: launch.sh's decisions are Python's"
pod() { PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$HOST_PYTHON" -S -m magic_jax.jobs.pod "$@"; }
# Never a prompt (enabling an API, a new ssh key's passphrase): gcloud fails with its
# message instead, which is shown.
export CLOUDSDK_CORE_DISABLE_PROMPTS=1

QR="$NAME-qr"
WHERE=(--zone "$ZONE" "${PROJECT[@]}")
TPU=(gcloud compute tpus tpu-vm)  # ssh and scp to the workers
# The slice as magic_jax/jobs/pod_api.py asks Cloud TPU's API for it (tpu_api.Spec)
SPEC=(accelerator="$ACCEL" runtime-version="$VERSION")
for c in "${CAPACITY[@]}" "${VM[@]}"; do
  case $c in
    --spot|--reserved|--best-effort) SPEC+=("${c#--}=1") ;;
    --reservation=*) SPEC+=("reservation=${c#*=}") ;;
    --valid-until-duration=*) SPEC+=("valid-until-s=$VALID_S") ;;
    --internal-ips) SPEC+=(internal-ip=1) ;;
    *) SPEC+=("${c#--}") ;;  # service-account=, network=, subnetwork=
  esac
done
say() { echo "[launch] $*" >&2; }
note() { echo "launch.sh: $*" >&2; }
exec 3>&1  # a dry run prints to the real stdout, also from inside $(...)
run() { if [ "$DRY" = 1 ]; then printf '%q ' "$@" >&3; echo >&3; else "$@"; fi; }
tmpfile() { mktemp "${TMPDIR:-/tmp}/launch-XXXXXX"; }
# A query: in a dry run it is printed and answers nothing. Its error output is kept in
# $ASKED (asked_why: the line that says what went wrong).
ASKED=${TMPDIR:-/tmp}/launch-asked-$$ ASK_ERR=${TMPDIR:-/tmp}/launch-ask-err-$$
ask() { if [ "$DRY" = 1 ]; then run "$@"; return 1; else "$@" 2>"$ASKED"; fi; }
asked_why() { error_line "$ASKED"; }
# Every ssh gives up connecting after CONNECT_S; a question to one worker (ask_worker)
# also gives up after ASK_S in all: gcloud's own ssh tries a host that is gone 10 times,
# 5 s apart, each waiting for TCP's connect timeout (minutes). Questions to many workers
# go FANOUT at a time.
CONNECT_S=${LAUNCH_SSH_CONNECT_S:-10} ASK_S=${LAUNCH_SSH_DEADLINE_S:-120} FANOUT=${LAUNCH_SSH_FANOUT:-16}
ssh_on() {
  local w=$1; shift
  run "${TPU[@]}" ssh "$NAME" "${WHERE[@]}" "${SSH_VIA[@]}" --worker="$w" \
    --ssh-flag=-oConnectTimeout="$CONNECT_S" --command "$*"
}
ask_worker() {
  local w=$1; shift
  [ "$DRY" = 0 ] || { ssh_on "$w" "$@"; return; }
  timeout -k 5 "$ASK_S" "${TPU[@]}" ssh "$NAME" "${WHERE[@]}" "${SSH_VIA[@]}" --worker="$w" \
    --ssh-flag=-oConnectTimeout="$CONNECT_S" --command "$*"
}
# Waits S seconds. LAUNCH_CLOCK=FILE (tests) makes the waits between retries (ssh
# reconnects, creates) advance a clock kept in FILE instead, and `now` read it.
now() { if [ -n "${LAUNCH_CLOCK:-}" ]; then cat "$LAUNCH_CLOCK" 2>/dev/null || echo 0; else date +%s; fi; }
nap() { if [ -n "${LAUNCH_CLOCK:-}" ]; then echo $(($(now) + $1)) > "$LAUNCH_CLOCK"; else sleep "$1"; fi; }
twice() { local s=$(($1 * 2)); echo $((s > $2 ? $2 : s)); }  # the next backoff, capped
span() {  # seconds as 45s, 12m05s, 3h07m
  local s=$1
  if [ "$s" -ge 3600 ]; then printf '%dh%02dm' $((s / 3600)) $((s % 3600 / 60))
  elif [ "$s" -ge 60 ]; then printf '%dm%02ds' $((s / 60)) $((s % 60))
  else printf '%ds' "$s"; fi
}
# The line of gcloud's error output (in file $1) that says what went wrong, with the fix
# for credentials or a missing role.
error_line() { pod error "$1" | cut -f2-; }
# Kills a process and its descendants (a backgrounded gcloud and its ssh).
kill_tree() {
  local c
  for c in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$c"; done
  kill "$1" 2>/dev/null || true
}

# Cloud TPU's API: magic_jax/jobs/pod_api.py on the google-cloud-tpu client (pip install
# 'magic-jax[launch]'), run with $LAUNCH_API_PYTHON [python3], Application Default
# Credentials (gcloud auth application-default login) and --project, else gcloud's
# project. One process for the launch (api_start), asked through two FIFOs, one request at
# a time; without it (--delete, the exit trap) one process a request. A dry run prints
# each request (tpu-api VERB ...). MAGIC_JAX_TPU_API_ENDPOINT (a test or emulator hook:
# http://HOST:PORT) points the client at another server.
API_PYTHON=${LAUNCH_API_PYTHON:-python3}
PROJECT_ID=${PROJECT[1]:-${CLOUDSDK_CORE_PROJECT:-}}
if [ -z "$PROJECT_ID" ] && [ "$DRY" = 0 ]; then PROJECT_ID=$(gcloud config get-value project 2>/dev/null) || true; fi
[ -n "$PROJECT_ID" ] || [ "$DRY" = 1 ] || die "no project: pass --project P (or: gcloud config set project P)"
DELETE_WAIT_S=${LAUNCH_DELETE_WAIT_S:-1800} API_PID="" API_DIR="" API_W="" API_R=""
api_py() { PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$API_PYTHON" -m magic_jax.jobs.pod_api "${PROJECT_ID:-PROJECT}" "$ZONE" "$@"; }
api_start() {
  local line
  [ "$DRY" = 0 ] || return 0
  API_DIR=$(mktemp -d "${TMPDIR:-/tmp}/launch-api-XXXXXX") && mkfifo "$API_DIR/in" "$API_DIR/out"
  # deaf to Ctrl-C and SIGTERM (the launch's own, sent to its process group): the exit
  # trap still asks it; api_stop ends it
  # (nor holding this launch's stdout, fd 3: its end is not delayed by it)
  ( trap '' INT TERM; exec 3>&- < "$API_DIR/in" > "$API_DIR/out" 2> "$API_DIR/err"
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" exec "$API_PYTHON" -m magic_jax.jobs.pod_api \
      "$PROJECT_ID" "$ZONE" --serve $$ ) &
  API_PID=$!
  exec {API_W}> "$API_DIR/in" {API_R}< "$API_DIR/out"
  read -r line <&"$API_R" || true
  [ "$line" = ready ] && return 0
  [ -n "$line" ] || line=$(tail -n 1 "$API_DIR/err")
  printf '%s\n' "$line" > "$ASKED"; api_stop
  quit 1 "Cloud TPU's API ($API_PYTHON -m magic_jax.jobs.pod_api) did not start: $(asked_why)"
}
api_stop() {
  [ -n "$API_PID" ] || return 0
  exec {API_W}>&- {API_R}<&-
  kill -KILL "$API_PID" 2>/dev/null || true; wait "$API_PID" 2>/dev/null || true
  rm -rf "$API_DIR"; API_PID=""
}
# One request (words joined by tabs): 0 with the answer's fields on stdout, or 1 with the
# error's line (pod_errors.told) in $ASKED.
api() {
  local line="" IFS=$'\t'
  if [ "$DRY" = 1 ]; then { printf 'tpu-api'; printf ' %q' "$@"; echo; } >&3; return 0; fi
  if [ -n "$API_PID" ] && kill -0 "$API_PID" 2>/dev/null; then
    { flock 9; printf '%s\n' "$*" >&"$API_W"; read -r line <&"$API_R" || true; } 9>> "$API_DIR/lock"
  else
    line=$(api_py "$@" 2>"$ASKED") || true
  fi
  case $line in ok) return 0 ;; ok$'\t'*) printf '%s\n' "${line#ok$'\t'}"; return 0 ;; esac
  [ -n "$line" ] || line="tpu-api-error	other	no answer from Cloud TPU's API ($API_PYTHON): $(tail -n 1 "$ASKED" 2>/dev/null)"
  printf '%s\n' "$line" > "$ASKED"
  return 1
}
# The node, as the API says: NODE (its state; GONE when NOT_FOUND; UNKNOWN when the
# question failed, its kind and line in $ASK_ERR for stop_if_fatal; "" in a dry run),
# HEALTH, WHY (its health description), IPS (;-separated) and RUNTIME. $1: poll for a
# status cycle's question.
node_info() {
  local a=""
  NODE="" HEALTH="" WHY="" IPS="" RUNTIME=""
  if a=$(api "${1:-node}" "$NAME") && [ -n "$a" ]; then
    IFS=$'\t' read -r NODE HEALTH WHY IPS RUNTIME <<< "$a"
    [ "$HEALTH" != - ] || HEALTH=""; [ "$WHY" != - ] || WHY=""; [ "$IPS" != - ] || IPS=""
  elif [ "$DRY" = 0 ]; then NODE=UNKNOWN; pod error "$ASKED" > "$ASK_ERR"; fi
}
# The queued resource, likewise: QR_STATE, and when FAILED its failedData's kind and line
# (QR_KIND, QR_LINE).
request_info() {
  local a=""
  QR_STATE="" QR_KIND="" QR_LINE=""
  if a=$(api request "$QR") && [ -n "$a" ]; then
    IFS=$'\t' read -r QR_STATE QR_KIND QR_LINE <<< "$a"
    [ "$QR_KIND" != - ] || QR_KIND=""; [ "$QR_LINE" != - ] || QR_LINE=""
  elif [ "$DRY" = 0 ]; then QR_STATE=UNKNOWN; pod error "$ASKED" > "$ASK_ERR"; fi
}
# Deletes the slice: its queued resource (with its node) when there is one, else the node;
# each waited for, at most LAUNCH_DELETE_WAIT_S [1800] s.
teardown() {
  if [ "$QUEUED" = 1 ] || { request_info; [ "$QR_STATE" != GONE ] && [ "$QR_STATE" != UNKNOWN ] && [ -n "$QR_STATE" ]; }; then
    # one SUSPENDING (Cloud TPU deleting its VMs) is left to finish, not force-deleted
    while [ "$DRY" = 0 ] && request_info && [ "$QR_STATE" = SUSPENDING ]; do nap "$POLL_S"; done
    api request-delete "$QR" wait-s="$DELETE_WAIT_S" > /dev/null && return 0
  else
    api delete "$NAME" wait-s="$DELETE_WAIT_S" > /dev/null && return 0
  fi
  say "deleting $NAME failed: $(asked_why)"; return 1
}

# This machine's supervisor of NAME, if one lives: its pid and launch.log (see alone).
ENTRY=$REPO/runs/launch/.$NAME.supervisor
supervisor() {
  local pid said
  IFS=$'\t' read -r pid said 2>/dev/null < "$ENTRY" && [ "$pid" != $$ ] &&
    ps -p "$pid" -o command= 2>/dev/null | grep -q launch.sh && echo "$pid ${said:-}"
}
# --delete first stops this machine's supervisor of NAME (SIGTERM: it exits 143, with
# --delete-on-exit stopping the command), so that it does not take the deletion for a
# preemption and recreate the slice.
if [ "$DELETE_ONLY" = 1 ]; then
  stopped=""
  if [ "$DRY" = 0 ] && read -r pid _ < <(supervisor); then
    say "stopping the supervisor of $NAME on this machine (pid $pid) first"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 600; i++)); do supervisor > /dev/null || break; sleep 0.2; done
    stopped=$pid
  fi
  api_start
  teardown || [ -n "$stopped" ]  # (one with --delete-on-exit deleted the slice itself)
  api_stop
  rm -f "$ASKED" "$ASK_ERR"
  exit 0
fi

# Ends the launch when the last question failed on credentials or a missing role (its
# kind and line in $ASK_ERR), which no wait mends.
stop_if_fatal() {
  local kind line
  [ -s "$ASK_ERR" ] || return 0
  IFS=$'\t' read -r kind line < "$ASK_ERR"
  case $kind in auth|permission) quit 1 "asking Cloud TPU about $NAME failed: $line" ;; esac
  : > "$ASK_ERR"
}
# Whether the slice is lost: preempted, terminated or gone, or its queued resource
# suspended or failed (one SUSPENDING is not yet: it is waited for). Sets LOST to why, or
# STATE to the node's state. A dry run: never.
slice_lost() {
  local s r="" v
  LOST="" STATE=""
  [ "$DRY" = 1 ] && return 1
  if [ "$QUEUED" = 1 ]; then
    request_info; stop_if_fatal; r=$QR_STATE
    v=$(pod node - - "$r")
    case $v in lost*) LOST="queued resource $QR is $r"; return 0 ;; esac
  fi
  node_info; stop_if_fatal; s=$NODE
  v=wait; [ "$s" = READY ] || v=$(pod node "$s" - "${r:--}")
  case $v in lost*) LOST="$NAME is $s"; return 0 ;; esac
  STATE=$s; return 1
}

# ------------------------------------------------------------------ create or reuse, wait
# HAVE_SLICE: the slice may exist (a create was asked for, or it was reused); the exit
# trap deletes it then with --delete-on-exit.
HAVE_SLICE=0 CREATED=0
on_exit() {
  # a request this shell was making when a signal came: its answer would be the next
  # one's, so the API's process goes (the exit trap's requests go one process each)
  if [ -n "$API_PID" ] && ! flock -n "$API_DIR/lock" true; then api_stop; fi
  [ -z "$UP_PID" ] || kill -KILL "$UP_PID" 2>/dev/null || true  # (deaf to TERM)
  [ -z "${STREAM_PID:-}" ] || kill_tree "$STREAM_PID"  # no ssh left behind
  if [ "$DELETE_ON_EXIT" = 1 ] && [ "$HAVE_SLICE" = 1 ]; then say "deleting $NAME"; teardown || true; fi
  # the lease, through the API's process only (gone: it names a dead pid of this host,
  # which a launch here takes over at once, and elsewhere after LEASE_S)
  [ -z "${LEASE:-}" ] || [ -z "$API_PID" ] || api lease-drop "$LEASE" $$ > /dev/null || true
  api_stop
  rm -f "$ASKED" "$ASK_ERR"
  # (this supervisor's entry, not one a later launch wrote after a kill -9 of this one)
  if [ -n "$SUPERVISOR" ] && [ "$(cut -f1 "$SUPERVISOR" 2>/dev/null)" = $$ ]; then rm -f "$SUPERVISOR"; fi
  [ "${#RELAYS[@]}" = 0 ] || end_relays
}
trap on_exit EXIT
# The slice READY and healthy: reused, attached to (its queued resource), or created
# (what follows a failed create is magic_jax/jobs/pod_errors.py's after_create: no
# capacity, code 13 and rate limits tried again with exponential backoff, up to
# CREATE_TRIES tries; ALREADY_EXISTS waited for; quota, credentials, a missing role and
# any other error end the launch with the API's message and the fix), then waited for: a
# new node --timeout [3600] s, a queued resource or one under maintenance or repair
# (READY with UNHEALTHY_* health, REPAIRING: hours, on every host) as long as it takes
# unless --timeout bounds it. magic_jax/jobs/pod_up.py does it (its lines on stderr, its
# state on stdout: HAVE_SLICE CREATED REQUESTED_AT IPS RUNTIME), deaf to Ctrl-C and
# SIGTERM (the exit trap ends it: UP_PID). $1: wait-ready (only wait for it).
UP_PID=""
slice_up() {
  local verb=${1:-up} out rc=0 have="" created="" bounded=0 timeout=$TIMEOUT
  out=$(tmpfile)
  [ -z "$TIMEOUT" ] && [ "$CREATED" = 0 ] || bounded=1
  [ "$verb" = wait-ready ] || HAVE_SLICE=1  # (a create in flight: --delete-on-exit deletes it)
  ( trap '' INT TERM; exec 3>&- > "$out"
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" exec "$API_PYTHON" -m magic_jax.jobs.pod_up \
      "$PROJECT_ID" "$ZONE" "$verb" name="$NAME" queued="$QUEUED" tries="$CREATE_TRIES" \
      wait="$CREATE_WAIT_S" max="$CREATE_MAX_S" timeout="$timeout" poll="$POLL_S" valid="$VALID" \
      valid-s="$VALID_S" delete-wait="$DELETE_WAIT_S" bounded="$bounded" "${SPEC[@]}" ) &
  UP_PID=$!
  wait "$UP_PID" || rc=$?
  UP_PID=""
  IFS=$'\t' read -r have created _ IPS RUNTIME < "$out" || true
  rm -f "$out"
  [ -z "$have" ] || HAVE_SLICE=$have
  [ "$verb" = wait-ready ] || [ -z "$created" ] || CREATED=$created
  [ "$IPS" != - ] || IPS=""; [ "$RUNTIME" != - ] || RUNTIME=""
  [ "$rc" = 0 ] || exit "$rc"  # (its last line said why)
}
# The slice READY (slice_up; a dry run prints its requests), its workers counted.
bring_up() {
  CREATED=0
  if [ "$DRY" = 1 ]; then
    if [ "$QUEUED" = 1 ]; then api request "$QR"; api request-create "$QR" "$NAME" "${SPEC[@]}"
    else api node "$NAME"; api create "$NAME" "${SPEC[@]}"; fi
    api node "$NAME"
    HAVE_SLICE=1 CREATED=1 IPS=10.0.0.1 RUNTIME=$VERSION
  else
    slice_up up
  fi
  IFS=';, ' read -r -a ips <<< "$IPS"
  WORKERS=${#ips[@]}
  say "$NAME: $WORKERS worker(s), runtime version ${RUNTIME:-unknown}"
}

# ------------------------------------------------------------------ install this commit
COMMIT=$(git -C "$REPO" rev-parse --short=12 HEAD)
[ -z "$(git -C "$REPO" status --porcelain --untracked-files=no)" ] ||
  say "warning: uncommitted changes are not installed (commit $COMMIT is)"
DIR="magic-jax/$COMMIT"
# Copies this commit to every worker and runs tpu_scripts/worker_setup.sh there (its
# lines pass through to stderr). On failure SETUP_ERR says which worker and why.
setup() {
  local archive out rc=0 knobs="" failed first n more="" ready w missing=() url fetch=""
  SETUP_ERR="setting up $NAME failed"
  archive=$(tmpfile) && out=$(tmpfile) || return 1
  git -C "$REPO" archive --format=tar.gz -o "$archive" HEAD || { rm -f "$archive" "$out"; return 1; }
  [ -z "${LAUNCH_PYTHON:-}" ] || knobs+="LAUNCH_PYTHON=$(printf %q "$LAUNCH_PYTHON") "
  [ -z "${LAUNCH_INSTALL:-}" ] || knobs+="LAUNCH_INSTALL=$(printf %q "$LAUNCH_INSTALL") "
  # The archive goes up once per commit: to the stage (the workers fetch it from there),
  # else to every worker by scp.
  if [ -n "$STAGE" ]; then
    url="$STAGE/archives/$COMMIT.tar.gz"
    fetch="gcloud storage cp $url magic-jax-$COMMIT.tar.gz >/dev/null &&"
    if ! ask gcloud storage ls "$url" >/dev/null && ! run gcloud storage cp "$archive" "$url" 2>"$out"; then
      SETUP_ERR="uploading commit $COMMIT to $url failed: $(error_line "$out")"
      rm -f "$archive" "$out"; return 1
    fi
  elif ! run "${TPU[@]}" scp "$archive" "$NAME:magic-jax-$COMMIT.tar.gz" "${WHERE[@]}" "${SSH_VIA[@]}" \
      --worker=all; then
    rm -f "$archive" "$out"
    SETUP_ERR="copying commit $COMMIT to $NAME failed"
    return 1
  fi
  rm -f "$archive"
  { ssh_on all "mkdir -p $DIR && { [ -e $DIR/.installed ] || { $fetch tar -xzf magic-jax-$COMMIT.tar.gz \
    -C $DIR; }; } && cd $DIR && ${knobs}bash tpu_scripts/worker_setup.sh $COMMIT" 2>&1 | tee "$out" >&2; } || rc=$?
  [ "$DRY" = 0 ] || { rm -f "$out"; return 0; }
  failed=$(grep -oE 'worker [^ :]+: set-up failed: .*' "$out" | sort -k2,2n || true)
  ready=$(grep -cE 'worker [^ :]+: ready' "$out" || true)
  if [ -n "$failed" ]; then
    first=$(head -n 1 <<< "$failed") n=$(wc -l <<< "$failed")
    [ "$n" -le 1 ] || more=" (and on $((n - 1)) more worker(s))"
    SETUP_ERR="set-up failed on ${first%%: set-up failed: *}: ${first#*: set-up failed: }$more"
  elif [ "$rc" != 0 ] || [ "$ready" -lt "$WORKERS" ]; then
    for ((w = 0; w < WORKERS; w++)); do grep -qE "worker $w: ready" "$out" || missing+=("$w"); done
    first=$(grep -v '^[[:space:]]*$' "$out" | tail -n 1 || true)
    SETUP_ERR="set-up failed on worker(s) ${missing[*]:-?} ($ready of $WORKERS ready):"
    SETUP_ERR+=" ${first:-gcloud exited with $rc}"
  else
    rm -f "$out"
    return 0
  fi
  rm -f "$out"
  return 1
}

# ------------------------------------------------------------------ run, stream, collect
RUN_ID="run-$(date -u +%Y%m%d-%H%M%S)"
LOGS_GIVEN=$LOGS LOGS=${LOGS:-$REPO/runs/launch/$NAME-$RUN_ID}
printf -v CMD '%q ' "$@"
L="" BEATS=""
EXPORTS=""  # --env and --compile-cache, quoted for the command's shell
if [ "${#ENVS[@]}" -gt 0 ]; then
  EXPORTS="export"
  for kv in "${ENVS[@]}"; do EXPORTS+=" ${kv%%=*}=$(printf %q "${kv#*=}")"; done
  EXPORTS+=" && "
fi
BODY="source .venv/bin/activate && ${EXPORTS}exec $CMD"  # each worker's $L.sh
RUN_DIR=$DIR  # where the running command's worker_run.sh is (an attached one's commit)
# Worker-side waits of the log stream: 5 s (0.2 s when LAUNCH_POLL_S is under 5, in tests).
TICK=5 FLUSH=2; [ "${POLL_S%.*}" -ge 5 ] || TICK=0.2 FLUSH=0.5
BEAT_S=${LAUNCH_HEARTBEAT_S:-10}  # each worker's heartbeat (with a stage)
ms() { date +%s%3N; }
to_ms() { awk -v s="$1" 'BEGIN { printf "%d", s * 1000 }'; }
POLL_MS=$(to_ms "$POLL_S") LOST_MS=$(to_ms "${LAUNCH_LOST_S:-20}") PROBE_MS=$(to_ms "${LAUNCH_PROBE_S:-15}")
# At a terminal, what the supervisor and its gcloud calls print passes through relays
# (tee, deaf to SIGHUP and Ctrl-C) that go on after the terminal is gone, when writing to
# it fails: the messages also into $LOGS/launch.log, worker 0's log to the terminal only.
# Never a write to a lost terminal, so no gcloud call fails on one. RELAYS: their pids.
relay_terminal() {
  [ "$DRY" = 0 ] || return 0
  exec < /dev/null  # no gcloud reads the terminal
  if [ -t 2 ]; then
    mkdir -p "$LOGS"
    SAID_TO=$LOGS/launch.log
    exec 2> >(trap '' INT TERM; exec tee -a "$SAID_TO" >&2); RELAYS+=("$!")
  fi
  if [ -t 1 ]; then exec > >(trap '' INT TERM; exec tee /dev/null); RELAYS+=("$!"); fi
}
# At the end: the relays drain what is left (for at most 5 s: an orphan may hold a pipe).
end_relays() {
  local i p
  [ "${#RELAYS[@]}" -gt 0 ] || return 0
  exec >&- 2>&-
  for ((i = 0; i < 50; i++)); do
    for p in "${RELAYS[@]}"; do kill -0 "$p" 2>/dev/null && break; p=""; done
    [ -n "$p" ] || return 0
    sleep 0.1
  done
}
# Attempt K's files on every worker: $L.sh (the command), .log, .pid, .boot and .exit;
# its heartbeats (with a stage) under $BEATS.
attempt_files() {
  L="\$HOME/magic-jax/logs/$RUN_ID-$attempt"
  BEATS=""; [ -z "$STAGE" ] || BEATS="$STAGE/beats/$NAME-$RUN_ID-$attempt"
}
# An earlier launch's command still running on this slice, its supervisor gone (killed,
# its machine down): with --attach, or for the same command, this launch supervises it
# to the end instead of starting another (its attempt counted in --retry; --attach
# without --retry keeps the budget of the launch that started it). Worker 0 names it in
# ~/magic-jax/logs/current: run id, attempt, commit, stage, --retry.
running_job() {
  local info id n c st r s body
  [ "$DRY" = 0 ] && [ "$CREATED" = 0 ] || return 1
  info=$(ask_worker 0 "read -r id n c s r < magic-jax/logs/current && L=\$HOME/magic-jax/logs/\$id-\$n \
&& echo \$id \$n \$c \$s \${r:--} \$(bash magic-jax/\$c/tpu_scripts/worker_run.sh --status \$L) \
&& cat \$L.sh" 2>/dev/null) || return 1
  read -r id n c st r _ s _ <<< "${info%%$'\n'*}"
  body=${info#*$'\n'}
  [ "${s:-}" = running ] && [[ ${n:-} =~ ^[0-9]+$ ]] || return 1
  [ "$ATTACH" = 1 ] || [ "$body" = "$BODY" ] || return 1
  RUN_ID=$id attempt=$n RUN_DIR=magic-jax/$c
  [ "$st" = - ] || STAGE=$st
  if [ "$RETRY_GIVEN" = 0 ] && [[ $r =~ ^[0-9]+$ ]]; then RETRY=$r ATTEMPTS=$((r + 1)); fi
  [ $# -gt 0 ] || BODY=$body  # --attach alone: a rerun runs the same command
  [ -n "$LOGS_GIVEN" ] || LOGS=$REPO/runs/launch/$NAME-$RUN_ID
  attempt_files
  say "attaching to the command running on $NAME since $RUN_ID (attempt $n of $ATTEMPTS," \
    "commit $c); its logs go to $LOGS"
}
# Every worker runs the command detached (an ssh drop does not kill it) under
# tpu_scripts/worker_run.sh, which records its boot id, its exit status (also when the
# host's shutdown signals it) and writes its heartbeat; only where this commit is set up
# and no earlier launch's command still runs (the TPU would be in use).
start() {
  RUN_DIR=$DIR
  ssh_on all "mkdir -p magic-jax/logs && cd $DIR && [ -e .installed ] || \
{ echo \"magic-jax $COMMIT is not set up in ~/$DIR\" >&2; exit 1; }
bash tpu_scripts/worker_run.sh --busy >&2 && exit 5
cat > $L.sh <<'LAUNCH_SH'
$BODY
LAUNCH_SH
echo '$RUN_ID $attempt $COMMIT ${STAGE:--} $RETRY' > \$HOME/magic-jax/logs/current
nohup bash tpu_scripts/worker_run.sh $L $BEATS $BEAT_S > $L.log 2>&1 < /dev/null & echo \$! > $L.pid"
}
# Worker W's command: its exit status, "running", "gone" (no status and no process) or
# "restarted" (gone, its host booted since); nothing when the worker does not answer.
status_of() {
  local id s b
  read -r id s b < <(ask_worker "$1" "bash $RUN_DIR/tpu_scripts/worker_run.sh --status $L" 2>/dev/null) ||
    true
  [ "${b:-}" != restarted ] || [ "$s" != gone ] || s=restarted
  echo "${s:-}" | tr -dc 'a-z0-9'
}
# Every worker's "N STATUS BOOT" (worker_run.sh --status) in one ssh, given PROBE_MS to
# answer (gcloud's own ssh retries a host that does not answer for minutes).
probe() {
  local f pid end
  f=$(tmpfile)
  ssh_on all "bash $RUN_DIR/tpu_scripts/worker_run.sh --status $L" > "$f" 2>/dev/null &
  pid=$! end=$(($(ms) + PROBE_MS))
  while kill -0 "$pid" 2>/dev/null && [ "$(ms)" -lt "$end" ]; do sleep 0.1; done
  kill_tree "$pid"; wait "$pid" 2>/dev/null
  cat "$f"; rm -f "$f"
}
# Stops the command on every worker: SIGTERM, then SIGKILL to what is left KILL_S later.
# Each worker still records its command's exit status.
bring_down() {
  say "stopping the command on every worker"
  ssh_on all "p=\$(cat $L.pid 2>/dev/null) || exit 0; pkill -TERM -P \$p; \
    for i in \$(seq $KILL_S); do pgrep -P \$p >/dev/null || exit 0; sleep 1; done; \
    pkill -KILL -P \$p; exit 0" || true
}
# One status cycle: one query of the node (its state and health) and one of every
# worker's heartbeat (or, with no stage, one ssh to all workers), whatever the number of
# hosts. Sets VERDICT: "" (all well, or waiting for a slice not ready), lost (LOST says
# why), failed (FAILED: a worker other than 0 ended with a failure, FAILED_STATUS) or
# restarted (RESTARTED: the workers whose host was restarted under the command).
# A worker is silent when its heartbeat (or answer) has not changed for LOST_MS. What
# that means is magic_jax/jobs/pod_decide.py's decision: on a READY and healthy node the
# silent workers are asked once (a host restarted is maintenance, one that does not
# answer is lost, a command gone from a live host is a failure); on a node that is not
# (READY with UNHEALTHY_* health, REPAIRING) nothing is asked or concluded: it is waited
# for. A cycle with nothing to decide (READY, HEALTHY, every worker running and heard)
# asks no Python.
cycle() {
  local node state health out w seq st boot t lines quiet=1 v action ws status alive why id re
  VERDICT="" BEATS_WHY=""
  node_info poll; stop_if_fatal
  state=$NODE health=$HEALTH node="$NODE $HEALTH"
  [ "$state" = READY ] && [ "${health:-HEALTHY}" = HEALTHY ] || quiet=0
  t=$(ms)
  if [ -z "$BEATS" ]; then out=$(probe)
  elif out=$(api beats "$BEATS"); then out=${out//$'\t'/$'\n'}  # (one a field)
  else out="" BEATS_WHY=$(asked_why); fi  # unreadable: BEATS_WHY says why, for the line below
  while read -r w seq st boot; do
    [[ ${w:-} =~ ^[0-9]+$ ]] && [ "$w" -lt "$WORKERS" ] || continue
    # a heartbeat is "N SEQ STATUS BOOT"; an answer "N STATUS BOOT", itself a sign of life
    [ -n "$BEATS" ] || { boot=$st st=$seq seq=$t; }
    if [ "${SEQ_OF[$w]:-}" != "$seq" ]; then SEQ_OF[w]=$seq; SEEN_AT[w]=$t; fi
    st=${st#exit-}
    [[ $st != [0-9]* ]] || ENDED[w]=1  # its last heartbeat: silent from now on
    ST_OF[w]=$st BOOT_OF[w]=${boot:-}
  done <<< "$out"
  for ((w = 0; w < WORKERS && quiet; w++)); do
    [ -n "${ENDED[$w]:-}" ] || [ $((t - ${SEEN_AT[$w]:-$t})) -lt "$LOST_MS" ] || quiet=0
    case ${ST_OF[$w]:-running} in running|0|130|143) ;; *) quiet=0 ;; esac
  done
  [ "$quiet" = 0 ] || return 0
  lines="node ${state:--} ${health:--} -"
  for ((w = 0; w < WORKERS; w++)); do
    secs $((t - ${SEEN_AT[$w]:-$t}))
    re=0; [ "${BOOT_OF[$w]:-}" != restarted ] || re=1
    lines+=$'\n'"worker $w ${ST_OF[$w]:-running} $SECS $re"
  done
  secs "$LOST_MS"
  v=$(pod decide "$SECS" <<< "$lines")
  if [ "${v%%$'\t'*}" = probe ]; then  # ask every worker once: what became of the silent ones?
    lines+=$'\nasked'
    while read -r id st boot; do
      [[ ${id:-} =~ ^[0-9]+$ ]] || continue
      re=0; [ "${boot:-}" != restarted ] || re=1
      lines+=$'\n'"answer $id $st $re"
    done < <(probe)
    v=$(pod decide "$SECS" <<< "$lines")
  fi
  IFS=$'\t' read -r action ws status alive why <<< "$v"
  case $action in
    wait) [ "$SAID" = "$node" ] || say "$NAME is $state${health:+ ($health)}: waiting for it"
      SAID=$node ;;
    recreate)
      VERDICT=lost
      if [ "$ws" = - ]; then slice_lost || LOST="$NAME is $state"; return; fi
      KIND="a host lost" GONE_HOSTS=" $ws"
      LOST="worker $ws stopped answering (no heartbeat for $(((t - ${SEEN_AT[$ws]}) / 1000))s, no"
      LOST+=" answer in $((PROBE_MS / 1000))s; $NAME is $state)" ;;
    rerun) RESTARTED=" $ws" VERDICT=restarted ;;
    stop) FAILED=$ws FAILED_STATUS=$status VERDICT=failed ;;
    carry-on)
      [ "$alive" != - ] || return 0
      for w in $alive; do SEEN_AT[w]=$t; done  # its heartbeat does not reach the bucket
      if [ -n "$BEATS_WHY" ]; then  # (said once)
        [ "$BEATS_WHY" = "$BEATS_SAID" ] ||
          say "worker(s) $alive answer, but their heartbeats in $BEATS cannot be read: $BEATS_WHY"
        BEATS_SAID=$BEATS_WHY
      else
        say "worker(s) $alive answer, but their heartbeats are $((LOST_MS / 1000))s" \
          "old or more: are they reaching $BEATS?"
      fi ;;
  esac
}
secs() { printf -v SECS '%d.%03d' $(($1 / 1000)) $(($1 % 1000)); }  # SECS: ms as seconds
# Runs a status cycle every POLL_S while the stream $1 runs (or, with no stream, until
# the time $2, in ms), until a cycle gives a verdict: a lost slice ends the stream, a
# failure stops the job first.
watch() {
  local spid=$1 until=${2:-} next tick=1 i
  VERDICT=""
  [ "$DRY" = 0 ] || return 0
  [ "$POLL_MS" -ge 1000 ] || tick=0.2
  next=$(($(ms) + POLL_MS))
  while :; do
    if [ -n "$spid" ]; then kill -0 "$spid" 2>/dev/null || return 0; fi
    if [ -n "$until" ] && [ "$(ms)" -ge "$until" ]; then return 0; fi
    sleep "$tick"
    [ "$(ms)" -ge "$next" ] || continue
    if [ -n "$spid" ]; then kill -0 "$spid" 2>/dev/null || return 0; fi
    cycle
    next=$(($(ms) + POLL_MS))
    case $VERDICT in
      lost|restarted) [ -z "$spid" ] || kill_tree "$spid"; return 0 ;;
      failed)
        local s=$FAILED_STATUS
        if [ "$s" = gone ]; then s="no exit status (its command is gone)" FAILED_STATUS=1; fi
        note "worker $FAILED ended with $s while worker 0's command still ran: the job failed"
        bring_down >/dev/null
        [ -n "$spid" ] || return 0
        for ((i = 0; i < KILL_S + 30; i++)); do kill -0 "$spid" 2>/dev/null || return 0; sleep 1; done
        kill_tree "$spid"; return 0 ;;
    esac
  done
}
# Waits S seconds between reconnects: status cycles meanwhile (a fake clock in tests).
pause() {
  if [ -n "${LAUNCH_CLOCK:-}" ]; then nap "$1"; else watch "" $(($(ms) + $1 * 1000)); fi
}
# Streams worker 0's log until its command ends, with status cycles meanwhile. 0: it
# ended; 1: the slice is lost (LOST says why); 2: another worker's command failed first
# (FAILED; the job is stopped); 4: maintenance restarted hosts under the command
# (RESTARTED). An ssh that fails on a slice that is not lost is retried, after
# SSH_WAIT_S, twice as long each time up to SSH_MAX_S, with no limit: the command goes on
# without us. Quits when worker 0's command vanished from a host that was not restarted.
await() {
  local from=+1 rc fails=0 wait=$SSH_WAIT_S t0 down="" stream w
  CREATED=0  # the slice was READY: a wait for it from now on is maintenance's, unbounded
  FAILED="" FAILED_STATUS="" RESTARTED="" SAID="" SEQ_OF=() SEEN_AT=() ENDED=() ST_OF=() BOOT_OF=()
  for ((w = 0; w < WORKERS; w++)); do SEEN_AT[w]=$(ms); done
  while :; do
    rc=0 t0=$(now)
    stream=("${TPU[@]}" ssh "$NAME" "${WHERE[@]}" "${SSH_VIA[@]}" --worker=0
      --ssh-flag=-oServerAliveInterval=30 --ssh-flag=-oServerAliveCountMax=6
      --command "tail -n $from -f $L.log & t=\$!; \
      while [ ! -e $L.exit ] && kill -0 \$(cat $L.pid) 2>/dev/null; do sleep $TICK; done; \
      sleep $FLUSH; kill \$t; [ -e $L.exit ] || exit 3")
    # not through run: $! is gcloud's own pid, so that kill_tree reaches its ssh
    if [ "$DRY" = 1 ]; then run "${stream[@]}" & else "${stream[@]}" & fi
    STREAM_PID=$!
    watch "$STREAM_PID"
    wait "$STREAM_PID" || rc=$?
    STREAM_PID=""
    case $VERDICT in lost) return 1 ;; failed) return 2 ;; restarted) return 4 ;; esac
    [ "$rc" = 0 ] && return 0
    slice_lost && return 1
    if [ "$rc" = 3 ]; then  # gone without an exit status: was its host restarted?
      slice_up wait-ready  # (a host under maintenance answers once READY and healthy)
      [ "$(status_of 0)" != restarted ] || { RESTARTED=" 0"; return 4; }
      quit 1 "worker 0's command ended without an exit status, its host not restarted" \
        "($NAME is $STATE): killed?"
    fi
    # a stream that was up for a while dropped: a new outage, not the same one
    if [ $(($(now) - t0)) -ge "$SSH_MAX_S" ]; then fails=0 wait=$SSH_WAIT_S down=""; fi
    fails=$((fails + 1)); [ -n "$down" ] || down=$(now)
    say "ssh to worker 0 failed ($rc; $NAME is ${STATE:-UNKNOWN}); reconnecting in $(span "$wait")" \
      "(failure $fails; unreachable for $(span $(($(now) - down))); the command goes on)"
    pause "$wait"
    case $VERDICT in lost) return 1 ;; failed) return 2 ;; restarted) return 4 ;; esac
    wait=$(twice "$wait" "$SSH_MAX_S") from=0
  done
}
# Sets CODE to the exit status of worker W's command once it ended (empty: none). A
# command still running is waited for until GRACE_S after worker 0's ended, then the job
# is stopped (STOPPED lists those workers). A worker that does not answer is asked again
# (worker 0 for as long as the slice is not lost; another one 3 times).
exit_of() {
  local w=$1 s tries=0 wait=$SSH_WAIT_S
  CODE=""
  while :; do
    s=$(ask_worker "$w" "cat $L.exit 2>/dev/null || echo none" 2>/dev/null | tr -dc 'a-z0-9') || s=""
    [ "$s" != none ] || s=$(status_of "$w")
    case $s in
      [0-9]*) CODE=$s; return 0 ;;
      gone) return 0 ;;
      running)
        if [ "$SECONDS" -ge "$DEADLINE" ]; then
          note "worker $w's command still ran ${GRACE_S}s after worker 0's ended: stopping it"
          STOPPED="$STOPPED $w"
          bring_down >/dev/null
          DEADLINE=$((SECONDS + KILL_S + 30))
        else
          sleep "$(( POLL_S < 5 ? 1 : 5 ))"
        fi ;;
      *)
        tries=$((tries + 1))
        if [ "$w" != 0 ] && [ "$tries" -ge 3 ]; then
          say "worker $w did not answer ($tries tries): its exit status is unknown"; return 0
        fi
        slice_lost && return 0
        say "ssh to worker $w failed ($NAME is ${STATE:-UNKNOWN}); asking again in $(span "$wait")"
        nap "$wait"; wait=$(twice "$wait" "$SSH_MAX_S") ;;
    esac
  done
}
log_suffix() { [ "$attempt" = 1 ] || echo ".attempt-$attempt"; }
# Copies every worker's log here (worker-N.log, worker-N.attempt-K.log on a retry), FANOUT
# at a time, each within ASK_S; a host known gone (GONE_HOSTS) is not asked, nor is any
# when worker 0 does not answer (a slice gone answers no ssh). A log that did not come so
# is the copy its worker kept in the stage (STAGE/logs/RUN/worker-N.log, written with its
# heartbeat and at its command's end: a preempted slice's too), read through the API's
# process. Sets FETCHED: how many came.
fetch_logs() {
  local w f suffix pids=() missing=()
  suffix=$(log_suffix) FETCHED=0
  mkdir -p "$LOGS"
  for ((w = 0; w < WORKERS; w++)); do
    case " $GONE_HOSTS " in *" $w "*) continue ;; esac
    if [ "$w" = 1 ] && [ ! -s "$LOGS/worker-0$suffix.log.part" ]; then
      case " $GONE_HOSTS " in *" 0 "*) ;; *) break ;; esac
    fi
    ask_worker "$w" "cat $L.log" > "$LOGS/worker-$w$suffix.log.part" 2>/dev/null &
    pids+=("$!")
    [ "$w" != 0 ] || { wait "$!" || true; pids=(); }
    if [ "${#pids[@]}" -ge "$FANOUT" ]; then wait "${pids[0]}" || true; pids=("${pids[@]:1}"); fi
  done
  [ "${#pids[@]}" = 0 ] || wait "${pids[@]}" || true
  for ((w = 0; w < WORKERS; w++)); do
    f=$LOGS/worker-$w$suffix.log
    if [ -s "$f.part" ]; then mv "$f.part" "$f"; else rm -f "$f.part"; fi
    [ -s "$f" ] || missing+=("$w")
  done
  if [ -n "$BEATS" ] && [ "${#missing[@]}" -gt 0 ] &&
     ! api logs "${BEATS%/beats/*}/logs/${BEATS##*/}" "$LOGS" "$suffix" "${missing[@]}" > /dev/null; then
    say "the logs kept in the stage cannot be read: $(asked_why)"
  fi
  for ((w = 0; w < WORKERS; w++)); do [ ! -s "$LOGS/worker-$w$suffix.log" ] || FETCHED=$((FETCHED + 1)); done
}
# Collects every worker's exit status, then every log. Sets STATUS to worker 0's; 1 when
# the slice is lost (LOST says why).
collect() {
  local w code codes=()
  if [ "$DRY" = 1 ]; then
    for ((w = 0; w < WORKERS; w++)); do ssh_on "$w" "cat $L.log"; done
    return 0
  fi
  STATUS=0 STOPPED="" DEADLINE=$((SECONDS + GRACE_S))
  for ((w = 0; w < WORKERS; w++)); do
    exit_of "$w"; codes[w]=$CODE  # first: a log is whole once its command ended
    if [ -z "$CODE" ] && [ "$w" = 0 ] && slice_lost; then return 1; fi
  done
  fetch_logs
  for ((w = 0; w < WORKERS; w++)); do
    code=${codes[$w]:-1}
    [ "$w" != 0 ] || STATUS=$code
    [ "$code" = 0 ] || say "worker $w exited with $code (log: $LOGS/worker-$w$(log_suffix).log)"
  done
  say "logs of $WORKERS worker(s) in $LOGS"
}
# Collects the log of every worker that still answers (a preemption, an interrupt).
salvage_logs() {
  [ "$DRY" = 0 ] || return 0
  fetch_logs
  say "logs of $FETCHED of $WORKERS worker(s) in $LOGS${LOST:+ ($LOST)}"
}

# Ctrl-C or SIGTERM (code 130 or 143). While the command runs: with --delete-on-exit,
# stop it on every worker (the run checkpoints on SIGTERM), collect the logs, then the
# exit trap deletes the slice; without it, leave the command running, detached. A second
# one exits at once (and the exit trap deletes).
RUNNING=0 STREAM_PID="" attempt=1 GONE_HOSTS="" BEATS_SAID=""
on_signal() {
  trap 'note "interrupted again: exiting now"; exit '"$1" INT TERM
  [ -z "$STREAM_PID" ] || kill_tree "$STREAM_PID"
  if [ "$RUNNING" = 1 ] && [ "$DRY" = 0 ]; then
    if [ "$DELETE_ON_EXIT" = 1 ]; then
      note "interrupted: stopping the command on every worker, collecting the logs, then" \
        "deleting $NAME (interrupt again to delete it at once)"
      bring_down >/dev/null 2>&1 || true
      salvage_logs || true
    else
      note "interrupted: the command goes on running on $NAME, detached (tpu_scripts/launch.sh" \
        "--name $NAME --zone $ZONE --delete stops it with the slice)"
    fi
  fi
  exit "$1"
}
# One supervisor per slice on this machine (runs/launch/.NAME.supervisor: its pid and its
# launch.log): a second launch for NAME (the same command, --attach) while it lives says
# so instead of racing it (both would stop, rerun and recreate). One killed (kill -9, its
# machine restarted) is no obstacle: its pid is gone.
alone() {
  local pid said
  [ "$DRY" = 0 ] || return 0
  if read -r pid said < <(supervisor); then
    quit 1 "a supervisor of $NAME runs on this machine already (pid $pid${said:+; its messages" \
      "in $said}): let it be, or stop it with \`kill -KILL $pid\` (the run goes on) and run" \
      "this again to take it over"
  fi
}
# One supervisor per slice across machines too (with a stage): a lease object,
# STAGE/supervisors/ZONE/NAME (jobs/pod_lease.py: the owner's host and pid), taken here
# and renewed by the API's process every status cycle (at least 1 s) whatever this
# supervisor does, dropped at its end. Held by a live supervisor elsewhere, it stops this
# launch naming it; unrenewed for LEASE_S (LAUNCH_LEASE_CYCLES [6] cycles, at least
# 60 s: its supervisor killed, its machine down) or its owner a process of this machine
# that is gone, it is taken over (the same command, or --attach, then attaches). Taken
# over by another meanwhile (SIGUSR1 from the API's process), this one stops and leaves
# the run and the slice to it. A stage that cannot be written is said once; no lease.
LEASE="" LEASE_EVERY=$(awk -v s="$POLL_S" 'BEGIN { printf "%d", s < 1 ? 1 : s }')
LEASE_S=$((LEASE_EVERY * ${LAUNCH_LEASE_CYCLES:-6})); [ "$LEASE_S" -ge 60 ] || LEASE_S=60
lease_take() {
  local a held owner age stale uri
  [ "$DRY" = 0 ] && [ -n "$STAGE" ] || return 0
  uri="$STAGE/supervisors/$ZONE/$NAME"
  if ! a=$(api lease-take "$uri" $$ "$LEASE_S" "$LEASE_EVERY" "$API_DIR/lease-lost"); then
    say "no supervisor lease in $uri ($(asked_why)): a launch on another machine is not kept out"
    return 0
  fi
  IFS=$'\t' read -r held owner age stale <<< "$a"
  if [ "$held" = held ]; then
    DELETE_ON_EXIT=0  # (the slice is the other supervisor's)
    quit 1 "a supervisor of $NAME runs on $owner (its lease $uri renewed ${age}s ago): let it" \
      "be, or stop it there; once its lease is stale (${stale}s unrenewed) this command or" \
      "--attach $NAME takes the run over"
  fi
  LEASE=$uri
}
lease_lost() {
  LEASE="" DELETE_ON_EXIT=0
  quit 1 "the supervision of $NAME was taken over by $(cat "$API_DIR/lease-lost" 2>/dev/null ||
    echo another supervisor) (this one's lease went stale): this supervisor stops, leaving" \
    "the run and the slice to it"
}
trap 'on_signal 130' INT  # also when gcloud catches the Ctrl-C itself
trap 'on_signal 143' TERM
trap lease_lost USR1
alone
relay_terminal
if [ "$DRY" = 0 ]; then
  SUPERVISOR=$ENTRY
  mkdir -p "${SUPERVISOR%/*}"; printf '%s\t%s\n' $$ "$SAID_TO" > "$SUPERVISOR"
fi
api_start
lease_take
ATTEMPTS=$((RETRY + 1))
while :; do
  bring_up
  attempt_files
  LOST="" STATUS=0 FAILED="" FAILED_STATUS="" STOPPED="" RESTARTED="" KIND=preempted GONE_HOSTS=""
  ATTACHED=0
  if [ "$attempt" = 1 ] && running_job "$@"; then ATTACHED=1 RUNNING=1
    [ -n "$LEASE" ] || lease_take  # (the stage it names: --attach alone knows none before)
  elif [ "$SETUP" = 1 ] || [ "$attempt" -gt 1 ]; then
    setup || slice_lost || quit 1 "$SETUP_ERR"
  fi
  if [ -z "$LOST" ] && [ "$ATTACHED" = 0 ]; then
    RUNNING=1
    started=$(tmpfile)
    if ! { start 2>&1 | tee "$started" >&2; } && ! slice_lost; then
      RUNNING=0
      if grep -q "the TPU is in use" "$started"; then
        quit 1 "an earlier launch's command still runs on $NAME, so the TPU is in use: wait for it," \
          "supervise it (--attach $NAME), or stop it (--delete stops it with the slice)"
      fi
      bring_down >/dev/null 2>&1 || true  # where it did start
      quit 1 "starting the command on $NAME failed"
    fi
    rm -f "$started"
  fi
  if [ -z "$LOST" ]; then
    ctl="detaches (the command goes on)"; [ "$DELETE_ON_EXIT" = 0 ] || ctl="stops it and deletes $NAME"
    kept=""; [ -z "$SAID_TO" ] || kept=", its messages in $SAID_TO"
    say "running on $WORKERS worker(s) of $NAME; worker 0's log follows (closing the" \
      "terminal leaves this supervisor running$kept; Ctrl-C $ctl)"
    rc=0; await || rc=$?
    if [ "$rc" = 1 ]; then salvage_logs
    elif [ "$rc" = 4 ]; then bring_down >/dev/null 2>&1; salvage_logs
    else collect || salvage_logs; fi
  fi
  RUNNING=0
  # What follows is magic_jax/jobs/pod_decide.py's after_attempt: maintenance and a
  # status that restarts (restarts.py, GKE's list) rerun on this slice, a failure
  # elsewhere stops, a lost slice (or 143) is recreated, each while a retry is left.
  # Worker 0's 0 with nothing else to tell asks no Python.
  if [ "$STATUS" = 0 ] && [ -z "$RESTARTED$FAILED$STOPPED$LOST" ]; then break; fi
  IFS=$'\t' read -r next code line < <(pod attempt <<OUTCOME
status $STATUS
restarted $RESTARTED
failed $FAILED $FAILED_STATUS
stopped $STOPPED
lost $LOST
kind $KIND
budget $attempt $RETRY
name $NAME
logs $LOGS
grace $GRACE_S
OUTCOME
  )
  case $next in
    rerun) note "$line"; attempt=$((attempt + 1)) ;;  # on the same slice, once READY
    recreate)
      STATUS=$code
      note "$line"
      teardown || say "deleting $NAME failed; creating it anyway"
      HAVE_SLICE=0 attempt=$((attempt + 1)) ;;
    *) STATUS=$code; [ -z "$line" ] || quit "$code" "$line"; break ;;
  esac
done
if [ "$attempt" -gt 1 ]; then
  if [ "$STATUS" = 0 ]; then note "resumed run finished"; else note "resumed run exited with $STATUS"; fi
fi
exit "$STATUS"
