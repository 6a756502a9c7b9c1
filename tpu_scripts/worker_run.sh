#!/usr/bin/env bash
# Runs one launch's command on one TPU worker for tpu_scripts/launch.sh, detached:
#
#   nohup bash tpu_scripts/worker_run.sh LOG [BEATS [EVERY]] > LOG.log 2>&1 < /dev/null &
#
# LOG.sh holds the command (written by launch.sh). This writes LOG.boot, the host's boot id
# as the command starts (a host restarted under the command, as a maintenance event does,
# has another), then LOG.exit, the command's exit status, when it ends. It outlives a
# SIGTERM, SIGHUP or SIGINT to itself (a host shutting down signals every process of the
# session): it waits for the command, which gets the signal too, and still records the
# status. With BEATS (a gs:// prefix) it writes BEATS/worker-N every EVERY [10] seconds,
# one line "N SEQ running BOOT", and "N end exit-STATUS BOOT" at the end: the heartbeat
# by which launch.sh sees every host alive with one query, whatever their number. Its
# log goes up too, to BEATS's stage under logs/ (STAGE/logs/RUN/worker-N.log for
# BEATS=STAGE/beats/RUN), every 60 heartbeats and at the end: a slice preempted or gone
# keeps it.
#
#   bash tpu_scripts/worker_run.sh --status LOG   prints "N STATUS BOOT"
#   bash tpu_scripts/worker_run.sh --busy         names the commands still running here
#                                                 (status 0 when there is one)
#
# STATUS: the exit status, running, or gone (no status and no process); BOOT: same, or
# restarted when this host booted since the command started. N is the worker number from
# the VM's metadata ($LAUNCH_METADATA_URL as in worker_setup.sh), else the host name.
set -u

META=${LAUNCH_METADATA_URL:-http://metadata.google.internal/computeMetadata/v1/instance/attributes}
BOOT_ID=${LAUNCH_BOOT_ID:-/proc/sys/kernel/random/boot_id}
ID=$(curl -sf --max-time 3 -H 'Metadata-Flavor: Google' "$META/agent-worker-number" 2>/dev/null) ||
  ID=""
[ -n "$ID" ] || ID=$(hostname)
boot=$(cat "$BOOT_ID" 2>/dev/null) || boot=unknown

# The status of the command logged at $1 (a path without its suffix).
status_of() {
  if [ -e "$1.exit" ]; then cat "$1.exit"
  elif [ "$(cat "$1.boot" 2>/dev/null)" = "$boot" ] &&
       kill -0 "$(cat "$1.pid" 2>/dev/null)" 2>/dev/null; then echo running
  else echo gone; fi
}

case ${1:-} in
  --status)
    b=same
    [ "$(cat "$2.boot" 2>/dev/null)" = "$boot" ] || b=restarted
    echo "$ID $(status_of "$2") $b"
    exit 0 ;;
  --busy)
    found=0
    for p in "$HOME"/magic-jax/logs/*.pid; do
      [ -e "$p" ] || continue
      if [ "$(status_of "${p%.pid}")" = running ]; then
        echo "worker $ID: a command started by an earlier launch still runs here" \
          "(${p%.pid}.log): the TPU is in use"
        found=1
      fi
    done
    exit $((1 - found)) ;;
esac

log=$1 beats=${2:-} every=${3:-10}
echo "$boot" > "$log.boot"
beat() {  # SEQ STATE
  [ -z "$beats" ] || printf '%s %s %s %s\n' "$ID" "$1" "$2" "$boot" |
    gcloud storage cp - "$beats/worker-$ID" > /dev/null 2>&1
}
keep_log() {  # (at most 60 s: the exit status waits for it)
  [ -z "$beats" ] || timeout 60 gcloud storage cp "$log.log" \
    "${beats%/beats/*}/logs/${beats##*/}/worker-$ID.log" > /dev/null 2>&1
}
bash "$log.sh" &
child=$!
trap : TERM HUP INT
beater=""
if [ -n "$beats" ]; then
  (
    trap - TERM HUP INT
    seq=0
    while kill -0 "$child" 2>/dev/null; do
      seq=$((seq + 1))
      beat "$seq" running
      [ $((seq % 60)) != 0 ] || keep_log
      sleep "$every" || break  # never a busy loop
    done
  ) &
  beater=$!
fi
status=0
while :; do
  wait "$child"
  status=$?
  # a signal to this script ends the wait early (over 128) while the command runs on;
  # anything else is the command's status (127 too: never spin on a pid reused since)
  [ "$status" -gt 128 ] && kill -0 "$child" 2>/dev/null || break
done
[ -z "$beater" ] || kill "$beater" 2>/dev/null
keep_log
echo "$status" > "$log.exit"
beat end "exit-$status"
exit 0
