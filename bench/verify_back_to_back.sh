#!/usr/bin/env bash
# Back-to-back `nccltune verify --demo` on one demo sweep's state, with the smallest repeats the
# config allows: does the verdict flip between runs that measure the same thing?
#   bash bench/verify_back_to_back.sh [RUNS]
# One line per run: verdict, code, reason, then (size, drift %, allowed %) per size.
set -u
cd "$(dirname "$0")/.."
NT=${NCCLTUNE:-.venv/bin/nccltune}
W=${W:-/tmp/nccltune-verify-back-to-back}
RUNS=${1:-8}
rm -rf "$W"; mkdir -p "$W"
echo 'sweep: {baseline_repeats: 2, finalist_repeats: 1, max_finalists: 1}' > "$W/c.yaml"
$NT sweep --demo --config "$W/c.yaml" --state-dir "$W/s" -q > "$W/sweep.txt" 2>&1; echo "sweep rc=$?"
grep -i "publish\|defaults" "$W/sweep.txt" | tail -2
for i in $(seq 1 "$RUNS"); do
  rm -rf "$W/v"; cp -a "$W/s" "$W/v"  # each verify on its own copy: none sees another's run
  $NT verify --demo --config "$W/c.yaml" --state-dir "$W/v" --json > "$W/v$i.json" 2>/dev/null
  python3 - "$W/v$i.json" "$i" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
rows = [(r["size_bytes"], round(r.get("drift_pct") or 0, 1), round(r.get("allowed_pct") or 0, 1)) for r in d.get("sizes", [])]
print(f"run {sys.argv[2]}", "PASS" if d["passed"] else "FAIL", d.get("code"), "|", d["reason"][:90], rows)
PY
done
