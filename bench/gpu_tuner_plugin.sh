#!/usr/bin/env bash
# nccltune's tuner plugin in the node's own NCCL (through the node's torch), on one GPU:
# the plugin is built here with the system C compiler, then a one-rank NCCL all-reduce runs three
# times with NCCL_TUNER_PLUGIN pointing at it:
#   valid      a table whose fingerprint matches: NCCL loads the plugin, which defers (one rank)
#   malformed  a table with a bad entry: one WARN from the plugin, the job runs on
#   stale      a valid table, but the node expects another fingerprint: one WARN, the job runs on
# Each run must give the right sum, NCCL's log must name the plugin, and the plugin's own lines must
# be the expected ones. Prints PASS/FAIL per case; exit 0 only when all pass. Under 3 minutes.
#   OUT=/tmp/x bash bench/gpu_tuner_plugin.sh
set -u
OUT=${OUT:-/tmp/nccltune-gpu-tuner}
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD
PY=${PY:-python3}
FP=0123456789abcdef
LIB=$OUT/lib/libnccl-tuner-nccltune.so

step "build the plugin with nccltune.tuner.build"
$PY - "$OUT/lib" > "$OUT/build.txt" 2>&1 <<'EOF'
import sys
from pathlib import Path

from nccltune.tuner.build import build_plugin

result = build_plugin(Path(sys.argv[1]))
print(result.message)
print("command:", " ".join(result.command))
print("warnings:", result.warnings or "none")
sys.exit(0 if result.ok else 1)
EOF
build_rc=$?
cat "$OUT/build.txt"
if [ "$build_rc" -ne 0 ] || [ ! -f "$LIB" ]; then
  echo "FAIL build (rc=$build_rc): nothing else can run"
  exit 1
fi
nm -D "$LIB" 2>/dev/null | grep ncclTunerPlugin

step "tables and the all-reduce"
# The table's section is the running NCCL's (bench/gpu_nccl_plugins.sh tries other versions).
V=$($PY -c 'import torch; print(".".join(map(str, torch.cuda.nccl.version())))')
# One entry for this one-rank shape (which NCCL never asks about) and one for a 2-GPU node.
cat > "$OUT/valid.txt" <<EOF
nccltune-tuner-table 2
fingerprint $FP
nccl $V
allreduce 0 1099511627776 1 1 1 ring simple 0
allreduce 0 1048575 1 2 2 ring ll128 16
end 2
EOF
sed 's/ ring ll128 16$/ ring ll64 16/' "$OUT/valid.txt" > "$OUT/malformed.txt"

cat > "$OUT/allreduce.py" <<'EOF'
"""One-rank NCCL all-reduce of a few sizes; prints ALLREDUCE OK when every result is right."""
import os
import sys

import torch
import torch.distributed as dist

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29541")  # each case passes its own port
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
print("torch", torch.__version__, "nccl", ".".join(map(str, torch.cuda.nccl.version())))
dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
ok = True
for n_bytes in (4096, 1 << 20, 64 << 20):
    x = torch.full((n_bytes // 4,), 3.0, device=device)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    good = bool(torch.all(x == 3.0).item())
    print(f"size {n_bytes}: {'ok' if good else 'WRONG'}")
    ok = ok and good
dist.destroy_process_group()
print("ALLREDUCE OK" if ok else "ALLREDUCE WRONG")
sys.exit(0 if ok else 1)
EOF

fails=0
port=29540
# run_case NAME TABLE FINGERPRINT EXPECTED-PLUGIN-LINE-REGEX
run_case() {
  local name=$1 table=$2 fp=$3 want=$4 dir=$OUT/$1 rc problems=""
  port=$((port + 1))
  mkdir -p "$dir"
  step "case $name"
  MASTER_PORT=$port NCCL_TUNER_PLUGIN=$LIB NCCLTUNE_TUNER_TABLE=$table NCCLTUNE_TUNER_FINGERPRINT=$fp \
    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING,ENV NCCL_DEBUG_FILE=$dir/nccl.%h.%p.log \
    timeout 55 "$PY" "$OUT/allreduce.py" > "$dir/run.txt" 2>&1
  rc=$?
  cat "$dir/run.txt"
  cat "$dir"/nccl.*.log > "$dir/nccl.log" 2>/dev/null
  grep -E "TUNER/Plugin|tuner plugin|nccltune tuner" "$dir/nccl.log" | sed 's/^/  log: /'
  [ "$rc" -eq 0 ] || problems="$problems run-rc=$rc"
  grep -q "ALLREDUCE OK" "$dir/run.txt" || problems="$problems result"
  grep -Eq "TUNER/Plugin: Using nccltune \(v[0-9]+\)" "$dir/nccl.log" || problems="$problems plugin-not-named"
  local total wanted
  total=$(grep -c "nccltune tuner:" "$dir/nccl.log")
  wanted=$(grep -Ec "$want" "$dir/nccl.log")
  # One line per communicator, each the expected one.
  if [ "$total" -lt 1 ] || [ "$total" -ne "$wanted" ]; then
    problems="$problems plugin-lines($wanted of $total expected)"
  fi
  if [ -z "$problems" ]; then
    echo "PASS $name: $(grep -Eo 'TUNER/Plugin: Using nccltune \(v[0-9]+\)' "$dir/nccl.log" | head -1)," \
      "$total plugin line(s) as expected" | tee "$dir/summary.txt"
  else
    echo "FAIL $name:$problems" | tee "$dir/summary.txt"
    fails=$((fails + 1))
  fi
}

run_case valid "$OUT/valid.txt" "$FP" \
  "NCCL INFO nccltune tuner: table .*valid.txt \(NCCL $V section, 2 entries\) is valid; one-rank communicator, deferring to NCCL"
run_case malformed "$OUT/malformed.txt" "$FP" \
  "NCCL WARN nccltune tuner: table .*malformed.txt:5 is malformed \(unknown protocol 'll64'\); deferring to NCCL"
run_case stale "$OUT/valid.txt" fedcba9876543210 \
  "NCCL WARN nccltune tuner: table .*valid.txt is stale \(fingerprint $FP, this node expects fedcba9876543210\)"

step "summary"
grep -h -E "^(PASS|FAIL) " "$OUT"/*/summary.txt 2>/dev/null
if [ "$fails" -eq 0 ]; then echo "ALL PASS"; else echo "$fails case(s) FAILED"; fi
[ "$fails" -eq 0 ]
