#!/usr/bin/env bash
# A one-GPU node from scratch: the README's main job, the commands a newcomer types next, the
# topology file through NCCL, NVML's compute processes, the units' capability set and no-new-privs
# around NVML/CUDA/NCCL, and the idle daemon's footprint with real NVML.
#   OUT=/tmp/x MINUTES=4 bash bench/gpu_one_gpu_node.sh
set -u
OUT=${OUT:-/tmp/nccltune-one-gpu}
STATE=${STATE:-/tmp/nccltune-one-gpu-state}
MINUTES=${MINUTES:-4}
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_env.sh"
rm -rf .venv-node "$STATE"

step "bash bringup.sh --state-dir $STATE"
s0=$(date +%s); bash bringup.sh --state-dir "$STATE"; echo "rc=$? wall=$(( $(date +%s) - s0 )) s"
NT=.venv-node/bin/nccltune
for cmd in history report env topo doctor; do
  step "nccltune $cmd"; $NT "$cmd" --state-dir "$STATE" 2>&1; echo "rc=$?"
done
step "nccltune topo check (the file the sweep published)"
xml=$(find "$STATE" -name ncclTopology.xml -print -quit)
echo "file: ${xml:-none}"
[ -n "$xml" ] && { $NT topo check "$xml" --state-dir "$STATE" 2>&1; echo "rc=$?"; }

step "hw.nvml.compute_pids while a torch process holds the GPU"
.venv-node/bin/python -c 'import torch, time; x = torch.ones(1, device="cuda"); print("holder", flush=True); time.sleep(40)' &
holder=$!
sleep 15
.venv-node/bin/python - "$holder" <<'EOF'
import sys
from nccltune.hw import nvml
print("holder pid", sys.argv[1])
print("compute_pids:", nvml.compute_pids([0]))
EOF
kill "$holder" 2>/dev/null; wait "$holder" 2>/dev/null

step "the units' capability bounding set and no-new-privs around NVML, CUDA and NCCL"
echo "pid 1: $(cat /proc/1/comm)"; command -v systemd-run setpriv capsh 2>&1
caps=$(sed -n 's/^CapabilityBoundingSet=//p' systemd/nccltune.service | tr 'A-Z' 'a-z' | sed 's/cap_/+/g; s/ /,/g')
echo "bounding set: -all,$caps"
setpriv --bounding-set "-all,$caps" --inh-caps=-all --no-new-privs -- bash -c '
  grep -E "^(CapBnd|NoNewPrivs)" /proc/self/status
  capsh --decode=$(sed -n "s/^CapBnd:\t//p" /proc/self/status) 2>/dev/null
  .venv-node/bin/nccltune topo --state-dir '"$STATE"' >/dev/null && echo "topo (NVML): ok"
  .venv-node/bin/python -c "
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR=\"127.0.0.1\", MASTER_PORT=\"29533\")
dist.init_process_group(\"nccl\", rank=0, world_size=1, device_id=torch.device(\"cuda\", 0))
x = torch.ones(1 << 20, device=\"cuda\"); dist.all_reduce(x); torch.cuda.synchronize()
print(\"one-rank NCCL all_reduce under the bounding set:\", \"ok\" if x[0].item() == 1 else \"WRONG\", torch.cuda.nccl.version())
dist.destroy_process_group()"
  .venv-node/bin/nccltune verify --state-dir '"$STATE"' >/tmp/verify.txt 2>&1; rc=$?; tail -4 /tmp/verify.txt; echo "verify rc=$rc"
' 2>&1

step "idle daemon footprint with real NVML ($MINUTES min)"
PYTHONPATH=$PWD .venv-node/bin/python bench/daemon_footprint.py --minutes "$MINUTES" --state-dir "$STATE-daemon" 2>&1
tail -20 "$STATE-daemon/daemon.log"
cp -r "$STATE" "$OUT/state" 2>/dev/null
step done
