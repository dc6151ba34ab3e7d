#!/usr/bin/env bash
# nccltune's two NCCL plugins in the node's own NCCL (through the node's torch), on one GPU: the
# tuner plugin with a table keyed by NCCL version, and the env plugin (NCCL 2.28.7 and newer).
# Both are built here (nccltune.tuner.build), the table and env file rendered by nccltune's own
# renderers, and a 2-rank NCCL all-reduce runs as two NCCL hosts on the one GPU (each process its
# own NCCL_HOSTID, so NCCL forms a 2-node communicator over its socket transport and consults the
# tuner; one rank would not) with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING,ENV, twice:
#   keyed   the table and env file have a section for the running NCCL: the tuner plugin applies it
#           (ring/simple at every all-reduce size, which NCCL's TUNING lines must show) and the env
#           plugin answers the tuned variables (NCCL logs them as set; the job's own value wins)
#   other   both have sections for other NCCL versions only: both defer, NCCL runs its own choices
# The ranks time-share the GPU: nothing here is a speed. Prints PASS/FAIL per case and a summary
# under $OUT (logs per case and rank); exit 0 only when all pass. About 2 minutes.
#   OUT=/tmp/x bash bench/gpu_nccl_plugins.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nccltune-gpu-plugins}
mkdir -p "$OUT"
. bench/gpu_env.sh
export PYTHONPATH=$PWD
PY=${PY:-python3}
FP=0123456789abcdef
W=$(mktemp -d /tmp/nccltune-plugins.XXXXXX)  # 0700, this user's: the env file's trust rule holds
chmod 755 "$W"
exec > >(tee "$OUT/summary.txt") 2>&1

step "NCCL version of this torch, and the plugins built"
V=$($PY -c 'import torch; print(".".join(map(str, torch.cuda.nccl.version())))') || { echo "FAIL: no torch NCCL"; exit 1; }
echo "torch's NCCL: $V"
$PY - "$W/lib" > "$OUT/build.txt" 2>&1 <<'EOF'
import sys
from pathlib import Path

from nccltune.tuner.build import build_env_plugin, compile_plugin

ok = True
for result in (compile_plugin(Path(sys.argv[1])), build_env_plugin(Path(sys.argv[1]))):
    print(result.message)
    print("  command:", " ".join(result.command), "| warnings:", result.warnings or "none")
    ok = ok and result.ok
sys.exit(0 if ok else 1)
EOF
build_rc=$?
cat "$OUT/build.txt"
TUNER=$W/lib/libnccl-tuner-nccltune.so ENVLIB=$W/lib/libnccl-env-nccltune.so
[ "$build_rc" -eq 0 ] && [ -f "$TUNER" ] && [ -f "$ENVLIB" ] || { echo "FAIL build (rc=$build_rc)"; exit 1; }
nm -D "$TUNER" "$ENVLIB" 2>/dev/null | grep -E "ncclTunerPlugin|ncclEnvPlugin"

step "tables and env files, rendered by nccltune"
$PY - "$W" "$V" "$FP" <<'EOF'
import sys
from pathlib import Path

from nccltune.tuner.envfile import env_values, render_env_file
from nccltune.tuner.table import TableEntry, TunerTable, render_table

out, running, fp = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
others = [v for v in ("2.27.7", "2.31.0") if v != running]


def entries(version: str, algo: str, proto: str) -> tuple[TableEntry, ...]:
    # The job's shape: 2 nodes (NCCL hosts) of 1 rank; every size.
    return (TableEntry("allreduce", 0, 2**40, 2, 2, 1, algo, proto, 0, version),)


keyed = entries(running, "ring", "simple") + entries(others[0], "tree", "ll")
(out / "table-keyed.txt").write_text(render_table(TunerTable(fp, keyed)))
(out / "table-other.txt").write_text(render_table(TunerTable(fp, entries(others[0], "ring", "simple")
                                                            + entries(others[1], "ring", "simple"))))
tuned = {"all": {"NCCL_BUFFSIZE": "8388608", "NCCL_NTHREADS": "256"}, "multi": {"NCCL_MIN_NCHANNELS": "4"},
         "single": {"NCCL_MAX_NCHANNELS": "1"}}
(out / "env-keyed.txt").write_text(render_env_file(env_values({running: tuned,
                                                               others[0]: {"all": {"NCCL_BUFFSIZE": "1048576"}}})))
(out / "env-other.txt").write_text(render_env_file(env_values({others[0]: tuned})))
EOF
chmod 644 "$W"/*.txt
for f in "$W"/table-*.txt "$W"/env-*.txt; do echo "--- $(basename "$f")"; cat "$f"; cp "$f" "$OUT/"; done

cat > "$W/allreduce.py" <<'EOF'
"""One rank of a 2-rank NCCL all-reduce on cuda:0 (both ranks share the GPU); prints ALLREDUCE OK
when every result is right."""
import os
import sys

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
ok = True
for n_bytes in (4096, 1 << 20, 16 << 20):
    x = torch.full((n_bytes // 4,), float(rank + 1), device=device)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    good = bool(torch.all(x == 3.0).item())
    print(f"rank {rank} size {n_bytes}: {'ok' if good else 'WRONG'}")
    ok = ok and good
dist.destroy_process_group()
print("ALLREDUCE OK" if ok else "ALLREDUCE WRONG")
sys.exit(0 if ok else 1)
EOF

fails=0
# run_case NAME: both ranks with the NAME table and env file; logs under $OUT/NAME.
run_case() {
  local name=$1 dir=$OUT/$1 port=$((20000 + RANDOM % 20000)) pids=() rc=0 problems=""
  mkdir -p "$dir"
  step "case $name"
  for r in 0 1; do
    RANK=$r WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port NCCL_HOSTID=plugins-host$r \
      NCCL_TUNER_PLUGIN=$TUNER NCCLTUNE_TUNER_TABLE=$W/table-$name.txt NCCLTUNE_TUNER_FINGERPRINT=$FP \
      NCCL_ENV_PLUGIN=$ENVLIB NCCLTUNE_ENV_TABLE=$W/env-$name.txt NCCL_NTHREADS=512 \
      NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING,ENV NCCL_DEBUG_FILE=$dir/nccl.rank$r.log \
      timeout 120 "$PY" "$W/allreduce.py" > "$dir/rank$r.out" 2> "$dir/rank$r.err" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  cat "$dir"/rank*.out
  local log=$dir/nccl.rank0.log
  echo "  from NCCL's log (rank 0):"
  grep -E "TUNER/Plugin|ENV/Plugin|env plugin|nccltune tuner|set by environment to|AllReduce: .* Bytes" "$log" \
    | sed 's/^[^ ]* [^ ]* NCCL /    /' | sort | uniq -c | sed 's/^/  /'
  echo "  the env plugin's own lines (rank 0's stderr):"
  grep "nccltune env:" "$dir/rank0.err" | sed 's/^[^ ]* NCCL INFO /    /'
  [ "$rc" -eq 0 ] || problems="$problems run-rc=$rc"
  [ "$(grep -c 'ALLREDUCE OK' "$dir"/rank*.out | awk -F: '{s+=$2} END {print s}')" = 2 ] || problems="$problems result"
  grep -Eq "TUNER/Plugin: Using nccltune \(v[0-9]+\)" "$log" || problems="$problems tuner-not-loaded"
  grep -Eq "ENV/Plugin: Using nccltune \(v1\)|Successfully loaded external env plugin" "$log" \
    || problems="$problems env-plugin-not-loaded"
  if [ "$name" = keyed ]; then
    grep -Eq "nccltune tuner: using table .*table-keyed.txt \(NCCL $V section, 1 entries, fingerprint $FP\) for a communicator of 2 ranks on 2 nodes, 1 per node" "$log" \
      || problems="$problems tuner-section-not-applied"
    # Every all-reduce NCCL logged ran the table's choice.
    local total ring
    total=$(grep -Ec "AllReduce: [0-9]+ Bytes -> Algo" "$log")
    ring=$(grep -Ec "AllReduce: [0-9]+ Bytes -> Algo RING proto SIMPLE" "$log")
    { [ "$total" -gt 0 ] && [ "$total" -eq "$ring" ]; } || problems="$problems tuning($ring of $total ring/simple)"
    grep -q "NCCL_BUFFSIZE=8388608 (tuned, all)" "$dir/rank0.err" || problems="$problems env-not-answered"
    grep -q "NCCL_MIN_NCHANNELS=4 (tuned, multi)" "$dir/rank0.err" || problems="$problems env-shape"
    grep -q "NCCL_NTHREADS=512 from the job's environment" "$dir/rank0.err" || problems="$problems env-precedence"
    grep -q "NCCL_MAX_NCHANNELS" "$dir/rank0.err" && problems="$problems single-node-value-answered"
    grep -q "NCCL_BUFFSIZE set by environment to 8388608" "$log" || problems="$problems nccl-did-not-log-buffsize"
  else
    grep -Eq "nccltune tuner: table .*table-other.txt has no section for NCCL $V \(sections: .*\); deferring to NCCL" \
      "$log" || problems="$problems tuner-did-not-defer"
    grep -q "env file .*env-other.txt has no section for NCCL $V" "$dir/rank0.err" || problems="$problems env-did-not-defer"
    grep -q "NCCL_BUFFSIZE set by environment" "$log" && problems="$problems buffsize-set"
  fi
  if [ -z "$problems" ]; then
    echo "PASS $name" | tee "$dir/verdict.txt"
  else
    echo "FAIL $name:$problems" | tee "$dir/verdict.txt"
    fails=$((fails + 1))
  fi
}

run_case keyed
run_case other

step "summary"
echo "NCCL $V; ranks time-share one GPU (two NCCL hosts): mechanisms only, no speeds"
cat "$OUT"/*/verdict.txt
if [ "$fails" -eq 0 ]; then echo "ALL PASS"; else echo "$fails case(s) FAILED"; fi
rm -rf "$W"
[ "$fails" -eq 0 ]
