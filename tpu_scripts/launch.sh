#!/usr/bin/env bash
# Run a magic-jax command on every worker of a Cloud TPU VM slice at once.
#
#   tpu_scripts/launch.sh TPU_NAME ZONE [--project P] [--setup] -- magic-jax convert ... --mesh fsdp=-1,tensor=4
#
# --setup copies this checkout to ~/magic-jax on all workers and installs it with
# the `tpu` extra (pinned by constraints.txt). The command then starts on all
# workers together; magic_jax calls jax.distributed.initialize() itself when it
# sees a multi-host slice. DRY_RUN=1 prints the gcloud commands instead.
set -euo pipefail

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 2 ] || usage
TPU_NAME=$1 ZONE=$2
shift 2
PROJECT=() SETUP=0
while [ $# -gt 0 ]; do
  case $1 in
    --project) PROJECT=(--project "$2"); shift 2 ;;
    --setup) SETUP=1; shift ;;
    --) shift; break ;;
    *) echo "launch.sh: unknown option $1" >&2; usage ;;
  esac
done
[ $# -gt 0 ] || { echo "launch.sh: no command after --" >&2; usage; }

REPO=$(cd "$(dirname "$0")/.." && pwd)
REMOTE_DIR='~/magic-jax'
run() { if [ "${DRY_RUN:-0}" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi; }
ssh_all() {
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" "${PROJECT[@]}" \
    --worker=all --command "$1"
}

if [ "$SETUP" = 1 ]; then
  archive=$(mktemp /tmp/magic-jax-XXXXXX.tar.gz)
  git -C "$REPO" archive --format=tar.gz -o "$archive" HEAD
  run gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME:/tmp/magic-jax.tar.gz" \
    --zone "$ZONE" "${PROJECT[@]}" --worker=all
  ssh_all "mkdir -p $REMOTE_DIR && tar -xzf /tmp/magic-jax.tar.gz -C $REMOTE_DIR && \
    cd $REMOTE_DIR && python3 -m venv .venv && .venv/bin/pip install -q -U pip && \
    .venv/bin/pip install -q -c constraints.txt -e '.[tpu]'"
  rm -f "$archive"
fi

printf -v CMD '%q ' "$@"
ssh_all "cd $REMOTE_DIR && source .venv/bin/activate && $CMD"
