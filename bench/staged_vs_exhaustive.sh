#!/usr/bin/env bash
# The staged search against the exhaustive grid over the same variables: trials, wall time,
# what each chose, and the two choices measured head to head against NCCL's defaults.
#   OUT=/tmp/x bash bench/staged_vs_exhaustive.sh [--demo]
# The space is kept small enough for the grid to finish in minutes (a YAML config below).
set -u
OUT=${OUT:-/tmp/nccltune-staged-vs-exhaustive}
PY=${PY:-python3}
DEMO=${1:-}
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD
cat > "$OUT/space.yaml" <<'YAML'
sweep:
  variables:
    NCCL_ALGO: [Ring, Tree]
    NCCL_PROTO: [Simple, LL]
    NCCL_MIN_NCHANNELS: ["32"]
  exclude: [NCCL_MAX_NCHANNELS, NCCL_BUFFSIZE, NCCL_NTHREADS, NCCL_CUMEM_ENABLE, NCCL_NVLS_ENABLE]
  max_finalists: 2
YAML
for mode in staged exhaustive; do
  flag=""; [ "$mode" = exhaustive ] && flag=--exhaustive
  s0=$(date +%s)
  $PY -m nccltune sweep $DEMO $flag --config "$OUT/space.yaml" --state-dir "$OUT/$mode" --json \
    > "$OUT/$mode.json" 2> "$OUT/$mode.err"
  echo "$mode: rc=$? wall=$(( $(date +%s) - s0 )) s"
done
$PY - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
docs = {m: json.load(open(f"{out}/{m}.json")) for m in ("staged", "exhaustive")}
for m, d in docs.items():
    gain = [r["ratio"] for r in d["sizes"]]
    print(f"{m:10} trials {d['trials']:3}  wall {d['wall_s']:6.1f} s  chose: {d['chosen']}")
    print(f"{'':10} tuned/default per size: {' '.join(f'{g:.3f}' for g in gain)}")
PYEOF
envs=()
for m in staged exhaustive; do
  e=$($PY -c "import json,sys; d=json.load(open('$OUT/$m.json')); print(' '.join(f'{k}={v}' for k,v in sorted(d['published_env'].items())))")
  envs+=(--env "$e")
done
if [ -z "$DEMO" ]; then
  $PY bench/compare_envs.py --repeats 3 "${envs[@]}" --json "$OUT/head_to_head.json"
else
  $PY bench/compare_envs.py --backend gloo --repeats 2 --sizes 4096,65536,1048576,4194304 "${envs[@]}"
fi
