#!/usr/bin/env bash
# `nccltune sweep` with the final code for the `large` and the `balanced` profile, each followed by
# its published environment against NCCL's defaults in the same run (medians of 3 repeats).
#   OUT=/tmp/x bash bench/gpu_sweep_profiles.sh
set -u
OUT=${OUT:-/tmp/nccltune-gpu7}
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD
PY=${PY:-python3}
for profile in large balanced; do
  state=/tmp/nccltune-s7-$profile
  step "nccltune sweep --profile $profile"
  s0=$(date +%s); $PY -m nccltune sweep --profile "$profile" --state-dir "$state" 2> "$OUT/sweep-$profile.err"
  echo "rc=$? wall=$(( $(date +%s) - s0 )) s"
  step "published ($profile) vs defaults"
  $PY bench/compare_envs.py --repeats 3 --profile "$profile" --published "$state" --json "$OUT/after-$profile.json"
done
step done
