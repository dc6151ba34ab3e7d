#!/usr/bin/env bash
# `nccltune verify` on a node with ONE GPU, on real NCCL: what NCCL runs for the class profile's
# shape 2 x 1, proven from NCCL's own log of 2 NCCL hosts formed on the one GPU (each check rank its
# own NCCL_HOSTID, set by verify in its check processes only).
#
#  1. The rig's loop (bench/gpu_nccl_hosts_rig.sh, shortened): `sweep --plan` for 2 hosts, then the
#     2-host sweep (coordinator and joiner as processes of their own, each its own NCCL_HOSTID and
#     state), the plan's ETA against the sweep's wall time; export, `fleet decide` -> a class profile
#     for 2x1. Where it holds no table entry (one node's screening runs are no evidence), a
#     hand-written 2x1 table goes into the profile, labelled as such: not a tuning result.
#  2. `nccltune apply` of the profile into a fresh state directory (the plugin built on this node),
#     then `nccltune verify` and `verify --quick`, each timed with date +%s.%N around it, and both
#     with --json.
#  3. The published table made stale (its fingerprint line) and malformed (a line after 'end') in
#     place: verify must fail with table_stale and table_malformed.
#
# The sweep's ranks run under the CUDA MPS control daemon this script starts (bench/gpu_env.sh
# mps_start; where it is refused they time-slice); verify starts its own for its check ranks
# (trials/mps.py) after this one is stopped, and its JSON says which it got (one_gpu.gpu_sharing).
# Either way these are NCCL hosts on ONE GPU over loopback: every number proves a mechanism, never a
# node's speed (never to be published on a real node), and every line of the summary says so, as
# does every file name (SUFFIX: mps-one-gpu, or ranks-time-sharing-one-gpu where MPS was refused).
#
#   OUT=/tmp/x [JSON_ONLY=1] bash bench/gpu_verify_one_gpu.sh [--demo]
# --demo: the same commands on the CPU (gloo, the recorded 1x H200 VM, the interpreter on PATH): no
# NCCL log and no table published there, so it checks the script, never NCCL.
# $OUT receives (flat, 8 files at most): summary-SUFFIX.txt, plan-SUFFIX.json, profile-SUFFIX.json,
# verify-SUFFIX.json, verify-quick-SUFFIX.json, verify-stale-SUFFIX.json, verify-malformed-SUFFIX.json,
# logs-SUFFIX.tar.gz (the sweep's and the checks' logs, rank 0's NCCL logs).
# Exit 0 when every step did what it must.
set -u
cd "$(dirname "$0")/.."
. bench/gpu_env.sh
DEMO=0
case ${1:-} in
  --demo) DEMO=1 ;;
  "") ;;
  *) echo "usage: $0 [--demo]" >&2; exit 2 ;;
esac
OUT=${OUT:-/tmp/nccltune-verify-one-gpu}
mkdir -p "$OUT"
if [ "$DEMO" = 1 ]; then
  PY=${PY:-$(command -v python3)} DEMO_ARGS=(--demo "$PWD/tests/fixtures/h200x1-vm.json")
else
  PY=${PY:-$(command -v python3)} DEMO_ARGS=()
fi
# The checkout is not installed on the device: nccltune and its dependencies from here.
export PYTHONPATH=$PWD:$PWD/.devdeps
PATH="$(dirname "$PY"):$PATH"  # torchrun of that interpreter
unset NCCL_HOSTID  # each process below gets its own; verify sets its check ranks' itself
W=$(mktemp -d /tmp/nccltune-verify1.XXXXXX)
LOGS=$W/logs
mkdir -p "$LOGS"
SUFFIX=ranks-time-sharing-one-gpu
TAG="[ranks time-sharing ONE GPU: numbers prove mechanisms, never speed]"
if [ "$DEMO" = 1 ]; then
  TAG="[CPU demo, gloo: ranks time-sharing the CPU, numbers prove nothing about NCCL]"
elif mps_start "$W/mps"; then
  SUFFIX=mps-one-gpu
  TAG="[NCCL hosts on ONE GPU under CUDA MPS, loopback: numbers prove mechanisms, never a node's speed]"
fi
trap mps_stop EXIT  # an MPS server left running holds the GPU
exec > >(sed -u "s|\$|  $TAG|" | tee "$OUT/summary-$SUFFIX.txt") 2>&1
echo "the sweep's ranks: $SHARING"
status=0
fail() { echo "FAILED: $*"; status=1; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
port() { echo $((20000 + RANDOM % 20000)); }
nt() { timeout "${LIMIT:-300}" "$PY" -m nccltune "$@"; }
echo "work directory $W, interpreter $PY"
"$PY" -c 'import torch
try:
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
except (AttributeError, RuntimeError):
    nccl = "none (CPU build)"
print("torch", torch.__version__, "NCCL", nccl)'
nvidia-smi -L 2>/dev/null | head -2

step "key and config"
nt keygen "$W/multinode.key" > /dev/null || fail keygen
CFG=$W/rig.yaml
"$PY" - "$CFG" "$W/multinode.key" <<'EOF'
import sys

import yaml

from nccltune.sweep.plan import PER_SIZE_VARS
from nccltune.sweep.space import CATALOGUE

# Algorithm and protocol per size only (the tuner table; no channel candidates), 64 KiB-4 MiB:
# the rig's sweep, short enough for the whole script to end within about 8 minutes.
keep = set(PER_SIZE_VARS) - {"NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"}
weights = {"64KiB": 1, "1MiB": 1, "4MiB": 1}
cfg = {"sweep": {"profile": "rig", "profiles": {"rig": {"all_reduce": dict(weights), "all_gather": dict(weights)}},
                 "baseline_repeats": 2, "finalist_repeats": 2, "max_finalists": 1,
                 "exclude": sorted(n for n, t in CATALOGUE.items() if t.kind == "perf" and n not in keep)},
       "bench": {"min_bytes": "64KiB", "max_bytes": "4MiB", "factor": 4, "warmup_iters": 2, "iters": 5,
                 "trial_timeout_s": 120},
       "multinode": {"key_file": sys.argv[2]}}
open(sys.argv[1], "w").write(yaml.safe_dump(cfg))
EOF

step "sweep --plan for 2 NCCL hosts, then the 2-host sweep (coordinator host0, joiner host1)"
P=$(port)
SWEEP_ARGS=("${DEMO_ARGS[@]}" --nodes 2 --launcher torchrun --rdzv-endpoint 127.0.0.1:$P --config "$CFG" --python "$PY")
NCCL_HOSTID=rig-host0 nt sweep --plan --json "${SWEEP_ARGS[@]}" --state-dir "$W/host0" \
  > "$OUT/plan-$SUFFIX.json" 2> "$LOGS/plan.err" || fail "sweep --plan"
ETA=$("$PY" -c 'import json, sys; e = json.load(open(sys.argv[1]))["estimate"]; print(e["seconds"], e["trials"])' \
  "$OUT/plan-$SUFFIX.json" 2>/dev/null) || ETA="? ?"
NCCL_HOSTID=rig-host1 LIMIT=600 nt sweep --join 127.0.0.1:$P "${DEMO_ARGS[@]}" --config "$CFG" --state-dir "$W/host1" --python "$PY" \
  > "$LOGS/join-host1.out" 2> "$LOGS/join-host1.err" &
jpid=$!
t0=$(now)
NCCL_HOSTID=rig-host0 LIMIT=600 nt sweep --json "${SWEEP_ARGS[@]}" --state-dir "$W/host0" \
  > "$LOGS/sweep-host0.json" 2> "$LOGS/sweep-host0.err" || fail "coordinator sweep: $(tail -2 "$LOGS/sweep-host0.err")"
t1=$(now)
wait "$jpid" || fail "joiner"
grep "trial " "$LOGS/sweep-host0.err" | tail -20
TRIALS=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("trials"))' "$LOGS/sweep-host0.json" \
  2>/dev/null)
set -- $ETA
echo "plan ETA: $1 s for ~$2 trial(s); actual sweep wall time: $(secs "$t0" "$t1") s for ${TRIALS:-?} trial(s)" \
  "(ratio actual/ETA: $(awk -v a="$(secs "$t0" "$t1")" -v e="$1" 'BEGIN { if (e > 0) printf "%.2f", a / e; else print "?" }'))"

step "export, fleet decide: the class profile for 2x1"
nt export "${DEMO_ARGS[@]}" --config "$CFG" --state-dir "$W/host0" --out "$W/export-host0.json" 2> "$LOGS/export.err" || fail export
nt fleet decide "$W/export-host0.json" --out "$W/profile.json" --config "$CFG" 2> "$LOGS/decide.err" \
  || fail "fleet decide: $(tail -2 "$LOGS/decide.err")"
"$PY" - "$W/profile.json" <<'EOF' || fail "the profile"
import json
import sys

path = sys.argv[1]
p = json.load(open(path))
print("profile: shape", p["job_shape"]["label"], "| env", p["env"], "| chosen", p["chosen"],
      "|", len(p["tuner_table"]), "table entries from fleet decide")
if not p["tuner_table"]:
    # One node's single screening runs are no evidence for fleet decide's rule: the mechanism is still
    # proven, with a table written here for the shape 2x1 (NOT a tuning result): Tree/Simple for
    # all-reduce, Ring/LL for all-gather (NCCL's own choice here is Ring/Simple at these sizes).
    entry = {"min_bytes": 0, "max_bytes": 1 << 40, "nnodes": 2, "nranks": 2, "ranks_per_node": 1, "channels": None}
    p["tuner_table"] = [{"collective": "allreduce", **entry, "algo": "tree", "proto": "simple"},
                        {"collective": "allgather", **entry, "algo": "ring", "proto": "ll"}]
    p["chosen"] = "HAND-WRITTEN 2x1 TABLE (not a tuning result)"
    json.dump(p, open(path, "w"), indent=1)
    print("profile: no table entry from the sweep; a HAND-WRITTEN 2x1 table put in (not a tuning result)")
for e in p["tuner_table"]:
    print("  entry:", {k: e[k] for k in ("collective", "min_bytes", "max_bytes", "nnodes", "ranks_per_node",
                                         "algo", "proto")})
EOF
cp "$W/profile.json" "$OUT/profile-$SUFFIX.json"

step "apply the profile into a fresh state directory"
APPLIED=$W/applied
nt apply "$W/profile.json" "${DEMO_ARGS[@]}" --config "$CFG" --state-dir "$APPLIED" --python "$PY" || fail apply
nt env --state-dir "$APPLIED" --config "$CFG" --as-published --format json > "$W/published.json" || fail env
"$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); print("published:", json.dumps(d.get("env", d)))' \
  "$W/published.json"
TABLE=$("$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); print(d.get("env", d).get("NCCLTUNE_TUNER_TABLE", ""))' \
  "$W/published.json")
if [ -z "$TABLE" ] && [ "$DEMO" = 1 ]; then
  echo "CPU demo: no tuner table published (gloo never loads NCCL's tuner)"
elif [ -z "$TABLE" ]; then
  fail "no tuner table published (plugin not built?)"
fi

# verify_run NAME EXPECT [ARGS...]: `nccltune verify ARGS` on the applied state, timed around it; its
# output in $LOGS/NAME.out; EXPECT is the exit status it must have (0 pass, 1 fail).
verify_run() {
  local name=$1 expect=$2 s e rc f
  shift 2
  touch "$LOGS/$name.stamp"
  s=$(now)
  nt verify "${DEMO_ARGS[@]}" --config "$CFG" --state-dir "$APPLIED" --python "$PY" "$@" > "$LOGS/$name.out" 2> "$LOGS/$name.err"
  rc=$?
  e=$(now)
  # The check ranks' NCCL logs (verify/<shape>/trial-001/rank/), kept before the next verify reuses the place.
  find "$APPLIED/verify" -name 'nccl.*.log' -newer "$LOGS/$name.stamp" -size -8M 2>/dev/null | while read -r f; do
    cp "$f" "$LOGS/$name.$(basename "$(dirname "$(dirname "$(dirname "$f")")")").$(basename "$f")"
  done
  echo "verify $* -> exit $rc, wall time around it $(secs "$s" "$e") s (date +%s.%N)"
  [ "$rc" = "$expect" ] || fail "verify $*: exit $rc, expected $expect ($(tail -2 "$LOGS/$name.err"))"
}
# code FILE: the verdict code of a verify --json document
code() { "$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); print(d["code"], "|", d["reason"])' "$1" \
  2>/dev/null || echo "no verify document"; }

# verify starts its own MPS daemon for its check ranks, as it does on a node: this one goes first.
[ "$DEMO" = 1 ] || mps_stop
step "nccltune verify (full), then verify --quick, on the applied state"
if [ -z "${JSON_ONLY:-}" ]; then  # JSON_ONLY=1: the two --json runs alone (the same checks, less device time)
  verify_run verify 0
  cat "$LOGS/verify.out"
  verify_run verify-quick 0 --quick
  cat "$LOGS/verify-quick.out"
fi
verify_run verify-json 0 --json
cp "$LOGS/verify-json.out" "$OUT/verify-$SUFFIX.json"
echo "verify --json: $(code "$LOGS/verify-json.out")"
verify_run verify-quick-json 0 --quick --json
cp "$LOGS/verify-quick-json.out" "$OUT/verify-quick-$SUFFIX.json"
echo "verify --quick --json: $(code "$LOGS/verify-quick-json.out")"
"$PY" - "$LOGS/verify-json.out" "$LOGS/verify-quick-json.out" <<'EOF'
import json
import sys

for path in sys.argv[1:]:
    try:
        d = json.load(open(path))
    except ValueError:
        continue
    one = d.get("one_gpu") or {}
    print(f"{'quick' if one.get('quick') else 'full'}: {one.get('note')}; verify's own wall time {one.get('wall_s')} s; "
          f"the check ranks: {(one.get('gpu_sharing') or {}).get('label')}")
    for s in one.get("shapes", []):
        ran = s.get("nccl_ran") or {}
        print(f"  {s['label']}: {s['status']}, sizes {s['sizes']}, tuner {ran.get('tuner')}, table {ran.get('table')}, "
              f"{ran.get('cells_checked')} choice(s) compared, findings {[f['code'] for f in ran.get('findings', [])]}")
EOF
if [ -z "$TABLE" ]; then
  echo "no published table: stale and malformed not run"
else
cp "$TABLE" "$W/table.orig"

step "the published table made STALE in place (its fingerprint line): verify must say table_stale"
sed -i 's/^fingerprint .*/fingerprint 00000000deadbeef/' "$TABLE"
verify_run verify-stale 1 --json
cp "$LOGS/verify-stale.out" "$OUT/verify-stale-$SUFFIX.json"
echo "stale: $(code "$LOGS/verify-stale.out")"
grep -q '"code": "table_stale"' "$LOGS/verify-stale.out" || fail "the stale table was not reported as table_stale"
cp "$W/table.orig" "$TABLE"

step "the published table made MALFORMED in place (a line after 'end'): verify must say table_malformed"
echo "allreduce zero many" >> "$TABLE"
verify_run verify-malformed 1 --json
cp "$LOGS/verify-malformed.out" "$OUT/verify-malformed-$SUFFIX.json"
echo "malformed: $(code "$LOGS/verify-malformed.out")"
grep -q '"code": "table_malformed"' "$LOGS/verify-malformed.out" \
  || fail "the malformed table was not reported as table_malformed"
cp "$W/table.orig" "$TABLE"
fi

step "done (status $status)"
# the checks' NCCL logs, the sweep's and every command's output, the config and the published set
cp "$CFG" "$W/published.json" "$LOGS/" 2>/dev/null
tar -C "$W" -czf "$OUT/logs-$SUFFIX.tar.gz" logs || fail "the logs' archive"
ls "$OUT"
exit $status
