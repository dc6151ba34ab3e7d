#!/usr/bin/env bash
# Worker fidelity with the prequeued timing, a full sweep, the published setting
# against the defaults, verify, doctor and the daemon. Results in $OUT.
set -u
OUT=${OUT:-/tmp/nccltune-gpu}
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD
PY=${PY:-python3}
$PY -m nccltune topo --xml "$OUT/ncclTopology.xml" > /dev/null
step fidelity; $PY bench/compare_envs.py --repeats 2 --timing-modes --env "NCCL_TOPO_FILE=$OUT/ncclTopology.xml" \
  ${REF:+--nccl-tests "$REF"} --json "$OUT/fidelity.json" 2>&1 | tee "$OUT/fidelity.txt"
step sweep; s0=$(date +%s); $PY -m nccltune sweep --state-dir /tmp/st2 2> "$OUT/sweep.err" | tee "$OUT/sweep.txt"
echo "sweep wall: $(( $(date +%s) - s0 )) s"
step after; $PY bench/compare_envs.py --repeats 4 --published /tmp/st2 --json "$OUT/after.json" 2>&1 | tee "$OUT/after.txt"
step verify; s0=$(date +%s); $PY -m nccltune verify --state-dir /tmp/st2 | tee "$OUT/verify.txt"; echo "rc=${PIPESTATUS[0]} in $(( $(date +%s) - s0 )) s"
step doctor; $PY -m nccltune doctor --state-dir /tmp/st2; echo "rc=$?"
NCCL_P2P_DISABLE=1 NCCL_P2P_LEVEL=nvl $PY -m nccltune doctor --state-dir /tmp/st2; echo "rc=$?"
step daemon; OUT=$OUT/daemon timeout 330 bash bench/gpu_daemon.sh
step done
