#!/usr/bin/env bash
# The daemon on a GPU node without systemd: NOTIFY_SOCKET points at a socket we listen on. It
# should notify READY, sweep (GPUs idle), publish, verify, then react to a simulated topology
# change (SIGHUP with a config whose topology.snapshot has one NVLink down) by republishing a
# safe environment and re-sweeping; SIGTERM stops it. Logs land in $OUT.
set -u
OUT=${OUT:-/tmp/nccltune-daemon}
PY=${PY:-python3}
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD
state=$(mktemp -d /tmp/nccltune-daemon-state.XXXX)
cat > "$OUT/daemon.yaml" <<YAML
sweep:
  baseline_repeats: 2
  finalist_repeats: 2
  max_finalists: 1
  variables: {NCCL_MIN_NCHANNELS: ["32"]}
  exclude: [NCCL_ALGO, NCCL_PROTO, NCCL_MAX_NCHANNELS, NCCL_BUFFSIZE, NCCL_NTHREADS, NCCL_CUMEM_ENABLE]
daemon: {quiet_period_s: 0, verify_interval_s: 3600}
publish: {metrics_dir: metrics}
YAML
$PY -m nccltune topo record "$OUT/mod.json" >/dev/null
$PY - "$OUT/mod.json" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
d["nvml"]["gpus"][1]["nvlinks"][5]["active"] = False  # one NVLink down on GPU1
json.dump(d, open(sys.argv[1], "w"), indent=1)
PYEOF
cp "$OUT/daemon.yaml" "$OUT/daemon2.yaml"; printf 'topology: {snapshot: %s}\n' "$OUT/mod.json" >> "$OUT/daemon2.yaml"
$PY bench/notify_listen.py /tmp/nccltune-notify.sock > "$OUT/notify.log" 2>&1 &
listener=$!
sleep 0.5
NOTIFY_SOCKET=/tmp/nccltune-notify.sock $PY -m nccltune daemon --config "$OUT/daemon.yaml" --state-dir "$state" \
  --poll-interval 3 > "$OUT/daemon.log" 2>&1 &
pid=$!
wait_for() { for _ in $(seq 1 "$2"); do grep -q "$1" "$OUT/daemon.log" && return 0; sleep 1; done; echo "timed out waiting for $1"; return 1; }
wait_for "verify passed\|verify: bus" 200
cp "$state/nccl.env" "$OUT/nccl.env.1"
cp "$OUT/daemon2.yaml" "$OUT/daemon.yaml"; kill -HUP $pid
wait_for "republished a safe" 60; cp "$state/nccl.env" "$OUT/nccl.env.safe"
n=0; for _ in $(seq 1 200); do n=$(grep -c "verify passed\|verify: bus" "$OUT/daemon.log"); [ "$n" -ge 2 ] && break; sleep 1; done
cp "$state/nccl.env" "$OUT/nccl.env.2"; cp "$state/metrics/nccltune.prom" "$OUT/" 2>/dev/null
kill -TERM $pid; wait $pid; echo "daemon exit status $?" | tee -a "$OUT/daemon.log"
sleep 0.5; kill $listener 2>/dev/null
echo "--- daemon log"; cut -c1-250 "$OUT/daemon.log"; echo "--- notify"; cat "$OUT/notify.log"
