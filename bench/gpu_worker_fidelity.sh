#!/usr/bin/env bash
# Fidelity of the worker's direct NCCL timing (out of place, host clock, as all_reduce_perf):
# against nccl-tests' reference curves of this machine type (REF: a directory holding
# grid-summary.txt and all_reduce_perf.nch32.txt), against the worker's other timing modes, and
# against an in-process stand-in of all_reduce_perf -g 2 measured in the same run.
#   OUT=/tmp/x REF=/path/to/reference-nccl-tests-dir bash bench/gpu_worker_fidelity.sh
set -u
OUT=${OUT:-/tmp/nccltune-gpu5}
REF=${REF:?set REF to a directory of all_reduce_perf outputs of this machine type (grid-summary.txt, all_reduce_perf.nch32.txt)}
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD
PY=${PY:-python3}
SIZES=$(echo 65536 262144 1048576 4194304 16777216 67108864 268435456 1073741824 | tr ' ' ,)
step "in-process all_reduce_perf stand-in"
$PY bench/inproc_allreduce.py --sizes "$SIZES" --repeats 5 --json "$OUT/inproc.json"
step "worker timing modes vs nccl-tests"
$PY bench/compare_envs.py --repeats 5 --sizes "$SIZES" --timing-modes --env NCCL_MIN_NCHANNELS=32 \
  --nccl-tests "$REF/grid-summary.txt" --nccl-tests "NCCL_MIN_NCHANNELS=32=$REF/all_reduce_perf.nch32.txt" \
  --json "$OUT/fidelity.json"
step done
