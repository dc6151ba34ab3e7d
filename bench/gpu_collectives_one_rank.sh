#!/usr/bin/env bash
# The worker's per-collective code on this node's NCCL through torch, on ONE GPU: a one-rank
# communicator, every collective, once with CUDA-graph timing and once with plain direct NCCL
# calls. Results must be correct; the times are one-rank times (no link between GPUs is
# measured, and busbw is 0 by definition where the factor has n-1 in it).
#   OUT=/tmp/x bash bench/gpu_collectives_one_rank.sh
set -u
OUT=${OUT:-/tmp/nccltune-collectives-one-rank}
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD
PY=${PY:-python3}
COLLECTIVES=all_reduce,all_gather,reduce_scatter,broadcast,reduce,all_to_all,sendrecv
SIZES=$(echo 4096 65536 1048576 16777216 67108864 | tr ' ' ,)
status=0
for timing in graph direct; do
  step "every collective, one rank, timing $timing"
  RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29500 + RANDOM % 1000)) \
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} \
    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING NCCL_DEBUG_FILE="$OUT/nccl-$timing.%p.log" \
    timeout 300 $PY nccltune/trials/worker.py --backend nccl --timing "$timing" --collectives "$COLLECTIVES" \
      --sizes "$SIZES" --warmup 5 --iters 20 > "$OUT/worker-$timing.jsonl" 2> "$OUT/worker-$timing.err"
  rc=$?
  echo "worker exit status: $rc"
  [ "$rc" -eq 0 ] || { status=1; tail -5 "$OUT/worker-$timing.err"; }
  # One line per collective: correctness over all sizes, the smallest size's time, the largest's algbw.
  $PY - "$OUT/worker-$timing.jsonl" <<'PYEOF' || status=1
import json, sys
docs = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
start = next((d for d in docs if d.get("event") == "start"), {})
print(f"timing: {start.get('timing')!r}; world_size {start.get('world_size')} (one-rank times); "
      f"NCCL {start.get('nccl_version')}; all_to_all by {start.get('all_to_all_call')}")
if start.get("graph_capture"):
    print(f"graph capture failed: {start['graph_capture']}")
ok = bool(start)
for name in start.get("collectives", []):
    rows = [d for d in docs if d.get("event") == "size" and d.get("collective") == name]
    missing = [d.get("reason") for d in docs if d.get("collective") == name and d.get("event") != "size"]
    if not rows:
        print(f"{name:15s} NOT MEASURED {missing}")
        ok = False
        continue
    correct = all(d["correct"] for d in rows)
    ok = ok and correct
    small, large = rows[0], rows[-1]
    print(f"{name:15s} {'correct' if correct else 'WRONG  '} {len(rows)} sizes; "
          f"{small['size_bytes']} B {small['time_us']} us; {large['size_bytes']} B {large['time_us']} us "
          f"algbw {large['algbw_gbps']} GB/s busbw {large['busbw_gbps']} GB/s (one rank)")
done = [d for d in docs if d.get("event") == "done"]
sys.exit(0 if ok and done and done[0].get("status") == 0 else 1)
PYEOF
  echo "functions in NCCL's per-size algorithm lines:"
  cat "$OUT"/nccl-"$timing".*.log 2>/dev/null | grep -o '[A-Za-z]*: [0-9]* Bytes -> Algo' | cut -d: -f1 | sort | uniq -c
done
step "done, status $status"
exit "$status"
