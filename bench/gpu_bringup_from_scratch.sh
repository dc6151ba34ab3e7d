#!/usr/bin/env bash
# The README's main-job command on a GPU node (bringup.sh: venv over the system's torch,
# then `nccltune sweep`), then the published environment against NCCL's defaults in the same run.
#   OUT=/tmp/x bash bench/gpu_bringup_from_scratch.sh
set -u
OUT=${OUT:-/tmp/nccltune-gpu6}
STATE=${STATE:-/tmp/nccltune-s6}
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_env.sh"
step "bash bringup.sh --state-dir $STATE"
s0=$(date +%s); bash bringup.sh --state-dir "$STATE"; echo "rc=$? wall=$(( $(date +%s) - s0 )) s"
step "the venv it made"
.venv-node/bin/python -c 'import sys, nccltune, torch; print(sys.prefix, nccltune.__version__, torch.__version__, torch.__file__)'
step "nccltune history"; .venv-node/bin/nccltune history --state-dir "$STATE"
step "published vs defaults"
PYTHONPATH=$PWD .venv-node/bin/python bench/compare_envs.py --repeats 3 --published "$STATE" --json "$OUT/after.json"
step done
