#!/usr/bin/env bash
# A run on a GKE TPU slice under JobSet, which restarts it after a preemption or a lost
# host (runs of weeks): writes the `xpk workload create` command and the equivalent JobSet
# manifest (for `kubectl apply -f`) from the arguments of a launch.sh run, then submits one.
#
#   tpu_scripts/gke.sh --cluster CLUSTER --image IMAGE [--build] --accelerator v5p-128 \
#     [--env KEY=VALUE ...] [--compile-cache gs://BUCKET/PATH] [--max-restarts N] \
#     [--via xpk|kubectl] [--dry-run] -- magic-jax train CONFIG --set output_dir=gs://BUCKET/RUN
#
# --dry-run prints the commands and the manifest and runs nothing; --help lists every option.
# The work is done by magic_jax/jobs/gke.py, run with this checkout's .venv if it has one.
set -euo pipefail
here=${0%/*}; [ "$here" != "$0" ] || here=.
REPO=$(cd "$here/.." && pwd)
PY=${GKE_PYTHON:-$REPO/.venv/bin/python}
[ -x "$PY" ] || PY=python3
PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} exec "$PY" -m magic_jax.jobs.gke "$@"
