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
#   --no-setup          the workers already have this commit installed
#   --logs DIR          where every worker's log is collected [runs/launch/NAME-run-TIME]
#   --delete-on-exit    delete the slice when the command ends (also on failure or Ctrl-C)
#   --delete            delete the slice (and its queued resource) and exit
#   --timeout S         seconds to wait for the slice to be ready [3600]
#   --dry-run           print every gcloud command instead of running it (or DRY_RUN=1)
#
# The command runs in ~/magic-jax/<commit> inside its venv on every worker; magic_jax
# starts jax.distributed itself on a multi-host slice. The exit status is worker 0's.
set -euo pipefail

die() { echo "launch.sh: $*" >&2; exit 2; }
usage() { sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

NAME=magic-jax ZONE=us-east5-a PROJECT=() ACCEL=v5p-64 VERSION="" SPOT=() QUEUED=0
SETUP=1 LOGS="" DELETE_ON_EXIT=0 DELETE_ONLY=0 TIMEOUT=3600 DRY="${DRY_RUN:-0}"
POLL_S="${LAUNCH_POLL_S:-30}"
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
if [ -z "$VERSION" ]; then
  case $ACCEL in
    v4-*) VERSION=tpu-ubuntu2204-base ;;
    v5litepod-*|v5e-*) VERSION=v2-alpha-tpuv5-lite ;;
    v5p-*) VERSION=v2-alpha-tpuv5 ;;
    v6e-*) VERSION=v2-alpha-tpuv6e ;;
    *) die "no default runtime version for accelerator $ACCEL: pass --version" ;;
  esac
fi
[ "$DRY" = 1 ] || command -v gcloud >/dev/null || die "gcloud not found on PATH (install the Google Cloud CLI)"

REPO=$(cd "$(dirname "$0")/.." && pwd)
QR="$NAME-qr"
WHERE=(--zone "$ZONE" "${PROJECT[@]}")
TPU=(gcloud compute tpus tpu-vm)
QRS=(gcloud compute tpus queued-resources)
say() { echo "[launch] $*" >&2; }
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

# ------------------------------------------------------------------ create or reuse
state=$(ask "${TPU[@]}" describe "$NAME" "${WHERE[@]}" --format='value(state)') || state=""
if [ -n "$state" ]; then
  say "reusing $NAME ($state)"
elif [ "$QUEUED" = 1 ]; then
  run "${QRS[@]}" create "$QR" "${WHERE[@]}" --node-id="$NAME" --accelerator-type="$ACCEL" \
    --runtime-version="$VERSION" "${SPOT[@]}"
else
  run "${TPU[@]}" create "$NAME" "${WHERE[@]}" --accelerator-type="$ACCEL" --version="$VERSION" \
    "${SPOT[@]}"
fi
[ "$DELETE_ON_EXIT" = 1 ] && trap 'say "deleting $NAME"; teardown' EXIT

# ------------------------------------------------------------------ wait until ready
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

# ------------------------------------------------------------------ install this commit
COMMIT=$(git -C "$REPO" rev-parse --short=12 HEAD)
[ -z "$(git -C "$REPO" status --porcelain --untracked-files=no)" ] ||
  say "warning: uncommitted changes are not installed (commit $COMMIT is)"
DIR="magic-jax/$COMMIT"
if [ "$SETUP" = 1 ]; then
  archive=$(mktemp "${TMPDIR:-/tmp}/magic-jax-XXXXXX.tar.gz")
  git -C "$REPO" archive --format=tar.gz -o "$archive" HEAD
  run "${TPU[@]}" scp "$archive" "$NAME:magic-jax-$COMMIT.tar.gz" "${WHERE[@]}" --worker=all
  rm -f "$archive"
  ssh_on all "set -e; mkdir -p $DIR && tar -xzf magic-jax-$COMMIT.tar.gz -C $DIR && cd $DIR && \
    python3 -m venv .venv && .venv/bin/pip install -q -U pip && \
    .venv/bin/pip install -q -c constraints.txt -e '.[tpu]'"
fi

# ------------------------------------------------------------------ run, stream, collect
RUN_ID="run-$(date -u +%Y%m%d-%H%M%S)"
LOGS=${LOGS:-$REPO/runs/launch/$NAME-$RUN_ID}
printf -v CMD '%q ' "$@"
# Every worker runs the command detached (an ssh drop does not kill it), writing its log
# and then its exit status under ~/magic-jax/logs.
ssh_on all "mkdir -p magic-jax/logs && cd $DIR && nohup bash -c 'source .venv/bin/activate && \
  $CMD; echo \$? > ~/magic-jax/logs/$RUN_ID.exit' > ~/magic-jax/logs/$RUN_ID.log 2>&1 < /dev/null &"
say "running on $WORKERS worker(s) of $NAME; worker 0's log follows"
ssh_on 0 "cd magic-jax/logs && tail -n +1 -f $RUN_ID.log & t=\$!; \
  while [ ! -e ~/magic-jax/logs/$RUN_ID.exit ]; do sleep 5; done; sleep 2; kill \$t"
[ "$DRY" = 1 ] || mkdir -p "$LOGS"
status=0
for ((w = 0; w < WORKERS; w++)); do
  if [ "$DRY" = 1 ]; then
    ssh_on "$w" "cat magic-jax/logs/$RUN_ID.log"
    continue
  fi
  ssh_on "$w" "cat magic-jax/logs/$RUN_ID.log" > "$LOGS/worker-$w.log" || true
  code=$(ssh_on "$w" "cat magic-jax/logs/$RUN_ID.exit" 2>/dev/null | tr -dc 0-9) || code=""
  [ -n "$code" ] || code=1
  [ "$w" != 0 ] || status=$code
  [ "$code" = 0 ] || say "worker $w exited with $code (log: $LOGS/worker-$w.log)"
done
[ "$DRY" = 1 ] || say "logs of $WORKERS worker(s) in $LOGS"
exit "$status"
