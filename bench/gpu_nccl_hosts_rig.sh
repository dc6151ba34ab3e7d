#!/usr/bin/env bash
# N NCCL hosts on ONE GPU, through nccltune's real multi-node path: the coordinator
# (`nccltune sweep --nodes N`) and each joiner (`nccltune sweep --join`) are processes of their own,
# each with its own state directory and NCCL_HOSTID (NCCL takes ranks with different host ids for
# different nodes and joins them over its socket transport), on 127.0.0.1, with one multi-node key.
# Then: export on each node, `fleet decide`, `nccltune apply` into a fresh state directory, a torch
# job of N hosts started through `nccltune exec` and through launchers/nccltune-torchrun with NCCL's
# TUNING log checked against the table by verify's own rule (nccl.ran.what_ran, bench/rig_check.py),
# a job of another shape (OTHER hosts: NCCL's own choices), `nccltune verify`, then a stale table
# and a malformed one.
#
# The ranks TIME-SHARE ONE GPU: every number here is an artifact of that, never a performance
# result, and nothing measured this way may be published on a real node.
#
#   OUT=/tmp/x bash bench/gpu_nccl_hosts_rig.sh [--demo] [--hosts N] [--other M]
# --demo: the same steps on the CPU (gloo, one rank per node, the recorded 1x H200 VM), without the
# parts that read NCCL's log. $OUT receives summary.txt, profile-ranks-time-sharing-one-gpu.json and
# rig-logs-ranks-time-sharing-one-gpu.tar.gz (the logs, the configuration, every document).
set -u
cd "$(dirname "$0")/.."
DEMO=0 HOSTS=2 OTHER=4
while [ $# -gt 0 ]; do
  case $1 in
    --demo) DEMO=1 ;;
    --hosts) HOSTS=$2; shift ;;
    --other) OTHER=$2; shift ;;
    *) echo "usage: $0 [--demo] [--hosts N] [--other M]" >&2; exit 2 ;;
  esac
  shift
done
OUT=${OUT:-/tmp/nccltune-nccl-hosts-rig}
mkdir -p "$OUT"
. bench/gpu_env.sh
export PYTHONPATH=$PWD
PY=${PY:-python3}
PATH="$(dirname "$($PY -c 'import sys; print(sys.executable)')"):$PATH"  # torchrun of that interpreter
W=$(mktemp -d /tmp/nccltune-rig.XXXXXX)
LOGS=$W/logs
mkdir -p "$LOGS"
exec > >(tee "$OUT/summary.txt") 2>&1
NOTE="ranks time-sharing ONE GPU: numbers prove mechanisms, never speed; never publish them on a real node"
rstep() { step "$* [$NOTE]"; }
status=0
fail() { echo "FAILED: $*"; status=1; }
if [ "$DEMO" = 1 ]; then
  DEMO_ARGS=(--demo "$PWD/tests/fixtures/h200x1-vm.json") BACKEND=gloo
  NOTE="CPU demo, gloo: $NOTE"
else
  DEMO_ARGS=() BACKEND=nccl
fi
echo "rig: $HOSTS NCCL hosts (other shape: $OTHER), backend $BACKEND, work directory $W"
echo "NOTE: $NOTE"
port() { echo $((20000 + RANDOM % 20000)); }

rstep "key and config"
$PY -m nccltune keygen "$W/multinode.key" || fail keygen
CFG=$W/rig.yaml
$PY - "$CFG" "$W/multinode.key" <<'EOF'
import sys

import yaml

from nccltune.sweep.plan import PER_SIZE_VARS
from nccltune.sweep.space import CATALOGUE

# Algorithm and protocol only (per size on the GPU: the tuner table; no channel candidates): a short sweep.
keep = set(PER_SIZE_VARS) - {"NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"}
weights = {"64KiB": 1, "1MiB": 1, "4MiB": 1}
cfg = {"sweep": {"profile": "rig", "profiles": {"rig": {"all_reduce": dict(weights), "all_gather": dict(weights)}},
                 "baseline_repeats": 2, "finalist_repeats": 2, "max_finalists": 1,
                 "exclude": sorted(n for n, t in CATALOGUE.items() if t.kind == "perf" and n not in keep)},
       "bench": {"min_bytes": "64KiB", "max_bytes": "64MiB", "factor": 4, "warmup_iters": 2, "iters": 5,
                 "trial_timeout_s": 240},
       "multinode": {"key_file": sys.argv[2]}}
open(sys.argv[1], "w").write(yaml.safe_dump(cfg))
EOF
cat "$CFG"

rstep "sweep: $HOSTS hosts, coordinator host0 and $((HOSTS - 1)) joiner(s), each its own state and NCCL_HOSTID"
P=$(port)
jpids=()
for ((h = 1; h < HOSTS; h++)); do
  NCCL_HOSTID=rig-host$h timeout 1200 $PY -m nccltune sweep --join 127.0.0.1:$P "${DEMO_ARGS[@]}" --config "$CFG" \
    --state-dir "$W/host$h" --python "$PY" > "$LOGS/join-host$h.out" 2> "$LOGS/join-host$h.err" &
  jpids+=($!)
done
s0=$(date +%s)
NCCL_HOSTID=rig-host0 timeout 1200 $PY -m nccltune sweep "${DEMO_ARGS[@]}" --nodes "$HOSTS" --launcher torchrun \
  --rdzv-endpoint 127.0.0.1:$P --config "$CFG" --state-dir "$W/host0" --python "$PY" --json \
  > "$LOGS/sweep-host0.json" 2> "$LOGS/sweep-host0.err" || fail "coordinator sweep (tail: $(tail -3 "$LOGS/sweep-host0.err"))"
echo "coordinator: wall $(( $(date +%s) - s0 )) s"
for i in "${!jpids[@]}"; do
  wait "${jpids[$i]}" || fail "joiner host$((i + 1))"
  cat "$LOGS/join-host$((i + 1)).out"
done
grep "trial " "$LOGS/sweep-host0.err" | tail -40
$PY - "$LOGS/sweep-host0.json" <<'EOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except ValueError:
    sys.exit("no sweep document")
print("chosen:", d.get("chosen"), "| published on this node:", d.get("published"))
print("not published:", d.get("not_published"))
for r in d.get("sizes", []):
    print(f"  {r['collective']:>10} {r['size_bytes']:>9} B  defaults {r['default_busbw_gbps']} GB/s "
          f"(noise {r['default_noise_pct']}%)  chosen {r['tuned_busbw_gbps']} GB/s  "
          f"{r.get('default_algo_proto')} -> {r.get('tuned_algo_proto')}")
print("tuner table of the run:", json.dumps(d.get("tuner_table"), indent=1))
EOF

rstep "export on each node, fleet decide"
exports=()
for ((h = 0; h < HOSTS; h++)); do
  if $PY -m nccltune export "${DEMO_ARGS[@]}" --config "$CFG" --state-dir "$W/host$h" --out "$W/export-host$h.json" \
      2> "$LOGS/export-host$h.err"; then
    runs=$($PY -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["runs"]))' "$W/export-host$h.json")
    echo "host$h: export with $runs run(s)"
    [ "$runs" -gt 0 ] && exports+=("$W/export-host$h.json")
  else
    echo "host$h: no export: $(tail -1 "$LOGS/export-host$h.err") (a joining node stores no run: the coordinator does)"
  fi
done
$PY -m nccltune fleet decide "${exports[@]}" --out "$W/profile.json" --config "$CFG" || fail "fleet decide"
[ -f "$W/profile.json" ] && cp "$W/profile.json" "$OUT/profile-ranks-time-sharing-one-gpu.json"
$PY - "$W/profile.json" <<'EOF'
import json, sys
p = json.load(open(sys.argv[1]))
print("profile: shape", p["job_shape"]["label"], "| env", p["env"], "| chosen", p["chosen"])
for e in p.get("tuner_table") or []:
    print("  entry:", e)
EOF

rstep "apply the profile into a fresh state directory"
APPLIED=$W/applied
$PY -m nccltune apply "$W/profile.json" "${DEMO_ARGS[@]}" --config "$CFG" --state-dir "$APPLIED" --python "$PY" \
  || fail "apply"
$PY -m nccltune env --state-dir "$APPLIED" --config "$CFG" --as-published --format json > "$W/published.json" \
  || fail "env"
cat "$W/published.json"

# job LABEL N HOW [VAR=VALUE...]: a torch job of N hosts on the GPU, started through `nccltune exec`
# (HOW=exec) or launchers/nccltune-torchrun (HOW=torchrun, one agent per host, static rendezvous);
# the variables go to every process and win over what is published.
job() {
  local label=$1 n=$2 how=$3 p r pids=() ok=1
  shift 3
  p=$(port)
  rstep "job $label: $n hosts through $how $*"
  for ((r = 0; r < n; r++)); do
    local dbg=()
    [ "$BACKEND" = nccl ] && dbg=(NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV,TUNING
                                  NCCL_DEBUG_FILE="$LOGS/$label.rank$r.nccl.log")
    if [ "$how" = exec ]; then
      env "$@" "${dbg[@]}" NCCL_HOSTID=rig-job-host$r RANK=$r WORLD_SIZE=$n LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
        MASTER_ADDR=127.0.0.1 MASTER_PORT=$p RIG_BACKEND=$BACKEND \
        timeout 300 $PY -m nccltune exec --state-dir "$APPLIED" --config "$CFG" -- $PY bench/rig_job.py \
        > "$LOGS/$label.rank$r.out" 2>&1 &
    else
      env "$@" "${dbg[@]}" NCCL_HOSTID=rig-job-host$r NCCLTUNE_ENV_FILE="$APPLIED/nccl.sh" RIG_BACKEND=$BACKEND \
        timeout 300 launchers/nccltune-torchrun --nnodes "$n" --nproc-per-node 1 --node-rank $r \
        --master-addr 127.0.0.1 --master-port $p bench/rig_job.py > "$LOGS/$label.rank$r.out" 2>&1 &
    fi
    pids+=($!)
  done
  for r in "${!pids[@]}"; do wait "${pids[$r]}" || { ok=0; tail -3 "$LOGS/$label.rank$r.out"; }; done
  grep -h "correct at" "$LOGS/$label".rank*.out
  [ "$ok" = 1 ] || fail "job $label"
}

# check LABEL EXPECT [VAR=VALUE...]: what NCCL ran in job LABEL, by verify's rule, with the job's
# environment (published, then the overrides); EXPECT: pass, or the finding code it must give.
check() {
  local label=$1 expect=$2
  shift 2
  [ "$BACKEND" = nccl ] || { echo "(CPU demo: no NCCL log to read for $label)"; return; }
  $PY -c 'import json, sys
env = json.load(open(sys.argv[1]))
env = env.get("env", env) if isinstance(env, dict) else {}
env.update(a.split("=", 1) for a in sys.argv[2:])
print(json.dumps(env))' "$W/published.json" "$@" > "$W/$label.env.json"
  grep -h "set by environment\|TUNER/Plugin\|nccltune tuner" "$LOGS/$label.rank0.nccl.log" | sort -u | head -12
  $PY bench/rig_check.py "$LOGS/$label.rank0.nccl.log" "$W/$label.env.json" > "$W/$label.check" 2>&1
  local rc=$?
  cat "$W/$label.check"
  if [ "$expect" = pass ]; then
    [ $rc = 0 ] || fail "$label: NCCL did not run what was published"
  else
    grep -q "\"code\": \"$expect\"" "$W/$label.check" || fail "$label: expected the finding $expect"
  fi
}

job exec-${HOSTS}hosts "$HOSTS" exec
check exec-${HOSTS}hosts pass
job torchrun-${HOSTS}hosts "$HOSTS" torchrun
check torchrun-${HOSTS}hosts pass
job other-shape-${OTHER}hosts "$OTHER" exec
check other-shape-${OTHER}hosts pass

rstep "nccltune verify on the applied state"
$PY -m nccltune verify "${DEMO_ARGS[@]}" --config "$CFG" --state-dir "$APPLIED" --json > "$W/verify.json" \
  2> "$LOGS/verify.err"
echo "verify rc=$?"; cat "$W/verify.json"

TABLE=$($PY -c 'import json, sys
d = json.load(open(sys.argv[1])); print(d.get("env", d).get("NCCLTUNE_TUNER_TABLE", ""))' "$W/published.json" 2>/dev/null)
TUNED=()
if [ -z "$TABLE" ] && [ "$BACKEND" = nccl ]; then
  # The class profile holds no table entries (one node's screening runs are no evidence for fleet
  # decide's rule). The plugin's mechanism is still proven, with a table written here for the shape
  # HOSTS x 1 and the plugin built on this node: Tree/Simple for all-reduce, Ring/LL for all-gather
  # (NCCL's defaults here are Ring, LL only for small messages).
  rstep "a hand-written table for ${HOSTS}x1 (not a tuning result), nccltune's plugin built on this node"
  FP=0123abcd4567ef89
  TABLE=$W/hand.table
  NCCL_V=$($PY -c 'import torch; print(".".join(map(str, torch.cuda.nccl.version())))')  # the table's section
  printf 'nccltune-tuner-table 2\nfingerprint %s\nnccl %s\nallreduce 0 1099511627776 %s %s 1 tree simple 0\nallgather 0 1099511627776 %s %s 1 ring ll 0\nend 2\n' \
    "$FP" "$NCCL_V" "$HOSTS" "$HOSTS" "$HOSTS" "$HOSTS" > "$TABLE"
  cat "$TABLE"
  PLUGIN=$($PY -c 'import sys
from pathlib import Path
from nccltune.tuner.build import build_plugin
r = build_plugin(Path(sys.argv[1]))
print(r.path if r.ok else "", end="")' "$W/plugin") || true
  if [ -n "$PLUGIN" ]; then
    TUNED=(NCCL_TUNER_PLUGIN="$PLUGIN" NCCLTUNE_TUNER_TABLE="$TABLE" NCCLTUNE_TUNER_FINGERPRINT=$FP)
    job table-${HOSTS}hosts "$HOSTS" exec "${TUNED[@]}"
    check table-${HOSTS}hosts pass "${TUNED[@]}"
    job table-other-shape-${OTHER}hosts "$OTHER" exec "${TUNED[@]}"
    check table-other-shape-${OTHER}hosts pass "${TUNED[@]}"
  else
    fail "the tuner plugin did not build"
  fi
fi
if [ -n "$TABLE" ] && [ "$BACKEND" = nccl ]; then
  job stale-${HOSTS}hosts "$HOSTS" exec "${TUNED[@]}" NCCLTUNE_TUNER_FINGERPRINT=00000000deadbeef
  check stale-${HOSTS}hosts table_stale "${TUNED[@]}" NCCLTUNE_TUNER_FINGERPRINT=00000000deadbeef
  { cat "$TABLE"; echo "allreduce zero many"; } > "$W/malformed.table"
  job malformed-${HOSTS}hosts "$HOSTS" exec "${TUNED[@]}" NCCLTUNE_TUNER_TABLE="$W/malformed.table"
  check malformed-${HOSTS}hosts table_malformed "${TUNED[@]}" NCCLTUNE_TUNER_TABLE="$W/malformed.table"
else
  echo "no tuner table (CPU demo, or no plugin): stale and malformed not run"
fi

rstep "done (status $status)"
cp "$CFG" "$LOGS/"
tar -C "$W" -czf "$OUT/rig-logs-ranks-time-sharing-one-gpu.tar.gz" logs $(cd "$W" && ls ./*.json ./*.check 2>/dev/null)
exit $status
