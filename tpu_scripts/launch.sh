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
#   --queued            request the slice as a queued resource (NAME-qr) and wait for it
#   --retry N           when the slice is preempted, delete it, recreate it (re-request
#                       it with --queued), set it up and rerun the command, up to N
#                       times; the run resumes from its output_dir [0]
#   --no-setup          the workers already have this commit installed
#   --logs DIR          where every worker's log is collected [runs/launch/NAME-run-TIME]
#   --delete-on-exit    delete the slice when the command ends (also on failure or Ctrl-C)
#   --delete            delete the slice (and its queued resource) and exit
#   --timeout S         seconds to wait for the slice to be ready [3600]
#   --dry-run           print every gcloud command instead of running it (or DRY_RUN=1)
#
# The command runs in ~/magic-jax/<commit> inside its venv on every worker; magic_jax
# starts jax.distributed itself on a multi-host slice. The exit status is worker 0's,
# unless another worker's command ends with a failure while worker 0's still runs (any
# status but 0, 130 or 143, or gone without one): then every worker's command is
# stopped (SIGTERM, SIGKILL $LAUNCH_KILL_S [30] s later) and the status is that worker's
# (1 when it left none). Commands still running $LAUNCH_GRACE_S [120] s after worker 0's
# ended are stopped too (status 1 if worker 0's was 0).
# A preemption is worker 0 exiting with 143 (stopped at a checkpoint on SIGTERM or a
# preemption notice) or the slice lost while the command runs (PREEMPTED, TERMINATED,
# gone; a queued resource SUSPENDED or FAILED); with no retries left the status is 143.
# --retry and --delete-on-exit need the command's output_dir (--set output_dir=..., or
# the top-level output_dir: of its YAML config) on gs://: the slice's disks go with it.
set -euo pipefail

quit() { local code=$1; shift; echo "launch.sh: $*" >&2; exit "$code"; }
die() { quit 2 "$@"; }
usage() { sed -n '2,39p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

NAME=magic-jax ZONE=us-east5-a PROJECT=() ACCEL=v5p-64 VERSION="" SPOT=() QUEUED=0
SETUP=1 LOGS="" DELETE_ON_EXIT=0 DELETE_ONLY=0 TIMEOUT=3600 DRY="${DRY_RUN:-0}" RETRY=0
POLL_S="${LAUNCH_POLL_S:-30}" SSH_TRIES="${LAUNCH_SSH_TRIES:-10}"
GRACE_S="${LAUNCH_GRACE_S:-120}" KILL_S="${LAUNCH_KILL_S:-30}"
need() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"; }
while [ $# -gt 0 ]; do
  case $1 in
    --name) need "$@"; NAME=$2; shift 2 ;;
    --zone) need "$@"; ZONE=$2; shift 2 ;;
    --project) need "$@"; PROJECT=(--project "$2"); shift 2 ;;
    --accelerator) need "$@"; ACCEL=$2; shift 2 ;;
    --version) need "$@"; VERSION=$2; shift 2 ;;
    --spot) SPOT=(--spot); shift ;;
    --queued) QUEUED=1; shift ;;
    --retry) need "$@"; RETRY=$2; shift 2 ;;
    --no-setup) SETUP=0; shift ;;
    --logs) need "$@"; LOGS=$2; shift 2 ;;
    --delete-on-exit) DELETE_ON_EXIT=1; shift ;;
    --delete) DELETE_ONLY=1; shift ;;
    --timeout) need "$@"; TIMEOUT=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[ "$DELETE_ONLY" = 1 ] || [ $# -gt 0 ] || die "no command after -- (or --delete to tear down)"
[[ $TIMEOUT =~ ^[0-9]+$ ]] || die "--timeout must be a number of seconds, got $TIMEOUT"
[[ $RETRY =~ ^[0-9]+$ ]] || die "--retry must be a number of retries, got $RETRY"
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
if [ "$DELETE_ONLY" = 0 ] && { [ "$DELETE_ON_EXIT" = 1 ] || [ "$RETRY" -gt 0 ]; }; then
  opt=--delete-on-exit why="the slice's disks are deleted with it"
  [ "$DELETE_ON_EXIT" = 1 ] || opt=--retry why="a recreated slice starts with empty disks"
  out=$(output_dir "$@")
  [ -n "$out" ] || die "$opt needs output_dir on gs:// ($why); the command has none" \
    "(pass --set output_dir=gs://BUCKET/RUN)"
  [[ $out == gs://?* ]] || die "$opt needs output_dir on gs:// ($why); the command's output_dir is $out"
fi
[ "$DRY" = 1 ] || command -v gcloud >/dev/null || die "gcloud not found on PATH (install the Google Cloud CLI)"

QR="$NAME-qr"
WHERE=(--zone "$ZONE" "${PROJECT[@]}")
TPU=(gcloud compute tpus tpu-vm)
QRS=(gcloud compute tpus queued-resources)
say() { echo "[launch] $*" >&2; }
note() { echo "launch.sh: $*" >&2; }
exec 3>&1  # a dry run prints to the real stdout, also from inside $(...)
run() { if [ "$DRY" = 1 ]; then printf '%q ' "$@" >&3; echo >&3; else "$@"; fi; }
# A query: in a dry run it is printed and answers nothing.
ask() { if [ "$DRY" = 1 ]; then run "$@"; return 1; else "$@" 2>/dev/null; fi; }
ssh_on() { local w=$1; shift; run "${TPU[@]}" ssh "$NAME" "${WHERE[@]}" --worker="$w" --command "$*"; }

teardown() {
  if [ "$QUEUED" = 1 ] || ask "${QRS[@]}" describe "$QR" "${WHERE[@]}" --format='value(name)' >/dev/null; then
    run "${QRS[@]}" delete "$QR" "${WHERE[@]}" --force --quiet
  else
    run "${TPU[@]}" delete "$NAME" "${WHERE[@]}" --quiet
  fi
}

if [ "$DELETE_ONLY" = 1 ]; then
  teardown
  exit 0
fi

# A described state, or GONE when gcloud says NOT_FOUND (UNKNOWN on any other failure).
state_of() {
  local out err
  err=$(mktemp "${TMPDIR:-/tmp}/launch-XXXXXX")
  if out=$("$@" 2>"$err"); then echo "${out:-UNKNOWN}"
  elif grep -q NOT_FOUND "$err"; then echo GONE
  else echo UNKNOWN; fi
  rm -f "$err"
}
# Whether the slice is lost: preempted, terminated or gone, or its queued resource
# suspended or failed. Sets LOST to why, or STATE to the node's state. A dry run: never.
slice_lost() {
  local s
  LOST="" STATE=""
  [ "$DRY" = 1 ] && return 1
  if [ "$QUEUED" = 1 ]; then
    s=$(state_of "${QRS[@]}" describe "$QR" "${WHERE[@]}" --format='value(state.state)')
    case $s in SUSPENDING|SUSPENDED|FAILED|GONE) LOST="queued resource $QR is $s"; return 0 ;; esac
  fi
  s=$(state_of "${TPU[@]}" describe "$NAME" "${WHERE[@]}" --format='value(state)')
  case $s in PREEMPTED|TERMINATED|GONE) LOST="$NAME is $s"; return 0 ;; esac
  STATE=$s; return 1
}

# ------------------------------------------------------------------ create or reuse, wait
TRAPPED=0
bring_up() {
  local state s deadline
  state=$(ask "${TPU[@]}" describe "$NAME" "${WHERE[@]}" --format='value(state)') || state=""
  case $state in
    PREEMPTED|TERMINATED) say "$NAME is $state; deleting it"; teardown; state="" ;;
  esac
  if [ -n "$state" ]; then
    say "reusing $NAME ($state)"
  elif [ "$QUEUED" = 1 ]; then
    run "${QRS[@]}" create "$QR" "${WHERE[@]}" --node-id="$NAME" --accelerator-type="$ACCEL" \
      --runtime-version="$VERSION" "${SPOT[@]}"
  else
    run "${TPU[@]}" create "$NAME" "${WHERE[@]}" --accelerator-type="$ACCEL" --version="$VERSION" \
      "${SPOT[@]}"
  fi
  if [ "$DELETE_ON_EXIT" = 1 ] && [ "$TRAPPED" = 0 ]; then
    trap 'say "deleting $NAME"; teardown || true' EXIT
    TRAPPED=1
  fi
  deadline=$(( $(date +%s) + TIMEOUT ))
  if [ "$QUEUED" = 1 ]; then
    until s=$(ask "${QRS[@]}" describe "$QR" "${WHERE[@]}" --format='value(state.state)') && [ "$s" = ACTIVE ]; do
      [ "$DRY" = 1 ] && break
      case ${s:-} in FAILED|SUSPENDED) die "queued resource $QR is $s" ;; esac
      [ "$(date +%s)" -lt "$deadline" ] || die "queued resource $QR not ACTIVE after ${TIMEOUT}s (${s:-unknown})"
      say "queued resource $QR: ${s:-unknown}"; sleep "$POLL_S"
    done
  fi
  until s=$(ask "${TPU[@]}" describe "$NAME" "${WHERE[@]}" --format='value(state)') && [ "$s" = READY ]; do
    [ "$DRY" = 1 ] && break
    [ "$(date +%s)" -lt "$deadline" ] || die "$NAME not READY after ${TIMEOUT}s (${s:-unknown})"
    say "$NAME: ${s:-not yet}"; sleep "$POLL_S"
  done
  endpoints=$(ask "${TPU[@]}" describe "$NAME" "${WHERE[@]}" --format='value(networkEndpoints[].ipAddress)') || endpoints="10.0.0.1"
  IFS=';, ' read -r -a ips <<< "$endpoints"
  WORKERS=${#ips[@]}
}

# ------------------------------------------------------------------ install this commit
COMMIT=$(git -C "$REPO" rev-parse --short=12 HEAD)
[ -z "$(git -C "$REPO" status --porcelain --untracked-files=no)" ] ||
  say "warning: uncommitted changes are not installed (commit $COMMIT is)"
DIR="magic-jax/$COMMIT"
setup() {
  local archive
  archive=$(mktemp "${TMPDIR:-/tmp}/magic-jax-XXXXXX.tar.gz") || return
  git -C "$REPO" archive --format=tar.gz -o "$archive" HEAD &&
    run "${TPU[@]}" scp "$archive" "$NAME:magic-jax-$COMMIT.tar.gz" "${WHERE[@]}" --worker=all &&
    ssh_on all "set -e; mkdir -p $DIR && tar -xzf magic-jax-$COMMIT.tar.gz -C $DIR && cd $DIR && \
      python3 -m venv .venv && .venv/bin/pip install -q -U pip && \
      .venv/bin/pip install -q -c constraints.txt -e '.[tpu]'"
  local rc=$?
  rm -f "$archive"
  return "$rc"
}

# ------------------------------------------------------------------ run, stream, collect
RUN_ID="run-$(date -u +%Y%m%d-%H%M%S)"
LOGS=${LOGS:-$REPO/runs/launch/$NAME-$RUN_ID}
printf -v CMD '%q ' "$@"
L="\$HOME/magic-jax/logs/$RUN_ID"  # each worker's log, .pid and .exit
# Every worker runs the command detached (an ssh drop does not kill it), writing its log,
# its pid and then its exit status under ~/magic-jax/logs.
start() {
  ssh_on all "mkdir -p magic-jax/logs && cd $DIR || exit 1; nohup bash -c 'source .venv/bin/activate && \
    $CMD; echo \$? > $L.exit' > $L.log 2>&1 < /dev/null & echo \$! > $L.pid"
}
# Worker W's command: its exit status, "running", or "gone" (no status and no process);
# nothing when the worker does not answer.
status_of() {
  ssh_on "$1" "if [ -e $L.exit ]; then cat $L.exit; elif kill -0 \$(cat $L.pid 2>/dev/null) \
    2>/dev/null; then echo running; else echo gone; fi" 2>/dev/null | tr -dc 'a-z0-9' || true
}
# Stops the command on every worker: SIGTERM, then SIGKILL to what is left KILL_S later.
# Each worker still records its command's exit status.
bring_down() {
  say "stopping the command on every worker"
  ssh_on all "p=\$(cat $L.pid 2>/dev/null) || exit 0; pkill -TERM -P \$p; \
    for i in \$(seq $KILL_S); do pgrep -P \$p >/dev/null || exit 0; sleep 1; done; \
    pkill -KILL -P \$p; exit 0" || true
}
# Follows worker 0's log (the ssh in the background, pid $1) and asks the other workers
# how their command is every POLL_S; one that ended with a failure while worker 0's runs
# brings the job down: FAILED says which worker, FAILED_STATUS its status. 130 and 143
# are stops that every process of a run agrees on: worker 0 stops as well.
watch_workers() {
  local spid=$1 w s next=$((SECONDS + POLL_S)) tick=1
  [ "$POLL_S" -ge 1 ] || tick=0.2
  [ "$DRY" = 0 ] && [ "$WORKERS" -gt 1 ] || return 0
  while kill -0 "$spid" 2>/dev/null; do
    sleep "$tick"
    [ "$SECONDS" -ge "$next" ] && kill -0 "$spid" 2>/dev/null || continue
    next=$((SECONDS + POLL_S))
    for ((w = 1; w < WORKERS; w++)); do
      s=$(status_of "$w")
      case $s in ""|running|0|130|143) continue ;; esac
      FAILED=$w FAILED_STATUS=$s
      [ "$s" != gone ] || FAILED_STATUS=1
      if [ "$s" = gone ]; then s="no exit status (its command is gone)"; fi
      note "worker $w ended with $s while worker 0's command still ran: the job failed"
      bring_down >/dev/null
      for ((w = 0; w < KILL_S + 30; w++)); do kill -0 "$spid" 2>/dev/null || return 0; sleep 1; done
      kill "$spid" 2>/dev/null || true
      return 0
    done
  done
}
# Streams worker 0's log until its command ends. 0: it ended; 1: the slice is lost (LOST
# says why); 2: another worker's command failed first (FAILED; the job is stopped).
# Quits when worker 0 stays unreachable (or its command vanished) on a live slice.
await() {
  local from=+1 tries=0 rc spid
  FAILED="" FAILED_STATUS=""
  while :; do
    rc=0
    run "${TPU[@]}" ssh "$NAME" "${WHERE[@]}" --worker=0 --ssh-flag=-oServerAliveInterval=30 \
      --ssh-flag=-oServerAliveCountMax=6 --command "tail -n $from -f $L.log & t=\$!; \
      while [ ! -e $L.exit ] && kill -0 \$(cat $L.pid) 2>/dev/null; do sleep 5; done; \
      sleep 2; kill \$t; [ -e $L.exit ] || exit 3" &
    spid=$!
    watch_workers "$spid"
    wait "$spid" || rc=$?
    [ -z "$FAILED" ] || return 2
    [ "$rc" = 0 ] && return 0
    slice_lost && return 1
    [ "$rc" != 3 ] || quit 1 "worker 0's command ended without an exit status ($NAME is $STATE)"
    tries=$((tries + 1))
    [ "$tries" -lt "$SSH_TRIES" ] || quit 1 "lost worker 0 of $NAME: ssh failed $tries times ($NAME is $STATE)"
    say "ssh to worker 0 failed ($rc; $NAME is $STATE); reconnecting"
    sleep "$POLL_S"; from=0
  done
}
# Sets CODE to the exit status of worker W's command once it ended (empty: none). A
# command still running is waited for until GRACE_S after worker 0's ended, then the job
# is stopped (STOPPED lists those workers).
exit_of() {
  local w=$1 s
  CODE=$(ssh_on "$w" "cat magic-jax/logs/$RUN_ID.exit" 2>/dev/null | tr -dc 0-9) || CODE=""
  while [ -z "$CODE" ] && s=$(status_of "$w") && [ "$s" = running ]; do
    if [ "$SECONDS" -ge "$DEADLINE" ]; then
      note "worker $w's command still ran ${GRACE_S}s after worker 0's ended: stopping it"
      STOPPED="$STOPPED $w"
      bring_down >/dev/null
      DEADLINE=$((SECONDS + KILL_S + 30))
    else
      sleep "$(( POLL_S < 5 ? 1 : 5 ))"
    fi
    CODE=$(ssh_on "$w" "cat magic-jax/logs/$RUN_ID.exit" 2>/dev/null | tr -dc 0-9) || CODE=""
  done
}
# Collects every worker's log (worker-N.log, worker-N.attempt-K.log on a retry) and exit
# status. Sets STATUS to worker 0's; 1 when the slice is lost (LOST says why).
collect() {
  local w code suffix=""
  [ "$attempt" = 1 ] || suffix=".attempt-$attempt"
  [ "$DRY" = 1 ] || mkdir -p "$LOGS"
  STATUS=0 STOPPED="" DEADLINE=$((SECONDS + GRACE_S))
  for ((w = 0; w < WORKERS; w++)); do
    if [ "$DRY" = 1 ]; then
      ssh_on "$w" "cat magic-jax/logs/$RUN_ID.log"
      continue
    fi
    exit_of "$w"; code=$CODE  # first: the log is whole once the command ended
    ssh_on "$w" "cat magic-jax/logs/$RUN_ID.log" > "$LOGS/worker-$w$suffix.log" || true
    if [ -z "$code" ] && [ "$w" = 0 ] && slice_lost; then return 1; fi
    [ -n "$code" ] || code=1
    [ "$w" != 0 ] || STATUS=$code
    [ "$code" = 0 ] || say "worker $w exited with $code (log: $LOGS/worker-$w$suffix.log)"
  done
  [ "$DRY" = 1 ] || say "logs of $WORKERS worker(s) in $LOGS"
}

trap 'exit 130' INT  # also when gcloud catches the Ctrl-C itself
trap 'exit 143' TERM
attempt=1 ATTEMPTS=$((RETRY + 1))
while :; do
  bring_up
  LOST="" STATUS=0 FAILED="" FAILED_STATUS="" STOPPED=""
  if [ "$SETUP" = 1 ] || [ "$attempt" -gt 1 ]; then
    setup || slice_lost || quit 1 "setting up $NAME failed"
  fi
  if [ -z "$LOST" ]; then
    start || slice_lost || quit 1 "starting the command on $NAME failed"
  fi
  if [ -z "$LOST" ]; then
    say "running on $WORKERS worker(s) of $NAME; worker 0's log follows"
    rc=0; await || rc=$?
    [ "$rc" = 1 ] || collect || true
  fi
  if [ -n "$FAILED" ]; then  # a failure, not a preemption: no retry
    quit "$FAILED_STATUS" "worker $FAILED failed (exit $FAILED_STATUS) while worker 0 still" \
      "ran; the command was stopped on every worker (logs: $LOGS)"
  fi
  if [ -n "$STOPPED" ] && [ "$STATUS" = 0 ]; then
    quit 1 "worker(s)$STOPPED still ran ${GRACE_S}s after worker 0 ended; stopped (logs: $LOGS)"
  fi
  if [ -z "$LOST" ] && [ "$STATUS" = 143 ]; then LOST="worker 0 stopped with 143"; fi
  [ -n "$LOST" ] || break
  STATUS=143
  if [ "$attempt" -ge "$ATTEMPTS" ]; then
    quit 143 "preempted ($LOST; attempt $attempt of $ATTEMPTS); no retries left (--retry $RETRY), exiting with 143"
  fi
  note "preempted ($LOST; attempt $attempt of $ATTEMPTS); recreating the slice"
  teardown || say "deleting $NAME failed; creating it anyway"
  attempt=$((attempt + 1))
done
if [ "$attempt" -gt 1 ]; then
  if [ "$STATUS" = 0 ]; then note "resumed run finished"; else note "resumed run exited with $STATUS"; fi
fi
exit "$STATUS"
