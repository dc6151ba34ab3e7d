#!/usr/bin/env bash
# Everything measured on a GPU node for the notes, in one go (one device lease):
# topology record/show/XML/check, worker fidelity against nccl-tests, a full sweep, and the
# published environment measured against NCCL's defaults afterwards. Results land in $OUT.
set -u
OUT=${OUT:-/tmp/nccltune-gpu}
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD
PY=${PY:-python3}
REF=${REF:-}
step versions; nvidia-smi -L; $PY -c 'import torch; print(torch.__version__, torch.cuda.nccl.version())'
step record; $PY -m nccltune topo record "$OUT/h200x2-nvswitch-vm.json" \
  --description "2x NVIDIA H200 joined by 18 NVLinks through an NVSwitch, in a Firecracker VM (NUMA unknown to NVML, flat PCIe)"
step topo; $PY -m nccltune topo | tee "$OUT/topo.txt"
$PY -m nccltune topo --json > "$OUT/topo.json"
step xml; $PY -m nccltune topo --xml "$OUT/ncclTopology.xml" >/dev/null; cat "$OUT/ncclTopology.xml"
step check; $PY -m nccltune topo check "$OUT/ncclTopology.xml" --dump "$OUT/redump.xml" | tee "$OUT/check.txt"; echo "rc=${PIPESTATUS[0]}"
step diff; $PY -m nccltune topo diff "$OUT/ncclTopology.xml" "$OUT/redump.xml"; echo "rc=$?"
step fidelity
$PY bench/compare_envs.py --repeats "${FIDELITY_REPEATS:-3}" --env "NCCL_TOPO_FILE=$OUT/ncclTopology.xml" \
  ${REF:+--nccl-tests "$REF"} --json "$OUT/fidelity.json" 2>&1 | tee "$OUT/fidelity.txt"
step plan; $PY -m nccltune sweep --state-dir /tmp/nccltune-state --plan | tee "$OUT/plan.txt"
step sweep; s0=$(date +%s); $PY -m nccltune sweep --state-dir /tmp/nccltune-state 2> "$OUT/sweep.err" | tee "$OUT/sweep.txt"; echo "sweep wall: $(( $(date +%s) - s0 )) s"
tail -5 "$OUT/sweep.err"
step after; $PY bench/compare_envs.py --repeats "${AFTER_REPEATS:-5}" --published /tmp/nccltune-state \
  --json "$OUT/after.json" 2>&1 | tee "$OUT/after.txt"
step done
