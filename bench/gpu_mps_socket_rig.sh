#!/usr/bin/env bash
# nccltune's real multi-node sweep of NCCL's socket transport, N NCCL hosts on ONE GPU under CUDA
# MPS, against an exhaustive grid of the socket knobs measured in the same session.
#
# With the MPS control daemon up (bench/gpu_env.sh's mps_start; where it is refused the ranks
# time-slice and every line says so) the ranks of the N hosts run concurrently and NCCL's socket
# transport over loopback is a real tuning problem: NCCL_SOCKET_NTHREADS and NCCL_NSOCKS_PERTHREAD
# change the bandwidth by 2x at 1 GiB. The coordinator (`nccltune sweep --nodes N`) and each joiner
# (`nccltune sweep --join`) are processes of their own, each its own state directory and
# NCCL_HOSTID, on 127.0.0.1; the sweep measures only the two socket knobs (every other variable
# excluded, no per-size table), all_reduce from 1 MiB to 1 GiB, every size weighted alike. Then
# `nccltune export` and `fleet decide` (the class profile it would publish), and
# bench/socket_grid.py: the grid {1,2,4} x {1,2,4}, NCCL's defaults and the sweep's choice, in
# interleaved rounds, medians per size.
#
# Loopback is not a NIC: the numbers say what the knobs do to NCCL's socket transport on this
# machine, never a node's network; nothing measured here is published on a real node.
#
# Within 25 trials: 2 runs of the defaults, 6 single values (sockets per thread on top of the best
# number of threads), the topology file alone, at most 1 combination, then the final check within
# the 15 trials left (sweep.max_final_trials): 2 rounds of FINALISTS finalists + the topology file
# alone + the defaults, then rounds only for the finalists still open (one that won, cannot win or
# is clearly behind another is measured no more), looks planned for what the bound lets the leader
# alone reach: 2, 4 and 5 rounds with two finalists (FINALISTS=2, the default), 2, 4 and 6 with one.
#
#   OUT=/tmp/x HOSTS=2 REPEATS=3 [FINALISTS=2] bash bench/gpu_mps_socket_rig.sh
# $OUT receives summary-HOSTSx1.txt, sweep-HOSTSx1.json (the sweep's own document: every trial's
# label, the decision with every finalist's verdict), grid-HOSTSx1.json and profile-HOSTSx1.json.
set -u
cd "$(dirname "$0")/.."
HOSTS=${HOSTS:-2} REPEATS=${REPEATS:-3}
OUT=${OUT:-/tmp/nccltune-mps-rig}
mkdir -p "$OUT"
. bench/gpu_env.sh
export PYTHONPATH=$PWD
PY=${PY:-python3}
PATH="$(dirname "$($PY -c 'import sys; print(sys.executable)')"):$PATH"  # torchrun of that interpreter
W=$(mktemp -d /tmp/nccltune-mps-rig.XXXXXX)
LOGS=$W/logs
mkdir -p "$LOGS"
exec > >(tee "$OUT/summary-${HOSTS}x1.txt") 2>&1
status=0
fail() { echo "FAILED: $*"; status=1; }
mps_start "$W/mps"
trap mps_stop EXIT  # an MPS server left running holds the GPU: the next sweep would find it busy
NOTE="$SHARING; loopback, not a NIC: never a node's tuning"
echo "rig: $HOSTS NCCL hosts on one GPU; $NOTE; work directory $W"

step "config: the socket knobs only, all_reduce 1 MiB..1 GiB [$NOTE]"
$PY -m nccltune keygen "$W/multinode.key" || fail keygen
CFG=$W/rig.yaml
FINALISTS=${FINALISTS:-2} $PY - "$CFG" "$W/multinode.key" <<'EOF'
import os
import sys

import yaml

from nccltune.sweep.plan import SOCKET_KNOBS
from nccltune.sweep.space import CATALOGUE

weights = {"1MiB": 1, "4MiB": 1, "16MiB": 1, "64MiB": 1, "256MiB": 1, "1GiB": 1}
cfg = {"sweep": {"profile": "rig", "profiles": {"rig": {"all_reduce": weights}},
                 "baseline_repeats": 2, "finalist_repeats": 2, "max_finalist_repeats": 8,
                 "max_final_trials": 25 - 10,
                 "max_finalists": int(os.environ.get("FINALISTS", "2")),
                 "exclude": sorted(n for n, t in CATALOGUE.items() if t.kind == "perf" and n not in SOCKET_KNOBS)},
       "bench": {"min_bytes": "1MiB", "max_bytes": "1GiB", "factor": 4, "warmup_iters": 2, "iters": 5,
                 "trial_timeout_s": 300},
       "multinode": {"key_file": sys.argv[2]}}
open(sys.argv[1], "w").write(yaml.safe_dump(cfg))
EOF
cat "$CFG"

step "sweep: $HOSTS hosts, coordinator host0 and $((HOSTS - 1)) joiner(s) [$NOTE]"
P=$((20000 + RANDOM % 20000))
jpids=()
for ((h = 1; h < HOSTS; h++)); do
  NCCL_HOSTID=rig-host$h timeout 1200 $PY -m nccltune sweep --join 127.0.0.1:$P --config "$CFG" \
    --state-dir "$W/host$h" --python "$PY" > "$LOGS/join-host$h.out" 2> "$LOGS/join-host$h.err" &
  jpids+=($!)
done
s0=$(date +%s)
NCCL_HOSTID=rig-host0 timeout 1200 $PY -m nccltune sweep --nodes "$HOSTS" --launcher torchrun \
  --rdzv-endpoint 127.0.0.1:$P --config "$CFG" --state-dir "$W/host0" --python "$PY" --json \
  > "$LOGS/sweep-host0.json" 2> "$LOGS/sweep-host0.err" || fail "coordinator sweep (tail: $(tail -3 "$LOGS/sweep-host0.err"))"
echo "coordinator: wall $(( $(date +%s) - s0 )) s"
cp "$LOGS/sweep-host0.json" "$OUT/sweep-${HOSTS}x1.json"
for i in "${!jpids[@]}"; do wait "${jpids[$i]}" || fail "joiner host$((i + 1))"; done
grep "trial " "$LOGS/sweep-host0.err" | tail -40
$PY - "$LOGS/sweep-host0.json" "$W/chosen.env" <<'EOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except ValueError:
    sys.exit("no sweep document")
print("chosen:", d.get("chosen"), "| trials:", d.get("trials"), "| wall:", d.get("wall_s"))
print("summary:", d.get("summary"))
print("not published:", d.get("not_published"))
decision = d.get("decision") or {}
print("decision:", json.dumps({k: v for k, v in decision.items() if k != "finalists"}, indent=1))
for f in decision.get("finalists", []):
    print(f"  finalist {f['candidate']}: {f['status']}, {f['runs']} run(s), gain {f['gain_pct']}%, "
          f"lower bound {f['lower_gain_pct']}%: {f['reason']}")
for r in d.get("sizes", []):
    print(f"  {r['collective']:>10} {r['size_bytes']:>11} B  defaults {r['default_busbw_gbps']} GB/s "
          f"(noise {r['default_noise_pct']}%)  chosen {r['tuned_busbw_gbps']} GB/s  x{r['ratio']}")
env = dict(t.split("=", 1) for t in str(d.get("chosen") or "").split() if t.split("=")[0] in ("NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD"))
open(sys.argv[2], "w").write(" ".join(f"{k}={v}" for k, v in sorted(env.items())))
EOF
CHOSEN=$(cat "$W/chosen.env" 2>/dev/null)
echo "the sweep's choice of the socket knobs: ${CHOSEN:-none (the defaults)}"

step "export and fleet decide: the class profile it would publish [$NOTE]"
$PY -m nccltune export --config "$CFG" --state-dir "$W/host0" --out "$W/export-host0.json" 2> "$LOGS/export.err" \
  || fail "export: $(tail -1 "$LOGS/export.err")"
$PY -m nccltune fleet decide "$W/export-host0.json" --out "$W/profile.json" --config "$CFG" || fail "fleet decide"
[ -f "$W/profile.json" ] && cp "$W/profile.json" "$OUT/profile-${HOSTS}x1.json" && $PY - "$W/profile.json" <<'EOF'
import json, sys
p = json.load(open(sys.argv[1]))
print("profile:", p["job_shape"]["label"], "| env", p["env"], "| chosen", p["chosen"])
print("verdict:", p["evidence"]["verdict"])
EOF

step "the grid {1,2,4} x {1,2,4}, the defaults and the sweep's choice, $REPEATS interleaved rounds [$NOTE]"
ALSO=()
[ -n "$CHOSEN" ] && ALSO=(--also "$CHOSEN")
$PY bench/socket_grid.py --hosts "$HOSTS" --repeats "$REPEATS" --python "$(command -v "$PY")" "${ALSO[@]}" \
  --json "$OUT/grid-${HOSTS}x1.json" || fail "grid"
echo "NOTE: $NOTE"
exit $status
