#!/usr/bin/env bash
# Sets up one TPU worker for tpu_scripts/launch.sh: a Python >= 3.11 virtual environment
# (.venv) made by uv in this commit's directory, with magic-jax installed in it; once per
# commit. launch.sh runs it on every worker from the extracted archive:
#
#   cd ~/magic-jax/<commit> && bash tpu_scripts/worker_setup.sh <commit>
#
# The stock TPU images ship Python 3.10, so the image's Python is only used, if at all, to
# bring uv: an existing `uv` on PATH or in ~/.local/bin, else `python3 -m pip install --user
# uv==UV_VERSION` (the image's pip), else uv's standalone installer. `uv venv --python 3.11`
# then takes a Python 3.11 found on the worker or downloads a uv-managed CPython (into
# ~/.local/share/uv/python, or $UV_PYTHON_INSTALL_DIR), and `uv pip install` installs.
#
# Environment: LAUNCH_PYTHON  the Python the venv is made with [3.11]
#              LAUNCH_INSTALL the arguments of `uv pip install`, split at spaces
#                             [-c constraints.txt -e .[tpu]]
#              LAUNCH_METADATA_URL the VM's metadata attributes [http://metadata.google.
#                             internal/computeMetadata/v1/instance/attributes]
# Every line it prints starts with "worker N: " (N from the VM's metadata, else its host
# name). It ends with "worker N: ready (...)" or, exiting 1, with "worker N: set-up failed:
# LINE" (LINE: the failed step's last error line). The whole output of the steps is in
# ~/magic-jax/setup-<commit>.log.
set -uo pipefail

UV_VERSION=0.13.9  # also pinned in constraints.txt (the tests' uv)
COMMIT=${1:?usage: worker_setup.sh COMMIT}
PYTHON=${LAUNCH_PYTHON:-3.11}
read -r -a INSTALL <<< "${LAUNCH_INSTALL:--c constraints.txt -e .[tpu]}"
META=${LAUNCH_METADATA_URL:-http://metadata.google.internal/computeMetadata/v1/instance/attributes}
LOG=$HOME/magic-jax/setup-$COMMIT.log
MARKER=.installed  # in this directory: the Python and install arguments it was made with
mkdir -p "$HOME/magic-jax" && : > "$LOG"

md() { curl -sf --max-time 3 -H 'Metadata-Flavor: Google' "$META/$1" 2>/dev/null; }
TPU_ENV=$(md tpu-env) || TPU_ENV=""
tpu_env() { sed -n "s/^$1: *'\{0,1\}\([^']*\)'\{0,1\}$/\1/p" <<< "$TPU_ENV" | head -n 1; }
ID=$(md agent-worker-number) || ID=""
[ -n "$ID" ] || ID=$(tpu_env WORKER_ID)
[ -n "$ID" ] || ID=$(hostname)
say() { echo "worker $ID: $*"; }
fail() { say "set-up failed: $*"; exit 1; }

# Runs a step with its output in the log; on failure, fails with its last error line.
step() {
  local what=$1 out line; shift
  echo "## $what: $*" >> "$LOG"
  out=$("$@" 2>&1)
  local rc=$?
  printf '%s\n' "$out" >> "$LOG"
  [ "$rc" = 0 ] && return 0
  line=$(grep -iE 'error|fail|denied|not found|no such' <<< "$out" | tail -n 1)
  [ -n "$line" ] || line=$(grep -v '^[[:space:]]*$' <<< "$out" | tail -n 1)
  fail "${line:-$what exited with $rc} ($what; log: $LOG)"
}

os=$(sed -n 's/^PRETTY_NAME="\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' /etc/os-release 2>/dev/null)
accel=$(tpu_env ACCELERATOR_TYPE) runtime=$(tpu_env RUNTIME_VERSION)
say "host $(hostname), ${os:-unknown OS}${accel:+, $accel}${runtime:+, runtime $runtime}"

venv_python() { .venv/bin/python -c 'import sys; print(sys._base_executable, sys.version.split()[0])'; }
want="python=$PYTHON install=${INSTALL[*]}"
if [ -e "$MARKER" ] && [ "$(head -n 1 "$MARKER")" = "$want" ] && py=$(venv_python 2>/dev/null); then
  say "magic-jax $COMMIT already installed, skipping set-up (python ${py% *}, ${py##* })"
  say "ready (python $PWD/.venv/bin/python ${py##* })"
  exit 0
fi
rm -f "$MARKER"
start=$SECONDS

find_uv() {
  UV=$(command -v uv) || { UV=$HOME/.local/bin/uv; [ -x "$UV" ]; }
}
uv_installer() {
  local url=https://astral.sh/uv/$UV_VERSION/install.sh
  if command -v curl >/dev/null; then curl -LsSf "$url"; else wget -qO- "$url"; fi |
    env UV_UNMANAGED_INSTALL="$HOME/.local/bin" sh
}
if ! find_uv; then
  echo "## python3 -m pip install --user uv==$UV_VERSION" >> "$LOG"
  if ! { python3 -m pip install --user -q "uv==$UV_VERSION" >> "$LOG" 2>&1 && find_uv; }; then
    step "uv's standalone installer" uv_installer
    find_uv || fail "no uv after its installer ran (log: $LOG)"
  fi
fi
say "uv: $("$UV" --version 2>/dev/null) ($UV)"

rm -rf .venv  # what a failed set-up left (also for a uv too old for `uv venv --clear`)
step "uv venv" "$UV" venv --python "$PYTHON" .venv
py=$(venv_python 2>&1) || fail "the new .venv has no working Python: $py"
.venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
  fail "the new .venv has Python ${py##* }; magic-jax needs 3.11 or newer (LAUNCH_PYTHON=$PYTHON)"
say "python ${py##* } (${py% *}) in $PWD/.venv"
step "uv pip install" "$UV" pip install --python .venv/bin/python "${INSTALL[@]}"
echo "$want" > "$MARKER"
say "installed magic-jax $COMMIT in $((SECONDS - start)) s"
say "ready (python $PWD/.venv/bin/python ${py##* })"
