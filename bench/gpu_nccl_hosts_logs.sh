#!/usr/bin/env bash
# NCCL's own log of multi-rank collectives on ONE GPU: N processes, each its own NCCL_HOSTID, so
# NCCL forms an N-node communicator over its socket transport. Records rank 0's worker output and
# every rank's NCCL log (INIT, ENV, TUNING) with NCCL's defaults and with forced choices, as
# fixtures for the reading of NCCL's log. The ranks time-share one GPU: the times are artifacts,
# never a performance result.
#   OUT=/tmp/x bash bench/gpu_nccl_hosts_logs.sh
set -u
OUT=${OUT:-/tmp/nccltune-nccl-hosts-logs}
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_env.sh"
PY=${PY:-python3}
COLLECTIVES=all_reduce,all_gather,reduce_scatter,broadcast,reduce
SIZES=$(echo 4096 65536 1048576 4194304 | tr ' ' ,)
status=0

# run LABEL NRANKS [VAR=VALUE...]: one job of NRANKS hosts on GPU 0, extra variables for every rank.
run() {
  local label=$1 n=$2; shift 2
  local port=$((29500 + RANDOM % 1000)) pids=() r
  step "$label: $n NCCL hosts on one GPU ($*)"
  for ((r = 0; r < n; r++)); do
    env "$@" RANK=$r WORLD_SIZE=$n LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      CUDA_VISIBLE_DEVICES=0 NCCL_HOSTID="nccltune-host$r" \
      NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV,TUNING NCCL_DEBUG_FILE="$OUT/$label.rank$r.nccl.log" \
      timeout 300 $PY -I nccltune/trials/worker.py --backend nccl --collectives "$COLLECTIVES" \
        --sizes "$SIZES" --warmup 2 --iters 5 > "$OUT/$label.rank$r.jsonl" 2> "$OUT/$label.rank$r.err" &
    pids+=($!)
  done
  for r in "${!pids[@]}"; do
    wait "${pids[$r]}"; local rc=$?
    [ "$rc" -eq 0 ] || { status=1; echo "rank $r exit $rc"; tail -3 "$OUT/$label.rank$r.err"; }
  done
  grep -h "nRanks\|NET/\|set by environment\|Using network" "$OUT/$label.rank0.nccl.log" | sort -u | head -8
  grep -c -- "-> Algo" "$OUT/$label.rank0.nccl.log" | sed 's/^/TUNING lines in rank 0 log: /'
}

run defaults-2hosts 2
run defaults-4hosts 4
run tree-simple-2hosts 2 NCCL_ALGO=Tree NCCL_PROTO=Simple
run ring-ll-2hosts 2 NCCL_ALGO=Ring NCCL_PROTO=LL
# One archive of the logs and outputs (the device returns few files).
tar -C "$OUT" -czf "$OUT/nccl-hosts-logs.tar.gz" $(cd "$OUT" && ls *.log *.jsonl *.err)
rm -f "$OUT"/*.log "$OUT"/*.jsonl "$OUT"/*.err
exit $status
